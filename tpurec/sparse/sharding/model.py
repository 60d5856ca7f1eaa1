"""``tpurec.shard``: a model's embeddings sharded by a plan, its dense part data-parallel.

Example::

    import tpurec, tpurec.sparse as sparse
    model = sparse.from_torchrec(torchrec_dlrm, capacities=sparse.Capacity(1024)).to("tpu")
    model = tpurec.shard(model, plan)          # all tpu devices, one mesh axis
    loss = loss_fn(model(dense, kjt), labels)  # batch split over the devices
    loss.backward(); optimizer.step()          # XLA all-reduces the dense gradients
"""

from __future__ import annotations

import warnings

from typing import Any, Literal, cast

import jax
import numpy as np
import torch
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from torch import nn

from torchrec.modules.mc_modules import ManagedCollisionCollection as TorchrecMCC

from tpurec.sparse.managed import ManagedCollisionEmbeddingBagCollection, ManagedCollisionEmbeddingCollection
from tpurec.sparse.modules import EmbeddingBagCollection
from tpurec.sparse.quant import QuantEmbeddingBagCollection
from tpurec.sparse.optimizers import EmbeddingOptimizer, optimizer_from_torch
from tpurec.sparse.sequence import EmbeddingCollection
from tpurec.sparse.sharding.ebc import ShardedEmbeddingBagCollection
from tpurec.sparse.sharding.managed import (
    ShardedManagedCollisionEmbeddingBagCollection,
    ShardedManagedCollisionEmbeddingCollection,
)
from tpurec.sparse.sharding.managed import check_shardable as check_managed
from tpurec.sparse.sharding.quant import ShardedQuantEmbeddingBagCollection, check_quant_shardings, mean_row_wise_tables
from tpurec.sparse.sharding.fingerprint import agree_on_model, model_fingerprint
from tpurec.sparse.mesh_batches import map_batch
from tpurec.sparse.mesh_batches import batch_sharded_array, local_device_count
from tpurec.sparse.sharding_plan.shards import TableSharding, module_plans, table_shardings
from tpurec.sparse.table_init import check_rows_fit, table_init, table_key
from tpurec.core import TpuTensor, host_array, is_global, mesh_arrays_in_use, replace_array, wrap

__all__ = ["shard", "batch_sharded_array", "default_mesh", "distribute_batch", "local_device_count", "replicate"]


def default_mesh() -> Mesh:
    """All devices of every process on one mesh axis named ``"devices"``, ordered by process."""
    devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    return Mesh(np.array(devices), ("devices",))


def distribute_batch(tensor: torch.Tensor, mesh: Mesh) -> torch.Tensor:
    """This process's batch ``tensor`` as a global batch-sharded tpu tensor.

    The first dim is the batch; each process passes its own samples, which are
    split evenly over its devices (in one process: the whole batch over the mesh).

    Args:
        tensor: a CPU or tpu tensor ``[local batch, ...]``.
        mesh: the mesh the model was sharded on.

    Returns:
        A tpu tensor ``[global batch, ...]`` sharded on its first dim.
    """
    if is_global(tensor):
        return tensor
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"expected a tensor, got {type(tensor).__name__}")
    local_devices = local_device_count(mesh)
    if tensor.dim() == 0 or tensor.shape[0] % local_devices:
        raise ValueError(
            f"a batch tensor of shape {tuple(tensor.shape)} does not split evenly over this process's "
            f"{local_devices} devices; its first dim must be a multiple of {local_devices}"
        )
    return wrap(batch_sharded_array(host_array(tensor.detach().cpu()), mesh), 0, tensor.dtype)


