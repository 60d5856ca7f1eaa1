"""TPU topology for the sharding planner: generations, slices, ICI torus, DCN.

A :class:`TpuTopology` describes one TPU job: a generation (v4, v5e, v5p, v6e,
v7x, tpu8t, tpu8i), the shape of one slice (chips along each torus axis) and the number of
slices joined over the data-center network (DCN). From these it derives what
the planner needs: JAX devices, chips, hosts, SparseCores, HBM capacity and
bandwidth, ICI link bandwidth, bisection bandwidth of the torus, and DCN
bandwidth per chip. :meth:`TpuTopology.to_torchrec` turns it into a TorchRec
``Topology(compute_device="tpu")`` so ``EmbeddingShardingPlanner`` can use it.

Units: bytes, bytes per second and seconds here; TorchRec wants bytes per
millisecond, and :meth:`TpuTopology.to_torchrec` converts.

Figures no public source gives are not guessed silently: each generation lists
them in :attr:`TpuGeneration.assumptions` with the reason, and the plan report
prints them (:attr:`TpuTopology.assumptions`).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field, fields, replace
from typing import Dict, List, Mapping, Optional, Tuple

__all__ = [
    "TpuCommsBandwidths",
    "TpuGeneration",
    "TPU_GENERATIONS",
    "TpuTopology",
    "DEVICE_KINDS",
    "default_slice_shape",
    "generation_of_device_kind",
]

_GiB = 1024**3
_GB = 1000**3


@dataclass(frozen=True)
class TpuGeneration:
    """Per-chip figures of one TPU generation.

    Args:
        name: generation name (``"v5p"``).
        hbm_bytes_per_chip: HBM capacity of one chip, in bytes.
        hbm_bw_per_chip: HBM bandwidth of one chip, bytes/s.
        bf16_flops_per_chip: peak bf16 FLOP/s of one chip.
        ici_bw_per_chip: ICI bandwidth of one chip, bidirectional, summed over
            its links, bytes/s.
        torus_rank: 2 or 3 (2D or 3D torus).
        max_chips_per_slice: largest slice (pod) size, chips.
        sparsecores_per_chip: SparseCores on one chip (0: lookups run on the
            TensorCore).
        devices_per_chip: JAX devices per chip (2 on v7x: two TensorCore dies,
            each its own device).
        chips_per_host: chips attached to one host VM.
        dcn_bw_per_chip: data-center network bandwidth per chip, one
            direction, bytes/s.
        name_counts_cores: whether the accelerator-type suffix counts
            TensorCores (v4, v5p, v7x: two per chip) instead of chips (v5e,
            v6e).
        sc_tiles: vector subcores ("tiles") per SparseCore.
        sc_lanes: f32 SIMD lanes per tile.
        sc_clock_hz: SparseCore clock (assumed; no public figure).
        sparsecore_primitives: whether jax-tpu-embedding's primitives drive
            this generation's SparseCores (v5p, v6e, v7x); elsewhere lookups run
            on the TensorCore kernel (:mod:`tpurec.sparse.kernels.tensorcore`).
        sources: where the figures come from.
        assumptions: ``(field, why)`` for every figure above that no cited
            source gives: the value used is the field's, the reason says where
            it was taken from and what it changes in a plan.

    Example::

        v5p = TPU_GENERATIONS["v5p"]
        v5p.ici_link_bw  # one-way bytes/s of one ICI link
    """

    name: str
    hbm_bytes_per_chip: int
    hbm_bw_per_chip: float
    bf16_flops_per_chip: float
    ici_bw_per_chip: float
    torus_rank: int
    max_chips_per_slice: int
    sparsecores_per_chip: int
    devices_per_chip: int
    chips_per_host: int
    dcn_bw_per_chip: float
    name_counts_cores: bool
    sc_tiles: int = 16
    sc_lanes: int = 8
    sc_clock_hz: float = 1.0e9
    sparsecore_primitives: bool = False
    sources: Tuple[str, ...] = ()
    assumptions: Tuple[Tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        known = set(figure_fields())
        for figure, _ in self.assumptions:
            if figure not in known:
                raise ValueError(f"{self.name}: assumption about unknown figure {figure!r}; figures: {sorted(known)}")

    def assumption_lines(self, skip: Tuple[str, ...] = ()) -> List[str]:
        """One line per assumed figure: its name, the value used, and why.

        Args:
            skip: figures not to list (overridden by the user, so not assumed).

        Returns:
            Lines such as ``"tpu8t hbm_bytes_per_chip = 192 GiB: ..."``.
        """
        return [
            f"{self.name} {figure} = {_figure_repr(figure, getattr(self, figure))}: {why}"
            for figure, why in self.assumptions
            if figure not in skip
        ]

    @property
    def ici_links_per_chip(self) -> int:
        """Links of one chip: two per torus axis (one each way round the ring)."""
        return 2 * self.torus_rank

    @property
    def ici_link_bw(self) -> float:
        """One-way bandwidth of one ICI link, bytes/s."""
        # ici_bw_per_chip is bidirectional over all links.
        return self.ici_bw_per_chip / (2 * self.ici_links_per_chip)

    @property
    def sparsecores_per_device(self) -> int:
        """SparseCores owned by one JAX device."""
        return self.sparsecores_per_chip // self.devices_per_chip


def figure_fields() -> Tuple[str, ...]:
    """The per-chip figures of :class:`TpuGeneration` (every field but labels)."""
    return tuple(
        f.name
        for f in fields(TpuGeneration)
        if f.name not in ("name", "sources", "assumptions", "sparsecore_primitives")
    )


def _figure_repr(figure: str, value: object) -> str:
    """A figure with its unit, as the report prints it."""
    if figure == "hbm_bytes_per_chip":
        v = int(value)  # type: ignore[call-overload]
        return f"{v // _GiB} GiB" if v % _GiB == 0 else f"{v / _GB:g} GB"
    if figure.endswith("_bw_per_chip"):
        return f"{float(value) / _GB:g} GB/s"  # type: ignore[arg-type]
    if figure == "bf16_flops_per_chip":
        return f"{float(value) / 1e12:g} TFLOP/s"  # type: ignore[arg-type]
    if figure == "sc_clock_hz":
        return f"{float(value) / 1e9:g} GHz"  # type: ignore[arg-type]
    return str(value)


_SC_SIMD_ASSUMED = (
    ("sc_lanes", "no public figure for SparseCore SIMD width; scales SparseCore vector time only"),
    ("sc_clock_hz", "no public SparseCore clock; scales SparseCore vector time only"),
)


# One table of generation figures. Sources (public):
#   cloud.google.com/tpu/docs/v4, /v5e, /v5p, /v6e, /tpu7x (system architecture
#   tables: HBM, HBM bandwidth, bf16 peak, ICI, topology, chips per host);
#   jax-tpu-embedding NUM_SC_PER_DEVICE_MAP (SparseCores per device);
#   openxla.org SparseCore guide (16 tiles per SparseCore).
# Figures not published (SparseCore lanes and clock, v4/v5e DCN) are
# assumptions, marked below; they only scale estimates, never capacity.
TPU_GENERATIONS: Dict[str, TpuGeneration] = {
    "v4": TpuGeneration(
        name="v4",
        hbm_bytes_per_chip=32 * _GiB,  # cloud.google.com/tpu/docs/v4
        hbm_bw_per_chip=1200 * _GB,  # cloud.google.com/tpu/docs/v4
        bf16_flops_per_chip=275e12,  # cloud.google.com/tpu/docs/v4
        ici_bw_per_chip=6 * 2 * 45 * _GB,  # 6 links x 45 GB/s one-way (v4 docs)
        torus_rank=3,
        max_chips_per_slice=4096,
        sparsecores_per_chip=4,  # v4 paper (Jouppi et al., ISCA 2023)
        devices_per_chip=1,  # megacore: 2 TensorCores, one device
        chips_per_host=4,
        dcn_bw_per_chip=50e9 / 8,  # assumption: as v5p (no public v4 figure)
        name_counts_cores=True,
        sources=("cloud.google.com/tpu/docs/v4", "Jouppi et al. ISCA 2023"),
        assumptions=(
            ("dcn_bw_per_chip", "no public v4 DCN figure; v5p's 50 Gb/s per chip; multislice comms only"),
            *_SC_SIMD_ASSUMED,
        ),
    ),
    "v5e": TpuGeneration(
        name="v5e",
        hbm_bytes_per_chip=16 * _GB,  # cloud.google.com/tpu/docs/v5e
        hbm_bw_per_chip=819 * _GB,
        bf16_flops_per_chip=197e12,
        ici_bw_per_chip=400 * _GB,
        torus_rank=2,
        max_chips_per_slice=256,
        sparsecores_per_chip=0,  # no SparseCore: lookups on the TensorCore
        devices_per_chip=1,
        chips_per_host=8,
        # cloud.google.com/tpu/docs/v5e: "Data center network bandwidth per
        # Pod 6.4 Tbps" over 256 chips = 25 Gb/s per chip (also: 2 x 100 Gbps
        # NICs per 8-chip host).
        dcn_bw_per_chip=25e9 / 8,
        name_counts_cores=False,
        sources=("cloud.google.com/tpu/docs/v5e",),
    ),
    "v5p": TpuGeneration(
        name="v5p",
        sparsecore_primitives=True,  # jax-tpu-embedding NUM_SC_PER_DEVICE_MAP
        hbm_bytes_per_chip=95 * _GiB,  # cloud.google.com/tpu/docs/v5p
        hbm_bw_per_chip=2765 * _GB,
        bf16_flops_per_chip=459e12,
        ici_bw_per_chip=1200 * _GB,
        torus_rank=3,
        # cloud.google.com/tpu/docs/v5p: a pod has 8960 chips, but "the largest
        # job that can be scheduled is a 96 cube (6144 chip) job" (16x16x24).
        max_chips_per_slice=6144,
        sparsecores_per_chip=4,  # jax-tpu-embedding NUM_SC_PER_DEVICE_MAP
        devices_per_chip=1,
        chips_per_host=4,
        # cloud.google.com/tpu/docs/v5p: "Data center network (DCN) bandwidth
        # per chip (Gbps) 50".
        dcn_bw_per_chip=50e9 / 8,
        name_counts_cores=True,
        sources=("cloud.google.com/tpu/docs/v5p", "jax-tpu-embedding"),
        assumptions=_SC_SIMD_ASSUMED,
    ),
    "v6e": TpuGeneration(
        name="v6e",
        sparsecore_primitives=True,  # jax-tpu-embedding NUM_SC_PER_DEVICE_MAP
        hbm_bytes_per_chip=32 * _GB,  # cloud.google.com/tpu/docs/v6e
        hbm_bw_per_chip=1638 * _GB,
        bf16_flops_per_chip=918e12,
        ici_bw_per_chip=800 * _GB,
        torus_rank=2,
        max_chips_per_slice=256,
        sparsecores_per_chip=2,  # jax-tpu-embedding NUM_SC_PER_DEVICE_MAP
        devices_per_chip=1,
        chips_per_host=8,
        dcn_bw_per_chip=100e9 / 8,  # 100 Gb/s per chip
        name_counts_cores=False,
        sc_lanes=16,  # assumption: wider SIMD than v5p's SparseCore
        sources=("cloud.google.com/tpu/docs/v6e", "jax-tpu-embedding"),
        assumptions=_SC_SIMD_ASSUMED,
    ),
    "v7x": TpuGeneration(
        name="v7x",
        sparsecore_primitives=True,  # jax-tpu-embedding NUM_SC_PER_DEVICE_MAP
        hbm_bytes_per_chip=192 * _GiB,  # cloud.google.com/tpu/docs/tpu7x
        hbm_bw_per_chip=7380 * _GB,
        bf16_flops_per_chip=2307e12,
        ici_bw_per_chip=1200 * _GB,
        torus_rank=3,
        max_chips_per_slice=9216,
        sparsecores_per_chip=4,  # 2 per device x 2 devices (jax-tpu-embedding)
        devices_per_chip=2,
        chips_per_host=4,
        dcn_bw_per_chip=100e9 / 8,  # 100 Gb/s per chip
        name_counts_cores=True,
        sc_lanes=16,  # assumption
        sources=("cloud.google.com/tpu/docs/tpu7x", "jax-tpu-embedding"),
        assumptions=_SC_SIMD_ASSUMED,
    ),
}


# TPU 8t (training) and TPU 8i (inference), the eighth generation. Published
# figures (Google's announcement of the two chips, as quoted in the project's
# seed brief):
#   * TPU 8i: 288 GB of HBM per chip at 8.6 TB/s;
#   * TPU 8t and 8i: chips link at 19.2 TB/s bidirectional (per chip, summed
#     over its ICI links: ``ici_bw_per_chip``'s convention, so 9.6 TB/s each
#     way);
#   * TPU 8t: slices talk over a 400 GB/s data-centre network.
# No Cloud TPU system-architecture page for them was available to cite, so
# every other figure is v7x's (the newest generation with a published table)
# and is listed, with what it changes, in the entry's ``assumptions``: the
# plan report prints each one. ``_next_generation`` enforces that: a figure is
# either in ``published`` or it is an assumption.

# What each v7x figure changes when it stands in for an unpublished one.
_INHERITED_EFFECT: Dict[str, str] = {
    "hbm_bytes_per_chip": "sets the HBM the plan must fit in",
    "hbm_bw_per_chip": "scales every lookup, update and HBM-bound time",
    "bf16_flops_per_chip": "reported only; no estimate uses it",
    "ici_bw_per_chip": "scales ICI collective times",
    "torus_rank": "a 3D torus: the per-chip ICI figure is split over 6 links, and slice shapes are 3D",
    "max_chips_per_slice": "the largest slice accepted",
    "sparsecores_per_chip": "sets SparseCore partitions, row padding and lookup parallelism",
    "devices_per_chip": "2 JAX devices (TensorCore dies) per chip: sets the world size and HBM per device",
    "chips_per_host": "sets TorchRec's host size (local_world_size)",
    "dcn_bw_per_chip": "one direction, per chip; scales multislice (cross-slice) comms only",
    "name_counts_cores": "the accelerator-type suffix counts TensorCores: {name}-64 is 32 chips, as v7x-64",
    "sc_tiles": "scales SparseCore vector time only",
    "sc_lanes": "scales SparseCore vector time only",
    "sc_clock_hz": "scales SparseCore vector time only",
}


def _next_generation(
    name: str,
    published: Mapping[str, object],
    notes: Mapping[str, str],
    sources: Tuple[str, ...],
) -> TpuGeneration:
    """A generation whose unpublished figures are v7x's, each one an assumption.

    Args:
        name: generation name.
        published: figures a public source gives, by field name.
        notes: caveats about how a published figure is read (field -> text);
            recorded as assumptions too, since they are readings, not figures.
        sources: where the published figures come from.

    Returns:
        The generation, with ``assumptions`` naming every figure not in
        ``published`` (and every reading in ``notes``).
    """
    base = TPU_GENERATIONS["v7x"]
    inherited = [f for f in figure_fields() if f not in published]
    assumptions = [
        (f, f"not published for {name}; v7x's figure ({_INHERITED_EFFECT[f].format(name=name)})") for f in inherited
    ]
    assumptions += [(f, text) for f, text in notes.items()]
    return replace(
        base,
        name=name,
        sparsecore_primitives=False,  # not in jax-tpu-embedding's table: the TensorCore kernel
        sources=sources,
        assumptions=tuple(assumptions),
        **published,  # type: ignore[arg-type]
    )


_TPU8_SOURCE = "Google's TPU 8t / TPU 8i announcement (figures quoted in the project seed)"
_TPU8_ICI = 19.2e12  # 19.2 TB/s bidirectional per chip (both 8t and 8i)
_TPU8_ICI_NOTE = (
    "published as 19.2 TB/s bidirectional per chip; read as bytes (9.6 TB/s each way, "
    "1.6 TB/s per link over 6 links). If the source meant terabits it is 8x less"
)

TPU_GENERATIONS["tpu8t"] = _next_generation(
    "tpu8t",
    published={
        "ici_bw_per_chip": _TPU8_ICI,
        "dcn_bw_per_chip": 400 * _GB,  # "400 GB/s data-centre network"
    },
    notes={
        "ici_bw_per_chip": _TPU8_ICI_NOTE,
        "dcn_bw_per_chip": "published as a 400 GB/s data-centre network between slices; read as per "
        "chip, one direction (as v5p's per-chip DCN figure is read)",
    },
    sources=(_TPU8_SOURCE,),
)
TPU_GENERATIONS["tpu8i"] = _next_generation(
    "tpu8i",
    published={
        # "288 GB": decimal gigabytes, taken literally (the smaller reading;
        # 288 GiB would be 7% more).
        "hbm_bytes_per_chip": 288 * _GB,
        "hbm_bw_per_chip": 8.6e12,  # 8.6 TB/s
        "ici_bw_per_chip": _TPU8_ICI,
    },
    notes={
        "ici_bw_per_chip": _TPU8_ICI_NOTE,
        "hbm_bytes_per_chip": "published as 288 GB; read as decimal GB (268.2 GiB), the smaller reading",
    },
    sources=(_TPU8_SOURCE,),
)

_ALIASES: Dict[str, str] = {
    "v5litepod": "v5e",
    "v5lite": "v5e",
    "tpu7x": "v7x",
    "ironwood": "v7x",
    "trillium": "v6e",
    "v8t": "tpu8t",
    "8t": "tpu8t",
    "v8i": "tpu8i",
    "8i": "tpu8i",
}


# The device kinds JAX reports (``jax.devices()[0].device_kind``) -> generation. The one
# place a chip is recognised: the planner's automatic topology and the sparse kernels'
# choice both read it. Kinds from jax-tpu-embedding's NUM_SC_PER_DEVICE_MAP ("TPU v5"
# is v5p; pathways reports "TPU v5p") and Cloud TPU VMs ("TPU v5 lite" is v5e).
DEVICE_KINDS: Dict[str, str] = {
    "TPU v4": "v4",
    "TPU v4 lite": "v4",
    "TPU v5 lite": "v5e",
    "TPU v5e": "v5e",
    "TPU v5": "v5p",
    "TPU v5p": "v5p",
    "TPU v6 lite": "v6e",
    "TPU v6e": "v6e",
    "TPU7x": "v7x",
    "TPU v7x": "v7x",
}


def generation_of_device_kind(kind: str) -> Optional[TpuGeneration]:
    """The generation of a JAX TPU device kind, or None for a kind not in :data:`DEVICE_KINDS`.

    Args:
        kind: ``jax.Device.device_kind``, e.g. ``"TPU v5 lite"``.

    Example::

        generation_of_device_kind("TPU v5 lite").name  # "v5e"
    """
    name = DEVICE_KINDS.get(kind.strip())
    return None if name is None else TPU_GENERATIONS[name]


def _generation(name: str) -> TpuGeneration:
    key = _ALIASES.get(name.lower(), name.lower())
    if key not in TPU_GENERATIONS:
        raise ValueError(f"Unknown TPU generation {name!r}; known: {sorted(TPU_GENERATIONS)}")
    return TPU_GENERATIONS[key]


# Slice shapes Cloud TPU offers whose chip count is not a power of two.
# cloud.google.com/tpu/docs/v5p: "The maximum v5p shape is 16x16x24 (6144
# chips, 96 cubes)".
_PUBLISHED_SHAPES: Dict[Tuple[str, int], Tuple[int, ...]] = {
    ("v5p", 6144): (16, 16, 24),
}


def default_slice_shape(generation: str, chips: int) -> Tuple[int, ...]:
    """The usual slice shape of ``chips`` chips (power of two) for a generation.

    Doubles the shortest axis until the chip count is reached, which gives the
    shapes Cloud TPU offers by default (2x2x1, 2x2x2, 2x2x4, 2x4x4, 4x4x4, ...
    for 3D tori; 2x2, 2x4, 4x4, ... 16x16 for 2D ones).

    Args:
        generation: generation name.
        chips: number of chips in the slice.

    Returns:
        Axis lengths, ascending.

    Example::

        default_slice_shape("v5p", 64)  # (4, 4, 4)
    """
    gen = _generation(generation)
    published = _PUBLISHED_SHAPES.get((gen.name, chips))
    if published is not None:
        return published
    if chips < 1 or chips & (chips - 1):
        raise ValueError(f"{chips} chips is not a power of two; pass slice_shape explicitly")
    dims = [1] * gen.torus_rank
    while math.prod(dims) < chips:
        i = dims.index(min(dims))
        dims[i] *= 2
    return tuple(sorted(dims))


@dataclass(frozen=True)
class TpuTopology:
    """A TPU job: ``num_slices`` slices of one generation, each ``slice_shape``.

    Build it from an accelerator-type name (:meth:`from_name`) or from fields.

    Args:
        generation: ``"v4"``, ``"v5e"``, ``"v5p"``, ``"v6e"``, ``"v7x"``,
            ``"tpu8t"`` or ``"tpu8i"`` (most of whose figures are assumed: see
            :attr:`assumptions`).
        slice_shape: chips along each torus axis of one slice, e.g. ``(4, 4, 8)``.
        num_slices: slices joined over DCN (multislice); 1 for one slice.
        hbm_bytes_per_chip: override the generation's HBM capacity.
        ddr_bytes_per_chip: host memory per chip (only reported: TPU
            embeddings live in HBM).

    Example::

        topo = TpuTopology.from_name("v5p-128")  # 64 chips, 4x4x4
        topo.world_size  # 64 JAX devices
        two = TpuTopology.from_name("v6e-256", num_slices=2)
        two.world_size  # 512
        trec = topo.to_torchrec()  # torchrec Topology(compute_device="tpu")
    """

    generation: str
    slice_shape: Tuple[int, ...]
    num_slices: int = 1
    hbm_bytes_per_chip: Optional[int] = None
    ddr_bytes_per_chip: int = 96 * _GiB
    gen: TpuGeneration = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        gen = _generation(self.generation)
        object.__setattr__(self, "gen", gen)
        object.__setattr__(self, "generation", gen.name)
        shape = tuple(int(d) for d in self.slice_shape)
        object.__setattr__(self, "slice_shape", shape)
        if len(shape) != gen.torus_rank:
            raise ValueError(f"{gen.name} slices are {gen.torus_rank}D; got slice_shape {shape}")
        if any(d < 1 for d in shape):
            raise ValueError(f"slice_shape must be positive, got {shape}")
        if math.prod(shape) > gen.max_chips_per_slice:
            raise ValueError(
                f"{gen.name} slices hold at most {gen.max_chips_per_slice} chips; {shape} has {math.prod(shape)}"
            )
        if self.num_slices < 1:
            raise ValueError(f"num_slices must be >= 1, got {self.num_slices}")

    # ---- construction -------------------------------------------------- #

    @classmethod
    def from_name(
        cls,
        name: str,
        num_slices: int = 1,
        slice_shape: Optional[Tuple[int, ...]] = None,
        **kwargs: object,
    ) -> "TpuTopology":
        """Topology from a Cloud TPU accelerator type such as ``"v5p-128"``.

        The suffix counts TensorCores on v4, v5p and v7x (two per chip) and
        chips on v5e and v6e, as Cloud TPU names them; on tpu8t and tpu8i it
        counts TensorCores as on v7x (an assumption: no published names). ``"2xv6e-256"`` is two
        slices.

        Args:
            name: accelerator type, optionally prefixed by ``"<N>x"`` slices.
            num_slices: number of slices (multiplied by the prefix, if any).
            slice_shape: override the default shape for the chip count.
            **kwargs: other :class:`TpuTopology` fields.

        Returns:
            The topology.

        Example::

            TpuTopology.from_name("v7x-64").num_chips  # 32
        """
        m = re.fullmatch(r"(?:(\d+)x)?([A-Za-z0-9]+)-(\d+)", name.strip())
        if not m:
            raise ValueError(f"Cannot parse TPU topology name {name!r}; expected e.g. 'v5p-128'")
        prefix, gen_name, count = m.groups()
        gen = _generation(gen_name)
        n = int(count)
        if gen.name_counts_cores:
            if n % 2:
                raise ValueError(f"{name}: {gen.name} names count TensorCores (2/chip)")
            chips = n // 2
        else:
            chips = n
        slices = num_slices * (int(prefix) if prefix else 1)
        shape = slice_shape or default_slice_shape(gen.name, chips)
        if math.prod(shape) != chips:
            raise ValueError(f"{name} has {chips} chips but slice_shape {shape}")
        return cls(gen.name, tuple(shape), slices, **kwargs)  # type: ignore[arg-type]

    @property
    def name(self) -> str:
        """Accelerator-type name of one slice, with an ``Nx`` multislice prefix."""
        n = self.chips_per_slice * (2 if self.gen.name_counts_cores else 1)
        base = f"{self.gen.name}-{n}"
        return base if self.num_slices == 1 else f"{self.num_slices}x{base}"

    # ---- counts -------------------------------------------------------- #

    @property
    def chips_per_slice(self) -> int:
        return math.prod(self.slice_shape)

    @property
    def num_chips(self) -> int:
        return self.chips_per_slice * self.num_slices

    @property
    def devices_per_chip(self) -> int:
        return self.gen.devices_per_chip

    @property
    def devices_per_slice(self) -> int:
        return self.chips_per_slice * self.devices_per_chip

    @property
    def world_size(self) -> int:
        """JAX devices in the job (TorchRec ranks)."""
        return self.num_chips * self.devices_per_chip

    @property
    def num_hosts(self) -> int:
        return max(1, math.ceil(self.num_chips / self.gen.chips_per_host))

    @property
    def sparsecores_per_device(self) -> int:
        return self.gen.sparsecores_per_device

    @property
    def sparsecores_per_chip(self) -> int:
        return self.gen.sparsecores_per_chip

    @property
    def sparsecore_note(self) -> Optional[str]:
        """A plain statement when the generation has no SparseCore, else ``None``.

        v5e chips have none (cloud.google.com/tpu/docs/v5e lists one
        TensorCore per chip and no SparseCore), so embedding lookups and
        updates run as gathers and scatters on the TensorCore.
        """
        if self.sparsecores_per_chip:
            return None
        return (
            f"{self.gen.name} has no SparseCore: embedding lookups and updates run as "
            f"gathers/scatters on the TensorCore, and SparseCore figures (partitions, "
            f"MOD row sharding per SparseCore) do not apply"
        )

    @property
    def assumptions(self) -> List[str]:
        """Figures this topology uses that no cited source gives, one line each.

        The generation's assumed figures, less the HBM capacity when
        ``hbm_bytes_per_chip`` overrides it. Empty when every figure is
        published.
        """
        skip = ("hbm_bytes_per_chip",) if self.hbm_bytes_per_chip is not None else ()
        return self.gen.assumption_lines(skip=skip)

    def slice_of(self, rank: int) -> int:
        """Slice index of a device rank (ranks are numbered slice-major)."""
        return rank // self.devices_per_slice

    def chip_of(self, rank: int) -> int:
        return rank // self.devices_per_chip

    # ---- memory -------------------------------------------------------- #

    @property
    def hbm_per_chip(self) -> int:
        return self.hbm_bytes_per_chip if self.hbm_bytes_per_chip is not None else self.gen.hbm_bytes_per_chip

    @property
    def hbm_per_device(self) -> int:
        return self.hbm_per_chip // self.devices_per_chip

    @property
    def hbm_bw_per_device(self) -> float:
        """HBM bandwidth of one device, bytes/s."""
        return self.gen.hbm_bw_per_chip / self.devices_per_chip

    # ---- ICI ----------------------------------------------------------- #

    @property
    def wraparound(self) -> Tuple[bool, ...]:
        """Whether each slice axis closes into a ring.

        3D generations (v4, v5p, v7x; tpu8t and tpu8i assumed so) wire an axis into a torus when its
        length is a multiple of 4 (Cloud TPU: full-cube slices are tori); 2D
        ones (v5e, v6e) only on a full 16-chip axis.
        """
        if self.gen.torus_rank == 3:
            return tuple(d >= 4 and d % 4 == 0 for d in self.slice_shape)
        return tuple(d == 16 for d in self.slice_shape)

    @property
    def ici_injection_bw(self) -> float:
        """One-way ICI bandwidth one chip can push into the network, bytes/s.

        Only links along axes longer than 1 are wired.
        """
        links = sum((2 if wrap or d > 2 else 1) for d, wrap in zip(self.slice_shape, self.wraparound) if d > 1)
        return max(1, links) * self.gen.ici_link_bw

    @property
    def bisection_bw(self) -> float:
        """One-way bandwidth across the worst cut of one slice, bytes/s.

        Cutting the longest axis in half severs, for every ring along it, two
        links on a torus and one on a mesh.
        """
        if self.chips_per_slice == 1:
            return math.inf
        i = max(range(len(self.slice_shape)), key=lambda k: self.slice_shape[k])
        rings = self.chips_per_slice // self.slice_shape[i]
        cut_links = 2 if self.wraparound[i] else 1
        return rings * cut_links * self.gen.ici_link_bw

    @property
    def all_to_all_bw_per_chip(self) -> float:
        """Sustained per-chip all-to-all bandwidth inside one slice, bytes/s.

        With P chips each sending B bytes spread evenly, P*B/4 bytes cross the
        bisection each way, so time = B * max(1/injection, P/(4*bisection)).
        """
        p = self.chips_per_slice
        if p == 1:
            return math.inf
        per_byte = max(1.0 / self.ici_injection_bw, p / (4.0 * self.bisection_bw))
        return 1.0 / per_byte

    @property
    def ring_bw_per_chip(self) -> float:
        """Per-chip bandwidth of ring collectives (reduce-scatter, all-gather).

        Multi-axis ring algorithms keep every link busy, so a chip moves data
        at its injection bandwidth.
        """
        return self.ici_injection_bw

    @property
    def torus_diameter(self) -> int:
        return sum((d // 2 if wrap else d - 1) for d, wrap in zip(self.slice_shape, self.wraparound))

    # ---- DCN ----------------------------------------------------------- #

    @property
    def dcn_bw_per_chip(self) -> float:
        return self.gen.dcn_bw_per_chip

    # ---- TorchRec ------------------------------------------------------ #

    @property
    def devices_per_host(self) -> int:
        return min(self.gen.chips_per_host, self.chips_per_slice) * self.devices_per_chip

    def to_torchrec(self, hbm_cap: Optional[int] = None) -> "Topology":  # noqa: F821
        """A TorchRec ``Topology`` with ``compute_device="tpu"``.

        One TorchRec rank is one JAX device, numbered slice-major. TorchRec's
        host (``local_world_size``) is a TPU host, and its "pod"
        (``pod_size`` hosts, the fast-interconnect group ``intra_group_size``)
        is one slice: table-row-wise groups are exactly one slice, and device
        indices in placements stay host-local. Collective bandwidths come from
        :class:`TpuCommsBandwidths`: ICI inside a slice, DCN across slices.

        Args:
            hbm_cap: HBM per device to plan with (default: all of it).

        Returns:
            ``torchrec.distributed.planner.types.Topology``.

        Example::

            trec = TpuTopology.from_name("v5p-128").to_torchrec()
            trec.compute_device  # "tpu"
        """
        # The "tpu" device name torchrec's Topology checks was registered by importing the
        # tpurec package, which Python always does before this module.
        from torchrec.distributed.planner.types import (
            HardwareConfig,
            KernelConfig,
            TopologyFactory,
            TrainerConfig,
        )

        per_ms = 1.0 / 1000.0
        dpc = self.devices_per_chip
        comms = TpuCommsBandwidths(self)
        hardware = HardwareConfig(
            hbm_cap_bytes=hbm_cap if hbm_cap is not None else self.hbm_per_device,
            ddr_cap_bytes=self.ddr_bytes_per_chip // dpc,
            hbm_mem_bw=self.hbm_bw_per_device * per_ms,
            ddr_mem_bw=50e9 * per_ms,
            hbm_to_ddr_mem_bw=32e9 * per_ms,
            intra_host_bw=comms.intra_host_bw,
            inter_host_bw=comms.inter_host_bw,
        )
        trainer = TrainerConfig(
            world_size=self.world_size,
            local_world_size=self.devices_per_host,
            pod_size=self.devices_per_slice // self.devices_per_host,
        )
        kernel = KernelConfig(
            compute_device="tpu",
            use_hardware_based_bandwidth=True,
            generalized_comms_bandwidths=comms,
        )
        return TopologyFactory.create_topology(trainer_config=trainer, hardware_config=hardware, kernel_config=kernel)

    def describe(self) -> Dict[str, object]:
        """Derived figures, for reports and JSON."""
        return {
            "name": self.name,
            "generation": self.gen.name,
            "slice_shape": list(self.slice_shape),
            "num_slices": self.num_slices,
            "chips": self.num_chips,
            "hosts": self.num_hosts,
            "devices": self.world_size,
            "devices_per_chip": self.devices_per_chip,
            "sparsecores_per_device": self.sparsecores_per_device,
            "sparsecore_note": self.sparsecore_note,
            "hbm_gib_per_chip": self.hbm_per_chip / _GiB,
            "hbm_gbps_per_chip": self.gen.hbm_bw_per_chip / 1e9,
            "ici_links_per_chip": self.gen.ici_links_per_chip,
            "ici_link_gbps_one_way": self.gen.ici_link_bw / 1e9,
            "wraparound": list(self.wraparound),
            "bisection_gbps": self.bisection_bw / 1e9 if self.chips_per_slice > 1 else None,
            "all_to_all_gbps_per_chip": self.all_to_all_bw_per_chip / 1e9 if self.chips_per_slice > 1 else None,
            "dcn_gbps_per_chip": self.dcn_bw_per_chip / 1e9,
            "assumptions": self.assumptions,
        }


def _comms_base() -> type:
    from torchrec.distributed.planner.types import GeneralizedCommsBandwidth

    return GeneralizedCommsBandwidth


class TpuCommsBandwidths(_comms_base()):  # type: ignore[misc]
    """TorchRec's comms-bandwidth model for a TPU job (bytes/ms per device).

    A collective among at most one slice's devices runs on ICI at the torus'
    per-chip all-to-all rate; a larger one is bound by DCN. All-reduce uses
    the ring rate.

    Args:
        topology: the TPU job.

    Example::

        bw = TpuCommsBandwidths(TpuTopology.from_name("v5p-128"))
        bw.intra_host_bw  # bytes/ms
    """

    def __init__(self, topology: TpuTopology) -> None:
        self._topo = topology
        dpc = topology.devices_per_chip
        per_ms = 1.0 / 1000.0
        if topology.chips_per_slice > 1:
            self._ici = topology.all_to_all_bw_per_chip / dpc * per_ms
            self._ring = topology.ring_bw_per_chip / dpc * per_ms
        else:
            # One chip: "collectives" stay in HBM.
            self._ici = self._ring = topology.gen.hbm_bw_per_chip / dpc * per_ms
        self._dcn = topology.dcn_bw_per_chip / dpc * per_ms
        self.name = "TpuCommsBandwidths"

    @property
    def intra_host_bw(self) -> float:
        return self._ici

    @property
    def inter_host_bw(self) -> float:
        return self._dcn

    def get_bw(self, local_world_size: int, world_size: int, collective_type: object) -> float:
        from torchrec.distributed.planner.types import CollectiveType

        if world_size > self._topo.devices_per_slice:
            return self._dcn
        if collective_type in (CollectiveType.ALL_REDUCE, CollectiveType.REDUCE_SCATTER, CollectiveType.ALL_GATHER):
            return self._ring
        return self._ici

    def __str__(self) -> str:
        return f"{self.name}: ici={self._ici:.3g} B/ms, dcn={self._dcn:.3g} B/ms"

    def __hash__(self) -> int:
        return hash((self._ici, self._ring, self._dcn, self._topo.devices_per_slice))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, TpuCommsBandwidths) and hash(self) == hash(other)
