"""Matrix products: mm, addmm, bmm, baddbmm, dot, mv, addmv, addr, _addmm_activation.

Precision follows ``torch.get_float32_matmul_precision()`` (default "highest",
i.e. true float32), so a TPU does not silently drop to one bf16 pass. Low
precision inputs accumulate in float32 and round once, as torch does.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import torch
from jax import lax

from tpurec.dense import native_matmul
from tpurec.dense._util import cast, is_float
from tpurec.dense._util import acc_dtype as _acc
from tpurec.dense.registry import Kind, lower
from tpurec.dense import transcendental

aten = torch.ops.aten

_PRECISION = {"highest": lax.Precision.HIGHEST, "high": lax.Precision.HIGH, "medium": lax.Precision.DEFAULT}


def _exact_matmul(a, b):
    """``a @ b`` in full precision: the products inside a LAPACK-style op (pinv, lstsq), which PyTorch
    computes in full float32 whatever ``torch.get_float32_matmul_precision()`` says."""
    return jnp.matmul(a, b, precision=lax.Precision.HIGHEST)


def matmul(a, b, rounded: bool = True):
    """``a @ b`` with torch's accumulation dtype and precision.

    ``rounded=False`` keeps the accumulation dtype (float32 for bf16/f16 inputs),
    for ops that add to the product before rounding once, as ATen's addmm does.
    """
    if a.dtype != b.dtype:
        raise TypeError(f"expected both operands to have the same dtype, got {a.dtype} and {b.dtype}")
    precision = _PRECISION.get(torch.get_float32_matmul_precision(), lax.Precision.HIGHEST)
    out = jnp.matmul(a, b, precision=precision, preferred_element_type=_acc(a.dtype))
    return out.astype(a.dtype) if rounded else out


def _scaled_add(x, prod, beta, alpha, dt=None):
    """beta * x + alpha * prod in dtype ``dt`` (default: prod's); beta == 0 ignores x entirely (NaNs included)."""
    dt = prod.dtype if dt is None else dt
    acc = _acc(dt)
    p = prod.astype(acc) * cast(alpha, acc)
    if not is_float(dt):
        return (cast(beta, acc) * x.astype(acc) + p).astype(dt)
    b = cast(beta, acc)
    scaled = jnp.where(b == 0, jnp.zeros((), acc), b * x.astype(acc))
    return (scaled + p).astype(dt)


@lower(aten.mm.default)
def mm(a, b):
    return matmul(a, b)


@lower(aten.bmm.default)
def bmm(a, b):
    if native_matmul.applies(a, b):  # XLA:CPU: many small float32 products in one native call
        return native_matmul.bmm(a, b, matmul)
    return matmul(a, b)


@lower(aten.dot.default, aten.vdot.default)
def dot(a, b):
    return matmul(a, b)


@lower(aten.mv.default)
def mv(a, v):
    return matmul(a, v)


@lower(aten.addmm.default)
def addmm(x, a, b, *, beta=1, alpha=1):
    # One rounding of the bf16/f16 result, after the bias is added (as ATen/oneDNN).
    return _scaled_add(x, matmul(a, b, rounded=False), beta, alpha, a.dtype)


@lower(aten._addmm_activation.default)
def addmm_activation(x, a, b, *, beta=1, alpha=1, use_gelu: bool = False):
    y = addmm(x, a, b, beta=beta, alpha=alpha)
    if use_gelu:
        # torch's CPU kernel applies exact (erf) gelu; CUDA's cuBLASLt epilogue
        # uses tanh. We follow CPU, the reference these lowerings are tested on.
        return jax.nn.gelu(y.astype(_acc(y.dtype)), approximate=False).astype(y.dtype)
    return jnp.maximum(y, jnp.zeros((), y.dtype))


@lower(aten.baddbmm.default)
def baddbmm(x, a, b, *, beta=1, alpha=1):
    return _scaled_add(x, bmm(a, b), beta, alpha)


@lower(aten.addbmm.default)
def addbmm(x, a, b, *, beta=1, alpha=1):
    # One contraction over (batch, k), as torch does, not a sum of per-batch products.
    precision = _PRECISION.get(torch.get_float32_matmul_precision(), lax.Precision.HIGHEST)
    prod = jnp.einsum("bik,bkj->ij", a, b, precision=precision, preferred_element_type=_acc(a.dtype)).astype(a.dtype)
    return _scaled_add(x, prod, beta, alpha)


@lower(aten.addmv.default)
def addmv(x, a, v, *, beta=1, alpha=1):
    return _scaled_add(x, matmul(a, v), beta, alpha)


@lower(aten.addr.default)
def addr(x, v1, v2, *, beta=1, alpha=1):
    prod = v1[:, None] * v2[None, :]
    if prod.dtype == jnp.bool_:
        # torch: bool addr is (beta and x) or (alpha and outer)
        return jnp.logical_or(jnp.logical_and(cast(beta, bool), x), jnp.logical_and(cast(alpha, bool), prod))
    return _scaled_add(x, prod, beta, alpha)


# --- factorizations and solvers ------------------------------------------------------
#
# Through ``jax.numpy.linalg`` / ``jax.scipy.linalg`` / ``lax.linalg``. torch's
# conventions are kept: LU pivots are 1-based int32 row swaps, ``info`` is an
# int32 tensor that is 0 on success and k > 0 when the k-th pivot / leading
# minor failed (singular or not positive definite), computed on the device so
# ``check_errors`` in the composite ops can report it. Gradients are torch's
# own formulas (svd_backward, eigh backward, ...) over ops lowered here.


def _info_from_diagonal(diag, bad) -> jax.Array:
    """1-based index of the first ``bad`` diagonal entry per matrix, 0 when none."""
    if diag.shape[-1] == 0:  # empty matrices always succeed
        return jnp.zeros(diag.shape[:-1], jnp.int32)
    first = jnp.argmax(bad, axis=-1)
    return jnp.where(jnp.any(bad, axis=-1), first + 1, 0).astype(jnp.int32)


def _lu(a):
    """(LU, 0-based pivots, permutation) with torch's shapes for (m, n) matrices."""
    lu, pivots, perm = lax.linalg.lu(a)
    return lu, pivots, perm


def _lu_info(lu) -> jax.Array:
    diag = jnp.diagonal(lu, axis1=-2, axis2=-1)
    return _info_from_diagonal(diag, diag == 0)


def _mT(x):
    return jnp.swapaxes(x, -1, -2)


def _mH(x):
    return jnp.conj(_mT(x)) if jnp.iscomplexobj(x) else _mT(x)


def _broadcast_batch(a, b):
    """``a`` (..., m, m) and ``b`` (..., m, k) with their batch dims broadcast."""
    batch = jnp.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    return jnp.broadcast_to(a, batch + a.shape[-2:]), jnp.broadcast_to(b, batch + b.shape[-2:])


def _triangular_solve(
    a, b, *, lower: bool, left: bool = True, transpose_a: bool = False, conjugate_a: bool = False, unit: bool = False
):
    a, b = _broadcast_batch(a, b)
    return lax.linalg.triangular_solve(
        a, b, left_side=left, lower=lower, transpose_a=transpose_a, conjugate_a=conjugate_a, unit_diagonal=unit
    )


def _lu_solve(lu, perm, b, adjoint: bool):
    """Solves A X = B (or A^H X = B) from A's LU factors, with B a (..., n, k) matrix."""
    n = lu.shape[-1]
    lu, b = _broadcast_batch(lu, b)
    perm = jnp.broadcast_to(perm, lu.shape[:-2] + (n,))
    if not adjoint:
        # A = P L U, P^T A = L U: row-permute B, then the two triangular solves.
        pb = jnp.take_along_axis(b, perm[..., None], axis=-2)
        y = _triangular_solve(lu, pb, lower=True, unit=True)
        return _triangular_solve(lu, y, lower=False)
    # A^H = U^H L^H P^T: solve U^H, then L^H, then undo the row permutation.
    y = _triangular_solve(lu, b, lower=False, transpose_a=True, conjugate_a=True)
    z = _triangular_solve(lu, y, lower=True, unit=True, transpose_a=True, conjugate_a=True)
    inverse = jnp.argsort(perm, axis=-1)
    return jnp.take_along_axis(z, inverse[..., None], axis=-2)


@lower(aten.linalg_lu_factor_ex.default)
def linalg_lu_factor_ex(a, *, pivot: bool = True, check_errors: bool = False):
    if not pivot:
        raise ValueError("linalg.lu_factor: LU without pivoting is not supported on the tpu device; use pivot=True")
    lu, pivots, _ = _lu(a)
    return lu, (pivots + 1).astype(jnp.int32), _lu_info(lu)


def _p_l_u(lu, perm, m: int, n: int):
    k = min(m, n)
    lower_part = jnp.tril(lu[..., :, :k], -1) + jnp.eye(m, k, dtype=lu.dtype)
    upper_part = jnp.triu(lu[..., :k, :])
    # P^T A = L U with P^T's rows = perm, so P = one_hot(perm)^T.
    p = _mT(jax.nn.one_hot(perm, m, dtype=lu.dtype))
    return p, lower_part, upper_part


@lower(aten.linalg_lu.default)
def linalg_lu(a, *, pivot: bool = True):
    if not pivot:
        raise ValueError("linalg.lu: LU without pivoting is not supported on the tpu device; use pivot=True")
    lu, _, perm = _lu(a)
    return _p_l_u(lu, perm, a.shape[-2], a.shape[-1])


@lower(aten.lu_unpack.default)
def lu_unpack(lu, pivots, unpack_data: bool = True, unpack_pivots: bool = True):
    m, n = lu.shape[-2], lu.shape[-1]
    perm = lax.linalg.lu_pivots_to_permutation((pivots - 1).astype(jnp.int32), m)
    p, lower_part, upper_part = _p_l_u(lu, perm, m, n)
    empty = jnp.zeros((0,), lu.dtype)
    return (
        (p if unpack_pivots else empty),
        (lower_part if unpack_data else empty),
        (upper_part if unpack_data else empty),
    )


def _pivots_to_perm(pivots, n: int):
    return lax.linalg.lu_pivots_to_permutation((pivots - 1).astype(jnp.int32), n)


def _as_matrix_rhs(a, b):
    """torch's rule: B is a batch of vectors when it has one dim less than A and matches A's batch."""
    vector = b.ndim == 1 or (b.ndim == a.ndim - 1 and b.shape == a.shape[:-1])
    return (b[..., None], True) if vector else (b, False)


@lower(aten.linalg_lu_solve.default)
def linalg_lu_solve(lu, pivots, b, *, left: bool = True, adjoint: bool = False):
    perm = _pivots_to_perm(pivots, lu.shape[-1])
    if left:
        return _lu_solve(lu, perm, b, adjoint)
    # X A = B  <=>  A^H X^H = B^H
    return _mH(_lu_solve(lu, perm, _mH(b), not adjoint))


@lower(aten._linalg_solve_ex.default)
def linalg_solve_ex(a, b, *, left: bool = True, check_errors: bool = False):
    lu, pivots, perm = _lu(a)
    rhs, vector = _as_matrix_rhs(a, b) if left else (b, False)
    if left:
        x = _lu_solve(lu, perm, rhs, adjoint=False)
    else:
        x = _mH(_lu_solve(lu, perm, _mH(rhs), adjoint=True))
    if vector:
        x = x[..., 0]
    return x, lu, (pivots + 1).astype(jnp.int32), _lu_info(lu)


@lower(aten.linalg_inv_ex.default)
def linalg_inv_ex(a, *, check_errors: bool = False):
    lu, _, perm = _lu(a)
    eye = jnp.broadcast_to(jnp.eye(a.shape[-1], dtype=a.dtype), a.shape)
    return _lu_solve(lu, perm, eye, adjoint=False), _lu_info(lu)


def _det_from_lu(lu, pivots):
    diag = jnp.diagonal(lu, axis1=-2, axis2=-1)
    swaps = jnp.sum(pivots != jnp.arange(pivots.shape[-1], dtype=pivots.dtype), axis=-1)
    parity = jnp.where(swaps % 2 == 1, -1, 1).astype(lu.dtype)
    return diag, parity


# torch's _linalg_det/_linalg_slogdet return the LU factors of A^T (the transposed
# view of a row-major A is the column-major matrix LAPACK factors without a copy),
# and their backward formulas solve with those factors accordingly; det(A^T) = det(A).


@lower(aten._linalg_det.default)
def linalg_det(a):
    lu, pivots, _ = _lu(_mT(a))
    diag, parity = _det_from_lu(lu, pivots)
    return parity * jnp.prod(diag, axis=-1), lu, (pivots + 1).astype(jnp.int32)


@lower(aten._linalg_slogdet.default)
def linalg_slogdet(a):
    lu, pivots, _ = _lu(_mT(a))
    diag, parity = _det_from_lu(lu, pivots)
    if jnp.iscomplexobj(diag):
        sign = parity * jnp.prod(diag / jnp.abs(diag), axis=-1)
    else:
        sign = parity * jnp.prod(jnp.sign(diag), axis=-1)
    logabsdet = jnp.sum(transcendental.log(jnp.abs(diag)), axis=-1)
    return sign, logabsdet, lu, (pivots + 1).astype(jnp.int32)


@lower(aten.linalg_cholesky_ex.default)
def linalg_cholesky_ex(a, *, upper: bool = False, check_errors: bool = False):
    factor = jnp.linalg.cholesky(a)  # lower; XLA fills a failed factorization with NaN
    failed = jnp.any(~jnp.isfinite(factor))
    info = lax.cond(failed, _first_non_pd_minor, lambda m: jnp.zeros(m.shape[:-2], jnp.int32), a)
    return (_mH(factor) if upper else factor), info


def _first_non_pd_minor(a) -> jax.Array:
    """torch's Cholesky ``info``: the order of the first leading minor that is not
    positive definite (0 if none). Only run when XLA's factorization failed:
    elimination without pivoting, whose k-th pivot is the ratio of the k-th and
    (k-1)-th leading minors."""
    n = a.shape[-1]
    if n == 0:
        return jnp.zeros(a.shape[:-2], jnp.int32)
    idx = jnp.arange(n)

    def step(k, carry):
        m, pivots = carry
        pivot = m[..., k, k]
        pivots = pivots.at[..., k].set(jnp.real(pivot))
        col = jnp.where(idx > k, m[..., :, k], 0)
        row = jnp.where(idx > k, m[..., k, :], 0)
        safe = jnp.where(pivot == 0, 1, pivot)
        return m - col[..., :, None] * row[..., None, :] / safe[..., None, None], pivots

    _, pivots = lax.fori_loop(0, n, step, (a, jnp.zeros(a.shape[:-1], jnp.real(a).dtype)))
    return _info_from_diagonal(pivots, ~(pivots > 0))


@lower(aten.cholesky.default)
def cholesky(a, upper: bool = False):
    return linalg_cholesky_ex(a, upper=upper)[0]


@lower(aten._cholesky_solve_helper.default)
def cholesky_solve_helper(b, factor, upper: bool):
    lower_factor = _mH(factor) if upper else factor
    y = _triangular_solve(lower_factor, b, lower=True)
    return _triangular_solve(lower_factor, y, lower=True, transpose_a=True, conjugate_a=True)


@lower(aten.cholesky_solve.default)
def cholesky_solve(b, factor, upper: bool = False):
    return cholesky_solve_helper(b, factor, upper)


@lower(aten.cholesky_inverse.default)
def cholesky_inverse(factor, upper: bool = False):
    eye = jnp.broadcast_to(jnp.eye(factor.shape[-1], dtype=factor.dtype), factor.shape)
    return cholesky_solve_helper(eye, factor, upper)


@lower(aten.linalg_solve_triangular.default)
def linalg_solve_triangular(a, b, *, upper: bool, left: bool = True, unitriangular: bool = False):
    return _triangular_solve(a, b, lower=not upper, left=left, unit=unitriangular)


@lower(aten.triangular_solve.default)
def triangular_solve(b, a, upper: bool = True, transpose: bool = False, unitriangular: bool = False):
    x = _triangular_solve(a, b, lower=not upper, transpose_a=transpose, unit=unitriangular)
    batch = x.shape[:-2]
    return x, jnp.broadcast_to(a, batch + a.shape[-2:])


@lower(aten._linalg_eigh.default)
def linalg_eigh(a, UPLO: str = "L", compute_v: bool = True):
    if UPLO not in ("L", "U"):
        raise ValueError(f"linalg.eigh: UPLO must be 'L' or 'U', got {UPLO!r}")
    values, vectors = jnp.linalg.eigh(a, UPLO=UPLO, symmetrize_input=False)
    if not compute_v:
        return values, jnp.zeros((0,), a.dtype)
    return values, vectors


try:  # JAX's SVD for TPUs (QDWH polar decomposition, then eigh), as a traceable function
    from jax._src.tpu.linalg import svd as _tpu_svd
except ImportError:  # another JAX layout: XLA's svd lowering everywhere
    _tpu_svd = None


def svd(a, *, full_matrices: bool = False, compute_uv: bool = True):
    """``jnp.linalg.svd`` that a TPU can compile: ``(u, s, vh)``, or ``s`` alone without ``compute_uv``.

    JAX builds its TPU SVD when it lowers the program, under the process's settings, and
    tpurec runs JAX with 64-bit types: the SVD then carries float64 and int64 parts, and XLA's
    TPU compiler aborts the whole process on it (a failed check in its TransposeFolding pass;
    measured on a v5e with JAX 0.10.2 alone, ``jax_enable_x64`` on, ``compute_uv=True``; through
    tpurec also ``svdvals``). So for a TPU the same algorithm is traced here, with 64-bit types off,
    for float32 and complex64 inputs; other platforms keep LAPACK's.
    """

    def lapack(x):
        out = jnp.linalg.svd(x, full_matrices=full_matrices, compute_uv=compute_uv)
        return tuple(out) if compute_uv else out

    tpu_svd = _tpu_svd
    if tpu_svd is None or a.size == 0 or a.dtype not in (jnp.float32, jnp.complex64):
        return lapack(a)  # (a 64-bit input cannot be traced with 64-bit types off)

    def tpu(x):
        fn = functools.partial(tpu_svd.svd, full_matrices=full_matrices, compute_uv=compute_uv)
        for _ in range(x.ndim - 2):
            fn = jax.vmap(fn)
        with jax.enable_x64(False):
            out = fn(x)
        return tuple(out) if compute_uv else out

    return lax.platform_dependent(a, tpu=tpu, default=lapack)


@lower(aten._linalg_svd.default)
def linalg_svd(a, full_matrices: bool = False, compute_uv: bool = True, *, driver=None):
    if not compute_uv:
        return jnp.zeros((0,), a.dtype), svd(a, compute_uv=False), jnp.zeros((0,), a.dtype)
    u, s, vh = svd(a, full_matrices=full_matrices)
    return u, s, vh


@lower(aten.linalg_qr.default)
def linalg_qr(a, mode: str = "reduced"):
    if mode not in ("reduced", "complete", "r"):
        raise ValueError(f"linalg.qr: mode must be 'reduced', 'complete' or 'r', got {mode!r}")
    if mode == "r":
        return jnp.zeros((0,), a.dtype), jnp.linalg.qr(a, mode="r")
    q, r = jnp.linalg.qr(a, mode=mode)
    return q, r


@lower(aten.linalg_eig.default)
def linalg_eig(a):
    # XLA implements the nonsymmetric eigendecomposition on CPU only (LAPACK's geev). Elsewhere JAX
    # fails deep in its lowering; say what to do instead. (Running geev on the host inside the
    # program through jax.pure_callback aborted the process on a TPU v5e.)
    if jax.default_backend() != "cpu":
        raise NotImplementedError(
            f"torch.linalg.eig (and eigvals) has no implementation for the {jax.default_backend()} platform in XLA; "
            "compute it on the CPU (torch.linalg.eig(x.cpu())) or, for a symmetric/Hermitian matrix, use "
            "torch.linalg.eigh on the device"
        )
    values, vectors = jnp.linalg.eig(a)
    return values, vectors


# PyTorch's CPU and CUDA kernels scale A by 2^-s until its 1-norm is at most this, take a degree-18
# Taylor approximation and square s times (Bader, Blanes and Casas, "Computing the matrix exponential
# with an optimized Taylor polynomial approximation", 2019): the bounds for 32- and 64-bit types.
_EXPM_THETA = {32: 3.010066362817634, 64: 1.090863719290036}
_EXPM_DEGREE = 18


def _expm_squarings(norm, theta: float):
    """max(0, ceil(log2(norm / theta))) without a logarithm: exact, where a TPU's float32 log is not."""
    mantissa, exponent = jnp.frexp(norm / theta)  # norm / theta = mantissa * 2**exponent, mantissa in [0.5, 1)
    s = exponent - (mantissa == 0.5).astype(exponent.dtype)
    return jnp.where(jnp.isfinite(norm), jnp.maximum(s, 0), 0)


@lower(aten.linalg_matrix_exp.default)
def linalg_matrix_exp(a):
    """exp(A) by PyTorch's method: scaling, a degree-18 Taylor polynomial, squaring.

    Only matrix products, so every platform runs it alike (JAX's Pade form needs a solve, and
    chooses its squarings with a float32 log). The Taylor polynomial is evaluated in
    Paterson-Stockmeyer form (powers up to A^4, then Horner in A^4). PyTorch's kernels use an
    approximation with the same terms through degree 18 in fewer products (within the bound, the
    terms beyond are below the type's precision), so results agree to rounding.
    """
    if a.size == 0:
        return a
    real = jnp.finfo(a.dtype).dtype if jnp.iscomplexobj(a) else a.dtype
    theta = _EXPM_THETA[64 if jnp.dtype(real).itemsize == 8 else 32]
    n = a.shape[-1]
    norm = jnp.max(jnp.sum(jnp.abs(a), axis=-2), axis=-1)  # the 1-norm: the largest column sum
    s = _expm_squarings(norm, theta)
    scaled = a * jnp.ldexp(jnp.ones((), real), -s).astype(a.dtype)[..., None, None]  # 2^-s, exact
    eye = jnp.broadcast_to(jnp.eye(n, dtype=a.dtype), a.shape)
    squared = _exact_matmul(scaled, scaled)
    powers = [eye, scaled, squared, _exact_matmul(squared, scaled), _exact_matmul(squared, squared)]
    coefficients = [1.0 / math.factorial(k) for k in range(_EXPM_DEGREE + 1)]
    blocks = [
        sum(coefficients[4 * j + i] * powers[i] for i in range(4) if 4 * j + i <= _EXPM_DEGREE)
        for j in range(_EXPM_DEGREE // 4 + 1)
    ]
    result = blocks[-1]
    for block in reversed(blocks[:-1]):
        result = _exact_matmul(result, powers[4]) + block

    def square(i, x):
        return jnp.where((i < s)[..., None, None], _exact_matmul(x, x), x)

    return lax.fori_loop(0, jnp.max(s), square, result)


@lower(aten.linalg_pinv.atol_rtol_tensor)
def linalg_pinv(a, *, atol=None, rtol=None, hermitian: bool = False):
    m, n = a.shape[-2], a.shape[-1]
    real = jnp.finfo(a.dtype).dtype if jnp.iscomplexobj(a) else a.dtype
    eps = jnp.finfo(real).eps
    if hermitian:
        values, vectors = jnp.linalg.eigh(a, symmetrize_input=False)
        s = jnp.abs(values)
    else:
        u, s, vh = svd(a)
    # torch's tolerance rule: max(atol, rtol * largest singular value); rtol
    # defaults to eps * max(m, n) unless a positive atol was given.
    atol_v = jnp.zeros((), real) if atol is None else atol.astype(real)
    if rtol is not None:
        rtol_v = rtol.astype(real)
    elif atol is not None:
        rtol_v = jnp.where(atol_v > 0, jnp.zeros((), real), eps * max(m, n))
    else:
        rtol_v = jnp.asarray(eps * max(m, n), real)
    largest = jnp.max(s, axis=-1, keepdims=True, initial=0.0) if s.shape[-1] else jnp.zeros(s.shape[:-1] + (1,), real)
    tol = jnp.maximum(
        atol_v[..., None] if jnp.ndim(atol_v) else atol_v, (rtol_v[..., None] if jnp.ndim(rtol_v) else rtol_v) * largest
    )
    keep = s > tol
    if hermitian:
        inv = jnp.where(keep, 1 / jnp.where(keep, values, 1), 0).astype(a.dtype)
        return _exact_matmul(vectors * inv[..., None, :], _mH(vectors))
    inv = jnp.where(keep, 1 / jnp.where(keep, s, 1), 0).astype(a.dtype)
    return _exact_matmul(_mH(vh) * inv[..., None, :], _mH(u))


@lower(aten.linalg_lstsq.default, static_scalars=True)
def linalg_lstsq(a, b, rcond=None, *, driver=None):
    """Least squares through the SVD: the minimum-norm solution, as LAPACK's gelsy/gelsd give.

    Outputs follow the CPU drivers' shapes: ``gelsy`` (the default) reports the
    rank only; ``gelsd``/``gelss`` also the squared residuals (when m > n) and the
    singular values; ``gels`` the residuals only. Residuals are reported for
    every m > n input (LAPACK omits them for rank-deficient ones).
    """
    driver = driver or "gelsy"
    if driver not in ("gelsy", "gelsd", "gelss", "gels"):
        raise ValueError(f"linalg.lstsq: driver must be gels, gelsy, gelsd or gelss, got {driver!r}")
    m, n = a.shape[-2], a.shape[-1]
    vector = b.ndim == a.ndim - 1
    rhs = b[..., None] if vector else b
    real = jnp.finfo(a.dtype).dtype if jnp.iscomplexobj(a) else a.dtype
    if rcond is None or rcond < 0:
        rcond = float(jnp.finfo(real).eps) * max(m, n)
    u, s, vh = svd(a)
    largest = jnp.max(s, axis=-1, keepdims=True, initial=0.0)
    keep = s > rcond * largest
    s_inv = jnp.where(keep, 1 / jnp.where(keep, s, 1), 0).astype(a.dtype)
    a_b, rhs_b = _broadcast_batch(a, rhs)
    u_b = jnp.broadcast_to(u, a_b.shape[:-2] + u.shape[-2:])
    vh_b = jnp.broadcast_to(vh, a_b.shape[:-2] + vh.shape[-2:])
    s_inv_b = jnp.broadcast_to(s_inv, a_b.shape[:-2] + s_inv.shape[-1:])

    def apply_pinv(r):
        return _exact_matmul(_mH(vh_b), s_inv_b[..., :, None] * _exact_matmul(_mH(u_b), r))

    x = apply_pinv(rhs_b)
    # One step of iterative refinement with the same factors: a TPU's SVD (QDWH) is less accurate
    # than LAPACK's, and lstsq amplifies that by the condition number (6.9e-5 against float64 on
    # a v5e where CPU's gelsy erred 1.6e-6); the correction solves for the residual.
    x = x + apply_pinv(rhs_b - _exact_matmul(a_b, x))
    empty = jnp.zeros((0,), real)
    residuals = empty
    if m > n and driver != "gelsy":
        residuals = jnp.sum(jnp.abs(_exact_matmul(a_b, x) - rhs_b) ** 2, axis=-2)
        if vector:
            residuals = residuals[..., 0]
    rank = jnp.sum(keep, axis=-1).astype(jnp.int64) if driver != "gels" else jnp.zeros((0,), jnp.int64)
    singular_values = s if driver in ("gelsd", "gelss") else empty
    return (x[..., 0] if vector else x), residuals, rank, singular_values


def _check_errors_on_host(info: torch.Tensor, api_name: str, *, is_matrix: bool) -> None:
    """``_linalg_check_errors``: reads ``info`` back (a sync point, as on CUDA) and
    raises torch's own error for a singular / non-positive-definite input."""
    # _to_copy, not .cpu(): below autograd ``to`` arrives as a (wrongly) view-like op.
    host_info = aten._to_copy.default(info, device=torch.device("cpu"))
    aten._linalg_check_errors(host_info, api_name, is_matrix=is_matrix)


lower(aten._linalg_check_errors.default, kind=Kind.COMPOSITE)(_check_errors_on_host)


# --- Householder (LAPACK geqrf / orgqr / ormqr) ----------------------------------


@lower(aten.geqrf.default)
def geqrf(a):
    """QR in LAPACK's compact form: R above the diagonal, the reflectors below, and their scales."""
    reflectors, taus = jnp.linalg.qr(a, mode="raw")  # numpy's "raw" layout is the transpose of LAPACK's
    return jnp.swapaxes(reflectors, -1, -2), taus


@lower(aten.linalg_householder_product.default)
def linalg_householder_product(reflectors, taus):
    """The first n columns of Q = H_1 ... H_k (LAPACK orgqr)."""
    return lax.linalg.householder_product(reflectors, taus.astype(reflectors.dtype))


@lower(aten.ormqr.default)
def ormqr(reflectors, taus, other, left: bool = True, transpose: bool = False):
    """Q @ other, Q^H @ other, other @ Q or other @ Q^H without forming Q (LAPACK ormqr)."""
    return lax.linalg.ormqr(reflectors, taus.astype(reflectors.dtype), other, left=left, transpose=transpose)


# --- pairwise distances (nn.functional.pdist) --------------------------------------


def _pairs(n: int):
    """Row and column of each pair i < j, in ``pdist``'s order (row-major upper triangle)."""
    return np.triu_indices(n, k=1)


@lower(aten._pdist_forward.default, static_scalars=True)
def _pdist_forward(x, p: float = 2.0):
    """p-norm distance between every pair of rows of ``x`` (N, M) -> (N (N - 1) / 2,)."""
    rows, cols = _pairs(x.shape[0])
    diff = jnp.abs(x[rows] - x[cols])
    if p == 0:
        return (diff != 0).sum(axis=-1).astype(x.dtype)
    if p == float("inf"):
        return diff.max(axis=-1, initial=0)
    if p == 1:
        return diff.sum(axis=-1)
    if p == 2:
        return jnp.sqrt((diff * diff).sum(axis=-1))
    return (diff**p).sum(axis=-1) ** (1.0 / p)


@lower(aten._pdist_backward.default, static_scalars=True)
def _pdist_backward(grad, x, p: float, dist):
    """ATen's pdist gradient per pair (zero where the distance is zero), added to row i, subtracted from row j."""
    n = x.shape[0]
    rows, cols = _pairs(n)
    diff = x[rows] - x[cols]
    g, d = grad[:, None], dist[:, None]
    zero = jnp.zeros((), x.dtype)
    if p == 0 or n < 2:
        contribution = jnp.zeros_like(diff)
    elif p == 1:
        contribution = g * jnp.sign(diff)
    elif p < 2:
        skip = (d == 0) | ((diff == 0) & (p < 1))
        safe_d = jnp.where(d == 0, 1, d)
        contribution = jnp.where(skip, zero, jnp.sign(diff) * jnp.abs(diff) ** (p - 1) * g / safe_d ** (p - 1))
    elif p == 2:
        contribution = jnp.where(d == 0, zero, g * diff / jnp.where(d == 0, 1, d))
    elif p == float("inf"):
        contribution = g * jnp.sign(diff) * (jnp.abs(diff) == d)
    else:
        safe_d = jnp.where(d == 0, 1, d)
        contribution = jnp.where(d == 0, zero, diff * jnp.abs(diff) ** (p - 2) * g / safe_d ** (p - 1))
    return jnp.zeros_like(x).at[rows].add(contribution).at[cols].add(-contribution)
