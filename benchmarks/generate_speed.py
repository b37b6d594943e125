"""Decode speed where users decode: tokens per second inside ``model.generate``, OpenAttention against the fastest
dense decode in the same run.

    python benchmarks/generate_speed.py                               # on a GPU: the Llama-3.1-8B shape at
                                                                      # 16x16K, 8x32K, 4x64K and 2x128K
    python benchmarks/generate_speed.py --configs 16x16384 8x32768    # one process per configuration
    python benchmarks/generate_speed.py --configs 1x32768 --densities 0.01 --variants specs/openattention.yaml
    python benchmarks/generate_speed.py --combine a.json b.json       # runs saved apart, merged (no measuring)
    python benchmarks/generate_speed.py --tiny --device cpu --configs 2x512 --densities 0.2 --tokens 4  # a smoke test

A Llama-3.1-8B-shaped model (hidden 4096, 32 layers, 32 query / 8 KV heads, head dim 128, MLP 14336, vocab 128256) is
built from its config with random bf16 weights: speed does not depend on the weights' values, and nothing is
downloaded. Per batch × context, a random prompt; every method generates ``--warmup`` + ``--tokens`` tokens greedily
in one ``generate`` call, and a stopping criterion waits for the device and reads the clock after every step: the time
per token is the mean gap over the last ``--tokens`` steps (the first ones include compiling and capturing the step).
Before the OpenAttention runs of a batch × context one untimed prefill compiles prepare's Triton kernels for the shape,
so that ``prepare_s`` is what a prompt costs, not the compiler.

- ``dense-default``: the model's own sdpa with transformers' default (dynamic) cache, eager.
- ``dense-static``: transformers' static cache (``cache_implementation="static"``), compiled by generate.
- ``dense-engine``: this project's static cache with every row read (``oa_core.ops.dense_decode``), compiled by
  generate: the same engine as OpenAttention, so that the ratio measures sparsity and not a better cache.
- ``openattention``: ``oa.patch(model, spec)`` and ``**oa.cache_kwargs(model, handle.static_cache(...))``, compiled
  by generate, for each of ``--variants`` (a spec file, ``:per_head`` or ``:shared`` after it replacing its GQA
  mode; by default the default spec per head and shared, and the paper's pipeline shared) at each ``--densities``.
  Each record names its ``"spec"`` file and ``"gqa"`` mode (None for the dense methods).
- ``no-attention`` (a bound, not a method): transformers' static cache, compiled, with an attention that reads no
  key or value (it returns its queries): everything in the step but attention. dense-fastest over it is the most
  any sparse attention can gain in this ``generate``.

Each batch × context × method (each OpenAttention variant apart) runs in a process of its own (the parent only
starts them and merges what they write), so that none inherits another's compiled code, CUDA graph pools or memory.
``dense-fastest`` is the faster of dense-static and dense-engine of the same run. Writes
``benchmarks/results/generate_speed.json``: ``{"machine", "runs": [{"batch", "context", "method", "density", "spec",
"gqa", "per_token_ms", "median_step_ms", "longest_step_ms", "prefill_s", "prepare_s", "tokens", "peak_gib"}],
"targets": [...], "provenance"}`` (``oa_core.analysis.provenance``: the commit and the machine) — the runs as
measured, one ``dense-fastest`` record per batch × context (``derived_from`` names the method it is), and each
OpenAttention run's speed over it against its target where the issue sets one (``target_for``) — prints a table and
draws ``generate_speed.png`` beside the JSON (``--replot JSON`` redraws a saved run).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import NamedTuple

# Set before CUDA starts: a batch's prefill allocates and frees several GiB a layer (the MLP's activations), and
# with fixed segments 16 × 16K's left 22 GiB reserved but unusable on an 80 GB H100 (out of memory at 77 GiB held).
os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")

import torch
from transformers import AttentionInterface, LlamaConfig, LlamaForCausalLM, StoppingCriteria, StoppingCriteriaList

import oa_core as oa
from oa_core.analysis.provenance import provenance

ROOT = Path(__file__).resolve().parents[1]
LLAMA_8B = dict(
    hidden_size=4096,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    intermediate_size=14336,
    vocab_size=128256,
    max_position_embeddings=131072,
    rope_theta=500000.0,
)
TINY = dict(
    hidden_size=256,
    num_hidden_layers=2,
    num_attention_heads=8,
    num_key_value_heads=2,
    intermediate_size=512,
    vocab_size=1024,
    max_position_embeddings=8192,
)


class StepClock(StoppingCriteria):
    """Waits for the device after every generated token and records the time: per-step gaps, not overlap."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.times: list[float] = []

    def __call__(self, input_ids, scores, **kwargs):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.times.append(time.perf_counter())
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


