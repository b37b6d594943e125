"""benchmarks/retrieval.py's choice of the layers its recall diagnostic reads."""

from types import SimpleNamespace

from conftest import load_benchmark


def _model(layer_types=None, layers=None):
    return SimpleNamespace(
        config=SimpleNamespace(layer_types=layer_types, num_hidden_layers=layers or len(layer_types))
    )


def test_recall_layers_are_distinct_full_attention_layers_spread_over_the_model():
    retrieval = load_benchmark("retrieval")
    # Gemma-3's pattern: five sliding-window layers, then one full (layers 5, 11, 17 of 18): fewer than six, all of
    # them, once each.
    gemma = ["sliding_attention"] * 5 + ["full_attention"]
    assert retrieval.full_attention_layers(_model(gemma * 3)) == [5, 11, 17]
    # Every layer full (SmolLM2's 30): six, the first and the last among them, evenly spaced.
    assert retrieval.full_attention_layers(_model(layers=30)) == [0, 6, 12, 17, 23, 29]
    assert retrieval.full_attention_layers(_model(layers=30), most=1) == [0]
