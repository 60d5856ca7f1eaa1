"""tpurec.config: every TPUREC_* flag declared once, read through one module, settable from Python."""

from __future__ import annotations

import os
import pathlib
import re

import pytest

import tpurec
from tpurec import config

PACKAGE_ROOT = pathlib.Path(tpurec.__file__).parent
REPO_ROOT = PACKAGE_ROOT.parent


def _sources() -> list[pathlib.Path]:
    return sorted(p for p in PACKAGE_ROOT.rglob("*") if p.suffix in (".py", ".cc", ".h"))


def test_every_flag_named_in_the_package_is_declared():
    named = set()
    for path in _sources():
        for name in re.findall(r"\bTPUREC_[A-Z0-9_]+", path.read_text()):
            # C/C++ header guards and preprocessor switches are not settings.
            if not name.endswith("_H_") and name != "TPUREC_X86":
                named.add(name.rstrip("_"))
    assert named <= {f.name for f in config.FLAGS}, sorted(named - {f.name for f in config.FLAGS})
    assert len({f.name for f in config.FLAGS}) == len(config.FLAGS)


def test_only_the_config_module_reads_the_environment_for_flags():
    # Native code reads TPUREC_CPU_THREADS itself; the flag says so (update() sets the variable).
    reads = re.compile(r"(environ\s*(\.get\(|\[)|getenv\()\s*[\"']TPUREC_")
    offenders = [
        f"{p.relative_to(PACKAGE_ROOT)}:{n}"
        for p in _sources()
        if p.name != "config.py"
        for n, line in enumerate(p.read_text().splitlines(), 1)
        if reads.search(line) and not (p.suffix == ".h" and "TPUREC_CPU_THREADS" in line)
    ]
    assert offenders == []
    assert [f.name for f in config.FLAGS if f.environ] == ["TPUREC_CPU_THREADS"]


def test_each_flag_is_fully_declared():
    for f in config.FLAGS:
        assert f.read in (config.IMPORT, config.FIRST_USE, config.EVERY_CALL, config.TRACE_TIME), f.name
        assert f.doc and f.kind in ("bool", "int", "choice", "topics", "str"), f.name
        if f.kind in ("choice", "topics"):
            assert f.choices, f.name
        if f.kind == "choice":
            assert f.default in f.choices, f.name


def test_defaults_come_from_the_declaration(monkeypatch):
    for f in config.FLAGS:
        monkeypatch.delenv(f.name, raising=False)
    assert config.get("TPUREC_NATIVE_MATMUL") is True
    assert config.get("TPUREC_FUSED_MAX_OPS") == 2000
    assert config.get("TPUREC_HOST_FALLBACK") == "warn"
    assert config.get("TPUREC_CHECK_NAN") is False
    assert config.get("TPUREC_LOG") == frozenset()
    assert config.get("TPUREC_CPU_THREADS") is None
    monkeypatch.setenv("TPUREC_FUSED_MAX_OPS", "")  # empty is unset
    assert config.get("TPUREC_FUSED_MAX_OPS") == 2000


def test_the_environment_is_read_when_the_flag_is_read(monkeypatch):
    monkeypatch.setenv("TPUREC_FUSED_MAX_OPS", "8")
    monkeypatch.setenv("TPUREC_NATIVE_MATMUL", "0")
    monkeypatch.setenv("TPUREC_LOG", "Recompiles, all")
    monkeypatch.setenv("TPUREC_PREPROCESS", " NumPy ")
    assert config.get("TPUREC_FUSED_MAX_OPS") == 8
    assert config.get("native_matmul") is False and config.native_matmul is False
    assert config.TPUREC_NATIVE_MATMUL is False
    assert config.get("TPUREC_LOG") == {"recompiles", "all"}
    assert config.get("preprocess") == "numpy"
    monkeypatch.setenv("TPUREC_FUSED_MAX_OPS", "9")
    assert config.fused_max_ops == 9


def test_update_wins_over_the_environment_and_none_goes_back(monkeypatch):
    monkeypatch.setenv("TPUREC_FUSED_MAX_OPS", "8")
    try:
        config.update("TPUREC_FUSED_MAX_OPS", 3)
        assert config.get("TPUREC_FUSED_MAX_OPS") == 3
        config.update("fused_max_ops", "5")  # text, as in the environment
        assert config.get("TPUREC_FUSED_MAX_OPS") == 5
    finally:
        config.update("TPUREC_FUSED_MAX_OPS", None)
    assert config.get("TPUREC_FUSED_MAX_OPS") == 8


