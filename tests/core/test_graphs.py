"""Captured steps (``tpurec.graph``): replays train exactly as the step run by Python would.

References: PyTorch CPU running the same step (losses and parameters), and, for random ops,
tpurec's own uncaptured step with the same generator state (bit for bit). Every refusal is
checked for its message and for the state it leaves: the step ran in full.
"""

from __future__ import annotations

import threading

import pytest
import torch

import tpurec
from tpurec.core import rng
from tpurec.core.device import jax_device
from tpurec.core.tensor import free_storage, host_to_jax

STEPS = 7
WARMUP = 2  # plain steps before the capture: the first makes the optimizer's state


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))


def _batches(n: int = STEPS) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(5, 6, generator=g), torch.randn(5, 1, generator=g)) for _ in range(n)]


def _step(model, optimizer, x, y, forward=None):
    optimizer.zero_grad()
    loss = torch.nn.functional.mse_loss((forward or model)(x), y)
    loss.backward()
    optimizer.step()
    return loss


def _graphed_losses(model, optimizer, batches, forward=None, api=tpurec) -> tuple[list[float], tpurec.TpuGraph]:
    """Trains on ``batches``: WARMUP plain fused steps, the capture (by ``api.graph``), then replays."""
    static_x = torch.zeros(batches[0][0].shape, device="tpu")
    static_y = torch.zeros(batches[0][1].shape, device="tpu")
    losses = []
    graph = api.TpuGraph()
    with tpurec.mode("fused"):
        for i, (x, y) in enumerate(batches):
            static_x.copy_(x)
            static_y.copy_(y)
            if i < WARMUP:
                losses.append(_step(model, optimizer, static_x, static_y, forward).item())
            elif i == WARMUP:
                with api.graph(graph):
                    static_loss = _step(model, optimizer, static_x, static_y, forward)
                losses.append(static_loss.item())
            else:
                graph.replay()
                losses.append(static_loss.item())
    return losses, graph


# Per name, the optimizer on tpu (its state on the device) and PyTorch CPU's counterpart, or None
# where CPU has none with the same arithmetic (capturable=True is for accelerators only, and its
# formula rounds differently from the CPU one's: about 2e-6 on these weights, captured or not).
OPTIMIZERS = {
    "sgd_momentum": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9),
    "adagrad_fused": lambda p: torch.optim.Adagrad(p, lr=0.05, fused=True),
    "adam_capturable": lambda p: torch.optim.Adam(p, lr=0.01, capturable=True),
    "adamw_fused": lambda p: torch.optim.AdamW(p, lr=0.01, fused=True),
}
CPU_OPTIMIZERS = {
    "sgd_momentum": OPTIMIZERS["sgd_momentum"],
    "adagrad_fused": OPTIMIZERS["adagrad_fused"],
    "adam_capturable": None,
    "adamw_fused": OPTIMIZERS["adamw_fused"],
}


def _uncaptured_losses(model, optimizer, batches, forward=None) -> list[float]:
    static_x, static_y = (torch.zeros(t.shape, device="tpu") for t in batches[0])
    losses = []
    with tpurec.mode("fused"):
        for x, y in batches:
            static_x.copy_(x)
            static_y.copy_(y)
            losses.append(_step(model, optimizer, static_x, static_y, forward).item())
    return losses


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_replayed_steps_train_as_the_uncaptured_step_and_as_pytorch_cpu(name):
    batches = _batches()
    model = _model().to("tpu")
    losses, graph = _graphed_losses(model, OPTIMIZERS[name](model.parameters()), batches)
    assert graph.captured
    plain = _model().to("tpu")
    assert losses == _uncaptured_losses(plain, OPTIMIZERS[name](plain.parameters()), batches)  # bit for bit
    assert all(torch.equal(a.detach().cpu(), b.detach().cpu()) for a, b in zip(model.parameters(), plain.parameters()))
    if CPU_OPTIMIZERS[name] is None:
        return
    cpu = _model()
    cpu_optimizer = CPU_OPTIMIZERS[name](cpu.parameters())
    expected = [_step(cpu, cpu_optimizer, x, y).item() for x, y in batches]
    # float32 arithmetic in another order (XLA fuses the step): stated tolerance, not bitwise.
    assert losses == pytest.approx(expected, rel=1e-5, abs=1e-6)
    for ours, theirs in zip(model.parameters(), cpu.parameters()):
        torch.testing.assert_close(ours.detach().cpu(), theirs.detach(), rtol=1e-5, atol=1e-6)


