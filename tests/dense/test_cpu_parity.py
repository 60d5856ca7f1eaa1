"""Ops whose tpu results the CPU shadow (``tpurec.debug.shadow``) found differing from PyTorch CPU.

Each case runs through the tpu device and is compared with PyTorch on CPU: values exactly
(equal NaN places, the same zero signs where CPU's are consistent), dtypes exactly, and
errors by type and message.
"""

from __future__ import annotations

import pytest
import torch

NAN, INF = float("nan"), float("inf")


def _same(tpu: torch.Tensor, cpu: torch.Tensor, *, signed_zeros: bool = True) -> None:
    tpu = tpu.cpu()
    assert tpu.dtype == cpu.dtype and tpu.shape == cpu.shape
    torch.testing.assert_close(tpu, cpu, rtol=0, atol=0, equal_nan=True)
    if signed_zeros and not cpu.is_complex() and cpu.is_floating_point():
        assert torch.equal(torch.signbit(tpu), torch.signbit(cpu)), (tpu, cpu)


# --- sign / sgn: NaN -> 0, -0 -> +0 as on CPU --------------------------------------------


@pytest.mark.parametrize("op", [torch.sign, torch.sgn])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
def test_sign_of_nan_and_signed_zero_is_positive_zero(op, dtype):
    x = torch.tensor([NAN, -0.0, 0.0, 2.0, -3.0, INF, -INF, 1e-30], dtype=dtype)
    _same(op(x.to("tpu")), op(x))


@pytest.mark.parametrize("op", [torch.sign, torch.sgn])
@pytest.mark.parametrize("dtype", [torch.int8, torch.uint8, torch.int32, torch.int64, torch.bool])
def test_sign_of_integers_and_bools(op, dtype):
    x = torch.tensor([0, 1, 1, 0], dtype=dtype) if dtype == torch.bool else torch.tensor([0, 1, 7], dtype=dtype)
    if dtype.is_signed:
        x = torch.tensor([0, -1, 7, -128 if dtype == torch.int8 else -1000], dtype=dtype)
    _same(op(x.to("tpu")), op(x))


@pytest.mark.parametrize("dtype", [torch.complex64, torch.complex128])
def test_sgn_of_complex_is_unit_phase_and_zero_at_zero(dtype):
    # Finite values and NaN only: for infinite components CPU's own result depends on which
    # of its kernels (vectorised or scalar) handles the element.
    x = torch.tensor(
        [
            complex(NAN, 0),
            complex(0, NAN),
            complex(-0.0, -0.0),
            0j,
            complex(3, 4),
            complex(-1e-30, 1e-30),
            complex(1e30, -1e30),
            complex(0, -2),
        ],
        dtype=dtype,
    )
    tpu, cpu = torch.sgn(x.to("tpu")).cpu(), torch.sgn(x)
    assert tpu.dtype == cpu.dtype
    torch.testing.assert_close(tpu, cpu, rtol=1e-6, atol=0, equal_nan=True)
    # CPU's zero is +0+0j, also for -0-0j.
    zero = cpu.abs() == 0
    assert not torch.signbit(torch.view_as_real(tpu)[zero]).any()


# --- mixed dtypes that PyTorch refuses (JAX would promote them) -----------------------------


def _f(shape, dtype):
    return torch.arange(1, 1 + torch.Size(shape).numel(), dtype=dtype).reshape(shape) / 8


def _idx():
    return torch.tensor([[0, 2, 1]])


