"""Shared setup for the lowering tests."""

import tpurec  # noqa: F401  (enables jax x64 before any lowering runs)

import pytest  # noqa: E402

from tpurec.core import accounting  # noqa: E402


@pytest.fixture
def no_host_fallback(monkeypatch):
    """The test must run on the device: a host fallback raises (TPUREC_HOST_FALLBACK=error) and is counted."""
    monkeypatch.setenv("TPUREC_HOST_FALLBACK", "error")
    before = sum(accounting.counters().host_fallbacks.values())
    yield
    assert sum(accounting.counters().host_fallbacks.values()) == before, "an op fell back to the host"
