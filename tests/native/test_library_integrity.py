"""The cached native library is loaded only when it matches its build record, and rebuilt otherwise.

Every case runs in a fresh process (with a timeout): loading a damaged shared library
kills the process that loads it, which an in-process test could not survive.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# A batched product on the tpu device runs the native kernel (XLA:CPU, float32, small
# matrices); PyTorch's CPU product is the reference.
SCRIPT = """
import torch, tpurec, tpurec.native
g = torch.Generator().manual_seed(0)
a = torch.randn(4, 3, 5, generator=g)
b = torch.randn(4, 5, 2, generator=g)
got = torch.bmm(a.to("tpu"), b.to("tpu")).cpu()
torch.testing.assert_close(got, torch.bmm(a, b), rtol=1e-5, atol=1e-5)
assert tpurec.native._LOADED is not None, "the native kernel was not used"
print("library", tpurec.native._LOADED._name)
"""


def _env(cache: Path) -> dict[str, str]:
    return {**os.environ, "TPUREC_CACHE_DIR": str(cache), "PYTHONPATH": str(ROOT)}


def _run(cache: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, check=False, timeout=600, env=_env(cache)
    )


def _library(cache: Path) -> Path:
    (library,) = (cache / "native").glob("tpurec_cpu-*.so")
    return library


def _assert_verified(library: Path) -> None:
    record = json.loads(library.with_suffix(".json").read_text())
    data = library.read_bytes()
    assert record["size"] == len(data)
    assert record["sha256"] == hashlib.sha256(data).hexdigest()
    assert library.name == f"tpurec_cpu-{record['build_id'][:16]}.so"


@pytest.fixture(scope="module")
def warm_cache(tmp_path_factory) -> Path:
    cache = tmp_path_factory.mktemp("warm") / "cache"
    result = _run(cache)
    assert result.returncode == 0, result.stderr[-3000:]
    _assert_verified(_library(cache))
    return cache


def _truncate(library: Path) -> None:
    data = library.read_bytes()
    library.write_bytes(data[: len(data) // 2])


def _flip(library: Path) -> None:
    data = bytearray(library.read_bytes())
    for at in range(len(data) // 8, len(data), len(data) // 8):  # across code, tables and symbols
        data[at] ^= 0xFF
    library.write_bytes(bytes(data))


def _empty(library: Path) -> None:
    library.write_bytes(b"")


def _foreign(library: Path) -> None:
    import _ctypes  # any other shared library: loads fine, but has none of the kernels

    shutil.copyfile(_ctypes.__file__, library)


@pytest.mark.parametrize("damage", [_truncate, _flip, _empty, _foreign], ids=lambda f: f.__name__.strip("_"))
def test_a_damaged_library_is_rebuilt_and_gives_the_right_result(warm_cache, tmp_path, damage):
    cache = tmp_path / "cache"
    shutil.copytree(warm_cache, cache)
    library = _library(cache)
    damage(library)
    damaged = library.read_bytes()

    result = _run(cache)

    assert result.returncode == 0, f"exit {result.returncode}\n{result.stderr[-3000:]}"
    assert f"library {library}" in result.stdout
    assert "does not match its build record" in result.stderr and "rebuilding" in result.stderr
    assert library.read_bytes() != damaged
    _assert_verified(library)
    assert not list((cache / "native").glob("*.tmp"))  # the build's temporary file is gone


def test_a_library_without_its_record_is_rebuilt(warm_cache, tmp_path):
    cache = tmp_path / "cache"
    shutil.copytree(warm_cache, cache)
    library = _library(cache)
    library.with_suffix(".json").unlink()
    result = _run(cache)
    assert result.returncode == 0, result.stderr[-3000:]
    _assert_verified(library)


def test_a_verified_library_is_reused_without_a_rebuild(warm_cache, tmp_path):
    cache = tmp_path / "cache"
    shutil.copytree(warm_cache, cache)
    library = _library(cache)
    before = library.stat().st_mtime_ns, library.stat().st_ino
    result = _run(cache)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "rebuilding" not in result.stderr
    assert (library.stat().st_mtime_ns, library.stat().st_ino) == before


def test_processes_starting_at_once_on_an_empty_cache_all_succeed(tmp_path):
    cache = tmp_path / "cache"
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", SCRIPT], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(cache)
        )
        for _ in range(2)
    ]
    outputs = [p.communicate(timeout=600) for p in procs]
    for p, (out, err) in zip(procs, outputs, strict=True):
        assert p.returncode == 0, err[-3000:]
        assert "library" in out
    # One build: the second process waited on the lock and found the first one's library.
    assert all("rebuilding" not in err for _, err in outputs)
    _assert_verified(_library(cache))
    assert not list((cache / "native").glob("*.tmp"))