def test_torch_tpu_graph_captures_as_torch_cuda_graph_would():
    # Code written for CUDA graphs with the device's name changed: torch.tpu.TpuGraph / torch.tpu.graph.
    batches = _batches()
    model = _model().to("tpu")
    losses, graph = _graphed_losses(model, torch.optim.SGD(model.parameters(), lr=0.05), batches, api=torch.tpu)
    assert isinstance(graph, tpurec.TpuGraph) and graph.captured
    cpu = _model()
    cpu_optimizer = torch.optim.SGD(cpu.parameters(), lr=0.05)
    expected = [_step(cpu, cpu_optimizer, x, y).item() for x, y in batches]
    assert losses == pytest.approx(expected, rel=1e-5, abs=1e-6)


def test_a_compiled_model_replays_as_pytorch_cpu():
    batches = _batches()
    cpu = _model()
    cpu_optimizer = torch.optim.SGD(cpu.parameters(), lr=0.05, momentum=0.9)
    expected = [_step(cpu, cpu_optimizer, x, y).item() for x, y in batches]
    model = _model().to("tpu")
    forward = torch.compile(model, backend="tpu")
    losses, _ = _graphed_losses(model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), batches, forward)
    assert losses == pytest.approx(expected, rel=1e-5, abs=1e-6)


def test_a_replay_is_one_program_and_compiles_nothing():
    batches = _batches()
    model = _model().to("tpu")
    _, graph = _graphed_losses(model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), batches)
    tpurec.synchronize()
    before = tpurec.stats()
    for _ in range(3):
        graph.replay()
    tpurec.synchronize()
    after = tpurec.stats()
    assert after["executions"] - before["executions"] == 3
    assert after["compilations"] == before["compilations"]
    assert after["ops_by_name"] == before["ops_by_name"]  # no op dispatched: no Python of the step ran


@pytest.mark.parametrize("compiled", [False, True], ids=["eager_model", "compiled_model"])
def test_random_ops_draw_as_the_uncaptured_step(compiled):
    def train(graphed: bool):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(6, 32), torch.nn.Dropout(0.5), torch.nn.Linear(32, 1)).to("tpu")
        forward = torch.compile(model, backend="tpu") if compiled else None
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        rng.manual_seed(123)
        if graphed:
            losses, _ = _graphed_losses(model, optimizer, _batches(), forward)
        else:
            static_x, static_y = torch.zeros(5, 6, device="tpu"), torch.zeros(5, 1, device="tpu")
            losses = []
            with tpurec.mode("fused"):
                for x, y in _batches():
                    static_x.copy_(x)
                    static_y.copy_(y)
                    losses.append(_step(model, optimizer, static_x, static_y, forward).item())
        return losses, [p.detach().cpu() for p in model.parameters()], rng.get_state()

    plain, graphed = train(False), train(True)
    assert graphed[0] == plain[0]  # bit for bit: the same random numbers, the same arithmetic
    assert all(torch.equal(a, b) for a, b in zip(graphed[1], plain[1]))
    assert torch.equal(graphed[2], plain[2])  # the generator advanced as far


def _warm(model, optimizer, x, y, steps=WARMUP):
    for _ in range(steps):
        _step(model, optimizer, x, y).item()


def _setup(optimizer=None):
    model = _model().to("tpu")
    optimizer = (optimizer or (lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9)))(model.parameters())
    x, y = (t.to("tpu") for t in _batches(1)[0])
    return model, optimizer, x, y


