"""Shared setup for the lowering tests.

torch's OpInfo database imports ``expecttest``, which is not pinned in
requirements-test.lock; the OpInfo *samples* never use it, so a stand-in
module lets the database import without it.
"""

import sys
import types
import unittest

try:
    import expecttest  # noqa: F401
except ImportError:
    _stub = types.ModuleType("expecttest")
    _stub.TestCase = unittest.TestCase
    sys.modules["expecttest"] = _stub

import tpurec  # noqa: E402,F401  (enables jax x64 before any lowering runs)
