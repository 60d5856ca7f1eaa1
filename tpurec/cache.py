"""tpurec's persistent cache folder, shared by compiled programs and built native kernels."""

from __future__ import annotations

import os

__all__ = ["cache_root"]


def cache_root() -> str | None:
    """tpurec's persistent cache folder (``$TPUREC_CACHE_DIR``, default ``~/.cache/tpurec``).

    Holds ``xla/`` (compiled programs) and ``native/`` (built kernels).
    ``TPUREC_CACHE_DIR=off`` turns persistence off: None.
    """
    root = os.environ.get("TPUREC_CACHE_DIR")
    if root and root.lower() in ("off", "none", "0"):
        return None
    if root:
        return root
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "tpurec")