_MIXED = {
    "baddbmm": lambda a, b: torch.baddbmm(_f((2, 3, 3), a), _f((2, 3, 3), b), _f((2, 3, 3), b)),
    "addmm": lambda a, b: torch.addmm(_f((3, 3), a), _f((3, 3), b), _f((3, 3), b)),
    "addmm_mats": lambda a, b: torch.addmm(_f((3, 3), a), _f((3, 3), a), _f((3, 3), b)),
    "addbmm": lambda a, b: torch.addbmm(_f((3, 3), a), _f((2, 3, 3), b), _f((2, 3, 3), b)),
    "addmv": lambda a, b: torch.addmv(_f((3,), a), _f((3, 3), b), _f((3,), b)),
    "mm": lambda a, b: torch.mm(_f((3, 3), a), _f((3, 3), b)),
    "bmm": lambda a, b: torch.bmm(_f((2, 3, 3), a), _f((2, 3, 3), b)),
    "mv": lambda a, b: torch.mv(_f((3, 3), a), _f((3,), b)),
    "dot": lambda a, b: torch.dot(_f((3,), a), _f((3,), b)),
    "matmul": lambda a, b: torch.matmul(_f((2, 3, 3), a), _f((3, 3), b)),
    "linear": lambda a, b: torch.nn.functional.linear(_f((2, 3), a), _f((4, 3), b)),
    "conv1d": lambda a, b: torch.nn.functional.conv1d(_f((1, 1, 4), a), _f((1, 1, 2), b)),
    "scatter": lambda a, b: torch.scatter(_f((1, 3), a), 1, _idx(), _f((1, 3), b)),
    "scatter_reduce": lambda a, b: torch.scatter_reduce(_f((1, 3), a), 1, _idx(), _f((1, 3), b), "amax"),
    "scatter_add_": lambda a, b: _f((1, 3), a).scatter_add_(1, _idx(), _f((1, 3), b)),
    "index_add": lambda a, b: torch.index_add(_f((3,), a), 0, torch.tensor([0, 2]), _f((2,), b)),
    "index_copy": lambda a, b: torch.index_copy(_f((3,), a), 0, torch.tensor([0, 2]), _f((2,), b)),
    "index_put_": lambda a, b: _f((3,), a).index_put_((torch.tensor([0, 2]),), _f((2,), b), accumulate=True),
    "setitem": lambda a, b: _f((3,), a).__setitem__(torch.tensor([0, 2]), _f((2,), b)),
    "put": lambda a, b: _f((3,), a).put(torch.tensor([0, 2]), _f((2,), b)),
    "masked_scatter": lambda a, b: torch.masked_scatter(_f((3,), a), torch.tensor([True, False, True]), _f((3,), b)),
    "lerp": lambda a, b: torch.lerp(_f((3,), a), _f((3,), b), 0.25),
}


