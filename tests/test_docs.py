"""Every fenced code block of README.md and docs/*.md works as written.

* ``python`` blocks run, each in a fresh interpreter with a timeout, from a scratch folder that
  sees the repository's ``examples/`` (so relative paths such as
  ``examples/planner/...`` resolve as they do from a checkout's root).
* ``bash`` blocks are checked command by command: ``make T`` needs a target ``T`` in the
  Makefile; ``tpurec ...``, ``python -m tpurec...`` and ``python path/to/script.py ...`` run with
  ``--help`` (exit 0), and every ``--flag`` of the documented line must appear in that help;
  ``pytest PATH ...`` needs ``PATH`` to exist. Any other command fails the test.
* ``text`` blocks are output or layouts, never run.
* A fence without a language fails: say what it is.

Markers, in an HTML comment on the line before the fence (blank lines allowed between):

* ``<!-- doctest: skip (reason) -->``: not run; the reason is required.
* ``<!-- doctest: continue -->``: a python block that runs after the page's previous python
  block, in the same interpreter (the page reads as one script).
* ``<!-- doctest: slow -->``: marked ``slow`` (still run in CI).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
PYTHON_TIMEOUT_S = 240
HELP_TIMEOUT_S = 120
_FENCE = re.compile(r"^(\s*)```(.*)$")
_MARKER = re.compile(r"^<!--\s*doctest:\s*(skip|continue|slow)\b\s*(.*?)\s*-->$")


@dataclasses.dataclass
class Block:
    """One fenced block of a page."""

    page: Path
    line: int  # 1-based line of the opening fence
    lang: str
    code: str
    markers: dict[str, str]
    previous: Block | None = None  # the page's previous python block, for `continue`

    @property
    def id(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"

    def script(self) -> str:
        """The code this block runs: itself, after the blocks it continues."""
        if "continue" in self.markers:
            assert self.previous is not None, f"{self.id}: `continue` with no python block before it"
            return self.previous.script() + "\n" + self.code
        return self.code


def parse(page: Path) -> list[Block]:
    """The fenced blocks of ``page``, with the markers in the comment just before each."""
    lines = page.read_text().splitlines()
    blocks: list[Block] = []
    last_python: Block | None = None
    i = 0
    while i < len(lines):
        match = _FENCE.match(lines[i])
        if not match:
            i += 1
            continue
        indent, lang = match.group(1), match.group(2).strip()
        markers: dict[str, str] = {}
        j = i - 1
        while j >= 0 and (not lines[j].strip() or _MARKER.match(lines[j].strip())):
            marker = _MARKER.match(lines[j].strip())
            if marker:
                markers[marker.group(1)] = marker.group(2)
            j -= 1
        end = i + 1
        while end < len(lines) and not lines[end].strip().startswith("```"):
            end += 1
        assert end < len(lines), f"{page.name}:{i + 1}: unclosed fence"
        code = "\n".join(line[len(indent) :] for line in lines[i + 1 : end])
        block = Block(page, i + 1, lang, code, markers, last_python)
        blocks.append(block)
        if lang == "python":
            last_python = block
        i = end + 1
    return blocks


BLOCKS = [block for page in PAGES for block in parse(page)]


def _params(langs: set[str]) -> list:
    return [
        pytest.param(block, id=block.id, marks=[pytest.mark.slow] if "slow" in block.markers else [])
        for block in BLOCKS
        if block.lang in langs
    ]


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return env


def _run_python(block: Block, workdir: Path) -> subprocess.CompletedProcess:
    workdir.mkdir(parents=True, exist_ok=True)
    if not (workdir / "examples").exists():
        (workdir / "examples").symlink_to(ROOT / "examples")
    return subprocess.run(
        [sys.executable, "-c", block.script()],
        cwd=workdir,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=PYTHON_TIMEOUT_S,
    )


@pytest.fixture(scope="module")
def python_results(request, tmp_path_factory) -> dict[str, concurrent.futures.Future]:
    """The selected python blocks, started at once on two workers (the machine's cores)."""
    selected = {
        item.callspec.params["block"].id
        for item in request.session.items
        if getattr(item, "originalname", None) == "test_python_block_runs"
    }
    base = tmp_path_factory.mktemp("doc_blocks")
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=2)
    futures = {
        block.id: pool.submit(_run_python, block, base / re.sub(r"\W", "_", block.id))
        for block in BLOCKS
        if block.id in selected and "skip" not in block.markers
    }
    yield futures
    pool.shutdown(wait=False, cancel_futures=True)


def _check_skip(block: Block) -> None:
    if "skip" in block.markers:
        assert block.markers["skip"].startswith("(") and len(block.markers["skip"]) > 2, (
            f"{block.id}: `doctest: skip` needs a reason in parentheses"
        )
        pytest.skip(f"marked in the page: {block.markers['skip']}")


@pytest.mark.parametrize("block", _params({"python"}))
def test_python_block_runs(block: Block, python_results) -> None:
    _check_skip(block)
    result = python_results[block.id].result()
    assert result.returncode == 0, f"{block.id} failed:\n{block.script()}\n--- stderr:\n{result.stderr[-4000:]}"


def _commands(code: str) -> list[str]:
    """The block's commands: continuation lines joined, comments and blank lines dropped."""
    joined = re.sub(r"\\\n", " ", code)
    commands = []
    for line in joined.splitlines():
        words = shlex.split(line, comments=True)
        if words:
            commands.append(shlex.join(words))
    return commands


@functools.cache
def _help(command: tuple[str, ...]) -> str:
    result = subprocess.run(
        [*command, "--help"], cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=HELP_TIMEOUT_S
    )
    assert result.returncode == 0, f"`{' '.join(command)} --help` exited {result.returncode}:\n{result.stderr[-2000:]}"
    return result.stdout


