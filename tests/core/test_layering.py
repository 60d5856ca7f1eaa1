"""The runtime core is layered: each tpurec/core module imports only the modules below it.

``tpurec.core.LAYERS`` declares the order (lowest first). The check reads every import
of every core module with ``ast``: module level, inside functions and classes, and
``importlib.import_module("tpurec...")`` calls, since an import hidden in a function
to dodge a cycle is still a cycle. Outside the core, a core module may import only the
foundation modules below it (``tpurec.dense``, ``tpurec.amp``, ``tpurec.composites``),
and those must import nothing of tpurec but each other.
"""

from __future__ import annotations

import ast
import io
import pathlib
from typing import Sequence

import pytest
import torch

import tpurec
import tpurec.core
from tpurec.core import tensor as core_tensor

PACKAGE_ROOT = pathlib.Path(tpurec.__file__).parent
CORE_DIR = PACKAGE_ROOT / "core"
# Modules outside the core that the core may import: they sit below it.
FOUNDATION = ("tpurec.dense", "tpurec.amp", "tpurec.composites", "tpurec.cache", "tpurec.native")


def imported_modules(source: str, package: str) -> list[tuple[int, str]]:
    """Every module ``source`` imports, with its line: ``import``, ``from ... import``
    (a name of a ``from pkg import name`` counts as the module ``pkg.name``), anywhere in
    the file, and ``importlib.import_module``/``__import__`` calls with a literal name.

    Args:
        source: Python source text.
        package: the package the source belongs to (resolves relative imports).
    """
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(source)):
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
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            called = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            if called in ("import_module", "__import__") and isinstance(node.args[0].value, str):
                found.append((node.lineno, node.args[0].value))
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
                violations.setdefault((line, target), f"{module}.py:{line}: imports {name} ({target} is not below {module})")
        elif name.startswith("tpurec.core."):
            undeclared = ".".join(name.split(".")[:3])
            violations.setdefault((line, undeclared), f"{module}.py:{line}: imports {undeclared}, a core module not in LAYERS")
        elif not any(name == f or name.startswith(f + ".") for f in FOUNDATION):
            package = ".".join(name.split(".")[:2])
            violations.setdefault(
                (line, package), f"{module}.py:{line}: imports {name}, outside the core and not a foundation module"
            )
    return list(violations.values())


def _foundation_files() -> list[pathlib.Path]:
    files = [PACKAGE_ROOT / "amp.py", PACKAGE_ROOT / "composites.py"]
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
        "from tpurec.composites import COMPOSITES\n",
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
    # Each layer's hooks into the ones below are installed by importing it: in order, all of them.
    names = [
        name.split(".")[-1]
        for _, name in imported_modules((CORE_DIR / "__init__.py").read_text(), "tpurec.core")
        if name.startswith("tpurec.core.")
    ]
    assert names == list(tpurec.core.LAYERS)


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


@pytest.mark.parametrize("module", [m for m in tpurec.core.LAYERS if m in tpurec._OLD_PATHS])  # modules older than tpurec.core
def test_old_module_paths_are_the_core_modules(module):
    import importlib

    core_module = getattr(tpurec.core, module)
    assert importlib.import_module(f"tpurec.{module}") is core_module
    assert getattr(tpurec, module) is core_module


def test_public_names_are_unchanged():
    for name in tpurec.__all__:
        assert getattr(tpurec, name) is not None, name
    from tpurec.profiler import enabled, profile, program_label, record  # noqa: F401
    from tpurec.runtime import enable_disk_cache, reset_stats, stats, synchronize  # noqa: F401

    assert tpurec.synchronize is tpurec.core.runtime.synchronize
    assert tpurec.TpuTensor is tpurec.core.tensor.TpuTensor


def test_the_hooks_of_the_layers_above_are_installed():
    # Cycles are broken by hooks; a missing one would silently drop work, so check each.
    assert core_tensor._dispatch is tpurec.core.dispatch.dispatch
    assert core_tensor._value_of is tpurec.core.dispatch.value_of
    assert tpurec.core.runtime._flush_pending_work is tpurec.core.fused.flush
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
