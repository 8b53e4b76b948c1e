"""mergecomp as a DDP communication hook: keep ``DistributedDataParallel`` (or Lightning, or
Accelerate), compress its buckets with any mergecomp compressor, memory and communicator.

    model = DistributedDataParallel(model, bucket_cap_mb_list=mergecomp.ddp.bucket_caps(model))
    state = mergecomp.ddp.register(model, compressor="dgc", memory="dgc", communicator="allgather")

or, where a framework registers the hook itself (Lightning's ``DDPStrategy(ddp_comm_state=...,
ddp_comm_hook=...)``)::

    state = mergecomp.ddp.HookState(model, compressor="topk", memory="residual")
    ddp_model.register_comm_hook(state, mergecomp.ddp.hook)

DDP fills a bucket during backward and calls the hook with it (buckets in order, the last one
flagged); the hook returns a ``torch.futures.Future`` of the averaged bucket, which DDP writes
into ``p.grad`` when backward ends.  Here each bucket is one mergecomp group of the step
lifecycle the wrapper uses too (:mod:`mergecomp.runtime.step`); this module holds only what
DDP's buckets make different:

- the bucket's per-parameter views (``GradBucket.gradients()``) are the group's layout, so
  low-rank compressors factor each layer's own matrix;
- error-feedback and compressor state is kept per bucket (named ``"group<i>"``, as the
  optimizer names its groups), transactional:
  a step is committed or rolled back as a whole;
- every bucket's exchange starts in the hook (compression, collective in flight while
  backward goes on); at the last bucket the lifecycle ends the step on the hook's thread
  (finishing in bucket order, so multi-round compressors issue their later rounds in the
  same order on every rank; the outcome; commit or rollback; a dropped step's buckets are
  NaN on every rank, as an allreduce would make them, and ``GradScaler`` skips) and the
  futures are completed.

DDP decides the buckets, not mergecomp: their sizes come from ``bucket_cap_mb`` or, with the
installed torch, per bucket from ``bucket_cap_mb_list`` (:func:`bucket_caps` turns a
mergecomp schedule into that list), and their order is DDP's.  DDP rebuilds its buckets
after the first iteration; in a step whose buckets changed, the buckets wait for the last
one, the state follows its parameters into the new buckets, and then all are sent as
configured, so every step is compressed (that step does not overlap the exchange with
backward).  A restarted job's DDP starts again from definition-order buckets: a hook state
that holds groups (loaded, unpickled) exchanges that first iteration in its own groups
instead, so a resumed run continues bit for bit.  Two cases go exact FP32: the fresh first
step with the ``ps`` communicator (its shard residuals cannot move) or without the model (no
names for the state to follow), and buckets that change after an earlier bucket of the same
step was sent (their state moves at the step's end).  The first exchange also checks, once,
that every rank registered the hook (see ``_check_every_rank_registered``).  What DDP cannot
carry: the adaptive schedulers (``auto``, ``binary``) re-plan between steps, and DDP's
buckets are fixed at construction; launching groups in an order of mergecomp's own;
parameter slices.  Use
:class:`~mergecomp.optimizer.DistributedOptimizer` for those.
"""
from __future__ import annotations

import warnings
import weakref
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import torch
import torch.distributed

from . import checkpoint, communicators, arguments, compressors, schedulers
from .runtime.agreement import StepOutcome
from .backends import Backend
from .communicators.base import Communicator
from .communicators.ps import PSCommunicator
from .compressors import recipes
from .compressors.base import Compressor, GroupLayout, ParamView
from .memories.base import Memory
from .plan import ParamInfo
from .runtime.reducer import config_digest
from .runtime.regroup import CannotRegroup, regroup_state
from .runtime.step import InFlight, StepLifecycle, check_nonfinite_policy

__all__ = ["HookState", "hook", "register", "bucket_caps"]

#: What the state remembers of a bucket's layout: (parameter name, elements) in order.
BucketKey = Tuple[Tuple[str, int], ...]


class _Bucket:
    """What the hook does with one group's average: complete DDP's ``future`` (None for a
    group gathered from several buckets) and copy ``pieces`` back into DDP's buckets: (bucket
    buffer, offset there, offset in the group, elements) per parameter of a gathered group
    (see ``HookState._gather_held_groups``)."""

    def __init__(self, future: Optional[torch.futures.Future],
                 pieces: Sequence[Tuple[torch.Tensor, int, int, int]] = ()):
        self.future, self.pieces = future, pieces


class _Deferred:
    """A bucket of DDP's first iteration, exchanged inside the groups the state holds."""

    def __init__(self, index: int, buffer: torch.Tensor, layout: GroupLayout, future: torch.futures.Future):
        self.index, self.buffer, self.layout, self.future = index, buffer, layout, future


