"""The package as pip sees it: version, licence, declared dependencies."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tomllib
from importlib import metadata
from pathlib import Path

import pytest

import tpurec

ROOT = Path(__file__).resolve().parents[1]


def _pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_version_is_the_installed_distributions():
    assert tpurec.__version__ == metadata.version("tpurec") == _pyproject()["project"]["version"]


def test_license_is_declared_and_shipped():
    project = _pyproject()["project"]
    assert project["license"] == "BSD-3-Clause"
    assert "BSD 3-Clause License" in (ROOT / "LICENSE").read_text()
    assert metadata.metadata("tpurec")["License-Expression"] == "BSD-3-Clause"


def test_every_runtime_import_is_a_declared_dependency():
    # What tpurec imports (directly or lazily) must come with `pip install .`, not only with the lock.
    declared = {_name(req) for req in _pyproject()["project"]["dependencies"]}
    for needed in (
        "torch",
        "torchrec",
        "fbgemm-gpu-cpu",
        "jax",
        "jaxlib",
        "jax-tpu-embedding",
        "numpy",
        "orbax-checkpoint",
    ):
        assert needed in declared, needed


def test_lock_satisfies_the_declared_ranges():
    # The lock is the exact tested set; it must lie inside the ranges that `pip install .` resolves.
    from packaging.requirements import Requirement

    pinned = {}
    for lock in ("requirements.lock", "requirements-test.lock"):
        for line in (ROOT / lock).read_text().splitlines():
            line = line.split("#")[0].strip()
            if line:
                name, version = line.split("==")
                pinned[_name(name)] = version
    project = _pyproject()["project"]
    requirements = list(project["dependencies"])
    for extra in project["optional-dependencies"].values():
        requirements += [r for r in extra if not r.startswith("tpurec")]
    for text in requirements:
        req = Requirement(text)
        name = _name(req.name)
        assert name in pinned, f"{name} is declared but not pinned in the lock"
        assert req.specifier.contains(pinned[name], prereleases=True), f"{name}=={pinned[name]} not in {req.specifier}"


# torchrec's metadata asks for the CUDA fbgemm-gpu, which cannot be installed on CPU; fbgemm-gpu-cpu
# provides the same modules. Every other requirement of every installed distribution must hold.
KNOWN_UNMET = re.compile(r"torchrec \S+ requires fbgemm-gpu, which is not installed\.")


def test_pip_check_reports_only_torchrecs_cuda_fbgemm():
    out = subprocess.run(
        [sys.executable, "-m", "pip", "check"], capture_output=True, text=True, timeout=300, check=False
    )
    problems = [line for line in out.stdout.splitlines() if line.strip() and not KNOWN_UNMET.fullmatch(line.strip())]
    assert not problems, "pip check: " + "\n".join(problems) + "\n(fix requirements.lock / requirements-test.lock)"
    assert out.returncode in (0, 1) and not out.stderr.strip(), out.stderr


def _name(requirement: str) -> str:
    """The normalized project name (PEP 503) at the start of a requirement string."""
    return re.sub(r"[-_.]+", "-", re.match(r"[A-Za-z0-9_.-]+", requirement).group(0)).lower()


def test_make_test_runs_lint_with_locked_tools():
    # `make test` (what CI runs) lints first; the tools it calls come from requirements-test.lock.
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(r"^test: lint\b", makefile, re.MULTILINE)
    lint = makefile.split("\nlint:", 1)[1].split("\n\n", 1)[0]
    lock = (ROOT / "requirements-test.lock").read_text()
    for tool in ("ruff", "basedpyright"):
        assert f"$(VENV)/bin/{tool}" in lint, tool
        assert re.search(rf"^{tool}==", lock, re.MULTILINE), f"{tool} is not pinned in requirements-test.lock"


def _locked_version(name: str) -> str:
    for line in (ROOT / "requirements.lock").read_text().splitlines():
        line = line.split("#")[0].strip()
        if line and _name(line) == name:
            return line.split("==")[1]
    raise AssertionError(f"{name} is not pinned in requirements.lock")


def test_tpu_extra_is_jax_tpu_runtime_at_the_locked_jax():
    # `pip install "tpurec[tpu]"` must bring the libtpu that the tested JAX was built against: jax's
    # own `tpu` extra at exactly the locked version (jax pins its libtpu release there).
    from packaging.requirements import Requirement

    (text,) = _pyproject()["project"]["optional-dependencies"]["tpu"]
    req = Requirement(text)
    assert _name(req.name) == "jax" and req.extras == {"tpu"}, text
    assert str(req.specifier) == f"=={_locked_version('jax')}", text
    jax_tpu = [Requirement(r) for r in metadata.requires("jax") or [] if 'extra == "tpu"' in r]
    assert any(_name(r.name) == "libtpu" for r in jax_tpu), "jax's metadata names no libtpu in its tpu extra"


@pytest.mark.slow
def test_pip_resolves_the_tpu_extra_with_the_lock(tmp_path):
    # pip's resolver (a dry run: metadata only, ~20 s) accepts tpurec[tpu] together with the locked set,
    # and picks the libtpu release jax's metadata asks for.
    from packaging.requirements import Requirement

    report = tmp_path / "report.json"
    out = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--no-build-isolation",
         "--quiet", "--report", str(report), "-c", str(ROOT / "requirements.lock"), f"{ROOT}[tpu]"],
        capture_output=True, text=True, timeout=600, check=False, cwd=tmp_path,
    )  # fmt: skip
    if out.returncode != 0 and re.search(r"Failed to establish a new connection|Could not fetch URL", out.stderr):
        pytest.skip("the package index is unreachable from this machine: " + out.stderr.strip().splitlines()[-1])
    assert out.returncode == 0, out.stderr
    chosen = {_name(i["metadata"]["name"]): i["metadata"]["version"] for i in json.loads(report.read_text())["install"]}
    assert chosen["jax"] == _locked_version("jax")
    (libtpu,) = [Requirement(r) for r in metadata.requires("jax") or [] if r.startswith("libtpu")]
    assert libtpu.specifier.contains(chosen["libtpu"]), (chosen["libtpu"], str(libtpu.specifier))
