"""``tpurec.warmup``: compile a training step's programs before the first real batch, then undo the step.

The first steps of a job compile its programs (in fused mode the first step's window and the
steady step's, in eager mode every op's), which on a TPU can take a minute. ``warmup`` runs the
step on an example batch as often as it takes to meet every program, then puts back everything
the step changed: parameters, buffers, gradients, optimizer state, the random number generators,
and the Python counters of the modules (e.g. a fused embedding optimizer's step counts). The job's
real steps then start from the same state, compute the same values, and find every program in
memory.
"""

from __future__ import annotations

import time
from typing import Any, Callable

import jax
import torch
from torch import nn

from tpurec.core import TpuTensor, flush, get_rng_state, replace_array, set_rng_state, stats, synchronize

__all__ = ["warmup"]

_COUNTER_TYPES = (bool, int, float)


def _objects(state: Any) -> tuple[list[nn.Module], list[torch.optim.Optimizer]]:
    items = [state] if isinstance(state, (nn.Module, torch.optim.Optimizer)) else state
    try:
        items = list(items)
    except TypeError:
        items = [items]
    modules, optimizers = [], []
    for item in items:
        if isinstance(item, nn.Module):
            modules.append(item)
        elif isinstance(item, torch.optim.Optimizer):
            optimizers.append(item)
        else:
            got = "a tensor (pass the module that holds it)" if isinstance(item, torch.Tensor) else type(item).__name__
            raise TypeError(
                "tpurec.warmup(state=...) takes the modules and optimizers the step changes (an nn.Module, a "
                f"torch.optim.Optimizer, or a list of them), got {got}"
            )
    if not modules and not optimizers:
        raise ValueError(
            "tpurec.warmup(state=...) needs the modules and optimizers the step changes, e.g. state=(model, "
            "optimizer): what it changes is put back after the warm-up"
        )
    return modules, optimizers


def _is_counter(value: Any) -> bool:
    if isinstance(value, _COUNTER_TYPES):
        return True
    return isinstance(value, (list, tuple)) and all(isinstance(v, _COUNTER_TYPES) for v in value)


class _Snapshot:
    """What a step may change in ``modules`` and ``optimizers``, kept to be put back.

    A whole tpu tensor's array is copied on its device (the copy keeps its sharding, and the
    step's programs see the same buffers donated as in a real step, where nothing else holds
    them) and put back in place; other tensors' values are cloned and copied back.
    """

    def __init__(self, modules: list[nn.Module], optimizers: list[torch.optim.Optimizer]) -> None:
        self.kept: set[int] = set()
        self.arrays: list[tuple[torch.Tensor, jax.Array]] = []  # whole tpu tensors and copies of their arrays
        self.values: list[tuple[torch.Tensor, torch.Tensor]] = []  # other tensors and clones of their values
        self.grads: list[tuple[torch.Tensor, torch.Tensor | None]] = []
        self.counters: list[tuple[nn.Module, str, Any]] = []
        self.optimizers: list[tuple[torch.optim.Optimizer, dict, list[dict]]] = []
        seen: set[int] = set()
        for module in modules:
            for sub in module.modules():
                if id(sub) in seen:
                    continue
                seen.add(id(sub))
                for name, value in vars(sub).items():
                    if _is_counter(value):  # a list is copied: the step may change it in place
                        self.counters.append((sub, name, list(value) if isinstance(value, list) else value))
            for tensor in [*module.parameters(), *module.buffers()]:
                self._keep(tensor)
                if isinstance(tensor, nn.Parameter):
                    self.grads.append((tensor, tensor.grad))
                    if tensor.grad is not None:
                        self._keep(tensor.grad)
        for optimizer in optimizers:
            state = {param: dict(entry) for param, entry in optimizer.state.items()}
            for entry in state.values():
                for value in entry.values():
                    if isinstance(value, torch.Tensor):
                        self._keep(value)
            groups = [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups]
            self.optimizers.append((optimizer, state, groups))
            for group in optimizer.param_groups:
                for param in group["params"]:
                    self._keep(param)
                    self.grads.append((param, param.grad))
                    if param.grad is not None:
                        self._keep(param.grad)
        self.rng = (get_rng_state(), torch.get_rng_state())

    def _keep(self, tensor: torch.Tensor) -> None:
        if id(tensor) in self.kept:
            return
        self.kept.add(id(tensor))
        if isinstance(tensor, TpuTensor) and tensor.is_full:
            array = tensor.to_jax()
            self.arrays.append((tensor, jax.device_put(array, array.sharding, may_alias=False)))
        else:  # a CPU tensor, or a view of a tpu storage: its values, copied back
            self.values.append((tensor, tensor.detach().clone()))

    def restore(self) -> None:
        for tensor, array in self.arrays:
            replace_array(tensor, array)
        with torch.no_grad():
            for tensor, values in self.values:
                tensor.detach().copy_(values)
        for param, grad in self.grads:
            param.grad = grad
        for module, name, value in self.counters:
            if getattr(module, name, None) != value:
                setattr(module, name, list(value) if isinstance(value, list) else value)
        for optimizer, state, groups in self.optimizers:
            optimizer.state.clear()
            optimizer.state.update({param: dict(entry) for param, entry in state.items()})
            for group, saved in zip(optimizer.param_groups, groups):
                group.update(saved)
        set_rng_state(self.rng[0])
        torch.set_rng_state(self.rng[1])
        self.arrays.clear()  # the restored arrays are held by their storages alone (donated as in any step)