def no_attention(module, query, key, value, attention_mask, **kwargs):
    """An attention that reads no cache: its output is its query (``[B, T, H, D]``), for the no-attention bound."""
    return query.transpose(1, 2).contiguous(), None


AttentionInterface.register("no_attention", no_attention)


def build_model(tiny: bool, layers: int | None, device: torch.device) -> LlamaForCausalLM:
    shape = dict(TINY if tiny else LLAMA_8B)
    if layers:
        shape["num_hidden_layers"] = layers
    config = LlamaConfig(**shape, attn_implementation="sdpa", torch_dtype=torch.bfloat16)
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    return model.eval()


def timed_generate(model, ids: torch.Tensor, warmup: int, tokens: int, **kwargs) -> dict:
    clock = StepClock(ids.device)
    start = time.perf_counter()
    with torch.no_grad():
        model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=warmup + tokens,
            min_new_tokens=warmup + tokens,
            do_sample=False,
            pad_token_id=0,
            stopping_criteria=StoppingCriteriaList([clock]),
            **kwargs,
        )
    gaps = [b - a for a, b in zip(clock.times[warmup:-1], clock.times[warmup + 1 :])]
    # The mean is the measure; the median and the longest gap say whether a few slow steps (the host's
    # pauses) make it, or every step.
    return {
        "per_token_ms": 1000 * sum(gaps) / len(gaps),
        "median_step_ms": 1000 * statistics.median(gaps),
        "longest_step_ms": 1000 * max(gaps),
        "prefill_s": clock.times[0] - start,
        "tokens": len(gaps),
    }


@contextlib.contextmanager
def method_setup(model, method: str, density: float | None, spec: dict, max_new_tokens: int):
    """``method`` set up on ``model`` → (generate's extra arguments, the patch handle or None); undone on leaving."""
    kwargs, handle = {}, None
    if method in ("dense-static", "no-attention"):
        kwargs["cache_implementation"] = "static"
    if method == "no-attention":
        model.set_attn_implementation("no_attention")
    elif method in ("dense-engine", "openattention"):
        handle = oa.patch(model, {**spec, "budget": {"density": 1.0 if density is None else density}})
        kwargs.update(oa.cache_kwargs(model, handle.static_cache(max_new_tokens=max_new_tokens)))
    try:
        yield kwargs, handle
    finally:
        if method == "no-attention":
            model.set_attn_implementation("sdpa")
        if handle is not None:
            handle.unpatch()
        kwargs.clear()
        gc.collect()
        if next(model.parameters()).is_cuda:
            torch.cuda.empty_cache()


def warm_prepare(model, ids: torch.Tensor, spec: dict, density: float) -> None:
    """One untimed OpenAttention prefill at this batch × context: the first prepare in a process at a shape compiles
    prepare's Triton kernels for it (seconds), which is no part of the prepare a user pays per prompt."""
    try:
        with method_setup(model, "openattention", density, spec, 1) as (kwargs, _), torch.no_grad():
            model.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=1,
                do_sample=False,
                pad_token_id=0,
                **kwargs,
            )
    except torch.OutOfMemoryError:
        pass  # the timed run records the error


def peak_gib(device: torch.device) -> float | None:
    """The most GPU memory held since the last reset (weights, cache, the prefill's activations: what a card must
    have), GiB; None off a GPU."""
    return round(torch.cuda.max_memory_allocated(device) / 2**30, 2) if device.type == "cuda" else None


