"""Fused embedding optimizers: configs (hyperparameters as in FBGEMM) and slots.

An embedding optimizer runs inside the backward of the lookup (as on
SparseCores and in FBGEMM's TBE), on the touched rows only. Each config
names its gradient op and the optimizer slots (state tensors) it needs.

Example::

    from tpurec.sparse import Adam, EmbeddingBagCollection
    ebc = EmbeddingBagCollection(tables, optimizer=Adam(learning_rate=1e-3))
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, Mapping

__all__ = [
    "EmbeddingOptimizer",
    "SGD",
    "Adagrad",
    "RowWiseAdagrad",
    "Adam",
    "optimizer_from_torch",
]


@dataclasses.dataclass
class EmbeddingOptimizer:
    """Base of the fused optimizer configs.

    Attributes:
        learning_rate: step size (mutable: a schedule may change it each step;
            it is a traced value, so changing it never recompiles).
    """

    learning_rate: float = 0.01

    op_name: ClassVar[str]
    # slot name -> "row" ([rows]) or "element" ([rows, dim])
    slots: ClassVar[dict[str, str]] = {}

    def hyperparameters(self, step: int) -> dict[str, float]:
        """Keyword arguments of the gradient op for update number ``step`` (from 1)."""
        del step
        return {"learning_rate": float(self.learning_rate)}


@dataclasses.dataclass
class SGD(EmbeddingOptimizer):
    """Plain SGD (FBGEMM ``EXACT_SGD``): ``w -= lr * g``.

    Example::

        SGD(learning_rate=0.1)
    """

    op_name: ClassVar[str] = "sparse_dense_matmul_grad_with_sgd"
    slots: ClassVar[dict[str, str]] = {}


@dataclasses.dataclass
class Adagrad(EmbeddingOptimizer):
    """Element-wise Adagrad (FBGEMM ``EXACT_ADAGRAD``).

    Example::

        Adagrad(learning_rate=0.1, eps=1e-8)
    """

    eps: float = 1.0e-8

    op_name: ClassVar[str] = "sparse_dense_matmul_grad_with_adagrad"
    slots: ClassVar[dict[str, str]] = {"momentum1": "element"}

    def hyperparameters(self, step: int) -> dict[str, float]:
        return {"learning_rate": float(self.learning_rate), "eps": float(self.eps)}


@dataclasses.dataclass
class RowWiseAdagrad(EmbeddingOptimizer):
    """Row-wise Adagrad (FBGEMM ``EXACT_ROWWISE_ADAGRAD``): one accumulator per row.

    Args:
        weight_decay: L2 weight decay (FBGEMM ``WeightDecayMode.L2``).

    Example::

        RowWiseAdagrad(learning_rate=0.05)
    """

    eps: float = 1.0e-8
    weight_decay: float = 0.0

    op_name: ClassVar[str] = "sparse_dense_matmul_grad_with_rowwise_adagrad"
    slots: ClassVar[dict[str, str]] = {"momentum1": "row"}

    def hyperparameters(self, step: int) -> dict[str, float]:
        return {
            "learning_rate": float(self.learning_rate),
            "eps": float(self.eps),
            "weight_decay": float(self.weight_decay),
        }


@dataclasses.dataclass
class Adam(EmbeddingOptimizer):
    """Lazy Adam on the touched rows (FBGEMM ``ADAM``), bias-corrected by the
    module's step count.

    Example::

        Adam(learning_rate=1e-3, beta1=0.9, beta2=0.999)
    """

    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1.0e-8
    weight_decay: float = 0.0

    op_name: ClassVar[str] = "sparse_dense_matmul_grad_with_adam"
    slots: ClassVar[dict[str, str]] = {"momentum1": "element", "momentum2": "element"}

    def hyperparameters(self, step: int) -> dict[str, float]:
        return {
            "learning_rate": float(self.learning_rate),
            "beta1": float(self.beta1),
            "beta2": float(self.beta2),
            "eps": float(self.eps),
            "weight_decay": float(self.weight_decay),
            "step": float(step),
        }


def _kwargs(kwargs: Mapping[str, Any], fields: tuple[str, ...]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in kwargs.items():
        if key in ("lr", "learning_rate"):
            out["learning_rate"] = value
        elif key == "betas":
            out["beta1"], out["beta2"] = value
        elif key in fields:
            out[key] = value
        elif key in ("weight_decay_mode",):
            # FBGEMM's mode enum: only the default semantics are modelled.
            continue
        else:
            raise ValueError(f"unsupported embedding optimizer argument {key}={value!r}")
    return out


def optimizer_from_torch(optimizer: Any, kwargs: Mapping[str, Any] | None = None) -> EmbeddingOptimizer:
    """The fused optimizer config for a torch/torchrec optimizer class or FBGEMM type.

    Unspecified hyperparameters take FBGEMM's defaults, as torchrec's fused
    modules do (e.g. Adagrad's eps is 1e-8, not torch's 1e-10).

    Args:
        optimizer: ``torch.optim.SGD``, ``torch.optim.Adagrad``,
            ``torchrec.optim.RowWiseAdagrad``, ``torch.optim.Adam``, or an
            FBGEMM ``EmbOptimType``; an :class:`EmbeddingOptimizer` passes through.
        kwargs: the optimizer's keyword arguments (``lr``, ``eps``, ...).

    Returns:
        The config.

    Example::

        optimizer_from_torch(torch.optim.Adagrad, {"lr": 0.1})
    """
    if isinstance(optimizer, EmbeddingOptimizer):
        return optimizer
    import torch
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from torchrec.optim import RowWiseAdagrad as TorchrecRowWiseAdagrad

    kwargs = dict(kwargs or {})
    table = {
        torch.optim.SGD: SGD,
        EmbOptimType.EXACT_SGD: SGD,
        torch.optim.Adagrad: Adagrad,
        EmbOptimType.EXACT_ADAGRAD: Adagrad,
        TorchrecRowWiseAdagrad: RowWiseAdagrad,
        EmbOptimType.EXACT_ROWWISE_ADAGRAD: RowWiseAdagrad,
        torch.optim.Adam: Adam,
        EmbOptimType.ADAM: Adam,
    }
    cls = table.get(optimizer)
    if cls is None:
        raise ValueError(f"no fused embedding optimizer for {optimizer}; supported: SGD, Adagrad, RowWiseAdagrad, Adam")
    if cls is SGD:
        # torch.optim.SGD extras that are no-ops at their defaults.
        for key, default in (("momentum", 0), ("dampening", 0), ("nesterov", False), ("weight_decay", 0)):
            if kwargs.pop(key, default) != default:
                raise ValueError(f"fused SGD does not support {key}")
    fields = tuple(f.name for f in dataclasses.fields(cls))
    return cls(**_kwargs(kwargs, fields))
