"""TorchRec's ``FUSED`` compute kernel for an ``EmbeddingCollection`` on the tpu device (unpooled lookups).

TorchRec's sequence sharders build FBGEMM's TBE with ``PoolingMode.NONE`` for a ``FUSED`` group of an
``EmbeddingCollection``: its forward returns one row per id of the group's features, ``[ids, dim]`` in
the KJT's value order (the group's tables share one dim), which TorchRec's grouped lookup flattens
and its output distribution splits per feature; its backward applies the fused optimizer to the rows
the ids read. :func:`sequence_kernel_class` gives the same on tpurec's sparse ops: each id is a bag
of its own (``sparse_dense_matmul`` over a one-partition CSR input whose sample of entry ``i`` is
``i``, gain 1), and the backward runs the same ``sparse_dense_matmul_grad_with_<optimizer>`` update
as the pooled kernel (:mod:`tpurec.dmp.fused_kernel`, whose tables, optimizer state, checks and
``KeyedOptimizer`` it shares). A row read by several ids gets one update on their summed gradient,
as FBGEMM's exact optimizers do.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

__all__ = ["create_kernel", "sequence_kernel_class"]


class _SequenceLookup(torch.autograd.Function):
    """The unpooled lookup of a kernel's tables; its backward runs the kernel's fused optimizer."""

    @staticmethod
    def forward(ctx: Any, kernel: Any, inputs: list[tuple[tuple[torch.Tensor, ...], int]], placeholder, *weights):
        ctx.kernel, ctx.inputs = kernel, inputs
        outputs = []
        for (csr, ids), weight in zip(inputs, weights, strict=True):
            rows = torch.ops.tpurec.sparse_dense_matmul(*csr, weight, batch_size=max(ids, 1))
            outputs.append(rows[:ids].float())
        return outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=0)

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor):
        ctx.kernel._update_rows(ctx.inputs, grad_output)
        # The tables were updated in place: they get no .grad (a dense optimizer skips them).
        return (None, None, None) + (None,) * len(ctx.inputs)


_CLASS: type | None = None


def sequence_kernel_class() -> type:
    """The ``TpuFusedEmbedding`` class: TorchRec's ``FUSED`` sequence kernel on tpu (built on first use)."""
    global _CLASS
    if _CLASS is None:
        from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

        from tpurec.core import mode
        from tpurec.dmp.fused_kernel import kernel_class

        class SequenceKernel(kernel_class()):
            _sequence = True

            def __init__(self, config: Any, pg: Any = None, device: torch.device | None = None) -> None:
                super().__init__(config, pg, device)

            def forward(self, features: KeyedJaggedTensor, *args: Any, **kwargs: Any) -> torch.Tensor:  # pyright: ignore[reportIncompatibleMethodOverride]
                if features.variable_stride_per_key():
                    raise NotImplementedError(
                        "variable batch sizes per feature with the FUSED kernel on tpu are not run by tpurec"
                    )
                batch = features.stride()
                offsets = features.offsets().cpu()
                values = features.values()
                device = values.device
                inputs, first = [], 0
                for count in self._features:
                    start, end = int(offsets[first * batch]), int(offsets[(first + count) * batch])
                    ids = end - start
                    entries = max(ids, 1)  # one padding entry (past the row pointer) for no ids
                    rows = (
                        values[start:end].to(torch.int32) if ids else torch.zeros(1, dtype=torch.int32, device=device)
                    )
                    samples = torch.arange(entries, dtype=torch.int32).to(device)
                    gains = torch.ones(entries, dtype=torch.float32, device=device)
                    row_pointers = torch.tensor([ids], dtype=torch.int32).to(device)
                    inputs.append(((row_pointers, rows, samples, gains), ids))
                    first += count
                return _SequenceLookup.apply(self, inputs, self._placeholder, *self._tables.values())

            def _update_rows(self, inputs: list[tuple[tuple[torch.Tensor, ...], int]], grad: torch.Tensor) -> None:
                self._steps += 1  # one optimizer step per backward of the group, as FBGEMM's TBE counts
                op = getattr(torch.ops.tpurec, self.optimizer.op_name)
                hyperparameters = self.optimizer.hyperparameters(self._steps)
                start = 0
                with torch.no_grad():
                    for (csr, ids), (name, weight) in zip(inputs, self._tables.items(), strict=True):
                        rows = grad[start : start + ids]
                        start += ids
                        if ids == 0:  # the padding entry's gradient
                            rows = torch.zeros(1, weight.shape[1], dtype=grad.dtype, device=grad.device)
                        slots = list(self.slots[name].values())
                        fused = mode("fused") if weight.device.type == "tpu" else contextlib.nullcontext()
                        with fused:  # one fused program for the update and its write-back
                            updated = op(*csr, rows.float().contiguous(), weight.detach(), *slots, **hyperparameters)
                            updated = updated if isinstance(updated, (tuple, list)) else (updated,)
                            for target, value in zip([weight, *slots], updated, strict=True):
                                target.copy_(value)

        SequenceKernel.__name__ = SequenceKernel.__qualname__ = "TpuFusedEmbedding"
        SequenceKernel.__module__ = __name__
        _CLASS = SequenceKernel
    return _CLASS


def create_kernel(config: Any, pg: Any, device: torch.device) -> Any:
    """The tpu kernel of an ``EmbeddingCollection``'s ``FUSED`` table group, or None for another kernel.

    Args:
        config: the ``GroupedEmbeddingConfig``.
        pg: its process group.
        device: a tpu device.

    Raises:
        NotImplementedError: a group tpurec cannot run as TorchRec would (the pooled kernel's checks).
    """
    from torchrec.distributed.embedding_types import EmbeddingComputeKernel

    if config.compute_kernel != EmbeddingComputeKernel.FUSED:
        return None
    return sequence_kernel_class()(config, pg, device)