class HookState:
    """What :func:`hook` keeps between calls; pass it to ``register_comm_hook``.

    Args:
        model: the module (or the DDP wrapper) whose parameters DDP reduces: it names the
            parameters, so state follows them when DDP rebuilds buckets and checkpoints are
            keyed by name.  Without it, parameters are named by their bucket position.
        compressor, memory, communicator: as for ``DistributedOptimizer`` (names, or
            instances for compressor and memory; ``"auto"`` takes the compressor's
            recommendation).  The communicator is given by name (plus
            ``communicator_options``) so the state can be pickled and rebuilt.
        sends: optional send mode per bucket (``"compress"``, ``"fp32"``, ``"fp16"``,
            ``"bf16"``), e.g. a plan's ``[g.send for g in plan.groups]``.
        nonfinite: ``"skip"`` (default), ``"raise"`` or ``"off"``, as for the optimizer; under
            DDP a dropped step's buckets are NaN on every rank (what an allreduce of a NaN
            gives), so the caller's ``GradScaler`` or NaN check skips it.
        process_group: the process group DDP uses (default: the default group).
        optimizer: the optimizer that will step on the averaged gradients, if known now:
            checked as the wrapper checks its own (:meth:`check_optimizer`).  It is not kept
            (the state pickles without it); frameworks that build it later call
            :meth:`check_optimizer` then.
    """

    def __init__(self, model: Optional[torch.nn.Module] = None,
                 compressor: Union[str, Compressor] = "none",
                 memory: Union[str, Memory] = "auto",
                 communicator: str = "auto",
                 *,
                 communicator_options: Optional[Dict[str, Any]] = None,
                 sends: Optional[Sequence[str]] = None,
                 nonfinite: str = "skip",
                 process_group: Optional[Any] = None,
                 optimizer: Optional[torch.optim.Optimizer] = None):
        check_nonfinite_policy(nonfinite)  # before anything is built
        if isinstance(communicator, Communicator):
            raise TypeError("HookState takes the communicator by name (e.g. 'allgather', with "
                            "communicator_options=...), so that the state can be pickled with a "
                            "checkpoint and rebuilt")
        self.compressor, self.memory, self.communicator_name = arguments.resolve(compressor, memory, communicator)
        self.communicator_options = dict(communicator_options or {})
        self.sends = list(sends) if sends is not None else None
        self.nonfinite = nonfinite
        self.names = _parameter_names(model) if model is not None else None
        #: Parameters frozen when the state was built: DDP does not reduce them (see _check_frozen).
        self._frozen = _frozen_parameters(model)
        self._conversion_check = _watch_conversion(model)
        self._know(model)
        if model is not None:
            _refuse_sparse_gradients(model)
            compressors.check_dtypes(self.compressor, sorted(
                {p.dtype for p in model.parameters() if p.requires_grad}, key=str))
        #: Steps whose buckets were exchanged (DDP's backward passes that reduced).
        self.steps = 0
        self.epoch: Optional[int] = None
        self.layouts: Dict[int, BucketKey] = {}
        self.loaded = ""
        self.process_group = process_group
        self._connect(process_group)
        self._advised: Optional[str] = None  # the recipe advice already given, not repeated
        if optimizer is not None:
            self.check_optimizer(optimizer)
        else:  # what can be judged without the optimizer: the memory and the ratio
            self._advised = recipes.warn_if_contradicted(self.compressor, None, self.memory)

    def check_optimizer(self, optimizer: torch.optim.Optimizer) -> Optional[str]:
        """Vet the optimizer that steps on this hook's averages, as ``DistributedOptimizer``
        vets the one it wraps: components that own the momentum (the ``dgc`` memory, SIGNUM)
        refuse one with its own (ValueError), and a setting that contradicts the compressor's
        recipe warns (:class:`~mergecomp.compressors.recipes.RecipeWarning`).  Returns the
        recipe's advice, or None."""
        arguments.vet_optimizer(optimizer, self.compressor, self.memory)
        message = recipes.advice(self.compressor, optimizer, self.memory)
        if message is not None and message != self._advised:
            recipes.warn(message)
            self._advised = message
        return message

    # -- the process-local half (rebuilt after unpickling) -------------------------------------
    def _connect(self, process_group) -> None:
        from .backends.torch_dist import TorchDistributedBackend
        self.backend: Backend = TorchDistributedBackend(process_group)  # DDP runs on torch.distributed
        self.communicator = communicators.create(self.communicator_name, compressor=self.compressor,
                                                 memory=self.memory, backend=self.backend,
                                                 **self.communicator_options)
        self.config = config_digest(self.compressor, self.memory, self.communicator, self.sends, self.nonfinite)
        self.lifecycle = StepLifecycle(self.communicator, self.backend, self.facts, self.nonfinite)
        self._registration_checked = False
        #: Whether per-bucket state can move to DDP's rebuilt buckets; a parameter server's
        #: shard residuals cannot (servers hold them), nor can state without parameter names:
        #: then the fresh first step goes exact.
        self._state_follows_buckets = not isinstance(self.communicator, PSCommunicator)
        #: The buckets seen so far this step, and those held back while the layout changes.
        self._step_keys: Dict[int, BucketKey] = {}
        self._started: set = set()  # indices of the buckets launched this step
        self._held: List[Tuple[int, torch.Tensor, GroupLayout, torch.futures.Future]] = []
        self._deferred: List[_Deferred] = []
        self._regather = False  # this step's buckets are DDP's first iteration's (see exchange)
        self._steps_here = 0  # steps since this state was built, unpickled or loaded

    def add_phase_listener(self, callback):
        """As the wrapper's (:meth:`mergecomp.runtime.reducer.Reducer.add_phase_listener`): the
        ``"launch"`` of each bucket and its ``"finish"`` (waits timed apart)."""
        return self.lifecycle.phase_listeners.add(callback)

    def add_step_listener(self, callback):
        """As the wrapper's (:meth:`mergecomp.runtime.reducer.Reducer.add_step_listener`)."""
        return self.lifecycle.step_listeners.add(callback)

    @property
    def skipped_steps(self) -> int:
        """Steps dropped because a gradient was NaN or Inf."""
        return self.lifecycle.skipped_steps

    def add_step_log(self, log):
        """Record every step's exchange in ``log`` (a :class:`mergecomp.StepLog`); returns a
        handle whose ``remove()`` detaches it.  Not kept when the state is pickled."""
        return log.attach(self)

    def _know(self, model: Optional[torch.nn.Module]) -> None:
        """Remember the model's parameter shapes and dtypes by name (to check a checkpoint's
        state against them) and the DDP wrapper, weakly (to tell its first iteration)."""
        from torch.nn.parallel import DistributedDataParallel
        module = getattr(model, "module", model)
        self._shapes = ({n: (p.shape, p.dtype) for n, p in module.named_parameters()}
                        if module is not None else {})
        self._ddp = weakref.ref(model) if isinstance(model, DistributedDataParallel) else None

    def communicators(self) -> List[Communicator]:
        """Every communicator the hook sends with (compressed first)."""
        return self.lifecycle.communicators()

    def facts(self) -> Dict[str, Any]:
        return {"steps": self.steps, "epoch": self.epoch, "config": self.config, "state": self.loaded}

    def set_epoch(self, epoch: int) -> None:
        """Tell epoch-scheduled components (DGC's density warm-up) the epoch; on every rank."""
        if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 0:
            raise ValueError(f"epoch must be a non-negative integer, got {epoch!r}")
        if self.lifecycle.in_step:
            raise RuntimeError("set_epoch() must be called between steps, not during backward")
        self.epoch = epoch
        for component in (self.compressor, self.memory):
            if hasattr(component, "set_epoch"):
                component.set_epoch(epoch)

    # -- one bucket ------------------------------------------------------------------------------
    def exchange(self, bucket) -> torch.futures.Future:
        """Start ``bucket``'s exchange; at the last bucket, finish the step (see the module)."""
        buffer = bucket.buffer()
        if buffer.is_sparse:
            raise self._sparse_error(bucket)
        index = bucket.index()
        if not self.lifecycle.in_step:  # the step's first bucket
            self._begin_step(buffer)
        layout, key = self._layout(bucket)
        self._step_keys[index] = key
        changed = self.layouts.get(index) != key
        self.lifecycle.check_preflight()
        future = torch.futures.Future(devices=[buffer.device] if buffer.device.type == "cuda" else None)
        follows = self._state_follows_buckets and self.names is not None
        if changed and self._regather:
            # A restarted job's first iteration: exchanged in the groups the state holds.
            self._deferred.append(_Deferred(index, buffer, layout, future))
        elif self._held or (changed and self.layouts and not self._started and self.names is not None):
            # DDP's buckets changed (its rebuild after the first iteration): hold the step's
            # buckets until the last one shows the new layout, move the state to it, then
            # send them all as configured.
            self._held.append((index, buffer, layout, future))
            if bucket.is_last():
                self._move_state(self._step_keys)
                for held in self._held:
                    self._start(*held, changed=False)
                self._held = []
        else:
            self._start(index, buffer, layout, future, changed=changed and (bool(self.layouts) or not follows))
        if bucket.is_last():
            self._finish_step()
        return future

    def _start(self, index: int, buffer: torch.Tensor, layout: GroupLayout, future: torch.futures.Future,
               changed: bool) -> None:
        """Launch one bucket: compressed (or at its raw width) unless ``changed``.

        A bucket whose parameters changed after an earlier bucket of the same step was
        already sent goes exact (FP32 through a communicator without memory, so its residual
        stays where the state's move at the step's end finds it)."""
        send = "exact" if changed else self._send_mode(index)
        self.lifecycle.launch(index, buffer, layout, send, owner=_Bucket(future))
        self._started.add(index)

    def _begin_step(self, buffer: torch.Tensor) -> None:
        self._check_frozen()
        if not self._registration_checked:
            self._check_every_rank_registered(buffer)
            self._registration_checked = True
        self.lifecycle.begin(self.steps, buffer.device)
        self._step_keys = {}
        self._started = set()
        self._deferred = []
        self._regather = bool(self.layouts) and self._ddp_first_iteration()

    def _check_every_rank_registered(self, first: torch.Tensor) -> None:
        """Once, before the first exchange: fail clearly if some rank runs DDP without this hook.

        A rank without the hook sends DDP's own allreduce of its first bucket, where this
        rank would send the preflight: collectives of different sizes, which gloo answers by
        aborting one process and resetting the others' connections.  So the first collective
        of a hook rank is shaped exactly like that allreduce (the first bucket's size and
        dtype) and pairs with it: each hook rank writes a large marker into its own element,
        and an element without its marker names a rank that did not register (a rank's
        gradient is far below the marker).  It runs once per state, so the steps cost the
        same as before.
        """
        size, rank = self.backend.size, self.backend.rank
        if size == 1 or first.numel() == 0:
            return
        marker = _registration_marker(first.dtype, size)
        probe = torch.zeros(first.numel(), dtype=first.dtype, device=first.device)
        slots = first.numel() >= size
        probe[rank if slots else 0] = marker
        (total,) = self.backend.allreduce_async([probe]).wait()
        seen = total[:size if slots else 1].real if total.is_complex() else total[:size if slots else 1]
        seen = seen.double().tolist()
        if slots:
            missing = [r for r, value in enumerate(seen) if not value > marker / 2]
        else:
            count = round(seen[0] / marker) if seen[0] == seen[0] else 0
            missing = [] if count == size else None
        if missing == []:
            return
        which = (f"rank(s) {missing}" if missing is not None
                 else f"{size - count} of the {size} ranks (which ones cannot be told: the first bucket "
                      f"has fewer elements than there are ranks)")
        error = RuntimeError(
            f"the mergecomp DDP communication hook is not registered on {which} (this is rank {rank} of "
            f"{size}): those ranks run DDP's own allreduce while this one compresses, so their "
            "collectives cannot meet. Register the hook on every rank, with the same arguments "
            "(mergecomp.ddp.register(ddp_model, ...) or ddp_model.register_comm_hook(state, "
            "mergecomp.ddp.hook)), before the first backward. The ranks without it received this "
            "check's markers as their first bucket's gradient and fail at their next collective.")
        beacon = getattr(self.backend, "beacon", None)
        if beacon is not None:  # the progress records then say why this rank stopped
            beacon.fail(str(error))
        raise error

    def _check_frozen(self) -> None:
        """A parameter frozen when the state was built must not start training unseen: DDP
        reduces only the parameters that required gradients when it was built, so each rank
        would apply its own gradient to it and the ranks' models would drift apart."""
        if not any(p.requires_grad for _, p in self._frozen):
            return
        names = [n for n, p in self._frozen if p.requires_grad]
        raise RuntimeError(
            f"parameter(s) {names[:5]}{'...' if len(names) > 5 else ''} were frozen (requires_grad="
            "False) when DDP and its mergecomp hook state were built and now require gradients: DDP "
            "does not reduce them, so every rank would apply its own gradient and the ranks' models "
            "would drift apart. Build DistributedDataParallel and register the hook again after "
            "changing requires_grad (a new HookState, or this one's state_dict() loaded into it), or "
            "use mergecomp.DistributedOptimizer, which takes parameters unfrozen during training into "
            "its exchange.")

    def _sparse_error(self, bucket) -> ValueError:
        names = [self._name(param, bucket.index(), position)
                 for position, param in enumerate(bucket.parameters())]
        return ValueError(
            f"DDP's bucket {bucket.index()} holds sparse gradients (parameter(s) {names}, e.g. "
            "nn.Embedding(sparse=True)), which the mergecomp hook cannot compress: build those "
            "layers with sparse=False, or keep DDP's own allreduce (no hook) for such a model")

    def _ddp_first_iteration(self) -> bool:
        """Whether DDP is in its first iteration, whose buckets (in definition order) it
        rebuilds afterwards (in backward order).  Known from the DDP wrapper the state was
        built with (or attached to); otherwise taken to be the first step since this state
        was built, unpickled or loaded."""
        ddp = self._ddp() if self._ddp is not None else None
        if ddp is None:
            return self._steps_here == 0
        rebuilds = getattr(ddp, "static_graph", False) or not getattr(ddp, "find_unused_parameters", False)
        return rebuilds and not getattr(ddp, "_has_rebuilt_buckets", True)

    def _gather_held_groups(self) -> None:
        """Exchange the step's deferred buckets as the groups the state holds.

        A restarted job's DDP buckets its first iteration in definition order and only then
        in backward order, the order whose buckets the saved state belongs to.  Sending those
        first buckets raw (as for buckets that changed for good) would make the resumed run
        differ from one that never stopped; instead each held group is gathered from the
        buckets by parameter, exchanged under its own name with its state, and the averages
        are copied back into the buckets at the step's end.  If the deferred buckets do not
        hold exactly the held groups' parameters, they are sent raw after all.
        """
        deferred, self._deferred = self._deferred, []
        held = {i: key for i, key in sorted(self.layouts.items()) if i not in self._started}
        where = {view.name: (d.buffer, view.offset, view.numel) for d in deferred for view in d.layout}
        wanted = {name: numel for key in held.values() for name, numel in key}
        fits = wanted == {name: numel for name, (_, _, numel) in where.items()} and len(
            {where[name][0].dtype for name in wanted}) <= 1
        if not fits:
            for d in deferred:  # as for buckets that changed for good (their state moves at the step's end)
                self.lifecycle.launch(d.index, d.buffer, d.layout, "exact", owner=_Bucket(d.future))
            return
        for index, key in held.items():
            first = where[key[0][0]][0]
            buffer = torch.empty(sum(numel for _, numel in key), dtype=first.dtype, device=first.device)
            views, pieces, offset = [], [], 0
            for name, numel in key:
                source, at, _ = where[name]
                buffer.narrow(0, offset, numel).copy_(source.narrow(0, at, numel))
                shape = self._shapes.get(name, (None,))[0]
                views.append(ParamView(name, shape if shape is not None and shape.numel() == numel
                                       else torch.Size([numel]), offset))
                pieces.append((source, at, offset, numel))
                offset += numel
            self.lifecycle.launch(index, buffer, tuple(views), self._send_mode(index),
                                  owner=_Bucket(None, pieces))
        self._deferred = deferred  # their futures complete with the step
        self._step_keys = dict(self.layouts)  # the state stays in its groups: nothing moves

    def _send_mode(self, index: int) -> str:
        if self.sends is None:
            return "compress"
        if index >= len(self.sends):
            raise ValueError(f"DDP made bucket {index} but the hook state has send modes for "
                             f"{len(self.sends)} buckets: build DDP with bucket_cap_mb_list="
                             "mergecomp.ddp.bucket_caps(...) of the same schedule")
        return self.sends[index]

    def _layout(self, bucket) -> Tuple[GroupLayout, BucketKey]:
        """The bucket's per-parameter views, named, and what identifies them."""
        buffer = bucket.buffer()
        base = buffer.data_ptr()
        size = buffer.element_size()
        views, key = [], []
        for position, (param, grad) in enumerate(zip(bucket.parameters(), bucket.gradients())):
            name = self._name(param, bucket.index(), position)
            offset = (grad.data_ptr() - base) // size if grad.numel() else (
                views[-1].offset + views[-1].numel if views else 0)
            views.append(ParamView(name, param.shape, offset))
            key.append((name, param.numel()))
        return tuple(views), tuple(key)

    def _name(self, param, index: int, position: int) -> str:
        name = self.names.get(id(param)) if self.names is not None else None
        return name if name is not None else f"bucket{index}.{position}"

    # -- the end of the step -------------------------------------------------------------------
    def _finish_step(self) -> None:
        """The last bucket: the lifecycle ends the step (finish, outcome, commit or rollback,
        each bucket's future completed); state follows DDP's new buckets; the step closes."""
        if self._deferred:
            self._gather_held_groups()
        deferred, self._deferred = self._deferred, []
        self.lifecycle.end_step(self._complete)
        if self._step_keys != self.layouts:
            self._move_state(self._step_keys)
        self.steps += 1
        self._steps_here += 1
        for d in deferred:
            d.future.set_result(d.buffer)
        self.lifecycle.close_step()

    @staticmethod
    def _complete(flight: InFlight, average: torch.Tensor, outcome: StepOutcome) -> None:
        """Hand a group's average to DDP: into the buckets it was gathered from, or as the
        result of its bucket's future (NaN for a dropped step: what an allreduce of a NaN
        gives)."""
        bucket: _Bucket = flight.owner
        for source, at, offset, numel in bucket.pieces:
            source.narrow(0, at, numel).copy_(average.narrow(0, offset, numel))
        if bucket.future is not None:
            bucket.future.set_result(average.view_as(flight.buffer))

    def _move_state(self, keys: Dict[int, BucketKey]) -> None:
        """DDP changed buckets: move per-bucket state to the new buckets by parameter.

        Runs between the steps' exchanges (at the end of a step, or before the first bucket
        of a held step is sent), when the state holds no step's uncommitted writes."""
        old = {f"group{i}": _pieces(key) for i, key in self.layouts.items()}
        new = {f"group{i}": _pieces(key) for i, key in keys.items()}
        if not self.layouts:  # nothing was kept per bucket yet
            self.layouts = dict(keys)
            return
        state = self.communicator.state_dict()
        try:
            if self.names is None:
                raise CannotRegroup("the parameters have no names: build the HookState with the model, "
                                    "or call attach(model) after unpickling it")
            moved = regroup_state(state, old, new)
        except (CannotRegroup, KeyError, ValueError) as error:
            if any(_holds_tensors(v) for v in state.values()):
                warnings.warn(f"mergecomp: DDP changed its buckets and the compression state could not "
                              f"follow the parameters ({error}); it starts afresh", RuntimeWarning)
            moved = None
        self.layouts = dict(keys)
        self._connect_state(moved)

    def _connect_state(self, moved: Optional[Dict[str, Any]]) -> None:
        if moved is None:
            fresh = {"compressor": {}, "memory": {}}
            try:
                self.communicator.load_state_dict(fresh)
            except ValueError:
                pass
        else:
            self.communicator.load_state_dict(moved)

    # -- checkpoints -------------------------------------------------------------------------------
    def state_dict(self) -> Dict[str, Any]:
        """Tensors and plain data only (``torch.load(weights_only=True)`` reads it back),
        sealed with a checksum that :meth:`load_state_dict` verifies."""
        return checkpoint.seal({
            "communicator": self.communicator.state_dict(), "steps": self.steps, "epoch": self.epoch,
            "layouts": {i: [list(p) for p in key] for i, key in self.layouts.items()},
            "skipped_steps": self.skipped_steps, "config": self.config,
            "rank": self.backend.rank, "world_size": self.backend.size})

    def load_state_dict(self, state: Dict[str, Any], restore_compression: bool = True) -> None:
        """Restore a state saved by :meth:`state_dict` on this rank of a run like this one.

        Everything is checked before anything changes: the checksum, the rank, world size and
        configuration, finite values, and the shapes and dtypes of this model's buckets
        (:mod:`mergecomp.checkpoint`); a refusal names the tensor and the file (when read
        with :func:`mergecomp.load`).  With ``restore_compression=False`` only the step and
        epoch counts are restored and compression state starts from zero (another number
        of ranks, or a damaged compression state).
        """
        if self.lifecycle.in_step:
            raise RuntimeError("load_state_dict() must be called between steps, not during backward")
        source = state.get(checkpoint.SOURCE) if isinstance(state, dict) else None
        where = checkpoint.describe_source(source)
        if not isinstance(state, dict) or not {"communicator", checkpoint.CHECKSUM} & set(state):
            keys = sorted(state)[:8] if isinstance(state, dict) else type(state).__name__
            raise checkpoint.CheckpointError(
                f"{where}: this is not a hook state (it has {keys}); pass what HookState.state_dict() "
                "returned, e.g. checkpoint['hook'] of a file saved as {'model': ..., 'hook': state.state_dict()}")
        layouts: Dict[int, BucketKey] = {}
        if restore_compression:
            try:
                layouts = _read_layouts(state.get("layouts", {}), where)
            except checkpoint.CheckpointError:
                checkpoint.verify(state, "hook state", source)  # names the damage, if sealed
                raise
            groups = self._group_specs(layouts)
            checkpoint.verify(state, "hook state", source, groups)
            self._check_state_belongs_here(state, where)
            checkpoint.check_state(self.communicator, state.get("communicator", {}), groups, source)
            self.communicator.load_state_dict(state.get("communicator", {}))
        else:
            self._connect_state(None)
        self.steps = int(state.get("steps", 0))
        if state.get("epoch") is not None:
            self.set_epoch(int(state["epoch"]))
        self.layouts = layouts
        self.lifecycle.restore(state.get("skipped_steps", 0))
        self.loaded = config_digest(self.steps, self.config, sorted(self.layouts.items()))
        self._steps_here = 0

    def _check_state_belongs_here(self, state: Dict[str, Any], where: str) -> None:
        rank, size = self.backend.rank, self.backend.size
        fix = "or pass restore_compression=False to restore only the step count"
        if state.get("world_size", size) != size:
            raise ValueError(f"{where}: it was saved by a run of {state['world_size']} ranks, "
                             f"this run has {size}: error-feedback state is per rank; {fix}")
        if state.get("rank", rank) != rank:
            raise ValueError(f"{where}: it was saved by rank {state['rank']}, and rank {rank} is "
                             f"loading it: every rank must load the state it saved; {fix}")
        if state.get("config", self.config) != self.config:
            raise ValueError(f"{where}: it belongs to another configuration (digest "
                             f"{state['config']}, this one {self.config}): build the same compressor, "
                             f"memory and communicator, {fix}")

    def _group_specs(self, layouts: Dict[int, BucketKey]) -> Dict[str, checkpoint.GroupSpec]:
        """What each held bucket exchanges, from the model's parameters when they are known."""
        specs = {}
        for index, key in layouts.items():
            known = [self._shapes.get(name) for name, _ in key]
            whole = all(k is not None and k[0].numel() == numel for k, (_, numel) in zip(known, key))
            views, offset = [], 0
            for (name, numel), k in zip(key, known):
                views.append(ParamView(name, k[0] if whole else torch.Size([numel]), offset))
                offset += numel
            dtypes = {k[1] for k in known if k is not None}
            specs[f"group{index}"] = checkpoint.GroupSpec(
                offset, dtypes.pop() if whole and len(dtypes) == 1 else None, tuple(views) if whole else None)
        return specs

    def __getstate__(self) -> Dict[str, Any]:
        """Pickled with a checkpoint like PyTorch's ``PowerSGDState``: the configuration and
        the state, not the process group; unpickling reconnects to the default group."""
        kept = {k: v for k, v in self.__dict__.items()
                if k in ("compressor", "memory", "communicator_name", "communicator_options", "sends",
                         "nonfinite", "steps", "epoch", "layouts", "loaded")}
        kept["skipped_steps"] = self.skipped_steps
        kept["state"] = checkpoint.seal(self.communicator.state_dict())
        kept["names"] = None  # ids of parameters mean nothing in another process
        return kept

    def __setstate__(self, kept: Dict[str, Any]) -> None:
        """Checks the compression state (checksum, finite values; its shapes are checked
        against the buckets when they arrive) before anything is rebuilt."""
        state = kept.pop("state")
        skipped = kept.pop("skipped_steps", 0)
        where = "the pickled HookState"
        checkpoint.verify(state, "compression state", None, where=where)
        checkpoint.check_finite(state, "compression state", None, {}, "communicator", where=where)
        state = {k: v for k, v in state.items() if k != checkpoint.CHECKSUM}
        self.__dict__.update(kept)
        self.process_group = None
        self._advised = None
        self._frozen = []
        self._conversion_check = None
        self._know(None)
        self._connect(None)
        self.lifecycle.restore(skipped)
        self.communicator.load_state_dict(state)

    def attach(self, model: torch.nn.Module) -> "HookState":
        """Name the parameters after unpickling (ids do not survive a restart); returns self."""
        self.names = _parameter_names(model)
        self._frozen = _frozen_parameters(model)
        if self._conversion_check is not None:
            self._conversion_check.remove()
        self._conversion_check = _watch_conversion(model)
        self._know(model)
        return self

    def __repr__(self) -> str:
        return f"HookState({self.communicator!r}, steps={self.steps}, ranks={self.backend.size})"


