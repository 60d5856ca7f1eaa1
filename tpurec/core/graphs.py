"""Captured steps: a training step recorded once and replayed as one program, with no Python.

The tpu device's counterpart of ``torch.cuda.CUDAGraph``. In fused mode a steady training
step already runs as one compiled program, but the host still runs the step's Python every
time: the modules, PyTorch's autograd engine, the optimizer, and tpurec's recording of each
op (milliseconds per step for a small model, where a TPU needs well under one). A
:class:`TpuGraph` keeps the program of one step and what it reads and writes: ``replay()``
calls the program on the current values of the tensors the step read and stores its results
into the tensors the step wrote, in about the time of one JAX call.

As with CUDA graphs, what replays is the device work of the step as captured:

* **Inputs are tensors that outlive the step**: parameters, optimizer state, and static input
  tensors that the caller fills (``static_x.copy_(batch)``) before each replay. A tensor made in
  the step from a CPU tensor (``batch.to("tpu")`` inside the step) cannot be captured.
* **Python runs once, at capture.** Python numbers the step passes to ops (learning rates, an
  ``alpha``) are those of the capture, and work on CPU tensors (the step counts of optimizers
  that keep them on the CPU) does not replay. A step whose numbers change from one step to the
  next (a learning rate scheduler, Adam's bias correction with ``capturable=False``) is refused
  at capture, since it would replay wrongly; of a change made later, a replay sees only what
  the next point names.
* **Random ops draw new numbers** on each replay, from the device's generator, as the step would.
* **Settings the Python read are checked at replay**: an optimizer's ``lr`` and other non-tensor
  param-group settings, and the train/eval mode of the modules of the models the step trained,
  must be as at the capture (a replay refuses otherwise).

The capture checks what it can and raises ``RuntimeError`` otherwise, after the step ran in full
as a fused window (no work is lost): a sync point in the step (``.item()``, printing, a host op),
an op run on its own outside the window, a copy from the CPU, an optimizer that makes its state in
the step or a step whose structure never ran before (so the first steps run before the capture),
a Python number that changed since the last step of the same structure, an optimizer state tensor
on the CPU that the step writes, an input tensor the step dropped.

Example::

    model, opt = ..., torch.optim.SGD(params, lr=0.1, momentum=0.9)
    static_x = torch.zeros(batch, features, device="tpu")
    static_y = torch.zeros(batch, device="tpu")

    def step():
        opt.zero_grad()
        loss = loss_fn(model(static_x), static_y)
        loss.backward()
        opt.step()
        return loss

    with tpurec.mode("fused"):
        for x, y in warmup_batches:  # at least two steps, each read (a sync point)
            static_x.copy_(x); static_y.copy_(y)
            step().item()
        g = tpurec.TpuGraph()
        with tpurec.graph(g):
            static_loss = step()
    for x, y in batches:
        static_x.copy_(x); static_y.copy_(y)
        g.replay()
        print(static_loss.item())
"""

from __future__ import annotations

import atexit
import collections
import concurrent.futures
import contextlib
import functools
import gc
import itertools
import logging
import operator
import threading
import time
import weakref
from typing import Callable, Iterator, Mapping, Sequence

import jax
import jax.numpy as jnp
from jax import lax
import numpy as np
import torch

from tpurec import config
from tpurec.core import accounting, fused, modes, rng, runtime
from tpurec.core import tensor as _tensor
from tpurec.core.fused import _DONATED, _KEPT, _OTHER
from tpurec.core.tensor import Storage, holders

__all__ = ["TpuGraph", "graph", "on_replay", "replay_check"]

log = logging.getLogger("tpurec.graphs")

_Optimizer = torch.optim.Optimizer

# Set while a step is captured: Python work each replay repeats (on_replay), and checks that a
# replay still does what the step would (replay_check).
_replay_hooks: list[Callable[[], None]] | None = None
_replay_checks: list[Callable[[], str | None]] | None = None

# Background compilations under way (replay_steps(compile_in_background=True)): a process that ends
# while XLA compiles on one of their (daemon) threads can abort in XLA's teardown, so the exit waits.
_compiling_in_background: set[concurrent.futures.Future] = set()


@atexit.register
def _wait_for_background_compiles() -> None:
    concurrent.futures.wait(list(_compiling_in_background), timeout=600)


_WARM_UP = "Run the step at least twice in fused mode first, reading a result of each (loss.item()), then capture"


