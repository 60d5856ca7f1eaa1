"""What surrounds the ops: autocast + GradScaler, the Transformer fast path, torch.load's
map_location, pin_memory, sparse embeddings, compiled-mode errors (issue 13, item 4-5).

Models run through their public API on ``tpu`` in eager, fused and compiled mode
and are compared with the same model on CPU.
"""

from __future__ import annotations

import copy
import io
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F

import tpurec

MODES = ["eager", "fused", "compiled"]


def _in_mode(mode: str, model: torch.nn.Module):
    """``model`` as run in ``mode``, and the context to run it in."""
    if mode == "compiled":
        return torch.compile(model, backend="tpu"), tpurec.mode("eager")
    return model, tpurec.mode(mode)


# --- autocast and GradScaler ------------------------------------------------------------


def test_autocast_casts_like_cuda():
    x = torch.randn(4, 4, device="tpu")
    with torch.autocast("tpu", dtype=torch.bfloat16):
        assert (x @ x).dtype == torch.bfloat16  # lower-precision list
        assert F.linear(x, x).dtype == torch.bfloat16
        assert torch.exp(x.bfloat16()).dtype == torch.float32  # float32 list
        assert torch.softmax(x.bfloat16(), -1).dtype == torch.float32  # float32 unless a dtype is given
        assert torch.softmax(x.bfloat16(), -1, dtype=torch.bfloat16).dtype == torch.bfloat16
        assert torch.cat([x, x.bfloat16()]).dtype == torch.float32  # widest input
        assert (x + 1).dtype == torch.float32  # not listed: unchanged
        assert (x.double() @ x.double()).dtype == torch.float64  # float64 is never cast
    with torch.autocast("tpu", dtype=torch.float16):
        assert (x @ x).dtype == torch.float16
    assert (x @ x).dtype == torch.float32  # outside autocast


def _mlp_losses(device: str, mode: str | None = None, steps: int = 10) -> tuple[list[float], float]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    x, y = torch.randn(64, 8), torch.randn(64, 1)
    model = model.to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = torch.amp.GradScaler(device, init_scale=2.0**10, growth_interval=3)
    x, y = x.to(device), y.to(device)
    run, context = (model, tpurec.mode("eager")) if mode is None else _in_mode(mode, model)
    losses = []
    with context:
        for _ in range(steps):
            optimizer.zero_grad()
            with torch.autocast(device, dtype=torch.bfloat16):
                loss = F.mse_loss(run(x), y)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            losses.append(loss.item())
    return losses, scaler.get_scale()


@pytest.mark.parametrize("mode", MODES)
def test_mlp_trains_under_autocast_bf16_with_grad_scaler(mode):
    expected, expected_scale = _mlp_losses("cpu")
    actual, scale = _mlp_losses("tpu", mode)
    # Same casts as CPU autocast for this model (linear in bf16, mse_loss in float32), and
    # addmm rounds to bf16 once, after the bias, as oneDNN does: losses agree to float32 noise.
    torch.testing.assert_close(torch.tensor(actual), torch.tensor(expected), rtol=1e-4, atol=0)
    assert scale == expected_scale  # the scale grew at the same steps (powers of two: exact)
    assert actual[-1] < actual[0]


def test_grad_scaler_skips_a_step_with_inf_and_backs_off():
    for device in ("cpu", "tpu"):
        weight = torch.ones(3, device=device, requires_grad=True)
        optimizer = torch.optim.SGD([weight], lr=0.1)
        scaler = torch.amp.GradScaler(device, init_scale=8.0)
        scaler.scale((weight * torch.tensor([1.0, float("inf"), 1.0], device=device)).sum()).backward()
        scaler.step(optimizer)
        scaler.update()
        assert weight.detach().cpu().tolist() == [1.0, 1.0, 1.0]  # step skipped
        assert scaler.get_scale() == 4.0


def test_autocast_mode_results_agree_with_each_other():
    eager, _ = _mlp_losses("tpu", "eager", steps=3)
    fused, _ = _mlp_losses("tpu", "fused", steps=3)
    torch.testing.assert_close(torch.tensor(fused), torch.tensor(eager), rtol=1e-4, atol=0)


# --- the Transformer fast path -------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("norm_first", [False, True])
def test_transformer_encoder_eval_under_no_grad(mode, norm_first):
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(
        16, 2, 32, dropout=0.0, batch_first=True, norm_first=norm_first, activation="gelu"
    )
    encoder = torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False).eval()
    inputs = [torch.randn(2, 5, 16) for _ in range(10)]
    padding = torch.tensor([[False] * 5, [False] * 3 + [True] * 2])
    with torch.no_grad():
        expected = [encoder(x, src_key_padding_mask=padding) for x in inputs]
        model, context = _in_mode(mode, copy.deepcopy(encoder).to("tpu"))
        with context:
            actual = [model(x.to("tpu"), src_key_padding_mask=padding.to("tpu")).cpu() for x in inputs]
    for a, e in zip(actual, expected):
        torch.testing.assert_close(a, e, rtol=1e-4, atol=1e-5)


