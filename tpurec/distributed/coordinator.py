"""JAX's coordination service in a child process of process 0, so that it outlives a lost process 0.

``jax.distributed.initialize`` runs the coordination service (the key-value store and the
heartbeats every process depends on) inside process 0. When process 0 is killed or stopped the
service goes with it, and every other process ends in JAX's own abort, saying nothing of which
process is gone or at which step. Here process 0 starts the service in a small child process
(this file, run by path, so that it imports no more than jaxlib) on the coordinator's address,
and JAX's in-process service binds an unused local port no client ever uses. The other
processes then go on reading the store after process 0 is lost, see its heartbeat stop and end
with tpurec's error naming it (:mod:`tpurec.distributed.peers`).

The child's lifetime follows process 0 through a pipe: once the job has finished and JAX's
shutdown barrier has passed (every process has shut its client down), process 0 writes ``done``
and the child shuts the service down at once. When the pipe ends without it (process 0 died),
the child stays up ``linger`` seconds, long enough for the others to read why and end, then
exits. A child left behind by a process 0 that an elastic restart replaced (it holds the port)
is found through its pid file (one per port) and ended by the next process 0.
"""

from __future__ import annotations

import importlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import IO

__all__ = ["Coordinator", "end_stale", "start"]

_SCRIPT = Path(__file__).resolve()
_READY = "ready"
_DONE = "done"
_START_SECONDS = 60.0  # the child imports jaxlib and binds the port: a second or two on an idle host


def _state_dir() -> Path:
    """Where the pid files and logs of this user's coordinator children live."""
    folder = Path(tempfile.gettempdir()) / f"tpurec-coordinator-{os.getuid()}"
    folder.mkdir(mode=0o700, exist_ok=True)
    return folder


def _port(address: str) -> int:
    return int(address.rpartition(":")[2])


