"""Sequence (unpooled) embeddings: TorchRec's ``EmbeddingCollection`` on the SparseCore op set.

Each position of a sequence is its own bag of one id, as TorchRec's SparseCore modules
do: a batch of ``B`` sequences padded to ``max_seq_len`` positions is ``B * max_seq_len``
bags, so the lookup program keeps one shape however the lengths vary (bounded dynamism),
and the fused optimizer runs in its backward exactly as for pooled tables.

Example::

    from torchrec import EmbeddingConfig
    import tpurec.sparse as sparse

    tables = [EmbeddingConfig(name="items", embedding_dim=16, num_embeddings=1000, feature_names=["history"])]
    ec = sparse.EmbeddingCollection(tables, optimizer=sparse.Adagrad(0.05), max_seq_len=64, device="tpu")
    history = ec(kjt)["history"]  # JaggedTensor: values [sum of lengths, 16]
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

import numpy as np
import torch
from torch import nn
from torchrec.modules.embedding_configs import DataType, EmbeddingBagConfig, EmbeddingConfig, PoolingType
from torchrec.modules.embedding_modules import EmbeddingCollectionInterface, get_embedding_names_by_table
from torchrec.sparse.jagged_tensor import JaggedTensor, KeyedJaggedTensor

from tpurec.sparse.modules import EmbeddingBagCollection
from tpurec.sparse.optimizers import EmbeddingOptimizer
from tpurec.sparse.preprocess import read_kjt
from tpurec.sparse.types import Capacity, CapacityError

__all__ = ["EmbeddingCollection"]

_BAGS = "_bags"  # the inner pooled collection (one id per bag)


class EmbeddingCollection(EmbeddingCollectionInterface):
    """Unpooled embeddings with a fused optimizer; TorchRec's ``EmbeddingCollection`` interface.

    Same configs, same ``Dict[str, JaggedTensor]`` output (one row per id, the KJT's
    lengths, the ids as weights with ``need_indices``), same state dict keys
    (``embeddings.<table>.weight``) as ``torchrec.EmbeddingCollection``; like tpurec's
    ``EmbeddingBagCollection``, ``backward`` updates the tables in place with
    ``optimizer`` and leaves no gradient on them.

    Args:
        tables: the tables (one embedding dim for all, as in TorchRec).
        need_indices: return each feature's ids as the output ``JaggedTensor``'s weights.
        optimizer: the fused optimizer (see :class:`EmbeddingBagCollection`); None: inference.
        optimizer_kwargs: keyword arguments of a torch optimizer class.
        device: where the tables live.
        max_seq_len: positions per sequence, one int for all features or per feature. A
            longer sequence raises :class:`CapacityError`. None: the longest sequence seen
            so far, rounded up to a power of two (a new length compiles at most once per
            power of two).
        num_partitions: MOD partitions of each table.
        capacities: static capacities of the inner lookup (None: grown as needed).

    Example::

        ec = EmbeddingCollection(tables, optimizer=Adagrad(0.05), max_seq_len=32)
        ec(kjt)["f0"].values()  # [kjt["f0"].lengths().sum(), dim]
    """

    def __init__(
        self,
        tables: Sequence[EmbeddingConfig],
        need_indices: bool = False,
        optimizer: EmbeddingOptimizer | type | Any = None,
        optimizer_kwargs: Mapping[str, Any] | None = None,
        device: torch.device | str | None = None,
        max_seq_len: int | Mapping[str, int] | None = None,
        num_partitions: int = 1,
        capacities: Capacity | Mapping[str, Capacity] | None = None,
    ) -> None:
        super().__init__()
        if not tables:
            raise ValueError("EmbeddingCollection needs at least one table")
        dims = {t.embedding_dim for t in tables}
        if len(dims) > 1:
            raise ValueError(
                f"all tables of an EmbeddingCollection have one embedding dim (as in TorchRec), got {sorted(dims)}"
            )
        for t in tables:
            # FP16/BF16 bags follow FBGEMM's pooled TBE; its sequence (nobag) kernels are not
            # checked against TorchRec yet, so they are refused rather than assumed equal.
            if t.data_type != DataType.FP32:
                raise ValueError(
                    f"table {t.name!r} has data_type={t.data_type.name}: tpurec's EmbeddingCollection trains FP32 "
                    "tables only (FP16/BF16 are supported by EmbeddingBagCollection). Use data_type=DataType.FP32."
                )
        self._embedding_configs = list(tables)
        self._need_indices = need_indices
        self._embedding_names_by_table = get_embedding_names_by_table(self._embedding_configs)
        features = [f for t in tables for f in t.feature_names]
        if isinstance(max_seq_len, Mapping):
            unknown = sorted(set(max_seq_len) - set(features))
            if unknown:
                raise ValueError(f"max_seq_len names features {unknown} that no table has")
        for value in max_seq_len.values() if isinstance(max_seq_len, Mapping) else [max_seq_len]:
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"max_seq_len must be a positive int, got {value!r}")
        self._max_seq_len = max_seq_len
        self._seen_seq_len = 1
        bags = [
            EmbeddingBagConfig(
                name=t.name,
                embedding_dim=t.embedding_dim,
                num_embeddings=t.num_embeddings,
                feature_names=list(t.feature_names),
                pooling=PoolingType.SUM,
                data_type=t.data_type,
                init_fn=t.init_fn,
                weight_init_min=t.weight_init_min,
                weight_init_max=t.weight_init_max,
            )
            for t in tables
        ]
        self.add_module(
            _BAGS,
            EmbeddingBagCollection(
                bags,
                optimizer=optimizer,
                optimizer_kwargs=optimizer_kwargs,
                device=device,
                num_partitions=num_partitions,
                capacities=capacities,
            ),
        )
        self._register_state_dict_hook(_to_torchrec_keys)
        self._register_load_state_dict_pre_hook(_from_torchrec_keys)

    # --- torchrec interface -----------------------------------------------------------

    def embedding_configs(self) -> list[EmbeddingConfig]:
        return self._embedding_configs

    def need_indices(self) -> bool:
        return self._need_indices

    def embedding_dim(self) -> int:
        return self._embedding_configs[0].embedding_dim

    def embedding_names_by_table(self) -> list[list[str]]:
        return self._embedding_names_by_table

    @property
    def bags(self) -> EmbeddingBagCollection:
        """The pooled collection that runs the lookups (one id per bag) and holds the tables."""
        return getattr(self, _BAGS)

    @property
    def optimizer(self) -> EmbeddingOptimizer | None:
        return self.bags.optimizer

    def dropped_entries(self) -> dict[str, int]:
        """Entries the inner collection's ``overflow="drop"`` left out, per feature (see its docs)."""
        return self.bags.dropped_entries()

    @property
    def device(self) -> torch.device:
        return self.bags.device

    def table_weight(self, name: str) -> torch.Tensor:
        """A view of table ``name``'s rows."""
        return self.bags.table_weight(name)

    def optimizer_state_dict(self) -> dict[str, Any]:
        """The fused optimizer's slots and step counts (keys ``embeddings.<table>.weight``)."""
        state = self.bags.optimizer_state_dict()
        state["state"] = {_rename(k, "embedding_bags.", "embeddings."): v for k, v in state["state"].items()}
        return state

    def load_optimizer_state_dict(self, state: Mapping[str, Any]) -> None:
        """Loads what :meth:`optimizer_state_dict` returned."""
        state = dict(state)
        state["state"] = {_rename(k, "embeddings.", "embedding_bags."): v for k, v in state["state"].items()}
        self.bags.load_optimizer_state_dict(state)

    # --- forward ------------------------------------------------------------------------

    def _seq_len(self, lengths: Mapping[str, np.ndarray]) -> int:
        """Positions per sequence for this batch (one for all features: one lookup program)."""
        longest = {f: int(ls.max()) if ls.size else 0 for f, ls in lengths.items()}
        limits = self._max_seq_len
        if limits is None:
            need = max(longest.values(), default=0)
            self._seen_seq_len = max(self._seen_seq_len, 2 ** math.ceil(math.log2(max(need, 1))))
            return self._seen_seq_len
        per_feature = limits if isinstance(limits, Mapping) else {f: limits for f in longest}
        for feature, length in longest.items():
            limit = per_feature.get(feature)
            if limit is not None and length > limit:
                raise CapacityError(
                    f"feature {feature!r} has a sequence of {length} ids but max_seq_len={limit}; raise "
                    "max_seq_len (or pass None to grow it by powers of two), or truncate the sequences"
                )
        fixed = [per_feature[f] for f in longest if per_feature.get(f) is not None]
        free = [longest[f] for f in longest if per_feature.get(f) is None]
        return max(fixed + [2 ** math.ceil(math.log2(max(n, 1))) for n in free], default=1)

    def forward(self, features: KeyedJaggedTensor) -> dict[str, JaggedTensor]:
        """One embedding row per id of ``features``.

        Args:
            features: KJT with the tables' features (CPU), one bag per sequence.

        Returns:
            ``{feature: JaggedTensor}`` with values ``[sum of lengths, dim]`` and the KJT's
            lengths (on the tables' device), in TorchRec's order.
        """
        # Each feature's sequences are its own outputs, so a variable batch per feature (VBE)
        # is read as TorchRec's EmbeddingCollection reads it: each feature with its own count.
        batch, per_feature = read_kjt(features, self.bags.stacks, is_weighted=False, variable_batch="unpooled")
        seq_len = self._seq_len({f: b.lengths for f, b in per_feature.items()})
        # A sharded inner collection (tpurec.shard) splits the bags evenly over this process's
        # devices, and TorchRec takes any number of sequences (per feature, with VBE): pad the
        # batch with empty sequences, whose rows no output reads.
        multiple = getattr(self.bags, "samples_multiple", 1)
        batch = -(-batch // multiple) * multiple
        keys = list(features.keys())
        positions = np.arange(seq_len)
        bag_lengths, rows = [], {}
        for key in keys:
            lengths = per_feature[key].lengths
            filled = positions[None, :] < lengths[:, None]  # [sequences, seq_len]
            rows[key] = np.flatnonzero(filled)  # bag index of each id, in KJT order
            # Features with fewer sequences than the batch get empty ones after theirs.
            padded = np.zeros((batch, seq_len), bool)
            padded[: len(lengths)] = filled
            bag_lengths.append(padded.reshape(-1).astype(np.int64))
        one_id_bags = KeyedJaggedTensor.from_lengths_sync(
            keys=keys,
            values=torch.cat([torch.from_numpy(per_feature[k].ids) for k in keys])
            if keys
            else torch.zeros(0, dtype=torch.long),
            lengths=torch.from_numpy(np.concatenate(bag_lengths)) if keys else torch.zeros(0, dtype=torch.long),
        )
        pooled = self.bags(one_id_bags).to_dict()
        device = self.device
        out: dict[str, JaggedTensor] = {}
        # A feature in several tables has one output per table, named "feature@table" (TorchRec's
        # embedding names, which the inner collection's pooled keys follow too).
        for table, names in zip(self._embedding_configs, self._embedding_names_by_table):
            for feature, name in zip(table.feature_names, names):
                lengths = torch.from_numpy(per_feature[feature].lengths).to(device)
                values = pooled[name].index_select(0, torch.from_numpy(rows[feature]).to(device))
                ids = torch.from_numpy(per_feature[feature].ids).to(device) if self._need_indices else None
                out[name] = JaggedTensor(values=values, lengths=lengths, weights=ids)
        return out


def _rename(key: str, old: str, new: str) -> str:
    return new + key[len(old) :] if key.startswith(old) else key


def _to_torchrec_keys(module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any) -> None:
    """``<prefix>_bags.embedding_bags.<t>.weight`` -> ``<prefix>embeddings.<t>.weight`` (TorchRec's keys)."""
    inner = f"{prefix}{_BAGS}.embedding_bags."
    for key in [k for k in state_dict if k.startswith(inner)]:
        state_dict[f"{prefix}embeddings.{key[len(inner) :]}"] = state_dict.pop(key)


def _from_torchrec_keys(state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
    outer = f"{prefix}embeddings."
    for key in [k for k in state_dict if k.startswith(outer)]:
        state_dict[f"{prefix}{_BAGS}.embedding_bags.{key[len(outer) :]}"] = state_dict.pop(key)
