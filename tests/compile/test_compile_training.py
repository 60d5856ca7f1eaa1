"""Compiled training (forward + backward through backend="tpu") matches eager tpu and CPU."""

import pytest

import tpurec
from compile_models import train


def _max_rel(a, b):
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


@pytest.mark.parametrize("name", ["mlp", "dlrm", "transformer"])
def test_compiled_training_matches_eager_and_cpu(name):
    cpu = train(name, "cpu", 20, compiled=False)
    eager = train(name, "tpu", 20, compiled=False)
    compiled = train(name, "tpu", 20, compiled=True)
    assert cpu[-1] < cpu[0]
    assert _max_rel(compiled, eager) <= 1e-5, (compiled, eager)
    assert _max_rel(compiled, cpu) <= 1e-5, (compiled, cpu)


@pytest.mark.parametrize("name", ["mlp", "dlrm", "transformer"])
def test_warm_compiled_loop_makes_no_compilations(name):
    marks = {}

    def on_step(step):
        if step == 20:
            tpurec.reset_stats()
            marks["reset"] = True

    train(name, "tpu", 70, compiled=True, on_step=on_step)
    stats = tpurec.stats()
    assert marks
    assert stats["compilations"] == 0, stats
    # forward + backward graphs of 50 steps are served from the program cache
    assert stats["cache_hits"] >= 100, stats


def test_dropout_in_training_mode_matches_eager():
    # Same lowering, same (seed, counter) stream: compiled dropout draws eager's masks.
    eager = train("transformer", "tpu", 5, compiled=False, eval_mode=False)
    compiled = train("transformer", "tpu", 5, compiled=True, eval_mode=False)
    assert _max_rel(compiled, eager) <= 1e-5, (compiled, eager)
