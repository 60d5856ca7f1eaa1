"""The model zoo (tests/models/zoo.py): every family x mode trains on tpu exactly as on CPU.

``make test`` runs the ``DEFAULT`` slice; ``make zoo`` runs every pair (``-m "zoo or not zoo"``). A pair that
fails today is listed in ``KNOWN`` with its cause and runs as a strict xfail: when a fix lands,
the pair XPASSes, the run fails, and its line must go. docs/zoo.md has the table.
"""

import pytest

import zoo

# The pairs `make test` runs (passing today, 3-20 s each on 2 cores): a decoder LM in eager and fused
# mode, a vision model and an encoder with tied weights compiled.
DEFAULT = {("llama", "eager"), ("llama", "fused"), ("vit", "compiled"), ("bert", "compiled")}

# (family, mode) -> the exact cause of today's failure (docs/zoo.md has the table and the measurements).
# Empty: every pair passes. The compiled KV-cache failure (Dynamo's fake run of the cache's torch.cat) left
# when tpu tensors made inside compiled code became fake (tpurec/compile/dynamo.py).
KNOWN: dict[tuple[str, str], str] = {}


def _params():
    for name in zoo.FAMILIES:
        for mode in zoo.MODES:
            marks = [] if (name, mode) in DEFAULT else [pytest.mark.zoo]
            if (name, mode) in KNOWN:
                marks.append(pytest.mark.xfail(strict=True, reason=KNOWN[(name, mode)]))
            yield pytest.param(name, mode, id=f"{name}-{mode}", marks=marks)


@pytest.mark.parametrize(("name", "mode"), list(_params()))
def test_trains_as_on_cpu(name, mode):
    report = zoo.run(name, mode)
    assert not report.problems, "\n".join([f"{name} {mode} ({report.attn_implementation}):", *report.problems[:20]])