class TpuGraph:
    """One captured step: its program, where its inputs come from and where its outputs go.

    Made empty; :func:`graph` captures a step into it. See the module's documentation.

    Example::

        g = tpurec.TpuGraph()
        with tpurec.graph(g):
            loss = step()
        g.replay()
    """

    def __init__(self) -> None:
        self._plan: _Plan | None = None

    @property
    def captured(self) -> bool:
        """Whether a step was captured (and not reset since)."""
        return self._plan is not None

    def replay(self) -> None:
        """Runs the captured step once on the current values of its input tensors.

        Pending fused work runs first (a ``copy_`` into a static input in fused mode). The
        program runs asynchronously, as any tpu op: reading an output waits for it.

        Raises:
            RuntimeError: nothing captured; a tensor the step reads or writes was given other
                memory since the capture (``set_``, ``resize_``, ``.data =``); a storage it
                reads changed shape or dtype or was freed; or a setting the step's Python read
                changed (an optimizer's non-tensor param-group setting such as ``lr``, the
                train/eval mode of a module of a model the step trained, a check registered
                with :func:`replay_check`). Nothing runs then.
        """
        plan = self._plan
        if plan is None:
            raise RuntimeError("this TpuGraph has no captured step: capture one with `with tpurec.graph(g): ...`")
        plan.replay()

    def replay_steps(
        self,
        inputs: Mapping[torch.Tensor, torch.Tensor] | None = None,
        *,
        fill: Callable[[int], None] | None = None,
        steps: int | None = None,
        collect: Sequence[torch.Tensor] = (),
        compile_in_background: bool = False,
    ) -> tuple[torch.Tensor, ...]:
        """Runs the captured step ``steps`` times in one program: a device loop, one launch.

        Keras' ``steps_per_execution``: the host issues one program for several steps, so a step
        costs the device's time, not a launch's. Step ``i`` reads, in place of each static input
        given, its ``i``-th batch: from ``inputs`` (per static input, its batches stacked along a
        new first dimension), or whatever ``fill(i)`` put into the static inputs (``copy_()``,
        ``stage()`` of a tpurec embedding collection), called for every step before the program
        runs. Everything else is as ``steps`` calls of :meth:`replay`: the results are those of
        the plain replays bit for bit, random ops draw as many numbers, hooks run once per step,
        and afterwards every tensor the step writes holds the last step's values and each static
        input the last batch. The program is compiled once per number of steps and way of
        feeding (a count of ``stats()["compilations"]``), then reused.

        Args:
            inputs: static input tensor -> a tpu tensor of its batches, ``[steps, *shape]``, of its
                dtype. Each static input must be a whole tensor the step reads (not a view) and
                does not write.
            fill: called with ``i`` for each step, in order, before the program runs; it writes
                step ``i``'s batch into static input tensors. Cheapest where it replaces their
                arrays (``stage()``, :func:`tpurec.core.tensor.replace_array`): a ``copy_()``
                in fused mode runs a program of its own per step.
            steps: the number of steps; needed with ``fill`` alone, else taken from ``inputs``.
            collect: tensors the step writes whose value at every step is wanted (the loss).
            compile_in_background: while the program of this number of steps and way of feeding
                is not compiled, compile it on a background thread and run the steps as single
                replays (the same results; one launch per step): the first calls do not wait
                for the compiler. :meth:`wait_for_compiles` waits for it.

        Returns:
            Per tensor of ``collect``, a new tpu tensor ``[steps, *shape]``: its value after each step.

        Raises:
            ValueError: ``steps`` below 1 or not matching ``inputs``; a static input the step does
                not read, writes, or views only in part; stacked batches of the wrong shape or dtype;
                a collected tensor the step does not write. Nothing runs then.
            RuntimeError: as :meth:`replay`.

        Example::

            (losses,) = g.replay_steps({static_x: xs, static_y: ys}, collect=[static_loss])
            print(losses.tolist())  # xs.shape[0] losses, one launch
        """
        plan = self._plan
        if plan is None:
            raise RuntimeError("this TpuGraph has no captured step: capture one with `with tpurec.graph(g): ...`")
        inputs = dict(inputs or {})
        if steps is None:
            sizes = {int(t.shape[0]) if t.dim() else 0 for t in inputs.values()}
            if fill is not None and not inputs:
                raise ValueError("replay_steps(fill=...) needs steps=: how many steps to run")
            if not inputs:
                raise ValueError("replay_steps needs inputs (static input -> stacked batches) or fill and steps")
            if len(sizes) != 1:
                raise ValueError(f"replay_steps: the stacked inputs disagree on the number of steps: {sorted(sizes)}")
            steps = sizes.pop()
        if steps < 1:
            raise ValueError(f"replay_steps runs at least one step, got steps={steps}")
        return plan.replay_steps(steps, inputs, fill, list(collect), compile_in_background)

    def wait_for_compiles(self, timeout: float | None = None) -> bool:
        """Waits for the programs that :meth:`replay_steps` compiles in the background.

        Args:
            timeout: seconds to wait at most (None: until they are compiled).

        Returns:
            Whether every one is compiled (or failed: the next call then compiles it itself).
        """
        plan = self._plan
        if plan is None:
            return True
        done, _ = concurrent.futures.wait(list(plan.compiling.values()), timeout=timeout)
        return len(done) == len(plan.compiling)

    def reset(self) -> None:
        """Forgets the captured step and lets go of the tensors it held."""
        self._plan = None


