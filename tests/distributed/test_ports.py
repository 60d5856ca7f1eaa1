"""The multi-process tests' port choice: a pair outside the kernel's ephemeral range, both ends free."""

from __future__ import annotations

import socket

import ports
import pytest
from ports import candidate_ports, ephemeral_range, free_port_pair


def test_free_port_pairs_lie_outside_the_ephemeral_range_and_can_be_bound() -> None:
    low, high = ephemeral_range()
    for _ in range(20):
        port = free_port_pair()
        assert port + 1 < low or port > high, (port, low, high)
        for p in (port, port + 1):
            with socket.socket() as s:
                s.bind(("127.0.0.1", p))  # raises if taken


def test_a_pair_with_a_listening_end_is_skipped(monkeypatch: pytest.MonkeyPatch) -> None:
    start = candidate_ports().start
    picks = iter([start + 1, start, start + 10])  # start + 1 listens: both first picks have a taken end
    monkeypatch.setattr(ports, "_pick", lambda _: next(picks))
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", start + 1))
        listener.listen()
        assert free_port_pair() == start + 10
