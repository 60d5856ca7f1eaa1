"""Row-wise quantized (INT8/INT4/INT2) embedding bags for inference.

:class:`QuantEmbeddingBagCollection` is the tpu counterpart of TorchRec's
``torchrec.quant.embedding_modules.EmbeddingBagCollection`` (what
``torchrec.inference.modules.quantize_embeddings`` makes of a float
``EmbeddingBagCollection``). It keeps each table's rows exactly as FBGEMM's
``IntNBitTableBatchedEmbeddingBagsCodegen`` stores them::

    [scale: float16][bias: float16][packed values: dim * bits / 8 bytes][padding to row_alignment]

(values packed low bits first) and looks up the same SparseCore CSR input as
the float collection (:func:`tpurec.sparse.preprocess_kjt`): a gather of the
rows, their dequantization as FBGEMM's CPU kernel does it (float16 scale and
bias widened to float32, ``weight * scale * q + weight * bias`` accumulated in
float32, MEAN's ``1 / length`` folded into the weight) and a segment sum, cast
once to the output dtype. Nothing here trains: the tables are buffers.

Example::

    from torchrec.inference.modules import quantize_embeddings
    qmodel = quantize_embeddings(model, dtype=torch.qint8, inplace=False)
    model_tpu = tpurec.sparse.from_torchrec(qmodel, device="tpu")
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal, Mapping, Sequence, cast

import jax
import jax.numpy as jnp
import torch
from torchrec.modules.embedding_configs import DataType, EmbeddingBagConfig, PoolingType
from torchrec.modules.embedding_modules import EmbeddingBagCollectionInterface
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor, KeyedTensor

if TYPE_CHECKING:  # (imported where used: it loads FBGEMM's inference ops)
    from torchrec.quant.embedding_modules import EmbeddingBagCollection as TorchrecQuantEBC

from tpurec.library import jax_op
from tpurec.sparse.kernels.reference import _valid
from tpurec.sparse.lookup import CsrLookup
from tpurec.sparse.preprocess import stack_tables
from tpurec.sparse.types import Capacity

__all__ = ["QuantEmbeddingBagCollection", "QUANT_BITS", "OUTPUT_DTYPES", "row_bytes", "from_torchrec_quant"]

QUANT_BITS: dict[DataType, int] = {DataType.INT8: 8, DataType.INT4: 4, DataType.INT2: 2}
"""Bits per value of the table data types this module stores."""

OUTPUT_DTYPES: dict[torch.dtype, str] = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}
"""Output dtypes FBGEMM's CPU kernel produces for pooled lookups (and their JAX names)."""

SCALE_BIAS_BYTES = 4
"""float16 scale and float16 bias at the start of every row (FBGEMM's default layout)."""

DEFAULT_ROW_ALIGNMENT = 16
"""TorchRec's default row alignment of quantized tables (bytes)."""


