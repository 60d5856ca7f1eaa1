"""The README's examples run and learn."""

import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run(script, *args):
    out = subprocess.run(
        [sys.executable, os.path.join(ROOT, script), *args], capture_output=True, text=True, timeout=600, cwd=ROOT
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["eager", "fused", "compile"])
def test_dlrm_example_learns_without_recompiling(mode):
    text = run(
        "examples/dlrm/train.py",
        "--batch_size",
        "256",
        "--num_embeddings",
        "1000",
        "--embedding_dim",
        "16",
        "--dense_arch_layer_sizes",
        "32,16",
        "--over_arch_layer_sizes",
        "32,1",
        "--adagrad",
        "--learning_rate",
        "0.05",
        "--limit_train_batches",
        "60",
        "--limit_val_batches",
        "4",
        "--limit_test_batches",
        "4",
        "--mode",
        mode,
    )
    losses = re.search(r"(\d+) steps, last loss (\d+\.\d+)", text)
    assert int(losses.group(1)) == 60 and float(losses.group(2)) < 0.6, text
    auc = float(re.search(r"held-out AUC (\d+\.\d+)", text).group(1))
    assert auc > 0.75, text
    assert re.search(r"\b0 compilations after warm-up", text), text


def test_quickstart_runs_tpu_and_cpu_side_by_side():
    text = run("examples/quickstart.py", "--steps", "20")
    rows = re.findall(r"^\s+(\d+)\s+(\d+\.\d+)\s+(\d+\.\d+)$", text, flags=re.M)
    assert rows and float(rows[-1][1]) < float(rows[0][1])
    assert abs(float(rows[-1][1]) - float(rows[-1][2])) <= 1e-4 * float(rows[-1][2])


def _make_recipes() -> dict[str, str]:
    """Makefile target -> its recipe lines, joined."""
    recipes: dict[str, str] = {}
    target = None
    with open(os.path.join(ROOT, "Makefile")) as f:
        for line in f:
            if line.startswith("\t") and target:
                recipes[target] += line
            else:
                match = re.match(r"^([A-Za-z][\w.-]*):", line)
                target = match.group(1) if match else None
                if target:
                    recipes[target] = ""
    return recipes


@pytest.mark.parametrize("script", sorted(f for f in os.listdir(os.path.join(ROOT, "examples")) if f.endswith(".py")))
def test_make_target_named_in_an_example_runs_it(script):
    """An example's "Run with ``make T``" names the target that runs that very file."""
    with open(os.path.join(ROOT, "examples", script)) as f:
        targets = re.findall(r"``make (\w+)``", f.read())
    recipes = _make_recipes()
    for target in targets:
        assert f"examples/{script}" in recipes.get(target, ""), (
            f"examples/{script} names `make {target}`, which does not run it"
        )
