"""tests/on_chip.sh, which CI cannot run (it needs a TPU): it parses, every group its header lists is one it runs,
and an unknown group is refused before anything starts; every file it names exists."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent / "on_chip.sh"


def test_the_script_parses_and_runs_every_group_its_header_lists() -> None:
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True, timeout=30)
    text = SCRIPT.read_text()
    listed = set(re.findall(r"^#   (\w+) {2,}", text, re.MULTILINE))
    handled = set(re.findall(r"^    (\w+)\)$", text, re.MULTILINE))
    known = set(re.search(r'^known=" (.*) "$', text, re.MULTILINE).group(1).split())  # type: ignore[union-attr]
    assert listed and listed == handled == known, (listed, handled, known)


def test_an_unknown_group_is_refused_before_anything_runs(tmp_path: Path) -> None:
    out = subprocess.run(
        ["bash", str(SCRIPT), str(tmp_path), "train", "dlrm_typo"], capture_output=True, text=True, timeout=30
    )
    assert out.returncode == 2 and "unknown group dlrm_typo" in out.stderr, out.stderr
    assert not (tmp_path / "summary.txt").exists()


def test_every_file_the_script_names_exists() -> None:
    root = SCRIPT.parent.parent
    named = set(re.findall(r"\b((?:tests|examples)/[\w/]+\.py)\b", SCRIPT.read_text()))
    assert named and not [path for path in named if not (root / path).is_file()], named
