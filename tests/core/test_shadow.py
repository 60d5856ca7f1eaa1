"""tpurec.debug.shadow(): every op on tpu checked against PyTorch CPU on the same inputs."""

from __future__ import annotations

import inspect
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import tpurec
from tpurec.core import dispatch, kernels, runtime
from tpurec.dense.registry import LOWERINGS, Lowering, get_lowering

aten = torch.ops.aten


@pytest.fixture
def wrong_lowering():
    """Replaces one table entry by a slightly wrong one (its result times 1 + 1e-3), then restores it."""
    patched = {}

    def patch(op, how=lambda out: out * (1 + 1e-3)):
        right = get_lowering(op)
        patched[op] = right
        LOWERINGS[op] = Lowering(op, lambda *a, **k: how(right.fn(*a, **k)), right.random, right.static_scalars)
        _forget(op)  # programs built from the right entry would hide the wrong one

    yield patch
    for op, right in patched.items():
        LOWERINGS[op] = right
        _forget(op)


def _forget(op) -> None:
    """Drops the cached programs of ``op`` (keyed by the op first), so its next call is traced again."""
    programs = runtime.programs._programs
    for key in [k for k in programs if isinstance(k, tuple) and k and k[0] is op]:
        del programs[key]


def _line_of(text: str, function=None) -> int:
    """The line of ``function`` (default: the caller) that contains ``text``."""
    code = function.__code__ if function is not None else inspect.stack()[1].frame.f_code
    lines, start = inspect.getsourcelines(code)
    return start + next(i for i, line in enumerate(lines) if text in line)


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(8)
        self.mlp = torch.nn.Sequential(
            torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Dropout(0.25), torch.nn.Linear(16, 8)
        )

    def forward(self, x):
        return x + self.mlp(self.norm(x))


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList([Block(), Block()])
        self.head = torch.nn.Linear(8, 3)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _net():
    torch.manual_seed(0)
    model = Net().to("tpu")
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2), torch.randn(4, 8).to("tpu")


def test_a_correct_training_step_reports_nothing():
    model, optimizer, x = _net()
    with tpurec.debug.shadow() as report:
        for _ in range(2):
            loss = torch.nn.functional.cross_entropy(model(x), torch.tensor([0, 1, 2, 1], device="tpu"))
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        assert loss.item() > 0
    checked = report.checked
    # forward, backward and the foreach optimizer were all compared
    assert checked["aten.addmm.default"] >= 10 and checked["aten.gelu_backward.default"] == 4
    assert any(name.startswith("aten._foreach_") for name in checked)
    assert report.random["aten.native_dropout.default"] == 4  # values not comparable: counted apart
    assert report.unchecked == {}


def test_off_means_no_hook():
    assert dispatch._shadow is None
    before = dict(torch.nn.modules.module._global_forward_pre_hooks)
    mode = tpurec.get_mode()
    with tpurec.debug.shadow():
        assert dispatch._shadow is not None and tpurec.get_mode() == "debug"
    assert dispatch._shadow is None
    assert dict(torch.nn.modules.module._global_forward_pre_hooks) == before
    assert tpurec.get_mode() == mode


def test_a_wrong_forward_lowering_names_op_module_and_line(wrong_lowering):
    model, _, x = _net()
    wrong_lowering(aten.gelu.default)
    with pytest.raises(tpurec.debug.ShadowMismatch) as caught:
        with tpurec.debug.shadow():
            model(x)  # the line the error names
    error = caught.value
    assert error.op == "aten.gelu.default"
    assert error.module == "blocks.0.mlp.1 (GELU)"
    # the innermost line outside torch and tpurec, then its callers: the test's own line among them
    assert error.where.startswith(f'File "{__file__}", line {_line_of("x + self.mlp(self.norm(x))", Block.forward)}')
    message = str(error)
    assert f'called from: File "{__file__}", line {_line_of("model(x)  # the line")}' in message
    assert "aten.gelu.default on tpu differs from PyTorch CPU" in message
    assert "module: blocks.0.mlp.1 (GELU)" in message
    assert "output [4, 16] float32: max abs diff" in message and "elements beyond rtol=0.0001, atol=1e-05" in message
    assert "against float64 tpu errs by" in message
    assert dispatch._shadow is None


