"""The persistent cache folder: an unusable one costs the cache, never the import or the run."""

import os
import subprocess
import sys

import pytest

SCRIPT = """
import warnings
warnings.simplefilter("default")
import torch, tpurec
import tpurec.native
x = torch.arange(6.0, device="tpu") * 2
print("sum", float(x.sum().cpu()))
print("native", tpurec.native.library_path())
"""


@pytest.mark.parametrize("case", ["a-file-in-its-place", "below-a-file"])
def test_an_unusable_cache_folder_falls_back_to_a_private_one_with_one_warning(tmp_path, case):
    blocker = tmp_path / "blocker"
    blocker.write_text("not a folder")
    root = blocker if case == "a-file-in-its-place" else blocker / "cache"
    private = tmp_path / "tmp"  # where the fallback goes (removed with tmp_path)
    private.mkdir()
    env = {**os.environ, "TPUREC_CACHE_DIR": str(root), "TMPDIR": str(private)}
    result = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=600, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "sum 30.0" in result.stdout
    warnings = [line for line in result.stderr.splitlines() if "is not writable" in line]
    assert len(warnings) == 1, result.stderr[-3000:]
    assert str(root) in warnings[0] and "TPUREC_CACHE_DIR" in warnings[0]
    native = result.stdout.split("native ", 1)[1].strip()
    assert native.startswith(str(private / "tpurec-cache-")), native
    assert blocker.read_text() == "not a folder"


WARM = """
import torch, tpurec
tpurec.reset_stats()
g = torch.Generator().manual_seed(0)
a, b = torch.randn(4, 3, 5, generator=g), torch.randn(4, 5, 2, generator=g)
y = (torch.bmm(a.to("tpu"), b.to("tpu")).relu() * 2).sum().cpu()
s = tpurec.stats()
print("counts", s["compile_requests"], s["disk_hits"], s["compilations"])
"""


def _counts(cache) -> tuple[int, int, int]:
    env = {
        **os.environ,
        "TPUREC_CACHE_DIR": str(cache),
        "PYTHONPATH": os.path.dirname(os.path.dirname(os.path.dirname(__file__))),
    }
    result = subprocess.run(
        [sys.executable, "-c", WARM], capture_output=True, text=True, timeout=600, env=env, check=False
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "rebuilding" not in result.stderr  # the native library moved with the cache and is reused
    requests, hits, compilations = map(int, result.stdout.split("counts", 1)[1].split())
    return requests, hits, compilations


@pytest.mark.parametrize("how", ["moved", "copied"])
def test_a_warm_cache_moved_or_copied_elsewhere_is_still_hit(tmp_path, how):
    import shutil

    first = tmp_path / "first"
    requests, hits, compilations = _counts(first)
    assert requests > 0 and compilations == requests and hits == 0  # a cold cache compiles everything
    second = tmp_path / "second"
    (shutil.move if how == "moved" else shutil.copytree)(first, second)
    again = _counts(second)
    assert again == (requests, requests, 0), again  # every program from the disk cache, none compiled
