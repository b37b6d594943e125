"""Query geometry, shared by the clusterers and selectors that use it (QGC, QGS).

- ``query_geometry``: the top-r eigenpairs (U_r, Λ_r) of the queries' second moment M per KV head (paper §3.2):
  ``top_eigenpairs``, by LAPACK on the CPU or by subspace iteration on the GPU (``subspace_eigenpairs``).
- ``project``: keys on a basis (QGC's points, QGS's codes), on CUDA tensors one Triton pass.
- the k-means on those points is ``oa_core.ops.kmeans``.
"""

from __future__ import annotations

import weakref

import torch
from torch import Tensor

from oa_core.ops.triton_path import tl, triton

QUERY_WINDOW = 256  # the last prefill queries that estimate the query geometry (and that a layer records for it)


def on_gpu(tensor: Tensor) -> bool:
    """Whether the projection, the k-means and the orthonormalisation take their Triton kernels for ``tensor``: on
    CUDA (on the CPU, even under the interpreter, torch: prepare's kernels would take minutes there; the tests run
    them at small shapes by name)."""
    return tensor.is_cuda and triton is not None


def check_rank(component: str, rank: int, head_dim: int) -> None:
    """A subspace of ``rank`` dimensions must fit the head dim (a clear error where it would silently shrink)."""
    if rank > head_dim:
        raise ValueError(
            f"{component}: rank {rank} is larger than the head dim {head_dim}; a rank of at most {head_dim} fits"
        )


def query_geometry(keys: Tensor, queries: Tensor | None, mask: Tensor, rank: int, window: int) -> tuple[Tensor, Tensor]:
    """Top-``rank`` eigenpairs of the query second moment per KV head.

    keys ``[B, Hkv, N, D]``, queries ``[B, Hq, M, D]`` or None (then the second moment of the keys ``mask`` ``[B, N]``
    selects) → (U_r ``[B, Hkv, D, r]``, Λ_r ``[B, Hkv, r]``), float32, from the float64 moment
    (``top_eigenpairs``). A request's queries are decomposed once for all the components that ask (QGC and QGS), at
    the largest rank any of them asked for so far.
    """
    B, Hkv, _, D = keys.shape
    if queries is not None:
        remembered = _DECOMPOSED.get(id(queries))
        if remembered is not None:
            owner, version, decomposed = remembered
            if owner() is queries and version == (queries._version, window, Hkv) and decomposed[0].shape[-1] >= rank:
                return _top(*decomposed, rank)
        samples = queries[:, :, -window:].double().reshape(B, Hkv, -1, D)  # the group's heads share one geometry
        count: int | Tensor = samples.shape[2]
    else:
        samples = keys.double() * mask[:, None, :, None]
        count = mask.sum(-1).clamp_min(1).view(B, 1, 1, 1)
    moment = samples.transpose(-1, -2) @ samples / count
    eigenvalues, eigenvectors = top_eigenpairs(moment, rank)
    if queries is not None:
        _remember(queries, (queries._version, window, Hkv), (eigenvalues, eigenvectors))
    return _top(eigenvalues, eigenvectors, rank)


# id(queries) → (a weak reference to them, (their version, window, KV heads), their eigendecomposition): one per
# request, shared by its components; an entry goes with its queries.
# id(queries) → (a weak reference to them, their version, window and Hkv, their eigenvalues and eigenvectors)
_DECOMPOSED: dict[int, tuple[weakref.ref[Tensor], tuple, tuple[Tensor, Tensor]]] = {}


def _remember(queries: Tensor, version: tuple, decomposed: tuple[Tensor, Tensor]) -> None:
    key = id(queries)
    _DECOMPOSED[key] = (weakref.ref(queries, lambda _: _DECOMPOSED.pop(key, None)), version, decomposed)


