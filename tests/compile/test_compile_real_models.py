"""What real model code does inside ``torch.compile(backend="tpu")``, checked against PyTorch CPU.

Each function runs compiled on tpu tensors and uncompiled on CPU copies of the same inputs.
Values are compared exactly where the computation is exact (indexing, factories, integer
results) and with rtol 1e-6 where float arithmetic is involved.
"""

import copy

import pytest
import torch
import torch.nn.functional as F

import tpurec  # noqa: F401


def _both(fn, *inputs, backend="tpu"):
    """``fn`` compiled on tpu copies of ``inputs`` (moved back) and eager on the CPU originals."""
    compiled = torch.compile(fn, backend=backend)(*(x.to("tpu") for x in inputs))
    return compiled, fn(*inputs)


def _cpu(out):
    return [o.cpu() for o in out] if isinstance(out, (list, tuple)) else out.cpu()


# --- factory tensors created inside the compiled code ------------------------


def _constant_list(x):
    return x + torch.tensor([1.0, 2.0, 3.0], device=x.device)


def _constant_times_two(x):
    # Ops on a constant alone are what fake mode would constant-fold on other devices.
    return x * (torch.tensor([1.0, 2.0, 3.0], device=x.device) * 2)


def _constant_scalar(x):
    return x * torch.tensor(0.5, device=x.device)


def _cpu_constant_moved(x):
    return x - torch.tensor([3.0, 2.0, 1.0]).to(x.device)


def _growing_cache(x):
    # Hugging Face's KV cache: starts as torch.tensor([]) and grows by torch.cat.
    cache = torch.tensor([], device=x.device)
    for _ in range(2):
        cache = torch.cat([cache, x]) if cache.numel() else x
    return cache


def _empty_then_cat(x):
    return torch.cat([torch.empty(0, device=x.device), x])


def _arange_and_full(x):
    return x * torch.arange(3, device=x.device) + torch.full((3,), 2.0, device=x.device)


@pytest.mark.parametrize(
    "fn",
    [
        _constant_list,
        _constant_times_two,
        _constant_scalar,
        _cpu_constant_moved,
        _growing_cache,
        _empty_then_cat,
        _arange_and_full,
    ],
)
def test_factory_tensors_inside_compiled_code_match_cpu(fn):
    x = torch.randn(3)
    compiled, expected = _both(fn, x)
    assert compiled.device.type == "tpu"
    torch.testing.assert_close(compiled.cpu(), expected, rtol=1e-6, atol=0)


# --- indexing with a Python list ------------------------------------------------


@pytest.mark.parametrize(
    "fn",
    [lambda y: y[..., [-2], :], lambda y: y[[0, 1, 0]], lambda y: y[:, [2, 0]] * 2],
    ids=["ellipsis_list", "leading_list", "list_then_mul"],
)
def test_list_index_inside_compiled_code_matches_cpu(fn):
    y = torch.randn(2, 3, 4)
    compiled, expected = _both(fn, y)
    torch.testing.assert_close(compiled.cpu(), expected, rtol=0, atol=0)


# --- a data-dependent graph break ---------------------------------------------


def _gather_valid(labels, values):
    picked = (labels >= 0).nonzero()  # data-dependent shape: Dynamo breaks the graph here
    return values.gather(0, picked.squeeze(1)) * 2


@pytest.mark.parametrize("backend", ["eager", "tpu"])
def test_data_dependent_graph_break_matches_cpu(backend):
    labels = torch.tensor([1, -1, 2, 0, -1])
    values = torch.randn(5)
    torch._dynamo.utils.counters.clear()
    compiled, expected = _both(_gather_valid, labels, values, backend=backend)
    tpu_breaks = sum(torch._dynamo.utils.counters["graph_break"].values())
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    torch.compile(_gather_valid, backend="eager")(labels, values)
    cpu_breaks = sum(torch._dynamo.utils.counters["graph_break"].values())
    torch.testing.assert_close(compiled.cpu(), expected, rtol=0, atol=0)
    assert tpu_breaks == cpu_breaks, (tpu_breaks, cpu_breaks)


