"""Test set-up shared by every test: 8 host devices for JAX, tpu registered; the device tests run in eager
and fused mode; under pytest-xdist, how test files are shared out between the workers."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

# Must be set before JAX initialises its backends.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import tpurec  # noqa: E402,F401

import pytest  # noqa: E402
import torch  # noqa: E402

from tpurec import config  # noqa: E402
from tpurec.core import headroom, modes, runtime  # noqa: E402

try:
    from scheduling import FileScheduling
except ImportError:  # pytest-xdist is pinned in requirements-test.lock; without it the suite runs in one process
    FileScheduling = None

ROOT = Path(__file__).resolve().parents[1]

# A crashed xdist worker's test report carries its fault handler output and the machine's memory.
pytest_plugins = ("crash_evidence",)

# The whole suite runs in one process and builds tens of thousands of programs, each holding
# memory mappings; tpurec's own guard (headroom.keep_mapping_headroom) would drop them in the
# middle of some test, under tests that count compilations. Dropping them between test files,
# well before that, keeps the guard out of the way.
_MAPPINGS_BETWEEN_FILES = 24_000


@pytest.fixture(autouse=True, scope="module")
def _drop_programs_between_files():
    yield
    held = headroom.mapping_count()
    if held is not None and held > _MAPPINGS_BETWEEN_FILES:
        torch._dynamo.reset()
        headroom.release_programs()


# --- One file's process state does not reach the next ---------------------------------------------------
# Under pytest-xdist a worker runs files in an order of its own (see the scheduling below), so whatever a file
# leaves set in the process meets files it never met in a one-process run in path order.


def _process_state() -> dict[str, object]:
    """The settings of this process a test may change and must put back: they change what later tests run."""
    return {
        "the execution mode (tpurec.mode)": modes.get_mode(),
        "tpurec.config.update/override values": dict(config._overrides),
        "TPUREC_* environment variables": {k: v for k, v in os.environ.items() if k.startswith("TPUREC_")},
    }


@pytest.fixture(autouse=True, scope="module")
def _process_state_per_file(request: pytest.FixtureRequest) -> Iterator[None]:
    """Each test file starts in the process state the run started in.

    Mesh arrays: once a sharded collection has put global arrays in the process, tpurec traces every
    compiled graph as an SPMD program from then on (runtime.mesh_arrays_exist), and such a program keeps
    XLA's dot instead of the native XLA:CPU kernels; the file's global arrays are gone when it ends (this
    fixture is torn down after the file's own module fixtures), so the next file starts without them, as
    it would in a process of its own.

    The settings of :func:`_process_state` are put back too, and a file that left one changed fails (an
    error in its last test's teardown) naming it: that file is where a restore is missing.
    """
    before = _process_state()
    yield
    runtime._mesh_arrays_exist = False
    after = _process_state()
    if after == before:
        return
    changed = [f"{what}: {before[what]!r} -> {after[what]!r}" for what in before if before[what] != after[what]]
    modes.set_mode(before["the execution mode (tpurec.mode)"])  # type: ignore[arg-type]
    config._overrides.clear()
    config._overrides.update(before["tpurec.config.update/override values"])  # type: ignore[arg-type]
    for name in after["TPUREC_* environment variables"]:  # type: ignore[union-attr]
        os.environ.pop(name)
    os.environ.update(before["TPUREC_* environment variables"])  # type: ignore[arg-type]
    pytest.fail(
        f"{request.node.nodeid} left the process changed for the files after it (put back now): " + "; ".join(changed),
        pytrace=False,
    )


# --- Fused mode as a parameter -------------------------------------------------------------------------
# The device tests run twice: in the mode the process started in (eager unless TPUREC_MODE says otherwise),
# and with fused mode as the default (the mode set, and TPUREC_MODE=fused for the processes a test starts),
# except those marked mode_set_by_test (each process they start is given its TPUREC_MODE).
FUSED_TOO = (
    "tests/core/",
    "tests/sparse/test_tpu_device.py",
    "tests/sparse/test_dlrm.py",
    "tests/dense/test_programs.py",
)


def _relative(path: Path) -> str:
    try:
        return path.resolve().relative_to(ROOT).as_posix()
    except ValueError:
        return path.as_posix()


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if metafunc.definition.get_closest_marker("mode_set_by_test") is not None:
        return  # fused mode as the default would change nothing it runs: the same test twice
    if "default_mode" in metafunc.fixturenames and _relative(metafunc.definition.path).startswith(FUSED_TOO):
        metafunc.parametrize("default_mode", ["eager", "fused"], indirect=True, ids=["eager-default", "fused-default"])


def _eager_then_fused(items: list[pytest.Item]) -> list[pytest.Item]:
    """Each file's eager-default tests, then its fused-default ones (as the two runs of a file would be)."""
    blocks: dict[str, list[pytest.Item]] = {}
    for item in items:
        fused = getattr(item, "callspec", None) is not None and item.callspec.params.get("default_mode") == "fused"
        blocks.setdefault(item.nodeid.split("::", 1)[0] + ("::fused" if fused else ""), []).append(item)
    return [item for block in blocks.values() for item in block]


# The files whose fused-default tests started: the first of them starts from no compiled program.
_FUSED_STARTED: set[str] = set()


@pytest.fixture(autouse=True)
def default_mode(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str | None]:
    """The execution mode a FUSED_TOO test starts in (None elsewhere: the process's mode, untouched).

    A file's fused-default tests run after its eager-default ones and start, as a run of their own in a
    fresh process would, with no program compiled (the tests that count compilations and recompilations
    would otherwise see the eager run's programs).
    """
    mode = getattr(request, "param", None)
    if mode is None:
        yield None
        return
    if mode == "fused":
        path = request.node.nodeid.split("::", 1)[0]
        if path not in _FUSED_STARTED:
            _FUSED_STARTED.add(path)
            torch._dynamo.reset()
            headroom.release_programs()
        monkeypatch.setenv("TPUREC_MODE", "fused")
    else:
        monkeypatch.delenv("TPUREC_MODE", raising=False)
    with tpurec.mode(mode):
        yield mode


# --- pytest-xdist (`make test` runs the suite on one worker per core) -----------------------------------
# A file's tests run on one worker, in order (they share module fixtures and warm caches), except in the
# files below, whose multi-process launches are independent: there, each test is a unit of its own (or, where
# prefixes are given, the tests whose names start alike, such as tests sharing a launch through a module fixture).
SPLIT_FILES: dict[str, tuple[str, ...]] = {
    "tests/distributed/test_dmp.py": ("test_two_processes",),
    "tests/distributed/test_dmp_dlrm.py": ("test_two_processes", "test_four_processes"),
    "tests/distributed/test_dmp_fused.py": (),
    "tests/distributed/test_faults.py": ("test_processes_that_disagree", "test_a_lost_process"),
    "tests/examples/test_dlrm_dmp.py": (),
}
# Units are handed out in collection order; the longest go first (the multi-process launches, longest first
# as measured on 2 cores), so that the short ones fill in at the end.
LONGEST_FIRST = (
    "tests/distributed/test_dmp_dlrm.py",
    "tests/distributed/test_dmp.py",
    "tests/distributed/test_dmp_fused.py",
    "tests/distributed/test_fsdp.py",
    "tests/distributed/test_torchrec_model_parallel.py",
    "tests/distributed/test_ddp.py",
    "tests/distributed/test_c10d.py",
    "tests/distributed/test_dmp_checkpoint.py",
    "tests/distributed/test_dmp_pipeline.py",
    "tests/distributed/test_dmp_default_plan.py",
    "tests/examples/test_dlrm_dmp.py",
    "tests/distributed/test_dtensor.py",
    "tests/distributed/test_dmp_uvm.py",
    "tests/sparse/dmp/",
    "tests/distributed/test_functional.py",
    "tests/examples/",
    "tests/sparse/sharding/",
    "tests/test_docs.py",
    "tests/distributed/",
)
# Tests that mostly wait (a lost process is noticed after a 20 s peer timeout): spread one by one between
# the first units, so that while one worker waits the other computes.
SPREAD = ("tests/distributed/test_faults.py",)


def _first_rank(nodeid: str) -> int:
    return next((i for i, prefix in enumerate(LONGEST_FIRST) if nodeid.startswith(prefix)), len(LONGEST_FIRST))


def unit(nodeid: str) -> str:
    """The unit of work ``nodeid`` belongs to: its file, or a part of a SPLIT_FILES file."""
    path, _, name = nodeid.partition("::")
    if path not in SPLIT_FILES:
        return path
    prefix = next((p for p in SPLIT_FILES[path] if name.startswith(p)), None)
    return nodeid if prefix is None else f"{path}::{prefix}"


def _xdist_order(items: list[pytest.Item]) -> list[pytest.Item]:
    """LONGEST_FIRST's order, with the SPREAD tests' units placed one after each of the first other units."""
    spread = [item for item in items if item.nodeid.startswith(SPREAD)]
    others = sorted((item for item in items if not item.nodeid.startswith(SPREAD)), key=lambda i: _first_rank(i.nodeid))
    spread_units: dict[str, list[pytest.Item]] = {}
    for item in spread:
        spread_units.setdefault(unit(item.nodeid), []).append(item)
    waiting = list(spread_units.values())
    ordered: list[pytest.Item] = []
    for i, item in enumerate(others):
        ordered.append(item)
        ends_a_unit = i + 1 == len(others) or unit(others[i + 1].nodeid) != unit(item.nodeid)
        if ends_a_unit and waiting:
            ordered.extend(waiting.pop(0))
    for rest in waiting:
        ordered.extend(rest)
    return ordered


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    items[:] = _eager_then_fused(items)
    if hasattr(config, "workerinput"):  # an xdist worker: every worker orders its identical collection alike
        items[:] = _xdist_order(items)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log):  # noqa: ANN001, ANN201
    """``--dist loadfile`` for this suite: the units of :func:`unit`, in collection order (tests/scheduling.py)."""
    if FileScheduling is None or config.getvalue("dist") != "loadfile":
        return None
    scheduler = FileScheduling(config, log)
    scheduler.unit_of = unit
    return scheduler
