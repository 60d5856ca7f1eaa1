"""Fused embedding optimizers: configs (hyperparameters as in FBGEMM) and slots.

An embedding optimizer runs inside the backward of the lookup (as on
SparseCores and in FBGEMM's TBE), on the touched rows only. Each config names
its update rule (:mod:`tpurec.sparse.update_rules`: the slots, hyperparameters
and row math, declared once), whose gradient op every kernel family runs; its
dataclass fields hold the hyperparameters' values.

A new optimizer is one rule and one config::

    from tpurec.sparse.update_rules import Slot, UpdateRule

    def momentum_rows(g, w, m, *, learning_rate, momentum, dtype):
        m = momentum * m + g
        return (w - learning_rate * m).astype(dtype), m

    @dataclasses.dataclass
    class SGDMomentum(EmbeddingOptimizer):
        momentum: float = 0.9
        rule: ClassVar[UpdateRule] = UpdateRule(
            "sgd_momentum", "SGD with momentum", (Slot("momentum1", "element"),),
            ("learning_rate", "momentum"), momentum_rows)

Example::

    from tpurec.sparse import Adam, EmbeddingBagCollection
    ebc = EmbeddingBagCollection(tables, optimizer=Adam(learning_rate=1e-3))
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, Literal, Mapping

from tpurec.sparse import ops  # noqa: F401  (defines the gradient op of each rule registered here)
from tpurec.sparse import update_rules
from tpurec.sparse.update_rules import UpdateRule

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

    A subclass sets ``rule`` (its :class:`~tpurec.sparse.update_rules.UpdateRule`, registered
    when the class is made) and has a field for each of the rule's hyperparameters but
    ``step`` (the module's update count).

    Attributes:
        learning_rate: step size (mutable: a schedule may change it each step;
            it is a traced value, so changing it never recompiles).
    """

    learning_rate: float = 0.01

    rule: ClassVar[UpdateRule]
    op_name: ClassVar[str]
    # slot name -> "row" ([rows]) or "element" ([rows, dim])
    slots: ClassVar[dict[str, str]] = {}

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        rule = cls.__dict__.get("rule")
        if rule is not None:
            update_rules.register(rule)
            cls.op_name = rule.op_name
            cls.slots = {s.name: s.kind for s in rule.slots}

    def __post_init__(self) -> None:
        if "rule" not in dir(type(self)):
            raise TypeError(f"{type(self).__name__} names no update rule (set the class attribute rule)")
        missing = [h for h in self.rule.hyperparameters if h != "step" and not hasattr(self, h)]
        if missing:
            raise TypeError(f"{type(self).__name__} has no field for the hyperparameters {missing} of its rule")

    def hyperparameters(self, step: int) -> dict[str, float]:
        """Keyword arguments of the gradient op for update number ``step`` (from 1)."""
        return {h: float(step) if h == "step" else float(getattr(self, h)) for h in self.rule.hyperparameters}


@dataclasses.dataclass
class SGD(EmbeddingOptimizer):
    """Plain SGD (FBGEMM ``EXACT_SGD``): ``w -= lr * g``.

    Example::

        SGD(learning_rate=0.1)
    """

    rule: ClassVar[UpdateRule] = update_rules.SGD


@dataclasses.dataclass
class Adagrad(EmbeddingOptimizer):
    """Element-wise Adagrad (FBGEMM ``EXACT_ADAGRAD``).

    Example::

        Adagrad(learning_rate=0.1, eps=1e-8)
    """

    eps: float = 1.0e-8

    rule: ClassVar[UpdateRule] = update_rules.ADAGRAD


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

    rule: ClassVar[UpdateRule] = update_rules.ROWWISE_ADAGRAD


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

    rule: ClassVar[UpdateRule] = update_rules.ADAM


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