def warmup(step: Callable[..., Any], *args: Any, state: Any, steps: int = 2, **kwargs: Any) -> dict[str, Any]:
    """Compiles the programs of a training step before the first real batch, then undoes the step.

    Runs ``step(*args, **kwargs)`` ``steps`` times in the current mode (the first makes the
    optimizer's state, the second is the steady step: what a job's first steps compile), waits
    for them, then puts back what they changed in ``state``: every parameter, buffer and
    gradient of its modules, its optimizers' state and hyperparameters, the Python numbers of
    the modules (step counts of fused embedding optimizers, flags), and the tpu and CPU random
    number generators. The job's first real step then compiles nothing (``tpurec.stats()``'s
    ``compilations`` and ``compile_requests`` stay 0 for steps like the example's) and computes
    what it would have computed without the warm-up. The state's tensors are copied on their
    devices meanwhile: the warm-up needs room for a second copy of them.

    Args:
        step: one training step (``zero_grad``, forward, ``backward``, ``step``); its result is
            waited for and dropped.
        *args: the example batch, passed to ``step``: tensors of the real batches' shapes and
            dtypes (a batch of other shapes compiles other programs).
        state: what the step changes: an ``nn.Module``, a ``torch.optim.Optimizer`` or a list of
            them (the model and its optimizer). State the step changes elsewhere is not put back.
        steps: how many times to run the step (at least 1).
        **kwargs: keyword arguments of ``step``.

    Returns:
        ``seconds`` (the warm-up's wall time), ``compilations`` (programs compiled, not read from
        the disk cache), ``compile_requests`` (programs compiled or read from it) and
        ``compile_seconds``.

    Raises:
        TypeError: ``state`` holds something other than modules and optimizers.
        ValueError: ``state`` is empty, or ``steps`` is below 1.

    Example::

        def train_step(x, y):
            optimizer.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            optimizer.step()
            return loss

        with tpurec.mode("fused"):
            tpurec.warmup(train_step, example_x, example_y, state=(model, optimizer))
            for x, y in loader:  # the first step compiles nothing
                train_step(x, y)
    """
    if not isinstance(steps, int) or steps < 1:
        raise ValueError(f"tpurec.warmup(steps=...) runs the step at least once, got steps={steps!r}")
    modules, optimizers = _objects(state)
    synchronize()  # pending work belongs to the state as it is
    before, started = stats(), time.perf_counter()
    snapshot = _Snapshot(modules, optimizers)
    try:
        for _ in range(steps):
            result = step(*args, **kwargs)
            # A step ends at its sync point with its result alive (a loop reading its loss): in
            # fused mode the same window, with the same live outputs, as a real step's.
            flush("step")
            del result
        synchronize()
    finally:
        snapshot.restore()
        synchronize()  # what the restore copied runs now, not in the first real step's program
    after = stats()
    return {
        "seconds": time.perf_counter() - started,
        "compilations": after["compilations"] - before["compilations"],
        "compile_requests": after["compile_requests"] - before["compile_requests"],
        "compile_seconds": after["compile_seconds"] - before["compile_seconds"],
    }