def test_override_restores_what_was_set_before(monkeypatch):
    monkeypatch.delenv("TPUREC_HOST_FALLBACK", raising=False)
    monkeypatch.delenv("TPUREC_CPU_THREADS", raising=False)
    config.update("TPUREC_CHECK_NAN", True)
    try:
        with config.override(host_fallback="error", check_nan=False, cpu_threads=2):
            assert config.get("TPUREC_HOST_FALLBACK") == "error" and config.get("TPUREC_CHECK_NAN") is False
            assert os.environ["TPUREC_CPU_THREADS"] == "2"  # native code reads the variable itself
        assert config.get("TPUREC_HOST_FALLBACK") == "warn" and config.get("TPUREC_CHECK_NAN") is True
        assert "TPUREC_CPU_THREADS" not in os.environ
        with pytest.raises(RuntimeError, match="inside"), config.override(host_fallback="error"):
            raise RuntimeError("inside")
        assert config.get("TPUREC_HOST_FALLBACK") == "warn"
    finally:
        config.update("TPUREC_CHECK_NAN", None)


@pytest.mark.parametrize(
    "name,text,allowed",
    [
        ("TPUREC_FUSED_MAX_OPS", "many", "an integer >= 1"),
        ("TPUREC_FUSED_MAX_OPS", "0", "an integer >= 1"),
        ("TPUREC_NATIVE_MATMUL", "maybe", "1 or 0"),
        ("TPUREC_HOST_FALLBACK", "sometimes", "'warn' or 'error'"),
        ("TPUREC_LOG", "recompiles,everything", "a comma-separated list of 'recompiles' or 'all'"),
        ("TPUREC_COORDINATOR_PORT", "70000", "an integer from 1 to 65535"),
        ("TPUREC_CPU_THREADS", "-1", "an integer >= 1"),
    ],
)
def test_a_bad_value_names_the_flag_and_the_allowed_values(monkeypatch, name, text, allowed):
    monkeypatch.setenv(name, text)
    with pytest.raises(ValueError, match=re.escape(f"{name} must be {allowed}")) as caught:
        config.get(name)
    assert f"{name}={text!r} in the environment" in str(caught.value)
    monkeypatch.delenv(name)
    before = config.get(name)
    with pytest.raises(ValueError, match=re.escape(f"{name} must be {allowed}")):
        config.update(name, text)
    assert config.get(name) == before  # unchanged after the error


def test_a_bad_value_in_override_changes_nothing(monkeypatch):
    monkeypatch.delenv("TPUREC_FUSED_MAX_OPS", raising=False)
    with (
        pytest.raises(ValueError, match="TPUREC_CHECK_NAN must be 1 or 0"),
        config.override(fused_max_ops=4, check_nan="perhaps"),
    ):
        pass
    assert config.get("TPUREC_FUSED_MAX_OPS") == 2000


def test_wrong_python_types_and_unknown_names_are_errors():
    with pytest.raises(ValueError, match="TPUREC_NATIVE_MATMUL must be 1 or 0"):
        config.update("TPUREC_NATIVE_MATMUL", 2.5)
    with pytest.raises(ValueError, match="TPUREC_FUSED_MAX_OPS must be an integer"):
        config.update("TPUREC_FUSED_MAX_OPS", True)
    with pytest.raises(ValueError, match="'TPUREC_NO_SUCH' is not a tpurec flag; the flags are TPUREC_MODE"):
        config.get("TPUREC_NO_SUCH")
    with pytest.raises(AttributeError):
        config.no_such_flag  # noqa: B018


@pytest.mark.parametrize("name", [f.name for f in config.FLAGS if not f.can_set()])
def test_flags_read_at_import_cannot_be_set_from_python(name):
    before = config.get(name)
    with pytest.raises(ValueError, match=f"{name} is read once, when tpurec is imported: set the environment variable"):
        config.update(name, config.flag(name).default)
    assert config.get(name) == before


def test_an_import_time_flag_says_what_to_use_instead():
    with pytest.raises(ValueError, match=r"from Python use tpurec.set_mode\(\)"):
        config.update("TPUREC_MODE", "fused")


def test_program_settings_hold_the_flags_that_change_programs():
    assert [f.name for f in config.FLAGS if f.programs] == [
        "TPUREC_SPARSE_KERNEL",
        "TPUREC_TENSORCORE_ONE_PASS",
        "TPUREC_TENSORCORE_ROW_SUM",
        "TPUREC_TENSORCORE_ROW_SLOTS",
        "TPUREC_TENSORCORE_LANE_DENSE",
        "TPUREC_NATIVE_MATMUL",
    ]
    with config.override(native_matmul=False):
        off = config.program_settings()
    assert off != config.program_settings() and hash(off) is not None


def test_docs_table_is_the_generated_one():
    import gen_docs  # tests/ is on sys.path (tests/conftest.py)

    committed = gen_docs.committed("docs/config.md", "flags")
    assert committed == config.markdown_table().removesuffix("\n"), "docs/config.md is stale: python tests/gen_docs.py"
    for f in config.FLAGS:
        assert f"| `{f.name}` | {f.allowed()} |" in committed
