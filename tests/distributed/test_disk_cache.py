"""JAX's persistent compilation cache in a multi-process job: every process, not only process 0, finds the
programs of its own device that it compiled before (the ``xla_disk_cache_every_process`` patch)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from fresh_cache import fresh_cache
from launcher import environment, run

HERE = Path(__file__).resolve().parent


@pytest.mark.slow
def test_every_process_finds_its_own_programs_in_the_cache(tmp_path):
    env = environment(hang_seconds=90, OMP_NUM_THREADS="1", TPUREC_CACHE_DIR=str(fresh_cache(tmp_path / "cache")))
    run(HERE / "disk_cache_worker.py", 2, str(tmp_path / "out"), env=env, seconds=120)
    for rank in range(2):
        first, second = json.loads((tmp_path / f"out.{rank}").read_text())
        assert first["asked"] > 0 and first["found"] == 0, (rank, first)  # an empty folder: all compiled
        # The same programs again, none of them held in memory: each read from the folder, none compiled.
        assert second["asked"] == first["asked"] and second["found"] == second["asked"], (rank, first, second)
        assert second["values"] == first["values"], rank