def test_a_wrong_backward_lowering_is_raised_after_backward(wrong_lowering):
    model, _, x = _net()
    wrong_lowering(aten.gelu_backward.default)
    with pytest.raises(tpurec.debug.ShadowMismatch) as caught:
        with tpurec.debug.shadow():
            loss = model(x).sum()
            loss.backward()  # the backward call the error names
            torch.zeros(1, device="tpu")  # the next op outside the engine raises it
    error = caught.value
    assert error.op == "aten.gelu_backward.default"
    # the last block's GELU is the first whose gradient is computed
    assert error.module == "backward of blocks.1.mlp.1 (GELU) (autograd node GeluBackward0)"
    assert f"line {_line_of('loss.backward()  # the backward')}" in error.where
    assert "backward called at:" in str(error)


def test_a_wrong_backward_lowering_is_raised_at_the_end_of_the_block(wrong_lowering):
    model, _, x = _net()
    wrong_lowering(aten.gelu_backward.default)
    with pytest.raises(tpurec.debug.ShadowMismatch, match="gelu_backward"):
        with tpurec.debug.shadow():
            model(x).sum().backward()


def test_a_wrong_optimizer_op_names_the_parameter(wrong_lowering):
    model, optimizer, x = _net()
    wrong_lowering(aten._foreach_addcdiv.ScalarList, how=lambda outs: [o * (1 + 1e-3) for o in outs])
    with pytest.raises(tpurec.debug.ShadowMismatch) as caught:
        with tpurec.debug.shadow():
            model(x).sum().backward()  # the model ran in the block: its parameters have names
            optimizer.step()
    message = str(caught.value)
    assert caught.value.op == "aten._foreach_addcdiv_.ScalarList"
    assert "argument 'self' (tensor 0 of 14), written in place = parameter blocks.0.norm.weight" in message
    assert "module: none (outside any nn.Module forward)" in message


def test_in_place_through_a_view_is_compared_on_the_whole_storage(wrong_lowering):
    base = torch.arange(12.0).reshape(3, 4).to("tpu")
    with tpurec.debug.shadow() as report:
        row = base[1]
        row.mul_(2)
        base.t()[2].add_(1)  # a strided view
        torch.testing.assert_close(base.cpu(), torch.tensor([[0, 1, 3, 3], [8, 10, 13, 14], [8, 9, 11, 11.0]]))
        view = base[1:]
        view.t_().squeeze_()  # in-place view ops: judged on the view as it was before them
        assert view.shape == (4, 2)
    assert report.checked["aten.mul_.Tensor"] == 1 and report.checked["aten.add_.Tensor"] == 1
    assert report.checked["aten.t_.default"] == 1
    wrong_lowering(aten.add.Tensor)
    with pytest.raises(tpurec.debug.ShadowMismatch) as caught:
        with tpurec.debug.shadow():
            base.t()[2].add_(1)
    assert "argument 'self', written in place (storage [12] float32)" in str(caught.value)


def test_integers_must_be_equal_and_nans_in_the_same_places(wrong_lowering):
    wrong_lowering(aten.add.Tensor, how=lambda out: out + (out == 5))
    with pytest.raises(tpurec.debug.ShadowMismatch, match=r"1 of 4 elements differ .* first at \[2\]: tpu 6, CPU 5"):
        with tpurec.debug.shadow():
            torch.tensor([1, 3, 4, 7], device="tpu") + 1
    wrong_lowering(aten.sqrt.default, how=lambda out: out.at[0].set(float("nan")))
    with pytest.raises(
        tpurec.debug.ShadowMismatch, match=r"NaN in different places: 1 elements, first at \[0\] \(NaN on tpu only\)"
    ):
        with tpurec.debug.shadow():
            torch.tensor([4.0, -1.0, 9.0], device="tpu").sqrt()


def test_tolerance_is_the_stated_one(wrong_lowering):
    wrong_lowering(aten.mul.Tensor, how=lambda out: out * (1 + 1e-3))
    x = torch.tensor([1.0, 2.0], device="tpu")
    with tpurec.debug.shadow(rtol=1e-2, atol=0.0):
        x * x  # a relative error of 1e-3 is inside rtol=1e-2
    with pytest.raises(tpurec.debug.ShadowMismatch, match="beyond rtol=0.0001, atol=0"):
        with tpurec.debug.shadow(rtol=1e-4, atol=0.0):
            x * x