def _refused(match: str, body, model) -> None:
    """``body`` under a capture is refused with ``match``; the step still ran (the parameters changed)."""
    before = [p.detach().cpu().clone() for p in model.parameters()]
    graph = tpurec.TpuGraph()
    with pytest.raises(RuntimeError, match=match):
        with tpurec.graph(graph):
            body()
    assert not graph.captured
    after = [p.detach().cpu() for p in model.parameters()]
    assert any(not torch.equal(a, b) for a, b in zip(before, after))
    with pytest.raises(RuntimeError, match="no captured step"):
        graph.replay()


def test_a_sync_point_in_the_step_is_refused_after_the_step_ran():
    model, optimizer, x, y = _setup()
    with tpurec.mode("fused"):
        _warm(model, optimizer, x, y)
        _refused("sync point", lambda: _step(model, optimizer, x, y).item(), model)


def test_a_step_without_warm_up_is_refused():
    from tpurec.core import fused

    # No step of these structures ran in this process before (an earlier test in it may have run them).
    fused.clear_programs()
    model, optimizer, x, y = _setup()
    with tpurec.mode("fused"):
        _refused("made its state in it", lambda: _step(model, optimizer, x, y), model)
        # A structure never run (a model of new shapes): nothing says its numbers stay the same.
        model = torch.nn.Linear(6, 3).to("tpu")
        no_state = torch.optim.SGD(model.parameters(), lr=0.05)
        _refused("no step of its structure ran", lambda: _step(model, no_state, x, y.expand(5, 3)), model)


def test_a_python_number_that_changes_between_steps_is_refused():
    model, optimizer, x, y = _setup()
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    with tpurec.mode("fused"):
        for _ in range(WARMUP):
            _step(model, optimizer, x, y).item()
            scheduler.step()
        _refused("Python number", lambda: _step(model, optimizer, x, y), model)


def test_an_optimizer_state_on_the_cpu_is_refused():
    model, optimizer, x, y = _setup(lambda p: torch.optim.Adam(p, lr=0.01))  # capturable=False: steps on the CPU
    with tpurec.mode("fused"):
        _warm(model, optimizer, x, y)
        _refused("optimizer's state", lambda: _step(model, optimizer, x, y), model)


def test_a_copy_from_the_cpu_in_the_step_is_refused():
    model, optimizer, x, y = _setup()
    cpu_x = x.cpu()
    with tpurec.mode("fused"):
        for _ in range(WARMUP):
            _step(model, optimizer, cpu_x.to("tpu"), y).item()
        _refused("copies 1 CPU tensor", lambda: _step(model, optimizer, cpu_x.to("tpu"), y), model)


def _params(model) -> list[torch.Tensor]:
    return [p.detach().cpu().clone() for p in model.parameters()]


def test_replay_refuses_a_learning_rate_changed_since_the_capture_and_runs_nothing():
    model, optimizer, _, graph, _ = _captured()
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    scheduler.step()  # lr 0.05 -> 0.025: the program has 0.05 in it
    before = _params(model)
    with pytest.raises(RuntimeError, match=r"SGD's lr is 0.025 in param group 0, and the step was captured with 0.05"):
        graph.replay()
    assert all(torch.equal(a, b) for a, b in zip(before, _params(model)))
    optimizer.param_groups[0]["lr"] = 0.05
    graph.replay()  # as captured again
    assert not all(torch.equal(a, b) for a, b in zip(before, _params(model)))


def test_replay_refuses_a_module_in_another_train_eval_mode_and_runs_nothing():
    model, _, _, graph, _ = _captured()
    model.eval()
    before = _params(model)
    with pytest.raises(
        RuntimeError, match=r"(Sequential|Linear) is in eval mode, and the step was captured in train mode"
    ):
        graph.replay()
    assert all(torch.equal(a, b) for a, b in zip(before, _params(model)))
    model[1].train()  # only the Tanh back: the Sequential and Linears are still in eval mode
    with pytest.raises(RuntimeError, match="is in eval mode"):
        graph.replay()
    model.train()
    graph.replay()
    assert not all(torch.equal(a, b) for a, b in zip(before, _params(model)))