def test_multihead_attention_fast_path_matches_cpu():
    torch.manual_seed(0)
    attention = torch.nn.MultiheadAttention(16, 4, batch_first=True).eval()
    x = torch.randn(2, 5, 16)
    with torch.no_grad():
        expected, expected_weights = attention(x, x, x)
        actual, weights = copy.deepcopy(attention).to("tpu")(*(x.to("tpu"),) * 3)
    torch.testing.assert_close(actual.cpu(), expected, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(weights.cpu(), expected_weights, rtol=1e-4, atol=1e-5)


# --- torch.load(map_location=...) -----------------------------------------------------------


def _tpu_checkpoint() -> bytes:
    buffer = io.BytesIO()
    torch.save({"w": torch.arange(4.0, device="tpu"), "b": torch.ones(2, dtype=torch.int64, device="tpu")}, buffer)
    return buffer.getvalue()


@pytest.mark.parametrize(
    "map_location, device",
    [
        (None, "tpu:0"),
        ("cpu", "cpu"),
        (torch.device("cpu"), "cpu"),
        ({"tpu:0": "cpu"}, "cpu"),
        (lambda storage, location: storage, "cpu"),
        (lambda storage, location: None, "tpu:0"),
        ("tpu:1", "tpu:1"),
    ],
)
def test_torch_load_honours_map_location(map_location, device):
    loaded = torch.load(io.BytesIO(_tpu_checkpoint()), map_location=map_location)
    assert str(loaded["w"].device) == device and str(loaded["b"].device) == device
    assert loaded["w"].cpu().tolist() == [0.0, 1.0, 2.0, 3.0] and loaded["b"].dtype == torch.int64


def test_tpu_checkpoint_loads_with_map_location_cpu_in_a_process_without_tpurec(tmp_path):
    path = tmp_path / "checkpoint.pt"
    path.write_bytes(_tpu_checkpoint())
    code = textwrap.dedent(
        f"""
        import sys, torch
        loaded = torch.load({str(path)!r}, map_location="cpu")  # weights_only=True, the default
        assert "tpurec" not in sys.modules, "tpurec was imported"
        print(loaded["w"].device, loaded["w"].tolist())
        """
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "cpu [0.0, 1.0, 2.0, 3.0]"


# --- pin_memory, sparse embeddings ---------------------------------------------------------------


def test_pin_memory_of_a_cpu_tensor_works_for_tpu_transfers():
    host = torch.arange(6.0).reshape(2, 3).t()
    pinned = host.pin_memory()
    assert pinned.device.type == "cpu" and torch.equal(pinned, host) and pinned.is_pinned()
    assert torch.equal(pinned.to("tpu", non_blocking=True).cpu(), host)
    loader = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(torch.arange(4.0)), batch_size=2, pin_memory=True
    )
    assert [b[0].tolist() for b in loader] == [[0.0, 1.0], [2.0, 3.0]]


def test_pin_memory_of_a_tpu_tensor_is_a_clear_error():
    x = torch.ones(2, device="tpu")
    assert not x.is_pinned()
    with pytest.raises(RuntimeError, match="only CPU tensors can be pinned"):
        x.pin_memory()


def test_sparse_embedding_is_a_clear_error_and_dense_works():
    embedding = torch.nn.Embedding(10, 3, sparse=True).to("tpu")
    ids = torch.tensor([1, 2], device="tpu")
    with pytest.raises(ValueError, match="sparse=True.*not supported on the tpu device.*sparse=False"):
        embedding(ids)
    with torch.no_grad():  # no gradient, no sparse gradient: fine
        assert embedding(ids).shape == (2, 3)
    embedding.sparse = False
    embedding(ids).sum().backward()
    assert embedding.weight.grad.cpu()[1].tolist() == [1.0, 1.0, 1.0]


# --- compiled-mode errors ------------------------------------------------------------------


@torch.library.custom_op("tpurec_test::cpu_only_triple", mutates_args=())
def _cpu_only_triple(x: torch.Tensor) -> torch.Tensor:
    return x * 3


_cpu_only_triple.register_fake(lambda x: torch.empty_like(x))


def test_compiled_error_names_the_op_and_the_user_line():
    def uses_cpu_only_op(x):
        y = x * 2
        return torch.ops.tpurec_test.cpu_only_triple(y)  # the user's line

    with pytest.raises(RuntimeError) as info:
        torch.compile(uses_cpu_only_op, backend="tpu")(torch.ones(3, device="tpu"))
    assert type(info.value).__name__ == "CompileError"  # not Dynamo's BackendCompilerFailed wrapper
    text = str(info.value)
    assert "tpurec_test::cpu_only_triple" in text and "the user's line" in text and "test_around_ops.py" in text
