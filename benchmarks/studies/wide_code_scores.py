"""Would PQS's 4d×8b code (half the lookups of the default's 2d×4b, the same bytes) score faster on the GPU? (GPU only)

``code_forms_recall.py`` found that 256 centroids of each 4 dimensions keep more of exact top-k's rows than the
default's 16 centroids of each 2 (0.981 and 0.967 against 0.951 and 0.924 at 1%, SmolLM2 and Gemma-3) with half the
table lookups a key, and left its GPU time open: its tables are 16× larger (128 KB a KV head in float32) and a
warp's reads into 256 entries conflict in the banks. ``wide_code_scores.cu`` times both codes' scores, float32
tables and float16 tables two heads a word, on random tables and codes (uniform: the banks' worst case) of the
Llama-3.1-8B shape (8 KV heads, 4 query heads each, head dim 128, 32 code bytes a key), and checks each against
torch doing the same arithmetic in the same order (the largest difference: 0 where they agree bit for bit), and each
float16 form's top 4% against its float32 form's (the share kept, mean and lowest over the (row, head) pairs).
Writes ``benchmarks/studies/results/wide_code_scores_<gpu>.json``.

    python benchmarks/studies/wide_code_scores.py          # on a CUDA device with nvcc
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cluster_shortlist import checked, pointer, stream, timed
from half_table_scores import kept, run_study

HERE = Path(__file__).resolve().parent
SOURCE = HERE / "wide_code_scores.cu"
HKV, G, BYTES = 8, 4, 32
# (name, sub-spaces M, centroids CC, float16 tables): the .cu's FORM order
FORMS = [
    ("2d×4b, float32 tables", 64, 16, False),
    ("2d×4b, float16 tables", 64, 16, True),
    ("4d×8b, float32 tables", 32, 256, False),
    ("4d×8b, float16 tables", 32, 256, True),
]
CHUNK = 2048  # keys a block


def codes_of(packed: torch.Tensor, M: int) -> torch.Tensor:
    """The codes ``[BH, N, BYTES]`` uint8 as sub-space numbers ``[BH, N, M]``: two nibbles a byte (low first) for 64
    sub-spaces, a byte each for 32."""
    if M == BYTES:
        return packed.long()
    return torch.stack([packed & 15, packed >> 4], dim=-1).flatten(-2).long()


def laid_out(tables: torch.Tensor, half: bool) -> torch.Tensor:
    """``[BH, G, M, CC]`` float32 → the kernel's words: float32 as is; float16 ``[BH, G/2, M, CC, 2]`` (heads 2p and
    2p + 1 in one word, 2p in the low half)."""
    if not half:
        return tables.contiguous()
    BH, _, M, CC = tables.shape
    return tables.half().view(BH, G // 2, 2, M, CC).permute(0, 1, 3, 4, 2).contiguous()


def reference(tables: torch.Tensor, codes: torch.Tensor, half: bool) -> torch.Tensor:
    """Torch's scores ``[BH, G, N]``: the entries rounded as the form rounds them, summed in float32 in sub-space
    order, as the kernel sums them."""
    BH, N, M = codes.shape
    entries = tables.half().float() if half else tables
    index = codes.view(BH, 1, N, M).expand(BH, G, N, M)
    total = torch.zeros(BH, G, N, device=tables.device)
    for m in range(M):
        total = total + entries[:, :, m, :].gather(-1, index[..., m])
    return total


def run_config(lib, batch: int, context: int) -> dict:
    torch.manual_seed(0)
    BH, N = batch * HKV, context
    packed = torch.randint(0, 256, (BH, N, BYTES), dtype=torch.uint8, device="cuda")
    row: dict = {"batch": batch, "context": context, "forms": {}}
    floats: dict[int, torch.Tensor] = {}
    for form, (name, M, CC, half) in enumerate(FORMS):
        tables = torch.randn(BH, G, M, CC, device="cuda", generator=torch.Generator("cuda").manual_seed(M))
        words = laid_out(tables, half)
        out = torch.empty(BH, G, N, device="cuda")

        def launch(words=words, out=out, form=form, name=name):
            code = lib.launch_scores(form, pointer(words), pointer(packed), pointer(out), BH, N, CHUNK, stream())
            checked(code, name)

        launch()
        torch.cuda.synchronize()
        expected = reference(tables, codes_of(packed, M), half)
        found = {"max_abs_diff_from_torch": float((out - expected).abs().max()), **timed(launch)}
        if half:
            found["top4pct_kept_mean"], found["top4pct_kept_lowest"] = kept(out, floats[M])
        else:
            floats[M] = out
        row["forms"][name] = found
    return row


def main(argv: list[str] | None = None) -> int:
    return run_study("wide_code_scores", __doc__, SOURCE, [name for name, *_ in FORMS], run_config, argv)


if __name__ == "__main__":
    sys.exit(main())