def test_copies_made_by_another_thread_during_the_capture_are_not_the_steps():
    # TrainPipeline's worker thread starts the next batch's copies while the main thread captures.
    model, optimizer, x, y = _setup()

    def worker_copy() -> None:
        host_to_jax(torch.ones(4), jax_device(0))

    with tpurec.mode("fused"):
        _warm(model, optimizer, x, y)
        graph = tpurec.TpuGraph()
        with tpurec.graph(graph):
            _step(model, optimizer, x, y)
            worker = threading.Thread(target=worker_copy)
            worker.start()
            worker.join(timeout=60)
    assert graph.captured


def test_a_tensor_the_step_reads_and_drops_is_refused():
    model, optimizer, x, y = _setup()
    carried = {"h": torch.zeros(5, 6, device="tpu")}

    def step():  # the input of each step is the previous step's output, kept in a Python variable
        loss = _step(model, optimizer, x + carried["h"], y)
        carried["h"] = x * loss.detach()
        return loss

    with tpurec.mode("fused"):
        for _ in range(WARMUP):
            step().item()
        _refused("reads a tensor that it then drops", step, model)


def _captured():
    """A model, its optimizer, its static batch, a graph of its step and the step's loss."""
    model, optimizer, x, y = _setup()
    with tpurec.mode("fused"):
        _warm(model, optimizer, x, y)
        graph = tpurec.TpuGraph()
        with tpurec.graph(graph):
            loss = _step(model, optimizer, x, y)
    return model, optimizer, x, graph, loss


@pytest.mark.parametrize("change", ["resize_", "set_", "data", "storage_freed"])
def test_replay_refuses_a_tensor_given_other_memory_and_runs_nothing(change):
    model, _, x, graph, _ = _captured()
    if change == "resize_":
        x.resize_(8, 6)  # a larger storage
    elif change == "set_":
        x.set_(torch.zeros(5, 6, device="tpu"))
    elif change == "data":
        next(model.parameters()).data = torch.zeros(16, 6, device="tpu")
    else:
        free_storage(x)  # as FSDP2 frees a parameter's memory (tpurec.distributed.fsdp): the same storage, no values
    before = [p.detach().cpu() for p in model.parameters()]
    message = "now holds float32\\[0\\]" if change == "storage_freed" else "has another storage since the capture"
    with pytest.raises(RuntimeError, match=message):
        graph.replay()
    assert all(torch.equal(a, p.detach().cpu()) for a, p in zip(before, model.parameters()))


def test_a_graph_captures_once_and_captures_do_not_nest():
    _, _, _, graph, _ = _captured()
    with pytest.raises(RuntimeError, match="call reset"):
        with tpurec.graph(graph):
            pass
    graph.reset()
    assert not graph.captured
    with pytest.raises(RuntimeError, match="do not nest"):
        with tpurec.graph(graph):
            with tpurec.graph(tpurec.TpuGraph()):
                pass
    assert not graph.captured


def test_the_captured_step_and_its_replays_free_nothing_they_still_use():
    """Donated buffers: a parameter's buffer also held by another storage is copied, not donated."""
    model, _, _, graph, loss = _captured()
    weight = next(model.parameters())
    alias = torch.empty_like(weight)
    alias.copy_(weight)  # may share the buffer (buffers are never written in place)
    kept = alias.cpu()
    graph.replay()
    assert torch.equal(alias.cpu(), kept)
    assert torch.isfinite(loss.cpu()).all()


class _PythonGetattribute(type):
    def __getattribute__(cls, name):
        return super().__getattribute__(name)


class _Hooked(metaclass=_PythonGetattribute):
    pass


