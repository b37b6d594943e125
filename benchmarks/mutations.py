"""Would the tests catch a wrong method? Plausible bugs, seeded one at a time into a copy of the project.

    python benchmarks/mutations.py                  # every mutation (about 40 minutes on 2 CPU cores)
    python benchmarks/mutations.py --only errorgate # those whose name contains a word
    python benchmarks/mutations.py --list           # the list, without running anything

Each mutation rewrites a few lines of one module (each edit must match exactly once, so the list fails loudly when
the code moves on), in a temporary copy of the checkout — its tracked and untracked, not ignored, files — that the
tests import instead of the installed package. The tests the mutation should trip run against it; it is caught when
at least one fails. The same tests first run on the unchanged copy, which must pass. Writes
``benchmarks/results/mutations.json`` — ``{"mutations": [{"name", "file", "caught", "by": [test ids]}]}`` — and
prints a table. Not part of CI (it runs the relevant tests once per mutation); run it after changing a mechanism or
its tests, and add a mutation for every mechanism added.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

ROOT = Path(__file__).resolve().parents[1]
RESULT = ROOT / "benchmarks" / "results" / "mutations.json"


@dataclass(frozen=True)
class Mutation:
    name: str
    file: str
    edits: tuple[tuple[str, str], ...]  # (text as it is, text as the bug would have it)
    tests: tuple[str, ...]  # pytest paths or node ids expected to catch it
    bug: str


def mutation(name: str, file: str, edits, tests, bug: str) -> Mutation:
    return Mutation(name, file, tuple(edits), tuple(tests), bug)


QGS_TESTS = ("tests/plugins/test_qgs.py", "tests/test_selection.py", "tests/test_conformance.py")
PQ_TESTS = ("tests/plugins/test_pq.py", "tests/test_conformance.py")
PQ_GPU_TESTS = ("tests/plugins/test_pq.py::test_the_gpu_prepare_learns_and_codes_every_key_as_the_torch_code",)
RULER_TESTS = ("tests/test_ruler_fidelity.py",)
ERRORGATE_TESTS = ("tests/plugins/test_errorgate.py", "tests/test_conformance.py")
KERNEL_TESTS = (
    "tests/plugins/test_reference_kernel.py",
    "tests/plugins/test_flash_kernel.py",
    "tests/test_conformance.py",
)
QGC_TESTS = ("tests/plugins/test_qgc.py", "tests/test_geometry.py", "tests/test_conformance.py")
KMEANS_TESTS = ("tests/plugins/test_qgc.py", "tests/test_kmeans.py", "tests/test_conformance.py")
SPEC_TESTS = ("tests/test_spec.py", "tests/test_errors.py")
PIPELINE_TESTS = ("tests/test_pipeline.py", "tests/test_conformance.py", "tests/test_theory.py")
STATIC_TESTS = ("tests/test_static.py", "tests/test_static_cache.py")
TWO_STAGE_TESTS = (
    "tests/test_rerank.py",
    "tests/plugins/test_errorgate.py",
    "tests/test_static.py::test_the_two_stage_selection_and_the_errorgate_floor_read_the_reference_rows_too",
)
FUSED_TESTS = ("tests/test_flash_step.py",)
FUSED_TWO_STAGE_TESTS = (
    "tests/test_flash_step.py::test_the_two_stage_selection_and_the_floor_read_the_reference_rows",
    "tests/test_flash_step.py::test_the_shortlist_counts_the_row_leaving_the_window_as_joined_before_its_join",
)
WATER_FILL_TESTS = (
    "tests/test_water_filling.py",
    "tests/plugins/test_errorgate.py",
    "tests/plugins/test_ablation_components.py",
)

MUTATIONS = [
    # -- QGS (Eq. 5) ------------------------------------------------------------------------------------------------
    mutation(
        "qgs-torch-score-without-int8-scale",
        "plugins/selectors/qgs.py",
        [("* (scale * index.scales[:, :, None, :])", "* scale")],
        QGS_TESTS,
        "the torch scoring path multiplies the codes by s but not by each key's int8 scale",
    ),
    mutation(
        "qgs-triton-score-without-int8-scale",
        "plugins/selectors/qgs.py",
        [("best * factor, mask=in_n)", "best * scale, mask=in_n)")],
        QGS_TESTS,
        "the fused Triton scores drop each key's int8 scale",
    ),
    mutation(
        "qgs-extend-codes-unprojected",
        "plugins/selectors/qgs.py",
        [
            (
                "codes, scales = quantize(project(keys, index.basis))\n        return {",
                "codes, scales = quantize(keys.float()[..., :index.basis.shape[-1]])\n        return {",
            )
        ],
        QGS_TESTS,
        "decode-time growth quantizes the raw keys' first r coordinates, not their projection",
    ),
    # -- PQS (product-quantised selection) ---------------------------------------------------------------------------
    mutation(
        "pq-torch-score-skips-a-sub-space",
        "plugins/selectors/pq.py",
        [
            (
                "offsets = (codes.long().view(B * Hkv, N, M) + place).view(-1, M)",
                "offsets = (codes.long().view(B * Hkv, N, M) + place)[..., 1:].reshape(-1, M - 1)",
            )
        ],
        PQ_TESTS,
        "the torch scores add the tables of every sub-space but the first",
    ),
    mutation(
        "pq-packs-the-high-nibble-first",
        "plugins/selectors/pq.py",
        [
            (
                "return (pairs[..., 0] | (pairs[..., 1] << 4)).contiguous()",
                "return (pairs[..., 1] | (pairs[..., 0] << 4)).contiguous()",
            )
        ],
        PQ_TESTS,
        "the index packs sub-space 2j + 1 in a byte's low nibble, where every reader takes 2j's",
    ),
    mutation(
        "pq-triton-reads-the-nibbles-swapped",
        "plugins/selectors/pq.py",
        [("codes = tl.interleave(raw & 15, raw >> 4)", "codes = tl.interleave(raw >> 4, raw & 15)")],
        PQ_TESTS,
        "the score kernel takes a byte's high nibble for the even sub-space",
    ),
    mutation(
        "fused-pq-packs-the-high-nibble-first",
        "plugins/selectors/pq_programs.py",
        [("byte = low | (high << 4)", "byte = high | (low << 4)")],
        FUSED_TESTS + PQ_GPU_TESTS,
        "the GPU's codes (every key's in prepare, the new row's in the fused step) with the nibbles swapped",
    ),
    mutation(
        "pq-triton-score-skips-a-sub-space",
        "plugins/selectors/pq.py",
        [
            (
                "both_t = tl.trans(in_n[:, None] & (offs_m[None, :] < M))",
                "both_t = tl.trans(in_n[:, None] & (offs_m[None, :] < M - 1))",
            )
        ],
        PQ_TESTS,
        "the fused scores read the codes of every sub-space but the last",
    ),
    mutation(
        "pq-growth-codes-off-by-one",
        "plugins/selectors/pq.py",
        [
            (
                "codes = nearest(sub_spaces(keys, dims), centroids).to(torch.uint8)",
                "codes = ((nearest(sub_spaces(keys, dims), centroids) + 1) % count).to(torch.uint8)",
            )
        ],
        PQ_TESTS,
        "decode-time growth codes a key by the centroid after its nearest",
    ),
    mutation(
        "pq-trains-on-unclustered-keys",
        "plugins/selectors/pq.py",
        [
            (
                "chosen = region & ((region.cumsum(-1) - 1) % stride.clamp_min(1) == 0)",
                "chosen = (region.cumsum(-1) - 1) % stride.clamp_min(1) == 0",
            )
        ],
        PQ_TESTS,
        "the centroids also learn from the keys outside the clustered region (sink, local window, padding)",
    ),
    mutation(
        "pq-gpu-train-sums-unchosen-points",
        "plugins/selectors/pq_programs.py",
        [
            (
                "member = (code == j) & (weight > 0)",
                "member = code == j",
            )
        ],
        PQ_GPU_TESTS,
        "the GPU's k-means adds the row's filler positions (not training keys) to their clusters' sums",
    ),
    mutation(
        "pq-gpu-train-starts-at-the-first-keys",
        "plugins/selectors/pq_programs.py",
        [("rank = tl.minimum((j * available) // C,", "rank = tl.minimum(j,")],
        PQ_GPU_TESTS,
        "the GPU's k-means starts from the first C training keys, not keys spread over the context",
    ),
    mutation(
        "pq-gpu-train-one-round-short",
        "plugins/selectors/pq_programs.py",
        [("for _round in range(iterations):", "for _round in range(iterations - 1):")],
        PQ_GPU_TESTS,
        "the GPU's k-means runs one Lloyd round fewer than the spec's iterations",
    ),
    mutation(
        "pq-gpu-train-empties-a-centre",
        "plugins/selectors/pq_programs.py",
        [
            (
                "tl.where(count > 0, sums / tl.maximum(count, 1.0), kept)",
                "sums / tl.maximum(count, 1.0)",
            )
        ],
        PQ_GPU_TESTS,
        "the GPU's k-means moves a cluster with no point to the origin, where the torch code keeps its centre",
    ),
    mutation(
        "pq-gpu-encode-swaps-sub-spaces",
        "plugins/selectors/pq_programs.py",
        [("sub = offs_m[:, None] * DIMS + offs_e[None, :]", "sub = (offs_m[:, None] ^ 1) * DIMS + offs_e[None, :]")],
        PQ_GPU_TESTS,
        "the GPU's encoding codes each sub-space from its neighbour's coordinates",
    ),
    # -- RULER's generator (NVIDIA/RULER at c3f5e3b) -----------------------------------------------------------------
    mutation(
        "ruler-never-singular",
        "oa_core/eval/ruler_tasks.py",
        [("singular = config.num_needle_q * config.num_needle_v == 1", "singular = False")],
        RULER_TESTS,
        "a niah task asking for one value keeps the plural template",
    ),
    mutation(
        "ruler-noise-lines-joined-by-spaces",
        "oa_core/eval/ruler_tasks.py",
        [('context, where = "\\n".join(placed)', 'context, where = " ".join(placed)')],
        RULER_TESTS,
        "the noise and needle haystacks' lines joined by spaces, not newlines",
    ),
    mutation(
        "ruler-vt-statements-with-periods",
        "oa_core/eval/ruler_tasks.py",
        [('[f"VAR {variables[0]} = {value}"]', '[f"VAR {variables[0]} = {value}."]')],
        RULER_TESTS,
        "vt's first assignment ends with a period",
    ),
    mutation(
        "ruler-vt-without-its-example",
        "oa_core/eval/ruler_tasks.py",
        [
            (
                'return Prompt(example + "\\n" + content, question, prefix, list(variables))',
                "return Prompt(content, question, prefix, list(variables))",
            )
        ],
        RULER_TESTS,
        "vt's worked example left out",
    ),
    mutation(
        "ruler-cwe-without-its-example",
        "oa_core/eval/ruler_tasks.py",
        [
            (
                "return Prompt(content, question, prefix, order[: config.num_cw], history)",
                "return Prompt(content, question, prefix, order[: config.num_cw])",
            )
        ],
        RULER_TESTS,
        "cwe's worked example left out",
    ),
    mutation(
        "ruler-cwe-list-by-lines",
        "oa_core/eval/ruler_tasks.py",
        [
            (
                'return " ".join(f"{i + 1}. {word}" for i, word in enumerate(items))',
                'return "\\n".join(f"{i + 1}. {word}" for i, word in enumerate(items))',
            )
        ],
        RULER_TESTS,
        "cwe's numbered list one word a line, not space-separated",
    ),
    mutation(
        "ruler-fwe-answers-ranks-1-3",
        "oa_core/eval/ruler_tasks.py",
        [('vocabulary[0] = "..."  # the top rank is noise', "pass")],
        RULER_TESTS,
        "fwe without its noise word: the answers are then the three most frequent words (an easier task)",
    ),
    mutation(
        "ruler-query-without-oxford-comma",
        "oa_core/eval/ruler_tasks.py",
        [('", ".join(queries[:-1]) + ", and " + queries[-1]', '", ".join(queries[:-1]) + " and " + queries[-1]')],
        RULER_TESTS,
        "several keys asked joined 'a, b and c'",
    ),
    mutation(
        "ruler-no-room-to-generate",
        "oa_core/eval/ruler.py",
        [("budget = length - NEW_TOKENS[config.family]", "budget = length")],
        RULER_TESTS,
        "the prompt alone fills the length, leaving no room for the tokens RULER lets the model generate",
    ),
    mutation(
        "ruler-essays-from-a-later-word",
        "oa_core/eval/ruler_tasks.py",
        [
            (
                'text = " ".join(words[:size] if size <= len(words)',
                'text = " ".join(words[100:100 + size] if size <= len(words)',
            )
        ],
        RULER_TESTS,
        "the essay haystack starts past the essays' first word",
    ),
    mutation(
        "ruler-keys-of-two-nouns",
        "oa_core/eval/ruler_tasks.py",
        [('return f"{r.choice(adjectives)}-{r.choice(nouns)}"', 'return f"{r.choice(nouns)}-{r.choice(nouns)}"')],
        RULER_TESTS,
        "niah keys drawn as noun-noun pairs, not adjective-noun",
    ),
    # -- QGC (Eq. 4) ------------------------------------------------------------------------------------------------
    mutation(
        "qgc-projection-without-sqrt-lambda",
        "plugins/clusterers/qgc.py",
        [("projection = basis * eigenvalues.sqrt()[..., None, :]", "projection = basis")],
        QGC_TESTS,
        "keys projected on U_r without Λ_r^½: k-means in the wrong metric",
    ),
    mutation(
        "qgc-ignores-the-queries",
        "plugins/clusterers/qgc.py",
        [("query_geometry(keys, queries, mask, cfg.rank", "query_geometry(keys, None, mask, cfg.rank")],
        QGC_TESTS,
        "the geometry comes from the keys (key PCA), not from the queries",
    ),
    mutation(
        "qgc-whole-prefill-instead-of-window",
        "oa_core/ops/geometry.py",
        [("samples = queries[:, :, -window:].double()", "samples = queries.double()")],
        QGC_TESTS,
        "M̄_q from every prefill query instead of the last query_window",
    ),
    mutation(
        "geometry-subspace-on-m-not-m-squared",
        "oa_core/ops/geometry.py",
        [("basis = orthonormalize(square @ basis, ", "basis = orthonormalize(basis, ")],
        QGC_TESTS,
        "the GPU's subspace iteration never multiplies by M²: the start's span is returned",
    ),
    mutation(
        "geometry-energy-stop-reversed",
        "oa_core/ops/geometry.py",
        [("done |= captured - energy <= energy_tol * captured", "done |= energy - captured <= energy_tol * captured")],
        QGC_TESTS,
        "the subspace iteration stops at its second check whatever the energy its basis still gains",
    ),
    mutation(
        "geometry-gram-schmidt-without-normalising",
        "oa_core/ops/geometry.py",
        [("column = column / tl.sqrt(tl.sum(column * column, axis=0))", "column = column")],
        QGC_TESTS,
        "the Triton Gram–Schmidt leaves its columns unnormalised",
    ),
    mutation(
        "kmeans-plus-plus-kernel-off-by-one",
        "oa_core/ops/kmeans.py",
        [("chosen = tl.minimum(below, n - 1)", "chosen = tl.minimum(below + 1, n - 1)")],
        KMEANS_TESTS,
        "the one-launch k-means++ picks the point after the one whose weight the draw fell in",
    ),
    mutation(
        "nearest-kernel-last-of-equals",
        "oa_core/ops/kmeans.py",
        [("better = low < best", "better = low <= best")],
        KMEANS_TESTS,
        "the Triton nearest centroid takes the last of equal centroids across tiles",
    ),
    mutation(
        "kmeans-plus-plus-kernel-block-search-one-short",
        "oa_core/ops/kmeans.py",
        [
            (
                "first = tl.sum(((offs_b < nb) & (ends < target)).to(tl.int64), axis=0)",
                "first = tl.maximum(tl.sum(((offs_b < nb) & (ends < target)).to(tl.int64), axis=0) - 1, 0)",
            )
        ],
        KMEANS_TESTS,
        "k-means++ inverts the CDF in the block before the one its draw falls in",
    ),
    mutation(
        "lloyd-torch-stops-while-points-move",
        "oa_core/ops/kmeans.py",
        [
            (
                "if iteration % check_every == 0 and torch.equal(updated, assignment):",
                "if iteration % check_every == 0 and not torch.equal(updated, assignment):",
            )
        ],
        KMEANS_TESTS,
        "Lloyd's torch loop stops at its first look where points still move",
    ),
    mutation(
        "lloyd-gpu-stops-while-points-move",
        "oa_core/ops/kmeans.py",
        [
            (
                "if i and i % check_every == 0 and not bool(moved[i]):",
                "if i and i % check_every == 0 and bool(moved[i]):",
            )
        ],
        KMEANS_TESTS,
        "Lloyd on the GPU stops at its first look where points still move",
    ),
    mutation(
        "lloyd-sums-count-every-point",
        "oa_core/ops/kmeans.py",
        [("go = changed & (w != 0)", "go = changed")],
        KMEANS_TESTS,
        "Lloyd's sums on the GPU move the points of weight 0 (outside the mask) too",
    ),
    mutation(
        "lloyd-means-empty-cluster-to-zero",
        "oa_core/ops/kmeans.py",
        [("tl.where(count[:, None] > 0, mean, centre)", "tl.where(count[:, None] >= 0, mean, centre)")],
        KMEANS_TESTS,
        "the Triton cluster means move an emptied cluster's centre to the origin",
    ),
    mutation(
        "lloyd-gpu-never-flags-a-moved-point",
        "oa_core/ops/kmeans.py",
        [("if tl.max(changed.to(tl.int32), axis=0) > 0:", "if tl.max(changed.to(tl.int32), axis=0) > 1:")],
        KMEANS_TESTS,
        "Lloyd on the GPU sees no point move, so it stops at its first look",
    ),
    mutation(
        "lloyd-gpu-deltas-never-zeroed",
        "oa_core/ops/kmeans.py",
        [("                tl.store(DELTAS + row + R, tl.zeros([BLOCK_C], tl.float64), mask=in_c)\n", "")],
        KMEANS_TESTS,
        "Lloyd on the GPU folds each launch's count deltas into the sums again at every later launch",
    ),
    mutation(
        "lloyd-gpu-moved-point-stays-in-its-old-sums",
        "oa_core/ops/kmeans.py",
        [("out_of = (p * C + before) * (R + 1)", "out_of = (p * C + best) * (R + 1)")],
        KMEANS_TESTS,
        "a point that changes cluster is taken from its new cluster's sums, not from its old one's",
    ),
    mutation(
        "lloyd-gpu-arrivals-never-reset",
        "oa_core/ops/kmeans.py",
        [("            tl.store(ARRIVED + p, 0)\n", "")],
        KMEANS_TESTS,
        "the arrival count is not reset: after the first launch no program is the last, the means never move",
    ),
    mutation(
        "lloyd-gpu-last-arrival-forgets-the-deltas",
        "oa_core/ops/kmeans.py",
        [
            (
                ") + tl.load(DELTAS + row[:, None] + offs_r[None, :], mask=tile",
                ") + 0 * tl.load(DELTAS + row[:, None] + offs_r[None, :], mask=tile",
            )
        ],
        KMEANS_TESTS,
        "the last program's means fold in the counts' deltas but not the sums'",
    ),
    mutation(
        "projection-kernel-drops-the-last-dimension",
        "oa_core/ops/geometry.py",
        [
            (
                "in_n, in_d, in_r = offs_n < N, offs_d < D, offs_r < R",
                "in_n, in_d, in_r = offs_n < N, offs_d < D - 1, offs_r < R",
            )
        ],
        QGC_TESTS,
        "the projection kernel reads each key without its last dimension",
    ),
    mutation(
        "pooled-sums-square-of-values",
        "oa_core/ops/scatter.py",
        [("key_square_sum += tl.sum(k * k, axis=0)", "key_square_sum += tl.sum(v * v, axis=0)")],
        ("tests/test_scatter.py",),
        "the pooled Σk⊙k sums the values' squares",
    ),
    mutation(
        "pooled-sums-one-row-short",
        "oa_core/ops/scatter.py",
        [("inside = at < count", "inside = at < count - 1")],
        ("tests/test_scatter.py",),
        "each cluster's pooled sums leave out its last row",
    ),
    mutation(
        "finite-check-reads-the-maximum-only",
        "oa_core/contracts.py",
        [
            (
                "ends = [torch.stack(torch.aminmax(t)) for t in tensors if t.numel()]",
                "ends = [t.amax()[None] for t in tensors if t.numel()]",
            )
        ],
        SPEC_TESTS,
        "the NaN/Inf check misses -Inf (it reads the largest element only)",
    ),
    # -- ErrorGate (Eq. 6) ------------------------------------------------------------------------------------------
    mutation(
        "errorgate-without-head-normaliser",
        "plugins/allocators/errorgate.py",
        [
            ("return log_error - log_total(log_mass)", "return log_error"),
            ("log_priority = log_error - total[:, None]", "log_priority = log_error"),
        ],
        ERRORGATE_TESTS,
        "each head's ε̂ is not divided by its Ẑ (torch and Triton paths)",
    ),
    mutation(
        "errorgate-torch-without-head-normaliser",
        "plugins/allocators/errorgate.py",
        [("return log_error - log_total(log_mass)", "return log_error")],
        ERRORGATE_TESTS,
        "the torch path alone drops −ln Ẑ",
    ),
    mutation(
        "errorgate-triton-without-head-normaliser",
        "plugins/allocators/errorgate.py",
        [("log_priority = log_error - total[:, None]", "log_priority = log_error")],
        ERRORGATE_TESTS,
        "the Triton path alone drops −ln Ẑ",
    ),
    mutation(
        "errorgate-without-erf-factor",
        "plugins/allocators/errorgate.py",
        [
            ("return log_mass + torch.log(torch.erf(sigma / math.sqrt(2))), log_mass", "return log_mass, log_mass"),
            ("log_error = log_mass + tl.log(tl.erf(tl.div_rn(sigma, 1.4142135623730951)))", "log_error = log_mass"),
        ],
        ERRORGATE_TESTS,
        "ε̂_b without the factor 2Φ(σ̂) − 1: the Gaussian mass instead of its error",
    ),
    mutation(
        "errorgate-variance-without-half",
        "plugins/allocators/errorgate.py",
        [
            (
                "log_mass = torch.log(counts) + mean_logit + logit_var / 2",
                "log_mass = torch.log(counts) + mean_logit + logit_var",
            ),
            (
                "log_mass = (tl.log(count)[None, :] + mean) + var * 0.5",
                "log_mass = (tl.log(count)[None, :] + mean) + var",
            ),
        ],
        ERRORGATE_TESTS,
        "e^{σ̂²} instead of e^{σ̂²/2} in both paths",
    ),
    # -- water-filling (Eq. 7) --------------------------------------------------------------------------------------
    mutation(
        "water-fill-smallest-remainders",
        "oa_core/ops/water_filling.py",
        [
            (
                "rank = fraction.argsort(dim=-1, descending=True, stable=True)",
                "rank = fraction.argsort(dim=-1, descending=False, stable=True)",
            )
        ],
        WATER_FILL_TESTS,
        "the rounding's leftover rows go to the smallest fractional parts (torch path)",
    ),
    mutation(
        "water-fill-triton-smallest-remainders",
        "oa_core/ops/water_filling.py",
        [("ahead = (fraction[:, None] > fraction[None, :])", "ahead = (fraction[:, None] < fraction[None, :])")],
        WATER_FILL_TESTS,
        "the Triton water-filling ranks remainders ascending",
    ),
    mutation(
        "pq-tables-float32",
        "plugins/selectors/pq.py",
        [("return tables.float().clamp(-HALF_MAX, HALF_MAX).half().float()", "return tables.float()")],
        PQ_TESTS,
        "PQS scores from float32 tables, not float16 ones as every path rounds them (and past float16's range)",
    ),
    mutation(
        "fused-pq-tables-float32",
        "plugins/kernels/flash_step_programs.py",
        [("entry.to(tl.float16).to(tl.float32),", "entry,")],
        FUSED_TESTS,
        "the fused prologue's PQS tables are not rounded to float16 as the selector's are",
    ),
    mutation(
        "water-fill-triton-full-by-lambda",
        "oa_core/ops/water_filling.py",
        [("quotas = tl.where(passed, cap, tl.minimum(cap, lam * p))", "quotas = tl.minimum(cap, lam * p)")],
        WATER_FILL_TESTS,
        "the Triton water-filling fills a passed cluster by λ, which rounding makes 0 at a breakpoint",
    ),
    mutation(
        "mass-without-cluster-size",
        "plugins/allocators/mass.py",
        [("log_mass = torch.log(counts) + inputs.mean_logit", "log_mass = inputs.mean_logit")],
        ("tests/plugins/test_ablation_components.py",),
        "the mass ablation ranks by e^{z̄_b}, not n_b e^{z̄_b}",
    ),
    mutation(
        "quest-bound-with-bounds-swapped",
        "plugins/selectors/quest.py",
        [
            (
                "q.clamp_min(0) @ hi.transpose(-1, -2) + q.clamp_max(0) @ lo.transpose(-1, -2)",
                "q.clamp_min(0) @ lo.transpose(-1, -2) + q.clamp_max(0) @ hi.transpose(-1, -2)",
            )
        ],
        ("tests/plugins/test_quest.py",),
        "Quest's page bound takes the minimum key where q_d > 0",
    ),
    # -- cluster statistics (§3.1) ----------------------------------------------------------------------------------
    mutation(
        "cluster-stats-variance-scaled-once",
        "oa_core/ops/cluster_stats.py",
        [
            (
                'scale**2 * torch.einsum("bhgtd,bhcd->bhgtc", q * q, key_var)',
                'scale * torch.einsum("bhgtd,bhcd->bhgtc", q * q, key_var)',
            )
        ],
        ("tests/test_cluster_stats.py", "tests/test_pipeline.py"),
        "σ̂² with s instead of s² (torch path)",
    ),
    # -- the kernels (Eq. 1) ----------------------------------------------------------------------------------------
    mutation(
        "kernel-proxy-not-minus-rows-read",
        "plugins/kernels/reference.py",
        [
            ("proxies.key_sum) - read_sum", "proxies.key_sum) - 0 * read_sum"),
            (
                "row_weights = weights[..., : logits.shape[-1]] - torch.cat(",
                "row_weights = weights[..., : logits.shape[-1]] - 0 * torch.cat(",
            ),
        ],
        KERNEL_TESTS,
        "the proxy means include the rows already read exactly",
    ),
    mutation(
        "kernel-proxy-count-n-b",
        "plugins/kernels/reference.py",
        [("tail_count = proxies.count[expand] - read_count", "tail_count = proxies.count[expand] + 0 * read_count")],
        KERNEL_TESTS,
        "the proxy counts n_b, not n_b − |X∩b|",
    ),
    mutation(
        "kernel-proxy-without-log-count",
        "plugins/kernels/reference.py",
        [("proxy_logits = tail_sum / n + torch.log(n)", "proxy_logits = tail_sum / n")],
        KERNEL_TESTS,
        "the proxy logit without + ln n_T: one token's weight for the whole tail",
    ),
    mutation(
        "kernel-ignores-row-weights",
        "plugins/kernels/reference.py",
        [("logits = read_logits + selection.log_weight.float()", "logits = read_logits")],
        KERNEL_TESTS,
        "sampled tail rows weigh 1 instead of η",
    ),
    mutation(
        "flash-proxy-without-log-count",
        "plugins/kernels/flash_programs.py",
        [
            (
                "ell = (qk_scaled - read_z) / n_tail[None, :] + tl.log(n_tail)[None, :]",
                "ell = (qk_scaled - read_z) / n_tail[None, :]",
            )
        ],
        KERNEL_TESTS,
        "the Triton kernel's proxy logit without + ln n_T",
    ),
    mutation(
        "kernel-second-order-without-the-half",
        "plugins/kernels/reference.py",
        [
            (
                "torch.log1p(\n                0.5\n                * tail_logit_variance(",
                "torch.log1p(\n                1.0\n                * tail_logit_variance(",
            )
        ],
        KERNEL_TESTS,
        "the second-order proxy adds ln(1 + σ̂_T²), not ln(1 + σ̂_T²/2)",
    ),
    mutation(
        "kernel-second-order-keeps-the-rows-read",
        "oa_core/ops/cluster_stats.py",
        [
            (
                "spread = ((count[:, :, None, None] * logit_var - d2 - d1 * d1 / n) / n).clamp_min(0)",
                "spread = ((count[:, :, None, None] * logit_var) / n).clamp_min(0)",
            )
        ],
        KERNEL_TESTS,
        "the tail's logit variance keeps the rows read exactly",
    ),
    mutation(
        "kernel-second-order-unbounded",
        "oa_core/ops/cluster_stats.py",
        [("return torch.minimum(spread, gap * gap)", "return spread")],
        KERNEL_TESTS,
        "the tail's logit variance is not bounded by its gap to the least logit read",
    ),
    mutation(
        "flash-stats-of-another-head",
        "plugins/kernels/flash_programs.py",
        [("stat = ((b * Hkv + h) * (Gs * G) + s * G + offs_g)", "stat = ((b * Hkv + h) * (Gs * G) + offs_g)")],
        FUSED_TESTS,
        "the fused step's flash pass reads every selection row's proxies with the group's first head's statistics",
    ),
    mutation(
        "flash-stats-mean-not-summed",
        "plugins/kernels/flash_programs.py",
        [("qk_scaled = mean_logit * tl.maximum(count, 1.0)[None, :]", "qk_scaled = mean_logit")],
        FUSED_TESTS,
        "the fused step's proxy logit takes z̄_b for s·q·Σk_b (the mean for the sum)",
    ),
    mutation(
        "flash-second-order-unbounded",
        "plugins/kernels/flash_programs.py",
        [("ell += tl.log(1.0 + 0.5 * tl.minimum(tail_var, gap * gap))", "ell += tl.log(1.0 + 0.5 * tail_var)")],
        KERNEL_TESTS,
        "the Triton kernel's tail logit variance is not bounded by the gap to the least logit read",
    ),
    mutation(
        "flash-second-order-keeps-the-rows-read",
        "plugins/kernels/flash_programs.py",
        [
            (
                "(count[None, :] * logit_var - d2 - d1 * d1 / n_tail[None, :]) / n_tail[None, :], 0.0",
                "(count[None, :] * logit_var) / n_tail[None, :], 0.0",
            )
        ],
        KERNEL_TESTS,
        "the Triton kernel's tail logit variance keeps the rows read exactly",
    ),
    mutation(
        "flash-tail-keeps-the-rows-read",
        "plugins/kernels/flash_programs.py",
        [("other=0.0) - read_v", "other=0.0)")],
        KERNEL_TESTS,
        "the proxy's values are the cluster's whole Σv_b: the rows read exactly count twice",
    ),
    mutation(
        "flash-free-columns-restart-at-the-runs",
        "plugins/kernels/flash_programs.py",
        [("offs_x = tl.where(offs_x < first, offs_x, offs_x - first + resume)", "offs_x = offs_x")],
        KERNEL_TESTS,
        "the columns after the runs (a selection's rows outside every cluster, padding) are never "
        "read: the chunks' free shares read the runs' first columns again",
    ),
    mutation(
        "flash-free-share-drops-the-remainder",
        "plugins/kernels/flash_programs.py",
        [("per = tl.cdiv(free, PARTS)", "per = free // PARTS")],
        KERNEL_TESTS,
        "the free columns that do not divide evenly among the chunks are never read",
    ),
    mutation(
        "flash-merge-by-the-first-part",
        "plugins/kernels/flash_programs.py",
        [('sem="acq_rel", scope="gpu") == PARTS - 1:', 'sem="acq_rel", scope="gpu") == 0:')],
        KERNEL_TESTS,
        "a row's first part to finish merges the row, before the other parts are written",
    ),
    mutation(
        "fused-step-arrivals-not-zeroed",
        "plugins/kernels/plan_programs.py",
        [("        tl.store(ARRIVALS + p, (p * 0).to(tl.int32))\n", "")],
        ("tests/test_flash_step.py",),
        "the fused step's plan leaves the flash pass's counters as the allocator gave them: a row may be merged by "
        "the wrong part, or never",
    ),
    # -- selection ---------------------------------------------------------------------------------------------------
    mutation(
        "triton-selection-grid-one-short",
        "oa_core/ops/selection.py",
        [("_select_kernel[(rows * C,)](", "_select_kernel[(rows * C - 1,)](")],
        ("tests/test_selection.py",),
        "the selection's grid (a row's clusters side by side) one program short: the last row's last cluster selects "
        "nothing",
    ),
    mutation(
        "triton-selection-ties-to-the-last-position",
        "oa_core/ops/selection.py",
        [
            ("| (-lanes + (BLOCK - 1)).to(tl.int64)", "| lanes.to(tl.int64)"),
            ("lane = (-(top & 0xFFFFFFFF) + (BLOCK - 1)).to(tl.int32)", "lane = (top & 0xFFFFFFFF).to(tl.int32)"),
        ],
        ("tests/test_selection.py",),
        "among tied scores a cluster's pick goes to the last position",
    ),
    mutation(
        "lsh-extend-without-centering",
        "plugins/selectors/lsh.py",
        [
            (
                '{"buckets": self._hash(index, keys.float() - index.center)}',
                '{"buckets": self._hash(index, keys.float())}',
            )
        ],
        ("tests/plugins/test_lsh.py", "tests/test_conformance.py"),
        "decode-time growth hashes new keys without the centring the build applied",
    ),
    # -- spec ---------------------------------------------------------------------------------------------------------
    mutation(
        "spec-budget-rounds-up",
        "oa_core/spec.py",
        [("torch.floor(num_tokens.double() * self.density)", "torch.ceil(num_tokens.double() * self.density)")],
        (*SPEC_TESTS, "tests/test_pipeline.py", "tests/test_conformance.py"),
        "a density budget rounds up, reading more than the density",
    ),
    mutation(
        "spec-tail-samples-unbounded",
        "oa_core/spec.py",
        [("default=0.5,\n        gt=0,\n        le=1,", "default=0.5,\n        gt=0,")],
        SPEC_TESTS,
        "tail_samples above 1 is accepted (it fails later, blaming the allocator)",
    ),
    mutation(
        "spec-local-unbounded",
        "oa_core/spec.py",
        [("local: int = Field(default=64, ge=0,", "local: int = Field(default=64,")],
        SPEC_TESTS,
        "a negative local window is accepted and runs",
    ),
    mutation(
        "resolved-spec-keeps-given-params-only",
        "oa_core/pipeline.py",
        [('data[kind]["params"] = getattr(self, kind).config.model_dump(mode="json")', "pass")],
        ("tests/test_spec.py", "tests/test_eval_runner.py"),
        "a record's spec names only the params it was given: after a default changes it reads as the new default",
    ),
    # -- the pipeline --------------------------------------------------------------------------------------------------
    mutation(
        "pipeline-budget-ignores-fixed-rows",
        "oa_core/state.py",
        [
            (
                "selectable = (self.pipeline.spec.budget.rows(lengths)[:, None] - fixed_counts).clamp_min(0)",
                "selectable = (self.pipeline.spec.budget.rows(lengths)[:, None] + 0 * fixed_counts).clamp_min(0)",
            )
        ],
        PIPELINE_TESTS,
        "the selector gets the whole budget on top of sink and local",
    ),
    mutation(
        "pipeline-growth-skips-pooled-sums",
        "oa_core/state.py",
        [("            self._pool(ids, self.keys[:, :, leaving], self.values[:, :, leaving])\n", "")],
        PIPELINE_TESTS,
        "rows leaving the local window join a cluster but not its pooled sums",
    ),
    mutation(
        "pipeline-variance-without-mean-square",
        "oa_core/ops/cluster_stats.py",
        [("(key_square_sum / n - mean * mean)", "(key_square_sum / n)")],
        PIPELINE_TESTS,
        "Var_b(k) from the pooled sums as E[k²], not E[k²] − k̄²",
    ),
    mutation(
        "pipeline-growth-leaves-one-late",
        "oa_core/state.py",
        [("leaving_end = self.clustered_end", "leaving_end = self.clustered_end - 1")],
        PIPELINE_TESTS,
        "the local window keeps one row too many after growth",
    ),
    mutation(
        "pipeline-causal-hides-own-position",
        "oa_core/pipeline.py",
        [
            (
                "selection.index.masked_fill(selection.index > own, -1)",
                "selection.index.masked_fill(selection.index >= own, -1)",
            )
        ],
        (*PIPELINE_TESTS, "tests/test_integration.py"),
        "a causal query does not see its own key",
    ),
    mutation(
        "pipeline-tail-samples-weigh-pool-size",
        "oa_core/pipeline.py",
        [("log_eta = torch.log(size / taken).expand(drawn.shape)", "log_eta = torch.log(size).expand(drawn.shape)")],
        PIPELINE_TESTS,
        "a tail sample weighs |pool| instead of |pool|/m",
    ),
    # -- the fast decode path -----------------------------------------------------------------------------------------
    mutation(
        "static-join-forgets-the-count",
        "oa_core/static.py",
        [
            (
                "tl.store(COUNT + cluster, tl.load(COUNT + cluster) + 1.0)",
                "tl.store(COUNT + cluster, tl.load(COUNT + cluster) + 0.0)",
            )
        ],
        STATIC_TESTS,
        "the row leaving the window joins its cluster's sums but not its count",
    ),
    mutation(
        "static-window-one-behind",
        "oa_core/static.py",
        [
            (
                "return self.fixed_base + self.length * self.fixed_moves",
                "return self.fixed_base + (self.length - 1) * self.fixed_moves",
            )
        ],
        STATIC_TESTS,
        "the local window the step reads lags one token behind",
    ),
    mutation(
        "static-cache-check-ignores-capacity",
        "oa_core/static.py",
        [("if tuple(tensor.shape[:3]) != want or", "if tuple(tensor.shape[:2]) != want[:2] or")],
        STATIC_TESTS,
        "a cache with fewer slots than the state's capacity is taken, and the kernels read its rows at the wrong place",
    ),
    mutation(
        "static-new-row-not-indexed",
        "oa_core/static.py",
        [("getattr(self.index, name).index_copy_(2, newest, codes)", "getattr(self.index, name)")],
        STATIC_TESTS,
        "the new row gets no selector codes",
    ),
    mutation(
        "static-stats-from-sums-without-mean-square",
        "oa_core/ops/cluster_stats.py",
        [
            (
                "return mean, tl.maximum(tl.div_rn(key_square_sum, n) - mean * mean, 0.0)",
                "return mean, tl.maximum(tl.div_rn(key_square_sum, n), 0.0)",
            )
        ],
        STATIC_TESTS + FUSED_TESTS + ("tests/test_cluster_stats.py",),
        "the step's cluster variance is E[k²], not E[k²] − k̄²",
    ),
    mutation(
        "dense-decode-reads-padding",
        "oa_core/ops/dense_decode.py",
        [("first = tl.maximum(tl.load(START + b), split * SPLIT)", "first = split * SPLIT")],
        ("tests/test_dense_decode.py", "tests/test_static_cache.py"),
        "dense decode reads a row's left padding",
    ),
    mutation(
        "static-state-over-another-arena-keeps-its-own",
        "oa_core/static.py",
        [("if length is self.length and arena is self.arena:", "if length is self.length:")],
        STATIC_TESTS,
        "a state handed another arena with its own length tensor keeps writing its own buffers",
    ),
    mutation(
        "static-pack-leaves-the-arena-unfilled",
        "oa_core/static.py",
        [("        view.copy_(tensors[name])\n", "        view.zero_()\n")],
        STATIC_TESTS,
        "the arena's views are zeros, not the prepared state (clusters, sums, codes lost)",
    ),
    mutation(
        "static-op-writes-the-states-own-tensors",
        "oa_core/integration/static_cache.py",
        [
            (
                "return _STATES[key].with_buffers(state).step(query, keys, values)",
                "return _STATES[key].step(query, keys, values)",
            )
        ],
        ("tests/test_static_cache.py",),
        "the compiled op writes the state's tensors, not the buffers the compiler gave it (growth lost)",
    ),
    mutation(
        "static-capacity-unchecked",
        "oa_core/integration/static_cache.py",
        [("int(self.cumulative_length) + 1 > self.max_cache_len", "int(self.cumulative_length) > self.max_cache_len")],
        ("tests/test_static_cache.py",),
        "a step one past the capacity is let through",
    ),
    # -- the fused static step (flash) ----------------------------------------------------------------------------
    mutation(
        "fused-codes-round-halves-up",
        "plugins/kernels/flash_step_programs.py",
        [("return tl.where((f > 0.5) | ((f == 0.5) & odd), r + 1.0, r)", "return tl.where(f >= 0.5, r + 1.0, r)")],
        FUSED_TESTS,
        "the new row's codes round halves up, where QGS's quantize rounds them to even",
    ),
    mutation(
        "fused-pq-code-last-of-equals-across-tiles",
        "plugins/selectors/pq_programs.py",
        [("better = distance < best", "better = distance <= best")],
        ("tests/test_flash_step.py::test_the_new_rows_pqs_codes_are_the_first_nearest_centroid_across_tiles",),
        "the new row's PQS code takes a later tile's equal centroid, where encode takes the first",
    ),
    mutation(
        "fused-pq-code-without-the-centroid-norm",
        "plugins/selectors/pq_programs.py",
        [
            (
                "distance = tl.sum(centre * centre, axis=1)[None, :] - 2.0 * tl.sum(x * centre[None, :, :], axis=2)",
                "distance = -2.0 * tl.sum(x * centre[None, :, :], axis=2)",
            )
        ],
        FUSED_TESTS + PQ_GPU_TESTS,
        "the GPU's PQS codes (prepare's, the new row's) are the centroids of largest dot product, not the nearest",
    ),
    mutation(
        "fused-pq-tables-of-one-head",
        "plugins/kernels/flash_step_programs.py",
        [
            (
                "q = tl.load(Q + b * sq_b + (h * G + j) * sq_h + sub, mask=sub_ok, other=0.0).to(tl.float32)",
                "q = tl.load(Q + b * sq_b + (h * G) * sq_h + sub, mask=sub_ok, other=0.0).to(tl.float32)",
            )
        ],
        FUSED_TESTS,
        "every query head of a KV group scores by the group's first head's tables",
    ),
    mutation(
        "pq-shortlist-takes-one-tie-too-many",
        "plugins/kernels/pq_shortlist_programs.py",
        [
            (
                "keep = ok & ((key > taus[:, None]) | (tie & (rank < ties[:, None])))",
                "keep = ok & ((key > taus[:, None]) | (tie & (rank <= ties[:, None])))",
            )
        ],
        ("tests/test_flash_step.py::test_pqs_three_launch_shortlist_leaves_what_the_scores_and_seven_launches_leave",),
        "PQS's shortlist lists one more tie at the cut than the reference's stable sort",
    ),
    mutation(
        "pq-shortlist-reads-k-for-the-rows-all-heads-list",
        "plugins/kernels/pq_shortlist_programs.py",
        [("union = tl.max(keep.to(tl.int32), axis=0) > 0", "union = tl.min(keep.to(tl.int32), axis=0) > 0")],
        ("tests/test_flash_step.py::test_pqs_three_launch_shortlist_leaves_what_the_scores_and_seven_launches_leave",),
        "PQS's shortlist reads a K row only where every head lists it: the others' exact logits are 0",
    ),
    mutation(
        "clustered-range-leaves-the-leaving-row-out",
        "plugins/kernels/two_stage_programs.py",
        [
            (
                "return (offs >= tl.load(START + b) + SINK) & (offs <= n - 1 - LOCAL)",
                "return (offs >= tl.load(START + b) + SINK) & (offs < n - 1 - LOCAL)",
            )
        ],
        (
            "tests/test_flash_step.py::test_pqs_three_launch_shortlist_leaves_what_the_scores_and_seven_launches_leave",
            *FUSED_TWO_STAGE_TESTS,
        ),
        "the fused shortlists (PQS's scores, QGS's radix pass) mask the row leaving the window, which joins a cluster "
        "in this step, whether or not its join has run",
    ),
    mutation(
        "pq-shortlist-drops-single-count-bins",
        "plugins/kernels/pq_shortlist_programs.py",
        [("counted = (rows < GS)[:, None] & (hist > 0)", "counted = (rows < GS)[:, None] & (hist > 1)")],
        ("tests/test_flash_step.py::test_pqs_three_launch_shortlist_leaves_what_the_scores_and_seven_launches_leave",),
        "a score chunk adds only the first-digit bins it counts twice or more: the row's histogram loses keys",
    ),
    mutation(
        "pq-shortlist-places-count-every-tie-before",
        "plugins/kernels/pq_shortlist_programs.py",
        [
            (
                "place = tl.cumsum(above, axis=0) - above + tl.minimum(tied_before, ties)",
                "place = tl.cumsum(above, axis=0) - above + tied_before",
            )
        ],
        ("tests/test_flash_step.py::test_pqs_three_launch_shortlist_leaves_what_the_scores_and_seven_launches_leave",),
        "a segment's place counts every tie at the cut before it, not only those the shortlist takes",
    ),
    mutation(
        "pq-cut-counts-past-its-segment",
        "plugins/kernels/pq_shortlist_programs.py",
        [
            (
                'value = tl.load(row + offs, mask=offs < end, other=float("-inf"))',
                'value = tl.load(row + offs, mask=offs < n, other=float("-inf"))',
            ),
            ('ok = (offs < end) & (value > float("-inf"))', 'ok = (offs < n) & (value > float("-inf"))'),
        ],
        ("tests/test_flash_step.py::test_the_two_stage_selection_and_the_floor_read_the_reference_rows",),
        "a segment's place counts the keys of a block that runs past the segment's end (a block wider than it)",
    ),
    mutation(
        "pq-cut-last-digit-counts-every-kept-key",
        "plugins/kernels/pq_shortlist_programs.py",
        [
            (
                "last += tl.histogram(radix_digit(key, 0, 8), 256, mask=(offs < kept) & ((key >> 8) == prefix))",
                "last += tl.histogram(radix_digit(key, 0, 8), 256, mask=offs < kept)",
            )
        ],
        ("tests/test_flash_step.py::test_pqs_cut_of_scores_that_share_their_first_digits_is_the_stable_sorts",),
        "the cut's last digit counts every key kept near the cut, not only those that share its first three digits",
    ),
    mutation(
        "pq-list-drops-a-gathered-row",
        "plugins/kernels/pq_shortlist_programs.py",
        [("entry_ok = entry < gathered", "entry_ok = entry < gathered - 1")],
        ("tests/test_flash_step.py::test_pqs_three_launch_shortlist_leaves_what_the_scores_and_seven_launches_leave",),
        "the listing takes no exact logit for the last of a block's gathered rows",
    ),
    mutation(
        "fused-budget-ignores-left-padding",
        "plugins/kernels/two_stage_programs.py",
        [("valid = length - tl.load(START + b)", "valid = length")],
        FUSED_TESTS,
        "a left-padded row's budget counts its padding as context",
    ),
    mutation(
        "fused-nearest-without-the-centroid-norm",
        "plugins/kernels/flash_step_programs.py",
        [
            (
                "distance = tl.sum(centre * centre, axis=1) - 2 * tl.sum(centre * point[None, :], axis=1)",
                "distance = -2 * tl.sum(centre * point[None, :], axis=1)",
            )
        ],
        FUSED_TESTS,
        "the leaving row joins the centroid of largest dot product, not the nearest",
    ),
    mutation(
        "fused-leaving-row-one-late",
        "plugins/kernels/flash_step_programs.py",
        [("leaving = newest - LOCAL", "leaving = newest - LOCAL + 1")],
        FUSED_TESTS,
        "the row that joins a cluster is still inside the local window",
    ),
    mutation(
        "fused-queries-projected-from-one-head",
        "plugins/kernels/flash_step_programs.py",
        [("(h * G + j) * sq_h + offs_d", "(h * G) * sq_h + offs_d")],
        FUSED_TESTS,
        "every query head of a group is scored with the group's first head",
    ),
    mutation(
        "fused-join-counted-in-the-first-chunk-only",
        "plugins/kernels/flash_step_programs.py",
        [("count = tl.where(joins, count + 1.0, count)", "count = tl.where(joins & (chunk == 0), count + 1.0, count)")],
        FUSED_TESTS,
        "a row joining a cluster past the first 16 is not counted (nor its statistics updated)",
    ),
    mutation(
        "fused-statistics-before-the-join",
        "plugins/kernels/flash_step_programs.py",
        [
            (
                "mean, var = moments_tile(key_sum, key_square_sum, count)",
                "mean, var = moments_tile(tl.where(joins[:, None], key_sum - k[None, :], key_sum),\n"
                "            tl.where(joins[:, None], key_square_sum - (k * k)[None, :], key_square_sum),\n"
                "            tl.where(joins, count - 1.0, count))",
            )
        ],
        FUSED_TESTS,
        "the allocator sees each cluster's mean key as it was before the step's join",
    ),
    mutation(
        "fused-window-one-behind",
        "plugins/kernels/plan_programs.py",
        [
            (
                "other=0) + length * tl.load(\n            FIXED_MOVES",
                "other=0) + (length - 1) * tl.load(\n            FIXED_MOVES",
            )
        ],
        FUSED_TESTS,
        "the local window the fused step reads lags one token behind",
    ),
    # -- two-stage selection (QGS rerank) and ErrorGate's floor -----------------------------------------------------
    mutation(
        "two-stage-rerank-keeps-cheap-scores",
        "oa_core/ops/rerank.py",
        [("torch.where(listed, exact, out.gather(-1, top))", "torch.where(listed, cut, out.gather(-1, top))")],
        TWO_STAGE_TESTS,
        "the shortlist keeps its codes' scores: nothing is re-ranked by exact logits",
    ),
    mutation(
        "two-stage-rest-not-shifted",
        "oa_core/ops/rerank.py",
        [
            (
                "    out = scores + torch.where(listed.any(-1, keepdim=True), lowest - last - 1, 0.0)\n",
                "    out = scores.clone()\n",
            )
        ],
        TWO_STAGE_TESTS,
        "the rows outside the shortlist keep their codes' scores, so they may outrank shortlisted exact logits",
    ),
    mutation(
        "two-stage-shortlist-ignores-row-budget",
        "oa_core/ops/rerank.py",
        [("torch.ceil(multiple * budget.double())", "torch.ceil(multiple * torch.full_like(budget.double(), width))")],
        TWO_STAGE_TESTS,
        "every row's shortlist is sized by the widest row's budget, not its own",
    ),
    mutation(
        "errorgate-floor-rest-uncapped",
        "plugins/allocators/errorgate.py",
        [
            (
                "rest = water_fill(priority, counts - first, inputs.budget - first.sum(-1))",
                "rest = water_fill(priority, counts, inputs.budget - first.sum(-1))",
            )
        ],
        TWO_STAGE_TESTS,
        "the water-filled rest ignores the floor's reads, so a cluster may get more than it holds",
    ),
    mutation(
        "errorgate-floor-reads-nothing-first",
        "plugins/allocators/errorgate.py",
        [
            (
                "first_budget = torch.floor(self.config.floor * inputs.budget.double()).long()",
                "first_budget = torch.zeros_like(inputs.budget)",
            )
        ],
        TWO_STAGE_TESTS,
        "the floor is parsed but no best-scored row is read first: the paper's ErrorGate",
    ),
    # -- the fused step's two-stage launches (plugins/kernels/two_stage.py) -------------------------------------------
    mutation(
        "fused-two-stage-ties-by-position-off-by-one",
        "plugins/kernels/two_stage_programs.py",
        [("return ok & ((key > tau) | (tie & (rank < ties)))", "return ok & ((key > tau) | (tie & (rank <= ties)))")],
        FUSED_TWO_STAGE_TESTS,
        "one tie too many taken at the cut: the shortlist or the floor is a row longer",
    ),
    mutation(
        "fused-two-stage-radix-digit-own-count-taken",
        "plugins/kernels/two_stage_programs.py",
        [
            (
                "return digit, rest - tl.sum(tl.where(bins == digit, total - inclusive, 0), axis=0)",
                "return digit, rest - tl.sum(tl.where(bins == digit, total - inclusive + hist, 0), axis=0)",
            )
        ],
        FUSED_TWO_STAGE_TESTS,
        "a digit's own count taken as above the cut: the lower digits look for too few",
    ),
    mutation(
        "fused-two-stage-rest-not-shifted",
        "oa_core/ops/selection.py",
        [("unlisted = tl.where(boxed, 0.0, score) + shift", "unlisted = tl.where(boxed, 0.0, score)")],
        FUSED_TWO_STAGE_TESTS,
        "the fused step's selection leaves unlisted rows their codes' scores beside exact logits",
    ),
    mutation(
        "fused-two-stage-box-names-the-next-entry",
        "oa_core/ops/selection.py",
        [
            (
                "entry = (score.to(tl.int32, bitcast=True) & 0x7FFFFF) - 1",
                "entry = score.to(tl.int32, bitcast=True) & 0x7FFFFF",
            )
        ],
        FUSED_TWO_STAGE_TESTS,
        "the selection reads a listed position's exact logit one shortlist entry off (the box's payload is entry + 1)",
    ),
    mutation(
        "fused-two-stage-shift-reversed",
        "plugins/kernels/two_stage_programs.py",
        [("tl.where(k > 0, (lowest - last) - 1.0, 0.0)", "tl.where(k > 0, (last - lowest) - 1.0, 0.0)")],
        FUSED_TWO_STAGE_TESTS,
        "the unlisted scores shifted the wrong way: above the shortlist's exact logits where the codes score high",
    ),
    mutation(
        "fused-qgs-listing-unboxed",
        "plugins/kernels/two_stage_programs.py",
        [("listed_box(offs.to(tl.int32)), mask=pos_ok)", "listed_box(offs.to(tl.int32) + 1), mask=pos_ok)")],
        FUSED_TWO_STAGE_TESTS,
        "QGS's listing boxes each listed score with the next entry's number: the selection reads the wrong exact logit",
    ),
    mutation(
        "pq-shortlist-listing-unboxed",
        "plugins/kernels/pq_shortlist_programs.py",
        [("listed_box(slot), mask=listed)  # its box", "value, mask=listed)  # its box")],
        (
            *FUSED_TWO_STAGE_TESTS,
            "tests/test_flash_step.py::test_pqs_three_launch_shortlist_leaves_what_the_scores_and_seven_launches_leave",
        ),
        "PQS's listing leaves the listed scores as the codes scored them: the selection never reads the exact logits",
    ),
    mutation(
        "fused-two-stage-ties-before-a-segment-inclusive",
        "plugins/kernels/two_stage_programs.py",
        [("tied_before = tl.cumsum(tied, axis=0) - tied", "tied_before = tl.cumsum(tied, axis=0)")],
        FUSED_TWO_STAGE_TESTS,
        "a segment counts its own ties at the cut as earlier ones: ties taken out of order",
    ),
    mutation(
        "fused-floor-rows-dropped",
        "plugins/kernels/plan_programs.py",
        [("            quotas = first + rest\n", "            quotas = rest\n")],
        FUSED_TWO_STAGE_TESTS,
        "the fused plan water-fills the rest but forgets the floor's own rows",
    ),
    # -- the transformers integration --------------------------------------------------------------------------------
    mutation(
        "integration-route-dense-question",
        "oa_core/integration/runtime.py",
        [
            (
                'LayerRuntime(module.layer_idx, build(spec), question="sparse")',
                'LayerRuntime(module.layer_idx, build(spec), question="dense")',
            )
        ],
        ("tests/test_integration.py",),
        "attn_implementation='openattention' attends the question densely (setup A) though B is the default",
    ),
    mutation(
        "static-decode-ignores-the-window",
        "oa_core/integration/runtime.py",
        [("if static.prefilled and self.keeps_own:", "if static.prefilled and self.eager:")],
        ("tests/test_sliding_layers.py",),
        "a static cache decodes a sliding-window layer over every slot (the window forgotten after the prompt)",
    ),
    mutation(
        "own-math-ignored",
        "oa_core/integration/prefill.py",
        [
            (
                '        return f"dense: {what} ({name}={shown})',
                '        return None and f"dense: {what} ({name}={shown})',
            )
        ],
        ("tests/test_sliding_layers.py",),
        "a layer whose attention caps its logits or adds sink logits goes sparse (or through sdpa) without them",
    ),
    mutation(
        "own-math-mask-left-boolean",
        "oa_core/integration/prefill.py",
        [("    if attention_mask is not None and attention_mask.dtype == torch.bool:", "    if False:")],
        ("tests/test_sliding_layers.py",),
        "the model's eager attention gets sdpa's boolean mask, which it adds to the logits as 0/1",
    ),
    mutation(
        "patch-needs-kv-groups",
        "oa_core/integration/runtime.py",
        [('        hasattr(module, "layer_idx")\n', '        hasattr(module, "num_key_value_groups")\n')],
        ("tests/test_other_decoders.py",),
        "only attention with num_key_value_groups is patched: GPT-2, GPT-NeoX and OPT are refused",
    ),
    mutation(
        "latent-attention-made-sparse",
        "oa_core/integration/prefill.py",
        [("    if key.shape[-1] == value.shape[-1]:\n        return None", "    if True:\n        return None")],
        ("tests/test_other_decoders.py",),
        "a layer whose values are narrower than its keys (DeepSeek's latent attention) is given to a pipeline",
    ),
    mutation(
        "route-takes-encoder-attention",
        "oa_core/integration/runtime.py",
        [("if runtime is None and not is_causal_self_attention(module):", "if False:")],
        ("tests/test_integration.py",),
        "the attn_implementation= route makes a runtime for a vision tower's bidirectional attention",
    ),
    mutation(
        "mask-bias-ignored",
        "oa_core/integration/prefill.py",
        [("if attention_mask is not None and attention_mask.is_floating_point():", "if False:")],
        ("tests/test_other_decoders.py",),
        "a float mask carrying ALiBi's bias is read as validity only, and the layer goes sparse without the bias",
    ),
    mutation(
        "eval-positions-not-warned",
        "oa_core/eval/runner.py",
        [
            (
                "past = [n for n in lengths if trained and n >= trained]",
                "past = [n for n in lengths if trained and n > trained]",
            )
        ],
        ("tests/test_eval_runner.py",),
        "oa eval is silent where RULER's prompts fill every position the model was trained on (SmolLM2 at 8K)",
    ),
    mutation(
        "static-beams-reordered-silently",
        "oa_core/integration/static_cache.py",
        [("if self.state is not None and not torch.equal(beam_idx.cpu(), torch.arange(len(beam_idx))):", "if False:")],
        ("tests/test_static_cache.py",),
        "beam search reorders the static cache's rows and the per-row state stays where it was",
    ),
    mutation(
        "foreign-static-cache-read-as-keys",
        "oa_core/integration/runtime.py",
        [("    return not bool(key[:, :, -1].any())", "    return False")],
        ("tests/test_static_cache.py",),
        "an unpadded prompt on transformers' static cache: its empty slots go to the pipeline as keys",
    ),
    mutation(
        "foreign-static-mask-ignored",
        "oa_core/integration/runtime.py",
        [("        return not bool(key_mask(attention_mask, key)[:, -1].any())", "        return False")],
        ("tests/test_static_cache.py",),
        "transformers' static cache under a mask (its decode steps, a padded prompt): the empty slots read as keys",
    ),
    mutation(
        "dense-layer-steps-called-prefill",
        "oa_core/integration/runtime.py",
        [('phase = "prefill" if past == 0 else "question" if T > 1 else "decode"', 'phase = "prefill"')],
        ("tests/test_sliding_layers.py",),
        "the stats call every step of a layer that keeps its own attention a prefill",
    ),
    # -- any decoder: head dim 256, base models, the transformers floor ------------------------------------------------
    mutation(
        "flash-blocks-ignore-the-head-dim",
        "plugins/kernels/flash.py",
        [("return 64 if block_d <= 64 else 16", "return 64")],
        ("tests/plugins/test_kernel_resources.py", "tests/plugins/test_flash_kernel.py"),
        "flash's pass takes 64-column blocks at every head dim: 18 KB a thread spilled at 256",
    ),
    mutation(
        "lloyd-blocks-ignore-the-dims",
        "oa_core/ops/kmeans.py",
        [("return 128 if block_r <= 128 else 16", "return 128")],
        ("tests/plugins/test_kernel_resources.py",),
        "the Lloyd step and nearest centroid take 128 points at every dim: 384 KB of shared memory at 256",
    ),
    mutation(
        "plain-prompt-without-bos",
        "oa_core/analysis/offline_model.py",
        [('    return tokenizer.decode(lead) + "".join(', '    return "".join(')],
        ("tests/test_offline_model.py",),
        "a base model's prompt loses the <bos> its tokenizer starts a text with",
    ),
    mutation(
        "qgs-key-rank-ignored",
        "plugins/selectors/qgs.py",
        [("        if cfg.key_rank:\n", "        if False:\n")],
        QGS_TESTS,
        "QGS's key_rank shrinks the query basis but never adds the keys' spread",
    ),
    mutation(
        "key-spread-not-projected-off-the-basis",
        "oa_core/ops/geometry.py",
        [("top_eigenpairs(off @ covariance @ off, extra)", "top_eigenpairs(covariance, extra)")],
        QGS_TESTS,
        "the keys' spread is taken whole, not outside the query subspace: its top directions repeat the basis",
    ),
    mutation(
        "key-rank-default-zero",
        "plugins/selectors/qgs.py",
        [("            self.key_rank = self.rank // 2\n", "            self.key_rank = 0\n")],
        QGS_TESTS,
        "the default QGS basis is the query geometry alone again (key_rank 0), not half from the keys",
    ),
    mutation(
        "key-spread-over-unclustered-keys",
        "plugins/selectors/qgs.py",
        [
            (
                "with_key_spread(basis, keys, region, cfg.key_rank)",
                "with_key_spread(basis, keys, torch.ones_like(region), cfg.key_rank)",
            )
        ],
        QGS_TESTS,
        "the keys' spread is taken over every key, sink and local window included, not the clustered ones",
    ),
    mutation(
        "transformers-floor-unchecked",
        "oa_core/integration/runtime.py",
        [
            (
                "    if tuple(int(part) for part in re.findall(",
                "    if False and tuple(int(part) for part in re.findall(",
            )
        ],
        ("tests/test_offline_model.py",),
        "a transformers below the declared floor is used as it is",
    ),
    mutation(
        "cluster-design-with-candidates",
        "benchmarks/step_cost.py",
        [
            (
                '(found["candidates_bucketed"], found["reread_codes"]) if design == "one_program" else (0.0, 0.0)',
                '(found["candidates_bucketed"], found["reread_codes"])',
            )
        ],
        ("tests/test_step_cost.py",),
        "the cluster design is projected with the one-program design's candidates and code re-reads",
    ),
    mutation(
        "pq-scores-count-the-sink",
        "plugins/kernels/pq_shortlist_programs.py",
        [("clustered(offs, START, head // Hkv, SINK, LOCAL, n)", "clustered(offs, START, head // Hkv, 0, LOCAL, n)")],
        ("tests/test_flash_step.py",),
        "PQS's fused scores take the sink's rows as clustered: they may be listed and selected beside the sink itself",
    ),
    mutation(
        "radix-pass-skips-the-first-clustered-row",
        "plugins/kernels/two_stage_programs.py",
        [
            (
                "~clustered(offs, START, p // (Gs * Hkv), F - LOCAL, LOCAL, n)",
                "~clustered(offs, START, p // (Gs * Hkv), F - LOCAL + 1, LOCAL, n)",
            )
        ],
        ("tests/test_flash_step.py",),
        "QGS's fused shortlist masks the first row past the sink, which is in a cluster: it is never listed",
    ),
    mutation(
        "member-lists-read-once-a-group",
        "benchmarks/step_cost.py",
        [("else score_rows * clusterable * MEMBER_BYTES", "else clusterable * MEMBER_BYTES")],
        ("tests/test_step_cost.py",),
        "the cost model counts the member lists once per KV head where each selection row reads its own",
    ),
    mutation(
        "flash-pass-proxies-read-once-a-group",
        "benchmarks/step_cost.py",
        [("    return statistics + score_rows * (head_dim + 1)", "    return statistics + (head_dim + 1)")],
        ("tests/test_step_cost.py",),
        "the cost model counts the built flash pass's Σv and counts once per KV head, not once per selection row",
    ),
    mutation(
        "cuda-shortlist-signature-drifts",
        "plugins/kernels/pq_shortlist_cuda.py",
        [('POINTERS = ("tables", "codes", "length", "start",', 'POINTERS = ("tables", "codes", "start", "length",')],
        ("tests/test_pq_shortlist_cuda.py",),
        "the wrapper passes the CUDA shortlist's length and start pointers swapped (no GPU in CI runs the kernel)",
    ),
    mutation(
        "exact-logits-never-box",
        "plugins/kernels/two_stage.py",
        [("BOX=box,", "BOX=False,")],
        ("tests/test_flash_step.py",),
        "exact_logits leaves the listed scores unboxed where the shortlist's own launch did not box them (QGS's): the "
        "selection ranks them by their codes' scores, not their exact logits",
    ),
    mutation(
        "floor-takes-one-tie-too-many",
        "plugins/kernels/two_stage_programs.py",
        [
            (
                "keep, block_ties = _kept(unsigned_key(value), offs < k, tau2, ties2, tied)",
                "keep, block_ties = _kept(unsigned_key(value), offs < k, tau2, ties2 + 1, tied)",
            )
        ],
        ("tests/test_floor_counts.py",),
        "ErrorGate's floor takes one more of the entries tied at its cut than its count leaves",
    ),
    mutation(
        "cuda-shortlist-ignores-oa-cuda",
        "plugins/kernels/pq_shortlist_cuda.py",
        [('if os.environ.get("OA_CUDA", "1") == "0":', 'if os.environ.get("OA_CUDA", "1") == "off":')],
        ("tests/test_pq_shortlist_cuda.py",),
        "OA_CUDA=0 does not turn the CUDA shortlist off",
    ),
    mutation(
        "cuda-shortlist-declared-as-three",
        "plugins/kernels/flash_step.py",
        [
            (
                "shortlist = pq_shortlist_cuda.launch_names() if cuda else scoring.SHORTLIST",
                "shortlist = scoring.SHORTLIST",
            )
        ],
        ("tests/test_pq_shortlist_cuda.py", "tests/test_step_cost.py"),
        "the step with the CUDA shortlist declares (and the cost model counts) Triton's three launches",
    ),
    mutation(
        "cuda-shortlist-scores-counted-five-times",
        "benchmarks/step_cost.py",
        [("CUDA_SCORE_PASSES = 2", "CUDA_SCORE_PASSES = 5")],
        ("tests/test_step_cost.py",),
        "the cost model counts the CUDA shortlist's scores as going through memory five times",
    ),
    mutation(
        "listing-check-misses-unlisted-better-keys",
        "benchmarks/studies/pq_shortlist_phases.py",
        [("(inside & (theirs > tau + tolerance) & ~chosen).any() or ", "")],
        ("tests/test_pq_shortlist_cuda.py",),
        "the shortlist check passes a shortlist that leaves out a key clearly above the cut",
    ),
]


def _copy_checkout(destination: Path) -> None:
    listed = (
        subprocess.run(
            ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
            cwd=ROOT,
            check=True,
            capture_output=True,
        )
        .stdout.decode()
        .split("\0")
    )
    for name in filter(None, listed):
        source = ROOT / name
        if source.is_file():
            target = destination / name
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target)


def _apply(source: Path, m: Mutation) -> str:
    """Rewrite ``m.file`` in the copy; → its original text. Each edit must match exactly once."""
    path = source / m.file
    original = text = path.read_text()
    for old, new in m.edits:
        count = text.count(old)
        if count != 1:
            raise SystemExit(f"mutation {m.name}: {old!r} occurs {count} times in {m.file}, not once: update the list")
        text = text.replace(old, new)
    path.write_text(text)
    return original


def _environment(site: Path) -> dict[str, str]:
    """The copy first on the path (``site`` links ``oa_core`` and ``oa_plugins`` to it), no bytecode cache (a module
    rewritten twice within a second must not load stale), the Triton kernels in their interpreter, and the essays
    where this checkout finds them (the copy has no ``../shared`` beside it: the tests that need them would skip)."""
    from oa_core.analysis.offline_model import haystack_candidates

    found = next((path.parent for path in haystack_candidates() if path.is_file()), None)
    data = {"OA_DATA_DIR": str(found)} if found and "OA_DATA_DIR" not in os.environ else {}
    return {**os.environ, **data, "PYTHONPATH": str(site), "PYTHONDONTWRITEBYTECODE": "1", "TRITON_INTERPRET": "1"}


def _check_imports_from(source: Path, site: Path) -> None:
    """Both import packages must load from the copy (an installed package found first would test nothing)."""
    code = "import oa_core, oa_plugins; print(oa_core.__file__); print(oa_plugins.__file__)"
    files = subprocess.run(
        [sys.executable, "-c", code], cwd=source, env=_environment(site), check=True, capture_output=True, text=True
    ).stdout.split()
    resolved = [Path(f).resolve() for f in files]
    if not all(f.is_relative_to(source.resolve()) for f in resolved):
        raise SystemExit(f"the copy's packages are shadowed by {', '.join(map(str, resolved))}")


def _pytest(source: Path, site: Path, tests: tuple[str, ...]) -> tuple[int, list[str], str]:
    """→ (exit code, ids of the failed tests, output's tail)."""
    env = _environment(site)
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rfE", *tests],
        cwd=source,
        env=env,
        capture_output=True,
        text=True,
    )
    failed = re.findall(r"^(?:FAILED|ERROR) (\S+)", proc.stdout, flags=re.M)
    return proc.returncode, sorted(set(failed)), (proc.stdout + proc.stderr)[-2000:]