def optimizer_from_torch(
    optimizer: Any, kwargs: Mapping[str, Any] | None = None, semantics: Literal["fbgemm", "torch"] = "fbgemm"
) -> EmbeddingOptimizer:
    """The fused optimizer config for a torch/torchrec optimizer class or FBGEMM type.

    With ``semantics="fbgemm"`` (a fused module: torchrec's ``FusedEmbeddingBagCollection``,
    tpurec's own ``EmbeddingBagCollection(optimizer=torch.optim.Adagrad)``) unspecified
    hyperparameters take FBGEMM's defaults, as torchrec's fused modules do (Adagrad's eps
    is 1e-8). With ``semantics="torch"`` (the optimizer a user gave to torchrec's
    ``apply_optimizer_in_backward``, which runs the torch optimizer itself on the table's
    dense gradient) they take torch's defaults (Adagrad's eps is 1e-10), and settings
    whose torch update touches rows the batch did not look up (Adam's moments, weight
    decay) raise: the fused update only writes the touched rows, so it would differ.

    Args:
        optimizer: ``torch.optim.SGD``, ``torch.optim.Adagrad``,
            ``torchrec.optim.RowWiseAdagrad``, ``torch.optim.Adam``, or an
            FBGEMM ``EmbOptimType``; an :class:`EmbeddingOptimizer` passes through.
        kwargs: the optimizer's keyword arguments (``lr``, ``eps``, ...).
        semantics: whose update rule and defaults the config must reproduce.

    Returns:
        The config.

    Raises:
        ValueError: no fused optimizer reproduces ``optimizer`` with ``kwargs`` exactly.

    Example::

        optimizer_from_torch(torch.optim.Adagrad, {"lr": 0.1})  # eps=1e-8 (FBGEMM)
        optimizer_from_torch(torch.optim.Adagrad, {"lr": 0.1}, semantics="torch")  # eps=1e-10
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
    if semantics == "torch":
        _check_torch_semantics(optimizer, cls, kwargs)
        # Settings at torch's defaults that the fused update has no field for.
        kwargs = {k: v for k, v in kwargs.items() if _TORCH_NO_OPS.get(k, _MISSING) != v}
        kwargs = {**_TORCH_EPS.get(cls, {}), **kwargs}
    return cls(**_kwargs(kwargs, fields))


_MISSING = object()
# torch.optim.Adagrad and torchrec.optim.RowWiseAdagrad default to eps=1e-10 (FBGEMM: 1e-8).
_TORCH_EPS: dict[type, dict[str, float]] = {Adagrad: {"eps": 1.0e-10}, RowWiseAdagrad: {"eps": 1.0e-10}}
_TORCH_NO_OPS: dict[str, Any] = {
    "weight_decay": 0,
    "lr_decay": 0,
    "initial_accumulator_value": 0,
    "maximize": False,
    "foreach": None,
    "differentiable": False,
    "fused": None,
}


def _check_torch_semantics(optimizer: Any, cls: type[EmbeddingOptimizer], kwargs: Mapping[str, Any]) -> None:
    """Raises where a torch optimizer on a table's dense gradient differs from the fused update.

    The fused update writes only the rows a batch looked up. A torch optimizer run by
    ``apply_optimizer_in_backward`` sees the whole table's gradient, zero on untouched rows:
    SGD and Adagrad leave those rows unchanged too, but Adam's moments keep moving them, and
    weight decay or ``lr_decay`` change the update of every row or every step.
    """
    name = getattr(optimizer, "__name__", str(optimizer))
    if cls is Adam:
        raise ValueError(
            f"apply_optimizer_in_backward({name}) runs torch's dense Adam, which moves every row each step "
            "(its moments decay on rows the batch did not touch); tpurec's fused Adam is FBGEMM's lazy Adam "
            "(touched rows only), so it would not match. To train with lazy Adam, remove the in-backward "
            "optimizer and pass optimizer=tpurec.sparse.Adam(learning_rate=...) to from_torchrec, or convert "
            "a torchrec FusedEmbeddingBagCollection(optimizer_type=torch.optim.Adam)."
        )
    for key in ("weight_decay", "lr_decay", "initial_accumulator_value"):
        if kwargs.get(key, 0) != 0:
            raise ValueError(
                f"apply_optimizer_in_backward({name}, {key}={kwargs[key]!r}) changes rows the batch did not touch "
                f"or the step size per step in torch; tpurec's fused {cls.__name__} has no exact equivalent. Use "
                f"{key}=0, or pass an explicit optimizer=tpurec.sparse.{cls.__name__}(...) (FBGEMM semantics) to "
                "from_torchrec without an in-backward optimizer."
            )
