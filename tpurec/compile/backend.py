"""The ``torch.compile`` backend "tpu": Dynamo -> AOTAutograd -> one jax.jit program per graph.

Dynamo captures the user's code (graph breaks run eagerly on the tpu device),
AOTAutograd turns each captured graph into functional ATen forward and
backward graphs, and each of those becomes a :class:`CompiledGraph`: the graph
interpreted over jax arrays with the lowering table (graph.py), jitted.

Dynamic shapes (``torch._dynamo.mark_dynamic``, or Dynamo's automatic
dynamic shapes) are handled by **recompiling per concrete shape, with the
reason logged** (logger ``tpurec.compile``). Padding to a bucket was rejected:
padding the batch changes what the graph computes wherever it reduces over
that dim (the mean loss, every weight gradient, batch norm statistics) unless
each op is mask-aware; a recompile is always correct, and the symbolic graph
itself is traced once by Dynamo/AOTAutograd, so only the XLA program is
rebuilt. A program for a shape seen before is reused.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, Sequence

import jax
import torch
import torch.fx

from tpurec import config
from tpurec import core
from tpurec.compile import saved
from tpurec.compile.graph import CompileError, GraphProgram
from tpurec.dense.registry import get_lowering
from tpurec.dense.trace_context import traced_as_spmd
from tpurec.core import (
    Pending,
    TpuTensor,
    contiguous_strides,
    fresh_with_key,
    host_to_jax,
    is_plain,
    jax_device,
    pending_value,
    store_array,
    value_of,
)

log = logging.getLogger("tpurec.compile")

__all__ = ["CompiledGraph", "compile_graph", "decompositions", "tpu_backend"]


# --- accounting (shared counters with eager execution) --------------------------


def _count_build() -> None:
    counters = core.counters()
    if hasattr(counters, "programs_built"):
        counters.programs_built += 1
    # Older runtimes count compilations by hand; newer ones count XLA compilations
    # through jax.monitoring, which sees ours too.
    if hasattr(counters, "compilations"):
        counters.compilations += 1


# --- one compiled graph ---------------------------------------------------------


class _Variant:
    """The jitted program of a graph for one set of input shapes."""

    # origin/reused/__weakref__: for recompilation diagnostics (tpurec/core/recompiles.py).
    __slots__ = (
        "run",
        "jitted",
        "recorded",
        "ran",
        "static_outs",
        "out_keys",
        "out_plain",
        "origin",
        "reused",
        "__weakref__",
    )

    def __init__(self) -> None:
        self.run = None  # the traceable program: (arrays, scalars, seeds) -> tensor outputs
        self.jitted = None
        # In fused mode the graph is one node of the fused window: this program's
        # traceable ``raw`` is called inside the window's single XLA program.
        self.recorded: core.Program | None = None
        self.ran = False
        self.origin = None
        self.reused = False
        # Non-tensor outputs (SymInts saved for backward): sizes, fixed per shape, so
        # they are taken from the trace instead of coming back as device arrays.
        self.static_outs: dict[int, Any] = {}
        # Per output, the metadata of its tensor (``TpuTensor._key``; None: a static output),
        # fixed per variant: known after its first call, so later outputs are made without
        # working it out again (and a graph fed by them finds the same key object).
        self.out_keys: list | None = None
        self.out_plain: list[bool] = []  # per output: tensor.is_plain of its key


_serial = 0


class CompiledGraph:
    """A forward or backward graph, callable with the real (tpu) inputs.

    Args:
        gm: the functional ATen graph from AOTAutograd.
        example_inputs: its fake inputs (for the output device and the name).
        name: "forward" / "backward" / "inference", for logs and errors.
    """

    def __init__(self, gm: torch.fx.GraphModule, example_inputs: Sequence[Any], name: str) -> None:
        global _serial
        _serial += 1
        self.serial = _serial
        self.name = f"{name}#{self.serial}"
        self.compile_id = core.current_compile_id()  # Dynamo's (frame, compile): groups recompilations
        self.program = GraphProgram(gm)
        self.device_index = _example_device(example_inputs)
        # The program's outputs: the graph's own, then the new value of each input the graph
        # mutates (AOTAutograd keeps those mutations in the graph; the call writes them).
        outputs = [*self.program.output_node.args[0], *(n for _, n in self.program.mutations)]
        self.user_outputs = len(self.program.output_node.args[0])
        self.mutated_inputs = [position for position, _ in self.program.mutations]
        self.tensor_out = [
            isinstance(o, torch.fx.Node) and isinstance(o.meta.get("val"), torch.Tensor) for o in outputs
        ]
        self.out_dtypes = [o.meta["val"].dtype if t else None for o, t in zip(outputs, self.tensor_out)]
        # One program per input-shape signature and setting of the flags that change
        # programs (tpurec.config). Kept here, not in the runtime's cache, so that the
        # programs die with the graph (torch._dynamo.reset()).
        self.variants: dict[tuple, _Variant] = {}
        # AOTAutograd passes the argument list itself (we free it early). An instance
        # attribute, so that functools.wraps carries it through AOTAutograd's wrappers.
        self._boxed_call = True
        # The calling plan of the last input metadata seen (see _Plan): a repeated call
        # takes its inputs through it instead of building the shape signature again.
        self._plan: _Plan | None = None

    def __call__(self, *args) -> list:
        if len(args) == 1 and isinstance(args[0], list):
            # Boxed convention: we get the argument list itself and drop references early.
            boxed = args[0]
            args = tuple(boxed)
            boxed.clear()
        deferred = core.get_mode() == "fused"
        settings = config.program_settings()
        plan = self._plan
        gathered = None
        if plan is not None and plan.settings == settings:
            gathered = _gather(plan, args, deferred, self.device_index)
        if plan is not None and gathered is not None:
            inputs, index = gathered
            variant = plan.variant
            core.counters().cache_hits += 1
        else:
            inputs, signature, index = self._inputs(args, deferred)
            key = (signature, settings)
            variant = self.variants.get(key)
            if variant is None:
                variant = self.variants[key] = self._build(signature, settings)
            else:
                core.counters().cache_hits += 1
            self._plan = _Plan.of(variant, settings, args)
        seeds = [core.next_seed_and_counter() for _ in self.program.random_nodes]
        if deferred:
            outs = self._record(variant, inputs, seeds, index)
        else:
            outs = self._execute(variant, inputs, seeds)
        keys = variant.out_keys
        if keys is None:
            keys = variant.out_keys = _output_keys(outs, self.tensor_out, self.out_dtypes)
            variant.out_plain = [k is not None and is_plain(k) for k in keys]
        arrays = iter(outs)
        static = variant.static_outs
        user = self.user_outputs
        # Only the graph's own outputs become tensors; the values of mutated inputs are written
        # into those inputs (a compiled optimizer step has dozens and no output of its own).
        results = [
            fresh_with_key(next(arrays), index, k, plain) if k is not None else static[i]
            for i, (k, plain) in enumerate(zip(keys[:user], variant.out_plain[:user]))
        ]
        if self.mutated_inputs:
            for position, new, key in zip(self.mutated_inputs, outs[-len(self.mutated_inputs) :], keys[user:]):
                _write_input(args[position], new, index, key)
        if deferred and config.get("TPUREC_FUSED_COMPILED_GRAPHS") == "dispatch":
            # Not a wait: the window's program is enqueued and runs while Python goes on.
            core.flush("compiled graph")
        return results

    def _inputs(self, args: Sequence[Any], deferred: bool = False):
        """Runtime values: jax arrays for tensors, Python numbers as they are; and the shape signature.

        ``deferred`` (fused mode): a tensor whose value is still pending in the fused
        window stays pending (no sync point); the graph is recorded behind it.
        """
        inputs, signature = [], []
        index = self.device_index
        for a in args:
            if isinstance(a, TpuTensor):
                index = a._storage.index
                v = pending_value(a) if deferred else value_of(a)
                inputs.append(v)
                signature.append((tuple(v.shape), v.dtype))
            elif isinstance(a, torch.Tensor):
                v = host_to_jax(a, jax_device(index))
                inputs.append(v)
                signature.append((tuple(v.shape), v.dtype, "host"))
            elif isinstance(a, (torch.SymInt, torch.SymFloat, torch.SymBool)):
                raise CompileError(f"{self.name}: a symbolic input reached the compiled program: {a}")
            else:
                # SymInt placeholders arrive as ints: sizes, so part of the program.
                inputs.append(a)
                signature.append(("scalar", a))
        return inputs, tuple(signature), index

    def _build(self, signature: tuple, settings: tuple = ()) -> _Variant:
        if self.variants:
            last_signature, last_settings = list(self.variants)[-1]
            log.warning(
                "tpurec.compile: recompiling %s (variant %d): %s",
                self.name,
                len(self.variants) + 1,
                f"a dynamic dim took a new value: {_changes(last_signature, signature)}"
                if last_signature != signature
                else f"a setting that changes programs changed: {_setting_changes(last_settings, settings)}",
            )
        _count_build()
        program = self.program
        statics = {i: s[1] for i, s in enumerate(signature) if s[0] == "scalar"}

        variant = _Variant()
        variant.origin = ("graph", self, signature)
        tensor_out = self.tensor_out

        def run(arrays, scalars, seeds):
            it = iter(arrays)
            inputs = [statics[i] if i in statics else next(it) for i in range(len(signature))]
            outs = program.trace(inputs, scalars, seeds)
            variant.static_outs = {i: o for i, (o, t) in enumerate(zip(outs, tensor_out)) if not t}
            return [o for o, t in zip(outs, tensor_out) if t]

        options = {}
        if not any(s[0] != "scalar" for s in signature):
            options["out_shardings"] = jax.sharding.SingleDeviceSharding(jax_device(self.device_index))
        variant.run = run
        # Global (mesh) inputs would make XLA partition this program: trace it as such
        # once they may exist (variant.recorded, in fused mode, is a Program that knows).
        variant.jitted = jax.jit(traced_as_spmd(run) if core.mesh_arrays_exist() else run, **options)
        return variant

    def _record(self, variant: _Variant, inputs: list, seeds: list, index: int) -> list:
        """Adds the graph to the fused window (fused mode); its outputs are pending values.

        The forward graph, the eager ops around it (loss, optimizer) and the backward
        graph then run as one XLA program at the next sync point, as in fused mode.
        """
        arrays = [v for v in inputs if not isinstance(v, (int, float, bool))]
        if variant.recorded is None:
            constants = len(self.program.constants)
            run = variant.run
            array_count = len(arrays)

            def raw(*flat):
                # (arrays..., graph constants..., seed triples...), all runtime values.
                graph_arrays = list(flat[:array_count])
                scalars = list(flat[array_count : array_count + constants])
                rest = flat[array_count + constants :]
                triples = [tuple(rest[k : k + 3]) for k in range(0, len(rest), 3)]
                return run(graph_arrays, scalars, triples)

            variant.recorded = core.Program(raw)
            variant.recorded.origin = variant.origin
        flat_seeds = [x for triple in seeds for x in triple]
        counters = core.counters()
        counters.ops_by_name[f"compiled {self.name.split('#')[0]} graph"] += 1
        return core.record_in_fused_window(variant.recorded, (*arrays, *self.program.constants, *flat_seeds), index)

    def _execute(self, variant: _Variant, inputs: list, seeds: list) -> list:
        counters = core.counters()
        counters.executions += 1
        arrays = [v for v in inputs if not isinstance(v, (int, float, bool))]
        if core.execution_stubbed():
            assert variant.run is not None  # set by _build
            return core.run_stub(variant, variant.run, {}, (arrays, self.program.constants, seeds))
        if variant.ran:
            variant.reused = True  # ran twice: its family is warm (recompilation diagnostics)
            with core.profiler_range(f"tpurec::execute {core.program_label(variant.origin)}"):  # profiler hook
                return variant.jitted(arrays, self.program.constants, seeds)
        start = time.perf_counter()
        try:
            with core.compiling(variant):  # tpurec hook: compile range + recompilation diagnostics
                return variant.jitted(arrays, self.program.constants, seeds)
        except CompileError:
            raise
        except Exception as e:
            ops = ", ".join(self.program.ops())
            raise CompileError(
                f"tpurec: XLA failed to compile {self.name} (ops: {ops}): {type(e).__name__}: {e}"
            ) from e
        finally:
            variant.ran = True
            counters.compile_seconds += time.perf_counter() - start


# --- the calling plan of a repeated call --------------------------------------

_FULL, _VIEW, _SCALAR = 0, 1, 2


class _Plan:
    """How a call with given input metadata runs: its variant and, per input, how to take its value.

    Dynamo's guards already hold the user's inputs to the shapes traced, and AOTAutograd
    calls a graph with the same kinds of values each step: so the inputs of a call are
    compared with the last call's (the ``TpuTensor._key`` of each tensor, usually the very
    same object; the value of each Python number) and, when they all match, taken without
    working out the shape signature again. Anything else (a CPU tensor input, new metadata,
    a changed setting) takes :meth:`CompiledGraph._inputs`'s full path.
    """

    __slots__ = ("variant", "settings", "inputs")

    def __init__(self, variant: _Variant, settings: tuple, inputs: tuple) -> None:
        self.variant = variant
        self.settings = settings
        self.inputs = inputs  # per input: (kind, key or number)

    @classmethod
    def of(cls, variant: _Variant, settings: tuple, args: Sequence[Any]) -> _Plan | None:
        """The plan for calls like ``args``; None where a value needs the full path each call."""
        inputs = []
        for a in args:
            if isinstance(a, TpuTensor):
                inputs.append((_FULL if a.is_full else _VIEW, a._key))
            elif type(a) in (int, float, bool):
                inputs.append((_SCALAR, a))
            else:
                return None
        return cls(variant, settings, tuple(inputs))


def _gather(plan: _Plan, args: Sequence[Any], deferred: bool, index: int):
    """``(inputs, device index)`` of a call that matches ``plan``, else None (the full path).

    Takes the values as :meth:`CompiledGraph._inputs` does: a whole-storage tensor gives its
    storage's array (pending in fused mode), a view its values read by the read program.
    """
    if len(args) != len(plan.inputs):
        return None
    inputs = []
    put = inputs.append
    for a, (kind, expected) in zip(args, plan.inputs):
        if kind == _SCALAR:
            if type(a) is not type(expected) or a != expected:
                return None
            put(a)
            continue
        if not isinstance(a, TpuTensor):
            return None
        key = a._key
        if key is not expected and key != expected:
            return None
        storage = a._storage
        index = storage.index
        if kind == _FULL:
            array = storage.array
            put(value_of(a) if not deferred and type(array) is Pending else array)
        else:
            put(pending_value(a) if deferred else value_of(a))
    return inputs, index


def _write_input(t: Any, new: Any, index: int, key: tuple) -> None:
    """Writes a mutated graph input's new value (``new``, shaped and typed like ``t``) into ``t``.

    A whole-storage tensor gets the array as its storage's (as an eager in-place op stores
    its result; in fused mode the old array becomes a donation candidate); a view is
    written through the eager ``copy_`` (AOTAutograd's own epilogue, which counts the
    version as well). AOTAutograd keeps only mutations autograd need not see in the graph
    and bumps the inputs' versions itself.
    """
    if isinstance(t, TpuTensor) and t.is_full:
        store_array(t._storage, new)
        return
    with torch.no_grad():
        t.copy_(fresh_with_key(new, index, key))


def _output_keys(outs: Sequence[Any], tensor_out: list[bool], dtypes: list) -> list:
    """Per graph output, the ``TpuTensor._key`` of a fresh contiguous tensor over it (None: static)."""
    keys: list = []
    arrays = iter(outs)
    for is_tensor, dtype in zip(tensor_out, dtypes):
        if not is_tensor:
            keys.append(None)
            continue
        shape = tuple(next(arrays).shape)
        keys.append((shape, dtype, shape, contiguous_strides(shape), 0, dtype))
    return keys


def _changes(old: tuple, new: tuple) -> str:
    """Which inputs changed between two shape signatures, e.g. "input 2: 8 -> 16"."""

    def show(s):
        return s[1] if s[0] == "scalar" else s[0]

    diffs = [f"input {i}: {show(a)} -> {show(b)}" for i, (a, b) in enumerate(zip(old, new)) if a != b]
    return "; ".join(diffs) or "input signature changed"


def _setting_changes(old: tuple, new: tuple) -> str:
    """Which flags of ``tpurec.config.program_settings()`` differ, e.g. "TPUREC_NATIVE_MATMUL: True -> False"."""
    names = [f.name for f in config.FLAGS if f.programs]
    return "; ".join(f"{n}: {a} -> {b}" for n, a, b in zip(names, old, new) if a != b) or "settings changed"


def _example_device(example_inputs) -> int:
    for x in example_inputs:
        if isinstance(x, torch.Tensor) and x.device.type == "tpu":
            return x.device.index or 0
    return torch.tpu.current_device()


def compile_graph(name: str) -> Callable:
    """An AOTAutograd compiler (fw_compiler / bw_compiler) producing :class:`CompiledGraph`."""

    def compiler(gm: torch.fx.GraphModule, example_inputs):
        return CompiledGraph(gm, example_inputs, name)

    return compiler


# --- decompositions ---------------------------------------------------------------


def decompositions() -> dict:
    """PyTorch's decompositions, minus every op we lower ourselves.

    Our own lowering of an op is preferred: it is what eager runs, so compiled
    and eager results agree, and it is usually one fused XLA op. The core ATen
    set is taken first, then the rest of ``torch._decomp``'s table, which eager
    falls back to as well (an op eager runs through a decomposition must not
    fail compiled).
    """
    from torch._decomp import core_aten_decompositions, decomposition_table

    from tpurec.compile.graph import handled_without_lowering
    from tpurec.dense.registry import TABLE, Kind

    table = {op: fn for op, fn in decomposition_table.items() if isinstance(op, torch._ops.OpOverload)}
    table.update(core_aten_decompositions())
    # The COMPOSITE entries (tpurec.dense.composites and the families' own, all loaded with tpurec.dense).
    table.update({op: composite.fn for op, composite in TABLE[Kind.COMPOSITE].items()})
    return {op: fn for op, fn in table.items() if get_lowering(op) is None and not handled_without_lowering(op)}


_backend = None


def _is_collective(node: torch.fx.Node) -> bool:
    """A call of a functional collective (``_c10d_functional`` / ``_c10d_functional_autograd`` ops)."""
    target = node.target
    if node.op != "call_function" or not isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        return False
    return str(target).startswith("_c10d_functional")  # "_c10d_functional.all_reduce.default", ...


class _CompiledOnFirstCall(torch.nn.Module):
    """A piece of a graph between collectives, compiled by the tpu backend with its first real inputs."""

    def __init__(self, piece: torch.fx.GraphModule) -> None:
        super().__init__()
        # AOTAutograd takes graphs that return a tuple; split_module's pieces return a lone value bare.
        output = next(n for n in reversed(piece.graph.nodes) if n.op == "output")
        self._single = not isinstance(output.args[0], (tuple, list))
        if self._single:
            output.args = ((output.args[0],),)
            piece.recompile()
        self.piece = piece
        self._compiled: Callable | None = None

    def forward(self, *args):
        if self._compiled is None:
            self._compiled = _compile_whole(self.piece, list(args))
        outs = self._compiled(*args)
        return outs[0] if self._single else outs


def _split_at_collectives(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """``gm`` cut into compiled pieces with the functional collectives between them, run eagerly.

    A collective spans the processes: each process's compiled program runs on its own device, so
    the collective runs between two programs, as the same XLA collective eager mode runs (through
    the tpu process group). The pieces are compiled on their first call.
    """
    from torch.fx.passes.split_module import split_module

    parts: dict[str, int] = {}
    part, previous = 0, None
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        kind = _is_collective(node)
        if previous is not None and (kind or previous):
            part += 1
        parts[node.name] = part
        previous = kind
    split = split_module(gm, gm, lambda node: parts[node.name], keep_original_order=True)
    collective_parts = {parts[n.name] for n in gm.graph.nodes if n.name in parts and _is_collective(n)}
    for name, piece in list(split.named_children()):
        if int(name.removeprefix("submod_")) not in collective_parts and isinstance(piece, torch.fx.GraphModule):
            setattr(split, name, _CompiledOnFirstCall(piece))
    return split


def tpu_backend(gm: torch.fx.GraphModule, example_inputs):
    """The Dynamo backend ``"tpu"`` (``torch.compile(model, backend="tpu")``)."""
    if any(_is_collective(node) for node in gm.graph.nodes):
        return _split_at_collectives(gm)
    return _compile_whole(gm, example_inputs)


def _compile_whole(gm: torch.fx.GraphModule, example_inputs):
    global _backend
    if _backend is None:
        from torch._dynamo.backends.common import aot_autograd

        _backend = aot_autograd(
            fw_compiler=compile_graph("forward"),
            bw_compiler=compile_graph("backward"),
            inference_compiler=compile_graph("inference"),
            decompositions=decompositions(),
            # Input mutations (an optimizer's step, batch norm's running statistics) stay in
            # the graph: the call stores their new values (_write_input) instead of
            # AOTAutograd's epilogue running one eager copy_ per mutated input.
            keep_inference_input_mutations=True,
            # The small saved activations travel to the backward packed (tpurec/compile/saved.py).
            partition_fn=saved.partition,
        )
    return _backend(gm, example_inputs)
