"""The model zoo (tests/models/zoo.py): every family x mode trains on tpu exactly as on CPU.

``make test`` runs the ``DEFAULT`` slice; ``make zoo`` runs every pair (``-m zoo``). A pair that
fails today is listed in ``KNOWN`` with its cause and runs as a strict xfail: when a fix lands,
the pair XPASSes, the run fails, and its line must go. docs/zoo.md has the table.
"""

import pytest

import zoo

# The pairs `make test` runs (a few seconds each on 2 cores).
DEFAULT = {("llama", "eager"), ("llama", "fused"), ("bert", "eager"), ("resnet", "compiled")}

TIED = "tied weights untied by .to('tpu'): tpu has more named_parameters than CPU"
COMPILED_LM = "compiled decoder LM: factory tensors inside compiled code / KV cache torch.tensor([])"
# (family, mode) -> the exact cause of today's failure.
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
