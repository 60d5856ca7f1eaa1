"""The README's "On a Cloud TPU VM": its commands are what tools/tpu/prepare.sh and setup.sh run, at the lock's pins.

What a CPU machine can check: the scripts parse; the README's PyPI commands name the locked torch, the locked
fbgemm-gpu-cpu and extras that pyproject.toml declares; every prepare.sh command line the README shows is one the
script accepts (run with --dry-run), and what it then downloads is exactly the lock's pins (torch's CPU build,
jax[tpu] at the locked jax); bad options exit 2 naming what is wrong; a folder laid out as prepare.sh lays it out
installs through setup.sh with no package index, as on the VM (a wheel built here), and puts the checkout and the
installed folder on PYTHONPATH with JAX free to take a TPU; with the package index reachable, a folder that
prepare.sh itself made installs the same way.
"""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from test_docs import ROOT, Block, check_command, parse

PREPARE = ROOT / "tools" / "tpu" / "prepare.sh"
SETUP = ROOT / "tools" / "tpu" / "setup.sh"
TORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"


def _norm(name: str) -> str:
    """The PEP 503 normalized form of a package name."""
    return re.sub(r"[-_.]+", "-", name).lower()


def _pins(*locks: str) -> dict[str, str]:
    """Normalized name -> ``name==version`` line of the given lock files."""
    pins = {}
    for lock in locks:
        for line in (ROOT / lock).read_text().splitlines():
            line = line.split("#")[0].strip()
            if line:
                pins[_norm(line.split("==")[0])] = line
    return pins


def _version(name: str) -> str:
    return _pins("requirements.lock")[name].split("==")[1]


def _section() -> str:
    """The README's TPU VM section, heading to the next heading of its level."""
    text = (ROOT / "README.md").read_text()
    start = text.index("## On a Cloud TPU VM")
    return text[start : text.index("\n## ", start + 1)]


def _blocks() -> list[Block]:
    text = (ROOT / "README.md").read_text()
    first = text[: text.index("## On a Cloud TPU VM")].count("\n") + 1
    last = first + _section().count("\n")
    return [b for b in parse(ROOT / "README.md") if first <= b.line <= last and b.lang == "bash"]


def _commands(block: Block) -> list[list[str]]:
    lines = re.sub(r"\\\n", " ", block.code).splitlines()
    return [words for words in (shlex.split(line, comments=True) for line in lines) if words]


def _prepare(*args: str, cwd: Path = ROOT, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(PREPARE), *args], cwd=cwd, capture_output=True, text=True, timeout=600, env=env, check=False
    )


def _dry_run(*args: str) -> tuple[list[list[str]], str]:
    """prepare.sh's pip commands for ``args`` (split into words) and its 'left out' list."""
    out = _prepare(*args, "--dry-run")
    assert out.returncode == 0, (args, out.stderr)
    lines = out.stdout.splitlines()
    assert lines[-1].startswith("left out:"), out.stdout
    return [line.split() for line in lines[:-1]], lines[-1].removeprefix("left out:").strip()


def test_the_scripts_parse() -> None:
    for script in (PREPARE, SETUP):
        subprocess.run(["bash", "-n", str(script)], check=True, timeout=30)


def test_the_pypi_commands_install_the_locked_versions_and_declared_extras() -> None:
    import tomllib

    from packaging.requirements import Requirement

    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    (block,) = [b for b in _blocks() if "venv" in b.code]
    torch_pins = [w for words in _commands(block) for w in words if w.startswith("torch==")]
    assert torch_pins == [f"torch=={_version('torch')}"], torch_pins
    assert any(TORCH_CPU_INDEX in words for words in _commands(block)), "torch's CPU build is not what it installs"
    (extras,) = re.findall(r'"\.\[([\w,]+)\]"', block.code)
    assert "tpu" in extras.split(",") and set(extras.split(",")) <= set(pyproject["optional-dependencies"]), extras
    (fbgemm,) = [Requirement(w) for words in _commands(block) for w in words if w.startswith("fbgemm-gpu-cpu")]
    assert fbgemm.specifier.contains(_version("fbgemm-gpu-cpu")), str(fbgemm)
    # The release the prose names is the tpu extra's, at the locked jax.
    assert re.findall(r"jax\[tpu\]==([\d.]+)", _section()) == [_version("jax")]
    assert pyproject["optional-dependencies"]["tpu"] == [f"jax[tpu]=={_version('jax')}"]