def _check_flags(words: list[str], command: tuple[str, ...]) -> None:
    text = _help(command)
    for word in words:
        if word.startswith("--"):
            flag = word.split("=", 1)[0]
            # The whole flag: `--batch` is not shown by a help that lists `--batch-size` only.
            shown = re.search(rf"{re.escape(flag)}(?![\w-])", text)
            assert shown, f"`{flag}` is not in `{' '.join(command)} --help`"


def _makefile_targets() -> set[str]:
    return set(re.findall(r"^([A-Za-z][\w.-]*):", (ROOT / "Makefile").read_text(), re.MULTILINE))


def check_command(line: str) -> None:
    """Checks one documented shell command (see the module docstring)."""
    words = shlex.split(line)
    while words and re.fullmatch(r"\w+=\S*", words[0]):  # leading VAR=value assignments
        words = words[1:]
    name = words[0]
    if name == "make":
        for target in (w for w in words[1:] if not w.startswith("-") and "=" not in w):
            assert target in _makefile_targets(), f"`make {target}`: no such target in the Makefile"
    elif name == "tpurec" or (
        name.endswith("python") and words[1:3] and words[1] == "-m" and words[2].startswith("tpurec")
    ):
        args = words[1:] if name == "tpurec" else words[3:]
        module = "tpurec" if name == "tpurec" else words[2]
        sub = [w for w in args[:1] if not w.startswith("-")]  # `tpurec plan`, `-m tpurec.bench dlrm`
        _check_flags(args, (sys.executable, "-m", module, *sub))
    elif name.endswith("python") and words[1:] and words[1].endswith(".py"):
        assert (ROOT / words[1]).is_file(), f"`{words[1]}` does not exist"
        _check_flags(words[2:], (sys.executable, words[1]))
    elif name == "pytest" or (name.endswith("python") and words[1:3] == ["-m", "pytest"]):
        paths = [w for w in words[1:] if w.startswith("tests")]
        assert paths, f"`{line}`: name the tests it runs"
        for path in paths:
            assert (ROOT / path.split("::")[0]).exists(), f"`{path}` does not exist"
    else:
        raise AssertionError(f"`{line}`: no rule checks this command; mark the block (see tests/test_docs.py)")


@pytest.mark.parametrize("block", _params({"bash", "sh", "shell"}))
def test_shell_block_commands(block: Block) -> None:
    _check_skip(block)
    commands = _commands(block.code)
    assert commands, f"{block.id}: empty block"
    for line in commands:
        check_command(line)


KNOWN_LANGS = {"python", "bash", "sh", "shell", "text"}


@pytest.mark.parametrize("block", [pytest.param(b, id=b.id) for b in BLOCKS])
def test_every_block_says_what_it_is(block: Block) -> None:
    assert block.lang in KNOWN_LANGS, (
        f"{block.id}: fence language {block.lang!r}: use one of {sorted(KNOWN_LANGS)} "
        "(`text` for output and layouts) so the doc test knows how to check it"
    )


def test_markers_are_known() -> None:
    for page in PAGES:
        for n, line in enumerate(page.read_text().splitlines(), 1):
            if "doctest:" in line:
                assert _MARKER.match(line.strip()), f"{page.name}:{n}: unknown doctest marker {line.strip()!r}"


def test_the_checks_catch_bad_commands() -> None:
    """The shell rules reject what a wrong page would say (the checks can fail)."""
    for bad in ["make no-such-target", "rm -rf build", "pytest tests/no_such_test.py", "python examples/missing.py",
                "python -m tpurec.bench modes --batch 64"]:  # fmt: skip
        with pytest.raises(AssertionError):
            check_command(bad)


def test_generated_parts_match_the_lowering_table() -> None:
    """The lists in the docs that tests/gen_docs.py writes equal what it writes now."""
    import gen_docs  # beside this file (tests/ is on sys.path: tests/conftest.py)

    for (page, name), text in gen_docs.parts().items():
        assert gen_docs.committed(page, name) == text, f"{page}: part {name!r} is stale: run python tests/gen_docs.py"


# Development-log wording: README.md and docs/ describe the product as it is, for someone with nothing
# else; what changed when lives in git history. Each pattern is a phrase that tells a story of
# changes ("now compile", "before/after" columns, "in the next round") rather than what tpurec does.
DEV_LOG_PATTERNS = [
    r"\bnow\b(?! on\b)",  # "now compile", "is now" ("from now on" is an instruction)
    r"\bused to (?:be|take|wrap|run|call|give|make)\b",
    r"\bsince fixed\b",
    r"\bin the next (?:round|session|change)\b",
    r"\bno longer\b",
    r"\bbefore and after:",
    r"\|\s*before\s*\|",  # a table column of an earlier version's figures
    r"\bbefore: ",
    r"\(it was \d",  # "(it was 50)": an earlier figure
    r"\bgdb\b",
    r"\bminutes of device\s+time\b",
    r"\bthis round\b",
    r"\bprevious main\b",
    r"\b(?:this|next|the) session\b",
    r"\btoday\b",  # "as it runs today": true on one date
]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_page_has_no_development_log_wording(page: Path) -> None:
    text = page.read_text()
    found = [
        f"{page.relative_to(ROOT)}:{text.count(chr(10), 0, m.start()) + 1}: {m.group(0)!r}"
        for pattern in DEV_LOG_PATTERNS
        for m in re.finditer(pattern, text, re.IGNORECASE)
    ]
    assert not found, "development-log wording (say what tpurec does, not what changed):\n" + "\n".join(found)