class _Plan:
    """What a replay needs: the program, per argument its source, per output its storage."""

    def __init__(
        self,
        program,
        groups: list,
        numbers: tuple,
        seeds: list,
        draws: int,
        outputs: list,
        watched: list,
        hooks: list[Callable[[], None]],
        checks: list[Callable[[], str | None]],
    ) -> None:
        self.program = program
        # Per donated/kept argument: (storage, shape, dtype) read at replay, or a constant array.
        self.groups = groups
        self.numbers = numbers  # the packed float, int and bool arguments: fixed at capture
        self.seeds = seeds  # the "others" group: per argument its value, or (part, offset) of a random op's seed
        self.draws = draws  # how many random ops the step has (the generator advances by as many)
        self.outputs = outputs  # (storage, output index)
        # (weak reference to a tensor, its storage) for every tensor over a storage the step reads or
        # writes: a tensor given another storage since (set_, resize_, .data =) would not see replays.
        self.watched = watched
        self.hooks = hooks  # Python bookkeeping of the step, repeated per replay (on_replay)
        self.checks = checks  # settings the step's Python read, unchanged since (replay_check): else an error
        self.loops: dict = {}  # replay_steps' programs, by number of steps and way of feeding
        self.compiling: dict = {}  # the same key -> the Future of its compilation in the background

    def _arrays(self, sources: list, donated: bool) -> list:
        arrays = []
        for source in sources:
            if type(source) is not tuple:
                arrays.append(source)  # made during the step: a constant
                continue
            storage, shape, dtype = source
            array = storage._array
            if fused.is_pending(array):
                array = fused.resolve(array)
            if not isinstance(array, jax.Array) or array.shape != shape or array.dtype != dtype:
                got = "no values" if not isinstance(array, jax.Array) else f"{array.dtype}{list(array.shape)}"
                raise RuntimeError(
                    f"a tensor the captured step reads now holds {got}, where the step read {dtype}{list(shape)}: "
                    "fill static inputs with copy_() (keeping their shape and dtype) and capture again after a change"
                )
            if donated and holders(array) > 1:
                array = jnp.copy(array)  # shared with another storage, which must keep it: donate a copy
            arrays.append(array)
        return arrays

    def _ready(self) -> None:
        """What every replay checks first (settings, storages) and the pending work it runs."""
        for check in self.checks:
            why = check()
            if why is not None:
                raise RuntimeError(f"this captured step cannot replay: {why}. Nothing ran")
        fused.flush("graph replay")
        for ref, storage in self.watched:
            t = ref()
            if t is not None and t._storage is not storage:
                raise RuntimeError(
                    f"a tensor that the captured step reads or writes ({t.dtype}{list(t.shape)}) has another storage "
                    "since the capture (set_(), resize_(), .data =), so a replay would not reach it: fill tensors "
                    "in place with copy_(), or capture again"
                )

    def _seeds(self, base: int) -> list:
        """The "others" arguments of the step whose random ops start at generator counter ``base``."""
        high, low = np.uint32(rng._seed >> 32), np.uint32(rng._seed & 0xFFFF_FFFF)
        others = []
        for value in self.seeds:
            if type(value) is tuple:
                part, offset = value
                others.append(high if part == 0 else low if part == 1 else np.uint32((base + offset) & 0xFFFF_FFFF))
            else:
                others.append(value)
        return others

    def replay(self) -> None:
        self._ready()
        donated, kept = self.groups
        args = [self._arrays(donated, True), self._arrays(kept, False), *self.numbers]
        if self.draws:
            base = rng._counter
            others = self._seeds(base)
            rng._counter = base + self.draws
            args.append(others)
        else:
            args.append(self.seeds or None)
        values = self.program(*args)
        for storage, k in self.outputs:
            storage.array = values[k]
        for hook in self.hooks:
            hook()

    def replay_steps(
        self, steps: int, inputs: dict, fill: Callable[[int], None] | None, collect: list, background: bool = False
    ) -> tuple:
        """``steps`` replays as one program (see :meth:`TpuGraph.replay_steps`; arguments checked there)."""
        from tpurec.core.tensor import TpuTensor, wrap

        written = {id(storage): k for storage, k in self.outputs}  # the last write of a storage wins, as in replay
        read: dict[int, tuple[int, int]] = {}
        for group, sources in enumerate(self.groups):
            for n, source in enumerate(sources):
                if type(source) is tuple:
                    read[id(source[0])] = (group, n)
        stacked_at, stacked = [], []
        for static, batches in inputs.items():
            if not isinstance(static, TpuTensor) or not static.is_full:
                raise ValueError(
                    "replay_steps: each static input must be a whole tpu tensor (not a view, not on another device), "
                    f"got {type(static).__name__} {getattr(static, 'device', '')} of shape {list(static.shape)}"
                )
            where = read.get(id(static._storage))
            if where is None or id(static._storage) in written:
                what = "does not read" if where is None else "writes"
                raise ValueError(
                    f"replay_steps: the captured step {what} the static input {static.dtype}{list(static.shape)}; "
                    "batches can only be fed to tensors the step reads and leaves as they are"
                )
            want = (steps, *static.shape)
            if not isinstance(batches, TpuTensor) or tuple(batches.shape) != want or batches.dtype != static.dtype:
                got = f"{type(batches).__name__} {getattr(batches, 'dtype', '')}{list(getattr(batches, 'shape', []))}"
                raise ValueError(
                    f"replay_steps: the batches of a static input {static.dtype}{list(static.shape)} must be a tpu "
                    f"tensor {static.dtype}{list(want)} (one batch per step along a new first dimension), got {got}"
                )
            stacked_at.append(where)
            stacked.append(batches.to_jax())
        collected = []
        for t in collect:
            k = written.get(id(getattr(t, "_storage", None)))
            if k is None or not t.is_full:
                raise ValueError(
                    f"replay_steps: collect takes whole tensors the captured step writes (its loss), got "
                    f"{type(t).__name__} {getattr(t, 'dtype', '')}{list(getattr(t, 'shape', []))}"
                )
            collected.append(k)
        fed_at, fed = self._fill(steps, fill, set(stacked_at), written) if fill is not None else ([], [])
        self._ready()
        varying = [n for n, value in enumerate(self.seeds) if type(value) is tuple and value[0] == 2]
        key = (steps, tuple(stacked_at), tuple(fed_at), tuple(collected))
        program = self.loops.get(key)
        if program is None:
            links = {read[s]: k for s, k in written.items() if s in read}
            avals: list = [None] * (1 + max((k for _, k in self.outputs), default=-1))
            for storage, k in self.outputs:  # each holds its output of the last step run (flushed above)
                avals[k] = (tuple(storage._array.shape), storage._array.dtype)
            body = _loop(self.program.raw, steps, avals, links, stacked_at, fed_at, collected, varying)
            program = self.loops[key] = runtime.Program(body, **self.program._options)
            program.origin = ("steps", steps)
        if background and not program.ran:
            future = self.compiling.get(key)
            if future is None:
                self.compiling[key] = self._compile_in_background(program, steps, len(varying), stacked, fed)
            if future is None or not future.done():
                return self._one_by_one(steps, stacked_at, stacked, fed_at, fed, collected)
            try:
                program.jitted = future.result()
                program.ran = True  # compiled: its first call runs it
            except Exception as error:  # noqa: BLE001 (compiled here instead, where the error surfaces)
                log.debug("tpurec: the background compilation of %d captured steps failed: %r", steps, error)
        donated, kept = self.groups
        args = [self._arrays(donated, True), self._arrays(kept, False), *self.numbers]
        if self.draws:
            base = rng._counter
            others = self._seeds(base)
            counters = np.array(
                [[self._seeds(base + i * self.draws)[n] for n in varying] for i in range(steps)], dtype=np.uint32
            )
            rng._counter = base + steps * self.draws
        else:
            others, counters = self.seeds or None, None
        final, series, last = program(*args, others, counters, stacked, fed)
        for storage, k in self.outputs:
            storage.array = final[k]
        for static, array in zip(inputs, last):
            static._storage.array = array
        for _ in range(steps):
            for hook in self.hooks:
                hook()
        index = self.outputs[0][0].index if self.outputs else 0
        return tuple(wrap(array, index) for array in series)

    def _compile_in_background(
        self, program: runtime.Program, steps: int, varying: int, stacked: list, fed: list
    ) -> concurrent.futures.Future:
        """Compiles ``program`` for the arguments a call would pass, on a thread of its own."""

        def spec(x):  # shapes, dtypes and placement only: the arrays themselves may be donated meanwhile
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding) if isinstance(x, jax.Array) else x

        donated, kept = self.groups
        arrays = [
            [(source[0]._array if type(source) is tuple else source) for source in group] for group in (donated, kept)
        ]
        others = (self._seeds(0) if self.draws else self.seeds) or None
        counters = np.zeros((steps, varying), np.uint32) if self.draws else None
        args = jax.tree.map(spec, [*arrays, *self.numbers, others, counters, stacked, fed])
        future: concurrent.futures.Future = concurrent.futures.Future()

        def compile_program() -> None:
            start = time.perf_counter()
            try:
                with accounting.compile_accounting(program):
                    future.set_result(program.jitted.lower(*args).compile())
            except BaseException as error:  # noqa: BLE001 (handed to the caller through the future)
                future.set_exception(error)
            finally:
                accounting.counters().compile_seconds += time.perf_counter() - start
                _compiling_in_background.discard(future)

        _compiling_in_background.add(future)
        threading.Thread(target=compile_program, name="tpurec-compile-steps", daemon=True).start()
        return future

    def _one_by_one(
        self, steps: int, stacked_at: list, stacked: list, fed_at: list, fed: list, collected: list
    ) -> tuple:
        """The ``steps`` steps as single replays, each fed its batch: what the loop program computes."""
        from tpurec.core.tensor import wrap

        def storage(where: tuple[int, int]):
            group, n = where
            return self.groups[group][n][0]

        writes = {k: s for s, k in self.outputs}
        series: list[list] = [[] for _ in collected]
        for i in range(steps):
            for where, arrays in zip(fed_at, fed):
                storage(where).array = arrays[i]
            for where, array in zip(stacked_at, stacked):
                storage(where).array = array[i]
            self.replay()
            for values, k in zip(series, collected):
                values.append(writes[k]._array)
        index = self.outputs[0][0].index if self.outputs else 0
        return tuple(wrap(jnp.stack(values), index) for values in series)

    def _fill(self, steps: int, fill: Callable[[int], None], stacked: set, written: dict) -> tuple[list, list]:
        """Calls ``fill(i)`` per step; per input slot the step reads whose array changed, its array per step."""
        slots = [
            ((group, n), source)
            for group, sources in enumerate(self.groups)
            for n, source in enumerate(sources)
            if type(source) is tuple and id(source[0]) not in written and (group, n) not in stacked
        ]
        per_step = []
        for i in range(steps):
            fill(i)
            per_step.append([fused.resolve(source[0]._array) for _, source in slots])
        fed_at, fed = [], []
        for j, (where, (_, shape, dtype)) in enumerate(slots):
            arrays = [arrays[j] for arrays in per_step]
            if all(a is arrays[0] for a in arrays):
                continue  # the same at every step: read as replay() reads it
            if any(not isinstance(a, jax.Array) or a.shape != shape or a.dtype != dtype for a in arrays):
                raise RuntimeError(
                    f"a static input the captured step reads as {dtype}{list(shape)} was given another shape or dtype "
                    "by fill(): fill static inputs in place (copy_(), keeping shape and dtype), or capture again"
                )
            fed_at.append(where)
            fed.append(arrays)
        return fed_at, fed


