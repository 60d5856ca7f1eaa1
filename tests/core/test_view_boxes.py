"""read_view/write_view against PyTorch's own strided views, for random chains of view ops.

Views that are boxes of their storage (narrow, select, unbind, unsqueeze) take the
``lax.slice``/``dynamic_update_slice`` path; transposed ones the reshape/transpose
path; overlapping ones the gather path. Every path must read and write exactly the
elements PyTorch's view has (compared bit for bit).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tpurec.core.views import _box, read_view, write_view


@st.composite
def views(draw):
    shape = tuple(draw(st.lists(st.integers(1, 4), min_size=1, max_size=3)))
    base = torch.arange(int(np.prod(shape)), dtype=torch.float32).reshape(shape)
    view = base
    for _ in range(draw(st.integers(1, 4))):
        if view.ndim == 0:
            break
        dim = draw(st.integers(0, view.ndim - 1))
        op = draw(st.sampled_from(["narrow", "select", "transpose", "unsqueeze", "expand"]))
        if op in ("narrow", "select") and view.shape[dim] == 0:
            continue
        if op == "narrow":
            start = draw(st.integers(0, view.shape[dim] - 1))
            view = view.narrow(dim, start, draw(st.integers(0, view.shape[dim] - start)))
        elif op == "select":
            view = view.select(dim, draw(st.integers(0, view.shape[dim] - 1)))
        elif op == "transpose" and view.ndim > 1:
            view = view.transpose(dim, view.ndim - 1)
        elif op == "unsqueeze":
            view = view.unsqueeze(dim)
        elif op == "expand" and view.shape[dim] == 1:
            view = view.expand(*[3 if d == dim else -1 for d in range(view.ndim)])
    return base, view


@settings(max_examples=300, deadline=None)
@given(views())
def test_views_read_and_write_what_pytorch_views_hold(case):
    base, view = case
    spec = (tuple(view.shape), tuple(view.stride()), view.storage_offset())
    storage = jnp.asarray(base.numpy())
    np.testing.assert_array_equal(np.asarray(read_view(storage, *spec)), view.numpy())
    if any(s == 0 and n > 1 for n, s in zip(view.shape, view.stride())):
        return  # an expanded view is not written through (PyTorch refuses too)
    value = torch.randn(view.shape)
    expected = base.clone()
    expected.as_strided(*spec).copy_(value)
    np.testing.assert_array_equal(np.asarray(write_view(storage, jnp.asarray(value.numpy()), *spec)), expected.numpy())


def test_a_select_of_an_interaction_tensor_is_a_box():
    # DLRM's interaction input [B, 27, 64]: the backward of its concatenation reads one
    # feature [B, 64] per input, a box (lax.slice), not a gather of flat indices.
    assert _box((8, 27, 64), (8, 64), (1728, 1), 5 * 64) == ((0, 5, 0), (8, 1, 64))
    assert _box((8, 27, 64), (8, 64), (1, 8), 0) is None  # transposed: not a box