def run_method(model, ids, method: str, density: float | None, spec: dict, args) -> dict:
    if ids.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(ids.device)
    try:
        with method_setup(model, method, density, spec, args.warmup + args.tokens) as (kwargs, handle):
            result = timed_generate(model, ids, args.warmup, args.tokens, **kwargs)
            result["peak_gib"] = peak_gib(ids.device)
            result["prepare_s"] = handle.stats.prepare_seconds if method == "openattention" else None
            if handle is not None:
                (name,) = oa.cache_kwargs(model, None)  # the cache's keyword on the installed transformers
                dense = [layer.dense_reason for layer in kwargs[name].layers if layer.state is None]
                result["dense_layers"] = len(dense)
                result["dense_reason"] = sorted(set(dense))
    except torch.OutOfMemoryError as exc:
        result = {
            "per_token_ms": None,
            "median_step_ms": None,
            "longest_step_ms": None,
            "prefill_s": None,
            "prepare_s": None,
            "tokens": 0,
            "peak_gib": peak_gib(ids.device),
            "error": f"out of memory: {str(exc).splitlines()[0]}",
        }
    return result


DEFAULT_VARIANTS = [
    "specs/openattention.yaml:per_head",
    "specs/openattention.yaml:shared",
    "specs/openattention-paper.yaml:shared",
]  # the issue's: the default both ways, the paper's shared


class Variant(NamedTuple):
    """One OpenAttention setting a run patches in: the spec file as given, its GQA mode, and the spec (as JSON)."""

    file: str
    gqa: str
    spec: dict


