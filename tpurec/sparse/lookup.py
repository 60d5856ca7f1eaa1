"""The lifecycle every tpurec embedding collection shares, written once.

tpurec's embedding collections (:class:`~tpurec.sparse.EmbeddingBagCollection`, the sharded
collection :func:`tpurec.shard` makes, :class:`~tpurec.sparse.QuantEmbeddingBagCollection` and
:class:`~tpurec.sparse.EmbeddingCollection`) differ in how a batch reaches their tables
(SparseCore CSR per stacked table, fixed-capacity entries per shard, sequences as bags of one
id) and in the programs that look it up. Around that they share one lifecycle, kept here:

* :class:`EmbeddingLookup`: the tables' configs and stacks, the KJT features they read, the
  output's keys and the order its blocks are assembled in, the entries ``overflow="drop"``
  left out, and whether a batch's per-id weights take a gradient;
* :class:`CsrLookup`: tables stacked in one device's memory and looked up from SparseCore CSR
  input: the batch's preprocessing (capacities fixed or grown), the stacked parameters, and
  state dicts with TorchRec's keys (every table checked before any is written);
* :class:`TrainableLookup`: the fused embedding optimizer's step counts, what a captured step
  checks before a replay, and the checks of its state dict; the lookups waiting for their
  backward, and the refusal of a training lookup whose gradient would differ from TorchRec's;
  and the batches prepared ahead of the forward: what ``prefetch(kjt)`` made of a
  KeyedJaggedTensor object (:class:`Prepared`, taken by the forward of that same object), and
  the batch ``stage(kjt)`` wrote into the collection's static input tensors (:class:`Staged`,
  written by :func:`restage`).
"""

from __future__ import annotations

import dataclasses
import math
import threading
import weakref
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, ClassVar, Generic, Literal, NamedTuple, TypeVar

import numpy as np
import torch
from torch import nn
from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType
from torchrec.modules.embedding_modules import get_embedding_names_by_table
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from tpurec.core import on_replay, replay_check
from tpurec.sparse.drops import DropCounter
from tpurec.sparse.optimizers import EmbeddingOptimizer
from tpurec.sparse.preprocess import preprocess_kjt
from tpurec.sparse.types import Capacity, CapacityError, SparseCoreInput, StackedTable, TableInStack

__all__ = [
    "CsrLookup",
    "EmbeddingLookup",
    "Prepared",
    "Staged",
    "TrainableLookup",
    "check_optimizer_state",
    "output_runs",
    "preprocess_growing",
    "restage",
]

BatchT = TypeVar("BatchT")


@dataclasses.dataclass
class Prepared:
    """What a collection's ``prefetch`` prepared for one KeyedJaggedTensor object.

    Kept by the object's ``id`` until the forward of that same object takes it; the
    collection's own kind adds the prepared input (CSR arrays, routed entries).
    """

    features: KeyedJaggedTensor


class Staged(NamedTuple, Generic[BatchT]):
    """The batch ``stage`` wrote into a collection's static input tensors, and its KJT object.

    The next forward of ``features`` reads the static tensors (its dropped entries were
    counted by ``stage``).
    """

    features: KeyedJaggedTensor
    batch: BatchT


# --- preprocessing with capacities -------------------------------------------------------


def _power_of_two(n: int) -> int:
    return 2 ** math.ceil(math.log2(max(n, 1)))


_growth_lock = threading.Lock()