def _run(script: str, **env) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **env},
        cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
    )


STEP = """
    import torch, tpurec
    from tpurec.dense.registry import LOWERINGS, Lowering, get_lowering
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1)).to("tpu")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(3, 4).to("tpu")
    for step in range(2):
        loss = model(x).square().mean()
        loss.backward()
        optimizer.step()
        print("step", step, "ok", flush=True)
        right = get_lowering(torch.ops.aten.mul.Tensor)  # now one product goes wrong
        LOWERINGS[right.op] = Lowering(right.op, lambda *a: right.fn(*a) * 1.001)
        tpurec.core.runtime.programs.clear()
"""


@pytest.mark.mode_set_by_test
def test_environment_switch_checks_each_step():
    result = _run(STEP, TPUREC_MODE="debug", TPUREC_SHADOW="cpu")
    assert result.returncode == 1 and result.stdout == "step 0 ok\n", (result.stdout, result.stderr[-3000:])
    assert "tpurec.debug.ShadowMismatch: tpurec.debug.shadow: aten.mul.Tensor on tpu differs" in result.stderr
    # square()'s gradient is the first product, taken outside any module
    assert "module: backward (autograd node PowBackward0)" in result.stderr
    assert 'backward called at: File "<string>", line 10' in result.stderr  # loss.backward()


@pytest.mark.mode_set_by_test
def test_environment_switch_needs_debug_mode():
    result = _run("import tpurec", TPUREC_MODE="eager", TPUREC_SHADOW="cpu")
    assert (
        result.returncode == 1
        and "TPUREC_SHADOW=cpu compares each op as it runs, which needs TPUREC_MODE=debug" in result.stderr
    )


def test_outputs_the_meta_kernel_shapes_differently_from_cpu_are_not_divergences():
    # _embedding_bag's max_indices (unused in mode "mean") are empty by the meta kernel, as tpu
    # makes them, and one per bag on CPU.
    weight = torch.randn(5, 3).to("tpu").requires_grad_()
    with tpurec.debug.shadow() as report:
        out = torch.nn.functional.embedding_bag(
            torch.tensor([0, 4, 1, 1], device="tpu"), weight, torch.tensor([0, 2], device="tpu"), mode="mean"
        )
        out.sum().backward()
    assert report.meta_conformant["aten._embedding_bag.default"] == 1
    assert report.checked["aten._embedding_bag.default"] == 1


def test_a_bfloat16_layer_norm_step_reports_nothing():
    # native_layer_norm's statistics of a bfloat16 input are float32 by the meta kernel (tpu, CUDA)
    # and bfloat16 on CPU: a backend difference, judged at CPU's precision, not a divergence.
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.SiLU(), torch.nn.LayerNorm(16), torch.nn.Linear(16, 1))
    model = model.to(torch.bfloat16).to("tpu")
    with tpurec.debug.shadow() as report:
        model(torch.randn(4, 8).to(torch.bfloat16).to("tpu")).float().square().mean().backward()
    assert report.checked["aten.native_layer_norm.default"] == 1
    assert report.checked["aten.native_layer_norm_backward.default"] == 1
    assert report.meta_conformant["aten.native_layer_norm.default"] == 2  # mean and rstd
    assert report.unchecked == {}


def test_a_tiny_llama_training_step_reports_nothing(wrong_lowering):
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    model = transformers.LlamaForCausalLM(config).to("tpu")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids = torch.randint(0, 64, (2, 7)).to("tpu")
    with tpurec.debug.shadow() as report:
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
    assert sum(report.checked.values()) > 200 and report.unchecked == {}
    # and the same model with one wrong product names the projection it ran in
    wrong_lowering(aten.mm.default)
    with pytest.raises(tpurec.debug.ShadowMismatch) as caught:
        with tpurec.debug.shadow():
            model(input_ids=ids, labels=ids)  # the wrong product runs here
    assert caught.value.module == "model.layers.0.self_attn.q_proj (Linear)"
    assert "modeling_llama.py" in caught.value.where and "self.q_proj(hidden_states)" in caught.value.where
    assert f'called from: File "{__file__}", line {_line_of("# the wrong product runs here")}' in str(caught.value)


