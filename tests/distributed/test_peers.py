"""tpurec.distributed.peers and the sharded model's fingerprint, in one process.

Two :class:`Peers` over an in-memory key-value store (what JAX's coordinator client offers) play
a two-process job; the subprocess tests (test_faults.py) run the real one.
"""

from __future__ import annotations

import threading
import time

import pytest

from tpurec.distributed import peers
from tpurec.sparse.sharding.fingerprint import first_difference


class Store:
    """The key-value calls of JAX's DistributedRuntimeClient that peers.py uses, in memory."""

    def __init__(self) -> None:
        self.data: dict[str, str] = {}
        self.lock = threading.Lock()
        self.down = False

    def _up(self) -> None:
        if self.down:
            raise RuntimeError("UNAVAILABLE: coordinator gone")

    def key_value_set(self, key: str, value: str, allow_overwrite: bool = False) -> None:
        self._up()
        with self.lock:
            if key in self.data and not allow_overwrite:
                raise RuntimeError(f"ALREADY_EXISTS: {key}")
            self.data[key] = value

    def key_value_try_get(self, key: str) -> str:
        self._up()
        with self.lock:
            if key not in self.data:
                raise RuntimeError(f"NOT_FOUND: {key}")
            return self.data[key]

    def key_value_dir_get(self, prefix: str) -> list[tuple[str, str]]:
        self._up()
        with self.lock:
            return [(k, v) for k, v in self.data.items() if k.startswith(prefix)]

    def key_value_delete(self, key: str) -> None:
        with self.lock:
            self.data.pop(key, None)


def _pair(store: Store, timeout: float = 1.0, step_timeout: float = 30.0):
    ended: list[str] = []
    pair = [peers.Peers(store, r, 2, timeout, step_timeout, on_failure=ended.append) for r in range(2)]
    for p in pair:
        p.begin()
    return pair, ended


def _both(pair, call):
    """Runs ``call(peer)`` on both peers at once; their results (or the exceptions they raised)."""
    results: list = [None, None]

    def run(r: int) -> None:
        try:
            results[r] = call(pair[r])
        except Exception as error:  # noqa: BLE001  (the test compares them)
            results[r] = error

    threads = [threading.Thread(target=run, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return results


def test_exchange_gives_every_process_every_value_round_after_round():
    store = Store()
    pair, ended = _pair(store)
    try:
        for n in range(5):
            assert (
                _both(pair, lambda p: p.exchange("x", {"rank": p.rank, "n": n}))
                == [[{"rank": 0, "n": n}, {"rank": 1, "n": n}]] * 2
            )
        # Old rounds are deleted: the store does not grow with the steps.
        assert len([k for k in store.data if k.startswith("tpurec/exchange/x/")]) <= 4
        assert ended == [] and all(p.check() is None for p in pair)
    finally:
        for p in pair:
            p.stop()


def test_a_process_whose_heartbeat_stops_is_lost_and_named():
    store = Store()
    pair, ended = _pair(store, timeout=1.0)
    try:
        pair[0].step = 3
        pair[1].stop()  # process 1 stops beating (as SIGSTOP or SIGKILL would)
        start = time.monotonic()
        with pytest.raises(
            peers.PeerLost, match=r"process 1 is lost: no heartbeat for 1 s .*this process 0 is at step 3"
        ):
            pair[0].exchange("step/0", 1)
        assert time.monotonic() - start < 5
        time.sleep(3 * pair[0].interval + 1.5)
        assert ended and "process 1 is lost" in ended[0]  # the watching thread would end the process
    finally:
        for p in pair:
            p.stop()


def test_a_process_that_finished_early_fails_the_others_exchange():
    store = Store()
    pair, _ = _pair(store)
    try:
        pair[1].step = 2
        done = threading.Thread(target=pair[1].finish)
        done.start()
        pair[0].step = 3
        with pytest.raises(
            peers.PeerLost, match="process 1 finished its program after step 2 while process 0 is at step 3"
        ):
            pair[0].exchange("step/0", 1)
        pair[0].post_failure(str(pair[0].failure))
        done.join(10)
        assert "process 0 failed: process 1 finished its program after step 2" in str(pair[1].failure)
    finally:
        for p in pair:
            p.stop()


def test_a_failed_process_ends_the_others_with_its_error():
    store = Store()
    pair, _ = _pair(store)
    try:
        pair[1].post_failure("ValueError: bad batch", own=True)
        with pytest.raises(peers.PeerLost, match="process 1 failed: ValueError: bad batch"):
            pair[0].exchange("step/0", 1)
    finally:
        for p in pair:
            p.stop()


def test_a_lost_coordinator_is_named():
    store = Store()
    pair, _ = _pair(store, timeout=1.0)
    try:
        store.down = True
        with pytest.raises(peers.PeerLost, match=r"lost contact with the job's coordinator \(on process 0's host\)"):
            pair[1].exchange("step/0", 1)
    finally:
        for p in pair:
            p.stop()


def test_live_processes_that_never_arrive_time_out():
    store = Store()
    pair, _ = _pair(store, step_timeout=1.0)
    try:
        with pytest.raises(peers.PeerTimeout, match=r"processes \[1\] did not reach 'step/0' \(step 0\) within 1 s"):
            pair[0].exchange("step/0", 1)
    finally:
        for p in pair:
            p.stop()


def test_first_difference_names_the_path_and_both_values():
    a = {
        "collection c": {"tables": {"t0": {"rows": 40, "shards": [[0, 40, 0, 8, 6]]}, "t1": {"rows": 3}}},
        "dense": {"w": "[2, 3] float32"},
    }
    b = {
        "collection c": {"tables": {"t0": {"rows": 40, "shards": [[0, 40, 0, 8, 5]]}, "t1": {"rows": 3}}},
        "dense": {"w": "[2, 4] float32"},
    }
    assert first_difference(a, a) is None
    assert first_difference(a, b) == ("collection c.tables.t0.shards[0][4]", 6, 5)
    assert first_difference({"x": 1}, {"x": 1, "y": 2}) == ("y", "(none)", 2)
    assert first_difference({"s": [1, 2]}, {"s": [1]}) == ("s", [1, 2], [1])


def test_one_process_jobs_exchange_nothing():
    assert peers.active() is None
    assert peers.exchange("anything", {"a": 1}) == [{"a": 1}]


def test_the_seed_of_tables_born_on_meta_is_part_of_the_fingerprint():
    # Each process creates its own shards of a table on meta: a different seed is a different model.
    from tpurec.sparse.sharding.fingerprint import model_fingerprint

    def fingerprint(seed):
        return model_fingerprint(
            {}, {}, [], mesh_shape=(2, 4), capacity=None, overflow="raise", optimizer=None, seed=seed
        )

    assert first_difference(fingerprint(0), fingerprint(1)) == ("seed of the tables on meta", 0, 1)
    assert "seed of the tables on meta" not in fingerprint(None)  # no table on meta: the seed is not used
