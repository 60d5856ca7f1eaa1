"""The runtime core is layered: each tpurec/core module imports only the modules below it.

``tpurec.core.LAYERS`` declares the order (lowest first). The check reads every import
of every core module with ``ast``: module level, inside functions and classes, and
``importlib.import_module("tpurec...")`` calls, since an import hidden in a function
to dodge a cycle is still a cycle. Outside the core, a core module may import only the
foundation modules below it (``tpurec.dense``, ``tpurec.amp``),
and those must import nothing of tpurec but each other.
"""

from __future__ import annotations

import ast
import importlib
import io
import os
import pathlib
import pickle
import pickletools
import subprocess
import sys
import types
from typing import Sequence

import pytest
import torch

import tpurec
import tpurec.core
from tpurec.core import tensor as core_tensor

PACKAGE_ROOT = pathlib.Path(tpurec.__file__).parent
CORE_DIR = PACKAGE_ROOT / "core"
# Modules outside the core that the core may import: they sit below it.
FOUNDATION = ("tpurec.config", "tpurec.dense", "tpurec.amp", "tpurec.cache", "tpurec.native")


def _type_checking_only(tree: ast.AST) -> set[int]:
    """Ids of the nodes under ``if TYPE_CHECKING:`` (never run, so they import nothing at run time)."""
    skipped: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and (
            (isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING")
            or (isinstance(node.test, ast.Attribute) and node.test.attr == "TYPE_CHECKING")
        ):
            skipped.update(id(n) for child in node.body for n in ast.walk(child))
    return skipped


def _string_constants(tree: ast.Module) -> dict[str, str]:
    """The module-level ``NAME = "text"`` assignments of a module (a module path kept in a constant)."""
    constants: dict[str, str] = {}
    for node in tree.body:
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and isinstance(node.value, ast.Constant):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                if isinstance(target, ast.Name) and isinstance(node.value.value, str):
                    constants[target.id] = node.value.value
    return constants


def _import_call_argument(node: ast.Call, constants: dict[str, str]) -> str | None:
    """The module an ``importlib.import_module``/``__import__`` call names, where the source says
    it: a literal, or a module-level string constant. None for another call or a computed name."""
    called = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
    if called not in ("import_module", "__import__") or not node.args:
        return None
    arg = node.args[0]
    if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
        return arg.value
    if isinstance(arg, ast.Name):
        return constants.get(arg.id)
    return None


def dynamic_imports(source: str) -> list[int]:
    """The lines of the ``importlib.import_module``/``__import__`` calls whose module the source
    does not say (neither a literal nor a module-level string constant)."""
    tree = ast.parse(source)
    constants = _string_constants(tree)
    return [
        node.lineno
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and (node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", ""))
        in ("import_module", "__import__")
        and _import_call_argument(node, constants) is None
    ]


def imported_modules(source: str, package: str, *, run_time_only: bool = False) -> list[tuple[int, str]]:
    """Every module ``source`` imports, with its line: ``import``, ``from ... import``
    (a name of a ``from pkg import name`` counts as the module ``pkg.name``), anywhere in
    the file, and ``importlib.import_module``/``__import__`` calls with a literal name or a
    module-level string constant (``_MODULE = "pkg.mod"``).

    Args:
        source: Python source text.
        package: the package the source belongs to (resolves relative imports).
        run_time_only: leave out imports under ``if TYPE_CHECKING:`` (annotations only).
    """
    found: list[tuple[int, str]] = []
    tree = ast.parse(source)
    constants = _string_constants(tree)
    skipped = _type_checking_only(tree) if run_time_only else set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            found.extend((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                parent = ".".join(parts[: len(parts) - node.level + 1])
                base = f"{parent}.{base}" if base else parent
            found.append((node.lineno, base))
            found.extend((node.lineno, f"{base}.{alias.name}") for alias in node.names if alias.name != "*")
        elif isinstance(node, ast.Call):
            named = _import_call_argument(node, constants)
            if named is not None:
                found.append((node.lineno, named))
    return found


def _core_layer(name: str, layers: Sequence[str]) -> str | None:
    """The core module ``name`` refers to (also through its old path ``tpurec.<module>``), if any."""
    parts = name.split(".")
    if parts[:2] == ["tpurec", "core"] and len(parts) > 2 and parts[2] in layers:
        return parts[2]
    if parts[0] == "tpurec" and len(parts) > 1 and parts[1] in layers:
        return parts[1]
    return None


def layering_violations(module: str, source: str, layers: Sequence[str]) -> list[str]:
    """The imports of core module ``module`` that break the layering, one line each.

    Args:
        module: the module's name in ``layers`` (e.g. ``"runtime"``).
        source: its source text.
        layers: the core modules, lowest first.
    """
    level = layers.index(module)
    violations: dict[tuple[int, str], str] = {}  # one per (line, module imported)
    for line, name in imported_modules(source, "tpurec.core"):
        if name.split(".")[0] != "tpurec" or name in ("tpurec", "tpurec.core"):
            # ``from tpurec.core import x`` also yields the package; ``x`` is judged on its own.
            continue
        target = _core_layer(name, layers)
        if target is not None:
            if layers.index(target) >= level:
                violations.setdefault(
                    (line, target), f"{module}.py:{line}: imports {name} ({target} is not below {module})"
                )
        elif name.startswith("tpurec.core."):
            undeclared = ".".join(name.split(".")[:3])
            violations.setdefault(
                (line, undeclared), f"{module}.py:{line}: imports {undeclared}, a core module not in LAYERS"
            )
        elif not any(name == f or name.startswith(f + ".") for f in FOUNDATION):
            package = ".".join(name.split(".")[:2])
            violations.setdefault(
                (line, package), f"{module}.py:{line}: imports {name}, outside the core and not a foundation module"
            )
    return list(violations.values())


def _foundation_files() -> list[pathlib.Path]:
    files = [PACKAGE_ROOT / "amp.py"]
    return files + sorted((PACKAGE_ROOT / "dense").rglob("*.py"))


def _package_of(path: pathlib.Path) -> str:
    parts = path.relative_to(PACKAGE_ROOT.parent).with_suffix("").parts
    return ".".join(parts if path.name == "__init__.py" else parts[:-1])


# --- the checker itself catches what it must --------------------------------------------


LAYERS_FOR_CHECKER = ("errors", "runtime", "tensor", "dispatch")


@pytest.mark.parametrize(
    "source",
    [
        "from tpurec.core import dispatch\n",
        "from tpurec.core.tensor import TpuTensor\n",
        "def synchronize():\n    from tpurec.core import tensor\n    return tensor\n",  # hidden in a function
        "class A:\n    import tpurec.core.dispatch as d\n",
        "from tpurec import tensor\n",  # the old path is the same module
        "import tpurec.dispatch\n",
        "from . import dispatch\n",  # relative
        "from .tensor import wrap\n",
        "import importlib\nimportlib.import_module('tpurec.core.tensor')\n",
        "from tpurec.core import runtime\n",  # itself: a module's own layer is not below it
        "from tpurec.sparse import ops\n",  # outside the core and not foundation
        "import tpurec.compile\n",
        "from tpurec.core.scheduler import run, wait\n",  # a core module missing from LAYERS
    ],
)
def test_checker_reports_an_import_that_is_not_downward(source):
    violations = layering_violations("runtime", source, LAYERS_FOR_CHECKER)
    assert len(violations) == 1, violations
    assert violations[0].startswith("runtime.py:")


@pytest.mark.parametrize(
    "source",
    [
        "from tpurec.core import errors\n",
        "from tpurec.core.errors import unsupported_op\n",
        "def f():\n    from tpurec.core import errors\n",
        "from . import errors\n",
        "from tpurec.dense.registry import to_jax_dtype\n",
        "from tpurec.dense.composites import COMPOSITES\n",
        "import jax\nimport torch\nfrom typing import Any\n",
    ],
)
def test_checker_accepts_downward_and_foundation_imports(source):
    assert layering_violations("runtime", source, LAYERS_FOR_CHECKER) == []


# --- the real core ----------------------------------------------------------------------


def test_every_core_module_is_declared_in_layers():
    on_disk = {p.stem for p in CORE_DIR.glob("*.py")} - {"__init__"}
    assert on_disk == set(tpurec.core.LAYERS)
    assert len(set(tpurec.core.LAYERS)) == len(tpurec.core.LAYERS)


def test_core_modules_import_only_downward():
    violations = []
    for module in tpurec.core.LAYERS:
        source = (CORE_DIR / f"{module}.py").read_text()
        violations += layering_violations(module, source, tpurec.core.LAYERS)
    assert violations == [], "\n".join(violations)


def test_the_core_package_imports_its_layers_in_order():
    # Each layer's hooks into the ones below are installed by importing it: in order, the eager
    # layers, then entry (the top layer, whose hooks load the lazy ones on the first tpu op).
    # (The facade's imports below the layers' come from them in the same order.)
    core = tpurec.core
    names: list[str] = []
    for _, name in imported_modules((CORE_DIR / "__init__.py").read_text(), "tpurec.core", run_time_only=True):
        layer = _core_layer(name, core.LAYERS)
        if layer is not None and layer not in names:
            names.append(layer)
    assert names == [*core.EAGER_LAYERS, "entry"]
    assert core.LAYERS == (*core.EAGER_LAYERS, *core.LAZY_LAYERS, "entry")


def _module_level_imports(source: str) -> list[str]:
    """The modules ``source`` imports when it is imported: its top-level statements only."""
    tree = ast.parse(source)
    top = [node for node in tree.body if isinstance(node, (ast.Import, ast.ImportFrom))]
    return [name for _, name in imported_modules(ast.unparse(ast.Module(top, [])), "tpurec.core")]


def test_the_lazy_layers_load_only_through_dispatch():
    # entry imports none of the op runtime at import, and in its functions only dispatch, which
    # imports every other lazy layer itself: the first tpu op loads all of them, or none.
    core = tpurec.core
    entry_source = (CORE_DIR / "entry.py").read_text()
    at_import = {_core_layer(n, core.LAYERS) for n in _module_level_imports(entry_source)} - {None}
    assert at_import.isdisjoint(core.LAZY_LAYERS), at_import
    anywhere = {_core_layer(n, core.LAYERS) for _, n in imported_modules(entry_source, "tpurec.core")} - {None}
    assert anywhere & set(core.LAZY_LAYERS) == {"dispatch"}
    dispatch_imports = {
        _core_layer(n, core.LAYERS) for n in _module_level_imports((CORE_DIR / "dispatch.py").read_text())
    }
    assert set(core.LAZY_LAYERS) - {"dispatch"} <= dispatch_imports
    for eager in core.EAGER_LAYERS:  # and nothing eager reaches a lazy layer (the layering forbids it anyway)
        names = {_core_layer(n, core.LAYERS) for n in _module_level_imports((CORE_DIR / f"{eager}.py").read_text())}
        assert names.isdisjoint(core.LAZY_LAYERS), (eager, names)


def _run_python(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(PACKAGE_ROOT.parent)}
    return subprocess.run([sys.executable, *args], check=False, capture_output=True, text=True, timeout=600, env=env)


def _imported(importtime_log: str) -> set[str]:
    """The modules named by ``python -X importtime``'s log (stderr)."""
    return {line.rsplit("|", 1)[-1].strip() for line in importtime_log.splitlines() if line.startswith("import time:")}


@pytest.mark.parametrize(
    "args",
    [
        ("-c", "import tpurec"),
        ("-c", "import tpurec.sparse.planner"),
        ("-m", "tpurec", "plan", "--help"),
    ],
    ids=["import tpurec", "import planner", "tpurec plan --help"],
)
def test_importing_or_planning_leaves_the_op_runtime_out(args):
    done = _run_python("-X", "importtime", *args)
    assert done.returncode == 0, done.stderr[-3000:]
    imported = _imported(done.stderr)
    assert "tpurec.core.entry" in imported  # the log is read right: the device is there
    runtime = {f"tpurec.core.{layer}" for layer in tpurec.core.LAZY_LAYERS} | {
        "tpurec.compile.backend",
        "tpurec.compile.graph",
    }
    assert imported & runtime == set()
    if args == ("-c", "import tpurec"):
        assert "torch._dynamo" not in imported  # its patches wait for its import (tpurec/_patches.py)


_FIRST_OPS = """
import sys, torch, tpurec
lazy = [f"tpurec.core.{layer}" for layer in tpurec.core.LAZY_LAYERS]
assert not any(m in sys.modules for m in [*lazy, "tpurec.compile.backend", "torch._dynamo"]) and not tpurec.core.entry.loaded()
assert torch.tpu.device_count() >= 1  # the device is there
torch.manual_seed(0)
linear = torch.nn.Linear(3, 2)
x = torch.randn(4, 3)
moved = linear.to("tpu")  # the first tpu op: empty_strided and _copy_from reach entry's kernels
assert all(m in sys.modules for m in lazy) and tpurec.core.entry.loaded()
assert moved is linear and linear.weight.device.type == "tpu"
y = linear(x.to("tpu"))
assert torch.allclose(y.cpu(), torch.nn.functional.linear(x, linear.weight.cpu(), linear.bias.cpu()), rtol=1e-5, atol=1e-6)
assert torch.equal(torch.arange(5, device="tpu").cpu(), torch.arange(5))  # a factory, through dispatch's kernel now
assert "tpurec.compile.backend" not in sys.modules  # (Dynamo may be imported: PyTorch's meta kernels import it)
double = torch.compile(lambda t: t * 2 + 1, backend="tpu")  # the registered backend loads tpurec.compile.backend
assert torch.equal(double(torch.arange(3.0, device="tpu")).cpu(), torch.tensor([1.0, 3.0, 5.0]))
assert "tpurec.compile.backend" in sys.modules and "tpu" in torch._dynamo.list_backends()
print("ok")
"""


def test_the_first_tpu_op_loads_the_op_runtime():
    done = _run_python("-c", _FIRST_OPS)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]


_FIRST_OP_IS_A_FACTORY = """
import sys, torch, tpurec
assert not tpurec.core.entry.loaded()
t = torch.zeros(2, 3, device="tpu")  # through the factory kernel entry registered at import
assert tpurec.core.entry.loaded() and torch.equal(t.cpu(), torch.zeros(2, 3))
print(torch.tensor([1.5, 2.5], device="tpu"))  # _copy_from with Python dispatch excluded
print("ok")
"""


def test_the_first_tpu_op_may_be_a_factory():
    done = _run_python("-c", _FIRST_OP_IS_A_FACTORY)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]
    assert "tensor([1.5000, 2.5000], device='tpu:0')" in done.stdout


def test_foundation_modules_import_nothing_of_the_core():
    violations = []
    for path in _foundation_files():
        for line, name in imported_modules(path.read_text(), _package_of(path)):
            if name.split(".")[0] != "tpurec" or name == "tpurec":
                continue
            if not any(name == f or name.startswith(f + ".") for f in FOUNDATION):
                violations.append(f"{path.relative_to(PACKAGE_ROOT)}:{line}: imports {name}")
    assert violations == [], "\n".join(violations)


# --- the old paths ------------------------------------------------------------------------


class _OldNamePickler(pickle._Pickler):
    """Writes the tpu tensor rebuild function under the path older releases wrote (``tpurec.tensor``)."""

    def save(self, obj, save_persistent_id=True):
        if obj is core_tensor._rebuild_tpu_tensor:
            self.write(pickle.GLOBAL + b"tpurec.tensor\n_rebuild_tpu_tensor\n")
            return
        super().save(obj, save_persistent_id)


class _OldTpuTensor:
    """Pickles as a tpu tensor did before the runtime moved to tpurec.core."""

    def __reduce__(self):
        return core_tensor._rebuild_tpu_tensor, (torch.arange(3.0), "tpu:0", True)


_OLD_PICKLE = types.SimpleNamespace(Pickler=_OldNamePickler, Unpickler=pickle.Unpickler, __name__="pickle")

_LOAD_OLD_CHECKPOINT = """
import pickle, sys, torch, tpurec
old = [m for m in sys.modules if m in ("tpurec.tensor", "tpurec.runtime", "tpurec.jax")]
assert old == [] and not hasattr(tpurec, "tensor"), old  # nothing registered up front
for loaded in (torch.load(sys.argv[1], weights_only=False)["w"], pickle.loads(open(sys.argv[2], "rb").read())["w"]):
    assert loaded.device.type == "tpu" and loaded.requires_grad, loaded
    assert torch.equal(loaded.detach().cpu(), torch.arange(3.0)), loaded
print("ok")
"""


def test_a_checkpoint_naming_the_old_tensor_path_loads_without_weights_only(tmp_path):
    # pickle (and torch.load(weights_only=False)) imports tpurec.tensor to resolve the name.
    checkpoint, raw = tmp_path / "old.pt", tmp_path / "old.pkl"
    torch.save({"w": _OldTpuTensor()}, checkpoint, pickle_module=_OLD_PICKLE)
    buffer = io.BytesIO()
    _OldNamePickler(buffer, protocol=2).dump({"w": _OldTpuTensor()})
    raw.write_bytes(buffer.getvalue())
    opcodes = [arg for op, arg, _ in pickletools.genops(buffer.getvalue()) if op.name == "GLOBAL"]
    assert "tpurec.tensor _rebuild_tpu_tensor" in opcodes and not any("tpurec.core" in str(a) for a in opcodes)
    env = {**os.environ, "PYTHONPATH": str(PACKAGE_ROOT.parent)}
    done = subprocess.run(
        [sys.executable, "-c", _LOAD_OLD_CHECKPOINT, str(checkpoint), str(raw)],
        check=False,
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]


def test_old_module_paths_offer_only_what_a_checkpoint_can_name():
    import tpurec.runtime as old_runtime

    assert old_runtime is not tpurec.core.runtime  # not an alias: a read-only view for unpickling
    assert old_runtime.enable_disk_cache is tpurec.core.runtime.enable_disk_cache  # a function: a pickle may name it
    with pytest.raises(AttributeError, match=r"tpurec.runtime is an old module path.*tpurec.core.runtime.programs"):
        _ = old_runtime.programs  # module state, not a class or function
    with pytest.raises(
        AttributeError, match=r"read-only old module path; set 'enable_disk_cache' on tpurec.core.runtime"
    ):
        old_runtime.enable_disk_cache = None
    assert tpurec.core.runtime.enable_disk_cache is old_runtime.enable_disk_cache  # the failed write changed nothing
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("tpurec.jax")  # only the modules that moved have old paths


def test_moved_modules_keep_their_old_paths_for_code():
    from tpurec import _old_paths

    assert _old_paths.MOVED  # what this checks exists
    for old, new in _old_paths.MOVED.items():
        old_file = PACKAGE_ROOT.parent / (old.replace(".", "/") + ".py")
        assert not old_file.exists() and not old_file.with_suffix("").is_dir(), old  # one copy: the new one
        assert importlib.import_module(old) is importlib.import_module(new), old
        parent, _, name = old.rpartition(".")
        assert getattr(importlib.import_module(parent), name) is importlib.import_module(new)  # from pkg import name
    code = (
        "import sys, tpurec\n"
        "from tpurec._old_paths import MOVED\n"
        "assert not any(old in sys.modules for old in MOVED)  # nothing imported until asked for\n"
        "from tpurec.composites import COMPOSITES\n"
        "import tpurec.dense.composites as new\n"
        "assert new.COMPOSITES is COMPOSITES and sys.modules['tpurec.composites'] is new\n"
        "assert new.__spec__.name == 'tpurec.dense.composites'  # the moved module is untouched\n"
    )
    done = _run_python("-c", code)
    assert done.returncode == 0, done.stderr[-3000:]


def test_tpurec_imports_no_old_path():
    from tpurec import _old_paths

    old = set(_old_paths.MOVED) | set(_old_paths.OLD_PATHS)
    found = [
        f"{path.relative_to(PACKAGE_ROOT.parent)}:{line}: {name}"
        for path in sorted(PACKAGE_ROOT.rglob("*.py"))
        for line, name in imported_modules(path.read_text(), _package_of(path))
        if name in old
    ]
    assert found == [], found


def test_public_names_are_unchanged():
    for name in tpurec.__all__:
        assert getattr(tpurec, name) is not None, name
    from tpurec.core import enable_disk_cache, reset_stats, stats, synchronize  # noqa: F401
    from tpurec.profiler import enabled, profile, program_label, record  # noqa: F401

    assert tpurec.synchronize is tpurec.core.sync.synchronize
    assert tpurec.TpuTensor is tpurec.core.tensor.TpuTensor


def test_the_hooks_of_the_layers_above_are_installed():
    # Cycles are broken by hooks; a missing one would silently drop work, so check each.
    tpurec.core.entry.load_runtime()  # what the first tpu op does: dispatch replaces entry's loaders
    assert core_tensor._dispatch is tpurec.core.dispatch.dispatch
    assert core_tensor._value_of is tpurec.core.dispatch.value_of
    assert tpurec.core.sync._flush_pending_work is tpurec.core.fused.flush
    assert tpurec.core.runtime._compile_observer is tpurec.core.recompiles.compiling


def test_a_checkpoint_naming_the_old_tensor_path_loads_with_weights_only():
    # Checkpoints written before the move name tpurec.tensor._rebuild_tpu_tensor.
    rebuild = core_tensor._rebuild_tpu_tensor

    class OldTpuTensor:
        def __reduce__(self):
            return rebuild, (torch.arange(3.0), "tpu:0", False)

    buffer = io.BytesIO()
    rebuild.__module__ = "tpurec.tensor"  # pickle writes the function's path as the old module did
    try:
        torch.save({"w": OldTpuTensor()}, buffer)
    finally:
        rebuild.__module__ = core_tensor.__name__
    assert b"tpurec.tensor" in buffer.getvalue() and b"tpurec.core" not in buffer.getvalue()
    loaded = torch.load(io.BytesIO(buffer.getvalue()), weights_only=True)
    assert loaded["w"].device.type == "tpu"
    assert torch.equal(loaded["w"].cpu(), torch.arange(3.0))


# --- tpurec.sparse: its parts in layers ---------------------------------------------------

SPARSE_DIR = PACKAGE_ROOT / "sparse"
# Outside tpurec.sparse, its device parts may import the runtime below them; its device-free
# parts (tpurec.sparse.DEVICE_FREE_LAYERS) only the command-line helpers.
# tpurec.config imports nothing of tpurec (the flags), so every part may read it.
SPARSE_FOUNDATION = (
    "tpurec.config",
    "tpurec.core",
    "tpurec.distributed",
    "tpurec.dense",
    "tpurec.library",
    "tpurec.native",
    "tpurec.cli",
)
DEVICE_FREE_FOUNDATION = ("tpurec.config", "tpurec.cli")


def _within(name: str, prefixes: Sequence[str]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def sparse_layering_violations(
    where: str, part: str, source: str, package: str, layers: Sequence[str], device_free: Sequence[str]
) -> list[str]:
    """The imports of a module of sparse part ``part`` that break the sparse layering, one line each.

    A part may import itself and the parts below it in ``layers``; outside
    ``tpurec.sparse``, the foundation (``SPARSE_FOUNDATION``, or for a part in
    ``device_free`` only ``DEVICE_FREE_FOUNDATION``). Imports under
    ``if TYPE_CHECKING:`` (annotations, never run) are not judged.

    Args:
        where: the file, for the messages (e.g. ``"planner/comms.py"``).
        part: its part (a name in ``layers``).
        source: its source text.
        package: the package it belongs to (resolves relative imports).
        layers: the parts of tpurec.sparse, lowest first.
        device_free: the parts that must not import the device runtime.
    """
    level = layers.index(part)
    violations: dict[tuple[int, str], str] = {}
    found = imported_modules(source, package, run_time_only=True)
    for line, name in found:
        parts = name.split(".")
        if parts[0] != "tpurec" or any(n.startswith(name + ".") for at, n in found if at == line):
            continue  # ``from pkg import x`` also yields ``pkg``; ``pkg.x`` is judged on its own
        if parts[:2] == ["tpurec", "sparse"]:
            target = parts[2]
            if target not in layers:
                violations.setdefault(
                    (line, target), f"{where}:{line}: imports {name}, a part of tpurec.sparse not in LAYERS"
                )
            elif layers.index(target) > level:
                violations.setdefault((line, target), f"{where}:{line}: imports {name} ({target} is not below {part})")
            continue
        allowed = DEVICE_FREE_FOUNDATION if part in device_free else SPARSE_FOUNDATION
        if not _within(name, allowed):
            kind = "device-free " if part in device_free else ""
            violations.setdefault(
                (line, ".".join(parts[:2])),
                f"{where}:{line}: imports {name}, which the {kind}part {part} may not import",
            )
    return list(violations.values())


SPARSE_LAYERS_FOR_CHECKER = ("sharding_plan", "planner", "modules", "sharding")


@pytest.mark.parametrize(
    "part, source",
    [
        ("planner", "from tpurec.sparse.sharding import Layout\n"),  # the executor is above the planner
        ("planner", "def f():\n    from tpurec.sparse.sharding.model import shard\n"),  # hidden in a function
        ("planner", "import tpurec\n"),  # the package: the device runtime
        ("planner", "from tpurec.core import dispatch\n"),  # device-free
        ("sharding_plan", "from tpurec.dense.registry import lower\n"),
        ("sharding_plan", "from tpurec.sparse import planner\n"),
        ("sharding_plan", "from ..planner.types import TableSpec\n"),  # relative
        ("modules", "import importlib\nimportlib.import_module('tpurec.sparse.sharding')\n"),
        ("modules", "from tpurec.compile import backend\n"),  # outside sparse and not its foundation
        ("modules", "from tpurec.sparse.scheduler import run\n"),  # a part missing from LAYERS
        ("sharding", "from tpurec import bench\n"),
    ],
)
def test_sparse_checker_reports_an_upward_import(part, source):
    package = f"tpurec.sparse.{part}"
    violations = sparse_layering_violations(
        f"{part}/x.py", part, source, package, SPARSE_LAYERS_FOR_CHECKER, ("sharding_plan", "planner")
    )
    assert len(violations) == 1, violations
    assert violations[0].startswith(f"{part}/x.py:")


@pytest.mark.parametrize(
    "part, source",
    [
        ("planner", "from tpurec.sparse.sharding_plan.layout import Layout\n"),
        ("planner", "from tpurec.sparse.planner.types import TableSpec\n"),  # its own part
        ("planner", "from tpurec.cli import error\n"),
        ("sharding_plan", "from . import shards\n"),
        ("sharding", "def f():\n    from tpurec.sparse.planner import plan\n"),  # the executor calls the planner
        ("sharding", "from tpurec.core.tensor import wrap\nfrom tpurec.sparse.modules import EmbeddingBagCollection\n"),
        ("modules", "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from tpurec.sparse.sharding import x\n"),
        ("modules", "import jax\nimport torch\nimport torchrec\n"),
    ],
)
def test_sparse_checker_accepts_downward_and_foundation_imports(part, source):
    package = f"tpurec.sparse.{part}"
    assert (
        sparse_layering_violations(
            f"{part}/x.py", part, source, package, SPARSE_LAYERS_FOR_CHECKER, ("sharding_plan", "planner")
        )
        == []
    )


def _sparse_files() -> list[tuple[str, pathlib.Path]]:
    """(part, file) for every module of tpurec.sparse but its package ``__init__``."""
    files = []
    for path in sorted(SPARSE_DIR.rglob("*.py")):
        rel = path.relative_to(SPARSE_DIR)
        if rel == pathlib.Path("__init__.py"):
            continue
        files.append((rel.parts[0].removesuffix(".py"), path))
    return files


def test_every_sparse_part_is_declared_in_layers():
    import tpurec.sparse

    on_disk = {part for part, _ in _sparse_files()}
    assert on_disk == set(tpurec.sparse.LAYERS)
    assert len(set(tpurec.sparse.LAYERS)) == len(tpurec.sparse.LAYERS)
    assert set(tpurec.sparse.DEVICE_FREE_LAYERS) <= set(tpurec.sparse.LAYERS)


def test_sparse_parts_import_only_downward():
    import tpurec.sparse

    violations = []
    for part, path in _sparse_files():
        violations += sparse_layering_violations(
            str(path.relative_to(SPARSE_DIR)),
            part,
            path.read_text(),
            _package_of(path),
            tpurec.sparse.LAYERS,
            tpurec.sparse.DEVICE_FREE_LAYERS,
        )
    assert violations == [], "\n".join(violations)


# --- all of tpurec: no import circle ------------------------------------------------------


def _module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(PACKAGE_ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if path.name == "__init__.py" else parts)


def import_graph(sources: dict[str, tuple[str, str]], *, type_only: bool = False) -> dict[str, dict[str, int]]:
    """Module -> {module it imports: line}, over the given modules only.

    ``from pkg import name`` is an edge to ``pkg.name`` when that is a module, else to
    ``pkg``; an import of a module outside ``sources`` counts as its closest enclosing
    module there. Imports inside functions count; those under ``if TYPE_CHECKING:`` do
    not (they never run) unless ``type_only``. Python's implicit import of a module's parent
    packages is not an edge: a package importing its own submodules would make every package
    a circle.

    Args:
        sources: module name -> (source text, package it belongs to).
        type_only: count the imports under ``if TYPE_CHECKING:`` too.
    """
    graph: dict[str, dict[str, int]] = {}
    for name, (source, package) in sources.items():
        edges: dict[str, int] = {}
        tree = ast.parse(source)
        constants = _string_constants(tree)
        skipped = set() if type_only else _type_checking_only(tree)
        for node in ast.walk(tree):
            if id(node) in skipped:
                continue
            targets: list[str] = []
            if isinstance(node, ast.ImportFrom):
                base = imported_modules(ast.unparse(ast.Module([node], [])), package)[0][1]
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in sources else base for a in node.names]
            elif isinstance(node, ast.Import):
                targets = [m for _, m in imported_modules(ast.unparse(ast.Module([node], [])), package)]
            elif isinstance(node, ast.Call):
                named = _import_call_argument(node, constants)
                targets = [named] if named is not None else []
            for target in targets:
                while target and target not in sources:
                    target = target.rpartition(".")[0]
                if target and target != name:
                    edges.setdefault(target, node.lineno)
        graph[name] = edges
    return graph


def circles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """The strongly connected components of ``graph`` with more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def _describe(graph: dict[str, dict[str, int]], component: list[str]) -> str:
    inside = set(component)
    return "\n".join(f"  {v}:{line} -> {w}" for v in component for w, line in graph[v].items() if w in inside)


def test_the_circle_finder_finds_a_circle_hidden_in_a_function():
    sources = {
        "tpurec.a": ("from tpurec.b import f\n", "tpurec"),
        "tpurec.b": ("def f():\n    from tpurec.c import g\n", "tpurec"),
        "tpurec.c": ("import tpurec.a\n", "tpurec"),
        "tpurec.d": ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from tpurec.a import x\n", "tpurec"),
        "tpurec.pkg": ("from tpurec.pkg import sub\n", "tpurec.pkg"),  # a package importing its submodule
        "tpurec.pkg.sub": ("from tpurec.pkg.other import y\n", "tpurec.pkg"),
        "tpurec.pkg.other": ("from tpurec.a import f\n", "tpurec.pkg"),
    }
    graph = import_graph(sources)
    assert circles(graph) == [["tpurec.a", "tpurec.b", "tpurec.c"]]
    assert graph["tpurec.d"] == {}  # annotations only
    sources["tpurec.a"] = ("from tpurec.b import f\nfrom tpurec import pkg\n", "tpurec")
    sources["tpurec.c"] = ("", "tpurec")
    sources["tpurec.pkg.other"] = ("def g():\n    from tpurec.a import f\n", "tpurec.pkg")
    assert circles(import_graph(sources)) == [["tpurec.a", "tpurec.pkg", "tpurec.pkg.other", "tpurec.pkg.sub"]]


# Circles outside tpurec.sparse that other work is taking apart, each with its edge back.
KNOWN_CIRCLES: list[list[str]] = []


@pytest.mark.parametrize("type_only", [False, True], ids=["run_time", "with_type_only_imports"])
def test_tpurec_has_no_import_circle(type_only):
    # Type-only imports count too: a module annotated with a class of a module above it is
    # an upward dependency all the same (a protocol where it is used says what it needs).
    files = sorted(PACKAGE_ROOT.rglob("*.py"))
    graph = import_graph({_module_name(p): (p.read_text(), _package_of(p)) for p in files}, type_only=type_only)
    found = [c for c in circles(graph) if c not in KNOWN_CIRCLES]
    assert found == [], "\n\n".join(_describe(graph, c) for c in found)


# --- outside the core, only its public names ---------------------------------------------


def private_core_uses(source: str) -> list[str]:
    """``line: name`` for each private name of ``tpurec.core`` that ``source`` imports or reads
    (``from tpurec.core.x import _y``, ``x._y`` on an imported core module, ``importlib`` included)."""
    tree = ast.parse(source)
    core_names: dict[str, str] = {}
    found: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and _within(node.module, ("tpurec.core",)):
            for alias in node.names:
                if alias.name.startswith("_"):
                    found.append(f"{node.lineno}: {node.module}.{alias.name}")
                core_names[alias.asname or alias.name] = f"{node.module}.{alias.name}"
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if _within(alias.name, ("tpurec.core",)):
                    core_names[alias.asname or alias.name] = alias.name
        elif isinstance(node, ast.Assign) and isinstance(node.value, ast.Call):
            # module = importlib.import_module("tpurec.core.x")
            call = node.value
            if (
                ast.unparse(call.func) in ("importlib.import_module", "import_module")
                and call.args
                and isinstance(call.args[0], ast.Constant)
                and _within(str(call.args[0].value), ("tpurec.core",))
            ):
                for target in node.targets:
                    if isinstance(target, ast.Name):
                        core_names[target.id] = str(call.args[0].value)
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id in core_names
            and node.attr.startswith("_")
            and not node.attr.startswith("__")
        ):
            found.append(f"{node.lineno}: {core_names[node.value.id]}.{node.attr}")
    return found


@pytest.mark.parametrize(
    "source,expected",
    [
        ("from tpurec.core.programs import _run\n", ["1: tpurec.core.programs._run"]),
        ("from tpurec.core import fused\nfused._flush()\n", ["2: tpurec.core.fused._flush"]),
        (
            "import importlib\nm = importlib.import_module('tpurec.core.tensor')\nm._wrap\n",
            ["3: tpurec.core.tensor._wrap"],
        ),
        ("from tpurec.core import fused as _fused\n_fused.record\n", []),  # a private alias of a public name
        ("from tpurec.core.programs import run_program\n", []),
    ],
)
def test_private_core_uses_are_found(source, expected):
    assert private_core_uses(source) == expected


def test_no_module_outside_the_core_uses_its_private_names():
    found = [
        f"{path.relative_to(PACKAGE_ROOT.parent)}:{use}"
        for path in sorted(PACKAGE_ROOT.rglob("*.py"))
        if "core" not in path.relative_to(PACKAGE_ROOT).parts[:1]
        for use in private_core_uses(path.read_text())
    ]
    assert found == [], "make the name public in tpurec.core (with a docstring) or keep the use inside it"


# --- outside the core, only its facade ------------------------------------------------------


def facade_violations(source: str, package: str, facade: Sequence[str]) -> list[str]:
    """``line: what`` for each use of ``tpurec.core`` in ``source`` that is not a facade name.

    Allowed: ``from tpurec.core import NAME`` and ``core.NAME`` on the package (``from tpurec
    import core``, ``import tpurec.core as core``, ``tpurec.core.NAME``) for ``NAME`` in
    ``facade``. Anything else that reaches a layer module (``from tpurec.core.tensor import
    wrap``, ``from tpurec.core import runtime``, ``importlib.import_module("tpurec.core.x")``,
    a relative import) is reported, type-only imports included.

    Args:
        source: Python source text of a module outside the core.
        package: the package it belongs to (resolves relative imports).
        facade: the names ``tpurec.core`` offers (its ``__all__``).
    """
    tree = ast.parse(source)
    found: list[str] = []
    core_aliases: set[str] = set()  # local names bound to the tpurec.core package
    tpurec_aliases: set[str] = set()  # local names bound to tpurec itself
    for line, name in imported_modules(source, package):
        if _within(name, ("tpurec.core",)) and name != "tpurec.core":
            head = name.removeprefix("tpurec.core.")
            if "." in head or head not in facade:
                found.append(f"{line}: {name}")
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            base = imported_modules(ast.unparse(ast.Module([node], [])), package)[0][1]
            for alias in node.names:
                if f"{base}.{alias.name}" == "tpurec.core":
                    core_aliases.add(alias.asname or alias.name)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == "tpurec.core" and alias.asname:
                    core_aliases.add(alias.asname)
                elif alias.name.split(".")[0] == "tpurec" and not alias.asname:
                    tpurec_aliases.add("tpurec")
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute):
            continue
        on_core = isinstance(node.value, ast.Name) and node.value.id in core_aliases
        on_core = on_core or (
            isinstance(node.value, ast.Attribute)
            and node.value.attr == "core"
            and isinstance(node.value.value, ast.Name)
            and node.value.value.id in tpurec_aliases
        )
        if on_core and node.attr not in facade:
            found.append(f"{node.lineno}: tpurec.core.{node.attr}")
    by_line: dict[int, str] = {}  # one per line (``from tpurec.core.x import y`` names x and x.y)
    for use in found:
        by_line.setdefault(int(use.split(":")[0]), use)
    return [by_line[line] for line in sorted(by_line)]


FACADE_FOR_CHECKER = ("wrap", "value_of", "Program")


@pytest.mark.parametrize(
    "source",
    [
        "from tpurec.core.tensor import wrap\n",
        "from tpurec.core import runtime\n",
        "import tpurec.core.dispatch\n",
        "def f():\n    from tpurec.core.programs import run_program\n",
        "import importlib\nimportlib.import_module('tpurec.core.tensor')\n",
        "import importlib\n_M = 'tpurec.core.fused'\ndef f():\n    return importlib.import_module(_M)\n",
        "from tpurec import core\ncore.runtime.stats()\n",
        "import tpurec.core as c\nc.tensor\n",
        "import tpurec\ntpurec.core.fused.flush()\n",
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from tpurec.core.tensor import TpuTensor\n",
        "from ..core import tensor\n",
    ],
)
def test_facade_checker_reports_a_reach_past_the_facade(source):
    found = facade_violations(source, "tpurec.sparse", FACADE_FOR_CHECKER)
    assert len(found) == 1, found


@pytest.mark.parametrize(
    "source",
    [
        "from tpurec.core import wrap, value_of\n",
        "from tpurec import core\ncore.Program(f)\n",
        "import tpurec.core as c\nc.wrap(x, 0)\n",
        "import tpurec\ntpurec.core.value_of(t)\n",
        "from tpurec.dense.registry import lower\nimport jax\n",
    ],
)
def test_facade_checker_accepts_the_facade(source):
    assert facade_violations(source, "tpurec.sparse", FACADE_FOR_CHECKER) == []


def test_the_facade_lists_what_it_offers():
    core = tpurec.core
    names = [n for n in core.__all__ if n not in ("EAGER_LAYERS", "LAYERS", "LAZY_LAYERS", "LAZY_NAMES")]
    assert len(set(names)) == len(names)
    assert not any(n.startswith("_") for n in names)
    assert set(core.LAZY_NAMES) <= set(names)
    assert set(core.LAZY_NAMES.values()) <= set(core.LAZY_LAYERS)
    assert set(names).isdisjoint(core.LAYERS), "a layer module is not a facade name"
    for name in names:
        assert getattr(core, name) is not None, name


def test_the_facade_loads_the_op_runtime_only_for_its_names_of_it():
    code = (
        "import sys, tpurec.core as c\n"
        "assert 'tpurec.core.programs' not in sys.modules\n"
        "eager = [n for n in c.__all__ if n not in c.LAZY_NAMES]\n"
        "[getattr(c, n) for n in eager]\n"
        "assert 'tpurec.core.programs' not in sys.modules\n"
        "from tpurec.core import value_of\n"
        "from tpurec.core.programs import value_of as direct\n"
        "assert value_of is direct\n"
    )
    done = _run_python("-c", code)
    assert done.returncode == 0, done.stderr[-3000:]


def test_outside_the_core_only_the_facade_is_used():
    facade = tpurec.core.__all__
    found = [
        f"{path.relative_to(PACKAGE_ROOT.parent)}:{use}"
        for path in sorted(PACKAGE_ROOT.rglob("*.py"))
        if "core" not in path.relative_to(PACKAGE_ROOT).parts[:1]
        for use in facade_violations(path.read_text(), _package_of(path), facade)
    ]
    assert found == [], "\n".join(found) + "\nuse a name of tpurec.core (add it to its facade if it is missing)"


# --- imports the checks can read --------------------------------------------------------------

# The imports whose module is computed, and why: every other import_module/__import__ in tpurec
# names its module as a literal or a module-level constant, which the checks above read.
DYNAMIC_IMPORTS = {
    "tpurec/cli.py": "a subcommand's module, from the command table",
    "tpurec/_patches.py": "the module of a patched object named in the patch table",
    "tpurec/_old_paths.py": "the module an old path became (OLD_PATHS)",
    "tpurec/dense/registry.py": "an op family of tpurec.dense, or a module registered with defer()",
    "tpurec/distributed/fsdp.py": "each of FSDP2's modules in _MODULES",
    "tpurec/core/__init__.py": "its own lazy layers",
    "tpurec/compile/__init__.py": "the compiler's modules, when their names are read on the package",
}


def test_dynamic_imports_are_declared():
    found = {
        str(path.relative_to(PACKAGE_ROOT.parent)): lines
        for path in sorted(PACKAGE_ROOT.rglob("*.py"))
        if (lines := dynamic_imports(path.read_text()))
    }
    assert set(found) == set(DYNAMIC_IMPORTS), found


def test_a_module_path_in_a_constant_is_read():
    source = "import importlib\n_MODULE = 'tpurec.sparse.x'\ndef f():\n    importlib.import_module(_MODULE)\n"
    assert imported_modules(source, "tpurec") == [(1, "importlib"), (4, "tpurec.sparse.x")]
    assert dynamic_imports(source) == []
    assert dynamic_imports("import importlib\ndef f(n):\n    importlib.import_module(n)\n") == [3]


# tpurec.distributed sits below tpurec.sparse (sparse imports it) and tpurec.dmp (TorchRec's
# DistributedModelParallel on tpu, above both): what it may import of tpurec.
DISTRIBUTED_FOUNDATION = ("tpurec.config", "tpurec.core", "tpurec.dense", "tpurec.native", "tpurec.distributed")


def test_distributed_imports_only_below_it():
    dist_dir = PACKAGE_ROOT / "distributed"
    violations: list[str] = []
    for path in sorted(dist_dir.rglob("*.py")):
        where = str(path.relative_to(dist_dir))
        for line, name in imported_modules(path.read_text(), _package_of(path)):
            if name.split(".")[0] == "tpurec" and name != "tpurec" and not _within(name, DISTRIBUTED_FOUNDATION):
                violations.append(f"{where}:{line}: imports {name}")
    assert violations == [], "\n".join(violations)


def test_only_the_patches_import_dmp():
    # tpurec.dmp adapts TorchRec's sharded modules and sits above the packages it builds on, which
    # never import it: its modules load through the patches of tpurec/_patches.py (when TorchRec
    # imports what they change) and the lowering table's deferred torchrec namespace.
    found = [
        f"{path.relative_to(PACKAGE_ROOT.parent)}:{line}: {name}"
        for path in sorted(PACKAGE_ROOT.rglob("*.py"))
        if path.relative_to(PACKAGE_ROOT).parts[0] not in ("dmp", "_patches.py")
        for line, name in imported_modules(path.read_text(), _package_of(path))
        if _within(name, ("tpurec.dmp",))
    ]
    assert found == [], found
