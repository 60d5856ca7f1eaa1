"""``torch.optim`` with ``fused=True`` on tpu (tpurec/dense/optimizers.py) against PyTorch CPU's fused kernels.

PyTorch offers its fused optimizers to PrivateUse1 devices: one ``_fused_adam_`` (``adamw``,
``sgd``, ``adagrad``) op updates every parameter. Each case trains the same model on CPU and on
tpu with the same optimizer settings and compares parameters and optimizer state after every
step at float32 rounding (rtol 1e-5, atol 1e-6).
"""

import copy

import pytest
import torch

import tpurec

CASES = {
    "adam": (torch.optim.Adam, {"lr": 0.05}),
    "adam_amsgrad_maximize_decay": (
        torch.optim.Adam,
        {"lr": 0.05, "amsgrad": True, "maximize": True, "weight_decay": 0.01},
    ),
    "adamw": (torch.optim.AdamW, {"lr": 0.05, "weight_decay": 0.1, "betas": (0.8, 0.99)}),
    "sgd": (torch.optim.SGD, {"lr": 0.05}),
    "sgd_nesterov_decay": (torch.optim.SGD, {"lr": 0.05, "momentum": 0.9, "nesterov": True, "weight_decay": 0.01}),
    "sgd_dampening_maximize": (torch.optim.SGD, {"lr": 0.05, "momentum": 0.5, "dampening": 0.3, "maximize": True}),
    "adagrad": (torch.optim.Adagrad, {"lr": 0.05}),
    "adagrad_decay_maximize": (
        torch.optim.Adagrad,
        {"lr": 0.05, "lr_decay": 0.05, "weight_decay": 0.1, "maximize": True},
    ),
}


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 9), torch.nn.Tanh(), torch.nn.Linear(9, 2))


def _batch(step: int) -> torch.Tensor:
    return torch.randn(7, 6, generator=torch.Generator().manual_seed(step))


def _step(model, optimizer, x) -> float:
    optimizer.zero_grad()
    loss = model(x).square().mean()
    loss.backward()
    optimizer.step()
    return loss.item()


def _assert_same_state(cpu_model, cpu_optimizer, tpu_model, tpu_optimizer, step) -> None:
    for (name, a), b in zip(cpu_model.named_parameters(), tpu_model.parameters()):
        torch.testing.assert_close(b.detach().cpu(), a.detach(), rtol=1e-5, atol=1e-6, msg=f"{name}, step {step}")
        state_a, state_b = cpu_optimizer.state[a], tpu_optimizer.state[b]
        assert state_a.keys() == state_b.keys()
        for key in state_a:
            if isinstance(state_a[key], torch.Tensor):
                assert state_b[key].device.type == ("tpu" if state_a[key].device.type == "cpu" else "cpu")
                torch.testing.assert_close(
                    state_b[key].cpu(), state_a[key], rtol=1e-5, atol=1e-6, msg=f"{name} {key}, step {step}"
                )


