"""tpurec's settings: every ``TPUREC_*`` environment variable, declared once.

Each flag has a name (the environment variable), a type, a default, the moment
tpurec reads it and a one-line description (the table in ``docs/config.md`` is
generated from :data:`FLAGS`). A flag is read from the environment unless it was
set from Python, which wins:

Example::

    import tpurec
    tpurec.config.get("TPUREC_FUSED_MAX_OPS")        # 2000, or $TPUREC_FUSED_MAX_OPS
    tpurec.config.fused_max_ops                      # the same, as an attribute
    tpurec.config.update("TPUREC_NATIVE_MATMUL", False)
    with tpurec.config.override(host_fallback="error"):
        ...                                          # restored afterwards

Names may be given as the variable (``TPUREC_NATIVE_MATMUL``) or without the
prefix, in any case (``native_matmul``). A value that is not allowed raises a
``ValueError`` naming the flag and the allowed values, from the environment when
the flag is read and from Python at once. Flags read once, at import, cannot be set
from Python (an error says how to set them instead). Flags that change the
programs tpurec compiles (:func:`program_settings`) are part of every program's
cache key, so a program is never reused under another setting.

This module imports nothing of tpurec (every layer may read it).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Iterator
from typing import Any

__all__ = [
    "FLAGS",
    "Flag",
    "flag",
    "get",
    "markdown_table",
    "override",
    "parse",
    "program_settings",
    "update",
]

# When tpurec reads a flag (the docs table's "read" column).
IMPORT = "import"
FIRST_USE = "first use"
EVERY_CALL = "every call"
TRACE_TIME = "trace time"

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


@dataclasses.dataclass(frozen=True)
class Flag:
    """One ``TPUREC_*`` setting.

    Attributes:
        name: the environment variable.
        kind: ``"bool"``, ``"int"``, ``"choice"``, ``"topics"`` (a comma-separated subset of
            ``choices``) or ``"str"``.
        default: the value when the variable is unset or empty.
        read: when tpurec reads it: ``"import"``, ``"first use"``, ``"every call"`` or
            ``"trace time"`` (while a program is traced).
        doc: one line for the docs table.
        choices: the allowed values of a ``choice`` or ``topics`` flag.
        aliases: other spellings of a choice (``{"0": "off"}``).
        minimum: the smallest allowed value of an ``int`` flag.
        maximum: the largest allowed value of an ``int`` flag.
        programs: the value changes compiled programs: it is part of the program cache key.
        environ: read by native code from the process environment, so setting it from Python
            sets the environment variable too.
        instead: for an import-time flag, what to use from Python instead (for the error).
        values: the allowed values of a ``str`` flag, in words.
        settable: whether :func:`update` may set it (default: unless it is read at import).
    """

    name: str
    kind: str
    default: Any
    read: str
    doc: str
    choices: tuple[str, ...] = ()
    aliases: tuple[tuple[str, str], ...] = ()
    minimum: int | None = None
    maximum: int | None = None
    programs: bool = False
    environ: bool = False
    instead: str = ""
    values: str = "text"
    settable: bool | None = None

    def can_set(self) -> bool:
        """Whether a value set from Python can still take effect."""
        return self.read != IMPORT if self.settable is None else self.settable

    def allowed(self) -> str:
        """The allowed values, in words (for errors and the docs)."""
        if self.kind == "bool":
            return "1 or 0 (also true/false, yes/no, on/off)"
        if self.kind == "int":
            if self.maximum is not None:
                return f"an integer from {self.minimum} to {self.maximum}"
            return f"an integer >= {self.minimum}" if self.minimum is not None else "an integer"
        if self.kind in ("choice", "topics"):
            quoted = [repr(c) for c in self.choices]
            listed = quoted[0] if len(quoted) == 1 else ", ".join(quoted[:-1]) + " or " + quoted[-1]
            return listed if self.kind == "choice" else f"a comma-separated list of {listed}"
        return self.values


FLAGS: tuple[Flag, ...] = (
    Flag(
        "TPUREC_MODE",
        "choice",
        "eager",
        IMPORT,
        "The execution mode tpurec starts in.",
        choices=("eager", "fused", "debug"),
        instead="tpurec.set_mode() or tpurec.mode()",
    ),
    Flag(
        "TPUREC_HOST_FALLBACK",
        "choice",
        "warn",
        EVERY_CALL,
        "An op that fails on the device during backward runs on the host: warn, or make the next tpu op raise.",
        choices=("warn", "error"),
    ),
    Flag(
        "TPUREC_CHECK_NAN",
        "bool",
        False,
        EVERY_CALL,
        "Debug mode also raises at the first op that produces NaN or Inf.",
    ),
    Flag(
        "TPUREC_FUSED_MAX_OPS",
        "int",
        2000,
        EVERY_CALL,
        "Fused mode runs the recorded window once it holds this many ops.",
        minimum=1,
    ),
    Flag(
        "TPUREC_HOST_MIRRORS",
        "int",
        16384,
        EVERY_CALL,
        "Integer and boolean tpu tensors of at most this many elements keep their values on the host "
        "too (copied from the CPU, or computed from such by exact ops), so .item() and bool() on them "
        "need no sync point; 0 turns it off.",
        minimum=0,
    ),
    Flag(
        "TPUREC_FUSED_COMPILED_GRAPHS",
        "choice",
        "defer",
        EVERY_CALL,
        "Fused mode, a torch.compile graph: defer keeps it in the window until the next sync point "
        "(a step is one program); dispatch runs it at once with the ops recorded before it (the "
        "device computes while Python records the rest of the step).",
        choices=("defer", "dispatch"),
    ),
    Flag(
        "TPUREC_COMPILE_PACK_SAVED",
        "bool",
        True,
        TRACE_TIME,
        "torch.compile training graphs: the forward's small saved activations travel to the backward "
        "as one tensor per dtype (fewer tensors for the host to make each step); 0 keeps "
        "AOTAutograd's own partition.",
    ),
    Flag(
        "TPUREC_SHADOW",
        "choice",
        "off",
        IMPORT,
        "cpu: every op also runs on CPU and is compared, from import on (needs TPUREC_MODE=debug).",
        choices=("off", "cpu"),
        aliases=(("0", "off"), ("none", "off")),
        instead="tpurec.debug.shadow()",
    ),
    Flag(
        "TPUREC_LOG",
        "topics",
        frozenset(),
        EVERY_CALL,
        "Topics logged as they happen: recompiles (logger tpurec.recompiles), or all.",
        choices=("recompiles", "all"),
    ),
    Flag(
        "TPUREC_CACHE_DIR",
        "str",
        None,
        IMPORT,
        "The persistent cache folder (compiled programs, native library); default ~/.cache/tpurec; off: none. "
        "Read again by tpurec.enable_disk_cache() and the first native build.",
        values="a folder, or off",
        settable=True,
    ),
    Flag(
        "TPUREC_SPARSE_KERNEL",
        "choice",
        "auto",
        TRACE_TIME,
        "Kernel of the sparse ops (tpurec.sparse): auto (from the chip: SparseCore, TensorCore, native XLA:CPU or "
        "reference), or one forced (sparsecore needs a chip whose SparseCores jax-tpu-embedding drives).",
        choices=("auto", "sparsecore", "tensorcore", "native", "reference"),
        programs=True,
    ),
    Flag(
        "TPUREC_TENSORCORE_ONE_PASS",
        "bool",
        True,
        TRACE_TIME,
        "The TensorCore sparse kernel pools looked-up rows straight into the output and fuses the optimizer "
        "step with the gradient sum (one pass over the table's blocks each way); 0: the two-pass kernels "
        "(gather then pool; gather, update, scatter), slower on a TPU v5e.",
        programs=True,
    ),
    Flag(
        "TPUREC_TENSORCORE_ROW_SUM",
        "choice",
        "loop",
        TRACE_TIME,
        "How the TensorCore kernel's one-pass optimizer step sums each table row's gradients: loop (one "
        "entry at a time) or mxu (a one-hot matrix product per 128 entries, each product exact); "
        "experimental: mxu measured slower than loop on a TPU v5e.",
        choices=("loop", "mxu"),
        programs=True,
    ),
    Flag(
        "TPUREC_TENSORCORE_ROW_SLOTS",
        "choice",
        "transpose",
        TRACE_TIME,
        "How the TensorCore kernel's one-pass optimizer step moves a lane-dense table's row slots "
        "(row-wise Adagrad's accumulator) between their lanes and each block's lines, and takes each "
        "row's mean: transpose (2 rows a line: the row math runs once a row on the accumulator as it is "
        "stored, and per-row values move between rows and lines by square transposes; other layouts and "
        "rules without a spread keyword take mxu; a DLRM-sized graphed step on a TPU v5e 8.5 -> 7.4 ms), "
        "mxu (exact matrix products; 0.85 ms faster than xlu in that step) or xlu (lane reductions and "
        "strided copies).",
        choices=("xlu", "mxu", "transpose"),
        programs=True,
    ),
    Flag(
        "TPUREC_TENSORCORE_LANE_DENSE",
        "bool",
        True,
        TRACE_TIME,
        "float32 tables whose dim is below 128 and divides it are kept lane-dense on the tpu device (128 / dim "
        "rows in each 128-lane line of the stored array, when the row count is a multiple of that) and the "
        "TensorCore kernels stream those lines; 0: rows as they are (lanes padded to 128 in TPU memory). Also "
        "read when a collection moves to the tpu device.",
        programs=True,
    ),
    Flag(
        "TPUREC_NATIVE_MATMUL",
        "bool",
        True,
        TRACE_TIME,
        "aten.bmm of small float32 matrices uses the native XLA:CPU kernel.",
        programs=True,
    ),
    Flag(
        "TPUREC_NATIVE_MARCH_NATIVE",
        "bool",
        False,
        FIRST_USE,
        "The native library is built with -march=native (for this CPU only).",
    ),
    Flag(
        "TPUREC_CPU_THREADS",
        "int",
        None,
        EVERY_CALL,
        "At most this many threads per native kernel call; default: the CPUs this process may use.",
        minimum=1,
        environ=True,
    ),
    Flag(
        "TPUREC_PREPROCESS",
        "choice",
        "auto",
        EVERY_CALL,
        "KeyedJaggedTensor preprocessing: native C++ where it builds (auto), always native, or numpy.",
        choices=("auto", "native", "numpy"),
    ),
    Flag(
        "TPUREC_TUNE_MALLOC",
        "bool",
        True,
        IMPORT,
        "glibc keeps freed memory for reuse (one arena, no trimming, no mmap) so XLA:CPU reuses buffers.",
    ),
    Flag(
        "TPUREC_CPU_LOCKSTEP",
        "bool",
        True,
        FIRST_USE,
        "XLA:CPU runs one mesh program at a time (read at the first mesh program): queued ones can deadlock.",
    ),
    Flag(
        "TPUREC_TRACE_PROGRAMS",
        "str",
        None,
        IMPORT,
        "Every program run on a mesh appends one line to PREFIX.<pid>.",
        values="a path PREFIX",
    ),
    Flag(
        "TPUREC_MAPPING_BUDGET",
        "int",
        None,
        EVERY_CALL,
        "Memory mappings this process may hold before tpurec drops its compiled programs (they are "
        "built again when next used); default 3/4 of the kernel's vm.max_map_count.",
        minimum=1,
    ),
    Flag(
        "TPUREC_COORDINATOR_PORT",
        "int",
        None,
        EVERY_CALL,
        "The port of JAX's coordinator under torchrun (default MASTER_PORT + 1).",
        minimum=1,
        maximum=65535,
    ),
    Flag(
        "TPUREC_PEER_TIMEOUT",
        "int",
        20,
        FIRST_USE,
        "Seconds without a heartbeat after which a multi-process job declares a process lost and ends "
        "(read by tpurec.distributed.initialize).",
        minimum=1,
    ),
    Flag(
        "TPUREC_STEP_TIMEOUT",
        "int",
        600,
        FIRST_USE,
        "Seconds a process waits for live peers to reach the same step or start-up check before it "
        "fails naming them (read by tpurec.distributed.initialize).",
        minimum=1,
    ),
)

_BY_NAME: dict[str, Flag] = {f.name: f for f in FLAGS}

# Values set from Python (update/override): they win over the environment.
_overrides: dict[str, Any] = {}


def flag(name: str) -> Flag:
    """The declaration of flag ``name`` (``"TPUREC_MODE"``, ``"mode"``, ...).

    Raises:
        ValueError: no such flag.
    """
    key = name.strip().upper()
    if not key.startswith("TPUREC_"):
        key = "TPUREC_" + key
    found = _BY_NAME.get(key)
    if found is None:
        raise ValueError(f"{name!r} is not a tpurec flag; the flags are {', '.join(_BY_NAME)}")
    return found


def _invalid(f: Flag, value: Any, where: str) -> ValueError:
    return ValueError(f"{f.name} must be {f.allowed()}, got {value!r} ({f.name}={value!r} {where})")


def _parse_text(f: Flag, text: str, where: str) -> Any:
    raw = text.strip()
    if raw == "":
        return f.default
    if f.kind == "bool":
        low = raw.lower()
        if low in _TRUE:
            return True
        if low in _FALSE:
            return False
        raise _invalid(f, text, where)
    if f.kind == "int":
        try:
            number = int(raw)
        except ValueError:
            raise _invalid(f, text, where) from None
        return _check_int(f, number, text, where)
    if f.kind == "choice":
        low = dict(f.aliases).get(raw.lower(), raw.lower())
        if low not in f.choices:
            raise _invalid(f, text, where)
        return low
    if f.kind == "topics":
        topics = frozenset(t.strip().lower() for t in raw.split(",") if t.strip())
        if not topics <= set(f.choices):
            raise _invalid(f, text, where)
        return topics
    return text


def _check_int(f: Flag, number: int, shown: Any, where: str) -> int:
    if (f.minimum is not None and number < f.minimum) or (f.maximum is not None and number > f.maximum):
        raise _invalid(f, shown, where)
    return number


def parse(name: str, value: Any, where: str = "in the environment") -> Any:
    """Flag ``name``'s typed value for ``value`` (text as in the environment, or a Python value).

    Args:
        name: the flag.
        value: a string (parsed as the environment variable would be), None (the default) or
            a value of the flag's type (``True``, ``8``, ``"fused"``, ``{"recompiles"}``).
        where: where the value came from, for the error message.

    Raises:
        ValueError: the value is not allowed (the message names the flag and the allowed values).
    """
    f = flag(name)
    if value is None:
        return f.default
    if isinstance(value, str):
        return _parse_text(f, value, where)
    if f.kind == "bool" and isinstance(value, bool):
        return value
    if f.kind == "int" and isinstance(value, int) and not isinstance(value, bool):
        return _check_int(f, value, value, where)
    if (
        f.kind == "topics"
        and isinstance(value, (set, frozenset, list, tuple))
        and all(isinstance(t, str) for t in value)
    ):
        return _parse_text(f, ",".join(value), where)
    raise _invalid(f, value, where)


def get(name: str) -> Any:
    """Flag ``name``'s value: set from Python, else from the environment, else its default.

    Raises:
        ValueError: unknown flag, or the environment holds a value that is not allowed.
    """
    f = _BY_NAME.get(name) or flag(name)
    if f.name in _overrides:
        return _overrides[f.name]
    # Read on every op (the program cache's settings, the fused window's size): the parsed
    # value is remembered with the environment text it came from, so a repeated read costs
    # two dict lookups. (Parsed values are immutable: bool, int, str, frozenset.)
    raw = _environ_get(f.name)
    seen = _parsed.get(f.name)
    if seen is not None and seen[0] == raw:
        return seen[1]
    value = parse(f.name, os.environ.get(f.name))
    _parsed[f.name] = (raw, value)
    return value


# flag name -> (the raw environment value it was parsed from, the parsed value)
_parsed: dict[str, tuple[Any, Any]] = {}


def _environ_get(name: str) -> Any:
    """The raw environment value of ``name`` (None when unset), cheaply.

    On POSIX ``os.environ`` keeps its values in a private dict keyed by the encoded
    name; its ``get`` encodes the name on each call, which costs more than the rest
    of a cached op's lookup. Elsewhere this is ``os.environ.get``.
    """
    data = getattr(os.environ, "_data", None)
    if isinstance(data, dict):
        key = _ENCODED.get(name)
        if key is None:
            key = _ENCODED[name] = os.environ.encodekey(name)  # pyright: ignore[reportAttributeAccessIssue]
        return data.get(key)
    return os.environ.get(name)


_ENCODED: dict[str, Any] = {}


def _settable(f: Flag) -> None:
    if not f.can_set():
        instead = f"; from Python use {f.instead}" if f.instead else ""
        raise ValueError(
            f"{f.name} is read once, when tpurec is imported: set the environment variable before "
            f"importing tpurec{instead}"
        )


def _apply(f: Flag, value: Any) -> None:
    """Sets (``value`` not None) or clears the Python value of ``f`` (already validated)."""
    if value is None:
        _overrides.pop(f.name, None)
        if f.environ:
            os.environ.pop(f.name, None)
        return
    _overrides[f.name] = value
    if f.environ:
        # Native code reads the process environment (getenv): keep it in step.
        os.environ[f.name] = (
            ",".join(sorted(value)) if f.kind == "topics" else str(int(value) if f.kind == "bool" else value)
        )


def update(name: str, value: Any) -> None:
    """Sets flag ``name`` from Python (as ``jax.config.update``); None goes back to the environment.

    Args:
        name: the flag (``"TPUREC_NATIVE_MATMUL"`` or ``"native_matmul"``).
        value: a value of the flag's type, or its text as in the environment.

    Raises:
        ValueError: unknown flag, a value that is not allowed, or a flag read only at import.
            Nothing changes then.
    """
    f = flag(name)
    _settable(f)
    _apply(f, None if value is None else parse(f.name, value, "from tpurec.config.update"))


@contextlib.contextmanager
def override(**values: Any) -> Iterator[None]:
    """Sets flags for the block, then restores what was set before (keyword names without the prefix).

    Example::

        with tpurec.config.override(native_matmul=False, fused_max_ops=8):
            ...

    Raises:
        ValueError: as :func:`update`, before any flag changes.
    """
    parsed = {}
    for name, value in values.items():
        f = flag(name)
        _settable(f)
        parsed[f] = None if value is None else parse(f.name, value, "from tpurec.config.override")
    saved = {f: (_overrides.get(f.name), f.name in _overrides, os.environ.get(f.name)) for f in parsed}
    try:
        for f, value in parsed.items():
            _apply(f, value)
        yield
    finally:
        for f, (value, was_set, env) in saved.items():
            if was_set:
                _overrides[f.name] = value
            else:
                _overrides.pop(f.name, None)
            if f.environ:
                if env is None:
                    os.environ.pop(f.name, None)
                else:
                    os.environ[f.name] = env


def program_settings() -> tuple:
    """The values of the flags that change compiled programs, as a hashable cache-key part.

    Asked on every op: the answer is remembered with what it was worked out from (the
    Python values set and the raw environment texts of those flags), so a repeated call
    reads them and returns the same tuple object, without parsing anything.
    """
    global _settings_memo
    data = getattr(os.environ, "_data", None)
    if isinstance(data, dict):
        raw = tuple(map(data.get, _PROGRAM_FLAG_KEYS))
    else:
        raw = tuple(map(os.environ.get, _PROGRAM_FLAG_NAMES))
    seen = (tuple(map(_overrides.get, _PROGRAM_FLAG_NAMES)), raw)
    memo = _settings_memo
    if memo is not None and memo[0] == seen:
        return memo[1]
    settings = tuple(get(name) for name in _PROGRAM_FLAG_NAMES)
    _settings_memo = (seen, settings)
    return settings


_PROGRAM_FLAGS = tuple(f for f in FLAGS if f.programs)
_PROGRAM_FLAG_NAMES = tuple(f.name for f in _PROGRAM_FLAGS)
# os.environ's private dict is keyed by the encoded names (see _environ_get).
_PROGRAM_FLAG_KEYS = tuple(
    os.environ.encodekey(name) if hasattr(os.environ, "encodekey") else name  # pyright: ignore[reportAttributeAccessIssue]
    for name in _PROGRAM_FLAG_NAMES
)
# ((Python values, environment texts), settings) of the last program_settings() answer.
_settings_memo: tuple | None = None


def __getattr__(name: str) -> Any:
    # tpurec.config.native_matmul / tpurec.config.TPUREC_NATIVE_MATMUL
    try:
        f = flag(name)
    except ValueError:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    return get(f.name)


def _shown_default(f: Flag) -> str:
    if f.default is None:
        return "unset"
    if f.kind == "bool":
        return "1" if f.default else "0"
    if f.kind == "topics":
        return ",".join(sorted(f.default)) or "unset"
    return str(f.default)


def markdown_table() -> str:
    """The table of every flag (``docs/config.md``; ``python tests/gen_docs.py`` writes it there)."""
    rows = [
        "| Flag | Values | Default | Read | Changes programs | Meaning |",
        "|---|---|---|---|---|---|",
    ]
    for f in FLAGS:
        rows.append(
            f"| `{f.name}` | {f.allowed()} | {_shown_default(f)} | {f.read} | {'yes' if f.programs else 'no'} | {f.doc} |"
        )
    return "\n".join(rows) + "\n"
