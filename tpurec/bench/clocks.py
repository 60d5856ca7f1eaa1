"""The main thread's CPU clock (``time.thread_time``), and whether it is fine enough to time a step.

Host figures of the benchmarks are main-thread CPU time. On Linux that clock counts nanoseconds;
in some sandboxes it advances in ticks (10 ms under gVisor, which runs the TPU machines of some
clouds), where a step of a few milliseconds reads 0 or 10 ms. A benchmark reports a host figure
only where the clock's tick is at most 10 us or 1% of what it times, and None otherwise (never a 0 that
was not measured), with the tick itself (``thread_clock_tick_us``) in its JSON.

Example::

    host = statistics.median(samples) if clocks.fine_enough(step_seconds) else None
"""

from __future__ import annotations

import functools
import time

__all__ = ["fine_enough", "thread_clock_tick"]


@functools.cache
def thread_clock_tick() -> float:
    """The smallest step of ``time.thread_time()`` seen while spinning (seconds; at most 0.1 s of spinning)."""
    steps: list[float] = []
    deadline = time.perf_counter() + 0.1
    last = time.thread_time()
    while len(steps) < 5 and time.perf_counter() < deadline:
        now = time.thread_time()
        if now != last:
            steps.append(now - last)
            last = now
    return min(steps) if steps else 0.1


def fine_enough(seconds: float) -> bool:
    """Whether the thread clock's tick is at most 1% of ``seconds`` (the span one sample times).

    A tick of 10 us or less always is: what :func:`thread_clock_tick` sees of a nanosecond clock is
    the cost of reading it (about 0.5 us), not a tick.
    """
    tick = thread_clock_tick()
    return tick <= 1e-5 or tick <= 0.01 * seconds
