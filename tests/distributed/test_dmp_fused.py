"""TorchRec's DistributedModelParallel with the optimizer fused into the backward, on the tpu device:
``apply_optimizer_in_backward`` (SGD, Adagrad, RowWiseAdagrad, Adam) on TorchRec's own
EmbeddingBagCollection, TorchRec's planner with the FUSED kernel, a mixed table-, row- and
column-wise plan on 2 and 4 processes, trains like FBGEMM's fused TBE on CPU in one process, and
``model.fused_optimizer``'s state equals the TBE's; what tpurec cannot run exactly is refused
(see dmp_fused_worker.py)."""

from __future__ import annotations

from pathlib import Path

import dmp_fused_worker as worker  # beside this file
import numpy as np
import pytest
from launcher import run

HERE = Path(__file__).resolve().parent

SECONDS = 540


def _check(out: Path, plan: str, optimizer: str, processes: int, mean: bool = False, half: bool = False) -> None:
    """Losses (1e-5 relative), tables and optimizer state assembled from the ranks equal FBGEMM's on CPU."""
    losses, tables, states = worker.reference(plan, optimizer, mean, half)
    name = f"{plan}.{optimizer}{'.mean' if mean else ''}{'.fp16' if half else ''}"
    ranks = [np.load(f"{out}.{name}.{rank}.npz") for rank in range(processes)]
    np.testing.assert_allclose(ranks[0]["losses"], losses, rtol=1e-5, atol=0, err_msg=f"{plan}/{optimizer}: losses")
    assembled = {name: np.full_like(t, np.nan) for name, t in tables.items()}
    got_states: dict[str, np.ndarray] = {}
    for got in ranks:
        for key in got.files:
            if key.startswith("table|"):
                _, name, r0, c0 = key.split("|")
                block = got[key]
                assembled[name][int(r0) : int(r0) + block.shape[0], int(c0) : int(c0) + block.shape[1]] = block
            elif key.startswith("state|"):
                _, name, j, r0, c0 = key.split("|")
                want = states[f"{name}|{j}|{c0}"] if f"{name}|{j}|{c0}" in states else states[f"{name}|{j}|0"]
                block = got[key]
                if block.shape[1] != want.shape[1]:  # an element-wise state of a column shard
                    want = want[:, int(c0) : int(c0) + block.shape[1]]
                got_states[key] = block
                np.testing.assert_allclose(
                    block, want[int(r0) : int(r0) + block.shape[0]], rtol=1e-5, atol=1e-6, err_msg=f"{optimizer}: {key}"
                )
    for name, want in tables.items():
        np.testing.assert_allclose(assembled[name], want, rtol=1e-5, atol=1e-6, err_msg=f"{plan}/{optimizer}: {name}")
    if optimizer != "sgd":
        assert got_states, "no optimizer state came back"


@pytest.mark.slow
def test_two_processes_mixed_plan_every_optimizer(tmp_path):
    optimizers = ("sgd", "adagrad", "rowwise", "adam")
    run(HERE / "dmp_fused_worker.py", 2, str(tmp_path / "two"), ",".join(f"mixed:{o}" for o in optimizers),
           seconds=SECONDS)  # fmt: skip
    for optimizer in optimizers:
        _check(tmp_path / "two", "mixed", optimizer, 2)


MEAN_RUNS = (("table_wise", "sgd"), ("row_wise", "adagrad"), ("column_wise", "sgd"))


@pytest.mark.slow
def test_two_processes_mean_pooling_as_fbgemm(tmp_path):
    # MEAN-pooled tables (it was refused: NotImplementedError): table- and column-wise shards pool each bag's
    # mean in the kernel (FBGEMM's MEAN), a row-wise shard sums and TorchRec divides by the lengths after its
    # output distribution; each as FBGEMM's MEAN-pooled TBE on CPU. (One sharding type a run: TorchRec's
    # division after the output distribution divides every feature but the row-wise SUM ones.)
    run(HERE / "dmp_fused_worker.py", 2, str(tmp_path / "mean"), ",".join(f"{p}:{o}:mean" for p, o in MEAN_RUNS),
        seconds=SECONDS)  # fmt: skip
    for plan, optimizer in MEAN_RUNS:
        _check(tmp_path / "mean", plan, optimizer, 2, mean=True)


@pytest.mark.slow
def test_two_processes_column_wise_plan(tmp_path):
    # Every group on tpurec's fused kernel and column-wise: TorchRec's output distribution calls
    # torch.ops.torchrec.permute_pooled_embs, which nothing had defined (AttributeError before).
    run(HERE / "dmp_fused_worker.py", 2, str(tmp_path / "cw"), "column_wise:sgd,column_wise:rowwise", seconds=SECONDS)
    for optimizer in ("sgd", "rowwise"):
        _check(tmp_path / "cw", "column_wise", optimizer, 2)


@pytest.mark.slow
def test_two_processes_fp16_tables_as_fbgemm(tmp_path):
    # FP16 tables (refused before: NotImplementedError): float16 weights, float32 optimizer state, each row's
    # update rounded back to nearest as FBGEMM's CPU TBE with weights_precision FP16. The loss is linear with
    # weights of multiples of 1/8, so every gradient is exact in any order of addition and the rounded tables
    # may not differ at all (the bounds are below float16's unit in the last place); with the squared error
    # a gradient's last float32 bit, which the order of addition sets, moved a float16 rounding at step 4.
    optimizers = ("sgd", "rowwise")
    run(HERE / "dmp_fused_worker.py", 2, str(tmp_path / "half"), ",".join(f"mixed:{o}:fp16" for o in optimizers),
        seconds=SECONDS)  # fmt: skip
    for optimizer in optimizers:
        _check(tmp_path / "half", "mixed", optimizer, 2, half=True)


@pytest.mark.slow
def test_four_processes_row_wise_rowwise_adagrad(tmp_path):
    run(HERE / "dmp_fused_worker.py", 4, str(tmp_path / "four"), "row_wise:rowwise", seconds=SECONDS)
    _check(tmp_path / "four", "row_wise", "rowwise", 4)


@pytest.mark.slow
def test_what_tpurec_cannot_run_exactly_is_refused_and_the_learning_rate_is_passed_on(tmp_path):
    run(HERE / "dmp_fused_worker.py", 1, str(tmp_path / "e"), "errors", seconds=SECONDS)
    lines = dict(line.split(" ", 1) for line in (tmp_path / "e.errors.0").read_text().splitlines())
    expected = {
        "unfused_in_backward": "UNFUSED_TPU kernel ignores the in-backward optimizer",
        "lamb": "LAMB is not run by tpurec",
        "weight_decay": "weight_decay=0.01",
        "clipping": "fused_params['gradient_clipping'] = True",
        "adam_fp16": "are FP16/BF16 and the fused optimizer is Adam",
        "int8": "INT8 tables with the FUSED kernel on tpu are not run",
    }
    # Row 2 is looked up twice: one update of the summed gradient (2 * lr), row 1 once (lr).
    assert lines["learning_rate"] == "lr=0.0 rows=[] delta=0.0000; lr=0.1 rows=[1, 2] delta=0.2000", lines
    for case, words in expected.items():
        assert lines[case].startswith("NotImplementedError") and words in lines[case], (case, lines[case])