def parse_variant(text: str) -> Variant:
    """``FILE`` or ``FILE:per_head`` / ``FILE:shared`` → the Variant, its components built (their parameters checked)
    before any model is; ValueError says what is wrong."""
    file, _, gqa = text.partition(":")
    if gqa and gqa not in ("per_head", "shared"):
        raise ValueError(f"{text}: the GQA mode after ':' is per_head or shared, not {gqa!r}")
    path = Path(file) if Path(file).is_file() else ROOT / file  # as given, else from the checkout (specs/...)
    if not path.is_file():
        raise ValueError(f"{text}: no file {file}")
    spec = oa.load_spec(path).model_dump(mode="json")
    spec["gqa"] = gqa or spec["gqa"]
    try:
        spec = oa.build(spec).resolved_spec()  # recorded with every component's params, defaults included
    except oa.SpecError as error:
        raise ValueError(f"{file}: {error}") from None
    return Variant(file, spec["gqa"], spec)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--configs",
        nargs="+",
        default=["16x16384", "8x32768", "4x65536", "2x131072"],
        help="BATCHxCONTEXT, each in a process of its own (a configuration that runs out of memory is recorded with "
        "its error)",
    )
    parser.add_argument("--densities", type=float, nargs="+", default=[0.01, 0.03])
    parser.add_argument(
        "--methods",
        nargs="+",
        default=["dense-static", "dense-engine", "openattention"],
        choices=["dense-default", "dense-static", "dense-engine", "openattention", "no-attention"],
    )
    parser.add_argument(
        "--variants",
        nargs="+",
        default=DEFAULT_VARIANTS,
        metavar="SPEC[:GQA]",
        help="the OpenAttention runs: a spec file each, ':per_head' or ':shared' replacing its GQA mode (each "
        "density replaces its budget); default: %(default)s",
    )
    parser.add_argument("--tokens", type=int, default=32, help="decode steps timed")
    parser.add_argument("--warmup", type=int, default=8, help="decode steps before the timed ones")
    parser.add_argument("--layers", type=int, default=None, help="fewer layers than the model's (a quick look)")
    parser.add_argument("--tiny", action="store_true", help="a toy model instead of the 8B shape")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "generate_speed.json")
    parser.add_argument(
        "--replot",
        type=Path,
        default=None,
        metavar="JSON",
        help="redraw the figure (and table) of a saved run, measuring nothing",
    )
    parser.add_argument(
        "--keep",
        type=Path,
        default=None,
        metavar="DIR",
        help="keep each configuration × method's run as DIR/<BATCHxCONTEXT>/<method>.json and skip one already there "
        "(a run cut short resumes where it stopped; delete a file to redo it)",
    )
    parser.add_argument(
        "--combine",
        type=Path,
        nargs="+",
        default=None,
        metavar="JSON",
        help="merge saved runs (of other configurations, on the same kind of device) into --out, measuring nothing",
    )
    parser.add_argument("--part", action="store_true", help=argparse.SUPPRESS)  # a child of run_apart: no figure
    args = parser.parse_args(argv)
    if args.replot is not None:
        saved = json.loads(args.replot.read_text())
        print(table(saved["runs"]))
        print(f"wrote {plot(saved['runs'], args.replot.with_suffix('.png'))}")
        return 0
    if args.combine is not None:
        try:
            combined = combine([json.loads(path.read_text()) for path in args.combine])
        except (OSError, ValueError) as error:
            parser.error(f"--combine: {error}")
        return write(args.out, combined)
    if args.tokens < 2:
        parser.error("--tokens: at least 2 (the time per token is the mean gap between timed steps)")
    try:
        configs = [parse_config(text) for text in args.configs]
        variants = [parse_variant(text) for text in args.variants] if "openattention" in args.methods else []
    except ValueError as error:
        parser.error(str(error))
    if len(configs) > 1 or args.keep is not None:
        return run_apart(args)
    (batch, context), device = configs[0], torch.device(args.device)
    torch._dynamo.config.cache_size_limit = 64  # one compiled step per method and shape: more than the default 8
    if hasattr(torch._dynamo.config, "recompile_limit"):
        torch._dynamo.config.recompile_limit = 64
    model = build_model(args.tiny, args.layers, device)
    machine = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor(),
        "torch": torch.__version__,
        "transformers": __import__("transformers").__version__,
        "layers": model.config.num_hidden_layers,
        "model": "tiny" if args.tiny else "Llama-3.1-8B shape",
        "variants": {f"{v.file}:{v.gqa}": v.spec for v in variants},
        "warmup": args.warmup,
        "cuda_alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF"),
    }
    made = provenance(device)  # the commit and the machine, written beside the figures
    runs: list[dict] = []
    ids = torch.randint(10, model.config.vocab_size, (batch, context), generator=torch.Generator().manual_seed(0))
    ids = ids.to(device)
    for method in args.methods:
        for variant in variants if method == "openattention" else [None]:
            spec = variant.spec if variant else {}
            if variant:
                warm_prepare(model, ids, spec, args.densities[0])
            for density in args.densities if variant else [None]:
                result = run_method(model, ids, method, density, spec, args)
                named = {"spec": variant.file if variant else None, "gqa": variant.gqa if variant else None}
                runs.append({"batch": batch, "context": context, "method": method, "density": density, **named})
                runs[-1].update(result)
                print(json.dumps(runs[-1]), flush=True)
                write(args.out, {**summary(machine, runs), "provenance": made}, quiet=True)
    return write(args.out, {**summary(machine, runs), "provenance": made}, figure=not args.part)


def parse_config(text: str) -> tuple[int, int]:
    """``BATCHxCONTEXT`` → (batch, context); ValueError names the text."""
    try:
        batch, context = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise ValueError(f"--configs: {text!r} is not BATCHxCONTEXT (e.g. 16x16384)") from None
    if batch < 1 or context < 1:
        raise ValueError(f"--configs: {text!r}: batch and context are at least 1")
    return batch, context


def jobs(args) -> list[tuple[str, list[str]]]:
    """The processes of one configuration: (a name for its file, its --methods/--variants options), one per dense
    method and one per OpenAttention variant."""
    dense = [(method, ["--methods", method]) for method in args.methods if method != "openattention"]
    named = [(v.replace("/", "_").replace(".yaml", "").replace(":", "-"), v) for v in args.variants]
    sparse = [(name, ["--methods", "openattention", "--variants", v]) for name, v in named]
    return dense + (sparse if "openattention" in args.methods else [])


