"""Test set-up shared by every test: 8 host devices for JAX, tpu registered."""

import os

# Must be set before JAX initialises its backends.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import tpurec  # noqa: E402,F401

import pytest  # noqa: E402
import torch  # noqa: E402

from tpurec.core import runtime  # noqa: E402

# The whole suite runs in one process and builds tens of thousands of programs, each holding
# memory mappings; tpurec's own guard (runtime.keep_mapping_headroom) would drop them in the
# middle of some test, under tests that count compilations. Dropping them between test files,
# well before that, keeps the guard out of the way.
_MAPPINGS_BETWEEN_FILES = 24_000


@pytest.fixture(autouse=True, scope="module")
def _drop_programs_between_files():
    yield
    held = runtime.mapping_count()
    if held is not None and held > _MAPPINGS_BETWEEN_FILES:
        torch._dynamo.reset()
        runtime.release_programs()