def preprocess_growing(
    features: KeyedJaggedTensor,
    stacks: Sequence[StackedTable],
    num_partitions: int,
    fixed: Capacity | Mapping[str, Capacity] | None,
    grown: dict[str, Capacity],
    is_weighted: bool,
    overflow: Literal["error", "drop"],
) -> SparseCoreInput:
    """The CSR input of ``features``, with fixed capacities or capacities grown on demand.

    Fixed capacities are used as given (``overflow`` decides what a batch beyond them
    does). Without them each stack's capacities (``grown``, 8 at first) grow to the next
    power of two a batch needs; ``grown`` is updated in place and only grows (each growth
    compiles the lookup again).

    Raises:
        ValueError: a malformed batch (named by ``preprocess_kjt``).
        CapacityError: a fixed capacity overflows with ``overflow="error"``.
    """
    if fixed is not None:
        return preprocess_kjt(features, stacks, num_partitions, fixed, is_weighted=is_weighted, overflow=overflow)
    caps = {st.name: grown.get(st.name, Capacity(8)) for st in stacks}
    try:
        return preprocess_kjt(features, stacks, num_partitions, caps, is_weighted=is_weighted)
    except CapacityError:
        needed = preprocess_kjt(features, stacks, num_partitions, None, is_weighted=is_weighted)
    with _growth_lock:  # TrainPipeline's workers preprocess batches side by side: capacities only grow
        for st in stacks:
            csr, old = needed.stacks[st.name], grown.get(st.name, caps[st.name])
            ids = max(old.max_ids_per_partition, _power_of_two(int(csr.max_ids.max())))
            unique = max(old.max_unique_ids_per_partition or 0, _power_of_two(int(csr.max_unique_ids.max())))
            grown[st.name] = Capacity(ids, min(unique, ids))
        caps = {st.name: grown[st.name] for st in stacks}
    return preprocess_kjt(features, stacks, num_partitions, caps, is_weighted=is_weighted)


def output_runs(stacks: Sequence[StackedTable], ordered: Sequence[EmbeddingBagConfig]) -> list[tuple[int, int, int]]:
    """The runs of consecutive stack slots that give a pooled output's blocks, in output order.

    Args:
        stacks: the stacked tables (a feature of two tables has a slot in each).
        ordered: the tables in output order (their features in order).

    Returns:
        ``(stack, first slot, end slot)`` per run.
    """
    where = {(s.table, s.feature): (i, s.slot) for i, st in enumerate(stacks) for s in st.features}
    runs: list[tuple[int, int, int]] = []
    for i, slot in (where[t.name, f] for t in ordered for f in t.feature_names):
        if runs and runs[-1][0] == i and runs[-1][2] == slot:
            runs[-1] = (i, runs[-1][1], slot + 1)
        else:
            runs.append((i, slot, slot + 1))
    return runs


# --- the collections' common part ---------------------------------------------------------


class EmbeddingLookup(nn.Module):
    """What every tpurec embedding collection holds besides its routing and its programs.

    A subclass sets ``_embedding_bag_configs``, ``_is_weighted``, ``_stacks`` and ``overflow``
    in its ``__init__`` (after this one's) and calls :meth:`_init_outputs` for its output order.
    """

    _embedding_bag_configs: list[EmbeddingBagConfig]
    _is_weighted: bool
    _stacks: list[StackedTable]
    overflow: Literal["error", "drop"]
    _embedding_names: list[str]
    _length_per_key: list[int]
    _output_runs: list[tuple[int, int, int]]

    def __init__(self) -> None:
        super().__init__()
        self._drops = DropCounter()  # entries overflow="drop" left out, per feature

    # --- torchrec interface ---------------------------------------------------------

    def embedding_bag_configs(self) -> list[EmbeddingBagConfig]:
        return self._embedding_bag_configs

    def is_weighted(self) -> bool:
        return self._is_weighted

    @property
    def stacks(self) -> list[StackedTable]:
        """The stacked tables (what a batch is validated against and looked up in)."""
        return list(self._stacks)

    @property
    def feature_names(self) -> list[str]:
        """The KJT keys this collection looks up (once each, also when two tables share one)."""
        return list(dict.fromkeys(s.feature for st in self._stacks for s in st.features))

    def dropped_entries(self) -> dict[str, int]:
        """Entries ``overflow="drop"`` left out of this collection's batches so far, per feature.

        Features that never dropped an entry are absent; the process-wide sum is
        ``tpurec.stats()["dropped_entries"]``.
        """
        return self._drops.by_feature()

    # --- the output -----------------------------------------------------------------

    def _init_outputs(self, ordered: Sequence[EmbeddingBagConfig]) -> None:
        """The output's keys and widths in the order of ``ordered`` (tables, then their features),
        and the runs of stack slots that fill it: ``(stack, first slot, end slot)``.

        A feature of two tables has a slot in each (output ``"<feature>@<table>"``).
        """
        self._embedding_names = [n for names in get_embedding_names_by_table(list(ordered)) for n in names]
        self._length_per_key = [t.embedding_dim for t in ordered for _ in t.feature_names]
        self._output_runs = output_runs(self._stacks, ordered)

    def _pooled_values(self, stack_outputs: Sequence[torch.Tensor], batch_size: int) -> torch.Tensor:
        """``[batch, sum of dims]`` from each stack's ``[slots, batch, dim]`` pooled rows, in output order.

        One block per run of consecutive slots: a transpose per run, not a select per
        feature (whose backward would add up full-size zeros).
        """
        blocks = [
            stack_outputs[i][first:last]
            .transpose(0, 1)
            .reshape(batch_size, (last - first) * self._stacks[i].embedding_dim)
            for i, first, last in self._output_runs
        ]
        return blocks[0] if len(blocks) == 1 else torch.cat(blocks, dim=1)

    # --- trainability ----------------------------------------------------------------

    def _weights_need_grad(self, features: KeyedJaggedTensor) -> bool:
        """Whether ``features``' per-id weights take part in the autograd graph of this lookup."""
        weights = features.weights_or_none()
        return self._is_weighted and torch.is_grad_enabled() and weights is not None and weights.requires_grad


