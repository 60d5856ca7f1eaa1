"""Runs a script's ``main()`` once per command line, each in a process forked from one that imported the script.

A test that checks many command lines which end early (bad input, exit status 2) pays the imports of torch,
TorchRec and tpurec once instead of once per command line, and each run still gets a process of its own:
its own exit status, stdout and stderr at the file-descriptor level (warnings and native logs included), and no
state left behind for the next. The parent never starts JAX's runtime or a thread, so forking it is safe.

From a test: :func:`run_forked`. As a program: the runs as JSON on stdin (each a command line, or a command line
with environment variables to set, or to remove where the value is null, in its process only), the results as
JSON on stdout::

    python forked_runs.py SCRIPT TIMEOUT < [[arg, ...] | {"argv": [arg, ...], "env": {name: value | null}}, ...]
    -> [{"returncode": int, "stdout": str, "stderr": str}, ...]

Variables that a module reads when it is imported (``XLA_FLAGS``, ``JAX_PLATFORMS``, ``TPUREC_*``) take the
parent's values: give them to the parent's process instead.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence


def run_forked(
    script: str, runs: Sequence[list[str] | dict], env: Mapping[str, str], timeout: float = 300
) -> list[subprocess.CompletedProcess]:
    """``runs`` of ``script``'s ``main()`` (command lines, or dicts with ``argv`` and ``env`` as in the module's
    documentation), each in its own process forked from one started with ``env``: per run its exit status,
    stdout and stderr. Each run is bounded by ``timeout`` seconds, the whole by the sum."""
    out = subprocess.run(
        [sys.executable, __file__, script, str(timeout)],
        input=json.dumps(list(runs)).encode(),
        capture_output=True,
        timeout=60 + timeout * len(runs),
        env=dict(env),
    )
    assert out.returncode == 0, out.stderr.decode()[-3000:]
    return [
        subprocess.CompletedProcess(
            [script, *(run if isinstance(run, list) else run["argv"])], r["returncode"], r["stdout"], r["stderr"]
        )  # fmt: skip
        for run, r in zip(runs, json.loads(out.stdout))
    ]


def _load(script: str):
    spec = importlib.util.spec_from_file_location("_forked_script", script)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _child(module, script: str, argv: list[str], env: dict[str, str | None], out: int, err: int) -> None:
    os.dup2(out, 1)
    os.dup2(err, 2)
    for name, value in env.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    sys.argv = [script, *argv]
    code = 0
    try:
        module.main()
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if not isinstance(e.code, int) and e.code is not None:
            print(e.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 (reported as an uncaught exception would be)
        import traceback

        traceback.print_exc()
        code = 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(code)


def _run(module, script: str, run: list[str] | dict, timeout: float) -> dict:
    argv, env = (run, {}) if isinstance(run, list) else (run["argv"], run.get("env", {}))
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        pid = os.fork()
        if pid == 0:
            _child(module, script, argv, env, out.fileno(), err.fileno())
        deadline = time.monotonic() + timeout
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                code, killed = os.waitstatus_to_exitcode(status), ""
                break
            if time.monotonic() > deadline:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                code, killed = -signal.SIGKILL, f"\nforked_runs: killed after {timeout:g} s"
                break
            time.sleep(0.02)
        out.seek(0)
        err.seek(0)
        return {"returncode": code, "stdout": out.read().decode(), "stderr": err.read().decode() + killed}


def main() -> None:
    script, timeout = sys.argv[1], float(sys.argv[2])
    runs = json.load(sys.stdin)
    module = _load(script)
    assert threading.active_count() == 1, "the script started a thread on import: forking it is not safe"
    from jax._src import xla_bridge

    assert not xla_bridge._backends, "the script started JAX's runtime on import: forking it is not safe"
    sys.stdout.flush()
    results = [_run(module, script, run, timeout) for run in runs]
    json.dump(results, sys.stdout)


if __name__ == "__main__":
    main()