def top_eigenpairs(moment: Tensor, rank: int) -> tuple[Tensor, Tensor]:
    """The ``rank`` largest eigenpairs of symmetric PSD matrices ``[..., D, D]`` (float64) → (values ``[..., k]``,
    vectors ``[..., D, k]``) in ascending order, k ≥ ``rank`` (all D from LAPACK), on the moment's device.

    On the CPU, and wherever the iteration's block (2·rank columns) would span the whole space, LAPACK's ``eigh`` of
    every matrix. On the GPU, where a batch of 128×128 decompositions takes ~0.2 s whichever library runs it (H200,
    ``benchmarks/studies/results/prepare_h200.json``), ``subspace_eigenpairs``: the same pairs to a residual of
    1e-9·λ_1, or a basis capturing all but 10⁻⁶ of their query energy where the spectrum is flat around λ_r, in a few
    batched products. Eigenvectors are unique up to sign (and, for equal eigenvalues, up to a rotation inside their
    eigenspace), which no component depends on: QGC's distances and QGS's scores are the same either way."""
    if moment.is_cuda and 2 * rank < moment.shape[-1]:
        return subspace_eigenpairs(moment, rank)
    return tuple(t.to(moment.device) for t in torch.linalg.eigh(moment.cpu()))


def subspace_eigenpairs(
    moment: Tensor,
    rank: int,
    tol: float = 1e-9,
    energy_tol: float = 1e-6,
    check_every: int = 8,
    max_iterations: int = 1000,
) -> tuple[Tensor, Tensor]:
    """Top-``rank`` eigenpairs of symmetric PSD ``[P, D, D]`` float64 matrices by block subspace iteration on M²
    with Rayleigh–Ritz: a block of 2·rank orthonormal columns (a fixed seeded start: the same on every device) is
    multiplied by M² and re-orthonormalised (``orthonormalize``: one Gram–Schmidt pass, two before a check) until,
    for every matrix, either every one of the top ``rank`` Ritz pairs (λ, u) has ‖Mu − λu‖ ≤ ``tol``·λ_1, or the
    query energy the basis captures, Σλ over the top ``rank`` Ritz values, grew by at most ``energy_tol`` of itself
    since the last check (checks every ``check_every`` products: each waits for the device).

    The energy is what QGC and QGS keep of the queries: a basis that captures all but 10⁻⁶ of what the exact top-r
    subspace captures serves them as well, whichever vectors span it. Ritz values only grow towards the eigenvalues,
    at the square of the vectors' rate, so the energy settles long before the vectors where the spectrum is flat
    around λ_r (there the top-r subspace is nearly arbitrary anyway: 32 products against 72 on flat 128 × 128
    moments of 1024 samples); where it decays, the residual stops the iteration first, as before. The block's extra
    columns make the r-th pair converge at (λ_{2r+1}/λ_r)² per product rather than (λ_{r+1}/λ_r)². → (values
    ``[P, rank]`` ascending, vectors ``[P, D, rank]``)."""
    *lead, D, _ = moment.shape
    block = min(D, 2 * rank)
    start = torch.randn(D, block, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    # Scaled to a unit trace: M² of a large moment stays in range; the eigenvectors are the same. The shift keeps
    # M²Q of full rank (a moment of fewer samples than the block is singular) and moves no eigenvector.
    scale = moment.diagonal(dim1=-2, dim2=-1).sum(-1).clamp_min(torch.finfo(torch.float64).tiny)[..., None, None]
    unit = moment / scale
    square = unit @ unit + 1e-12 * torch.eye(D, dtype=moment.dtype, device=moment.device)
    basis = orthonormalize(start.to(moment.device).expand(*lead, D, block).contiguous())
    energy = None  # the last check's Σ of the top Ritz values
    for iteration in range(1, max_iterations + 1):
        check = iteration % check_every == 0 or iteration == max_iterations
        # Between checks the basis only carries the span to the next product: one Gram–Schmidt pass keeps it
        # orthonormal to about eps·cond(M²Q), which the next product and pass absorb. A check's Rayleigh–Ritz needs
        # it orthonormal to rounding: two passes.
        basis = orthonormalize(square @ basis, passes=2 if check else 1)
        if not check:
            continue
        values, rotation = torch.linalg.eigh(basis.transpose(-1, -2) @ unit @ basis)
        values, vectors = values[..., -rank:], basis @ rotation[..., -rank:]
        residual = (unit @ vectors - vectors * values[..., None, :]).norm(dim=-2)
        done = (residual <= tol * values[..., -1:].clamp_min(torch.finfo(torch.float64).tiny)).all(-1)
        captured = values.sum(-1)
        if energy is not None:
            done |= captured - energy <= energy_tol * captured
        if bool(done.all()):
            break
        energy = captured
    return values * scale[..., 0], vectors


def orthonormalize(columns: Tensor, passes: int = 2) -> Tensor:
    """An orthonormal basis of the span of ``[..., D, b]`` float64 columns of full rank, in order (the j-th basis
    vector spans the first j columns). On CUDA tensors one Triton program per matrix: modified Gram–Schmidt, ``passes``
    times (the second removes what rounding left of the first's projections; one leaves the basis orthonormal to about
    eps·cond(columns)). A pass is 64 dependent reductions at 128 × 32 whatever the batch: two took 0.11 ms for 128
    matrices on an H200 (a batched QR 7.1 ms), and as long for 8. Elsewhere QR."""
    if passes < 1:
        raise ValueError(f"orthonormalize: passes must be at least 1, got {passes}")
    if on_gpu(columns):
        *lead, D, b = columns.shape
        flat = columns.reshape(-1, D, b).contiguous()
        out = torch.empty_like(flat)
        _gram_schmidt[(flat.shape[0],)](
            flat,
            out,
            D,
            b,
            BLOCK_D=triton.next_power_of_2(D),
            BLOCK_B=triton.next_power_of_2(b),
            PASSES=passes,
            num_warps=8,
        )
        return out.reshape(columns.shape)
    return torch.linalg.qr(columns).Q


def with_key_spread(basis: Tensor, keys: Tensor, mask: Tensor, extra: int) -> Tensor:
    """``basis`` ``[B, Hkv, D, r]`` (orthonormal) extended by the ``extra`` directions along which the keys ``[B, Hkv,
    N, D]`` that ``mask`` ``[B, N]`` selects spread most outside it: the top eigenvectors of the centred keys'
    covariance projected off the basis → ``[B, Hkv, D, r + extra]`` float32, orthonormal. A query subspace learnt
    from the context misses keys that stand out where the context's queries do not look (Gemma-3's needles:
    README, "RULER 16K on Gemma-3-270M").

    The keys are centred in float32 before their product (a large common component would otherwise cancel inside
    it); the projection off the basis, (I − UUᵀ) C (I − UUᵀ), and the eigenpairs work on the D × D covariance C in
    float64."""
    points, weight = keys.float(), mask[:, None, :, None].float()
    count = weight.sum(2, keepdim=True).clamp_min(1)
    centred = (points - (points * weight).sum(2, keepdim=True) / count) * weight
    covariance = (centred.transpose(-1, -2) @ centred).double() / count.double()
    inside = basis.double()
    off = torch.eye(inside.shape[-2], dtype=torch.float64, device=inside.device) - inside @ inside.transpose(-1, -2)
    _, vectors = top_eigenpairs(off @ covariance @ off, extra)
    extended = torch.cat([inside, vectors[..., -extra:]], -1)
    return orthonormalize(extended).float()  # the spread's vectors are orthogonal to the basis up to rounding


def _top(eigenvalues: Tensor, eigenvectors: Tensor, rank: int) -> tuple[Tensor, Tensor]:
    r = min(rank, eigenvectors.shape[-1])
    top = eigenvectors[..., -r:].flip(-1)
    return top.float(), eigenvalues[..., -r:].flip(-1).clamp_min(0).float()


def project(keys: Tensor, basis: Tensor) -> Tensor:
    """keys ``[B, H, N, D]`` (any float dtype) times ``basis`` ``[B, H, D, r]`` float32 → ``[B, H, N, r]`` float32,
    as ``keys.float() @ basis``. On CUDA one Triton pass that reads the keys in their own dtype (where torch writes a
    float32 copy of them first), in ``tf32x3`` dots: float32's accuracy on tensor cores (0.30 against 1.38 ms at 16 ×
    8 heads × 16K keys of 128 bfloat16, rank 16, on an H200; relative difference 9e-7)."""
    if not on_gpu(keys):
        return keys.float() @ basis
    B, H, N, D = keys.shape
    r = basis.shape[-1]
    keys = keys if keys.stride(-1) == 1 else keys.contiguous()
    out = torch.empty(B, H, N, r, dtype=torch.float32, device=keys.device)
    if out.numel():
        block_n = 64
        _project[(triton.cdiv(N, block_n), B * H)](
            keys,
            basis.float().contiguous(),
            out,
            N,
            H,
            *keys.stride()[:3],
            D=D,
            R=r,
            BLOCK_D=max(16, triton.next_power_of_2(D)),
            BLOCK_R=max(16, triton.next_power_of_2(r)),
            BLOCK_N=block_n,
        )
    return out


if triton is not None:

    @triton.jit
    def _gram_schmidt(Y, OUT, D, B, BLOCK_D: tl.constexpr, BLOCK_B: tl.constexpr, PASSES: tl.constexpr):
        """Program (matrix): modified Gram–Schmidt over its ``B`` columns of ``D`` rows, held in registers, ``PASSES``
        times."""
        p = tl.program_id(0).to(tl.int64)
        offs_d = tl.arange(0, BLOCK_D)
        offs_b = tl.arange(0, BLOCK_B)
        inside = (offs_d[:, None] < D) & (offs_b[None, :] < B)
        at = (p * D + offs_d[:, None]) * B + offs_b[None, :]
        y = tl.load(Y + at, mask=inside, other=0.0)
        for _ in tl.static_range(PASSES):
            for j in range(0, B):
                this = offs_b[None, :] == j
                column = tl.sum(tl.where(this, y, 0.0), axis=1)
                column = column / tl.sqrt(tl.sum(column * column, axis=0))
                y = tl.where(this, column[:, None], y)
                later = tl.where(offs_b > j, tl.sum(y * column[:, None], axis=0), 0.0)
                y = y - column[:, None] * later[None, :]
        tl.store(OUT + at, y, mask=inside)

    @triton.jit
    def _project(
        K,
        BASIS,
        OUT,
        N,
        H,
        kb,
        kh,
        kn,
        D: tl.constexpr,
        R: tl.constexpr,
        BLOCK_D: tl.constexpr,
        BLOCK_R: tl.constexpr,
        BLOCK_N: tl.constexpr,
    ):
        """Program (block of rows, batch row · head): its rows' projections on the head's basis."""
        bh = tl.program_id(1).to(tl.int64)
        b, h = bh // H, bh % H
        offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, BLOCK_D)
        offs_r = tl.arange(0, BLOCK_R)
        in_n, in_d, in_r = offs_n < N, offs_d < D, offs_r < R
        k = tl.load(
            K + b * kb + h * kh + offs_n[:, None] * kn + offs_d[None, :], mask=in_n[:, None] & in_d[None, :], other=0.0
        ).to(tl.float32)
        basis = tl.load(
            BASIS + (bh * D + offs_d[:, None]) * R + offs_r[None, :], mask=in_d[:, None] & in_r[None, :], other=0.0
        )
        out = tl.dot(k, basis, input_precision="tf32x3")
        tl.store(OUT + (bh * N + offs_n[:, None]) * R + offs_r[None, :], out, mask=in_n[:, None] & in_r[None, :])
