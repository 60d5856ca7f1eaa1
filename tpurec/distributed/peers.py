"""The processes of a multi-process job watch each other, so that a failure ends every process in bounded time.

JAX's multi-controller runtime notices a lost process late: a survivor waits in a collective
or in JAX's shutdown barrier for minutes and then aborts with no word about which process is
gone. Here every process posts a heartbeat (a counter and its step) to the JAX coordinator's
key-value store from a background thread and reads everyone else's:

* a process whose heartbeat stops changing for ``TPUREC_PEER_TIMEOUT`` seconds (it died, was
  stopped or hangs with the GIL held) is *lost*: every other process reports it, naming the
  process and the step, and exits (process 0 too: the store lives in a child process of it that
  outlives it, :mod:`tpurec.distributed.coordinator`);
* a process that raises posts its error before it exits, and the others end with that error;
* a process that ends its program posts its last step, so a peer still training fails at
  once ("process 1 finished after step 5 ...") instead of waiting in a collective;
* :func:`exchange` (the agreement before the first collective and the per-step check of the
  sharded model) gives every process every other process's value, or raises
  :class:`PeerLost` / :class:`PeerTimeout`.

The main thread may be inside a collective when a peer is lost, where no Python error can
reach it: then the watching thread prints the error and ends the process (``os._exit``), after
a short grace in which an :func:`exchange` in progress raises it as an exception. At exit a
process waits (bounded) for the others to finish and skips JAX's shutdown barrier when one is
lost, so the job never sits in that barrier.
"""

from __future__ import annotations

import atexit
import json
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

__all__ = [
    "PeerError",
    "PeerLost",
    "PeerMismatch",
    "PeerTimeout",
    "Peers",
    "active",
    "exchange",
    "set_step",
    "start",
]

_PREFIX = "tpurec/peers/"
EXIT_CODE = 1


class PeerError(RuntimeError):
    """Base class: the processes of a multi-process job cannot go on together."""


class PeerLost(PeerError):
    """Another process of the job died, was stopped, hangs, failed or finished early."""


class PeerTimeout(PeerError):
    """Live processes did not reach the same point of the program in ``TPUREC_STEP_TIMEOUT`` seconds."""


class PeerMismatch(PeerError):
    """The processes of the job disagree on something they must share (raised on every process, same text)."""


