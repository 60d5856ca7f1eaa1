"""TorchRec's own tests of its TPU path (``torchrec/experimental/torch_tpu``) on tpurec's tpu device.

TorchRec's wheel ships its TPU modules but not their tests; they are loaded from a TorchRec
source tree, the installed package's root if it ever holds them, else the checkout named by
``TPUREC_TORCHREC_SOURCE`` (``git clone https://github.com/meta-pytorch/torchrec``); without either
the test skips and says so. Each file runs in its own bounded torchrun launch, with 2 processes
where the test needs a process group, through torchrec_tpu_tests_worker.py (the glue is stated
there and in docs/distributed.md). Every test of each file must pass on every rank: none needs
CUDA, so none is excluded.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from launcher import run

HERE = Path(__file__).resolve().parent
SOURCE_VARIABLE = "TPUREC_TORCHREC_SOURCE"
# TorchRec's test files of its TPU path, and the processes each runs in.
SUITES = {
    "torchrec/experimental/torch_tpu/pallas/tests/test_ec_lookup.py": 1,
    "torchrec/experimental/torch_tpu/tests/test_rw_sharding.py": 2,
}
# The tests each file holds (ids as unittest gives them, less the module's name).
TESTS = {
    "torchrec/experimental/torch_tpu/pallas/tests/test_ec_lookup.py": [
        f"ECLookupTest.{name}_{i}_{device}"
        for name in ("test_dispatch", "test_forward_matches_embedding_collection", "test_backward_populates_grads")
        for i, device in enumerate(("cpu", "tpu"))
    ],
    "torchrec/experimental/torch_tpu/tests/test_rw_sharding.py": [
        "RWShardingCorrectnessTest.test_forward_and_backward_match_unsharded_cpu"
    ],
}


def _source(test_file: str) -> Path:
    """The source tree holding ``test_file``: the installed TorchRec's root, else $TPUREC_TORCHREC_SOURCE."""
    import importlib.util

    spec = importlib.util.find_spec("torchrec")
    roots = [Path(spec.origin).parents[1]] if spec is not None and spec.origin else []
    if os.environ.get(SOURCE_VARIABLE):
        roots.append(Path(os.environ[SOURCE_VARIABLE]))
    for root in roots:
        if (root / test_file).is_file():
            return root
    pytest.skip(
        f"{test_file} is not in TorchRec's wheel; set {SOURCE_VARIABLE} to a TorchRec checkout "
        "(git clone https://github.com/meta-pytorch/torchrec) to run TorchRec's tests of its TPU path"
    )


@pytest.mark.slow
@pytest.mark.parametrize("test_file", list(SUITES))
def test_torchrec_tpu_path_tests_pass_on_tpu(tmp_path, test_file):
    source = _source(test_file)
    processes = SUITES[test_file]
    out = tmp_path / "outcomes"
    run(HERE / "torchrec_tpu_tests_worker.py", processes, str(out), str(source), test_file, seconds=420)
    for rank in range(processes):
        outcomes = json.loads(Path(f"{out}.{rank}").read_text())
        by_test = {test_id.split(".", 1)[1] if "." in test_id else test_id: o for test_id, o in outcomes.items()}
        failing = {test_id: o for test_id, o in by_test.items() if o != "passed"}
        assert not failing, f"rank {rank}: " + "\n".join(f"{t}: {o}" for t, o in failing.items())
        assert sorted(by_test) == sorted(TESTS[test_file]), (rank, sorted(by_test))
