"""nn.Module on tpu: .to/.cpu, state_dict round-trips, autograd."""

import pytest
import torch

import tpurec  # noqa: F401


def mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))


def test_cpu_state_dict_into_tpu_model_and_back():
    cpu_model = mlp()
    tpu_model = mlp().to("tpu")
    with torch.no_grad():
        for p in tpu_model.parameters():
            p.zero_()
    tpu_model.load_state_dict(cpu_model.state_dict())
    for k, v in tpu_model.state_dict().items():
        assert v.device.type == "tpu"
        assert torch.equal(v.cpu(), cpu_model.state_dict()[k])
    back = mlp()
    with torch.no_grad():
        for p in back.parameters():
            p.zero_()
    back.load_state_dict(tpu_model.state_dict())
    for k, v in back.state_dict().items():
        assert v.device.type == "cpu" and torch.equal(v, cpu_model.state_dict()[k])
    assert all(p.device.type == "cpu" for p in tpu_model.cpu().parameters())


def test_autograd_matches_cpu():
    model = mlp()
    x = torch.randn(4, 8)
    ref = model(x).square().mean()
    ref.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    dev = mlp().to("tpu")
    out = dev(x.to("tpu")).square().mean()
    out.backward()
    torch.testing.assert_close(out.cpu(), ref.detach(), rtol=1e-6, atol=1e-7)
    for p, g in zip(dev.parameters(), grads):
        assert p.grad.device.type == "tpu"
        torch.testing.assert_close(p.grad.cpu(), g, rtol=1e-5, atol=1e-6)


def test_module_to_dtype_on_device_keeps_values():
    model = mlp().to("tpu")
    before = [p.cpu() for p in model.parameters()]
    model.to(torch.float64)
    for p, b in zip(model.parameters(), before):
        assert p.dtype == torch.float64 and p.device.type == "tpu"
        torch.testing.assert_close(p.cpu(), b.double())


def test_torch_save_and_load_of_a_tpu_state_dict(tmp_path):
    model = mlp().to("tpu")
    path = tmp_path / "checkpoint.pt"
    torch.save({"model": model.state_dict(), "step": 3}, path)
    loaded = torch.load(path)  # weights_only=True, the default
    assert loaded["step"] == 3
    for key, value in model.state_dict().items():
        assert loaded["model"][key].device == torch.device("tpu", 0)
        assert torch.equal(loaded["model"][key].cpu(), value.cpu())
    fresh = mlp()
    fresh.load_state_dict({k: v.cpu() for k, v in loaded["model"].items()})


@pytest.mark.parametrize("map_location", [None, "cpu"])
def test_a_saved_tpu_parameter_loads_as_a_parameter(tmp_path, map_location):
    # As on CUDA: torch.export's saved programs and pickled modules need their Parameters back.
    weight = torch.nn.Parameter(torch.randn(2, 3, device="tpu"))
    frozen = torch.nn.Parameter(torch.randn(3, device="tpu"), requires_grad=False)
    path = tmp_path / "params.pt"
    torch.save({"weight": weight, "frozen": frozen, "plain": weight.detach()}, path)
    loaded = torch.load(path, map_location=map_location)  # weights_only=True
    device = torch.device("tpu", 0) if map_location is None else torch.device("cpu")
    for name, source in (("weight", weight), ("frozen", frozen)):
        assert isinstance(loaded[name], torch.nn.Parameter) and loaded[name].device == device
        assert loaded[name].requires_grad == source.requires_grad
        assert torch.equal(loaded[name].cpu(), source.cpu())
    assert not isinstance(loaded["plain"], torch.nn.Parameter)


def test_a_pickled_tpu_module_keeps_its_parameters(tmp_path):
    model = mlp().to("tpu")
    path = tmp_path / "model.pt"
    torch.save(model, path)
    loaded = torch.load(path, weights_only=False)
    assert [n for n, _ in loaded.named_parameters()] == [n for n, _ in model.named_parameters()]
    x = torch.randn(4, 8)
    torch.testing.assert_close(loaded(x.to("tpu")).cpu(), model(x.to("tpu")).cpu(), rtol=0, atol=0)