class Peers:
    """This process's view of the other processes of the job (one per process, see :func:`start`).

    Args:
        client: JAX's distributed runtime client (its key-value store).
        rank: this process's index.
        count: processes in the job.
        peer_timeout: seconds without a heartbeat after which a process is lost.
        step_timeout: seconds :meth:`exchange` waits for live processes.
        on_failure: called with the message when the watching thread ends the process
            (default: print it to stderr and ``os._exit``); tests replace it.
    """

    def __init__(
        self,
        client: Any,
        rank: int,
        count: int,
        peer_timeout: float,
        step_timeout: float,
        on_failure: Callable[[str], None] | None = None,
    ) -> None:
        self.client = client
        self.rank = rank
        self.count = count
        self.peer_timeout = float(peer_timeout)
        self.step_timeout = float(step_timeout)
        self.interval = min(2.0, max(0.1, self.peer_timeout / 10))
        self.step = 0  # the step this process is at (set by the sharded model)
        self.failure: str | None = None  # why the job cannot go on (first reason found)
        self._on_failure = on_failure or self._end
        self._beat = 0
        self._seen: dict[int, tuple[str, float]] = {}  # rank -> (heartbeat value, local time it last changed)
        self._created = self._last_contact = time.monotonic()
        self._finished: dict[int, int] = {}
        self._reached: dict[int, int] = {}  # rank -> the last step it made an exchange for
        self._failed: dict[int, str] = {}
        self._rounds: dict[str, int] = {}
        self.own_failure = False  # this process raised (its traceback is printed already)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._beat_loop, name="tpurec-peers-heartbeat", daemon=True),
            threading.Thread(target=self._watch_loop, name="tpurec-peers-watch", daemon=True),
        ]

    # --- background -----------------------------------------------------------------------

    def begin(self) -> None:
        """Posts the first heartbeat and starts the two threads."""
        self._post_heartbeat()
        for thread in self._threads:
            thread.start()

    def _post_heartbeat(self) -> None:
        self._beat += 1
        self.client.key_value_set(f"{_PREFIX}alive/{self.rank}", f"{self._beat} {self.step}", allow_overwrite=True)

    def _beat_loop(self) -> None:
        """Posts this process's heartbeat and reads the others' (KV calls may block: the watch thread checks this one)."""
        while not self._stop.wait(self.interval):
            try:
                self._post_heartbeat()
                entries = self.client.key_value_dir_get(_PREFIX)
            except Exception:  # the coordinator is gone or unreachable; the watch thread judges how long
                continue
            now = time.monotonic()
            with self._lock:
                self._last_contact = now
                for key, value in entries:
                    kind, _, who = key.removeprefix(_PREFIX).partition("/")
                    if not who.isdigit() or int(who) == self.rank:
                        continue
                    r = int(who)
                    if kind == "alive":
                        old = self._seen.get(r)
                        if old is None or old[0] != value:
                            self._seen[r] = (value, now)
                    elif kind == "finished":
                        self._finished[r] = int(value)
                    elif kind == "failed":
                        self._failed[r] = value

    def _watch_loop(self) -> None:
        """Finds a lost or failed peer; ends the process if the main thread does not raise in time."""
        while not self._stop.wait(self.interval):
            reason = self.check()
            if reason is None:
                continue
            # An exchange in progress raises it in the main thread; give it a moment.
            if self._stop.wait(max(1.0, 2 * self.interval)):
                return
            self._on_failure(reason)
            return

    def check(self) -> str | None:
        """Why the job cannot go on (also recorded in :attr:`failure`), or None while every peer is fine."""
        with self._lock:
            if self.failure is not None:
                return self.failure
            now = time.monotonic()
            reason = None
            if self._failed:
                r = min(self._failed)
                reason = f"process {r} failed: {self._failed[r]}"
            elif now - self._last_contact > self.peer_timeout:
                reason = (
                    f"lost contact with the job's coordinator (on process 0's host) for {self.peer_timeout:g} s at "
                    f"step {self.step} of this process {self.rank}: that host is gone or unreachable, or the "
                    "coordination service ended"
                )
            else:
                for r in range(self.count):
                    if r == self.rank or r in self._finished:
                        continue
                    if self._stale(r, now):
                        beat = self._seen.get(r, ("0 0", 0.0))[0].split()
                        peer_step = max(int(beat[1]) if len(beat) > 1 else 0, self._reached.get(r, 0))
                        reason = (
                            f"process {r} is lost: no heartbeat for {self.peer_timeout:g} s (it died, was stopped "
                            f"or hangs), last seen at its step {peer_step}; this process {self.rank} is at step "
                            f"{self.step}"
                        )
                        break
            if reason is not None:
                self.failure = reason
            return reason

    def _stale(self, r: int, now: float) -> bool:
        """Process ``r``'s heartbeat has not changed for ``peer_timeout`` seconds (hold the lock)."""
        return now - self._seen.get(r, ("", self._created))[1] > self.peer_timeout

    def stop(self) -> None:
        """Stops the threads (tests; the process's end stops them by itself)."""
        self._stop.set()

    # --- what the main thread calls --------------------------------------------------------

    def exchange(self, name: str, value: Any, *, step: int | None = None) -> list[Any]:
        """Every process's ``value`` (JSON-able) for the next round of ``name``, in process order.

        Args:
            name: what is exchanged (rounds are counted per name, so every process must make
                the same exchanges in the same order).
            value: this process's value.
            step: the step the exchange belongs to (for messages; default: :attr:`step`).

        Raises:
            PeerLost: a process died, was stopped, failed or finished before making this exchange.
            PeerTimeout: live processes did not make it within ``step_timeout`` seconds.
        """
        n = self._rounds.get(name, 0)
        self._rounds[name] = n + 1
        step = self.step if step is None else step
        keys = [f"tpurec/exchange/{name}/{n}/{r}" for r in range(self.count)]
        try:
            self.client.key_value_set(keys[self.rank], json.dumps(value))
        except Exception:  # the coordinator is unreachable: say so once the watch finds out why
            deadline = time.monotonic() + self.peer_timeout + 3 * self.interval
            while time.monotonic() < deadline:
                reason = self.check()
                if reason is not None:
                    raise PeerLost(reason) from None
                time.sleep(self.interval / 2)
            raise
        values: list[Any] = [None] * self.count
        values[self.rank] = value
        waiting = [r for r in range(self.count) if r != self.rank]
        start = time.monotonic()
        pause = 0.0005
        while waiting:
            for r in list(waiting):
                got = self._try_get(keys[r])
                if got is not None:
                    values[r] = json.loads(got)
                    waiting.remove(r)
                    self._reached[r] = max(self._reached.get(r, 0), step)
            if not waiting:
                break
            with self._lock:
                finished = {r: self._finished[r] for r in waiting if r in self._finished}
            if finished and not any(self._try_get(keys[r]) is not None for r in finished):
                # (read again: a process posts its last value before it posts that it finished)
                r, last = min(finished.items())
                self._fail(
                    f"process {r} finished its program after step {last} while process {self.rank} is at step "
                    f"{step}: every process must run the same number of steps"
                )
            reason = self.check()
            if reason is not None:
                raise PeerLost(reason)
            if time.monotonic() - start > self.step_timeout:
                self._fail(
                    f"processes {waiting} did not reach {name!r} (step {step}) within {self.step_timeout:g} s "
                    f"(TPUREC_STEP_TIMEOUT) though they are alive; every process must make the same calls",
                    PeerTimeout,
                )
            time.sleep(pause)
            pause = min(pause * 2, 0.05)
        if n:  # everyone has read round n - 1 (they posted round n after it)
            self.client.key_value_delete(f"tpurec/exchange/{name}/{n - 1}/{self.rank}")
        return values

    def _end(self, message: str) -> None:
        """The watching thread's end of the process: tells the others, then :func:`_end_process`."""
        self.post_failure(message)
        _end_process(message)

    def _try_get(self, key: str) -> str | None:
        try:
            return self.client.key_value_try_get(key)
        except Exception:  # NOT_FOUND (not posted yet); a lost coordinator is judged by check()
            return None

    def _fail(self, message: str, kind: type[PeerError] = PeerLost) -> None:
        with self._lock:
            self.failure = self.failure or message
        raise kind(message)

    def post_failure(self, message: str, own: bool = False) -> None:
        """Tells the other processes that this one fails with ``message`` (they end with it).

        Args:
            message: the error.
            own: it is this process's own error (an uncaught exception), not a peer's.
        """
        with self._lock:
            if self.failure is None:
                self.failure, self.own_failure = message, own
        try:
            self.client.key_value_set(f"{_PREFIX}failed/{self.rank}", message, allow_overwrite=True)
        except Exception:  # the coordinator is gone: the others find this process lost instead
            pass

    def finish(self) -> str | None:
        """At the program's end: posts this process's last step and waits for the others to finish.

        When the job fails, waits instead (bounded) until every other process has seen it (it
        posted its own failure) or is lost: the coordinator (a child of process 0, see
        :mod:`tpurec.distributed.coordinator`) ends soon after process 0, and a process that
        loses it before it has read why would end with a message saying nothing but that.

        Returns:
            None when every process finished, else why not (a process was lost or failed).
        """
        if self.failure is None:
            try:
                self.client.key_value_set(f"{_PREFIX}finished/{self.rank}", str(self.step), allow_overwrite=True)
            except Exception:
                pass
        start = time.monotonic()
        while self.failure is None:
            with self._lock:
                if len(self._finished) == self.count - 1:
                    return None
                waiting = [r for r in range(self.count) if r != self.rank and r not in self._finished]
            if self.check() is not None:
                break
            if time.monotonic() - start > self.step_timeout:
                self.post_failure(
                    f"processes {waiting} did not finish within {self.step_timeout:g} s (TPUREC_STEP_TIMEOUT) of "
                    f"process {self.rank} finishing its program after step {self.step}, though they are alive: they "
                    "may wait in a collective that this process did not make"
                )
                break
            time.sleep(self.interval / 2)
        deadline = time.monotonic() + self.peer_timeout + 2 * self.interval
        while time.monotonic() < deadline:
            with self._lock:
                now = time.monotonic()
                if all(r == self.rank or r in self._failed or self._stale(r, now) for r in range(self.count)):
                    break
            time.sleep(self.interval / 2)
        return self.failure