class CsrLookup(EmbeddingLookup):
    """A collection whose stacks are parameters or buffers ``stacked_weight_<i>`` on one device,
    looked up from SparseCore CSR input.

    A subclass also sets ``num_partitions``, ``_fixed_capacities`` and ``_auto_capacities``
    (what :meth:`preprocess` follows).
    """

    num_partitions: int
    _fixed_capacities: Capacity | Mapping[str, Capacity] | None
    _auto_capacities: dict[str, Capacity]

    @property
    def device(self) -> torch.device:
        return self.stacked_weight(0).device

    def stacked_weight(self, index: int) -> torch.Tensor:
        """The tensor holding stack ``index``."""
        return getattr(self, f"stacked_weight_{index}")

    def table_weight(self, name: str) -> torch.Tensor:
        """A view of table ``name``'s rows inside its stack."""
        for i, st in enumerate(self._stacks):
            for t in st.tables:
                if t.name == name:
                    return self.stacked_weight(i)[t.row_offset : t.row_offset + t.num_embeddings]
        raise KeyError(f"no table named {name!r}")

    def preprocess(self, features: KeyedJaggedTensor) -> SparseCoreInput:
        """Validates ``features`` and builds the CSR input (host side, no state change
        except growing automatic capacities)."""
        return preprocess_growing(
            features,
            self._stacks,
            self.num_partitions,
            self._fixed_capacities,
            self._auto_capacities,
            self._is_weighted,
            self.overflow,
        )

    # --- state dicts: TorchRec's keys, one per table ----------------------------------

    def _tables(self) -> list[tuple[str, int, TableInStack]]:
        """``(state dict key, stack, table)`` of every table, stack by stack."""
        return [(f"embedding_bags.{t.name}.weight", i, t) for i, st in enumerate(self._stacks) for t in st.tables]

    def _table_value(
        self, state_dict: Mapping[str, Any], key: str, stack: int, target: torch.Tensor
    ) -> tuple[Any, str | None]:
        """State dict entry ``key`` as the rows to copy into ``target``, or the error it has."""
        value = state_dict[key]
        if tuple(value.shape) != tuple(target.shape):
            return None, f"size mismatch for {key}: checkpoint {tuple(value.shape)}, model {tuple(target.shape)}"
        return value, None

    def _table_companions(self, key: str) -> list[str]:
        """Other state dict keys that belong to table ``key`` (not unexpected when present)."""
        return []

    def _tables_loaded(self, prefix: str) -> None:
        """Called after ``load_state_dict`` wrote the tables."""

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        for key, i, t in self._tables():
            weight = self.stacked_weight(i)
            weight = weight if keep_vars else weight.detach()
            destination[prefix + key] = weight[t.row_offset : t.row_offset + t.num_embeddings]

    def _load_from_state_dict(
        self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
    ):
        # Every table is checked before any is written: a bad checkpoint changes nothing.
        expected, writes = set(), []
        for key, i, t in self._tables():
            full = prefix + key
            expected.add(full)
            if full not in state_dict:
                missing_keys.append(full)
                continue
            expected.update(self._table_companions(full))
            target = self.stacked_weight(i)[t.row_offset : t.row_offset + t.num_embeddings]
            value, error = self._table_value(state_dict, full, i, target)
            if error is not None:
                error_msgs.append(error)
                continue
            writes.append((target, value))
        if strict:
            unexpected_keys.extend(k for k in state_dict if k.startswith(prefix) and k not in expected)
        if error_msgs or (strict and missing_keys):
            return
        with torch.no_grad():
            for target, value in writes:
                target.copy_(value)
        if writes:
            self._tables_loaded(prefix)