def hook(state: HookState, bucket):
    """The DDP communication hook: ``ddp_model.register_comm_hook(state, mergecomp.ddp.hook)``."""
    return state.exchange(bucket)


# DDP checks the annotations as objects (this module's are strings): give it the real ones.
hook.__annotations__ = {"state": HookState, "bucket": torch.distributed.GradBucket,
                        "return": torch.futures.Future[torch.Tensor]}


def register(model: torch.nn.Module, compressor: Union[str, Compressor] = "none",
             memory: Union[str, Memory] = "auto", communicator: str = "auto", **options) -> HookState:
    """Build a :class:`HookState` for the DDP-wrapped ``model`` and register :func:`hook`."""
    if not hasattr(model, "register_comm_hook"):
        raise TypeError(f"register() needs the DistributedDataParallel-wrapped model, got "
                        f"{type(model).__name__}: wrap it first (DDP(model, bucket_cap_mb_list=...))")
    state = HookState(model, compressor, memory, communicator, **options)
    model.register_comm_hook(state, hook)
    return state


def bucket_caps(model: torch.nn.Module, schedule: Union[int, str, schedulers.Scheduler] = 4) -> List[float]:
    """DDP's ``bucket_cap_mb_list`` that makes its buckets the groups of a mergecomp schedule.

    The schedule plans the trainable parameters in reverse definition order (the order
    backward usually produces, and the order DDP buckets in before its first iteration); each
    group's size in MiB, a hair over, is its bucket's cap, so DDP closes a bucket exactly
    where the group ends.  After its first iteration DDP re-buckets in the real backward
    order with the same caps.
    """
    arguments.check_schedule(schedule, "a fusion-num (int), a scheduler name or a Scheduler", plan=False)
    if isinstance(schedule, int):
        schedule = schedulers.create("fixed", fusion_num=schedule)
    elif isinstance(schedule, str):
        schedule = schedulers.create(schedule)
    if getattr(schedule, "adaptive", False):
        raise ValueError(f"the {schedule!r} scheduler re-plans while training, and DDP's buckets are fixed "
                         "when it is built: use a fusion-num or 'optimal' with a saved profile, or "
                         "mergecomp.DistributedOptimizer")
    module = getattr(model, "module", model)
    params = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
    infos = [ParamInfo(n, p.numel(), str(p.dtype), str(p.device), p.element_size()) for n, p in reversed(params)]
    plan = schedule.plan(infos)
    sizes = {info.name: info.nbytes for info in infos}
    return [sum(sizes[n] for n in group.names) / 2 ** 20 * (1 + 1e-9) for group in plan.groups]