def test_a_capture_leaves_alone_the_tuples_another_thread_is_building():
    # TrainPipeline's worker builds tuple(generator) while the main thread captures; the capture's
    # scan of live objects once held such a half-built tuple across a thread switch, and the
    # worker's resize of it failed (SystemError in tupleobject.c).
    model, optimizer, x, y = _setup()
    stop, errors = threading.Event(), []
    ballast = [[n] for n in range(200_000)]  # a long scan: thread switches happen during it
    # Objects of a class whose metaclass runs Python code on attribute access (as transformers'
    # DummyObject does): a scan that reads their class's attributes lets the worker run.
    hooked = [_Hooked() for _ in range(20_000)]

    def slow(n: int):
        for k in range(n):
            yield sum(range(50)) + k

    def build_tuples() -> None:
        while not stop.is_set():
            try:
                assert len(tuple(slow(300))) == 300
            except Exception as error:  # noqa: BLE001 (reported by the main thread)
                errors.append(error)
                return

    with tpurec.mode("fused"):
        _warm(model, optimizer, x, y)
        worker = threading.Thread(target=build_tuples)
        worker.start()
        try:
            for _ in range(8):
                graph = tpurec.TpuGraph()
                with tpurec.graph(graph):
                    _step(model, optimizer, x, y)
                assert graph.captured
                graph.replay()
        finally:
            stop.set()
            worker.join(timeout=60)
    del ballast, hooked
    assert not worker.is_alive()
    assert errors == []


# --- several steps per launch (TpuGraph.replay_steps) ----------------------------------------

K = 4  # steps per launch


def _dropout_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Dropout(0.3), torch.nn.Linear(16, 1))


def _train_in_launches(feed: str, batches: list) -> tuple[list[float], list[torch.Tensor], torch.Tensor, list[int]]:
    """Warm-up, capture, then replays of ``batches[WARMUP + 1:]``: one launch per step (``feed`` "single") or
    K steps per launch, fed stacked batches ("stacked"; "background": the program compiled in the
    background) or by a fill callback ("fill").

    Returns the losses, the parameters, the generator's state, and the programs run per launch."""
    model = _dropout_model().to("tpu")
    optimizer = torch.optim.Adagrad(model.parameters(), lr=0.05, fused=True)
    rng.manual_seed(123)
    static_x, static_y = torch.zeros(5, 6, device="tpu"), torch.zeros(5, 1, device="tpu")
    graph = tpurec.TpuGraph()
    losses, programs = [], []
    with tpurec.mode("fused"):
        for i, (x, y) in enumerate(batches[: WARMUP + 1]):
            static_x.copy_(x)
            static_y.copy_(y)
            if i < WARMUP:
                losses.append(_step(model, optimizer, static_x, static_y).item())
                continue
            with tpurec.graph(graph):
                static_loss = _step(model, optimizer, static_x, static_y)
            losses.append(static_loss.item())
        rest = batches[WARMUP + 1 :]
        on_device = [(x.to("tpu"), y.to("tpu")) for x, y in rest]
        for start in range(0, len(rest), 1 if feed == "single" else K):
            chunk = on_device[start : start + K]
            xs, ys = torch.stack([x for x, _ in chunk]), torch.stack([y for _, y in chunk])

            def fill(i: int, chunk=chunk) -> None:
                tpurec.core.tensor.replace_array(static_x, chunk[i][0].to_jax())
                tpurec.core.tensor.replace_array(static_y, chunk[i][1].to_jax())

            tpurec.synchronize()  # the stacking's own program runs here
            before = tpurec.stats()["executions"]
            if feed == "single":
                fill(0)
                graph.replay()
                stepped = static_loss
            elif feed == "fill":
                (stepped,) = graph.replay_steps(fill=fill, steps=len(chunk), collect=[static_loss])
            else:
                background = feed == "background"
                (stepped,) = graph.replay_steps(
                    {static_x: xs, static_y: ys}, collect=[static_loss], compile_in_background=background
                )
            programs.append(tpurec.stats()["executions"] - before)  # the launches, not the loss's read
            losses.extend(stepped.reshape(-1).tolist())
            if feed == "background":
                assert graph.wait_for_compiles(timeout=300)
        assert torch.equal(static_x.cpu(), rest[-1][0])  # the static inputs hold the last batch, as after replays
    return losses, [p.detach().cpu() for p in model.parameters()], rng.get_state(), programs


@pytest.mark.parametrize("feed", ["stacked", "fill", "background"])
def test_several_steps_per_launch_train_as_single_replays_bit_for_bit(feed):
    batches = _batches(WARMUP + 1 + 2 * K)
    single = _train_in_launches("single", batches)
    looped = _train_in_launches(feed, batches)
    assert looped[0] == single[0]  # bit for bit, dropout included
    assert all(torch.equal(a, b) for a, b in zip(looped[1], single[1]))
    assert torch.equal(looped[2], single[2])  # the generator advanced as far
    assert len(looped[3]) == 2 and looped[3][-1] == 1  # one program for K steps
    if feed == "background":  # the first launch ran its steps one by one while the program compiled
        assert looped[3][0] == K