def replicate(tensor: torch.Tensor, mesh: Mesh) -> None:
    """Makes tpu tensor ``tensor`` hold a copy of its values on every mesh device (in place)."""
    from tpurec.core import value_of

    if is_global(tensor):
        return
    if not isinstance(tensor, TpuTensor) or not tensor.is_full:
        raise ValueError(
            "only whole tpu tensors (not views) can be replicated onto a mesh; move the model to 'tpu' first"
        )
    value = value_of(tensor, "replicate onto the mesh")
    sharding = NamedSharding(mesh, P())
    if jax.process_count() == 1:
        replace_array(tensor, jax.device_put(value, sharding))
    else:
        host = np.asarray(value)
        replace_array(tensor, jax.make_array_from_callback(host.shape, sharding, lambda index: host[index]))


def _check_mesh(mesh: Any) -> None:
    if not isinstance(mesh, Mesh):
        raise TypeError(f"mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}")
    known = set(jax.devices())
    strangers = [d for d in mesh.devices.flat if d not in known]
    if strangers:
        raise ValueError(f"mesh devices {strangers} are not devices of the tpu platform ({jax.default_backend()})")


def planning_topology(num_devices: int, device: Any = None) -> str:
    """The topology name a plan for ``num_devices`` devices like ``device`` is made for, e.g. ``"v5e-8"``.

    Args:
        num_devices: the devices the plan spreads over.
        device: a JAX device of the run (default: the first one); its kind picks the generation
            (:func:`planning_generation`).

    Raises:
        ValueError: ``num_devices`` is not a whole number of chips of a generation that shows
            several JAX devices a chip (v7x: 2), which no topology of that generation has.
    """
    from tpurec.sparse.planner.topology import TPU_GENERATIONS

    device = jax.devices()[0] if device is None else device
    generation = TPU_GENERATIONS[planning_generation(device)]
    if num_devices % generation.devices_per_chip:
        raise ValueError(
            f"{num_devices} device(s) of {getattr(device, 'device_kind', generation.name)!r} are not whole chips: "
            f"a {generation.name} chip shows {generation.devices_per_chip} JAX devices, and a plan is made for "
            f"whole chips; use a multiple of {generation.devices_per_chip} devices, or make a plan with "
            f"`tpurec plan --topology` and pass it"
        )
    # Accelerator names count TensorCores on v4/v5p/v7x (two per chip), chips elsewhere.
    chips = -(-num_devices // generation.devices_per_chip)
    return f"{generation.name}-{chips * 2 if generation.name_counts_cores else chips}"


def planning_generation(device: Any) -> str:
    """The TPU generation a plan for ``device`` is made for (the planner's table of device kinds).

    A TPU of a kind not in the table plans as v5p with a warning naming the kind; a device that is
    no TPU (XLA:CPU in tests) plans as v5p, the generation the SparseCore layout is tested on.
    """
    from tpurec.sparse.planner.topology import generation_of_device_kind

    kind = str(getattr(device, "device_kind", ""))
    generation = generation_of_device_kind(kind)
    if generation is not None:
        return generation.name
    if getattr(device, "platform", "") == "tpu":
        warnings.warn(
            f"tpurec.shard: the TPU device kind {kind!r} is not in tpurec's table of chips "
            "(tpurec.sparse.planner.topology.DEVICE_KINDS); planning as v5p. Pass a plan made with "
            "`tpurec plan --topology <generation>-<size>` to plan for the right chip.",
            stacklevel=3,
        )
    return "v5p"


def _planned(owner: nn.Module, ebc: EmbeddingBagCollection, mesh: Mesh, batch_size: int) -> Any:
    """A plan from the TPU planner for ``ebc`` (held by ``owner``) on a topology with the mesh's device count.

    A sequence collection is planned as TorchRec's ``EmbeddingCollection`` (the
    planner's ``TpuEmbeddingCollectionSharder``: DP, TW, CW, RW), a pooled one as
    an ``EmbeddingBagCollection``, row-wise only behind a managed-collision remap.
    """
    from torchrec.modules.embedding_modules import EmbeddingCollection as TorchrecEC

    from tpurec.sparse.planner import plan as tpu_plan

    devices = mesh.devices.size
    name = planning_topology(devices, mesh.devices.flat[0])
    constraints = None
    sequence = owner._embedding_module if isinstance(owner, ManagedCollisionEmbeddingCollection) else owner
    if isinstance(sequence, EmbeddingCollection):
        tables: Any = TorchrecEC(sequence.embedding_configs(), device=torch.device("meta"))
    else:
        tables = ebc.embedding_bag_configs()
    if isinstance(owner, (ManagedCollisionEmbeddingBagCollection, ManagedCollisionEmbeddingCollection)):
        # TorchRec shards managed-collision tables row-wise only.
        from torchrec.distributed.planner.types import ParameterConstraints
        from torchrec.distributed.types import ShardingType

        row_wise = [ShardingType.ROW_WISE.value]
        constraints = {c.name: ParameterConstraints(sharding_types=row_wise) for c in ebc.embedding_bag_configs()}
    result, _report = tpu_plan(tables, name, batch_size=batch_size, constraints=constraints)
    return module_plans(result)[""]


def _managed_owners(model: nn.Module) -> dict[str, nn.Module]:
    """Every tpurec managed-collision EBC / EC of ``model`` (path -> module), sharded with its collection.

    Raises:
        NotImplementedError: a managed-collision collection on its own (not in an EBC / EC) or a
            model spread over processes.
    """
    from tpurec.sparse.managed import remapped_features

    kinds = (ManagedCollisionEmbeddingBagCollection, ManagedCollisionEmbeddingCollection)
    owners: dict[str, nn.Module] = {p: m for p, m in model.named_modules() if isinstance(m, kinds)}
    if not remapped_features(model):
        return owners
    inner = {id(m._managed_collision_collection) for m in owners.values()}
    alone = [p for p, m in model.named_modules() if isinstance(m, TorchrecMCC) and id(m) not in inner]
    if alone:
        raise NotImplementedError(
            f"tpurec.shard cannot shard the managed-collision collections {alone} on their own (not inside a "
            "ManagedCollisionEmbeddingBagCollection or ManagedCollisionEmbeddingCollection): TorchRec's "
            "ManagedCollisionCollectionSharder has no standalone sharding either. Wrap the collection and its "
            "tables in a managed-collision embedding collection."
        )
    if owners and jax.process_count() > 1:
        raise NotImplementedError(
            f"tpurec.shard cannot shard the managed-collision collections {sorted(owners)} over several processes "
            "yet: their remap runs on one host, which would need every process's ids. Shard it in one process."
        )
    return owners


def _managed_bags_path(path: str, module: nn.Module) -> str:
    """The path of the pooled collection behind managed-collision module ``module`` at ``path``."""
    inner = (
        "_embedding_module._bags" if isinstance(module, ManagedCollisionEmbeddingCollection) else "_embedding_module"
    )
    return f"{path}.{inner}" if path else inner


def _refuse_unshardable(model: nn.Module) -> None:
    """Raises for the embedding modules of ``model`` that tpurec.shard cannot shard as TorchRec would.

    Left in the model they would be replicated as its dense part, which is not what TorchRec's
    sharded modules compute: TorchRec's own modules that ``from_torchrec`` keeps for FP16/BF16
    tables (TorchRec's DMP trains those with FBGEMM's fused kernels).
    """
    from tpurec.sparse.convert import TorchrecEmbeddingBagCollectionOnDevice, TorchrecEmbeddingCollectionOnDevice

    for path, module in model.named_modules():
        where = f"{type(module).__name__} at {path!r}"
        if isinstance(module, (TorchrecEmbeddingBagCollectionOnDevice, TorchrecEmbeddingCollectionOnDevice)):
            configs = (
                module.embedding_bag_configs()
                if isinstance(module, TorchrecEmbeddingBagCollectionOnDevice)
                else module.embedding_configs()
            )
            tables = ", ".join(f"{c.name} ({c.data_type.name})" for c in configs)
            raise NotImplementedError(
                f"tpurec.shard cannot shard TorchRec's module with FP16/BF16 tables that from_torchrec keeps as it "
                f"is ({where}, tables {tables}): TorchRec's DistributedModelParallel trains such tables with "
                "FBGEMM's fused kernels, which this module's float16 lookups and dense updates are not. Use FP32 "
                "tables (data_type=DataType.FP32), build tpurec's EmbeddingBagCollection with the FP16/BF16 tables "
                "(it shards and trains as FBGEMM's TBE), or train the model unsharded (model.to('tpu'))."
            )


def _quantized_collections(model: nn.Module) -> dict[str, QuantEmbeddingBagCollection]:
    """Every quantized inference collection of ``model`` (path -> module), sharded for inference."""
    return {path: m for path, m in model.named_modules() if isinstance(m, QuantEmbeddingBagCollection)}


def _planned_table_wise(qebc: QuantEmbeddingBagCollection, mesh: Mesh, batch_size: int) -> Any:
    """A table-wise plan of a quantized collection from the TPU planner (TorchRec's
    ``shard_quant_model`` default: table-wise constraints on every table)."""
    from torchrec.distributed.planner.types import ParameterConstraints
    from torchrec.distributed.types import ShardingType

    from tpurec.sparse.planner import plan as tpu_plan

    name = planning_topology(mesh.devices.size, mesh.devices.flat[0])
    configs = qebc.embedding_bag_configs()
    constraints = {c.name: ParameterConstraints(sharding_types=[ShardingType.TABLE_WISE.value]) for c in configs}
    result, _report = tpu_plan(configs, name, batch_size=batch_size, constraints=constraints)
    return module_plans(result)[""]


def _collections(model: nn.Module) -> dict[str, tuple[str, nn.Module]]:
    """Every tpurec ``EmbeddingBagCollection`` of ``model``: its path -> (its plan path, the module owning it).

    TorchRec plans a sequence ``EmbeddingCollection`` and a
    ``FeatureProcessedEmbeddingBagCollection`` at their own paths; in tpurec
    both hold an inner ``EmbeddingBagCollection`` (``<path>._bags``,
    ``<path>._embedding_bag_collection``) that runs the lookups, and that inner
    collection is what gets sharded. Its plan path is the owner's (TorchRec's);
    a plain collection is its own owner. A managed-collision module owns the
    collection behind its remap (``<path>._embedding_module``).
    """
    from torchrec.modules.fp_embedding_modules import FeatureProcessedEmbeddingBagCollection

    modules = dict(model.named_modules())
    found: dict[str, tuple[str, nn.Module]] = {}
    for path, module in modules.items():
        if not isinstance(module, EmbeddingBagCollection):
            continue
        parent_path, _, name = path.rpartition(".")
        parent = modules[parent_path]
        wrapped = (isinstance(parent, EmbeddingCollection) and name == "_bags") or (
            isinstance(parent, FeatureProcessedEmbeddingBagCollection) and name == "_embedding_bag_collection"
        )
        owner_path, owner = (parent_path, parent) if wrapped else (path, module)
        # Behind a managed-collision remap the plan names the managed-collision module (TorchRec's sharder's).
        managed_path, _, attr = owner_path.rpartition(".")
        managed = modules.get(managed_path) if owner_path else None
        kinds = (ManagedCollisionEmbeddingBagCollection, ManagedCollisionEmbeddingCollection)
        if attr == "_embedding_module" and isinstance(managed, kinds):
            owner_path, owner = managed_path, managed
        found[path] = (owner_path, owner)
    return found


def _move_to_tpu(model: nn.Module, moving: set[int]) -> None:
    """Moves the host parameters and buffers whose ids are in ``moving`` to ``tpu``, in their modules.

    Only those: the sharded collections' global arrays are left alone (a
    ``model.to("tpu")`` would copy them off the mesh).
    """
    for module in model.modules():
        # In place in the module's own dicts, as nn.Module._apply moves them.
        parameters: dict[str, Any] = vars(module)["_parameters"]
        buffers: dict[str, Any] = vars(module)["_buffers"]
        for name, param in list(parameters.items()):
            if param is not None and id(param) in moving:
                parameters[name] = nn.Parameter(param.detach().to("tpu"), requires_grad=param.requires_grad)
        for name, buffer in list(buffers.items()):
            if buffer is not None and id(buffer) in moving:
                buffers[name] = buffer.to("tpu")


def shard(
    model: nn.Module,
    plan: Any = None,
    mesh: Mesh | None = None,
    *,
    optimizer: EmbeddingOptimizer | type | None = None,
    optimizer_kwargs: dict[str, Any] | None = None,
    capacity: int | None = None,
    overflow: Literal["error", "drop"] = "error",
    planner_batch_size: int = 4096,
    seed: int = 0,
) -> nn.Module:
    """Shards every tpurec embedding collection of ``model`` and makes the rest data-parallel.

    Embedding tables and their optimizer slots become sharded global arrays laid
    out as the plan says; the ids of each step travel to their shards and the
    pooled rows back with collectives inside one SPMD program. Every other
    parameter and buffer is replicated on the mesh; tensor arguments of
    ``model``'s forward (also inside tuples, lists, dicts and dataclasses such
    as torchrec's ``Batch``) are split over the mesh along their first (batch) dim,
    so XLA partitions the dense layers and all-reduces their gradients.

    Args:
        model: a model on ``tpu`` holding tpurec ``EmbeddingBagCollection`` s
            or sequence ``EmbeddingCollection`` s (e.g. from
            ``tpurec.sparse.from_torchrec(...).to("tpu")``), or one such
            collection. Their tables may be on ``meta`` (``from_torchrec(model,
            device="meta")`` of TorchRec modules built on ``meta``, or
            ``EmbeddingBagCollection(..., device="meta")``): then each shard is
            created on its own device, no process ever holds a whole table, and
            the rest of the model, on ``tpu`` or the host, is moved to ``tpu``
            (as TorchRec's ``DistributedModelParallel`` moves the dense part). A sequence collection keeps its module (its output is
            unstacked from the sharded lookup of its one-id bags); its inner
            ``_bags`` collection becomes the sharded one. A quantized inference
            collection (:class:`~tpurec.sparse.QuantEmbeddingBagCollection`) becomes a
            :class:`~tpurec.sparse.sharding.quant.ShardedQuantEmbeddingBagCollection`
            (table-wise, row-wise or column-wise, as TorchRec's quantized sharder; its
            lookups compute what TorchRec's sharded inference computes). A
            managed-collision EBC / EC (:mod:`tpurec.sparse.managed`, planned at its own
            path, row-wise) becomes a sharded one
            (:mod:`tpurec.sparse.sharding.managed`: one remap per row-wise shard, evicted
            rows reset, as TorchRec's sharded modules).
        plan: a torchrec ``ShardingPlan`` (module path -> table plans, e.g. from
            ``EmbeddingShardingPlanner``, ``construct_module_sharding_plan`` or
            ``tpurec.sparse.planner.load_plan``), or one module's table plan.
            An ``EmbeddingCollection`` or ``FeatureProcessedEmbeddingBagCollection``
            is named by its own path, as TorchRec plans it. None asks the TPU
            planner (table-wise for quantized collections, as TorchRec's
            ``shard_quant_model`` does by default).
        mesh: a ``jax.sharding.Mesh``; plan rank ``r`` is ``mesh.devices.flat[r]``.
            Default: every device, ordered by process.
        optimizer: a fused embedding optimizer replacing the collections' own
            (FBGEMM's semantics: one update per lookup, see docs/torchrec_semantics.md). Its
            slots start at zero, or at the module's where its optimizer has the same slots.
            Quantized collections keep none (a model with only those refuses one).
        optimizer_kwargs: its keyword arguments when ``optimizer`` is a torch class.
        capacity: entries a device may send one shard per step (None: grow on demand).
        overflow: ``"error"`` or ``"drop"`` when a batch exceeds ``capacity``.
        planner_batch_size: global batch size the planner assumes (``plan=None``).
        seed: for collections whose tables are on ``meta``: every shard is born
            on its own device from ``(seed, table name, row, column)``, so no
            process holds a whole table and the same seed gives the same tables
            under any plan or mesh (the config's distribution, see
            :mod:`tpurec.sparse.table_init`); optimizer slots start at zero. Every
            process must pass the same seed. Unused for tables with values.

    Returns:
        ``model`` with its collections replaced by :class:`ShardedEmbeddingBagCollection`
        (or ``ShardedQuantEmbeddingBagCollection``; the sharded collection itself when
        ``model`` is one).

    Raises:
        ValueError, TypeError: a bad plan, mesh or seed; raised before anything changes.
        NotImplementedError: a table on ``meta`` whose ``init_fn`` cannot be applied
            shard by shard (see :func:`tpurec.sparse.table_init.table_init`), or a
            managed-collision remap it does not shard (see docs/sharding.md);
            raised before anything changes.
        tpurec.distributed.PeerMismatch: (several processes) the processes' models, plans or
            arguments differ; every process raises it, naming the first difference.

    Example::

        plan = construct_module_sharding_plan(torchrec_ebc, {"t0": table_wise(rank=0), "t1": row_wise()},
                                              local_size=8, world_size=8, device_type="tpu")
        sharded = tpurec.shard(model, {"sparse_arch.embedding_bag_collection": plan})
    """
    mesh = default_mesh() if mesh is None else mesh
    _check_mesh(mesh)
    _refuse_unshardable(model)
    owners = _collections(model)
    ebcs = {path: model.get_submodule(path) for path in owners}
    quants = _quantized_collections(model)
    if not ebcs and not quants:
        raise ValueError(
            "the model has no tpurec EmbeddingBagCollection, EmbeddingCollection or QuantEmbeddingBagCollection to "
            "shard (convert it with tpurec.sparse.from_torchrec)"
        )
    managed = _managed_owners(model)
    for path, ebc in ebcs.items():
        if ebc.device.type not in ("tpu", "meta"):
            raise ValueError(
                f"EmbeddingBagCollection '{path}' is on {ebc.device}; move the model to 'tpu' first (or build its "
                "tables on 'meta' for tpurec.shard to create each shard on its device)"
            )
    for path, qebc in quants.items():
        if qebc.device.type != "tpu":
            raise ValueError(
                f"QuantEmbeddingBagCollection '{path}' is on {qebc.device}; move the model to 'tpu' first (its "
                "quantized rows are copied onto their shards)"
            )
    if quants and not ebcs and optimizer is not None:
        raise ValueError(
            f"optimizer= trains embedding tables, but the model's collections {sorted(quants)} are quantized "
            "inference collections, which nothing trains (TorchRec's quantized modules have no optimizer either). "
            "Leave optimizer out."
        )
    born = [path for path, ebc in ebcs.items() if ebc.device.type == "meta"]
    for path in born:
        # Every table born on meta must be creatable shard by shard: refuse before anything changes.
        collection = ebcs[path]
        assert isinstance(collection, EmbeddingBagCollection)  # what _collections finds
        table_key(seed, "")
        check_rows_fit(collection.embedding_bag_configs())
        for cfg in collection.embedding_bag_configs():
            table_init(cfg)
    embedding_optimizer = None if optimizer is None else optimizer_from_torch(optimizer, optimizer_kwargs)

    # Every check first: a bad plan must leave the model untouched.
    if plan is None:
        per_module = {path: _planned(owners[path][1], ebc, mesh, planner_batch_size) for path, ebc in ebcs.items()}
        per_quant = {path: _planned_table_wise(qebc, mesh, planner_batch_size) for path, qebc in quants.items()}
    else:
        given = module_plans(plan)
        # A plan names a collection by its owner's path (TorchRec's) or, for a
        # wrapped one, by the inner collection's path: one entry each.
        by_plan_path = {owners[path][0]: path for path in ebcs}
        known = set(by_plan_path) | set(ebcs) | set(quants)
        strangers = [path for path in given if path not in known]
        if strangers:
            raise ValueError(
                f"the plan names modules {strangers} that are not tpurec EmbeddingBagCollections, "
                f"EmbeddingCollections or QuantEmbeddingBagCollections of the model (they are: "
                f"{sorted(set(by_plan_path) | set(quants))})"
            )
        missing = [path for path in quants if path not in given]
        if missing:
            raise ValueError(f"the plan has no entry for the quantized collections {missing} of the model")
        per_quant = {path: given[path] for path in quants}
        twice = [path for path in ebcs if owners[path][0] != path and path in given and owners[path][0] in given]
        if twice:
            raise ValueError(
                f"the plan names the collections {twice} twice (also by their owners' paths "
                f"{[owners[p][0] for p in twice]}); give one entry per collection"
            )
        per_module = {}
        for path in ebcs:
            entry = given.get(owners[path][0], given.get(path))
            if entry is not None:
                per_module[path] = entry
        unplanned = [owners[path][0] for path in ebcs if path not in per_module]
        if unplanned:
            raise ValueError(f"the plan has no entry for the embedding collections {unplanned} of the model")
    specs: dict[str, dict[str, TableSharding]] = {
        path: table_shardings(ebcs[path].embedding_bag_configs(), per_module[path], mesh.devices.size) for path in ebcs
    }
    quant_specs: dict[str, dict[str, TableSharding]] = {}
    for path, qebc in quants.items():
        configs = qebc.embedding_bag_configs()
        quant_specs[path] = table_shardings(configs, per_quant[path], mesh.devices.size)
        check_quant_shardings(f"QuantEmbeddingBagCollection at {path!r}", configs, quant_specs[path])
    managed_inner = {path: _managed_bags_path(path, module) for path, module in managed.items()}
    for path, inner in managed_inner.items():
        check_managed(repr(path), ebcs[inner], specs[inner], mesh.devices.size)
    collections = [*ebcs.values(), *quants.values()]
    inside = {id(p) for c in collections for p in c.parameters()} | {id(b) for c in collections for b in c.buffers()}
    # The remapping state stays on the host (tpurec.sparse.managed): not part of the dense model.
    inside |= {id(b) for m in managed.values() for b in m.get_submodule("_managed_collision_collection").buffers()}
    dense = [t for t in list(model.parameters()) + list(model.buffers()) if id(t) not in inside]
    # With tables on meta the rest of the model may still be on the host: it moves to tpu
    # below, as TorchRec's DMP moves a model's dense part to its device.
    allowed = ("tpu", "cpu") if born else ("tpu",)
    off_device = [(tuple(t.shape), t.device.type) for t in dense if t.device.type not in allowed]
    if off_device:
        hint = (
            " (a model with tables on 'meta' may have its dense part on the host or 'tpu', not 'meta')" if born else ""
        )
        raise ValueError(
            f"parameters/buffers of shapes and devices {off_device} are not on 'tpu'; move the model to 'tpu' "
            f"first{hint}"
        )
    if jax.process_count() > 1:
        # Before anything changes or any collective runs: every process must shard the same model alike.
        named = [(n, t) for n, t in list(model.named_parameters()) + list(model.named_buffers()) if id(t) not in inside]
        agree_on_model(
            model_fingerprint(
                {**ebcs, **quants}, {**specs, **quant_specs}, named, mesh_shape=tuple(mesh.devices.shape),
                capacity=capacity, overflow=overflow, optimizer=embedding_optimizer, seed=seed if born else None,
            )
        )  # fmt: skip

    sharded: dict[str, nn.Module] = {}
    for path, qebc in quants.items():
        averaged = mean_row_wise_tables(qebc.embedding_bag_configs(), quant_specs[path])
        if averaged:
            warnings.warn(
                f"tpurec.shard: the row-wise MEAN tables {averaged} of the quantized collection at {path!r} average "
                "the ids each row shard holds and sum the shards' means, as TorchRec's sharded inference does; the "
                "unsharded module averages each whole bag. Plan them table-wise or column-wise to keep the bag's mean.",
                stacklevel=2,
            )
        sharded[path] = ShardedQuantEmbeddingBagCollection(
            qebc, quant_specs[path], mesh, capacity=capacity, overflow=overflow
        )
    for path, ebc in ebcs.items():
        # The slots of an optimizer given here start at zero where the module holds other ones
        # (an inference module holds none).
        zero_slots = False
        if embedding_optimizer is not None:
            held = cast(EmbeddingOptimizer | None, ebc.optimizer)
            zero_slots = held is None or dict(held.slots) != dict(embedding_optimizer.slots)
            ebc.optimizer = embedding_optimizer
        new_ebc = ShardedEmbeddingBagCollection(
            ebc, specs[path], mesh, capacity=capacity, overflow=overflow, seed=seed, zero_slots=zero_slots
        )
        if embedding_optimizer is not None:
            # An explicit fused optimizer updates once per lookup, as FBGEMM's kernels do.
            new_ebc.optimizer_semantics = "fbgemm"
        sharded[path] = new_ebc
    if "" in sharded:
        return sharded[""]
    for path, new in sharded.items():
        parent_path, _, name = path.rpartition(".")
        setattr(model.get_submodule(parent_path), name, new)
    for path, module in managed.items():
        table_specs = specs[managed_inner[path]]
        sharded_mc: nn.Module
        if isinstance(module, ManagedCollisionEmbeddingCollection):
            sequence = module.get_submodule("_embedding_module")  # its _bags now sharded
            sharded_mc = ShardedManagedCollisionEmbeddingCollection(module, sequence, table_specs, mesh.devices.size)
        else:
            sharded_ebc = cast(ShardedEmbeddingBagCollection, sharded[managed_inner[path]])
            sharded_mc = ShardedManagedCollisionEmbeddingBagCollection(
                cast(ManagedCollisionEmbeddingBagCollection, module), sharded_ebc, table_specs, mesh.devices.size
            )
        if not path:
            mesh_arrays_in_use()
            return sharded_mc
        parent_path, _, name = path.rpartition(".")
        setattr(model.get_submodule(parent_path), name, sharded_mc)
    mesh_arrays_in_use()
    if born:
        _move_to_tpu(model, {id(t) for t in dense if t.device.type == "cpu"})
        dense = [t for t in list(model.parameters()) + list(model.buffers()) if id(t) not in inside]
    for t in dense:
        replicate(t, mesh)

    # Host-side placement: never traced by torch.compile (it reads tensors on the host).
    @torch.compiler.disable
    def split_batch(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        # Tensors inside containers too (e.g. torchrec's Batch for a DLRMTrain model);
        # KeyedJaggedTensors stay on the host (the sharded collections route them).
        place = lambda x: map_batch(x, lambda t: distribute_batch(t, mesh), lambda kjt: kjt)  # noqa: E731
        return tuple(place(a) for a in args), {k: place(v) for k, v in kwargs.items()}

    model.register_forward_pre_hook(split_batch, with_kwargs=True)
    # For users (e.g. distribute_batch(labels, model.mesh)); tpurec itself asks the sharded
    # collections (tpurec.sparse.mesh_batches.mesh_of).
    model.mesh = mesh
    return model
