"""Writes the generated parts of the docs from the lowering table.

``python tests/gen_docs.py`` rewrites each part in place; ``tests/test_docs.py`` fails while the
committed text differs from what this prints. A part sits between
``<!-- generated: NAME (python tests/gen_docs.py) -->`` and ``<!-- end generated: NAME -->``.

Parts:

* ``lowered-ops`` (docs/lowerings.md): the ATen ops each family file of that page lowers.
* ``not-lowered`` (docs/lowerings.md): the ATen ops that OpInfo entries reach and that have no
  lowering (from ``tests/dense/opinfo_known_failures.txt``, kept by ``make coverage``).
* ``flags`` (docs/config.md): the table of every ``TPUREC_*`` flag, from ``tpurec.config.FLAGS``.
* ``patches`` (docs/import.md): every change ``import tpurec`` makes, from ``tpurec._patches.PATCHES``.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
KNOWN_FAILURES = ROOT / "tests" / "dense" / "opinfo_known_failures.txt"
# The family files docs/lowerings.md describes, in its order.
FAMILIES = ("conv", "pooling", "rnn", "linalg", "fft", "special", "grouped_mm", "weight_norm", "selection")


def lowered_ops() -> dict[str, str]:
    """ATen op name (``aten::add``, overload dropped) -> the module of its lowering."""
    import torch

    import tpurec  # noqa: F401 (registers the tpu device and the op families)
    from tpurec.dense import registry

    registry.get_lowering(torch.ops.aten.add.Tensor)  # the table fills on first use
    ops: dict[str, str] = {}
    for op, entry in registry.LOWERINGS.items():
        fn = getattr(entry, "fn", entry)
        ops.setdefault(op.name().partition(".")[0], getattr(fn, "__module__", "") or "")
    return ops


def render_lowered(ops: dict[str, str]) -> str:
    lines = []
    for family in FAMILIES:
        names = sorted(
            name.removeprefix("aten::") for name, module in ops.items() if module == f"tpurec.dense.{family}"
        )
        lines.append(f"* `{family}.py` ({len(names)}): " + ", ".join(f"`{n}`" for n in names))
    return "\n".join(lines)


def render_not_lowered(ops: dict[str, str]) -> str:
    named = set(re.findall(r"the ATen op '(aten::\w+)'", KNOWN_FAILURES.read_text()))
    missing = sorted(name for name in named if name not in ops)
    if not missing:
        return "Every ATen op that an OpInfo entry reaches has a lowering or a decomposition."
    return (
        "Not lowered (OpInfo entries that reach them fail, see docs/ops.md): "
        + ", ".join(f"`{name.removeprefix('aten::')}`" for name in missing)
        + "."
    )


def render_flags() -> str:
    from tpurec import config

    return config.markdown_table().removesuffix("\n")


def render_patches() -> str:
    from tpurec._patches import PATCHES

    def cell(text: str) -> str:
        return " ".join(text.split()).replace("|", "\\|")

    lines = ["| patch | library | applied | what it changes | why |", "|---|---|---|---|---|"]
    for p in PATCHES:
        applied = f"when `{p.after_import}` is imported" if p.after_import else "at `import tpurec`"
        lines.append(f"| `{p.name}` | {p.library} | {applied} | {cell(p.changes)} | {cell(p.reason)} |")
    return "\n".join(lines)


def parts() -> dict[tuple[str, str], str]:
    """(page, part name) -> the generated text."""
    ops = lowered_ops()
    return {
        ("docs/lowerings.md", "lowered-ops"): render_lowered(ops),
        ("docs/lowerings.md", "not-lowered"): render_not_lowered(ops),
        ("docs/config.md", "flags"): render_flags(),
        ("docs/import.md", "patches"): render_patches(),
    }


def _span(name: str) -> re.Pattern:
    return re.compile(
        rf"(<!-- generated: {re.escape(name)} \(python tests/gen_docs.py\) -->\n)(.*?)(<!-- end generated: {re.escape(name)} -->)",
        re.DOTALL,
    )


def committed(page: str, name: str) -> str:
    """The text of part ``name`` as committed in ``page``."""
    match = _span(name).search((ROOT / page).read_text())
    assert match, f"{page}: no generated part {name!r}"
    return match.group(2).removesuffix("\n")


def write() -> None:
    for (page, name), text in parts().items():
        path = ROOT / page
        source = path.read_text()
        assert _span(name).search(source), f"{page}: no generated part {name!r}"
        path.write_text(_span(name).sub(lambda m: m.group(1) + text + "\n" + m.group(3), source))


if __name__ == "__main__":
    write()
    sys.exit(0)