def _loop(
    raw: Callable,
    steps: int,
    avals: list,
    links: dict,
    stacked_at: list,
    fed_at: list,
    collected: list,
    varying: list,
):
    """The traceable program of ``steps`` captured steps: a ``lax.scan`` over the step's program ``raw``.

    Args:
        raw: the captured window's traceable function (donated, kept, floats, ints, bools, others) -> outputs.
        steps: how many steps.
        avals: per output of the step, its (shape, dtype).
        links: (group, n) of an input the step reads -> the output that writes the same storage:
            from the second step on, that input is the previous step's output.
        stacked_at: (group, n) of the inputs fed a ``[steps, ...]`` array each.
        fed_at: (group, n) of the inputs fed a list of ``steps`` arrays each.
        collected: outputs whose value at every step is returned.
        varying: positions in "others" of the random ops' counters, one row of ``counters`` per step.
    """
    slots = [*stacked_at, *fed_at]

    def program(donated, kept, floats, ints, bools, others, counters, stacked, fed):
        batches = [*stacked, *[jnp.stack(arrays) for arrays in fed]]
        groups = (list(donated), list(kept))
        # The carry: every output of the step; one written over a storage the step reads starts as that input.
        start = [jnp.zeros(shape, dtype) for shape, dtype in avals]
        for (group, n), k in links.items():
            value = groups[group][n]
            shape, dtype = avals[k]
            if value.shape != shape or value.dtype != dtype:
                raise ValueError(
                    f"replay_steps: the captured step writes {dtype}{list(shape)} over a tensor it reads as "
                    f"{value.dtype}{list(value.shape)}; steps with a changing shape cannot run in one loop"
                )
            start[k] = value

        def step(carry, xs):
            batch, counter = xs
            args = ([*groups[0]], [*groups[1]])
            for (group, n), k in links.items():
                args[group][n] = carry[k]
            for (group, n), value in zip(slots, batch):
                args[group][n] = value
            step_others = others
            if varying:
                step_others = list(others)
                for j, n in enumerate(varying):
                    step_others[n] = counter[j]
            values = raw(args[0], args[1], floats, ints, bools, step_others)
            values = [lax.convert_element_type(v, dtype) for v, (_, dtype) in zip(values, avals)]
            return values, [values[k] for k in collected]

        final, series = lax.scan(step, start, (batches, counters), length=steps)
        return final, series, [batch[-1] for batch in stacked]

    return program


