"""Every float32 exp, log, log1p, expm1, tanh and logistic that tpurec hands XLA asks for full accuracy.

XLA's TPU backend approximates these functions in float32 unless an op carries StableHLO's
``result_accuracy`` (measured on a TPU v5e: up to about 4,000 units in the last place for log and
log1p, 1,300 for tanh; docs/lowerings.md). XLA:CPU ignores the request, so what can be checked here
is that the request is in every program: the ops below run through the tpu device (forward and
backward), the StableHLO of the programs they build is dumped by JAX, and every such op in it either
carries ``result_accuracy`` or is dead (JAX's own lowering leaves an unused copy without it).
"""

from __future__ import annotations

import re
from pathlib import Path

import jax
import pytest
import torch
import torch.nn.functional as F

import tpurec
from tpurec.core import runtime

_TRANSCENDENTAL = re.compile(
    r"(%[\w#]+) = stablehlo\.(exponential|log|log_plus_one|exponential_minus_one|tanh|logistic)\b(.*)"
)

# name -> f(x) with x a float32 tensor of positive and negative values; the sum is backpropagated.
CASES = {
    "exp": torch.exp,
    "exp2": torch.exp2,
    "expm1": torch.expm1,
    "log": lambda x: torch.log(x.abs() + 0.5),
    "log2": lambda x: torch.log2(x.abs() + 0.5),
    "log10": lambda x: torch.log10(x.abs() + 0.5),
    "log1p": lambda x: torch.log1p(x.abs()),
    "tanh": torch.tanh,
    "sigmoid": torch.sigmoid,
    "logit": lambda x: torch.logit(torch.sigmoid(x)),
    "softplus": F.softplus,
    "silu": F.silu,
    "mish": F.mish,
    "elu": F.elu,
    "celu": F.celu,
    "selu": F.selu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "logsigmoid": F.logsigmoid,
    "softmax": lambda x: torch.softmax(x, -1),
    "log_softmax": lambda x: torch.log_softmax(x, -1),
    "logsumexp": lambda x: torch.logsumexp(x, -1),
    "bce_with_logits": lambda x: F.binary_cross_entropy_with_logits(x, (x > 0).float()),
    "bce": lambda x: F.binary_cross_entropy(torch.sigmoid(x), (x > 0).float()),
    "cross_entropy": lambda x: F.cross_entropy(x, torch.zeros(x.shape[0], dtype=torch.long, device=x.device)),
    "lstm_cell": lambda x: torch.nn.LSTMCell(x.shape[1], 4).to(x.device)(x)[0],
    "gru_cell": lambda x: torch.nn.GRUCell(x.shape[1], 4).to(x.device)(x),
}


def _unrequested(text: str) -> list[str]:
    """The live float32 transcendental ops of a StableHLO module that do not ask for accuracy."""
    found = []
    for function in text.split("func.func")[1:]:  # SSA names are per function
        for match in _TRANSCENDENTAL.finditer(function):
            name, op, rest = match.groups()
            if "result_accuracy" in rest or ("xf32>" not in rest and "tensor<f32>" not in rest):
                continue
            if len(re.findall(re.escape(name) + r"\b", function)) > 1:  # used, not only defined
                found.append(f"{op} {rest.strip()[:80]}")
    return found


@pytest.mark.parametrize("mode", ["eager", "fused"])
@pytest.mark.parametrize("name", list(CASES))
def test_float32_transcendentals_ask_xla_for_full_accuracy(name: str, mode: str, tmp_path: Path) -> None:
    torch.manual_seed(0)
    x = (torch.randn(3, 29) * 3).to("tpu").requires_grad_()
    runtime.release_programs()  # so every program of the case is lowered (and dumped) here, none found cached
    previous = jax.config.read("jax_dump_ir_to")
    jax.config.update("jax_dump_ir_to", str(tmp_path))
    try:
        with tpurec.mode(mode):
            y = CASES[name](x)
            y.sum().backward()
            assert x.grad is not None
            x.grad.cpu(), y.detach().cpu()  # both used: XLA's programs keep forward and backward
    finally:
        jax.config.update("jax_dump_ir_to", previous)
    modules = list(tmp_path.glob("*.mlir"))
    texts = [m.read_text() for m in modules]
    assert any(_TRANSCENDENTAL.search(t) for t in texts), f"{name}: no transcendental op reached XLA"
    unrequested = [f"{m.name}: {op}" for m, t in zip(modules, texts) for op in _unrequested(t)]
    assert not unrequested, f"{name} ({mode}): float32 ops without result_accuracy:\n" + "\n".join(unrequested)
