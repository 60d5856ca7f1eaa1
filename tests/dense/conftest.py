"""Shared setup for the lowering tests."""

import tpurec  # noqa: F401  (enables jax x64 before any lowering runs)
