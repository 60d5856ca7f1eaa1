"""One rank of the persistent-cache test (``torchrun --nproc-per-node N disk_cache_worker.py OUT``).

Each rank of a ``"tpu"`` group (JAX's distributed runtime started, so that JAX sees the rank as its process)
runs a few tpu ops on its own device, drops every program it holds in memory
(:func:`tpurec.core.headroom.release_programs`), runs them again, and writes ``OUT.<rank>``: how many programs
each pass asked JAX's persistent cache for and how many it found there. The folder starts empty
(``TPUREC_CACHE_DIR``), so the first pass compiles, and the second pass must find every program the first one wrote. (The
collectives' programs span processes: they keep JAX's own rule, and are not counted here.)
"""

from __future__ import annotations

import datetime
import faulthandler
import json
import os
import sys

ASKED = "/jax/compilation_cache/compile_requests_use_cache"
FOUND = "/jax/compilation_cache/cache_hits"


def main(out_path: str) -> None:
    import jax
    import torch
    import torch.distributed as dist

    import tpurec  # noqa: F401 (registers the "tpu" backend)
    from tpurec.core import headroom

    dist.init_process_group("tpu", timeout=datetime.timedelta(seconds=60))
    rank = dist.get_rank()
    events: list[str] = []
    jax.monitoring.register_event_listener(lambda event, **_: events.append(event))

    def ops() -> list[float]:
        x = torch.arange(6.0, device="tpu").reshape(2, 3) * 3 + rank
        return x.sin().sum(dim=0).cpu().tolist()

    passes = []
    for _ in range(2):
        events.clear()
        values = ops()
        passes.append({"asked": events.count(ASKED), "found": events.count(FOUND), "values": values})
        headroom.release_programs()
    dist.barrier()
    dist.destroy_process_group()
    with open(f"{out_path}.{rank}", "w") as f:
        json.dump(passes, f)


if __name__ == "__main__":
    faulthandler.dump_traceback_later(float(os.environ.get("TPUREC_TEST_HANG_SECONDS", "150")), exit=True)
    main(sys.argv[1])