class TrainableLookup(EmbeddingLookup):
    """A collection whose backward updates its tables with a fused embedding optimizer.

    ``_steps`` counts the optimizer's steps (per stack, or one for all of a collection's
    tables); a replay of a captured step counts too, and refuses to run when the
    optimizer's settings changed since the capture.
    """

    optimizer: EmbeddingOptimizer | None
    optimizer_semantics: Literal["fbgemm", "torch"]

    def __init__(self) -> None:
        super().__init__()
        self.optimizer = None
        # "fbgemm": one optimizer update per lookup, as FBGEMM's fused kernels (and torchrec's
        # FusedEmbeddingBagCollection) do. "torch": the optimizer came from torchrec's
        # apply_optimizer_in_backward, which makes one update per backward pass on the summed
        # gradient of every lookup in it (from_torchrec sets it).
        self.optimizer_semantics = "fbgemm"
        self._steps: list[int] = []
        # The lookups whose backward has not run yet (until it runs or their graph is freed).
        self._pending_lookups: weakref.WeakSet[Any] = weakref.WeakSet()
        # id(kjt) -> what prefetch() (TrainPipeline's worker thread) prepared for that KJT
        # object; taken by forward() of the same object.
        self._prefetched: dict[int, Any] = {}
        # stage(): the KJT staged last and its batch (the static input tensors are the subclass's).
        self._staged: Staged[Any] | None = None
        # How many times stage() made new static tensors (a first batch, a new batch size, grown
        # capacities): a step captured over older ones cannot replay.
        self.staged_generation = 0

    def _step_tables(self, index: int) -> list[str]:
        """The tables whose optimizer steps ``_steps[index]`` counts."""
        return [t.name for t in self._stacks[index].tables]

    def _hyperparameters(self, step: int) -> dict[str, Any]:
        """The optimizer's settings at ``step`` (what its update op takes)."""
        assert self.optimizer is not None
        return self.optimizer.hyperparameters(step)

    def _count_step(self, index: int) -> None:
        self._steps[index] += 1

    def _next_step(self, index: int) -> dict[str, Any]:
        """Counts an optimizer step of ``_steps[index]``; returns its settings."""
        self._steps[index] += 1
        return self._hyperparameters(self._steps[index])

    def _next_captured_step(self, index: int) -> dict[str, Any]:
        """:meth:`_next_step` in a step that may be captured: a replay counts its step too, and
        refuses to run once the optimizer's settings differ from those the capture read."""
        hyperparameters = self._next_step(index)
        on_replay(lambda: self._count_step(index))  # a replayed step counts too (its numbers do not change)
        replay_check(lambda: self._changed_optimizer(index, hyperparameters))
        return hyperparameters

    def _changed_optimizer(self, index: int, captured: dict[str, Any]) -> str | None:
        """What changed in the embedding optimizer's settings since a captured step read them (None: nothing)."""
        now = None if self.optimizer is None else self._hyperparameters(self._steps[index] + 1)
        if now == captured:
            return None
        return (
            f"the embedding optimizer of {self._tables_noun} {self._step_tables(index)} now has {now}, and the "
            f"step was captured with {captured}: a replay would use the old settings. Capture again after the change"
        )

    _tables_noun: ClassVar[str] = "tables"
    """How :meth:`_changed_optimizer` names the tables of a step count."""

    # --- trainability ----------------------------------------------------------------

    def _check_trainable_lookup(self, features: KeyedJaggedTensor) -> None:
        """Raises where a training lookup would silently differ from TorchRec's."""
        if not torch.is_grad_enabled():
            return
        if self._weights_need_grad(features):
            unpooled = [t.name for t in self._embedding_bag_configs if t.pooling != PoolingType.SUM]
            if unpooled or self.overflow == "drop":
                why = f"tables {unpooled} do not use SUM pooling" if unpooled else "overflow='drop' may drop ids"
                raise NotImplementedError(
                    f"the KJT's per-id weights require grad, but {why}, so tpurec cannot give them TorchRec's "
                    "gradient. Use SUM pooling and overflow='error', or detach the weights."
                )

    # --- lookups waiting for their backward ---------------------------------------------

    def _lookup_started(self, ctx: Any, reads: Sequence[torch.Tensor]) -> None:
        """Records the autograd context of a lookup until its backward runs (or its graph is
        freed); ``reads``: the batch input tensors its backward reads."""
        ctx.reads = tuple(reads)
        self._pending_lookups.add(ctx)

    def _lookup_finished(self, ctx: Any) -> None:
        self._pending_lookups.discard(ctx)

    # --- batches prepared ahead of the forward ------------------------------------------

    _max_prefetched: ClassVar[int] = 8
    """Batches :meth:`_keep_prefetched` keeps for forward (a pipeline needs 1-2)."""

    def clear_prefetched(self) -> None:
        """Drops batches prepared by :meth:`prefetch` that no step used."""
        self._prefetched.clear()

    def _keep_prefetched(self, entry: Prepared) -> None:
        """Keeps what ``prefetch`` prepared, for the forward of ``entry.features``."""
        self._prefetched[id(entry.features)] = entry
        # A model that hands a different KJT object to this module never takes
        # its prefetched batches: keep only the newest few, not every batch.
        # (A snapshot of the keys: the step's thread may pop one meanwhile.)
        for key in list(self._prefetched)[: -self._max_prefetched]:
            self._prefetched.pop(key, None)

    def _pop_prefetched(self, features: KeyedJaggedTensor) -> Any:
        """What ``prefetch`` prepared for this KJT object (no longer kept), or None."""
        entry = self._prefetched.pop(id(features), None)
        return entry if entry is not None and entry.features is features else None

    def _take_staged(self, features: KeyedJaggedTensor) -> Any:
        """The batch ``stage`` made of this KJT object (its drops already counted), or None."""
        staged = self._staged
        return staged.batch if staged is not None and staged.features is features else None

    def _refuse_restaging(self, static: Iterable[torch.Tensor], what: str) -> None:
        """Raises while a lookup that reads the static input tensors ``static`` waits for its
        backward (staging the next batch would change what that backward reads)."""
        ids = {id(t) for t in static}
        if any(id(t) in ids for ctx in list(self._pending_lookups) for t in getattr(ctx, "reads", ())):
            raise RuntimeError(
                f"stage(): the lookup of the batch staged before still waits for its backward, which reads the "
                f"staged {what}; run the backward (or drop that step's outputs) before staging the next batch"
            )