_peers: Peers | None = None


def active() -> Peers | None:
    """This process's :class:`Peers` in a multi-process job started by ``tpurec.distributed.initialize``, else None."""
    return _peers


def set_step(step: int) -> None:
    """Records the step this process is at (named in the messages about lost processes)."""
    if _peers is not None:
        _peers.step = max(_peers.step, step)
        # The heartbeat thread posts it with the next beat.


def exchange(name: str, value: Any, *, step: int | None = None) -> list[Any]:
    """Every process's ``value`` for the next round of ``name`` (``[value]`` in a one-process job); see :meth:`Peers.exchange`."""
    if _peers is None:
        return [value]
    return _peers.exchange(name, value, step=step)


_ending = threading.Lock()


def _end_process(message: str) -> None:
    """Ends this process with the failure, skipping JAX's shutdown (a peer is gone, it would wait for it).

    Once per process: a second thread that gets here (the watch thread and JAX's coordinator
    callback may both find a failure) waits for the first to end the process.
    """
    if not _ending.acquire(blocking=False):
        while True:
            time.sleep(60)
    try:
        print(f"tpurec: {message}; ending this process (exit status {EXIT_CODE})", file=sys.stderr, flush=True)
        sys.stdout.flush()
    finally:
        os._exit(EXIT_CODE)


def start(client: Any, rank: int, count: int, peer_timeout: float, step_timeout: float) -> Peers:
    """Starts watching the other processes (``initialize`` calls it once, after JAX's start-up).

    Also registers an exit hook: it posts an uncaught exception to the others, waits for them
    (bounded) and skips JAX's shutdown barrier when one is lost or failed.
    """
    global _peers
    peers = Peers(client, rank, count, peer_timeout, step_timeout)
    peers.begin()
    _peers = peers

    # JAX registered its shutdown (a barrier that waits for every process) at import; atexit runs
    # hooks last-in first-out, so this one runs before it.
    def at_exit() -> None:
        # An uncaught exception ended the program: Python printed it and set sys.last_value before
        # running the exit hooks. The others end with it (the first line of what was printed).
        error = getattr(sys, "last_value", None)
        if error is not None:
            text = "".join(traceback.format_exception_only(type(error), error)).strip().splitlines()
            peers.post_failure(text[-1] if text else type(error).__name__, own=True)
            peers.own_failure = True
        reason = peers.finish()
        peers.stop()
        if reason is not None:
            if peers.own_failure:  # its traceback is printed: just skip JAX's shutdown barrier
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(EXIT_CODE)
            peers.post_failure(reason)
            _end_process(reason)

    atexit.register(at_exit)
    return peers