# --- _assert_async (F.one_hot, MoE routers) -------------------------------------


def test_one_hot_compiles_and_matches_cpu():
    classes = torch.tensor([[1, 3], [0, 4], [2, 2]])
    compiled, expected = _both(lambda i: F.one_hot(i, 5).sum(1).float(), classes)
    torch.testing.assert_close(compiled.cpu(), expected, rtol=0, atol=0)


@pytest.mark.parametrize(
    "value, message",
    [(True, "held"), (False, "one_hot: Class values must be non-negative."), (0.0, None), (3, None)],
)
def test_eager_assert_async_checks_like_cpu(value, message):
    def run(device):
        args = (torch.tensor(value, device=device),) + (() if message is None else (message,))
        try:
            torch._assert_async(*args)
        except RuntimeError as e:
            return str(e)
        return None

    assert run("tpu") == run("cpu")


def test_eager_assert_async_of_several_values_fails_like_cpu():
    with pytest.raises(RuntimeError, match="more than one value is ambiguous"):
        torch._assert_async(torch.tensor([True, True]))
    with pytest.raises(RuntimeError, match="more than one value is ambiguous"):
        torch._assert_async(torch.tensor([True, True], device="tpu"))


def test_fused_assert_async_is_no_sync_point():
    # Like CUDA's asynchronous device assert: it does not flush the window to read the value.
    with tpurec.mode("fused"):
        x = torch.ones(3, device="tpu") * 2
        tpurec.reset_stats()
        torch._assert_async((x > 0).all(), "positive")
        assert tpurec.stats()["sync_points"] == {}
        y = (x + 1).cpu()
    assert torch.equal(y, torch.full((3,), 3.0))


class _TopTwoRouter(torch.nn.Module):
    """A dense mixture-of-experts layer routed with F.one_hot, as MoE routers and their
    load-balancing losses write it (one_hot's decomposition asserts its class range)."""

    def __init__(self, width=16, experts=4):
        super().__init__()
        self.gate = torch.nn.Linear(width, experts)
        self.experts = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(experts))

    def forward(self, x):
        probs = self.gate(x).softmax(-1)
        weights, chosen = torch.topk(probs, 2)
        mask = F.one_hot(chosen, len(self.experts)).to(x.dtype)  # [tokens, 2, experts]
        combine = (weights.unsqueeze(-1) * mask).sum(1)
        out = sum(combine[:, e : e + 1] * expert(x) for e, expert in enumerate(self.experts))
        balance = (mask.sum(1).mean(0) * probs.mean(0)).sum() * len(self.experts)
        return out.square().mean() + 0.01 * balance


def test_moe_router_with_one_hot_trains_compiled_like_cpu():
    # Loss and gradients: rtol 1e-5 against CPU, one graph (no break) on both.
    torch.manual_seed(0)
    cpu = _TopTwoRouter()
    tpu = copy.deepcopy(cpu).to("tpu")
    x = torch.randn(8, 16)
    torch._dynamo.utils.counters.clear()
    loss = torch.compile(tpu, backend="tpu")(x.to("tpu"))
    assert sum(torch._dynamo.utils.counters["graph_break"].values()) == 0
    loss.backward()
    expected = cpu(x)
    expected.backward()
    assert loss.item() == pytest.approx(expected.item(), rel=1e-5)
    for (name, p_tpu), p_cpu in zip(tpu.named_parameters(), cpu.parameters()):
        torch.testing.assert_close(p_tpu.grad.cpu(), p_cpu.grad, rtol=1e-5, atol=1e-7, msg=name)


# --- Hugging Face models from tiny configs (no downloads) ---------------------