@pytest.mark.parametrize("mode", ["eager", "fused"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_a_fused_optimizer_trains_as_pytorch_cpus_fused_kernel(case, mode):
    make, settings = CASES[case]
    cpu_model = _model()
    tpu_model = copy.deepcopy(cpu_model).to("tpu")
    cpu_optimizer = make(cpu_model.parameters(), fused=True, **settings)
    tpu_optimizer = make(tpu_model.parameters(), fused=True, **settings)
    with tpurec.mode(mode):
        for step in range(5):
            x = _batch(step)
            cpu_loss = _step(cpu_model, cpu_optimizer, x)
            tpu_loss = _step(tpu_model, tpu_optimizer, x.to("tpu"))
            assert tpu_loss == pytest.approx(cpu_loss, rel=1e-5, abs=1e-6), step
            _assert_same_state(cpu_model, cpu_optimizer, tpu_model, tpu_optimizer, step)


@pytest.mark.parametrize("make", [torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD, torch.optim.Adagrad])
def test_a_tensor_learning_rate_and_a_scheduler_change_no_program(make):
    cpu_model = _model()
    tpu_model = copy.deepcopy(cpu_model).to("tpu")
    cpu_optimizer = make(cpu_model.parameters(), lr=torch.tensor(0.05), fused=True)
    tpu_optimizer = make(tpu_model.parameters(), lr=torch.tensor(0.05), fused=True)
    schedulers = [torch.optim.lr_scheduler.ExponentialLR(o, gamma=0.8) for o in (cpu_optimizer, tpu_optimizer)]
    with tpurec.mode("fused"):
        for step in range(6):
            if step == 3:
                compilations = tpurec.stats()["compilations"]
            x = _batch(step)
            _step(cpu_model, cpu_optimizer, x)
            _step(tpu_model, tpu_optimizer, x.to("tpu"))
            for scheduler in schedulers:
                scheduler.step()
            _assert_same_state(cpu_model, cpu_optimizer, tpu_model, tpu_optimizer, step)
    assert tpurec.stats()["compilations"] == compilations  # the rate is an input, not part of the program


@pytest.mark.parametrize("make", [torch.optim.Adam, torch.optim.SGD, torch.optim.Adagrad])
def test_grad_scaler_unscales_in_the_kernel_and_skips_a_step_with_inf(make):
    for device in ("cpu", "tpu"):
        weight = torch.ones(3, device=device, requires_grad=True)
        optimizer = make([weight], lr=0.1, fused=True)
        scaler = torch.amp.GradScaler(device, init_scale=8.0)
        scaler.scale((weight * torch.tensor([1.0, 2.0, 3.0], device=device)).sum()).backward()
        scaler.step(optimizer)  # the fused kernel divides the gradients by the scale, in place
        scaler.update()
        assert weight.grad.cpu().tolist() == [1.0, 2.0, 3.0], device
        stepped = weight.detach().cpu().clone()
        assert (stepped < 1).all(), device
        optimizer.zero_grad()
        scaler.scale((weight * torch.tensor([1.0, float("inf"), 1.0], device=device)).sum()).backward()
        scaler.step(optimizer)
        scaler.update()
        assert torch.equal(weight.detach().cpu(), stepped), device  # skipped: nothing written
        assert scaler.get_scale() == 4.0


def test_bfloat16_parameters_are_updated_in_float32_and_rounded_once():
    cpu_model = _model().to(torch.bfloat16)
    tpu_model = copy.deepcopy(cpu_model).to("tpu")
    cpu_optimizer = torch.optim.Adam(cpu_model.parameters(), lr=0.05, fused=True)
    tpu_optimizer = torch.optim.Adam(tpu_model.parameters(), lr=0.05, fused=True)
    for step in range(3):
        x = _batch(step).to(torch.bfloat16)
        _step(cpu_model, cpu_optimizer, x)
        _step(tpu_model, tpu_optimizer, x.to("tpu"))
    for a, b in zip(cpu_model.parameters(), tpu_model.parameters()):
        assert b.dtype == torch.bfloat16
        # One bfloat16 rounding of float32 math that agrees to float32 noise: at most one ulp apart.
        torch.testing.assert_close(b.detach().cpu(), a.detach(), rtol=2**-7, atol=1e-6)


def test_a_fused_step_dispatches_one_update_op():
    model = _model().to("tpu")
    optimizer = torch.optim.Adam(model.parameters(), lr=0.05, fused=True)
    x = _batch(0).to("tpu")
    with tpurec.mode("fused"):
        _step(model, optimizer, x)
        tpurec.reset_stats()
        _step(model, optimizer, x)
    ops = tpurec.stats()["ops_by_name"]
    assert ops["_fused_adam_.default"] == 1, ops
    # The step counts (one _foreach_add_) are PyTorch's; no other foreach op runs.
    assert {name for name in ops if name.startswith("_foreach")} == {"_foreach_add_.Scalar"}, ops


def test_a_compiled_fused_optimizer_step_trains_as_pytorch_cpu():
    cpu_model = _model()
    tpu_model = copy.deepcopy(cpu_model).to("tpu")
    cpu_optimizer = torch.optim.Adam(cpu_model.parameters(), lr=0.05, fused=True)
    tpu_optimizer = torch.optim.Adam(tpu_model.parameters(), lr=0.05, fused=True)
    update = torch.compile(tpu_optimizer.step, backend="tpu")  # the graph holds the functional _fused_adam
    with tpurec.mode("fused"):
        for step in range(3):
            x = _batch(step)
            _step(cpu_model, cpu_optimizer, x)
            tpu_optimizer.zero_grad()
            tpu_model(x.to("tpu")).square().mean().backward()
            update()
            _assert_same_state(cpu_model, cpu_optimizer, tpu_model, tpu_optimizer, step)