def _parameter_names(model: torch.nn.Module) -> Dict[int, str]:
    module = getattr(model, "module", model)
    return {id(p): name for name, p in module.named_parameters()}


def _watch_conversion(model: Optional[torch.nn.Module]):
    """Register a :class:`_ConversionCheck` on the module DDP wraps; returns its handle."""
    if model is None:
        return None
    module = getattr(model, "module", model)
    return module.register_forward_pre_hook(_ConversionCheck(module))


def _frozen_parameters(model: Optional[torch.nn.Module]) -> List[Tuple[str, torch.nn.Parameter]]:
    if model is None:
        return []
    module = getattr(model, "module", model)
    return [(name, p) for name, p in module.named_parameters() if not p.requires_grad]


def _refuse_sparse_gradients(model: torch.nn.Module) -> None:
    """Embeddings built with ``sparse=True`` make sparse gradients, which DDP puts in a bucket
    of their own and which no mergecomp compressor carries: say so before the first step."""
    module = getattr(model, "module", model)
    sparse = [f"{name}.weight" if name else "weight" for name, m in module.named_modules()
              if isinstance(m, (torch.nn.Embedding, torch.nn.EmbeddingBag)) and m.sparse
              and m.weight.requires_grad]
    if sparse:
        raise ValueError(
            f"parameter(s) {sparse} get sparse gradients (nn.Embedding/EmbeddingBag with sparse=True), "
            "which the mergecomp hook cannot compress: build those layers with sparse=False, or keep "
            "DDP's own allreduce (no hook) for such a model")


