"""A convolution's weight gradient on a TPU: one product of the input's patches, not XLA's float32 convolution.

XLA's TPU compiler took 26 s (v5e) for the float32 weight gradient of a ResNet stem (3 channels, 7x7,
stride 2), most of the zoo's ResNet step; ``tpurec/dense/conv.py`` computes it there as a product of
the input's strided slices. Checked on CPU: that product equals XLA's weight gradient (and PyTorch
CPU's) over strides, paddings, dilations and 1-3 spatial dims; the program ``convolution_backward``
lowers to for a TPU holds no convolution for the weight gradient, the CPU one keeps XLA's.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from jax import lax

from tpurec.dense import conv
from tpurec.dense.registry import get_lowering

aten = torch.ops.aten

CASES = [  # (input shape, weight shape, stride, padding, dilation)
    ((2, 3, 32, 32), (8, 3, 7, 7), (2, 2), (3, 3), (1, 1)),  # the zoo ResNet's stem
    ((2, 4, 9, 11), (5, 4, 3, 2), (1, 2), (1, 0), (2, 1)),
    ((3, 2, 17), (4, 2, 5), (3,), (2,), (1,)),
    ((1, 2, 5, 6, 7), (3, 2, 2, 3, 2), (1, 2, 1), (0, 1, 1), (2, 1, 1)),
]


@pytest.mark.parametrize(("shape", "kernel", "stride", "padding", "dilation"), CASES)
def test_patch_product_is_the_weight_gradient(shape, kernel, stride, padding, dilation) -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=g)
    weight = torch.randn(kernel, generator=g, requires_grad=True)
    forward = {3: torch.nn.functional.conv1d, 4: torch.nn.functional.conv2d, 5: torch.nn.functional.conv3d}[len(shape)]
    out = forward(x, weight, stride=stride, padding=padding, dilation=dilation)
    grad = torch.randn(out.shape, generator=g)
    out.backward(grad)
    assert weight.grad is not None
    by_patches = conv._weight_grad_by_patches(
        jnp.asarray(grad.numpy()), jnp.asarray(x.numpy()), kernel[2:], stride, padding, dilation, lax.Precision.HIGHEST
    )
    _, vjp = jax.vjp(
        lambda w: conv.convolution(jnp.asarray(x.numpy()), w, None, stride, padding, dilation, False, (0,), 1),
        jnp.asarray(weight.detach().numpy()),
    )
    (by_xla,) = vjp(jnp.asarray(grad.numpy()))
    # The project's float32 tolerance against PyTorch CPU (tests/dense/opinfo_device.py's TOL): a few
    # hundred products summed in another order than XLA's convolution differ in their last bits.
    torch.testing.assert_close(torch.tensor(np.asarray(by_patches)), weight.grad, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(
        torch.tensor(np.asarray(by_patches)), torch.tensor(np.asarray(by_xla)), rtol=1e-4, atol=1e-5
    )


def _convolutions(platform: str) -> int:
    lowering = get_lowering(aten.convolution_backward.default)
    assert lowering is not None

    def weight_gradient(grad, x, weight):
        return lowering.fn(grad, x, weight, None, [2, 2], [3, 3], [1, 1], False, [0, 0], 1, [False, True, False])[1]

    args = [jax.ShapeDtypeStruct(s, jnp.float32) for s in ((2, 8, 16, 16), (2, 3, 32, 32), (8, 3, 7, 7))]
    text = jax.export.export(jax.jit(weight_gradient), platforms=(platform,))(*args).mlir_module()
    return text.count("stablehlo.convolution")


def test_a_tpu_program_has_no_convolution_for_the_weight_gradient() -> None:
    assert _convolutions("tpu") == 0
    assert _convolutions("cpu") == 1
