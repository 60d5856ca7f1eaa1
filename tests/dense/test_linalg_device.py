"""Linear-algebra lowerings through the tpu device: OpInfo samples (forward and
input gradients) vs CPU (LAPACK)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from opinfo_device import check_opinfo

# Factorizations in float32: XLA:CPU and LAPACK pivot and accumulate in
# different orders; inverse-like ops amplify that by the condition number.
TOL = dict(rtol=1e-3, atol=1e-3)

ENTRIES = [
    "linalg.cholesky",
    "linalg.cholesky_ex",
    "cholesky",
    "cholesky_solve",
    "cholesky_inverse",
    "linalg.inv",
    "linalg.inv_ex",
    "linalg.solve",
    "linalg.solve_ex",
    "linalg.lu_factor",
    "linalg.lu_factor_ex",
    "linalg.lu",
    "linalg.lu_solve",
    "lu_unpack",
    "lu",
    "lu_solve",
    "linalg.eigvalsh",
    "linalg.qr",
    "qr",
    "linalg.solve_triangular",
    "triangular_solve",
    "matrix_exp",
    "linalg.pinv",
    "linalg.pinv.hermitian",
    "pinverse",
    "linalg.cond",
    "linalg.tensorinv",
    "linalg.tensorsolve",
    "linalg.lstsq",
    "linalg.lstsq.grad_oriented",
]


@pytest.mark.parametrize("name", ENTRIES)
def test_opinfo_through_device(name):
    assert check_opinfo(name, max_samples=3, **TOL) > 0


FACTORIZATION_OUTPUTS = [
    "linalg.det",
    "linalg.slogdet",
    "logdet",
    "linalg.svd",
    "linalg.svdvals",
    "svd",
    "linalg.matrix_rank",
]


@pytest.mark.parametrize("name", FACTORIZATION_OUTPUTS)
def test_opinfo_det_svd_through_device(name):
    assert check_opinfo(name, max_samples=3, **TOL) > 0


@pytest.mark.parametrize("op", [torch.ops.aten._linalg_det, torch.ops.aten._linalg_slogdet])
def test_det_factors_the_transpose_like_torch(op):
    """_linalg_det/_linalg_slogdet hand their LU of A^T to the backward formula:
    factoring A instead gave transposed gradients."""
    torch.manual_seed(0)
    a = torch.randn(3, 5, 5, dtype=torch.float64)
    for want, got in zip(op(a), op(a.to("tpu"))):
        torch.testing.assert_close(got.cpu(), want, rtol=1e-12, atol=1e-12)
    ref, dev = a.clone().requires_grad_(), a.to("tpu").requires_grad_()
    torch.linalg.det(ref).sum().backward()
    torch.linalg.det(dev).sum().backward()
    torch.testing.assert_close(dev.grad.cpu(), ref.grad, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("uplo", ["L", "U"])
def test_eigh_values_vectors_and_gauge_invariant_gradient(uplo):
    """Eigenvectors are defined up to sign, so they are checked through A V = V diag(L)
    and |V|, and the gradient through a sign-invariant loss."""
    torch.manual_seed(0)
    a = torch.randn(3, 5, 5, dtype=torch.float64)
    a = a + a.mT
    at = a.to("tpu").requires_grad_()
    ac = a.clone().requires_grad_()
    values, vectors = torch.linalg.eigh(at, UPLO=uplo)
    ref_values, ref_vectors = torch.linalg.eigh(ac, UPLO=uplo)
    torch.testing.assert_close(values.cpu(), ref_values, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close((a @ vectors.cpu()), vectors.cpu() * values.cpu()[..., None, :], rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(vectors.abs().cpu(), ref_vectors.abs(), rtol=1e-7, atol=1e-7)
    weights = torch.arange(1.0, 6.0, dtype=torch.float64)
    loss = lambda v, w: (v.square() * weights.to(v.device)).sum() + w.square().sum()  # noqa: E731
    loss(vectors, values).backward()
    loss(ref_vectors, ref_values).backward()
    torch.testing.assert_close(at.grad.cpu(), ac.grad, rtol=1e-7, atol=1e-7)


def test_singular_and_indefinite_inputs_raise_torchs_errors():
    with pytest.raises(torch.linalg.LinAlgError, match="singular"):
        torch.linalg.inv(torch.zeros(3, 3, device="tpu"))
    with pytest.raises(torch.linalg.LinAlgError, match="positive-definite"):
        torch.linalg.cholesky(-torch.eye(3, device="tpu"))
    info = torch.linalg.cholesky_ex(torch.diag(torch.tensor([1.0, -1.0, 1.0])).to("tpu")).info
    assert info.item() == 2


@pytest.mark.parametrize("driver", ["gelsy", "gelsd", "gelss", "gels"])
def test_lstsq_drivers_report_torchs_outputs(driver):
    torch.manual_seed(0)
    a, b = torch.randn(2, 6, 3, dtype=torch.float64), torch.randn(2, 6, 2, dtype=torch.float64)
    ref = torch.linalg.lstsq(a, b, driver=driver)
    got = torch.linalg.lstsq(a.to("tpu"), b.to("tpu"), driver=driver)
    for name in ("solution", "residuals", "rank", "singular_values"):
        want, have = getattr(ref, name), getattr(got, name).cpu()
        assert have.shape == want.shape and have.dtype == want.dtype, name
        torch.testing.assert_close(have, want, rtol=1e-9, atol=1e-9, msg=name)


@pytest.mark.parametrize("shape, compute_uv", [((5, 5), True), ((2, 5, 3), True), ((3, 7), True), ((5, 2), False)])
def test_the_svd_a_tpu_compiles_carries_no_float64(shape, compute_uv):
    # JAX builds its TPU SVD when lowering, under tpurec's 64-bit setting, and XLA's TPU compiler
    # aborted the process on it (JAX 0.10.2, TPU v5e: torch.linalg.svd, svdvals, the nuclear
    # norm, cond, matrix_rank, pinv, lstsq). tpurec traces the same algorithm for TPUs with
    # 64-bit types off; the program exported for a TPU shows it. (Run on the v5e: every such
    # OpInfo entry compiles and passes, but for lstsq's accuracy: docs/lowerings.md.)
    import jax
    import jax.numpy as jnp

    from tpurec.dense.linalg import svd

    spec = jax.ShapeDtypeStruct(shape, jnp.float32)
    ours = jax.export.export(jax.jit(lambda a: svd(a, compute_uv=compute_uv)), platforms=["tpu"])(spec)
    assert "f64" not in ours.mlir_module()
    jax_own = jax.export.export(jax.jit(lambda a: jnp.linalg.svd(a, compute_uv=compute_uv)), platforms=["tpu"])(spec)
    assert "f64" in jax_own.mlir_module()  # what it replaces (x64 is on under tpurec)
    x = torch.randn(shape)
    if compute_uv:
        u, s, vh = torch.linalg.svd(x.to("tpu"), full_matrices=False)
        torch.testing.assert_close((u * s.unsqueeze(-2)) @ vh, x.to("tpu"), rtol=0, atol=1e-5)
    torch.testing.assert_close(torch.linalg.svdvals(x.to("tpu")).cpu(), torch.linalg.svdvals(x), rtol=1e-5, atol=1e-5)


def test_eig_where_xla_has_none_says_what_to_do(monkeypatch: pytest.MonkeyPatch):
    # XLA has the nonsymmetric eigendecomposition on CPU only; on a TPU v5e JAX failed with "MLIR
    # translation rule for primitive 'eig' not found for platform tpu".
    import jax
    import jax.numpy as jnp

    from tpurec.dense import linalg

    monkeypatch.setattr(linalg.jax, "default_backend", lambda: "tpu")
    with pytest.raises(
        NotImplementedError, match=r"no implementation for the tpu platform.*torch.linalg.eig\(x.cpu\(\)\)"
    ):
        jax.jit(linalg.linalg_eig).lower(jnp.ones((3, 3), jnp.float32))


def test_lstsq_refines_a_solution_from_an_inexact_svd(monkeypatch: pytest.MonkeyPatch):
    # A TPU's SVD is less exact than LAPACK's (lstsq erred 6.9e-5 against float64 on a v5e, CPU
    # 1.6e-6). Here an SVD with relative errors of 1e-4 stands in for it: with the refinement step
    # the solution errs about as much as from the exact SVD (16x as much without it).
    import jax
    import jax.numpy as jnp

    from tpurec.dense import linalg

    rng = np.random.default_rng(0)
    q1, _ = np.linalg.qr(rng.standard_normal((6, 6)))
    q2, _ = np.linalg.qr(rng.standard_normal((4, 4)))
    a = (q1[:, :4] @ np.diag([1.0, 0.3, 1e-2, 1e-3]) @ q2.T).astype(np.float32)  # condition number 1e3
    b = rng.standard_normal((6, 2)).astype(np.float32)
    expected = np.linalg.lstsq(a.astype(np.float64), b.astype(np.float64), rcond=None)[0]
    exact_svd = linalg.svd

    def inexact_svd(x, **kwargs):
        key = jax.random.key(1)
        return tuple(
            t * (1 + 1e-4 * jax.random.normal(jax.random.fold_in(key, i), t.shape, t.dtype))
            for i, t in enumerate(exact_svd(x, **kwargs))
        )

    def error() -> float:
        x = jax.jit(lambda a, b: linalg.linalg_lstsq(a, b)[0])(jnp.asarray(a), jnp.asarray(b))
        return float(np.abs(np.asarray(x) - expected).max())

    from_exact = error()
    monkeypatch.setattr(linalg, "svd", inexact_svd)
    assert error() < 2 * from_exact


def test_matrix_exp_is_pytorchs_method_with_products_only():
    # JAX's expm (a Pade form) needs a solve and picks its squarings with a float32 log, which a
    # TPU approximates (its backward erred 0.06 there against float64, CPU 0.021). The lowering is
    # PyTorch's method instead: scaling, a degree-18 Taylor polynomial, squaring (on the v5e since,
    # matrix_exp's OpInfo entry passes forward and backward). In the program exported for a TPU:
    # products, no solve or factorization, and no logarithm.
    import jax
    import jax.numpy as jnp

    from tpurec.dense.linalg import linalg_matrix_exp

    spec = jax.ShapeDtypeStruct((3, 6, 6), jnp.float32)
    text = jax.export.export(jax.jit(linalg_matrix_exp), platforms=["tpu"])(spec).mlir_module()
    assert "stablehlo.dot_general" in text
    for absent in ("triangular_solve", "custom_call", "stablehlo.log", "stablehlo.exponential", "f64"):
        assert absent not in text, absent


def _exact_matrix_exp(a: torch.Tensor) -> torch.Tensor:
    """exp of each matrix of ``a`` to 40 digits (mpmath), as complex128."""
    import mpmath

    with mpmath.workdps(40):
        exact = []
        for m in a.reshape(-1, *a.shape[-2:]).tolist():
            e = mpmath.expm(mpmath.matrix([[mpmath.mpc(complex(v)) for v in row] for row in m]))
            exact.append([[complex(e[i, j]) for j in range(e.cols)] for i in range(e.rows)])
    return torch.tensor(exact, dtype=torch.complex128).reshape(a.shape)


@pytest.mark.parametrize("dtype", [torch.float32, torch.complex64, torch.float64])
def test_matrix_exp_is_as_accurate_as_cpu(dtype):
    # 40 matrices with 1-norms from 0.01 to about 200 (0 to 7 squarings), against the exact
    # exponential. Squaring amplifies rounding, so one matrix may err several times more on one
    # side than on the other (up to 22x, either way, measured); over the batch the device must be
    # at least as accurate as PyTorch CPU (geometric mean of the errors: measured 0.47-0.84x CPU's
    # here, 0.54x on a TPU v5e; JAX's Pade form, replaced: 0.94x, 0.97x, and 0.43x in float64), and no
    # matrix may err by more than 1000 ulp (a wrong formula errs by orders of magnitude more). The
    # same for the input gradient, against the gradient in float64.
    generator = torch.Generator().manual_seed(0)
    wide = torch.complex128 if dtype.is_complex else torch.float64
    scales = torch.tensor([0.01, 0.5, 3.0, 10.0, 30.0], dtype=torch.float64).repeat_interleave(8)
    a = (torch.randn(len(scales), 5, 5, generator=generator, dtype=wide) * scales[:, None, None]).to(dtype)
    eps = torch.finfo(dtype).eps

    def check(ours: torch.Tensor, cpu: torch.Tensor, exact: torch.Tensor) -> None:
        def errors(x: torch.Tensor) -> torch.Tensor:
            difference = x.to(exact.dtype) - exact
            return difference.abs().amax(dim=(-2, -1)) / exact.abs().amax(dim=(-2, -1))

        assert ours.dtype == dtype and ours.shape == a.shape
        ours_errors, cpu_errors = errors(ours), errors(cpu)
        assert ours_errors.log().mean() <= cpu_errors.log().mean(), (ours_errors, cpu_errors)
        assert ours_errors.max() <= 1000 * eps, ours_errors

    check(torch.linalg.matrix_exp(a.to("tpu")).cpu(), torch.linalg.matrix_exp(a), _exact_matrix_exp(a))
    if dtype == torch.float64:
        return  # no gradient more exact than CPU's own to compare with
    weights = torch.randn(a.shape, generator=generator, dtype=wide)

    def gradient(x: torch.Tensor) -> torch.Tensor:
        x = x.detach().requires_grad_()
        (torch.linalg.matrix_exp(x) * weights.to(x.device, x.dtype)).abs().sum().backward()
        return x.grad.cpu()

    check(gradient(a.to("tpu")), gradient(a), gradient(a.to(wide)))


def test_matrix_exp_of_non_finite_and_empty_inputs_is_cpus():
    for a in (torch.full((2, 2), float("nan")), torch.tensor([[float("inf"), 0.0], [0.0, 1.0]]), torch.zeros(0, 0),
              torch.zeros(2, 0, 0), torch.tensor([[2.0]])):  # fmt: skip
        torch.testing.assert_close(
            torch.linalg.matrix_exp(a.to("tpu")).cpu(), torch.linalg.matrix_exp(a), equal_nan=True
        )
