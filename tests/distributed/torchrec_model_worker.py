"""One rank of TorchRec's own model-parallel test (``torchrun --nproc-per-node N torchrec_model_worker.py CASE[,CASE...]``).

Runs ``torchrec.distributed.test_utils.test_sharding.sharding_single_rank_test_single_process``
(what TorchRec's ``ModelParallelTestShared._test_sharding`` runs in each rank) on the ``tpu`` device:
TorchRec's ``TestSparseNN`` (an EmbeddingBagCollection and a weighted one, the tables of
``ModelParallelTestShared``), planned by TorchRec's ``EmbeddingShardingPlanner``, sharded by DMP,
trained and compared by TorchRec's own code with the same model unsharded. The cases:

* ``default``: TorchRec's default sharder (``EmbeddingBagCollectionSharder``), no constraints;
* ``<sharding type>_<kernel>``: the sharder TorchRec's tests make with ``create_test_sharder``
  (``TestEBCSharder``, learning rate 0.1), every table of that sharding type on that kernel, as its
  tests parametrize ``sharding_type`` and ``kernel_type`` (``DENSE`` is data-parallel only there).

The glue, and why: TorchRec's wheel leaves out ``torchrec.distributed.tests``, which
``test_sharding`` imports for the 2D-parallel sharder only; a module in its place holds a sharder
that raises if used. The process group is ``"cpu:gloo,tpu:tpu"`` made by torchrun (TorchRec's
``MultiProcessContext`` picks CUDA or CPU), and ``local_size=1`` (one tpu device per process: rank
``r``'s shards on its ``tpu:0``). Each rank writes ``OUT.<rank>``: ``<case> passed`` per line.
"""

from __future__ import annotations

import datetime
import faulthandler
import os
import sys
import types
from typing import Any, cast

CASES = ("default", "data_parallel_dense", "table_wise_fused", "row_wise_fused", "column_wise_fused")


def stand_in_for_the_missing_tests_package() -> None:
    class TestEmbeddingCollectionSharder:
        """TorchRec's 2D-parallel test sharder, not in its wheel."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            raise NotImplementedError("torchrec.distributed.tests is not in TorchRec's wheel (2D-parallel tests)")

    package = types.ModuleType("torchrec.distributed.tests")
    module = types.ModuleType("torchrec.distributed.tests.test_sequence_model")
    module.TestEmbeddingCollectionSharder = TestEmbeddingCollectionSharder  # pyright: ignore[reportAttributeAccessIssue]
    sys.modules.setdefault(package.__name__, package)
    sys.modules.setdefault(module.__name__, module)


def run_case(case: str) -> None:
    """TorchRec's single-rank sharding test of ``case`` on this rank's tpu device."""
    import torch
    import torch.distributed as dist
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.test_utils.test_model import TestSparseNN
    from torchrec.distributed.test_utils.test_sharding import (
        SharderType,
        create_test_sharder,
        sharding_single_rank_test_single_process,
    )
    from torchrec.modules.embedding_configs import EmbeddingBagConfig

    # ModelParallelTestShared's tables (without its shared features).
    tables = [
        EmbeddingBagConfig(
            num_embeddings=(i + 1) * 10, embedding_dim=(i + 2) * 8, name=f"table_{i}", feature_names=[f"feature_{i}"]
        )  # fmt: skip
        for i in range(4)
    ]
    weighted = [
        EmbeddingBagConfig(
            num_embeddings=(i + 1) * 10,
            embedding_dim=(i + 2) * 4,
            name=f"weighted_table_{i}",
            feature_names=[f"weighted_feature_{i}"],
        )  # fmt: skip
        for i in range(2)
    ]
    if case == "default":
        sharder: Any = EmbeddingBagCollectionSharder()
    else:
        sharding_type, _, kernel = case.rpartition("_")
        sharder = create_test_sharder(SharderType.EMBEDDING_BAG_COLLECTION.value, sharding_type, kernel)
    sharding_single_rank_test_single_process(
        pg=cast(Any, dist.GroupMember.WORLD), device=torch.device("tpu"), rank=dist.get_rank(),
        world_size=dist.get_world_size(), model_class=cast(Any, TestSparseNN),
        embedding_groups={"group_0": [f for t in tables for f in t.feature_names]}, tables=cast(Any, tables),
        weighted_tables=cast(Any, weighted), sharders=[sharder], optim=EmbOptimType.EXACT_SGD, local_size=1,
    )  # fmt: skip


def main(out_path: str, cases: list[str]) -> None:
    import torch.distributed as dist

    import tpurec  # noqa: F401 (registers the "tpu" backend)

    stand_in_for_the_missing_tests_package()
    dist.init_process_group("cpu:gloo,tpu:tpu", timeout=datetime.timedelta(seconds=120))
    done = []
    for case in cases:
        if case not in CASES:
            raise ValueError(f"unknown case {case!r}: use one of {CASES}")
        run_case(case)
        done.append(f"{case} passed")
    with open(f"{out_path}.{dist.get_rank()}", "w") as f:
        f.write("\n".join(done) + "\n")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    # A hung collective ends this rank with every thread's stack instead of stalling the test.
    faulthandler.dump_traceback_later(float(os.environ.get("TPUREC_TEST_HANG_SECONDS", "150")), exit=True)
    main(sys.argv[1], sys.argv[2].split(","))
