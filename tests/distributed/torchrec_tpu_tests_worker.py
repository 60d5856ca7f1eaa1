"""One rank of TorchRec's own tests of its TPU path (``torchrun ... torchrec_tpu_tests_worker.py OUT SOURCE TEST_FILE``).

TorchRec's repository tests its TPU path (``torchrec/experimental/torch_tpu``) with unittest
modules its wheel does not ship. This worker loads one of them from a TorchRec source tree
(``SOURCE/TEST_FILE``; never from this repository, and without putting the source tree on
``sys.path``: the code under test is the installed TorchRec), runs its test cases on tpurec's
``tpu`` device, and writes ``OUT.<rank>`` as JSON, ``{test id: "passed" | "skipped: <reason>" |
"failed: <traceback>" | "error: <traceback>"}``.

The glue, and why each piece is needed (nothing else of the tests is changed):

* ``torch_tpu``: the tests call a TPU available when ``import torch_tpu`` (Google's PyTorch TPU
  backend) succeeds and ``torch.tpu.is_available()``. While the module is loaded (its
  ``skipIf`` decorators run then) an empty module stands in for ``torch_tpu``, and its
  ``tpu_is_available`` is then tpurec's ``torch.tpu.is_available()``.
* ``_register_tpu_kernels``: the tests import ``torchrec.experimental.torch_tpu.pallas.impl``, which
  binds TorchRec's Pallas kernels to the tpu device through ``torch_tpu._internal.pallas``, and
  ``pallas.dispatcher``, which binds FBGEMM's index ops for the tpu device as round trips through
  FBGEMM's CPU kernels. tpurec lowers the same ``torch.ops.torchrec`` ops itself
  (``tpurec.dmp.lookup_ops``) and runs FBGEMM's index ops on tpu tensors itself, so in its
  place the glue imports tpurec's lowerings only: the tests check tpurec's own path.
* ``SingleProcessContext(backend="tpu_dist")``: ``tpu_dist`` is torch_tpu's process-group backend;
  the context is TorchRec's own with tpurec's ``"cpu:gloo,tpu:tpu"`` in its place.
* ``torchrec.distributed.tests``: ``test_sharding`` (``copy_state_dict``) imports it for its
  2D-parallel sharder only, and TorchRec's wheel leaves it out: the stand-in of
  torchrec_model_worker.py, a sharder that raises if used.
* ``parameterized``: ``test_ec_lookup.py`` expands its cases with the ``parameterized`` package;
  where it is not installed, :func:`_expand` names the cases as ``parameterized.expand`` does.
"""

from __future__ import annotations

import faulthandler
import importlib
import importlib.util
import json
import os
import sys
import traceback
import types
import unittest
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

# torch_tpu's process-group backend and tpurec's in its place.
_BACKENDS = {"tpu_dist": "cpu:gloo,tpu:tpu"}


def _expand(cases: Sequence[Sequence[Any]]) -> Callable[[Callable[..., Any]], None]:
    """``parameterized.expand``: one test method per case, named ``<name>_<index>_<first argument>``."""

    def decorate(method: Callable[..., Any]) -> None:
        namespace = sys._getframe(1).f_locals  # the class body being defined
        for index, case in enumerate(cases):

            def test(self: Any, _case: Sequence[Any] = case) -> Any:
                return method(self, *_case)

            name = f"{method.__name__}_{index}_{case[0]}" if case else f"{method.__name__}_{index}"
            test.__name__ = test.__qualname__ = name
            test.__doc__ = method.__doc__
            namespace[name] = test

    return decorate


def _parameterized_stand_in() -> types.ModuleType | None:
    try:
        importlib.import_module("parameterized")
        return None
    except ImportError:
        module = types.ModuleType("parameterized")
        module.parameterized = types.SimpleNamespace(expand=_expand)  # pyright: ignore[reportAttributeAccessIssue]
        return module


def _tpu_is_available() -> bool:
    import torch

    return bool(torch.tpu.is_available())  # pyright: ignore[reportAttributeAccessIssue]


def _register_tpu_kernels() -> None:
    importlib.import_module("tpurec.dmp.lookup_ops")


def _single_process_context(original: type) -> type:
    class SingleProcessContext(original):
        """TorchRec's SingleProcessContext, tpurec's process group for torch_tpu's ``tpu_dist``."""

        def __init__(self, backend: str | None = None, *args: Any, **kwargs: Any) -> None:
            super().__init__(_BACKENDS.get(backend or "", backend), *args, **kwargs)

    return SingleProcessContext


def load(source: Path, test_file: str) -> types.ModuleType:
    """The test module ``source/test_file``, loaded with the glue above."""
    path = source / test_file
    name = "torchrec_tpu_test_" + Path(test_file).stem
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    stand_ins = {"torch_tpu": types.ModuleType("torch_tpu")}
    parameterized = _parameterized_stand_in()
    if parameterized is not None:
        stand_ins["parameterized"] = parameterized
    # Only while the module body runs: nothing else in the process sees a torch_tpu.
    sys.modules.update(stand_ins)
    try:
        spec.loader.exec_module(module)
    finally:
        for key in stand_ins:
            sys.modules.pop(key, None)
    glue: dict[str, Callable[[Any], Any]] = {
        "tpu_is_available": lambda _: _tpu_is_available,
        "_register_tpu_kernels": lambda _: _register_tpu_kernels,
        "SingleProcessContext": _single_process_context,
    }
    for name, replace in glue.items():
        if hasattr(module, name):
            setattr(module, name, replace(getattr(module, name)))
    return module


def _tests(suite: unittest.TestSuite) -> Iterator[unittest.TestCase]:
    for test in suite:
        if isinstance(test, unittest.TestSuite):
            yield from _tests(test)
        else:
            yield test


def run(module: types.ModuleType) -> dict[str, str]:
    """Each test of ``module``: its outcome (see the module's docstring)."""
    suite = unittest.defaultTestLoader.loadTestsFromModule(module)
    outcomes = {test.id(): "passed" for test in _tests(suite)}  # before running: a run drops its tests
    result = unittest.TestResult()
    suite.run(result)
    for test, reason in result.skipped:
        outcomes[test.id()] = f"skipped: {reason}"
    for test, text in result.failures:
        outcomes[test.id()] = f"failed: {text}"
    for test, text in result.errors:
        outcomes[test.id()] = f"error: {text}"
    return outcomes


def main(out_path: str, source: str, test_file: str) -> None:
    import tpurec  # noqa: F401 (the tpu device, its "tpu" process-group backend)
    from torchrec_model_worker import stand_in_for_the_missing_tests_package

    stand_in_for_the_missing_tests_package()
    rank = int(os.environ.get("RANK", "0"))
    try:
        outcomes = run(load(Path(source), test_file))
    except Exception:  # the module did not load: say so instead of a missing report
        outcomes = {test_file: f"error: {traceback.format_exc()}"}
    Path(f"{out_path}.{rank}").write_text(json.dumps(outcomes, indent=1))


if __name__ == "__main__":
    # A hung collective ends this rank with every thread's stack instead of stalling the test.
    faulthandler.dump_traceback_later(float(os.environ.get("TPUREC_TEST_HANG_SECONDS", "150")), exit=True)
    main(*sys.argv[1:4])