def _captured_sgd_step() -> tuple:
    """A model, its optimizer, a captured step over static inputs x and y, and its loss tensor."""
    model = _model().to("tpu")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    static_x, static_y = torch.zeros(5, 6, device="tpu"), torch.zeros(5, 1, device="tpu")
    graph = tpurec.TpuGraph()
    with tpurec.mode("fused"):
        _warm(model, optimizer, static_x, static_y)
        with tpurec.graph(graph):
            loss = _step(model, optimizer, static_x, static_y)
    return model, graph, static_x, static_y, loss


def test_a_launch_of_several_steps_compiles_once_then_nothing():
    _, graph, static_x, _, loss = _captured_sgd_step()
    xs = torch.randn(K, 5, 6).to("tpu")
    graph.replay_steps({static_x: xs}, collect=[loss])
    tpurec.synchronize()
    before = tpurec.stats()
    for _ in range(3):
        graph.replay_steps({static_x: xs}, collect=[loss])
    tpurec.synchronize()
    after = tpurec.stats()
    assert after["compilations"] == before["compilations"]
    assert after["executions"] - before["executions"] == 3
    assert after["ops_by_name"] == before["ops_by_name"]  # no op dispatched: no Python of the step ran


def test_replay_steps_refuses_what_it_cannot_feed_and_runs_nothing():
    model, graph, static_x, static_y, loss = _captured_sgd_step()
    before = [p.detach().cpu().clone() for p in model.parameters()]
    weight = next(model.parameters())
    with pytest.raises(ValueError, match=r"must be a tpu tensor torch.float32\[4, 5, 6\]"):
        graph.replay_steps({static_x: torch.zeros(4, 5, 7, device="tpu")})
    with pytest.raises(ValueError, match="writes the static input"):
        graph.replay_steps({weight: torch.zeros(4, *weight.shape, device="tpu")})
    with pytest.raises(ValueError, match="does not read the static input"):
        graph.replay_steps({torch.zeros(5, 6, device="tpu"): torch.zeros(4, 5, 6, device="tpu")})
    with pytest.raises(ValueError, match="collect takes whole tensors the captured step writes"):
        graph.replay_steps({static_x: torch.zeros(4, 5, 6, device="tpu")}, collect=[static_y])
    with pytest.raises(ValueError, match="disagree on the number of steps"):
        graph.replay_steps({static_x: torch.zeros(4, 5, 6, device="tpu"), static_y: torch.zeros(3, 5, 1, device="tpu")})
    with pytest.raises(ValueError, match="needs steps="):
        graph.replay_steps(fill=lambda i: None)
    assert all(torch.equal(a, p.detach().cpu()) for a, p in zip(before, model.parameters()))
    assert loss.shape == ()


def test_stats_say_where_the_compile_seconds_of_each_program_went():
    _, graph, static_x, _, loss = _captured_sgd_step()
    tpurec.reset_stats()
    graph.replay_steps({static_x: torch.randn(K + 1, 5, 6).to("tpu")}, collect=[loss])
    stats = tpurec.stats()
    entry = stats["compiles_by_program"][f"captured step x{K + 1}"]
    assert entry["programs"] == 1
    # The persistent cache may hold the program: then it loads instead of compiling.
    assert entry["tracing"] > 0 and entry["lowering"] > 0 and entry["xla_compile"] + entry["cache_load"] > 0
    assert entry["tracing"] + entry["lowering"] + entry["xla_compile"] + entry["cache_load"] <= entry["seconds"]
    assert sum(e["seconds"] for e in stats["compiles_by_program"].values()) <= stats["compile_seconds"] + 1e-6
    for phase in ("tracing", "lowering", "xla_compile", "cache_load"):
        assert stats["compile_phases"][phase] >= entry[phase]