def test_compiled_modules_run_under_the_shadow():
    # Dynamo traces global module hooks: the shadow's skip compiled regions (one program, not shadowed),
    # and the eager ops around them are still compared.
    torch.manual_seed(0)
    compiled = torch.compile(torch.nn.Linear(4, 2).to("tpu"), backend="tpu")
    x = torch.randn(3, 4).to("tpu")
    with tpurec.debug.shadow() as report:
        compiled(x).sum().backward()
    assert report.checked["aten.sum.default"] == 1
    assert compiled.weight.grad is not None


def test_float_to_int_casts_of_nan_inf_and_out_of_range_values_are_not_divergences(monkeypatch):
    # C++ leaves them undefined: x86 CPU gives INT_MIN, tpu (as CUDA) saturates and maps NaN to 0.
    x = torch.tensor([float("nan"), float("inf"), -float("inf"), 1e20, -1e20, 3.7, -2.5, 2.0**31], device="tpu")
    with tpurec.debug.shadow() as report:
        for dtype in (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8):
            x.to(dtype)
        torch.zeros(2, 8, dtype=torch.int32, device="tpu")[1].copy_(x)
    assert report.undefined_casts == {"aten._to_copy.default": 5, "aten.copy_.default": 1}
    # The defined elements are still compared: a cast that gets 3.7 wrong is a divergence.
    right = kernels._cast_program

    def wrong(key, dtype):
        program = right(key, dtype)
        return dispatch._compile(
            ("wrong cast", key, dtype), lambda storage: [v + (v == 3) for v in program.raw(storage)]
        )

    monkeypatch.setattr(kernels, "_cast_program", wrong)
    with pytest.raises(tpurec.debug.ShadowMismatch, match=r"1 of 8 elements differ .* first at \[5\]: tpu 4, CPU 3"):
        with tpurec.debug.shadow():
            x.to(torch.int32)


def test_ctc_log_alpha_is_a_workspace_and_the_loss_and_gradient_are_compared():
    torch.manual_seed(0)
    logits = torch.randn(12, 2, 6).to("tpu").requires_grad_()
    targets = torch.tensor([1, 2, 2, 3, 4]).to("tpu")  # concatenated: lengths 3 and 2
    with tpurec.debug.shadow() as report:
        loss = torch.nn.functional.ctc_loss(
            logits.log_softmax(-1), targets, torch.tensor([12, 10]).to("tpu"), torch.tensor([3, 2]).to("tpu")
        )
        loss.backward()
    assert report.workspaces == {"aten._ctc_loss.Tensor": 1}
    assert report.checked["aten._ctc_loss.Tensor"] == 1 and report.checked["aten._ctc_loss_backward.Tensor"] == 1


def test_sort_and_topk_indices_may_order_ties_differently_but_must_pick_cpus_values(wrong_lowering):
    reverse = lambda out: (out[0], out[1][..., ::-1])  # noqa: E731
    wrong_lowering(aten.sort.default, how=reverse)
    wrong_lowering(aten.sort.stable, how=reverse)
    wrong_lowering(aten.topk.default, how=reverse)
    ties = torch.tensor([[5, 5, 5, 5], [7, 7, 7, 7]], device="tpu")
    with tpurec.debug.shadow() as report:
        torch.sort(ties)
        torch.sort(ties, stable=False)
        torch.topk(ties.float(), 3)
    assert report.ties == {"aten.sort.default": 1, "aten.sort.stable": 1, "aten.topk.default": 1}
    with pytest.raises(
        tpurec.debug.ShadowMismatch,
        match=r"aten.sort.default .*\n(.*\n)*.*output 1 \[4\] int64: 4 of 4 elements differ",
    ):
        with tpurec.debug.shadow():
            torch.sort(torch.tensor([3, 1, 2, 0], device="tpu"))
    with pytest.raises(tpurec.debug.ShadowMismatch, match="aten.sort.stable"):
        with tpurec.debug.shadow():
            torch.sort(ties, stable=True)
