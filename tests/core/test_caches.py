"""The persistent cache folder: an unusable one costs the cache, never the import or the run; a second
process reads every program of a training step (fused, captured, several steps per launch) from it."""

import os
import subprocess
import sys

import pytest
from fresh_cache import fresh_cache

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

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

    first = fresh_cache(tmp_path / "first")
    requests, hits, compilations = _counts(first)
    assert requests > 0 and compilations == requests and hits == 0  # a cold cache compiles everything
    second = tmp_path / "second"
    (shutil.move if how == "moved" else shutil.copytree)(first, second)
    again = _counts(second)
    assert again == (requests, requests, 0), again  # every program from the disk cache, none compiled


STEPS = """
import json, torch, tpurec
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1)).to("tpu")
optimizer = torch.optim.Adagrad(model.parameters(), lr=0.1, fused=True)
g = torch.Generator().manual_seed(1)
x, y = torch.randn(32, 8, generator=g).to("tpu"), torch.randn(32, 1, generator=g).to("tpu")
xs = torch.randn(4, 32, 8, generator=g).to("tpu")
tpurec.reset_stats()
losses = []
with tpurec.mode("fused"):
    def step():
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        return loss
    for _ in range(2):  # fused steps: the optimizer's state, then the steady step
        losses.append(step().item())
    graph = tpurec.TpuGraph()
    with tpurec.graph(graph):  # the captured step
        loss = step()
    losses.append(loss.item())
    (series,) = graph.replay_steps({x: xs}, collect=[loss], compile_in_background=True)  # 4 steps, one program
    graph.wait_for_compiles(timeout=300)
    (series,) = graph.replay_steps({x: xs}, collect=[loss], compile_in_background=True)
    losses += series.tolist()
s = tpurec.stats()
print("STATS", json.dumps({
    "requests": s["compile_requests"], "hits": s["disk_hits"], "compilations": s["compilations"],
    "programs": sorted(label for label, e in s["compiles_by_program"].items() for _ in range(e["programs"])),
    "cache_load": s["compile_phases"]["cache_load"], "losses": losses,
}))
"""


def _step_stats(cache) -> dict:
    import json

    env = {**os.environ, "TPUREC_CACHE_DIR": str(cache), "PYTHONPATH": ROOT}
    result = subprocess.run([sys.executable, "-c", STEPS], capture_output=True, text=True, timeout=600, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.split("STATS ", 1)[1])


def test_a_second_process_reads_every_program_of_the_steps_from_the_shared_cache(tmp_path):
    """Two processes, one cache folder: the first compiles the fused steps, the captured step and the
    program of 4 captured steps (compiled on a background thread); the second reads each from disk."""
    first = _step_stats(fresh_cache(tmp_path / "cache"))
    assert first["requests"] > 0 and first["hits"] == 0 and first["compilations"] == first["requests"], first
    assert "captured step x4" in first["programs"], first["programs"]
    second = _step_stats(tmp_path / "cache")
    assert second["requests"] == first["requests"], (first, second)
    assert second["hits"] == second["requests"] and second["compilations"] == 0, second
    assert second["programs"] == first["programs"] and second["cache_load"] > 0
    assert second["losses"] == first["losses"] and len(first["losses"]) == 7