_drain = collections.deque(maxlen=0).extend


def _live_objects(*bases: type) -> list[list]:
    """Per class in ``bases``, every object the garbage collector tracks whose type derives from it.

    ``gc.get_objects()`` also returns objects that another thread is still building, a tuple
    that ``tuple(generator)`` will resize among them (TrainPipeline's worker does that); holding
    it while that thread runs makes the resize fail (``SystemError`` in tupleobject.c). So the
    list is filled, filtered and emptied in one call into C: no Python code, and no other
    thread, runs while it exists.
    """
    everything: list = []
    picked: list[list] = [[] for _ in bases]
    steps = [map(everything.extend, map(operator.call, [gc.get_objects]))]
    for found, base in zip(picked, bases):
        # type.__subclasscheck__ itself, not getattr or ==: a metaclass's Python hooks would run
        # Python code, and so let other threads run (transformers' DummyObject and httpx's status
        # codes have a __getattribute__, jax's scalar types an __eq__).
        derived = map(type.__subclasscheck__, itertools.repeat(base), map(type, everything))
        steps.append(map(found.extend, [itertools.compress(everything, derived)]))
    steps.append(map(operator.call, [everything.clear]))
    _drain(itertools.chain.from_iterable(steps))
    return picked


def _live_state() -> tuple[dict[int, tuple], list]:
    """Every live storage by id, (a weak reference to it, the array it holds); per optimizer, (it,
    the size of its state, (tensor, version counter) per CPU tensor of its state)."""
    live_storages, live_optimizers = _live_objects(Storage, _Optimizer)
    storages = {id(obj): (weakref.ref(obj), obj._array) for obj in live_storages}
    optimizers = [(obj, _state_size(obj), _cpu_state(obj)) for obj in live_optimizers]
    return storages, optimizers


