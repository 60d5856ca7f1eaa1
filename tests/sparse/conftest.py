"""Shared setup of the sparse tests; this folder is on sys.path (pytest puts a conftest's folder there), so
helpers.py and fuzz_kjt.py import from the tests in its subfolders."""

from hypothesis import settings

import tpurec  # noqa: F401  (x64, device registration)

# Long fuzz runs: pytest tests/sparse/test_fuzz.py --hypothesis-profile=fuzz-long (see test_fuzz.py).
settings.register_profile("fuzz-long", max_examples=10_000, deadline=None)