def test_the_wheel_folder_commands_are_the_scripts() -> None:
    (block,) = [b for b in _blocks() if "prepare.sh" in b.code]
    commands = _commands(block)
    prepare = [words for words in commands if words[:2] == ["bash", "tools/tpu/prepare.sh"]]
    assert len(prepare) == 1, commands
    args = prepare[0][2:]
    _dry_run(*args)  # the script takes the README's command line
    out = next((a for a in args if not a.startswith("-")), ".tpu")
    assert ["source", f"{out}/setup.sh"] in commands, commands
    for words in commands:
        if words[0].startswith("python"):  # what runs after setup.sh, by the doc test's rules
            check_command(shlex.join(["python", *words[1:]]))
        else:
            assert words[0] in ("bash", "source"), words
    # Every option the prose names is one the script takes; every list it shows is accepted.
    section = _section()
    options = set(re.findall(r"`(--[\w-]+)", section)) - {"--no-index", "--no-deps"}
    assert options == {"--skip", "--from-vm", "--test", "--dry-run"}, options
    shown = _prepare("--help")
    assert shown.returncode == 0, shown.stderr
    assert set(re.findall(r"^  (--[\w-]+)", shown.stdout, re.MULTILINE)) == options, shown.stdout
    examples = re.findall(r"`(--(?:skip|from-vm) [a-z][\w,-]*)`", section)
    assert len(examples) == 2, examples
    for example in examples:
        _dry_run(*example.split())
    # The variables and defaults the prose names are setup.sh's.
    setup = SETUP.read_text()
    for variable, default in re.findall(r"`(TPUREC_\w+)`, default `([^`]+)`", section):
        assert f"${{{variable}:-{default}}}" in setup, (variable, default)
    assert "TPUREC_FIND_LINKS" in section and "$TPUREC_FIND_LINKS" in setup
    assert re.search(r"^\s*unset JAX_PLATFORMS XLA_FLAGS$", setup, re.MULTILINE)


def test_the_folder_holds_the_locks_pins_torchs_cpu_build_and_jax_tpu() -> None:
    commands, left_out = _dry_run()
    wheel, torch, jax_tpu = commands
    assert left_out == ""
    assert wheel[1:4] == ["-m", "pip", "wheel"] and "--no-deps" in wheel
    lock = _pins("requirements.lock")
    assert sorted(wheel[wheel.index(".tpu/wheels") + 1 :]) == sorted(p for n, p in lock.items() if n != "torch")
    assert torch[1:4] == ["-m", "pip", "download"] and torch[-1] == lock["torch"]
    assert torch[torch.index("--index-url") + 1] == TORCH_CPU_INDEX
    assert jax_tpu[-1] == f"jax[tpu]=={_version('jax')}"
    assert jax_tpu[jax_tpu.index("-c") + 1] == "requirements.lock" and "--no-deps" not in jax_tpu


def test_skip_from_vm_and_test_select_from_both_locks() -> None:
    commands, left_out = _dry_run("--test", "--skip", "jax,libtpu,NumPy", "--from-vm", "torch", "out")
    (wheel,) = commands  # neither torch's nor jax[tpu]'s download
    pins = _pins("requirements.lock", "requirements-test.lock")
    wanted = sorted(p for n, p in pins.items() if n not in {"torch", "jax", "numpy"})
    assert sorted(wheel[wheel.index("out/wheels") + 1 :]) == wanted
    assert left_out == "jax libtpu numpy torch"
    (_, _, jax_tpu), _ = _dry_run("--test")
    assert jax_tpu.count("-c") == 2 and "requirements-test.lock" in jax_tpu


@pytest.mark.parametrize(
    "args,message",
    [
        (["--bogus"], "unknown option --bogus"),
        (["--skip", "no-such-package"], "--skip no-such-package: not pinned"),
        (["--from-vm", "libtpu"], "--from-vm libtpu: not pinned"),
        (["--skip"], "--skip needs a comma-separated list of package names"),
        (["--from-vm", "--test"], "--from-vm needs a comma-separated list of package names"),
        (["one", "two"], "usage: bash tools/tpu/prepare.sh"),
    ],
)
def test_bad_input_exits_2_saying_what(args: list[str], message: str) -> None:
    out = _prepare(*args, "--dry-run")
    assert out.returncode == 2 and message in out.stderr and not out.stdout, (out.returncode, out.stderr)


def test_prepare_outside_the_checkout_root_exits_2(tmp_path: Path) -> None:
    out = _prepare("--dry-run", cwd=tmp_path)
    assert out.returncode == 2 and "run from the checkout's root" in out.stderr, out.stderr


def _source_setup(folder: Path, tmp_path: Path, **env: str) -> subprocess.CompletedProcess[str]:
    """Sources folder/setup.sh from the checkout's root as on the VM, then prints what a run there sees."""
    import os

    base = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    base.update(
        PYTHON=sys.executable,
        TPUREC_SITE=str(tmp_path / "site"),
        TPUREC_CACHE_DIR=str(tmp_path / "cache"),
        JAX_PLATFORMS="cpu",
        XLA_FLAGS="--xla_force_host_platform_device_count=8",
        **env,
    )
    after = 'echo "PYTHONPATH=$PYTHONPATH"; echo "JAX_PLATFORMS=${JAX_PLATFORMS-unset} XLA_FLAGS=${XLA_FLAGS-unset}"'
    return subprocess.run(
        ["bash", "-c", f"source {shlex.quote(str(folder / 'setup.sh'))} && {after}"],
        cwd=ROOT,
        env=base,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def _probe_wheel(tmp_path: Path, name: str, version: str) -> Path:
    """A wheel of a one-module package, built here with no index."""
    project = tmp_path / f"{name}-src"
    (project / name).mkdir(parents=True)
    (project / name / "__init__.py").write_text(f"VERSION = {version!r}\n")
    (project / "pyproject.toml").write_text(
        f'[project]\nname = "{name}"\nversion = "{version}"\n'
        '[build-system]\nrequires = ["setuptools"]\nbuild-backend = "setuptools.build_meta"\n'
    )
    wheels = tmp_path / f"{name}-wheel"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "--no-index", "-w", str(wheels),
         str(project)],
        check=True, capture_output=True, timeout=300,
    )  # fmt: skip
    (wheel,) = wheels.glob("*.whl")
    return wheel