def _hf_model(name):
    import transformers

    torch.manual_seed(0)
    common = dict(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    if name == "llama":
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(**common))
    if name == "qwen2":
        return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**common))
    if name == "mixtral":
        # Experts as a loop over the routed tokens (F.one_hot, nonzero: graph breaks on CPU too).
        config = transformers.MixtralConfig(
            **common, num_local_experts=4, num_experts_per_tok=2, experts_implementation="eager"
        )
        return transformers.MixtralForCausalLM(config)
    if name == "mixtral_grouped_mm":
        # transformers' default experts: one torch._grouped_mm per projection.
        config = transformers.MixtralConfig(**common, num_local_experts=4, num_experts_per_tok=2)
        return transformers.MixtralForCausalLM(config)
    if name == "bert":
        # An encoder (masked LM; its decoder bias is one parameter shared by two modules).
        config = transformers.BertConfig(
            vocab_size=64,
            hidden_size=32,
            num_hidden_layers=1,
            num_attention_heads=4,
            intermediate_size=64,
            max_position_embeddings=64,
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
            tie_word_embeddings=False,
        )
        return transformers.BertForMaskedLM(config)
    if name == "gpt2":
        # No dropout: the CPU twin's random masks are not the device's.
        config = transformers.GPT2Config(
            vocab_size=64,
            n_embd=32,
            n_layer=1,
            n_head=4,
            n_positions=64,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
        )
        return transformers.GPT2LMHeadModel(config)
    raise KeyError(name)


def _twins(name):
    cpu = _hf_model(name)
    tpu = copy.deepcopy(cpu).to("tpu")
    if name == "gpt2":
        assert tpu.lm_head.weight is tpu.transformer.wte.weight  # .to("tpu") keeps the tie
    return cpu, tpu


def _graph_breaks(run):
    torch._dynamo.utils.counters.clear()
    out = run()
    return out, sum(torch._dynamo.utils.counters["graph_break"].values())


def _ids():
    return torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))


@pytest.mark.slow
@pytest.mark.parametrize("name", ["llama", "qwen2", "gpt2", "mixtral", "mixtral_grouped_mm", "bert"])
def test_hf_lm_compiled_training_step_matches_cpu(name):
    # Loss, every gradient, and the loss after one AdamW step: rtol 1e-4 against CPU.
    cpu, tpu = _twins(name)
    ids = _ids()
    compiled_cpu = torch.compile(cpu, backend="eager")  # Dynamo on CPU: the graph breaks it needs there
    compiled_tpu = torch.compile(tpu, backend="tpu")
    opt_cpu = torch.optim.AdamW(cpu.parameters(), lr=1e-3)
    opt_tpu = torch.optim.AdamW(tpu.parameters(), lr=1e-3)
    losses = []
    for _ in range(2):
        loss_cpu, cpu_breaks = _graph_breaks(lambda: compiled_cpu(input_ids=ids, labels=ids).loss)
        loss_tpu, tpu_breaks = _graph_breaks(lambda: compiled_tpu(input_ids=ids.to("tpu"), labels=ids.to("tpu")).loss)
        assert tpu_breaks == cpu_breaks, (tpu_breaks, cpu_breaks)
        losses.append((loss_tpu.item(), loss_cpu.item()))
        if len(losses) == 2:
            break
        loss_cpu.backward()
        loss_tpu.backward()
        for (n, p_tpu), p_cpu in zip(tpu.named_parameters(), cpu.parameters()):
            if p_cpu.grad is None:  # BERT's pooler: not part of the masked-LM loss
                assert p_tpu.grad is None, n
                continue
            # atol: gradients that are zero in exact arithmetic (a key bias under softmax) are ~1e-12 noise.
            torch.testing.assert_close(p_tpu.grad.cpu(), p_cpu.grad, rtol=1e-4, atol=1e-6, msg=n)
        opt_cpu.step()
        opt_tpu.step()
    for loss_tpu, loss_cpu in losses:
        assert loss_tpu == pytest.approx(loss_cpu, rel=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["llama", "qwen2", "gpt2"])
