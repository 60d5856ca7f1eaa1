"""Test set-up shared by every test: 8 host devices for JAX, tpu registered."""

import os

# Must be set before JAX initialises its backends.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import tpurec  # noqa: E402,F401