def _torch_dtype(dtype: Any) -> torch.dtype:
    return torch.from_numpy(np.zeros(0, np.dtype(dtype))).dtype


def restage(
    old: list[torch.Tensor] | None,
    arrays: Sequence[Any],
    same_batch: bool,
    device: torch.device,
    index: int = 0,
) -> tuple[list[torch.Tensor], bool]:
    """Writes a staged batch's input arrays into the static tensors ``old``, or into new ones.

    In place while every shape and dtype, the device and the batch (``same_batch``) stay as
    ``old`` holds them: a step captured over those tensors reads the new batch at its next
    replay. Otherwise new tensors; on a tpu device the old ones are freed, so that a step
    captured over them refuses to replay instead of misreading the batch.

    Args:
        old: the static tensors of the batch staged before (None: none).
        arrays: the new batch's arrays: ``jax.Array`` s already on the device (tpu), else numpy.
        same_batch: the new batch has the batch size ``old`` was made for.
        device: the device of the static tensors.
        index: the tpu device index of new tensors (on a tpu device).

    Returns:
        ``(tensors, renewed)``: the static tensors now holding the batch, and whether they are new.
    """
    if (
        old is not None
        and same_batch
        and len(old) == len(arrays)
        and all(
            t.device == device and tuple(t.shape) == tuple(a.shape) and t.dtype == _torch_dtype(a.dtype)
            for t, a in zip(old, arrays)
        )
    ):
        for t, a in zip(old, arrays):
            if device.type == "tpu":
                from tpurec.core import replace_array

                replace_array(t, a)
            else:
                t.copy_(torch.from_numpy(a))
        return old, False
    if device.type == "tpu":
        from tpurec.core import free_storage, wrap

        for t in old or ():
            free_storage(t)
        tensors: list[torch.Tensor] = [wrap(a, index) for a in arrays]
        return tensors, True
    return [torch.from_numpy(a).to(device) for a in arrays], True


