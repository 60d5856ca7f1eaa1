"""tpurec's persistent cache folder, shared by compiled programs and built native kernels.

Nothing in it depends on where it is: a warm folder moved or copied elsewhere (with
``TPUREC_CACHE_DIR`` pointing at the new place) serves its compiled programs and its
native library as before.
"""

from __future__ import annotations

import functools
import os
import tempfile
import warnings

from tpurec import config

__all__ = ["cache_root", "writable_cache_root"]


def cache_root() -> str | None:
    """tpurec's persistent cache folder (``$TPUREC_CACHE_DIR``, default ``~/.cache/tpurec``).

    Holds ``xla/`` (compiled programs) and ``native/`` (built kernels).
    ``TPUREC_CACHE_DIR=off`` turns persistence off: None.
    """
    root = config.get("TPUREC_CACHE_DIR")
    if root and root.lower() in ("off", "none", "0"):
        return None
    if root:
        return root
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "tpurec")


def writable_cache_root() -> str | None:
    """:func:`cache_root` if it can be written, else a private temporary folder (one warning).

    An unusable cache folder (read-only, a file in its place) must not stop tpurec from
    working: it only costs the compiled programs and built kernels of earlier runs.
    """
    root = cache_root()
    return None if root is None else _writable(root)


@functools.lru_cache(maxsize=None)
def _writable(root: str) -> str:
    try:
        os.makedirs(root, exist_ok=True)
        with tempfile.TemporaryFile(dir=root):
            pass
        return root
    except OSError as error:
        fallback = tempfile.mkdtemp(prefix="tpurec-cache-")
        warnings.warn(
            f"tpurec: the cache folder {root!r} is not writable ({type(error).__name__}: {error}); using "
            f"{fallback!r} for this process, so programs and kernels built earlier are not reused. Set "
            "TPUREC_CACHE_DIR to a writable folder (or TPUREC_CACHE_DIR=off to keep nothing).",
            RuntimeWarning,
            stacklevel=2,
        )
        return fallback