def merged(previous: dict, result: dict, listed: set[str]) -> dict:
    """A partial run's ``result`` over the ``previous`` record: its rows replace theirs, the rows of mutations no longer
    ``listed`` go. "commit" and "seconds" stay this run's; "commits" counts the rows' own (a row from before rows named
    theirs: "unrecorded", since records were merged before too)."""
    ran = {r["name"] for r in result["mutations"]}
    kept = [
        {"commit": None, **r} for r in previous.get("mutations", []) if r["name"] not in ran and r["name"] in listed
    ]
    rows = kept + result["mutations"]
    commits = collections.Counter(r["commit"] or "unrecorded" for r in rows)
    return {
        **result,
        "caught": sum(r["caught"] for r in rows),
        "total": len(rows),
        "commits": dict(commits),
        "mutations": rows,
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default="", help="run the mutations whose name contains this")
    parser.add_argument("--list", action="store_true", help="list the mutations and exit")
    parser.add_argument("--output", type=Path, default=RESULT)
    args = parser.parse_args(argv)
    chosen = [m for m in MUTATIONS if args.only in m.name]
    if args.list or not chosen:
        for m in MUTATIONS:
            print(f"{m.name:45s} {m.file:38s} {m.bug}")
        return 0 if args.list else 2

    start = time.time()
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    with tempfile.TemporaryDirectory(prefix="oa-mutations-") as tmp:
        source, site = Path(tmp) / "src", Path(tmp) / "site"
        _copy_checkout(source)
        site.mkdir()
        (site / "oa_core").symlink_to(source / "oa_core")
        (site / "oa_plugins").symlink_to(source / "plugins")
        _check_imports_from(source, site)
        tests = tuple(dict.fromkeys(t for m in chosen for t in m.tests))
        print(f"baseline: {len(tests)} test files on the unchanged copy ...", flush=True)
        code, failed, tail = _pytest(source, site, tests)
        if code != 0:
            print(tail)
            raise SystemExit(
                f"the tests fail without any mutation ({', '.join(failed) or 'see above'}): fix them first"
            )
        if not re.search(r"\b\d+ passed", tail):  # every test skipped would catch nothing, and say nothing
            print(tail)
            raise SystemExit("no test ran on the unchanged copy (all skipped: see above)")
        rows = []
        for m in tqdm(chosen, desc="mutations", unit="mutation"):
            original = _apply(source, m)
            try:
                code, failed, tail = _pytest(source, site, m.tests)
            finally:
                (source / m.file).write_text(original)
            if code not in (0, 1):  # 1: tests failed; anything else: pytest itself could not run them
                print(tail)
                raise SystemExit(f"mutation {m.name}: pytest exited with {code}")
            rows.append(
                {
                    "name": m.name,
                    "file": m.file,
                    "bug": m.bug,
                    "caught": bool(failed),
                    "by": failed,
                    "tests_run": list(m.tests),
                    "commit": head[:7],
                }
            )
    result = {
        "machine": {"platform": platform.platform(), "python": platform.python_version(), "cpus": os.cpu_count()},
        "commit": head,
        "seconds": round(time.time() - start, 1),
        "caught": sum(r["caught"] for r in rows),
        "total": len(rows),
        "mutations": rows,
    }
    if args.only and args.output.exists():  # a partial run updates its rows in the full record
        result = merged(json.loads(args.output.read_text()), result, {m.name for m in MUTATIONS})
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=1, ensure_ascii=False) + "\n")
    print(f"\n{'mutation':45s} {'caught':7s} by")
    for r in rows:
        by = (r["by"][0] + (f" (+{len(r['by']) - 1})" if len(r["by"]) > 1 else "")) if r["by"] else "-"
        print(f"{r['name']:45s} {'yes' if r['caught'] else 'NO':7s} {by}")
    print(
        f"\n{sum(r['caught'] for r in rows)} of {len(rows)} caught in {time.time() - start:.0f} s; "
        f"{args.output.relative_to(ROOT) if args.output.is_relative_to(ROOT) else args.output}"
    )
    return 0 if all(r["caught"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
