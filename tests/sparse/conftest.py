import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

import tpurec  # noqa: E402,F401  (x64, device registration)
