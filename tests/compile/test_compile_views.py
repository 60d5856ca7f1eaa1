"""The functional view lowerings agree with torch's views (values only)."""

import jax.numpy as jnp
import numpy as np
import pytest
import torch

from tpurec.compile.views import VIEWS

aten = torch.ops.aten

X = torch.arange(2 * 3 * 4, dtype=torch.float32).reshape(2, 3, 4)

CASES = [
    (aten.view.default, (X, [6, -1])),
    (aten._unsafe_view.default, (X, [4, 6])),
    (aten.permute.default, (X, [2, 0, 1])),
    (aten.t.default, (X[0],)),
    (aten.transpose.int, (X, -1, 0)),
    (aten.unsqueeze.default, (X, -1)),
    (aten.unsqueeze.default, (X, 1)),
    (aten.squeeze.dim, (X[:, :1], 1)),
    (aten.squeeze.dims, (X[:1, :, :1], [0, 1, 2])),
    (aten.squeeze.default, (X[:1],)),
    (aten.expand.default, (X[:, :1], [5, 2, -1, 4])),
    (aten.slice.Tensor, (X, 2, 1, None, 2)),
    (aten.slice.Tensor, (X, 1, -2, 9223372036854775807)),
    (aten.slice.Tensor, (X, 0, 5, 9)),
    (aten.select.int, (X, 1, -1)),
    (aten.narrow.default, (X, 2, 1, 2)),
    (aten.split.Tensor, (X, 3, 2)),
    (aten.split_with_sizes.default, (X, [1, 3], -1)),
    (aten.unbind.int, (X, 1)),
    (aten.diagonal.default, (X, 1, 1, 2)),
    (aten.unfold.default, (X, 2, 2, 1)),
    (aten.as_strided.default, (X, [3, 2], [1, 4], 2)),
    (aten.alias.default, (X,)),
    (aten.view.dtype, (X, torch.int32)),
]


@pytest.mark.parametrize("op, args", CASES, ids=[f"{op}-{i}" for i, (op, _) in enumerate(CASES)])
def test_view_matches_torch(op, args):
    want = op(*args)
    jargs = [jnp.asarray(a.contiguous().numpy()) if isinstance(a, torch.Tensor) else a for a in args]
    got = VIEWS[op](*jargs)
    wants = want if isinstance(want, (list, tuple)) else [want]
    gots = got if isinstance(got, (list, tuple)) else [got]
    assert len(gots) == len(wants)
    for g, w in zip(gots, wants):
        np.testing.assert_array_equal(np.asarray(g), w.numpy())


def test_as_strided_scatter_matches_torch():
    base = torch.zeros(12)
    src = torch.arange(6, dtype=torch.float32).reshape(3, 2)
    want = torch.as_strided_scatter(base, src, [3, 2], [1, 4], 1)
    got = VIEWS[aten.as_strided_scatter.default](
        jnp.zeros(12, jnp.float32), jnp.asarray(src.numpy()), [3, 2], [1, 4], 1
    )
    np.testing.assert_array_equal(np.asarray(got), want.numpy())