def _stat(pid: int) -> list[str]:
    """The fields of ``/proc/<pid>/stat`` after the command name (state, parent, ...); empty if none."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    except OSError:
        return []


def _is_ours(pid: int, port: int) -> bool:
    """Process ``pid`` is a coordinator child of tpurec serving ``port`` (not a reused pid)."""
    try:
        args = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return False
    fields = _stat(pid)
    return bool(fields) and fields[0] != "Z" and str(_SCRIPT) in args and f"--port={port}" in args


def _ended(pid: int) -> bool:
    """Process ``pid`` is gone, or a zombie none of whose threads still runs (and so holds the port).

    Its command line empties, and its first thread turns zombie, while the others still close its files.
    """
    fields = _stat(pid)
    if not fields:
        return True
    try:
        return fields[0] == "Z" and len(os.listdir(f"/proc/{pid}/task")) <= 1
    except OSError:
        return True


def end_stale(address: str, wait: float = 10.0) -> None:
    """Ends the coordinator child an earlier process 0 left on ``address``'s port (an elastic restart).

    The child of a process 0 that was killed lingers to let the other processes read why; when
    torchrun starts the job again at once, the new process 0 needs the port. Only a process whose
    command line names this file and the port, and whose parent is no longer the process 0 that
    started it, is ended: a live job's coordinator is left alone (the port is then in use).

    Args:
        address: the coordinator's ``host:port``.
        wait: seconds to wait for it to be gone.
    """
    port = _port(address)
    pid_file = _state_dir() / f"{port}.pid"
    try:
        pid, parent = (int(n) for n in pid_file.read_text().split())
    except (OSError, ValueError):
        return
    if not _is_ours(pid, port):
        pid_file.unlink(missing_ok=True)
        return
    fields = _stat(pid)
    if fields and int(fields[1]) == parent:
        return  # its process 0 still runs (maybe stopped): another job's, not ours to end
    try:
        os.kill(pid, signal.SIGKILL)
    except OSError:
        pass
    deadline = time.monotonic() + wait
    while not _ended(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    pid_file.unlink(missing_ok=True)


class Coordinator:
    """The running child (see :func:`start`).

    Args:
        process: the child.
        pid_file: where its pid is recorded.
        log: its log file (stdout and stderr).
    """

    def __init__(self, process: subprocess.Popen[str], pid_file: Path, log: Path) -> None:
        self.process = process
        self.pid_file = pid_file
        self.log = log

    @property
    def pid(self) -> int:
        """The child's process id."""
        return self.process.pid

    def release(self) -> None:
        """Ends the service now (the job finished and every process shut its client down)."""
        stdin = self.process.stdin
        if stdin is not None and not stdin.closed:
            try:
                stdin.write(_DONE + "\n")
                stdin.close()
            except OSError:  # it is gone already
                pass
        try:
            self.process.wait(10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        try:
            if self.pid_file.read_text().split()[0] == str(self.pid):  # (not a later job's on the same port)
                self.pid_file.unlink()
        except (OSError, IndexError):
            pass


def start(address: str, num_processes: int, heartbeat_timeout: int, linger: float) -> Coordinator:
    """Starts JAX's coordination service for the job in a child process (process 0 calls it).

    It listens where JAX's would: on every interface at ``address``'s port, or at
    ``JAX_COORDINATOR_BIND_ADDRESS``.

    Args:
        address: the coordinator's ``host:port`` (every process connects there).
        num_processes: processes in the job.
        heartbeat_timeout: JAX's own limit, in seconds, on a process without heartbeats.
        linger: seconds the service stays up after process 0 is gone without finishing.

    Returns:
        The child, once its service listens.

    Raises:
        RuntimeError: the service did not start (its log is quoted).
    """
    port = _port(address)
    bind = os.environ.get("JAX_COORDINATOR_BIND_ADDRESS") or f"[::]:{port}"
    folder = _state_dir()
    log = folder / f"{port}.log"
    import jaxlib

    # -I: none of the user's PYTHON* settings; jaxlib comes from where this process found it (--path).
    command = [sys.executable, "-I", str(_SCRIPT), f"--port={port}", f"--bind={bind}",
               f"--processes={num_processes}", f"--heartbeat={heartbeat_timeout}", f"--linger={linger:g}",
               f"--path={Path(jaxlib.__file__).parent.parent}"]  # fmt: skip
    with open(log, "w") as log_file:
        # Its output goes to the log, not to this process's stdout: a caller reading that to its end
        # (subprocess.communicate) would wait for the child too.
        process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log_file, text=True)
    (folder / f"{port}.pid").write_text(f"{process.pid} {os.getpid()}")
    coordinator = Coordinator(process, folder / f"{port}.pid", log)
    assert process.stdout is not None
    if not _wait_ready(process.stdout, _START_SECONDS):
        process.kill()
        process.wait()
        coordinator.release()  # (removes the pid file)
        tail = log.read_text(errors="replace")[-2000:]
        raise RuntimeError(f"JAX's coordination service for {address} (bind {bind}) did not start; its log:\n{tail}")
    process.stdout.close()
    return coordinator


def _wait_ready(stream: IO[str], timeout: float) -> bool:
    """The child said it listens within ``timeout`` seconds (False: it ended or took too long)."""
    import selectors

    with selectors.DefaultSelector() as selector:
        selector.register(stream, selectors.EVENT_READ)
        if not selector.select(timeout):
            return False
    return stream.readline().strip() == _READY


def _serve(args: list[str]) -> None:
    """The child: hosts the service until process 0 says ``done``, or ``linger`` seconds after it is gone."""
    options = dict(a.removeprefix("--").split("=", 1) for a in args)
    if options.get("path"):
        sys.path.insert(0, options["path"])
    # Its process group gets the terminal's Ctrl-C with process 0; the others may still need the store.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # jaxlib alone (a compiled module, not jax): the child starts in well under a second.
    _jax = importlib.import_module("jaxlib._jax")
    service = _jax.get_distributed_runtime_service(
        options["bind"], int(options["processes"]), heartbeat_timeout=int(options["heartbeat"])
    )
    print(_READY, flush=True)
    os.dup2(os.open(os.devnull, os.O_WRONLY), 1)  # nobody reads the pipe any more
    said = sys.stdin.readline().strip()
    if said != _DONE:  # process 0 is gone: the others read its last heartbeat and end
        print(f"process 0 is gone; serving {options['linger']} s more", file=sys.stderr, flush=True)
        time.sleep(float(options["linger"]))
    service.shutdown()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    _serve(sys.argv[1:])
