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