def _state_size(optimizer: torch.optim.Optimizer) -> int:
    return sum(len(state) for state in optimizer.state.values())


def _cpu_state(optimizer: torch.optim.Optimizer) -> list:
    return [
        (value, value._version)
        for state in optimizer.state.values()
        for value in state.values()
        if isinstance(value, torch.Tensor) and value.device.type == "cpu"
    ]


def replay_check(check: Callable[[], str | None]) -> None:
    """Has every replay of the step being captured call ``check`` first (else: nothing).

    For a setting the step's Python read and baked into the program (a learning rate, a module's
    train/eval mode): ``check`` returns None while the setting is as at the capture, else what
    changed, and the replay then raises ``RuntimeError`` with it and runs nothing.

    Args:
        check: called with no arguments before each replay.

    Example::

        lr = self.lr
        graphs.replay_check(lambda: None if self.lr == lr else f"lr is {self.lr}, the capture's {lr}")
    """
    if _replay_checks is not None:
        _replay_checks.append(check)


def on_replay(hook: Callable[[], None]) -> None:
    """Has every replay of the step being captured call ``hook`` after its program (else: nothing).

    For Python state that a step keeps beside its tensors and that its ops do not depend on
    (a module's count of its optimizer steps): the capture runs the step's Python once, so such
    a count would stop at the capture's. A number that an op reads must stay a tensor's value
    or be the same at every step (the capture refuses one that changes).

    Args:
        hook: called with no arguments once per replay, after the program is enqueued.

    Example::

        self._steps += 1
        graphs.on_replay(lambda: setattr(self, "_steps", self._steps + 1))
    """
    if _replay_hooks is not None:
        _replay_hooks.append(hook)


