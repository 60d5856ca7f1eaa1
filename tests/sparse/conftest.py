import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

from hypothesis import settings  # noqa: E402

import tpurec  # noqa: E402,F401  (x64, device registration)

# Long fuzz runs: pytest tests/sparse/test_fuzz.py --hypothesis-profile=fuzz-long (see test_fuzz.py).
settings.register_profile("fuzz-long", max_examples=10_000, deadline=None)