def run_apart(args) -> int:
    """Each of ``args.configs`` × each method (each OpenAttention variant apart) in a child process of this script
    (the same options, its own --out): no method inherits another's compiled step, CUDA graph pools or cache (on an
    80 GB card 16 × 16K's dense-static left 71 GB held, and every method after it ran out of memory). Merged into
    ``args.out`` after each one: one that fails leaves the others' runs. With ``args.keep`` the parts stay in that
    folder (``<config>/<method>.json``), and one already there is not run again."""
    import subprocess
    import tempfile

    options = ["--densities", *map(str, args.densities), "--tokens", str(args.tokens), "--warmup", str(args.warmup)]
    options += ["--device", args.device] + (["--layers", str(args.layers)] if args.layers else [])
    options += ["--tiny"] if args.tiny else []
    parts, failed = [], []
    with tempfile.TemporaryDirectory() as scratch:
        folder = args.keep or Path(scratch)
        for config in args.configs:
            for name, chosen in jobs(args):
                part = folder / config / f"{name}.json"
                partial = part.with_suffix(".partial")  # one cut short is not mistaken for a whole one
                part.parent.mkdir(parents=True, exist_ok=True)
                if part.is_file():
                    print(f"--- {config} {name}: kept from an earlier run ({part})", flush=True)
                else:
                    command = [sys.executable, __file__, *options, *chosen, "--configs", config, "--out", str(partial)]
                    command.append("--part")  # its own figure is not drawn: the merged one is
                    print(f"--- {config} {name}: {' '.join(command[1:])}", flush=True)
                    if subprocess.run(command).returncode == 0 and partial.is_file():
                        partial.replace(part)
                if not part.is_file():
                    failed.append(f"{config} {name}")  # what it measured is merged, and it runs again next time
                done = part if part.is_file() else partial
                if done.is_file():
                    parts.append(json.loads(done.read_text()))
                    write(args.out, combine(parts), quiet=True)
        if not parts:
            print(f"nothing finished: {', '.join(failed)}", file=sys.stderr)
            return 1
        write(args.out, combine(parts))
    if failed:
        print(f"did not finish: {', '.join(failed)} (their processes' output is above)", file=sys.stderr)
    return 1 if failed else 0


def run_key(run: dict) -> tuple:
    """What makes a run the same measurement again: its configuration, method, spec, GQA mode and density."""
    return (run["batch"], run["context"], run["method"], run.get("spec"), run.get("gqa"), run["density"])


def combine(saved: list[dict]) -> dict:
    """Saved runs of separate processes → one result: their runs in order (a run saved twice keeps the later one),
    the summary derived again; where they were made at different commits, each configuration's provenance (its last
    saved; a saved combination's own for each of its configurations) is kept. ValueError where they come from
    different kinds of device."""
    devices = {s["machine"]["device"] for s in saved}
    if len(devices) > 1:
        raise ValueError(f"runs from different devices cannot be compared in one table: {sorted(devices)}")
    measured = [r for s in saved for r in s["runs"] if r["method"] != "dense-fastest"]  # derived again below
    last = {run_key(r): r for r in measured}
    runs = [r for r in measured if last[run_key(r)] is r]
    by_config = {  # a saved combination keeps each configuration's own provenance
        config: s.get("provenance_by_config", {}).get(config, s["provenance"])
        for s in saved
        for config in (f"{r['batch']}x{r['context']}" for r in s["runs"])
    }
    variants = {name: spec for s in saved for name, spec in s["machine"].get("variants", {}).items()}
    result = {**summary({**saved[-1]["machine"], "variants": variants}, runs), "provenance": saved[-1]["provenance"]}
    if len({json.dumps(p, sort_keys=True) for p in by_config.values()}) > 1:
        result["provenance_by_config"] = by_config
    return result