@contextlib.contextmanager
def graph(tpu_graph: TpuGraph) -> Iterator[None]:
    """Captures the block, one training step, into ``tpu_graph`` (as ``torch.cuda.graph``).

    The block runs in fused mode as one window, then as one program, as it would without the
    capture; its tensors hold their results as usual. Pending work runs before the block.

    Args:
        tpu_graph: an empty :class:`TpuGraph`.

    Raises:
        RuntimeError: the step cannot be replayed exactly (see the module's documentation); the
            step ran in full and ``tpu_graph`` stays empty.

    Example::

        with tpurec.graph(g):
            loss = step()
    """
    if tpu_graph._plan is not None:
        raise RuntimeError("this TpuGraph holds a captured step already: call reset() to capture another")
    if fused.capture_sync_points is not None:
        raise RuntimeError("a step is being captured already: captures do not nest")
    fused.flush("graph capture starts")
    before, optimizers = _live_state()
    counters = accounting.counters()
    executions, transfers, first_draw = counters.executions, _tensor.transfers.count, rng._counter
    sync_points: list = []
    draws: list = []
    hooks: list[Callable[[], None]] = []
    replay_checks: list[Callable[[], str | None]] = []
    global _replay_hooks, _replay_checks
    fused.capture_sync_points, rng._log, _replay_hooks, _replay_checks = sync_points, draws, hooks, replay_checks
    try:
        # No host copies of small integer tensors: a value read in Python would be baked in.
        with modes.mode("fused"), config.override(fused_max_ops=2**31 - 1, host_mirrors=0):
            yield
            fused.capture_sync_points = None  # the capture's own flush is no sync point of the step
            ran = fused.flush("graph capture")
    finally:
        fused.capture_sync_points, rng._log, _replay_hooks, _replay_checks = None, None, None, None
    ran_extra = accounting.counters().executions - executions - (ran is not None)
    new_state = sum(_state_size(optimizer) != size for optimizer, size, _ in optimizers)
    cpu_writes = sum(t._version != version for _, _, state in optimizers for t, version in state)
    checks = (sync_points, ran_extra, _tensor.transfers.count - transfers, new_state, cpu_writes)
    tpu_graph._plan = _plan(ran, before, checks, draws, first_draw, hooks, replay_checks, optimizers)


def _plan(
    ran,
    before: dict,
    checks: tuple,
    draws: list,
    first_draw: int,
    hooks: list[Callable[[], None]],
    replay_checks: list[Callable[[], str | None]],
    optimizers: list,
):
    """The replay plan of a captured window, after the checks that it replays exactly."""

    def refuse(why: str) -> RuntimeError:
        return RuntimeError(
            f"tpurec.graph cannot capture this step: {why}. The step ran in full; nothing was captured."
        )

    sync_points, ran_extra, transfers, new_state, cpu_writes = checks

    if sync_points:
        raise refuse(
            f"it has {len(sync_points)} sync point(s) ({', '.join(sorted(set(sync_points)))}): a value was read on "
            "the host (.item(), printing, a data-dependent op), which splits the step. Read values after replay()"
        )
    if ran is None:
        raise refuse("it records no tpu op")
    if ran_extra > 0:
        raise refuse(f"{ran_extra} program(s) ran on their own outside the step's window (an op run eagerly)")
    if transfers:
        raise refuse(
            f"it copies {transfers} CPU tensor(s) to the device; a replay would use the values of the capture. "
            "Copy each batch into static tpu tensors with copy_() before the step instead"
        )
    if new_state:
        raise refuse(f"an optimizer made its state in it (its first step), which a replay would make again. {_WARM_UP}")
    if cpu_writes:
        raise refuse(
            f"it writes {cpu_writes} CPU tensor(s) of an optimizer's state (its step count), work a replay would "
            "not do: use fused=True or capturable=True, which keep the optimizer's state on the device"
        )
    window, program, positions, filled, seen, arguments, previous = ran
    if previous is None:
        raise refuse(f"no step of its structure ran before it (the first steps make the optimizer's state). {_WARM_UP}")
    for was, now in zip(previous, arguments[2:5]):
        if (was is None) != (now is None) or (was is not None and not np.array_equal(was, now, equal_nan=True)):
            raise refuse(
                "a Python number it passes to an op changed since the last step like it (a learning rate set by a "
                "scheduler, an optimizer's bias correction computed on the CPU: use capturable=True). A replay "
                "would keep the value of the capture"
            )
    external = window.external
    held_before = {id(array): (ref, array) for ref, array in before.values() if isinstance(array, jax.Array)}
    sources: list = [[], []]
    for group in (_DONATED, _KEPT):
        for k in positions[group]:
            sources[group].append(_source(external[k], held_before, refuse))
    seeds: list = list(arguments[_OTHER] or [])
    slot_of = {id(external[k]): n for n, k in enumerate(positions[_OTHER])}
    for values, counter in draws:
        for part, value in enumerate(values):
            n = slot_of.get(id(value))
            if n is None:
                raise refuse("a random op's seed does not reach the step's program")
            seeds[n] = (part, counter - first_draw)
    outputs = [(storage, seen[where]) for storage, _, where in filled]
    storages = {id(source[0]): source[0] for group in sources for source in group if type(source) is tuple}
    storages.update((id(storage), storage) for storage, _ in outputs)
    tensors, modules = _live_objects(_tensor.TpuTensor, torch.nn.Module)
    watched = [(weakref.ref(t), t._storage) for t in tensors if id(getattr(t, "_storage", None)) in storages]
    checks_ = [*replay_checks, *_mode_checks(modules, storages), *_optimizer_checks(optimizers, storages)]
    return _Plan(program, sources, tuple(arguments[2:5]), seeds, len(draws), outputs, watched, hooks, checks_)


