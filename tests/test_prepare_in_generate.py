"""benchmarks/studies/prepare_in_generate.py's summary: the prepare's share of the prefill is the time to the first
token it adds over the same process's dense-engine (medians over the rounds), and its device span over that
prefill."""

import pytest

from conftest import load_benchmark


def test_the_share_is_the_added_time_over_the_dense_engines_prefill():
    bench = load_benchmark("prepare_in_generate")
    runs = [{"method": "dense-engine", "prefill_s": t} for t in (2.0, 2.2, 9.0)] + [
        {"method": "openattention", "prefill_s": t, "prepare_s": p, "spans_ms": [p * 500, p * 500]}
        for t, p in ((2.1, 0.3), (2.3, 0.2), (2.25, 0.4))
    ]
    out = bench.config_summary("1x64", runs)
    assert out["median_prefill_s"] == {"dense-engine": 2.2, "openattention": 2.25}  # an outlier does not move it
    assert out["added_s"] == 0.05 and out["added_share"] == round(0.05 / 2.2, 4)
    assert out["span_share"] == round(0.3 / 2.2, 4) and out["layer_prepare_ms_median"] == 150.0
    assert not out["met"]  # 2.3% added, but the prepare's own 13.6% is over the 10%
    fast = bench.config_summary("1x64", [r if r["method"] == "dense-engine" else {**r, "prepare_s": 0.1} for r in runs])
    assert fast["met"] and fast["span_share"] == round(0.1 / 2.2, 4)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["16by16384"], "expected BATCHxCONTEXT of positive integers (e.g. 16x16384), got '16by16384'"),
        (["0x512"], "expected BATCHxCONTEXT of positive integers (e.g. 16x16384), got '0x512'"),
        (["2x512", "--repeats", "0"], "expected a positive number of rounds, got '0'"),
    ],
)
def test_bad_arguments_are_refused_before_anything_loads(argv, message, capsys):
    bench = load_benchmark("prepare_in_generate")
    with pytest.raises(SystemExit) as exit_:
        bench.main(argv)
    assert exit_.value.code == 2 and message in capsys.readouterr().err
