"""Module paths of older tpurec releases, resolved when imported: the one place that keeps them working.

Before the runtime moved to ``tpurec.core``, its modules lived at ``tpurec.tensor``,
``tpurec.runtime``, ... A checkpoint written then names them: a tpu tensor pickled as
``tpurec.tensor._rebuild_tpu_tensor(values, device, requires_grad)``. ``pickle`` (and
``torch.load(..., weights_only=False)``) resolves such a name by importing
``tpurec.tensor``, so those paths stay importable, through a finder on ``sys.meta_path``
(``torch.load``'s default ``weights_only=True`` needs no import: the rebuild function is
registered as a safe global under its old name too).

Nothing is registered in ``sys.modules`` or on the ``tpurec`` package until something
imports an old path; then it is a small read-only module whose attributes are the
classes and functions of the ``tpurec.core`` module (the globals a pickle can name).
Its other names raise an error that says where they are now: code should use the
public ``tpurec`` API.

Modules that moved to the package of their kind (``tpurec.composites`` is an op family of
``tpurec.dense``) keep their old path for code as well (``MOVED``): importing it gives the
module itself, under its new name.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import inspect
import sys
import types
from collections.abc import Sequence
from typing import Any

__all__ = ["MOVED", "OLD_PATHS", "install"]

# Old path -> the module it became.
OLD_PATHS: dict[str, str] = {
    f"tpurec.{name}": f"tpurec.core.{name}"
    for name in (
        "device",
        "dispatch",
        "errors",
        "fused",
        "memory",
        "modes",
        "recompiles",
        "rng",
        "runtime",
        "tensor",
        "views",
    )
}


# Old path -> the module it became, for code: the old path imports the module itself.
MOVED: dict[str, str] = {
    "tpurec.composites": "tpurec.dense.composites",
    "tpurec._dynamo": "tpurec.compile.dynamo",
    # TorchRec's DistributedModelParallel on tpu: one package.
    "tpurec.distributed.torchrec_dp": "tpurec.dmp.dense_kernel",
    "tpurec.distributed.torchrec_fused": "tpurec.dmp.grouped_lookups",
    "tpurec.distributed.torchrec_plan": "tpurec.dmp.placements",
    "tpurec.distributed.torchrec_tables": "tpurec.dmp.unfused_tables",
    "tpurec.sparse.torchrec_fused": "tpurec.dmp.fused_kernel",
    "tpurec.sparse.torchrec_ops": "tpurec.dmp.lookup_ops",
    # What a sharding plan says (the package named for it), and batches on a mesh.
    "tpurec.sparse.spec": "tpurec.sparse.sharding_plan",
    "tpurec.sparse.spec.layout": "tpurec.sparse.sharding_plan.layout",
    "tpurec.sparse.spec.sharding_types": "tpurec.sparse.sharding_plan.sharding_types",
    "tpurec.sparse.spec.shards": "tpurec.sparse.sharding_plan.shards",
    "tpurec.sparse.spec.tables": "tpurec.sparse.sharding_plan.tables",
    "tpurec.sparse.spec.traffic": "tpurec.sparse.sharding_plan.traffic",
    "tpurec.sparse.spec.validate": "tpurec.sparse.sharding_plan.validate",
    "tpurec.sparse.spec.batch": "tpurec.sparse.mesh_batches",
    "tpurec.sparse.spec.mesh": "tpurec.sparse.mesh_batches",
    "tpurec.sparse.sharding.layout": "tpurec.sparse.sharding_plan.layout",
    "tpurec.sparse.sharding.specs": "tpurec.sparse.sharding_plan.shards",
    "tpurec.sparse.planner.comms": "tpurec.sparse.sharding_plan.traffic",
    # Checkpoints, unsharded and sharded, in one package.
    "tpurec.sparse.sharding.checkpoint": "tpurec.sparse.checkpoint.sharded",
}


class OldPath(types.ModuleType):
    """An old module path: the classes and functions of the module it became, read-only."""

    def __init__(self, name: str, target: str) -> None:
        super().__init__(name, f"Old path of {target}, kept so that checkpoints naming it load.")
        object.__setattr__(self, "_target", target)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):  # import machinery probes (__path__, __file__, ...)
            raise AttributeError(name)
        target = importlib.import_module(object.__getattribute__(self, "_target"))
        value = getattr(target, name, None)
        # What a pickle can name: a class or function defined in that module (under
        # its new path, or its old one as the checkpoints of older releases wrote it).
        defined_here = getattr(value, "__module__", None) in (target.__name__, self.__name__)
        if (inspect.isclass(value) or inspect.isroutine(value)) and defined_here:
            return value
        raise AttributeError(
            f"{self.__name__} is an old module path, kept only so that checkpoints naming it load; "
            f"{name!r} is not a class or function of {target.__name__}. Use the public tpurec API "
            f"(e.g. tpurec.stats, tpurec.synchronize, tpurec.flush) or {target.__name__}.{name}."
        )

    def __setattr__(self, name: str, value: Any) -> None:
        if name.startswith("__"):  # set by the import system when the module is made
            object.__setattr__(self, name, value)
            return
        raise AttributeError(
            f"{self.__name__} is a read-only old module path; set {name!r} on "
            f"{object.__getattribute__(self, '_target')} instead"
        )


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds the old paths (only those) and makes each an :class:`OldPath` module."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: types.ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in OLD_PATHS and fullname not in MOVED:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType | None:
        if spec.name in MOVED:
            return None  # the default module: exec_module puts the moved one in its place
        return OldPath(spec.name, OLD_PATHS[spec.name])

    def exec_module(self, module: types.ModuleType) -> None:
        # An old checkpoint path: nothing to run, attributes are looked up in the new module on
        # access. A moved module: the import system returns what sys.modules holds under the
        # name once this returns, so the old path is the moved module itself.
        if module.__name__ in MOVED:
            sys.modules[module.__name__] = importlib.import_module(MOVED[module.__name__])


def install() -> None:
    """Makes the old paths importable (once per process).

    The finder goes first: an old path's parent may be a moved package (``tpurec.sparse.spec``
    is ``tpurec.sparse.sharding_plan``), whose folder the path finder would search for the child
    and load its file a second time, as another module. It answers only the names of its
    tables, and none of them is a file.
    """
    if not any(isinstance(finder, _Finder) for finder in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