class _ConversionCheck:
    """A forward pre-hook: refuse a model converted or moved after DDP was built.

    ``model.to(torch.float64)`` (or to another device) after ``DistributedDataParallel`` gives
    the parameters new storage, and DDP's gradient hooks stay with the old: no bucket is
    reduced any more, the hook is never called, and each rank trains on its own gradients
    without a word.  Conversions act on the whole model, so the first and the last parameter
    are enough to see one, at two comparisons per forward.  A plain object, so a module
    that holds it still pickles.
    """

    def __init__(self, module: torch.nn.Module):
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        self.watched = [(n, p, p.dtype, p.device) for n, p in (named[:1] + named[-1:])]

    def __call__(self, module, args) -> None:
        for name, param, dtype, device in self.watched:
            if param.dtype != dtype or param.device != device:
                raise RuntimeError(
                    f"parameter {name!r} is now {param.dtype} on {param.device}, but it was {dtype} on "
                    f"{device} when DistributedDataParallel and the mergecomp hook were built: the model "
                    "was converted or moved (model.to(...)) afterwards, and DDP no longer sees its "
                    "gradients, so each rank would train on its own. Convert or move the model first, "
                    "then build DistributedDataParallel and register the hook.")


def _registration_marker(dtype: torch.dtype, size: int) -> float:
    """A value far above any gradient that ``size`` ranks can sum without overflow."""
    real = torch.empty((), dtype=dtype).real.dtype if dtype.is_complex else dtype
    return float(torch.finfo(real).max) / (4 * size) if real.is_floating_point else 1.0


def _read_layouts(saved: Any, where: str) -> Dict[int, BucketKey]:
    """The ``"layouts"`` of a saved hook state, or CheckpointError saying what is wrong."""
    try:
        return {int(i): tuple((str(n), int(k)) for n, k in key) for i, key in saved.items()}
    except (AttributeError, TypeError, ValueError) as error:
        raise checkpoint.CheckpointError(
            f"{where}: its bucket layouts are not {{bucket: [[parameter, elements], ...]}} ({error}); "
            "the file is damaged") from None


def _pieces(key: BucketKey):
    return [(name, 0, numel) for name, numel in key]


def _holds_tensors(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return True
    if isinstance(value, dict):
        return any(_holds_tensors(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(_holds_tensors(v) for v in value)
    return False
