"""A custom Pallas kernel as a PyTorch op on the tpu device, trained inside a model.

The kernel is DLRM's dot interaction (every pair of feature vectors of a sample,
dotted): ``features [B, F, D] -> [B, F*(F-1)/2]``, one grid step per block of
samples. Pallas runs it natively on a TPU and with ``interpret=True`` on every
other XLA platform (this machine). JAX cannot differentiate a Pallas call, so
the op gets its backward from ``backward=``, written in plain JAX.

The model trains on the ``tpu`` device in eager, fused and compiled mode and is
compared step by step with the same model in plain PyTorch on the CPU.

Run::

    python examples/pallas_kernel.py --steps 20 --mode fused
"""

from __future__ import annotations

import argparse
import functools

import jax
import jax.numpy as jnp
import numpy as np
import torch
from jax.experimental import pallas as pl

import tpurec
from tpurec.library import jax_op

BLOCK = 8  # samples per grid step


def _pairs(num_features: int) -> tuple[np.ndarray, np.ndarray]:
    """Row and column of each pair i < j, in the order of the output columns."""
    rows, cols = np.triu_indices(num_features, k=1)
    return rows, cols


def _interaction_kernel(features_ref, out_ref, *, num_features: int) -> None:
    x = features_ref[...].astype(jnp.float32)  # [BLOCK, F, D]
    # Static pairs, unrolled: a kernel cannot capture index arrays as constants.
    dots = [jnp.sum(x[:, i, :] * x[:, j, :], axis=-1) for i, j in zip(*_pairs(num_features))]
    out_ref[...] = jnp.stack(dots, axis=1).astype(out_ref.dtype)


def _interaction_backward(grad: jax.Array, features: jax.Array) -> jax.Array:
    """d(sum_p g_p <x_i(p), x_j(p)>)/dx = G x + G^T x, with G the pair gradients scattered to [F, F]."""
    num_features = features.shape[1]
    rows, cols = _pairs(num_features)
    pair_grads = jnp.zeros(features.shape[:1] + (num_features, num_features), features.dtype)
    pair_grads = pair_grads.at[:, rows, cols].set(grad)
    return jnp.einsum("bfg,bgd->bfd", pair_grads + jnp.swapaxes(pair_grads, 1, 2), features)


@jax_op("examples::dot_interaction", backward=_interaction_backward)
def dot_interaction(features: jax.Array) -> jax.Array:
    """Pairwise dot products of the feature vectors of each sample, as a Pallas kernel."""
    batch, num_features, dim = features.shape
    if batch % BLOCK:
        raise ValueError(f"dot_interaction: the batch ({batch}) must be a multiple of {BLOCK}")
    num_pairs = num_features * (num_features - 1) // 2
    return pl.pallas_call(
        functools.partial(_interaction_kernel, num_features=num_features),
        out_shape=jax.ShapeDtypeStruct((batch, num_pairs), features.dtype),
        grid=(batch // BLOCK,),
        in_specs=[pl.BlockSpec((BLOCK, num_features, dim), lambda i: (i, 0, 0))],
        out_specs=pl.BlockSpec((BLOCK, num_pairs), lambda i: (i, 0)),
        interpret=jax.default_backend() != "tpu",
    )(features)


def torch_dot_interaction(features: torch.Tensor) -> torch.Tensor:
    """The same op in plain PyTorch (the reference)."""
    rows, cols = _pairs(features.shape[1])
    gram = features @ features.transpose(1, 2)
    return gram[:, torch.as_tensor(rows), torch.as_tensor(cols)]


class InteractionModel(torch.nn.Module):
    """Dense features -> F embeddings -> dot interaction (the Pallas op or PyTorch) -> logit."""

    def __init__(self, num_dense: int = 13, num_features: int = 4, dim: int = 8, pallas: bool = True) -> None:
        super().__init__()
        self.num_features, self.dim, self.pallas = num_features, dim, pallas
        self.bottom = torch.nn.Linear(num_dense, num_features * dim)
        self.top = torch.nn.Linear(num_features * (num_features - 1) // 2, 1)

    def forward(self, dense: torch.Tensor) -> torch.Tensor:
        features = torch.relu(self.bottom(dense)).view(-1, self.num_features, self.dim)
        pairs = dot_interaction(features) if self.pallas else torch_dot_interaction(features)
        return self.top(pairs)


def train(mode: str, steps: int, batch: int = 32, seed: int = 0) -> list[tuple[float, float]]:
    """Trains the Pallas model on tpu and the PyTorch one on CPU side by side; returns their losses."""
    torch.manual_seed(seed)
    reference = InteractionModel(pallas=False)
    model = InteractionModel(pallas=True)
    model.load_state_dict(reference.state_dict())
    model = model.to("tpu")
    forward = torch.compile(model, backend="tpu") if mode == "compiled" else model
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.05) for m in (reference, model)]
    generator = torch.Generator().manual_seed(seed + 1)
    losses = []
    with tpurec.mode("eager" if mode == "compiled" else mode):
        for _ in range(steps):
            dense = torch.randn(batch, 13, generator=generator)
            labels = (dense[:, :1] > 0).float()
            step_losses = []
            for net, optimizer, device in ((reference, optimizers[0], "cpu"), (forward, optimizers[1], "tpu")):
                optimizer.zero_grad()
                logits = net(dense.to(device))
                loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, labels.to(device))
                loss.backward()
                optimizer.step()
                step_losses.append(loss.item())
            losses.append((step_losses[1], step_losses[0]))
    return losses


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--mode", choices=["eager", "fused", "compiled"], default="fused")
    args = parser.parse_args()
    losses = train(args.mode, args.steps)
    print(f"{'step':>5} {'tpu (pallas)':>14} {'cpu (torch)':>14}")
    for step, (ours, reference) in enumerate(losses):
        print(f"{step:>5} {ours:>14.6f} {reference:>14.6f}")
    worst = max(abs(a - b) for a, b in losses)
    print(f"largest loss difference: {worst:.2e}; compilations: {tpurec.stats()['compilations']}")


if __name__ == "__main__":
    main()
