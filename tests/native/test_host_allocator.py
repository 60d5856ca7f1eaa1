"""tpurec.native.host_allocator: glibc keeps large freed blocks for reuse (checked in subprocesses)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

_ALLOCATE_ON_A_THREAD = textwrap.dedent("""
    import ctypes, threading
    import tpurec
    from tpurec.native import host_allocator

    class MallInfo2(ctypes.Structure):
        _fields_ = [(name, ctypes.c_size_t) for name in (
            "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]

    libc = ctypes.CDLL(None)
    libc.mallinfo2.restype = MallInfo2
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    seen = {}

    def allocate():  # as XLA:CPU's runtime threads do for a program's buffers
        mapped = libc.mallinfo2().hblks
        block = libc.malloc(64 << 20)
        seen["mapped"] = libc.mallinfo2().hblks - mapped
        libc.free(block)
        seen["kept"] = libc.mallinfo2().fordblks >= 64 << 20

    thread = threading.Thread(target=allocate)
    thread.start()
    thread.join()
    print(host_allocator.tuned(), seen["mapped"], seen["kept"])
""")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc allocator settings")
def test_host_allocator_keeps_large_blocks_for_reuse():
    """A 64 MiB block that a non-main thread frees stays in the heap instead of being unmapped.

    An unmapped block comes back as fresh pages that the next run faults in: a fused
    DLRM dense step at batch 4096 faulted in 128 MB per step without the settings and
    none with them (docs/throughput.md)."""
    runs = {}
    for setting in ("1", "0"):
        env = {**os.environ, "TPUREC_TUNE_MALLOC": setting}
        out = subprocess.run(
            [sys.executable, "-c", _ALLOCATE_ON_A_THREAD], env=env, capture_output=True, text=True, timeout=120
        )
        assert out.returncode == 0, out.stderr
        runs[setting] = out.stdout.split()
    assert runs["1"] == ["True", "0", "True"], runs
    assert runs["0"] == ["False", "1", "False"], runs  # glibc's defaults: mapped, and unmapped on free