def test_hf_causal_lm_compiled_greedy_generate_matches_cpu(name):
    # The KV cache starts as torch.tensor([]) on the device and grows by torch.cat inside the graph.
    cpu, tpu = _twins(name)
    cpu.eval()
    tpu.eval()
    ids = _ids()
    mask = torch.ones_like(ids)
    cpu.forward = torch.compile(cpu.forward, backend="eager")
    tpu.forward = torch.compile(tpu.forward, backend="tpu")
    with torch.no_grad():
        expected, cpu_breaks = _graph_breaks(
            lambda: cpu.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0)
        )
        got, tpu_breaks = _graph_breaks(
            lambda: tpu.generate(
                ids.to("tpu"), attention_mask=mask.to("tpu"), max_new_tokens=4, do_sample=False, pad_token_id=0
            )
        )
    assert torch.equal(got.cpu(), expected)
    assert tpu_breaks == cpu_breaks, (tpu_breaks, cpu_breaks)


# --- errors ----------------------------------------------------------------------


@torch.library.custom_op("tpurec_test::cpu_only_gradient", mutates_args=())
def _cpu_only_gradient(g: torch.Tensor) -> torch.Tensor:
    return g * 2


_cpu_only_gradient.register_fake(lambda g: torch.empty_like(g))


class _DoubledWithCpuOnlyGradient(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        return torch.ops.tpurec_test.cpu_only_gradient(grad)  # the backward's line


def test_backward_graph_error_names_the_op_and_the_user_line():
    def step(x):
        return _DoubledWithCpuOnlyGradient.apply(torch.sin(x)).sum()

    loss = torch.compile(step, backend="tpu")(torch.ones(3, device="tpu", requires_grad=True))
    with pytest.raises(RuntimeError) as info:
        loss.backward()
    text = str(info.value)
    assert type(info.value).__name__ == "CompileError"
    assert "tpurec_test::cpu_only_gradient" in text and "the backward's line" in text, text


def test_error_names_the_users_frame_not_torchs():
    import os

    from tpurec.compile.graph import describe_node

    graph = torch.fx.Graph()
    node = graph.call_function(torch.ops.aten.sin.default, (graph.placeholder("x"),))
    functional = os.path.join(os.path.dirname(torch.__file__), "nn", "functional.py")
    user = '  File "/models/moe.py", line 12, in forward\n    out = F.grouped_mm(x, w, offs=offs)\n'
    inside = f'  File "{functional}", line 7139, in grouped_mm\n    return torch._grouped_mm(mat_a, mat_b)\n'
    node.meta["stack_trace"] = user + inside
    text = describe_node(node)
    assert "/models/moe.py" in text and "F.grouped_mm(x, w, offs=offs)" in text and "functional.py" not in text
    node.meta["stack_trace"] = inside  # torch's frame is all there is: still named
    assert "functional.py" in describe_node(node)


# --- grouped_mm (Hugging Face MoE experts on tpu) while tracing -----------------


@pytest.mark.parametrize(
    "shapes",
    [((10, 8), (3, 8, 4), True), ((3, 4, 8), (3, 8, 4), False), ((3, 4, 8), (8, 4), True)],
    ids=["2d_3d", "3d_3d", "3d_2d"],
)
def test_grouped_mm_fake_of_float32_tpu_tensors_matches_cpu(shapes):
    # PyTorch's meta kernel accepts only bf16 (CUDA's rule); tpu computes float32 too.
    from torch._subclasses.fake_tensor import FakeTensorMode

    a_shape, b_shape, grouped = shapes
    a, b = torch.randn(a_shape), torch.randn(b_shape)
    offs = torch.tensor([3, 7, 10], dtype=torch.int32) if grouped else None
    expected = torch._grouped_mm(a, b, offs)
    mode = FakeTensorMode()
    fakes = [None if t is None else mode.from_tensor(t.to("tpu")) for t in (a, b, offs)]
    with mode:
        out = torch._grouped_mm(*fakes)
    assert (out.shape, out.dtype, out.device.type) == (expected.shape, expected.dtype, "tpu")
