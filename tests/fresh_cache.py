"""A persistent cache folder for the processes a test starts: no compiled program, tpurec's built C++ libraries.

A process on an empty cache folder compiles tpurec's C++ libraries (tpurec.native: about 12 s of CPU) before
its first native op. Tests that count the XLA programs a process compiles or reads from the cache need a
folder without programs, not that compilation: :func:`fresh_cache` copies the verified libraries of this
process's cache (each beside its build record, as tpurec.native writes them) into the new folder. Tests of the
native build itself (a damaged library, a cache folder that cannot be written) keep empty folders.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from tpurec.native import library_path, torch_hooks


def fresh_cache(folder: Path) -> Path:
    """``folder`` (created) as a persistent cache folder holding only tpurec's built native libraries.

    Args:
        folder: a path that does not exist yet (e.g. under ``tmp_path``).

    Returns:
        ``folder``, for ``TPUREC_CACHE_DIR``.
    """
    native = folder / "native"
    native.mkdir(parents=True)
    for library in (library_path(), torch_hooks.library_path()):
        shutil.copy2(library, native / library.name)
        shutil.copy2(library.with_suffix(".json"), native / library.with_suffix(".json").name)
    return folder
