"""The query geometry the clusterers and selectors share (oa_core.ops.geometry)."""

import torch

from oa_core.ops.geometry import query_geometry


def test_query_geometry_finds_the_query_subspace():
    gen = torch.Generator().manual_seed(2)
    queries = torch.zeros(1, 2, 100, 8)
    queries[..., :2] = torch.randn(1, 2, 100, 2, generator=gen) * torch.tensor([3.0, 1.0])
    basis, eigenvalues = query_geometry(
        torch.randn(1, 1, 50, 8, generator=gen), queries, torch.ones(1, 50, dtype=torch.bool), rank=2, window=100
    )
    # Both query heads share the KV head: the basis spans the first two axes, largest variance first.
    assert basis[0, 0, 2:].abs().max() < 1e-6  # nothing outside the span of the queries
    assert torch.allclose(basis[0, 0].T @ basis[0, 0], torch.eye(2), atol=1e-5)
    assert basis[0, 0, 0, 0].abs() > 0.99  # the wider query axis comes first
    assert eigenvalues[0, 0, 0] > eigenvalues[0, 0, 1] > 0


def _moments(spectrum, samples, count=6, seed=3):
    x = (
        torch.randn(count, samples, len(spectrum), generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
        * spectrum.double().sqrt()
    )
    return x.transpose(-1, -2) @ x / samples


def test_subspace_iteration_gives_lapacks_top_pairs():
    """The GPU's eigensolver (run here on the CPU) against LAPACK, stopped by the residual alone (``energy_tol=0``):
    the same top eigenvalues and the same subspace, on a decaying spectrum and a nearly flat one (the latter converges
    only through the block's extra columns)."""
    from oa_core.ops.geometry import subspace_eigenpairs

    r = 6
    for spectrum in (0.8 ** torch.arange(40), 1 + 0.01 * torch.rand(40, generator=torch.Generator().manual_seed(1))):
        moment = _moments(spectrum, 400)
        values, vectors = subspace_eigenpairs(moment, r, energy_tol=0.0)
        exact_values, exact_vectors = torch.linalg.eigh(moment)
        assert torch.allclose(values, exact_values[..., -r:], rtol=1e-10, atol=0)
        top = exact_vectors[..., -r:]
        residual = moment @ vectors - vectors * values[..., None, :]
        assert residual.norm(dim=-2).max() <= 1e-8 * exact_values[..., -1].max()
        assert torch.allclose(vectors.transpose(-1, -2) @ vectors, torch.eye(r, dtype=torch.float64), atol=1e-12)
        if spectrum[0] != spectrum[1]:  # separated eigenvalues: the same vectors up to sign
            assert torch.allclose((top * vectors).sum(-2).abs(), torch.ones(r, dtype=torch.float64), atol=1e-8)


def test_subspace_iteration_stops_once_the_captured_energy_settles():
    """By default the iteration also stops once the energy its basis captures (Σ of the top Ritz values) settles: on
    a spectrum flat around λ_r that is long before the residual, with all but 1e-6 of the energy the exact top-r
    subspace captures; the values are lower bounds of LAPACK's (Ritz values), the basis orthonormal. On a decaying
    spectrum the residual still stops it first (the pairs of the test above)."""
    from unittest import mock

    from oa_core.ops import geometry

    r = 6
    moment = _moments(1 + 0.01 * torch.rand(40, generator=torch.Generator().manual_seed(1)), 400)
    exact = torch.linalg.eigh(moment).eigenvalues[..., -r:]
    products = {}
    for energy_tol in (1e-6, 0.0):
        with mock.patch.object(geometry, "orthonormalize", wraps=geometry.orthonormalize) as counted:
            values, vectors = geometry.subspace_eigenpairs(moment, r, energy_tol=energy_tol)
        products[energy_tol] = counted.call_count
    values, vectors = geometry.subspace_eigenpairs(moment, r)
    captured = (vectors.transpose(-1, -2) @ moment @ vectors).diagonal(dim1=-2, dim2=-1).sum(-1)
    assert bool((captured >= (1 - 1e-6) * exact.sum(-1)).all())
    assert bool((values <= exact * (1 + 1e-12)).all())  # Ritz values: from below
    assert torch.allclose(vectors.transpose(-1, -2) @ vectors, torch.eye(r, dtype=torch.float64), atol=1e-12)
    assert products[1e-6] + 2 * 8 <= products[0.0]  # it stopped on the energy, checks before the residual would
    decaying = _moments(0.8 ** torch.arange(40), 400)
    assert torch.equal(
        geometry.subspace_eigenpairs(decaying, r)[1], geometry.subspace_eigenpairs(decaying, r, energy_tol=0.0)[1]
    )


def test_subspace_iteration_of_a_rank_deficient_moment():
    """Fewer samples than the rank asked for (a short prompt): the nonzero pairs are found, the rest are zero and the
    basis stays orthonormal."""
    from oa_core.ops.geometry import subspace_eigenpairs

    moment = _moments(torch.ones(32), samples=3)
    values, vectors = subspace_eigenpairs(moment, 8)
    exact = torch.linalg.eigh(moment).eigenvalues
    assert torch.allclose(values[..., -3:], exact[..., -3:], rtol=1e-10)
    assert values[..., :5].abs().max() < 1e-12 * exact[..., -1].max()
    assert torch.allclose(vectors.transpose(-1, -2) @ vectors, torch.eye(8, dtype=torch.float64), atol=1e-10)


def test_the_triton_gram_schmidt_matches_qr():
    """Under the interpreter: the GPU's orthonormalisation spans what QR spans, column by column, and is orthonormal,
    on ill-conditioned columns (a geometric spread of scales)."""
    import pytest

    from oa_core.ops import geometry, triton_path

    if triton_path.unavailable_reason(torch.device("cpu")) is not None:
        pytest.skip(triton_path.unavailable_reason(torch.device("cpu")))
    gen = torch.Generator().manual_seed(5)
    scaled = torch.randn(3, 24, 10, generator=gen, dtype=torch.float64) * (0.1 ** torch.arange(10.0)).double()
    # Nearly parallel columns (cond ≈ 1e6): one pass leaves them orthonormal only to about eps·cond.
    parallel = torch.randn(3, 24, 1, generator=gen, dtype=torch.float64) + 1e-6 * torch.randn(
        3, 24, 10, generator=gen, dtype=torch.float64
    )
    eye = torch.eye(10, dtype=torch.float64)
    for columns in (scaled, parallel):
        q = torch.linalg.qr(columns).Q
        # Two passes: orthonormal to rounding. One (the subspace iteration's between its checks): the same span,
        # column by column, orthonormal to about eps·cond.
        for passes, atol in ((2, 1e-12), (1, 1e-8)):
            out = torch.empty_like(columns)
            geometry._gram_schmidt[(3,)](columns, out, 24, 10, BLOCK_D=32, BLOCK_B=16, PASSES=passes)
            assert torch.allclose(out.transpose(-1, -2) @ out, eye, atol=atol)
            assert torch.allclose((out * q).sum(-2).abs(), torch.ones(3, 10, dtype=torch.float64), atol=1e-9)
    assert not torch.allclose(out.transpose(-1, -2) @ out, eye, atol=1e-12)  # one pass is not two
    with pytest.raises(ValueError, match="passes must be at least 1, got 0"):
        geometry.orthonormalize(scaled, passes=0)


def test_the_subspace_iteration_on_the_triton_gram_schmidt(monkeypatch):
    """Under the interpreter, the iteration as a GPU runs it (one Gram–Schmidt pass between checks, two before each):
    LAPACK's top pairs on a decaying spectrum, an orthonormal basis."""
    import pytest

    from oa_core.ops import geometry, triton_path

    if triton_path.unavailable_reason(torch.device("cpu")) is not None:
        pytest.skip(triton_path.unavailable_reason(torch.device("cpu")))
    monkeypatch.setattr(geometry, "on_gpu", lambda tensor: True)
    r = 4
    moment = _moments(0.7 ** torch.arange(24), 200, count=2)
    values, vectors = geometry.subspace_eigenpairs(moment, r, energy_tol=0.0)
    exact_values, exact_vectors = torch.linalg.eigh(moment)
    assert torch.allclose(values, exact_values[..., -r:], rtol=1e-10, atol=0)
    assert torch.allclose(vectors.transpose(-1, -2) @ vectors, torch.eye(r, dtype=torch.float64), atol=1e-12)
    assert torch.allclose(
        (exact_vectors[..., -r:] * vectors).sum(-2).abs(), torch.ones(2, r, dtype=torch.float64), atol=1e-8
    )


def test_the_triton_projection_equals_torchs(monkeypatch):
    """Under the interpreter: the projection as it runs on a GPU (one pass reading the keys in their own dtype, in
    place from a view of a larger cache) equals ``keys.float() @ basis``, over row blocks that do not divide N."""
    import pytest

    from oa_core.ops import geometry, triton_path

    if triton_path.unavailable_reason(torch.device("cpu")) is not None:
        pytest.skip(triton_path.unavailable_reason(torch.device("cpu")))
    gen = torch.Generator().manual_seed(9)
    for dtype, D, r in ((torch.bfloat16, 24, 16), (torch.float32, 16, 5)):
        cache = torch.full((2, 3, 150, D), float("nan"), dtype=dtype)
        cache[:, :, :100] = torch.randn(2, 3, 100, D, generator=gen).to(dtype)
        keys = cache[:, :, :100]
        basis = torch.randn(2, 3, D, r, generator=gen)
        with monkeypatch.context() as patch:
            patch.setattr(geometry, "on_gpu", lambda tensor: True)
            found = geometry.project(keys, basis)
        assert found.dtype == torch.float32 and found.shape == (2, 3, 100, r)
        assert torch.allclose(found, keys.float() @ basis, rtol=1e-5, atol=1e-5)