def _same(now: object, then: object) -> bool:
    """A setting unchanged: equal, both nan, or (where ``==`` gives no truth value) the same object."""
    try:
        return bool(now == then) or (now != now and then != then)
    except Exception:  # noqa: BLE001 (an array-valued setting, say)
        return now is then


def _captured(t, storages: dict) -> bool:
    return id(getattr(t, "_storage", None)) in storages


def _mode_checks(modules: list, storages: dict) -> list[Callable[[], str | None]]:
    """One check per module of a model the step trained (one whose parameters or buffers it read or
    wrote, with all its submodules: its dropouts too) that the module's train/eval mode is the
    capture's."""
    owners = set()
    for m in modules:  # from the modules' own dicts: a half-built module of some library may lack attributes
        own = (*getattr(m, "_parameters", {}).values(), *getattr(m, "_buffers", {}).values())
        if any(_captured(t, storages) for t in own):
            owners.add(id(m))
    flags = {}
    for model in modules:
        try:
            tree = list(model.modules())
        except Exception:  # noqa: BLE001 (not a model the step trained: leave it out)
            continue
        if any(id(m) in owners for m in tree):
            flags.update((id(m), (weakref.ref(m), m.training)) for m in tree)

    def check(ref: weakref.ref, training: bool) -> str | None:
        m = ref()
        if m is None or m.training == training:
            return None
        now, then = ("train", "eval") if m.training else ("eval", "train")
        return (
            f"{type(m).__name__} is in {now} mode, and the step was captured in {then} mode (dropout, batch norm "
            f"statistics): call .{then}() again before replay(), or capture a step for each mode"
        )

    return [functools.partial(check, ref, training) for ref, training in flags.values()]


def _optimizer_checks(optimizers: list, storages: dict) -> list[Callable[[], str | None]]:
    """One check per optimizer the step used that its param groups' settings (lr, momentum, ...;
    not tensor ones, which the program reads) are the capture's."""
    out: list[Callable[[], str | None]] = []
    for optimizer, _, _ in optimizers:
        groups = optimizer.param_groups
        if not any(_captured(p, storages) for group in groups for p in group["params"]):
            continue
        settings = [
            (index, key, value)
            for index, group in enumerate(groups)
            for key, value in group.items()
            if key != "params" and not isinstance(value, torch.Tensor)
        ]

        out.append(functools.partial(_settings_check, weakref.ref(optimizer), settings))
    return out


def _settings_check(ref: weakref.ref, settings: list) -> str | None:
    """What of ``settings`` ((group index, key, value) each) the optimizer behind ``ref`` changed (None: nothing)."""
    optimizer = ref()
    if optimizer is None:
        return None
    groups = optimizer.param_groups
    for index, key, value in settings:
        now = groups[index].get(key) if index < len(groups) else None
        if not _same(now, value):
            return (
                f"{type(optimizer).__name__}'s {key} is {now!r} in param group {index}, and the step was "
                f"captured with {value!r} (a learning rate scheduler?): a replay would use the old value. "
                "Capture again after the change, or give the optimizer a tensor lr, which a replay reads"
            )
    return None


def _source(x, held_before: dict, refuse):
    """Where a replay takes the input that was array ``x`` at capture: its storage, or ``x`` itself.

    ``held_before``: per array id, (a weak reference to a storage that held it when the capture
    began, the array).
    """
    held = held_before.get(id(x)) if isinstance(x, jax.Array) else None
    if held is None or held[1] is not x:
        if getattr(x, "size", 1) == 0:
            return x  # an empty array made in the step: no values, the same at every replay
        raise refuse(
            f"it reads values ({x.dtype}{list(x.shape)}) that no tensor held when the step began and that no op of "
            "the step made: an array put on the device outside tpurec's ops (a batch prefetched by "
            "EmbeddingBagCollection.prefetch, a tensor wrapped from a jax.Array in the step, a batch tensor that a "
            "model sharded by tpurec.shard splits over its mesh in the step). A replay would read the values of the "
            "capture. Fill a tensor that outlives the step before it (copy_(); for a sharded model, a tensor made "
            "by tpurec.sparse.sharding.distribute_batch; for a tpurec embedding collection, its stage() method) "
            "instead"
        )
    storage = held[0]()
    if storage is None:
        raise refuse(
            "it reads a tensor that it then drops (a value carried from step to step in a Python "
            "variable?); keep such a value in a tensor that outlives the step and write it with copy_()"
        )
    return (storage, x.shape, x.dtype)
