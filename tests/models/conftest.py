"""Each zoo test starts from fresh Dynamo caches (graphs are per model instance anyway)."""

import pytest
import torch

import tpurec  # noqa: F401


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()