def write(path: Path, result: dict, quiet: bool = False, figure: bool = True) -> int:
    """``result`` to ``path`` (JSON) and, with ``figure``, its figure beside it; unless ``quiet``, the table
    printed."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1) + "\n")
    if not quiet:
        print(table(result["runs"]))
        print(f"wrote {path}" + (f" and {plot(result['runs'], path.with_suffix('.png'))}" if figure else ""))
    return 0


def plot(runs: list[dict], path: Path) -> Path:
    """One panel per batch × context: each method's tokens/s over dense-fastest (bars), a run's target where the
    issue sets one (a green tick on its bar), dense and the no-attention bound as lines → ``path`` (PNG)."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    configs = list(dict.fromkeys((r["batch"], r["context"]) for r in runs))
    fig, axes = plt.subplots(1, len(configs), figsize=(6.5 * len(configs), 4.2), squeeze=False)
    for ax, config in zip(axes[0], configs):
        rows = [r for r in runs if (r["batch"], r["context"]) == config and r["per_token_ms"]]
        best = fastest_dense(rows)
        ax.set_title(f"batch {config[0]} × context {config[1]}", fontsize=10)
        if best is None:  # nothing to compare with: say why (an out-of-memory configuration, most often)
            errors = {
                r.get("error", "no dense run").split(".")[0]
                for r in runs
                if (r["batch"], r["context"]) == config and not r["per_token_ms"]
            }
            ax.text(
                0.5,
                0.5,
                "not measured:\n" + "\n".join(sorted(errors)) if errors else "no dense run",
                ha="center",
                va="center",
                wrap=True,
                fontsize=8,
                transform=ax.transAxes,
            )
            ax.set_axis_off()
            continue
        fastest = best["per_token_ms"]
        shown = [r for r in rows if r["method"] not in ("dense-fastest", "no-attention")]
        speed = [fastest / r["per_token_ms"] for r in shown]
        colours = ["tab:orange" if r["method"] == "openattention" else "tab:gray" for r in shown]
        ax.barh([run_label(r) for r in shown], speed, color=colours)
        for y, (value, r) in enumerate(zip(speed, shown)):
            ax.text(value, y, f" {value:.2f}× ({r['per_token_ms']:.1f} ms)", va="center", fontsize=8)
        aims = [(y, target_for(r)) for y, r in enumerate(shown) if target_for(r)]
        if aims:
            ys, xs = zip(*aims)
            ax.scatter(xs, ys, marker="|", s=300, color="tab:green", zorder=3, label="target")
        bound = [r["per_token_ms"] for r in rows if r["method"] == "no-attention"]
        if bound:
            ax.axvline(fastest / bound[0], color="tab:red", linewidth=1, label="no-attention (bound)")
        ax.axvline(1.0, color="black", linewidth=0.8)
        if aims or bound:
            ax.legend(fontsize=7, loc="lower right")
        ax.set_xlabel("tokens/s over dense-fastest")
        ax.set_xlim(0, max(speed + [x for _, x in aims] + [fastest / b for b in bound]) * 1.3)
        ax.tick_params(axis="y", labelsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def fastest_dense(rows: list[dict]) -> dict | None:
    """Of one batch × context's runs, the fastest dense static-cache decode (dense-static, dense-engine, or the
    dense-fastest record already derived from them); None where none finished."""
    dense = [r for r in rows if r["method"] in ("dense-static", "dense-engine", "dense-fastest") and r["per_token_ms"]]
    return min(dense, key=lambda r: r["per_token_ms"]) if dense else None


# The targets for tokens/s over dense-fastest: (spec file's name, GQA mode, density, the batch × context
# they hold at (None: every one), target).
SPEED_TARGETS = [
    ("openattention", "per_head", 0.01, {(16, 16384), (8, 32768)}, 1.5),
    ("openattention", "per_head", 0.03, {(16, 16384), (8, 32768)}, 1.3),
    ("openattention", "per_head", 0.01, {(2, 131072)}, 2.5),
    ("openattention-paper", "shared", 0.01, None, 2.0),
]
PREPARE_TARGET = 0.10  # the issue's: prepare at most this share of the model's dense prefill, everywhere


def target_for(run: dict) -> float | None:
    """The speed-up over dense-fastest the issue asks of an OpenAttention run, or None where it sets none."""
    if run["method"] != "openattention" or not run.get("spec"):
        return None
    for stem, gqa, density, configs, target in SPEED_TARGETS:
        if (stem, gqa, density) == (Path(run["spec"]).stem, run.get("gqa"), run["density"]) and (
            configs is None or (run["batch"], run["context"]) in configs
        ):
            return target
    return None


def run_label(run: dict) -> str:
    """A run's name in figures: an OpenAttention run's spec file's name and GQA mode, another's method; then the
    density."""
    name = f"{Path(run['spec']).stem} {run.get('gqa')}" if run.get("spec") else run["method"]
    return name + ("" if run["density"] is None else f" {run['density']:.0%}")


def prepare_share(run: dict) -> float | None:
    """An OpenAttention run's prepare over the model's dense prefill in the same run: its time to the first token
    holds the model's own prefill (dense attention) and the prepare after each layer's, so the prefill is the
    difference. None for other runs."""
    if run["method"] != "openattention" or not run.get("prepare_s") or not run.get("prefill_s"):
        return None
    return run["prepare_s"] / (run["prefill_s"] - run["prepare_s"])


def summary(machine: dict, runs: list[dict]) -> dict:
    """The JSON: the runs as measured, then per batch × context a ``dense-fastest`` record (the faster of the dense
    static-cache methods of the same run, named in ``derived_from``), and each OpenAttention run's speed-up and
    prepare share, against their targets where the issue sets them (``target`` None, ``met`` None elsewhere)."""
    fastest_runs, targets = [], []
    for config in dict.fromkeys((r["batch"], r["context"]) for r in runs):
        rows = [r for r in runs if (r["batch"], r["context"]) == config]
        fastest = fastest_dense(rows)
        if fastest is None:
            continue
        fastest_runs.append({**fastest, "method": "dense-fastest", "derived_from": fastest["method"]})
        for r in rows:
            named = {"batch": config[0], "context": config[1], "spec": r.get("spec"), "gqa": r.get("gqa")}
            if r["method"] == "openattention" and r["per_token_ms"]:
                speedup, target = fastest["per_token_ms"] / r["per_token_ms"], target_for(r)
                targets.append(
                    {
                        **named,
                        "density": r["density"],
                        "speedup_over_dense_fastest": round(speedup, 3),
                        "target": target,
                        "met": None if target is None else speedup >= target,
                        "short_by": None if target is None else round(max(target - speedup, 0.0), 3),
                    }
                )
            share = prepare_share(r)
            if share is not None:
                targets.append(
                    {
                        **named,
                        "density": r["density"],
                        "prepare_over_prefill": round(share, 3),
                        "target": PREPARE_TARGET,
                        "met": share <= PREPARE_TARGET,
                        "short_by": round(max(share - PREPARE_TARGET, 0.0), 3),
                    }
                )
    return {
        "machine": machine,
        "runs": runs + fastest_runs,
        "targets": targets,
        "where_the_time_goes": (
            "benchmarks/kernel_h200.py (the sparse stage per layer and its parts) and "
            "benchmarks/studies/generate_profile.py (device and host per token)"
        ),
    }


def peak_cell(run: dict) -> str:
    """A run's most GPU memory held, GiB; for one that ran out of memory, what it held when an allocation failed."""
    if run.get("peak_gib") is None:
        return ""
    return f"{run['peak_gib']:.1f}" + (", out of memory" if run.get("error") else "")


def table(runs: list[dict]) -> str:
    """Per batch × context: each method's ms per token and its speed over dense-fastest."""
    lines = [
        "| batch × context | method | spec, GQA | density | ms / token | tokens/s vs dense-fastest | prefill s "
        "| prepare s | prepare / dense prefill | peak GiB |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for config in dict.fromkeys((r["batch"], r["context"]) for r in runs):
        rows = [r for r in runs if (r["batch"], r["context"]) == config]
        best = fastest_dense(rows)
        fastest = best["per_token_ms"] if best else None
        for r in rows:
            ms, density = r["per_token_ms"], r["density"]
            cells = [
                f"{config[0]} × {config[1]}",
                r["method"],
                f"{Path(r['spec']).stem}, {r.get('gqa')}" if r.get("spec") else "",
                "" if density is None else f"{density:.0%}",
                "n/a" if ms is None else f"{ms:.2f}",
                f"{fastest / ms:.2f}×" if ms and fastest else "n/a",
                "n/a" if r["prefill_s"] is None else f"{r['prefill_s']:.2f}",
                "" if r.get("prepare_s") is None else f"{r['prepare_s']:.2f}",
                "" if prepare_share(r) is None else f"{prepare_share(r):.1%}",
                peak_cell(r),
            ]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
