"""How the bags of a KeyedJaggedTensor map to output samples: rule 3 of :func:`tpurec.sparse.preprocess.read_kjt`.

Both preprocessing paths apply it: the numpy reference
(:mod:`tpurec.sparse.preprocess`) and the native one
(:mod:`tpurec.sparse.kernels.native.preprocess`), so they raise the same
errors for bad batch sizes or ``inverse_indices``.

Example::

    batching = read_batching(kjt, variable_batch=True)
    batching.rows  # CSR rows per feature slot
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import numpy as np
import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

__all__ = ["Batching", "read_batching", "expand_bags"]


@dataclasses.dataclass(frozen=True)
class Batching:
    """How the bags of a KJT map to output samples (rule 3 of :func:`read_kjt`).

    Args:
        bags_per_key: bags of each KJT key, in key order (the stride, or with a
            variable batch size per feature the key's ``stride_per_key``).
        rows: CSR rows per feature slot (``sample = slot * rows + bag``): the
            output batch, or more when a feature has more bags than that.
        inverse_indices: per feature, the bag each output sample repeats
            (TorchRec's ``KeyedJaggedTensor.inverse_indices``); None: output
            sample ``b`` is bag ``b`` of every feature.
    """

    bags_per_key: tuple[int, ...]
    rows: int
    inverse_indices: dict[str, np.ndarray] | None


def _is_integer(t: torch.Tensor) -> bool:
    return not (t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool)


def read_batching(kjt: KeyedJaggedTensor, variable_batch: bool | Literal["unpooled"]) -> Batching:
    """Rule 3 of :func:`read_kjt`: the bags per feature and how they map to output samples.

    Expects rules 1 and 2 to hold (every table feature is a key, once).

    Args:
        kjt: the batch.
        variable_batch: accept a variable batch size per feature (VBE) and
            ``inverse_indices``, as TorchRec's ``EmbeddingBagCollection`` does;
            ``"unpooled"``: each feature's bags are its own outputs (TorchRec's
            ``EmbeddingCollection``), so their counts may differ and
            ``inverse_indices`` are not read (``rows`` is the most bags of a feature).

    Returns:
        The :class:`Batching`.

    Raises:
        NotImplementedError: a VBE batch where ``variable_batch`` is False.
        ValueError: bad ``stride_per_key_per_rank`` or ``inverse_indices``.
    """
    keys = list(kjt.keys())
    vbe = kjt.variable_stride_per_key()
    if not variable_batch:
        if vbe:
            raise NotImplementedError(
                "variable batch size per feature (VBE), a KeyedJaggedTensor built with stride_per_key_per_rank, is "
                f"not supported by this caller (features {keys}), which needs one batch size for every feature; "
                "tpurec.sparse.EmbeddingBagCollection (unsharded or sharded) and EmbeddingCollection accept VBE "
                "batches"
            )
        stride = kjt.stride()
        return Batching((stride,) * len(keys), stride, None)
    if vbe:
        per_rank = kjt.stride_per_key_per_rank()
        if len(per_rank) != len(keys) or any(b < 0 for ranks in per_rank for b in ranks):
            raise ValueError(
                f"stride_per_key_per_rank must give every one of the {len(keys)} features {keys} a list of "
                f"non-negative bag counts, got {per_rank}"
            )
        bags = tuple(int(sum(ranks)) for ranks in per_rank)
    else:
        bags = (kjt.stride(),) * len(keys)
    if variable_batch == "unpooled":
        return Batching(bags, max(bags, default=0), None)
    inverse = kjt.inverse_indices_or_none()
    # TorchRec expands the pooled rows only when inverse_indices hold something.
    if inverse is not None and inverse[1].numel() > 0:
        names, index = inverse
        if index.dim() != 2 or not _is_integer(index):
            raise ValueError(
                f"inverse_indices must be a 2-D integer tensor [features, batch size], got dtype {index.dtype} and "
                f"shape {tuple(index.shape)}"
            )
        if index.shape[0] != len(names):
            raise ValueError(
                f"inverse_indices name {len(names)} features but its tensor has shape {tuple(index.shape)}; give one "
                "row per named feature"
            )
        row_of = {name: i for i, name in enumerate(names)}  # a repeated name: its last row, as in TorchRec
        rows = index.detach().cpu().numpy().astype(np.int64)  # a copy: the batch may be prefetched
        out: dict[str, np.ndarray] = {}
        for key, n in zip(keys, bags):
            if key not in row_of:
                raise ValueError(f"inverse_indices have no row for feature {key!r} (they name {list(names)})")
            row = rows[row_of[key]]
            bad = (row < 0) | (row >= n)
            if bad.any():
                raise ValueError(
                    f"inverse_indices of feature {key!r} hold {int(row[np.argmax(bad)])}, outside [0, {n}) (the "
                    f"feature's {n} bags)"
                )
            out[key] = row
        return Batching(bags, max((int(index.shape[1]), *bags)), out)
    if len(set(bags)) > 1:
        raise ValueError(
            f"features have different batch sizes {dict(zip(keys, bags))} but the KeyedJaggedTensor has no "
            "inverse_indices, so their pooled embeddings do not line up (TorchRec's EmbeddingBagCollection cannot "
            "concatenate them either); pass inverse_indices=(keys, tensor [num_keys, batch_size]) giving the bag of "
            "each sample"
        )
    return Batching(bags, bags[0] if bags else 0, None)


def expand_bags(kjt: KeyedJaggedTensor, batching: Batching) -> KeyedJaggedTensor:
    """``kjt`` with its ``inverse_indices`` applied: output sample ``b`` of feature ``f`` becomes
    a bag of its own, a copy of bag ``inverse_indices[f][b]``, so every feature has one batch
    size (the inverse indices' width) and no inverse indices are left.

    Pooling the result gives what TorchRec's ``EmbeddingBagCollection`` returns for ``kjt``
    (it pools each bag once and expands the pooled rows), and the gradient of a copied bag's
    ids is the sum over its copies, as through TorchRec's expansion. Runs on the host; ids and
    weights are gathered with torch ops, so weights that require grad keep their graph.

    Args:
        kjt: a batch already validated by ``read_kjt(..., variable_batch=True)``.
        batching: its :func:`read_batching`, with ``inverse_indices``.

    Returns:
        The expanded batch, on ``kjt``'s device.
    """
    if batching.inverse_indices is None:
        raise ValueError("expand_bags needs a batch with inverse_indices")
    keys = list(kjt.keys())
    lengths = kjt.lengths().long()
    bag_starts = torch.cumsum(lengths, 0) - lengths  # each bag's first id in values
    first_bag = np.cumsum((0, *batching.bags_per_key))[:-1]
    chosen = torch.from_numpy(
        np.concatenate([first_bag[i] + batching.inverse_indices[key] for i, key in enumerate(keys)]).astype(np.int64)
    ).to(lengths.device)
    new_lengths = lengths[chosen]
    within = torch.arange(int(new_lengths.sum()), device=lengths.device) - torch.repeat_interleave(
        torch.cumsum(new_lengths, 0) - new_lengths, new_lengths
    )
    index = torch.repeat_interleave(bag_starts[chosen], new_lengths) + within
    weights = kjt.weights_or_none()
    return KeyedJaggedTensor(
        keys=keys,
        values=kjt.values()[index],
        weights=None if weights is None else weights[index],
        lengths=new_lengths.to(kjt.lengths().dtype),
        stride=len(next(iter(batching.inverse_indices.values()))) if keys else 0,
    )