def check_optimizer_state(
    state_dict: Any,
    expected: Mapping[str, Mapping[str, tuple[int, ...]]],
    optimizer: str | None,
    steps: int | None,
    owner: str,
    remedy: str,
) -> None:
    """Checks an embedding optimizer state (``optimizer_state_dict()``'s format) without writing it.

    Args:
        state_dict: ``{"optimizer": name, "steps": [...], "state": {table key: {slot: tensor}}}``.
        expected: table key -> slot -> the shape its tensor must have.
        optimizer: the optimizer's class name (None: an inference collection).
        steps: how many step counts the state must hold (None: one or more).
        owner: the collection, as the messages name it (``"this EmbeddingBagCollection"``).
        remedy: what to do when the state is of another optimizer.

    Raises:
        ValueError: the state does not fit (the message says what differs).
    """
    if not isinstance(state_dict, Mapping) or "steps" not in state_dict or "state" not in state_dict:
        keys = sorted(state_dict) if isinstance(state_dict, Mapping) else type(state_dict).__name__
        raise ValueError(
            f"an embedding optimizer state needs 'steps' and 'state' (from optimizer_state_dict()), got {keys}"
        )
    theirs = state_dict.get("optimizer", optimizer)
    if theirs != optimizer:
        raise ValueError(f"the optimizer state is of {theirs}, but {owner} uses {optimizer}; {remedy}")
    counts = state_dict["steps"]
    if (
        not isinstance(counts, (list, tuple))
        or (len(counts) != steps if steps is not None else not counts)
        or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in counts)
    ):
        raise ValueError(
            f"steps must be {steps} non-negative ints (one per stacked table), got {counts!r}"
            if steps is not None
            else f"steps must be a non-empty list of non-negative ints, got {counts!r}"
        )
    state = state_dict["state"]
    if not isinstance(state, Mapping) or set(state) != set(expected):
        got = sorted(state) if isinstance(state, Mapping) else type(state).__name__
        raise ValueError(f"the optimizer state has tables {got}, {owner} has {sorted(expected)}")
    for key, slots in expected.items():
        entry = state[key]
        if not isinstance(entry, Mapping) or set(entry) != set(slots):
            got = sorted(entry) if isinstance(entry, Mapping) else type(entry).__name__
            raise ValueError(f"the optimizer state of {key} has slots {got}, but {optimizer} needs {sorted(slots)}")
        for name, shape in slots.items():
            value = entry[name]
            if not isinstance(value, torch.Tensor) or tuple(value.shape) != tuple(shape):
                got = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
                raise ValueError(f"slot {name} of {key}: expected shape {tuple(shape)}, got {got}")
            if not value.dtype.is_floating_point:
                raise ValueError(f"slot {name} of {key}: expected a floating point tensor, got {value.dtype}")
