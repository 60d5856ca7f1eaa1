"""A training pipeline that hides host work behind the device step.

:class:`TrainPipeline` is a TorchRec ``torchrec.distributed.train_pipeline.TrainPipeline``
with ``progress(dataloader_iter)`` as in TorchRec's ``TrainPipelineBase``: each call runs one
training step and returns the model's output. While the device runs step
``i``, a background thread reads batch ``i + 1`` from the iterator and
worker threads (``workers``) preprocess its KeyedJaggedTensors into SparseCore CSR for every tpurec
:class:`~tpurec.sparse.EmbeddingBagCollection` of the model (any module with
its ``prefetch(kjt)`` / ``clear_prefetched()`` / ``feature_names`` protocol,
e.g. the sharded collections of ``tpurec.shard``, which route the ids to their
shards), and starts the host-to-device transfer of its tensors and CSR arrays
(for a sharded model, straight onto its mesh, split along the batch dim). The
loop waits on the host only when the data is late.

The model follows TorchRec's training-module convention: ``model(batch)``
returns ``(losses, output)`` (for example ``torchrec.models.dlrm.DLRMTrain``
over a ``torchrec.datasets.utils.Batch``). Batches may be tensors,
KeyedJaggedTensors, dataclasses, tuples, lists and dicts of them; tensors move
to ``device``, KeyedJaggedTensors stay on the host (their CSR moves instead).

Example::

    from torchrec.models.dlrm import DLRM, DLRMTrain
    model = sparse.from_torchrec(DLRMTrain(DLRM(...)), capacities=sparse.Capacity(4096)).to("tpu")
    pipeline = sparse.TrainPipeline(model, torch.optim.Adagrad(dense_params), torch.device("tpu"))
    batches = iter(loader)
    while True:
        try:
            loss, logits, labels = pipeline.progress(batches)
        except StopIteration:
            break
        for step, value in pipeline.losses():  # read one step behind: no wait on the device
            print(step, value)

The pipeline reads each step's loss itself, one call behind the step it issues: the host runs
ahead of the device by one call, never waits on the step it just issued, and a loss that is not
finite raises ``FloatingPointError`` naming its step. With ``graphed=True, steps_per_call=K`` a
call runs K captured steps in one program (one launch), and :meth:`TrainPipeline.losses` still
gives every step's loss.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import queue
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Generic, Iterator, TypeVar

import numpy as np
import torch
from torchrec.distributed.train_pipeline import TrainPipeline as TorchRecTrainPipeline
from torchrec.distributed.train_pipeline.types import PipelineState
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from tpurec import core
from tpurec.sparse.managed import remapped_features
from tpurec.sparse.mesh_batches import OnDevice as _OnDevice  # started by the worker thread, wrapped on the main one
from tpurec.sparse.mesh_batches import Prefetching, batch_sharded_array, local_device_count, map_batch, mesh_of

__all__ = ["TrainPipeline", "map_batch"]

In = TypeVar("In")
Out = TypeVar("Out")


@dataclasses.dataclass
class _Failure:
    error: BaseException


_END = object()


class _Renewed(Exception):
    """A batch staged for a launch of several steps made new static tensors: the capture cannot read them."""


# TorchRec bounds its batch type by Pipelineable (has .to); batches here may also be
# dicts, tuples and lists of tensors and KJTs, so In is unbounded.
class TrainPipeline(TorchRecTrainPipeline[Any, Out], Generic[In, Out]):
    """Overlaps reading, preprocessing and transferring batch ``i + 1`` with step ``i``.

    A TorchRec ``torchrec.distributed.train_pipeline.TrainPipeline``: code written
    for TorchRec's pipelines (``while True: pipeline.progress(it)`` until
    ``StopIteration``, ``reset()``, the ``_state`` it reports) runs on it unchanged.
    Works in every tpurec mode (eager, fused, debug) and with
    ``torch.compile(..., backend="tpu")`` models: the step itself is the
    caller's model and optimizer, unchanged; only where its input comes from
    changes. Losses equal those of the plain loop over the same batches.

    Args:
        model: ``model(batch) -> (losses, output)``; ``losses`` are summed and
            back-propagated when the model is in training mode.
        optimizer: the dense optimizer (embedding tables update in the backward).
        device: where tensors of a batch go (``"tpu"``, ``"tpu:N"`` or ``"cpu"``).
        prefetch: batches prepared ahead of the running step (>= 1).
        workers: threads that preprocess and transfer batches (>= 1). One thread reads the
            iterator, in order; with several workers, batches ``i + 1``, ``i + 2``... are
            prepared at the same time (the native preprocessing and the transfers run outside
            Python's GIL) and handed to the steps in the iterator's order, so a batch's host work
            may take up to ``workers`` steps' time without the device waiting. At least this
            many batches are prepared ahead. (With automatic capacities, a batch that grows them
            may do so while the batch before it is still being prepared, which then takes the
            grown capacities too: the step that compiles for them can be one earlier.)
        graphed: capture the step with :func:`tpurec.graph` and replay it (device ``tpu``; fused
            mode is used for the steps whatever the current mode): the first two steps run as
            usual, the third is captured, and from then on a step copies the batch into static
            tensors (made from the first batch; a batch of other shapes, such as a short last
            one, runs uncaptured), stages its KJTs (``stage()`` of tpurec's
            ``EmbeddingBagCollection`` and of the sharded collections of :func:`tpurec.shard`,
            for one process or several) and calls ``replay()``, with no Python of the
            model, autograd or the optimizer. ``progress`` then returns the same output tensors
            at every step, holding the latest step's values (as with CUDA graphs: ``clone()``
            what must outlive the next step). A step in the other of train and eval mode than
            the captured one's runs uncaptured. The capture raises where the step cannot be
            replayed exactly (see :func:`tpurec.graph`); the step ran in full, and the pipeline
            goes on uncaptured.
        steps_per_call: with ``graphed``, the captured steps a call of :meth:`progress` runs in
            one program (:meth:`tpurec.TpuGraph.replay_steps`: one launch, the results of as many
            single replays bit for bit). A call then runs up to this many steps: fewer where the
            iterator ends, a batch of other shapes comes (that batch runs uncaptured on the next
            call) or ``max_steps`` says so; the steps before the capture run one per call.
            ``progress`` returns the output of the call's last step; :meth:`losses` gives the loss
            of every step and :attr:`steps` counts them. At least this many batches are prepared
            ahead.
        compile_in_background: with ``steps_per_call``, compile the program of several steps on a
            background thread while the first calls run their steps as single replays (the same
            results), so that the job does not stop for the compiler; :meth:`wait_for_compiles`
            waits for it. False: the first launch compiles it and waits.
        check_finite: raise ``FloatingPointError`` naming the step when a step's loss, as read,
            is not finite (nan or inf).

    Raises:
        ValueError: ``prefetch``, ``workers`` or ``steps_per_call`` below 1; ``graphed`` with a device other
            than ``tpu`` or a collection that cannot stage its input (one without a ``stage``
            method); ``steps_per_call`` above 1 without ``graphed``, or for a model sharded over
            a mesh.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        device: torch.device | str,
        *,
        prefetch: int = 1,
        workers: int = 2,
        graphed: bool = False,
        steps_per_call: int = 1,
        compile_in_background: bool = True,
        check_finite: bool = True,
    ) -> None:
        if prefetch < 1:
            raise ValueError(f"prefetch must be >= 1 (batches prepared ahead), got {prefetch}")
        if workers < 1:
            raise ValueError(f"workers must be >= 1 (threads preparing batches), got {workers}")
        if steps_per_call < 1:
            raise ValueError(f"steps_per_call must be >= 1, got {steps_per_call}")
        if steps_per_call > 1 and not graphed:
            raise ValueError(
                f"steps_per_call={steps_per_call} runs several captured steps in one program: it needs graphed=True"
            )
        super().__init__()  # TorchRec's pipeline state (IDLE)
        self._model = model
        self._optimizer = optimizer
        self._device = torch.device(device)
        self._prefetch = max(prefetch, steps_per_call, workers)
        self._workers = workers
        self._steps_per_call = steps_per_call
        self._compile_in_background = compile_in_background
        self._check_finite = check_finite
        # Embedding modules that can take a batch's KJT ahead of time: tpurec's
        # EmbeddingBagCollection, or any module with the same prefetch /
        # clear_prefetched / feature_names protocol (mesh_batches.Prefetching; e.g. a sharded collection).
        # A collection behind a managed-collision remap (tpurec.sparse.managed) looks up ids
        # remapped in the step itself, after the previous step's evictions: none ahead of time.
        remapped = remapped_features(model)
        self._collections = [
            m for m in model.modules() if isinstance(m, Prefetching) and not set(m.feature_names) & remapped
        ]
        # A model sharded by tpurec.shard: its batch tensors go straight to the
        # mesh, split along the batch dim, as the model's own input hook would
        # place them (not to one device first and then over the mesh).
        # The sharded collections say which mesh (the OnMesh protocol); nothing set on
        # the user's model is read.
        self._mesh = mesh_of(model) if self._device.type == "tpu" else None
        if self._mesh is not None:
            self._local_devices = local_device_count(self._mesh)
            if steps_per_call > 1:
                raise ValueError(
                    "steps_per_call > 1 is not available for a model sharded over a mesh (tpurec.shard): "
                    "use steps_per_call=1"
                )
        if graphed:
            unstaged = [type(m).__name__ for m in self._collections if not hasattr(m, "stage")]
            if self._device.type != "tpu" or unstaged:
                why = (
                    f"the device is {self._device}"
                    if self._device.type != "tpu"
                    else f"the collections {unstaged} cannot stage their input"
                )
                raise ValueError(
                    f"TrainPipeline(graphed=True) captures a model on the tpu device, but {why}; use graphed=False"
                )
        # graphed: the capture, its step count, the static batch tensors and the captured output.
        self._graph = core.TpuGraph() if graphed else None
        self._graph_calls = 0
        self._graph_generations: list[int] = []  # each staged collection's staged_generation at the capture
        self._statics: list[torch.Tensor] | None = None
        self._graph_output: Any = None
        self._graph_training = True  # whether the captured step trained (else: a forward only)
        self._graph_loss: torch.Tensor | None = None  # the captured step's loss tensor
        # Losses: steps issued, (first step, values not read yet, how many steps) per call issued,
        # and the (step, loss) pairs read and not yet handed out by losses().
        self._steps = 0
        self._unread: collections.deque = collections.deque()
        self._read: list[tuple[int, float]] = []
        self._held: Any = None  # a batch taken from the queue for a launch it could not join
        self._queue: queue.Queue | None = None
        self._worker: threading.Thread | None = None
        self._iterator: Iterator[In] | None = None
        self._stop = threading.Event()
        self._exhausted = False

    # --- worker thread --------------------------------------------------------------

    def _to_device(self, t: torch.Tensor) -> Any:
        if self._device.type != "tpu":
            return t.to(self._device, non_blocking=True)
        from tpurec.core import host_array, host_to_jax, jax_device

        if t.device.type != "cpu":
            return t  # already on a device: the step moves it if needed
        if self._mesh is not None and t.dim() > 0 and t.shape[0] % self._local_devices == 0:
            # Global arrays are wrapped on tpu:0, as tpurec.shard's input hook does.
            return _OnDevice(batch_sharded_array(host_array(t), self._mesh), 0, t.dtype)
        index = self._device.index if self._device.index is not None else torch.tpu.current_device()
        return _OnDevice(host_to_jax(t, jax_device(index)), index, t.dtype)  # starts the async copy

    def _collections_of(self, kjt: KeyedJaggedTensor) -> list:
        keys = set(kjt.keys())
        return [ebc for ebc in self._collections if ebc.feature_names and set(ebc.feature_names) == keys]

    def _prefetch_kjt(self, kjt: KeyedJaggedTensor) -> KeyedJaggedTensor:
        for ebc in self._collections_of(kjt):
            ebc.prefetch(kjt)
        return kjt

    def _prepare(self, batch: Any) -> Any:
        """``batch`` with its tensors moving to the device and its KJTs prefetched (or a _Failure)."""
        try:
            return map_batch(batch, self._to_device, self._prefetch_kjt)
        except BaseException as e:  # handed to the main thread, raised by progress()
            return _Failure(e)

    def _work(self, iterator: Iterator[In], out: queue.Queue) -> None:
        """Reads the iterator in order; prepares each batch here (one worker) or on the pool."""
        pool = (
            ThreadPoolExecutor(self._workers, thread_name_prefix="tpurec-train-pipeline-prepare")
            if self._workers > 1
            else None
        )
        try:
            while not self._stop.is_set():
                try:
                    batch = next(iterator)
                    item: Any = self._prepare(batch) if pool is None else pool.submit(self._prepare, batch)
                except StopIteration:
                    item = _END
                except BaseException as e:  # handed to the main thread, raised by progress()
                    item = _Failure(e)
                while not self._stop.is_set():
                    try:
                        out.put(item, timeout=0.1)
                        break
                    except queue.Full:
                        continue
                if item is _END or isinstance(item, _Failure):
                    return
        finally:
            if pool is not None:
                # Stopped: batches not started are dropped. Either way the ones being prepared finish
                # first, so nothing is prefetched into a collection after this thread ends.
                pool.shutdown(wait=True, cancel_futures=self._stop.is_set())

    def _connect(self, dataloader_iter: Iterator[In]) -> None:
        self.close()
        self._stop = threading.Event()
        self._iterator = dataloader_iter
        self._exhausted = False
        self._queue = queue.Queue(maxsize=self._prefetch)
        self._worker = threading.Thread(
            target=self._work, args=(dataloader_iter, self._queue), name="tpurec-train-pipeline", daemon=True
        )
        self._worker.start()

    # --- public API -----------------------------------------------------------------

    @property
    def steps(self) -> int:
        """How many steps the pipeline issued since it was made (the next step's index)."""
        return self._steps

    def losses(self, wait: bool = False) -> list[tuple[int, float]]:
        """The (step index, loss) of every step whose loss was read since the last call, in order.

        :meth:`progress` reads the losses of the steps issued by its previous call, so this is
        one call behind without waiting for the device. A step's loss is the sum of the losses
        its model returned (what the backward ran on).

        Args:
            wait: first wait for every step issued and read its loss (a sync point: before a
                checkpoint, an evaluation, or at the end).

        Raises:
            FloatingPointError: (``check_finite``) a loss read now is not finite; the message names
                its step, and the error's ``step`` and ``loss`` attributes hold them. The losses of
                the steps before it are kept for the next call.
            Exception: an error of the device surfaced while waiting for a step, with a note
                naming the steps.
        """
        if wait:
            self._read_losses(keep=0)
        read, self._read = self._read, []
        return read

    def wait_for_compiles(self, timeout: float | None = None) -> bool:
        """Waits for the programs of several steps compiled in the background (``compile_in_background``).

        Args:
            timeout: seconds to wait at most (None: until they are compiled).

        Returns:
            Whether every one is compiled.
        """
        return self._graph is None or self._graph.wait_for_compiles(timeout)

    def progress(self, dataloader_iter: Iterator[In], *, max_steps: int | None = None) -> Out:
        """Runs one training step on the next batch of ``dataloader_iter`` (with
        ``steps_per_call``, up to that many steps).

        TorchRec's contract: one step per call (unless ``steps_per_call`` says more), the
        model's output returned, ``StopIteration`` once the iterator is exhausted (and on every
        call after, until a new iterator or :meth:`reset`). The first call (or a call with a
        new iterator) starts the worker that prepares batches ahead. Before returning, the call
        reads the losses of the steps its previous call issued (see :meth:`losses`); at the end
        of the iterator, all of them.

        In fused mode the step is dispatched as one program at the end of the
        call (asynchronously: reading a value of the output waits for it).

        Args:
            max_steps: with ``steps_per_call``, at most this many steps in this call (to stop at
                a checkpoint or an evaluation).

        Returns:
            The model's output for this step (the call's last step).

        Raises:
            StopIteration: the iterator is exhausted.
            FloatingPointError: (``check_finite``) the loss of a step read here is not finite.
            Exception: what the iterator raised (with a note naming the step it was to feed).
        """
        if max_steps is not None and max_steps < 1:
            raise ValueError(f"max_steps must be >= 1, got {max_steps}")
        self._state = PipelineState.IDLE
        if self._iterator is not dataloader_iter or self._queue is None:
            self._connect(dataloader_iter)
        if self._exhausted:
            self._read_losses(keep=0)
            raise StopIteration
        item = self._next_item()
        if item is _END:
            self._exhausted = True
            self._read_losses(keep=0)
            raise StopIteration
        if isinstance(item, _Failure):
            self._exhausted = True
            # The batches read after it (prepared by other workers meanwhile) are dropped.
            self._stop_worker()
            item.error.add_note(f"tpurec TrainPipeline: raised by the iterator for the batch of step {self._steps}")
            raise item.error

        first = self._steps
        try:
            if self._graph is not None:
                output = self._graphed_call(item, min(self._steps_per_call, max_steps or self._steps_per_call))
            else:
                loss, output = self._step(self._as_batch(item))
                self._issued(loss, 1)
        except Exception as error:
            error.add_note(f"tpurec TrainPipeline: raised by step {first}")
            raise
        self._read_losses(keep=1)
        return output

    def _next_item(self) -> Any:
        """The next prepared batch (or _END, or a _Failure): one held back by a launch first."""
        if self._held is not None:
            item, self._held = self._held, None
            return item
        assert self._queue is not None
        item = self._queue.get()
        return item.result() if isinstance(item, Future) else item

    # --- losses, read behind the device ------------------------------------------------

    def _issued(self, loss: torch.Tensor, count: int) -> None:
        """Notes the loss (one value, or ``count`` stacked) of the ``count`` steps just issued."""
        from tpurec.core import TpuTensor

        # A tpu loss's values as they are now (the array, no copy): a replay refills the captured loss tensor.
        values: Any = loss.to_jax() if isinstance(loss, TpuTensor) else loss.detach()
        self._unread.append((self._steps, values, count))
        self._steps += count

    def _read_losses(self, keep: int) -> None:
        """Reads the losses of all calls issued but the last ``keep``, waiting for them."""
        while len(self._unread) > keep:
            first, values, count = self._unread[0]
            try:
                read = np.asarray(values).reshape(-1).tolist() if count > 1 else [float(np.asarray(values))]
            except Exception as error:
                self._unread.popleft()
                steps = f"step {first}" if count == 1 else f"steps {first} to {first + count - 1}"
                error.add_note(f"tpurec TrainPipeline: raised while waiting for the loss of {steps}")
                raise
            self._unread.popleft()
            for step, value in enumerate(read, start=first):
                if self._check_finite and not math.isfinite(value):
                    error = FloatingPointError(
                        f"tpurec TrainPipeline: the loss of step {step} is {value}. Steps after it may have run "
                        "already (the pipeline reads losses one call behind); pass check_finite=False to go on"
                    )
                    error.step, error.loss = step, value  # type: ignore[attr-defined]  # for a caller's own report
                    raise error
                self._read.append((step, value))

    # --- the steps ---------------------------------------------------------------------

    def _step(self, batch: Any, flush: bool = True) -> tuple[torch.Tensor, Out]:
        """One plain step: its summed loss and the model's output."""
        training = self._model.training
        if training:
            self._optimizer.zero_grad()
        self._state = PipelineState.CALL_FWD
        losses, output = self._model(batch)
        loss = torch.sum(losses, dim=0) if losses.dim() else losses
        if training:
            self._state = PipelineState.CALL_BWD
            loss.backward()
            self._optimizer.step()
        if flush and self._device.type == "tpu" and core.get_mode() == "fused":
            # The step's recorded ops go out now as one program, without
            # waiting for it: the host moves on to the next batch while the
            # device runs, and every step is the same (cached) program even
            # if the caller reads no value.
            core.flush("step")
        return loss.detach(), output  # _state stays at the last phase reached, as in TorchRec's pipelines

    def _as_batch(self, item: Any) -> Any:
        from tpurec.core import wrap

        return map_batch(
            item, lambda t: wrap(t.array, t.index, t.dtype) if isinstance(t, _OnDevice) else t, lambda k: k
        )

    def _fill_statics(self, item: Any) -> tuple[bool, list[KeyedJaggedTensor]]:
        """Writes ``item``'s tensors into the static batch tensors (made from the first batch).

        Returns whether it could (False: the item's shapes are not the static ones, nothing
        written), and the item's KJTs.
        """
        from tpurec.core import replace_array, wrap

        leaves: list = []
        kjts: list[KeyedJaggedTensor] = []
        map_batch(item, leaves.append, kjts.append)
        if self._statics is None:
            self._statics = [
                wrap(t.array, t.index, t.dtype) if isinstance(t, _OnDevice) else t.to(self._device).clone()
                for t in leaves
            ]
            return True, kjts
        statics = self._statics
        if len(leaves) != len(statics) or any(
            tuple(s.shape) != tuple(t.array.shape if isinstance(t, _OnDevice) else t.shape) or s.dtype != t.dtype
            for s, t in zip(statics, leaves)
        ):
            return False, kjts
        for s, t in zip(statics, leaves):
            replace_array(s, t.array) if isinstance(t, _OnDevice) else s.copy_(t)
        return True, kjts

    def _stage(self, kjts: list[KeyedJaggedTensor]) -> list[int]:
        """Stages the KJTs into their collections' static CSR tensors; their staged generations."""
        staged = []
        for kjt in kjts:
            for ebc in self._collections_of(kjt):
                ebc.stage(kjt)  # takes what the worker prefetched
                staged.append(ebc.staged_generation)
        return staged

    def _graphed_call(self, item: Any, steps: int) -> Out:
        """One call of ``graphed=True``: a launch of up to ``steps`` captured steps, or one step."""
        graph = self._graph
        assert graph is not None
        launch = steps > 1 and graph.captured and self._model.training == self._graph_training
        if not launch or not self._regular(item):
            return self._graphed_step(item)
        items = [item]
        while len(items) < steps:
            nxt = self._next_item()
            if nxt is _END or isinstance(nxt, _Failure) or not self._regular(nxt):
                self._held = nxt  # the next call's (it ends the iterator, raises, or runs uncaptured)
                break
            items.append(nxt)
        if len(items) == 1:
            return self._graphed_step(item)

        def fill(i: int) -> None:
            self._fill_statics(items[i])
            if self._stage(self._kjts(items[i])) != self._graph_generations:
                raise _Renewed

        try:
            with core.mode("fused"):
                assert self._graph_loss is not None
                (series,) = graph.replay_steps(
                    fill=fill,
                    steps=len(items),
                    collect=[self._graph_loss],
                    compile_in_background=self._compile_in_background,
                )
        except _Renewed:
            # A batch made new static CSR tensors (automatic capacities grew): nothing ran. The
            # steps run one by one, which captures the step again over the new tensors.
            output = self._graphed_step(items[0])
            for one in items[1:]:
                output = self._graphed_step(one)
            return output
        self._state = PipelineState.CALL_BWD if self._graph_training else PipelineState.CALL_FWD
        self._issued(series, len(items))
        return self._graph_output

    def _kjts(self, item: Any) -> list[KeyedJaggedTensor]:
        kjts: list[KeyedJaggedTensor] = []
        map_batch(item, lambda t: t, kjts.append)
        return kjts

    def _regular(self, item: Any) -> bool:
        """Whether ``item``'s tensors have the static tensors' shapes and dtypes (a captured step can take it)."""
        leaves: list = []
        map_batch(item, leaves.append, lambda k: k)
        statics = self._statics
        return (
            statics is not None
            and len(leaves) == len(statics)
            and all(
                tuple(s.shape) == tuple(t.array.shape if isinstance(t, _OnDevice) else t.shape) and s.dtype == t.dtype
                for s, t in zip(statics, leaves)
            )
        )

    def _graphed_step(self, item: Any) -> Out:
        """One step of ``graphed=True``: the batch into the static tensors, then a plain step, the
        capture or a replay."""
        regular, kjts = self._fill_statics(item)
        if not regular:
            # Not the static shapes (a short last batch): an uncaptured step on the batch as it
            # came, its KJTs as the worker prefetched them; the static tensors and the capture stay.
            with core.mode("fused"):
                loss, output = self._step(self._as_batch(item))
            self._issued(loss, 1)
            return output
        staged = self._stage(kjts)
        it = iter(self._statics or ())
        batch = map_batch(item, lambda _: next(it), lambda k: k)
        graph = self._graph
        assert graph is not None
        if graph.captured and staged != self._graph_generations:
            # stage() made new CSR tensors (automatic capacities grew): the capture read the old
            # ones. This step runs uncaptured (warm for the new shapes), the next is captured.
            graph = self._graph = core.TpuGraph()
            self._graph_calls = 1
        with core.mode("fused"):
            if graph.captured and self._model.training == self._graph_training:
                graph.replay()
                self._state = PipelineState.CALL_BWD if self._graph_training else PipelineState.CALL_FWD
                assert self._graph_loss is not None
                self._issued(self._graph_loss, 1)
                return self._graph_output
            if graph.captured:  # the other of train/eval mode than the captured step's: run it uncaptured
                loss, output = self._step(batch)
                self._issued(loss, 1)
                return output
            self._graph_calls += 1
            if self._graph_calls <= 2:  # the first makes the optimizer's state, the second is steady
                loss, output = self._step(batch)
                self._issued(loss, 1)
                return output
            try:
                with core.graph(graph):
                    loss, output = self._step(batch, flush=False)  # the capture runs the window itself
            except RuntimeError:
                self._graph = None  # refused: the step ran in full, and the steps go on uncaptured
                self._steps += 1  # its loss is not read: the capture's refusal is what surfaces
                raise
        self._graph_output, self._graph_training, self._graph_loss = output, self._model.training, loss
        self._graph_generations = staged
        self._issued(loss, 1)
        return output

    def reset(self) -> None:
        """TorchRec's ``reset``: drops the batches prepared ahead; the next ``progress`` starts over from its iterator."""
        self.close()
        self._state = PipelineState.IDLE

    def close(self) -> None:
        """Stops the worker thread (batches it prepared are dropped)."""
        self._stop_worker()
        self._queue = None
        self._iterator = None
        self._held = None

    def _stop_worker(self) -> None:
        self._stop.set()
        if self._worker is not None:
            self._worker.join(timeout=10)
        self._worker = None
        for ebc in self._collections:
            ebc.clear_prefetched()

    def __del__(self) -> None:
        try:
            self._stop.set()
        except Exception:
            pass