def row_bytes(embedding_dim: int, bits: int, row_alignment: int = DEFAULT_ROW_ALIGNMENT) -> int:
    """Bytes of one stored row: scale and bias, the packed values, padding to ``row_alignment``."""
    unpadded = SCALE_BIAS_BYTES + embedding_dim * bits // 8
    return -(-unpadded // row_alignment) * row_alignment


# --- the lookup kernel ---------------------------------------------------------------


@jax_op(
    "tpurec::quantized_sparse_dense_matmul",
    schema=(
        "(Tensor row_pointers, Tensor embedding_ids, Tensor sample_ids, Tensor gains, Tensor table, *, "
        "int batch_size, int bits, int embedding_dim, str output_dtype) -> Tensor"
    ),
)
def quantized_sparse_dense_matmul(
    row_pointers: jax.Array,
    embedding_ids: jax.Array,
    sample_ids: jax.Array,
    gains: jax.Array,
    table: jax.Array,
    *,
    batch_size: int,
    bits: int,
    embedding_dim: int,
    output_dtype: str,
) -> jax.Array:
    """Pooled lookup of row-wise quantized rows: ``out[s] = sum_i gains[i] * (scale * q + bias)[ids[i]]``.

    Args:
        row_pointers, embedding_ids, sample_ids, gains: the SparseCore CSR input.
        table: uint8 ``[rows, row_bytes]`` in FBGEMM's layout (see the module docstring).
        batch_size: output rows (all feature slots of the stack times the batch).
        bits: 8, 4 or 2 bits per value.
        embedding_dim: values per row.
        output_dtype: ``"float32"``, ``"float16"`` or ``"bfloat16"``.

    Returns:
        ``[batch_size, embedding_dim]`` of ``output_dtype`` (float32 sums, rounded once).
    """
    op = "torch.ops.tpurec.quantized_sparse_dense_matmul"
    csr = (
        ("row_pointers", row_pointers, "int32"),
        ("embedding_ids", embedding_ids, "int32"),
        ("sample_ids", sample_ids, "int32"),
        ("gains", gains, "float32"),
    )
    for name, x, want in csr:
        # Never cast ids: an int64 id of 2**32 + 1 must not silently read row 1.
        if jnp.dtype(x.dtype).name != want or x.ndim != 1:
            raise ValueError(
                f"{op}: {name} must be 1-D {want} (preprocess_kjt builds valid CSR input), got "
                f"{jnp.dtype(x.dtype).name} {tuple(x.shape)}"
            )
    if not sample_ids.shape == gains.shape == embedding_ids.shape or embedding_ids.shape[0] % max(
        row_pointers.shape[0], 1
    ):
        raise ValueError(
            f"{op}: embedding_ids, sample_ids and gains need one equal length, a multiple of the "
            f"{row_pointers.shape[0]} partitions; got {embedding_ids.shape[0]}, {sample_ids.shape[0]}, {gains.shape[0]}"
        )
    if jnp.dtype(table.dtype) != jnp.uint8 or table.ndim != 2:
        raise ValueError(
            f"{op}: table must be uint8 [rows, row_bytes], got {jnp.dtype(table.dtype).name} {tuple(table.shape)}"
        )
    if bits not in (8, 4, 2) or embedding_dim * bits % 8:
        raise ValueError(
            f"{op}: bits must be 8, 4 or 2 with embedding_dim * bits a multiple of 8, got {bits}, {embedding_dim}"
        )
    data_bytes = embedding_dim * bits // 8
    if table.shape[1] < SCALE_BIAS_BYTES + data_bytes:
        raise ValueError(
            f"{op}: rows of {table.shape[1]} bytes cannot hold scale, bias and {embedding_dim} {bits}-bit values "
            f"({SCALE_BIAS_BYTES + data_bytes} bytes)"
        )
    if output_dtype not in OUTPUT_DTYPES.values():
        raise ValueError(f"{op}: output_dtype must be one of {sorted(OUTPUT_DTYPES.values())}, got {output_dtype!r}")
    valid = _valid(row_pointers, embedding_ids)
    rows = jnp.take(table, jnp.where(valid, embedding_ids, 0), axis=0)
    # The float16 scale and bias are the row's first 4 bytes (little-endian, as FBGEMM writes them).
    scale = jax.lax.bitcast_convert_type(rows[:, 0:2], jnp.float16).astype(jnp.float32)
    bias = jax.lax.bitcast_convert_type(rows[:, 2:4], jnp.float16).astype(jnp.float32)
    packed = rows[:, SCALE_BIAS_BYTES : SCALE_BIAS_BYTES + data_bytes]
    if bits == 8:
        q = packed
    else:
        # Value j sits in byte j // per_byte at bit (j % per_byte) * bits: low bits first.
        per_byte = 8 // bits
        shifts = jnp.arange(per_byte, dtype=jnp.uint8) * jnp.uint8(bits)
        q = ((packed[:, :, None] >> shifts) & jnp.uint8((1 << bits) - 1)).reshape(rows.shape[0], embedding_dim)
    # FBGEMM: out += (w * scale) * q + w * bias, in float32 (w: the per-sample weight, 1 unweighted).
    g = jnp.where(valid, gains, 0).astype(jnp.float32)
    values = (g * scale)[:, None] * q.astype(jnp.float32) + (g * bias)[:, None]
    segments = jnp.where(valid, sample_ids, batch_size)
    out = jax.ops.segment_sum(values, segments, num_segments=batch_size + 1)[:batch_size]
    return out.astype(jnp.dtype(output_dtype))


# --- the module ----------------------------------------------------------------------


def _torchrec_quant_order(tables: Sequence[EmbeddingBagConfig]) -> list[EmbeddingBagConfig]:
    """Tables in the order of TorchRec's quantized EBC output: grouped by pooling, groups in
    order of first appearance (it builds one FBGEMM module per pooling type)."""
    poolings: list[PoolingType] = []
    for t in tables:
        if t.pooling not in poolings:
            poolings.append(t.pooling)
    return [t for p in poolings for t in tables if t.pooling == p]


class QuantEmbeddingBagCollection(CsrLookup, EmbeddingBagCollectionInterface):
    """Pooled lookups of row-wise quantized tables, for inference (TorchRec's quantized EBC).

    Tables of one data type and embedding dim are stacked in one uint8 buffer
    ``stacked_weight_<i>`` (FBGEMM's row layout, see the module docstring). The
    output is a ``KeyedTensor`` in TorchRec's quantized order (tables grouped by
    pooling type), of ``output_dtype``. The state dict has TorchRec's keys,
    ``embedding_bags.<table>.weight``: uint8 ``[rows, row_bytes]`` as TorchRec's
    quantized EBC saves them (it also loads TorchRec's split
    ``weight_qscale``/``weight_qbias`` form). A new module's tables are zero;
    fill them with :func:`tpurec.sparse.from_torchrec` or ``load_state_dict``.

    Args:
        tables: table configs whose ``data_type`` is INT8, INT4 or INT2.
        is_weighted: the features carry per-id weights.
        output_dtype: float32, float16 or bfloat16 (TorchRec's ``output_dtype``).
        device: where the tables live, e.g. ``"tpu"`` (default CPU).
        num_partitions: MOD partitions of every table.
        capacities: static per-partition capacities (None: grown on demand).
        overflow: ``"error"`` or ``"drop"`` (see ``preprocess_kjt``).
        row_alignment: bytes each stored row is padded to (TorchRec's default 16).
        stack: stack tables of equal data type and dim.

    Example::

        qebc = QuantEmbeddingBagCollection(
            [EmbeddingBagConfig(name="t0", embedding_dim=8, num_embeddings=100, feature_names=["f0"],
                                data_type=DataType.INT4)], device="tpu")
        qebc.load_state_dict(torchrec_qebc.state_dict())
        kt = qebc(kjt)
    """

    def __init__(
        self,
        tables: Sequence[EmbeddingBagConfig],
        is_weighted: bool = False,
        output_dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
        num_partitions: int = 1,
        capacities: Capacity | Mapping[str, Capacity] | None = None,
        overflow: Literal["error", "drop"] = "error",
        row_alignment: int = DEFAULT_ROW_ALIGNMENT,
        stack: bool = True,
    ) -> None:
        super().__init__()
        if not tables:
            raise ValueError("QuantEmbeddingBagCollection needs at least one table")
        for cfg in tables:
            if cfg.data_type not in QUANT_BITS:
                raise ValueError(
                    f"table {cfg.name!r} has data_type={cfg.data_type.name}: QuantEmbeddingBagCollection stores "
                    f"row-wise quantized tables ({', '.join(d.name for d in QUANT_BITS)}). Use "
                    "tpurec.sparse.EmbeddingBagCollection for float32 tables."
                )
            bits = QUANT_BITS[cfg.data_type]
            if cfg.embedding_dim * bits % 8:
                raise ValueError(
                    f"table {cfg.name!r}: embedding_dim {cfg.embedding_dim} does not fill whole bytes at {bits} bits "
                    f"per value; FBGEMM's {cfg.data_type.name} rows need a dim that is a multiple of {8 // bits}"
                )
        if output_dtype not in OUTPUT_DTYPES:
            raise ValueError(
                f"output_dtype {output_dtype} is not supported: FBGEMM's pooled lookups produce "
                f"{', '.join(str(d) for d in OUTPUT_DTYPES)} (TorchRec's INT8/INT4 outputs are for unpooled lookups)"
            )
        if row_alignment < 1:
            raise ValueError(f"row_alignment must be a positive number of bytes, got {row_alignment}")
        self._embedding_bag_configs = list(tables)
        self._is_weighted = is_weighted
        self._output_dtype = output_dtype
        self.row_alignment = row_alignment
        self.num_partitions = num_partitions
        self.overflow = overflow
        self._fixed_capacities = capacities
        self._auto_capacities = {}
        # Stacks hold one data type each (the bits per value are a property of the buffer).
        kinds = list(dict.fromkeys(t.data_type for t in self._embedding_bag_configs))
        self._stacks = []
        self._stack_bits: list[int] = []
        for kind in kinds:
            for st in stack_tables([t for t in self._embedding_bag_configs if t.data_type == kind], stack=stack):
                self._stacks.append(st)
                self._stack_bits.append(QUANT_BITS[kind])
        self._init_outputs(_torchrec_quant_order(self._embedding_bag_configs))
        for i, (st, bits) in enumerate(zip(self._stacks, self._stack_bits)):
            weight = torch.zeros(st.num_rows, row_bytes(st.embedding_dim, bits, row_alignment), dtype=torch.uint8)
            self.register_buffer(f"stacked_weight_{i}", weight, persistent=False)
        if device is not None:
            self.to(device)

    # --- torchrec interface ---------------------------------------------------------

    def output_dtype(self) -> torch.dtype:
        return self._output_dtype

    # --- lookup ---------------------------------------------------------------------

    @torch.compiler.disable
    def forward(self, features: KeyedJaggedTensor) -> KeyedTensor:
        """Pooled embeddings of ``features``, as TorchRec's quantized EBC computes them.

        Args:
            features: KJT with the tables' features (CPU; preprocessed on the host).

        Returns:
            ``KeyedTensor`` of ``output_dtype``, one ``[batch, dim]`` block per
            feature, in TorchRec's quantized order.

        Raises:
            ValueError: the batch is invalid (as for :class:`EmbeddingBagCollection`).
            NotImplementedError: the per-id weights require grad (quantized tables
                are for inference: nothing would give them a gradient).
        """
        if self._weights_need_grad(features):
            raise NotImplementedError(
                f"QuantEmbeddingBagCollection (tables {[t.name for t in self._embedding_bag_configs]}) is for "
                "inference, but the KJT's per-id weights require grad: TorchRec's quantized lookup gives them no "
                "gradient either. Detach the weights, or train a float EmbeddingBagCollection and quantize it after."
            )
        if features.variable_stride_per_key() or features.inverse_indices_or_none() is not None:
            # TorchRec's quantized lookup ignores inverse_indices (its TBE reads one batch size):
            # the float collection's expansion would differ from it, and ignoring them would not.
            raise NotImplementedError(
                "QuantEmbeddingBagCollection does not look up KeyedJaggedTensors with a variable batch size per "
                "feature (VBE, stride_per_key_per_rank) or inverse_indices: TorchRec's quantized "
                "EmbeddingBagCollection does not expand them either. Give every feature the same batch size and "
                "no inverse_indices."
            )
        batch = self.preprocess(features)
        self._drops.add(batch.dropped_by_feature)
        device = self.device
        dtype = OUTPUT_DTYPES[self._output_dtype]
        stack_outputs = []
        for i, (st, bits) in enumerate(zip(self._stacks, self._stack_bits)):
            arrays = [torch.from_numpy(a).to(device) for a in batch.stacks[st.name].arrays()]
            out = torch.ops.tpurec.quantized_sparse_dense_matmul(
                *arrays,
                self.stacked_weight(i),
                batch_size=st.num_slots * batch.batch_size,
                bits=bits,
                embedding_dim=st.embedding_dim,
                output_dtype=dtype,
            )
            stack_outputs.append(out.view(st.num_slots, batch.batch_size, st.embedding_dim))
        values = self._pooled_values(stack_outputs, batch.batch_size)
        return KeyedTensor(keys=self._embedding_names, length_per_key=self._length_per_key, values=values)

    # --- checkpoints ----------------------------------------------------------------

    def _table_value(
        self, state_dict: Mapping[str, Any], key: str, stack: int, target: torch.Tensor
    ) -> tuple[Any, str | None]:
        rows, width = target.shape
        return _stored_rows(state_dict, key, rows, self._stacks[stack].embedding_dim, self._stack_bits[stack], width)

    def _table_companions(self, key: str) -> list[str]:
        return [key + "_qscale", key + "_qbias"]  # TorchRec's split scale/bias form


def _plain_uint8(value: Any) -> Any:
    """The uint8 bytes behind TorchRec's ``UInt4Tensor``/``UInt2Tensor`` wrappers (else ``value``)."""
    from torchrec.tensor_types import UIntXTensor

    return value.elem if isinstance(value, UIntXTensor) else value


def _stored_rows(
    state_dict: Mapping[str, Any], key: str, rows: int, dim: int, bits: int, width: int
) -> tuple[torch.Tensor | None, str | None]:
    """Table ``key`` of a state dict as stored rows ``[rows, width]`` (uint8), or an error message.

    Accepts TorchRec's two forms: whole rows (scale, bias, values, padding; the default)
    and, with ``weight_qscale``/``weight_qbias`` beside it, the values alone.
    """
    value = _plain_uint8(state_dict[key])
    data_bytes = dim * bits // 8
    if not isinstance(value, torch.Tensor) or value.dtype != torch.uint8 or value.dim() != 2 or value.shape[0] != rows:
        got = f"{value.dtype} {tuple(value.shape)}" if isinstance(value, torch.Tensor) else type(value).__name__
        return None, f"{key}: expected uint8 quantized rows [{rows}, {width}] (TorchRec's quantized EBC), got {got}"
    scale, bias = state_dict.get(key + "_qscale"), state_dict.get(key + "_qbias")
    if scale is None and bias is None:
        if value.shape[1] == width:
            return value, None
        if value.shape[1] >= SCALE_BIAS_BYTES + data_bytes:
            # Another row alignment: the same scale, bias and values, different padding.
            out = torch.zeros(rows, width, dtype=torch.uint8, device=value.device)
            out[:, : SCALE_BIAS_BYTES + data_bytes] = value[:, : SCALE_BIAS_BYTES + data_bytes]
            return out, None
        return None, f"{key}: rows of {value.shape[1]} bytes cannot hold scale, bias and {dim} {bits}-bit values"
    if scale is None or bias is None:
        return None, f"{key}: {key}_qscale and {key}_qbias come together (TorchRec's split scale/bias form)"
    if value.shape[1] != data_bytes or any(
        not isinstance(t, torch.Tensor) or t.dtype != torch.float16 or t.numel() != rows for t in (scale, bias)
    ):
        return None, (
            f"{key}: the split form needs values uint8 [{rows}, {data_bytes}] and float16 scale and bias of {rows} "
            f"entries, got {tuple(value.shape)}, {getattr(scale, 'dtype', scale)}, {getattr(bias, 'dtype', bias)}"
        )
    out = torch.zeros(rows, width, dtype=torch.uint8)
    out[:, 0:2] = scale.detach().cpu().reshape(rows, 1).view(torch.uint8)
    out[:, 2:4] = bias.detach().cpu().reshape(rows, 1).view(torch.uint8)
    out[:, SCALE_BIAS_BYTES : SCALE_BIAS_BYTES + data_bytes] = value.detach().cpu()
    return out, None


# --- conversion from TorchRec --------------------------------------------------------


def unsupported_quant_reason(module: TorchrecQuantEBC) -> str | None:
    """Why TorchRec quantized EBC ``module`` cannot be converted exactly (None: it can)."""
    from fbgemm_gpu.split_table_batched_embeddings_ops_inference import IntNBitTableBatchedEmbeddingBagsCodegen

    for cfg in module.embedding_bag_configs():
        if cfg.data_type not in QUANT_BITS:
            return f"table {cfg.name!r} is {cfg.data_type.name} (tpurec converts INT8, INT4 and INT2 tables)"
        pruned = getattr(cfg, "num_embeddings_post_pruning", None)
        if pruned is not None and pruned != cfg.num_embeddings:
            return f"table {cfg.name!r} is pruned to {pruned} of {cfg.num_embeddings} rows (index remapping)"
        if getattr(cfg, "use_virtual_table", False):
            return f"table {cfg.name!r} is a virtual (key-value) table"
    if module.output_dtype() not in OUTPUT_DTYPES:
        return f"output_dtype {module.output_dtype()} (tpurec's pooled output is float32, float16 or bfloat16)"
    for emb in module._emb_modules:
        if type(emb) is not IntNBitTableBatchedEmbeddingBagsCodegen:
            return (
                f"its tables are held by {type(emb).__qualname__}, not FBGEMM's IntNBitTableBatchedEmbeddingBagsCodegen"
            )
        if (
            getattr(emb, "reverse_qparam", False)
            or getattr(emb, "scale_bias_size_in_bytes", SCALE_BIAS_BYTES) != SCALE_BIAS_BYTES
        ):
            return "its rows keep scale and bias at the end (reverse_qparam) or in another size"
        remapped = (
            getattr(emb, "index_remapping_hash_table_cpu", None) is not None
            or emb.index_remapping_hash_table.numel() > 0
            or emb.index_remappings_array.numel() > 0
        )
        if remapped:
            return "its ids are remapped (pruning index remappings)"
    return None


def from_torchrec_quant(
    module: TorchrecQuantEBC,
    device: torch.device | str | None = None,
    num_partitions: int = 1,
    capacities: Capacity | Mapping[str, Capacity] | None = None,
) -> QuantEmbeddingBagCollection:
    """A :class:`QuantEmbeddingBagCollection` with the quantized rows of TorchRec's ``module``.

    Args:
        module: a ``torchrec.quant.embedding_modules.EmbeddingBagCollection``.
        device: device of the new tables (default: the module's device).
        num_partitions: MOD partitions.
        capacities: static capacities.

    Returns:
        The new module; its rows are byte for byte those FBGEMM holds.

    Raises:
        NotImplementedError: ``module`` uses something tpurec cannot reproduce (named).
    """
    reason = unsupported_quant_reason(module)
    if reason is not None:
        raise NotImplementedError(f"from_torchrec cannot convert this quantized EmbeddingBagCollection: {reason}")
    new = QuantEmbeddingBagCollection(
        tables=module.embedding_bag_configs(),
        is_weighted=module.is_weighted(),
        output_dtype=module.output_dtype(),
        num_partitions=num_partitions,
        capacities=capacities,
        row_alignment=module.row_alignment,
    )
    with torch.no_grad():
        for (_key, tables), emb in zip(module._key_to_tables.items(), module._emb_modules):
            # Mode 0: each table's whole stored rows (scale, bias, values, padding), whatever
            # form the module's own state dict uses.
            fbgemm = cast(Any, emb)  # FBGEMM's IntNBitTableBatchedEmbeddingBagsCodegen (unsupported_quant_reason)
            for cfg, (rows, _, _) in zip(
                tables, fbgemm.split_embedding_weights_with_scale_bias(split_scale_bias_mode=0)
            ):
                new.table_weight(cfg.name).copy_(rows)
    target = device if device is not None else module.device
    return new.to(target) if target is not None else new