class _OnTpu(torch.overrides.TorchFunctionMode):
    """Every tensor a case makes is made on tpu (the same values as on CPU)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if isinstance(out, torch.Tensor) and out.device.type == "cpu":
            return out.to("tpu")
        return out


@pytest.mark.parametrize("other", [torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("case", sorted(_MIXED))
def test_mixed_dtypes_are_refused_as_on_cpu(case, other):
    fn = _MIXED[case]
    with pytest.raises(RuntimeError):
        fn(torch.float32, other)
    with _OnTpu(), pytest.raises(RuntimeError, match="dtype|scalar type"):
        fn(torch.float32, other)
    # One dtype is accepted and computes CPU's values.
    cpu = fn(torch.float32, torch.float32)
    with _OnTpu():
        tpu = fn(torch.float32, torch.float32)
    if cpu is not None:
        torch.testing.assert_close(tpu.cpu(), cpu, rtol=1.3e-6, atol=1e-5)


# --- shifts: t << 2, t >> 1, amounts >= the bit width and negative ones ----------------------

_SHIFTS = {
    "lshift_scalar": lambda x, s: x << 3,
    "rshift_scalar": lambda x, s: x >> 1,
    "lshift_tensor": lambda x, s: x << s,
    "rshift_tensor": lambda x, s: x >> s,
    "lshift_wide": lambda x, s: x << 70,
    "rshift_wide": lambda x, s: x >> 70,
    "lshift_negative": lambda x, s: x << -1,
    "rshift_negative": lambda x, s: x >> -1,
    # The amount wraps to the tensor's dtype first (int8: 257 -> 1, 300 -> 44 >= 8).
    "rshift_wrapping": lambda x, s: x >> 257,
    "lshift_wrapping": lambda x, s: x << 300,
    "ilshift": lambda x, s: x.clone().__ilshift__(s),
    "irshift_scalar": lambda x, s: x.clone().__irshift__(2),
    "bitwise_left_shift_scalar": lambda x, s: torch.bitwise_left_shift(x, 2),
    "bitwise_right_shift_scalar_tensor": lambda x, s: torch.bitwise_right_shift(-100, s),
    "rlshift": lambda x, s: 3 << s,
    "int64_amounts": lambda x, s: x >> s.long(),
    "and": lambda x, s: x & s,
    "xor_scalar": lambda x, s: x ^ 3,
}


def _shift_operands(dtype):
    if dtype == torch.uint8:
        x = torch.tensor([1, 3, 100, 200, 255, 7], dtype=dtype)
    else:
        x = torch.tensor([1, -3, 100, -128, 127, -1], dtype=dtype)
    s = torch.tensor([0, 1, 7, 8, 70, 200 if dtype == torch.uint8 else -2], dtype=dtype)
    return x, s


@pytest.mark.parametrize("dtype", [torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64])
@pytest.mark.parametrize("case", sorted(_SHIFTS))
def test_shifts_match_cpu(case, dtype):
    x, s = _shift_operands(dtype)
    cpu = _SHIFTS[case](x, s)
    tpu = _SHIFTS[case](x.to("tpu"), s.to("tpu"))
    _same(tpu, cpu)


@pytest.mark.parametrize(
    "case", ["lshift_scalar", "rshift_tensor", "bitwise_left_shift_scalar", "rlshift", "and", "xor_scalar"]
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bool])
def test_shifts_of_floats_and_bools_and_float_bitwise_ops_are_refused_as_on_cpu(case, dtype):
    x = torch.tensor([1, 0, 1], dtype=dtype)
    try:
        cpu = _SHIFTS[case](x, x)
    except NotImplementedError as error:
        with pytest.raises(NotImplementedError, match=str(error)):
            _SHIFTS[case](x.to("tpu"), x.to("tpu"))
    else:  # a bool tensor shifted by an int scalar is an int64 shift; bool & bool is logical
        _same(_SHIFTS[case](x.to("tpu"), x.to("tpu")), cpu)


# --- in-place and out=: results PyTorch will not cast into the written tensor -----------------

_WRITES = {
    "int_add_float": lambda: torch.zeros(3, dtype=torch.int64).add_(torch.ones(3)),
    "int_mul_float_scalar": lambda: torch.zeros(3, dtype=torch.int64).mul_(1.5),
    "bool_add_int": lambda: torch.zeros(3, dtype=torch.bool).add_(1),
    "out_int_of_float": lambda: torch.add(torch.ones(3), 1, out=torch.zeros(3, dtype=torch.int64)),
    "float_add_complex": lambda: torch.zeros(3).add_(torch.ones(3, dtype=torch.complex64)),
    "int_true_divide": lambda: torch.zeros(3, dtype=torch.int32).div_(2),
    # Same kind: accepted (rounded into the narrower dtype).
    "half_add_float": lambda: torch.zeros(3, dtype=torch.float16).add_(torch.full((3,), 1 / 3)),
    "int8_add_int64": lambda: torch.zeros(3, dtype=torch.int8).add_(torch.tensor([1, 300, -1])),
    "float_add_int": lambda: torch.zeros(3).add_(torch.tensor([1, 2, 3])),
    "bool_rshift_int": lambda: torch.ones(3, dtype=torch.bool).__irshift__(2),
    "int8_lshift_int64": lambda: torch.ones(3, dtype=torch.int8).__ilshift__(torch.tensor([1, 2, 9])),
}


@pytest.mark.parametrize("case", sorted(_WRITES))
def test_writes_refuse_the_casts_cpu_refuses(case):
    try:
        cpu = _WRITES[case]()
    except RuntimeError as error:
        with _OnTpu(), pytest.raises(RuntimeError, match=str(error)):
            _WRITES[case]()
    else:
        with _OnTpu():
            tpu = _WRITES[case]()
        _same(tpu, cpu)


_F32, _BF16, _F16, _F64 = torch.float32, torch.bfloat16, torch.float16, torch.float64


@pytest.mark.parametrize(
    "x, w, b",
    [
        (_F32, _BF16, _BF16),
        (_F32, _F64, _F64),
        (_BF16, _F16, _F16),
        (_BF16, _F32, _BF16),
        (_F64, _F32, _F32),
        (_BF16, _BF16, _F32),
        (_F32, _F32, _BF16),
        # accepted: one dtype, or float32 parameters of a bfloat16/float16 input
        (_BF16, _F32, _F32),
        (_F16, _F32, _F32),
        (_BF16, _BF16, _BF16),
        (_F32, _F32, None),
    ],
)
def test_layer_norm_parameter_dtypes_as_on_cpu(x, w, b):
    def run():
        return torch.ops.aten.native_layer_norm(
            torch.linspace(-2, 3, 8, dtype=x).reshape(2, 4),
            [4],
            torch.linspace(0.5, 2, 4, dtype=w),
            None if b is None else torch.linspace(-1, 1, 4, dtype=b),
            1e-5,
        )

    try:
        cpu = run()
    except RuntimeError:
        with _OnTpu(), pytest.raises(RuntimeError, match="native_layer_norm: expected"):
            run()
        return
    with _OnTpu():
        tpu = run()
    # The statistics of a bfloat16/float16 input are float32 on tpu as in the meta kernel (and CUDA),
    # CPU computes them at the input's precision (docs/observability.md): values at CPU's precision.
    rtol = {_BF16: 1.6e-2, _F16: 1e-3}.get(x, 1e-5)
    assert tpu[0].dtype == cpu[0].dtype
    for t, c in zip(tpu, cpu):
        torch.testing.assert_close(t.cpu().to(c.dtype), c, rtol=rtol, atol=1e-5)