def test_setup_installs_the_folder_with_no_index_and_frees_jax(tmp_path: Path) -> None:
    folder = tmp_path / "tpu"
    (folder / "wheels").mkdir(parents=True)
    shutil.copy(SETUP, folder / "setup.sh")
    shutil.copy(_probe_wheel(tmp_path, "tpurec_probe_one", "1.0"), folder / "wheels")
    elsewhere = _probe_wheel(tmp_path, "tpurec_probe_two", "2.0").parent  # a --from-vm package's folder on the VM
    (folder / "requirements.txt").write_text("tpurec_probe_one==1.0\ntpurec-probe-two==2.0\n")
    out = _source_setup(folder, tmp_path, TPUREC_FIND_LINKS=str(elsewhere))
    assert out.returncode == 0, out.stderr
    site = tmp_path / "site"
    assert re.search(r"^tpurec setup: \d+ s; platform cpu, cpu$", out.stdout, re.MULTILINE), out.stdout
    assert f"PYTHONPATH={site}:{ROOT}\n" in out.stdout
    assert "JAX_PLATFORMS=unset XLA_FLAGS=unset" in out.stdout
    for name, version in (("tpurec_probe_one", "1.0"), ("tpurec_probe_two", "2.0")):
        assert (site / name / "__init__.py").read_text() == f"VERSION = {version!r}\n"
    # Without the folder that holds the --from-vm wheel, nothing is installed and the environment is left alone.
    shutil.rmtree(site)
    out = _source_setup(folder, tmp_path)
    assert "installing the wheels failed: see" in out.stderr and "tpurec-probe-two" in out.stderr, out.stderr
    assert "PYTHONPATH=\n" in out.stdout and "JAX_PLATFORMS=cpu" in out.stdout, out.stdout


@pytest.mark.slow
def test_a_folder_prepare_makes_installs_through_setup(tmp_path: Path) -> None:
    # prepare.sh's real downloads (two small pins of the lock, the rest skipped; six from the VM's own folder),
    # then setup.sh installs them with no index.
    lock = _pins("requirements.lock")
    skip = sorted(set(lock) - {"tqdm", "six"}) + ["libtpu"]
    folder = tmp_path / "tpu"
    out = _prepare("--skip", ",".join(skip), "--from-vm", "six", str(folder), env=_env_with_python())
    if out.returncode != 0 and re.search(r"Failed to establish a new connection|Could not fetch URL", out.stderr):
        pytest.skip("the package index is unreachable from this machine")
    assert out.returncode == 0, out.stderr
    assert [p.name.split("-")[0] for p in (folder / "wheels").glob("*.whl")] == ["tqdm"]
    assert (folder / "requirements.txt").read_text().split() == [lock["six"], lock["tqdm"]]
    vm_wheels = tmp_path / "vm_wheels"
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", str(vm_wheels), lock["six"]],
        check=True, capture_output=True, timeout=300,
    )  # fmt: skip
    out = _source_setup(folder, tmp_path, TPUREC_FIND_LINKS=str(vm_wheels))
    assert out.returncode == 0 and "platform cpu" in out.stdout, out.stderr
    for name in ("tqdm", "six"):
        (info,) = (tmp_path / "site").glob(f"{name}-*.dist-info")
        assert info.name == f"{lock[name].replace('==', '-')}.dist-info"


def _env_with_python() -> dict[str, str]:
    import os

    return {**os.environ, "PYTHON": sys.executable}


def test_setup_sourced_by_another_shell_says_to_use_bash() -> None:
    # It finds its folder through bash's BASH_SOURCE; another shell gets a message and status 2, nothing else.
    dash = shutil.which("dash")
    if dash is None:
        pytest.skip("no dash on this machine")
    out = subprocess.run(
        [dash, "-c", f'. {shlex.quote(str(SETUP))}; echo "rc=$? PYTHONPATH=${{PYTHONPATH-}}"'],
        cwd=ROOT, env={"PATH": "/usr/bin:/bin"}, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert out.stdout == "rc=2 PYTHONPATH=\n" and out.stderr == "source .tpu/setup.sh from bash\n", out
