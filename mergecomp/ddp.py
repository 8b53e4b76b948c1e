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
into ``p.grad`` when backward ends.  Here each bucket is one mergecomp group:

- the bucket's per-parameter views (``GradBucket.gradients()``) are the group's layout, so
  low-rank compressors factor each layer's own matrix;
- error-feedback and compressor state is kept per bucket (named ``"group<i>"``, as the
  optimizer names its groups), transactional:
  a step is committed or rolled back as a whole;
- every bucket's exchange starts in the hook (compression, collective in flight while
  backward goes on); at the last bucket all of them are finished in bucket order on the
  hook's thread — multi-round compressors (PowerSGD) run their later rounds there, so every
  rank issues the same collectives in the same order — then one small allreduce settles
  whether any rank's gradient was NaN/Inf (the step's buckets then become NaN on every rank,
  as an allreduce would make them, state rolls back, ``GradScaler`` skips) and the futures
  are completed;
- before the first bucket's collective a tiny preflight allreduce checks that the ranks
  agree on the step, the epoch and the configuration (see :mod:`mergecomp.agreement`).

DDP decides the buckets, not mergecomp: their sizes come from ``bucket_cap_mb`` or, with the
installed torch, per bucket from ``bucket_cap_mb_list`` (:func:`bucket_caps` turns a
mergecomp schedule into that list), and their order is DDP's.  DDP rebuilds its buckets
after the first iteration; a bucket whose parameters changed is sent raw (FP32 allreduce,
exact, its residual untouched) in that step, and at the step's end the state follows its
parameters into the new buckets.  A restarted job's DDP starts again from definition-order
buckets: a hook state that holds groups (loaded, unpickled) exchanges that first iteration
in its own groups instead, so a resumed run continues bit for bit.  What DDP cannot carry:
the adaptive schedulers (``auto``, ``binary``) re-plan between steps, and DDP's buckets are
fixed at construction; launching groups in an order of mergecomp's own; parameter slices.  Use
:class:`~mergecomp.optimizer.DistributedOptimizer` for those.
"""
from __future__ import annotations

import warnings
import weakref
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import torch
import torch.distributed

from . import checkpoint, communicators, components, compressors, memories, schedulers
from .agreement import NonFiniteGradient, StepAgreement, StepOutcome, nonfinite_flag, zero_if
from .backends import Backend
from .communicators.base import Communicator, Handle
from .compressors import recipes
from .compressors.base import Compressor, GroupLayout, ParamView
from .memories.base import Memory
from .plan import ParamInfo
from .reducer import NONFINITE_POLICIES, config_digest
from .regroup import CannotRegroup, regroup_state

__all__ = ["HookState", "hook", "register", "bucket_caps"]

#: What the state remembers of a bucket's layout: (parameter name, elements) in order.
BucketKey = Tuple[Tuple[str, int], ...]


class _Pending:
    """One bucket in flight within a step."""

    def __init__(self, index: int, buffer: torch.Tensor, communicator: Communicator, handle: Handle,
                 future: Optional[torch.futures.Future], local_nonfinite: Optional[torch.Tensor],
                 pieces: Sequence[Tuple[torch.Tensor, int, int, int]] = ()):
        self.index, self.buffer, self.communicator = index, buffer, communicator
        self.handle, self.future, self.local_nonfinite = handle, future, local_nonfinite
        #: A group gathered from DDP's buckets (see ``HookState._gather_held_groups``):
        #: (bucket buffer, offset there, offset here, elements) per parameter.
        self.pieces = pieces


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
        if nonfinite not in NONFINITE_POLICIES:
            raise ValueError(f"nonfinite must be one of {NONFINITE_POLICIES}, got {nonfinite!r}")
        if isinstance(communicator, Communicator):
            raise TypeError("HookState takes the communicator by name (e.g. 'allgather', with "
                            "communicator_options=...), so that the state can be pickled with a "
                            "checkpoint and rebuilt")
        self.compressor, self.memory, self.communicator_name = components.resolve(compressor, memory, communicator)
        self.communicator_options = dict(communicator_options or {})
        self.sends = list(sends) if sends is not None else None
        self.nonfinite = nonfinite
        self.names = _parameter_names(model) if model is not None else None
        self._know(model)
        if model is not None:
            compressors.check_dtypes(self.compressor, sorted(
                {p.dtype for p in model.parameters() if p.requires_grad}, key=str))
        #: Steps whose buckets were exchanged (DDP's backward passes that reduced).
        self.steps = 0
        #: Steps dropped because a gradient was NaN or Inf.
        self.skipped_steps = 0
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
        components.vet_optimizer(optimizer, self.compressor, self.memory)
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
        self._raw: Dict[str, Communicator] = {}
        self._bypass = communicators.create("allreduce", compressor=compressors.create("none"),
                                            memory=memories.create("none"), backend=self.backend)
        self._agreement: Optional[StepAgreement] = None
        self._preflight = None
        self._pending: List[_Pending] = []
        self._new_layouts: Dict[int, BucketKey] = {}
        self._deferred: List[_Deferred] = []
        self._regather = False  # this step's buckets are DDP's first iteration's (see exchange)
        self._steps_here = 0  # steps since this state was built, unpickled or loaded

    def _know(self, model: Optional[torch.nn.Module]) -> None:
        """Remember the model's parameter shapes and dtypes by name (to check a checkpoint's
        state against them) and the DDP wrapper, weakly (to tell its first iteration)."""
        from torch.nn.parallel import DistributedDataParallel
        module = getattr(model, "module", model)
        self._shapes = ({n: (p.shape, p.dtype) for n, p in module.named_parameters()}
                        if module is not None else {})
        self._ddp = weakref.ref(model) if isinstance(model, DistributedDataParallel) else None

    def _raw_communicator(self, send: str) -> Communicator:
        if send not in self._raw:
            self._raw[send] = communicators.create(
                "allreduce", compressor=compressors.create("none" if send == "fp32" else send),
                memory=self.memory, backend=self.backend)
        return self._raw[send]

    def communicators(self) -> List[Communicator]:
        return [self.communicator] + list(self._raw.values())

    def facts(self) -> Dict[str, Any]:
        return {"steps": self.steps, "epoch": self.epoch, "config": self.config, "state": self.loaded}

    def set_epoch(self, epoch: int) -> None:
        """Tell epoch-scheduled components (DGC's density warm-up) the epoch; on every rank."""
        if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 0:
            raise ValueError(f"epoch must be a non-negative integer, got {epoch!r}")
        if self._pending:
            raise RuntimeError("set_epoch() must be called between steps, not during backward")
        self.epoch = epoch
        for component in (self.compressor, self.memory):
            if hasattr(component, "set_epoch"):
                component.set_epoch(epoch)

    # -- one bucket ------------------------------------------------------------------------------
    def exchange(self, bucket) -> torch.futures.Future:
        """Start ``bucket``'s exchange; at the last bucket, finish the step (see the module)."""
        buffer = bucket.buffer()
        index = bucket.index()
        if not self._pending and not self._deferred:  # the step's first bucket
            self._begin_step(buffer.device)
        layout, key = self._layout(bucket)
        changed = self.layouts.get(index) != key
        if self._preflight is not None:
            work, self._preflight = self._preflight, None
            self._agreement.check(work, self.facts(), f"at step {self.steps}")
        if changed and self._regather:
            future = torch.futures.Future(devices=[buffer.device] if buffer.device.type == "cuda" else None)
            self._deferred.append(_Deferred(index, buffer, layout, future))
            if bucket.is_last():
                self._finish_step()
            return future
        if changed:
            self._new_layouts[index] = key
        send = self._send_mode(index)
        if changed:
            communicator = self._bypass  # exact, and leaves the residual where regrouping finds it
        elif send == "compress":
            communicator = self.communicator
        else:
            communicator = self._raw_communicator(send)
        local = None
        if communicator is self.communicator and self.nonfinite != "off":
            local = nonfinite_flag(buffer)
            zero_if(buffer, local)
        handle = communicator.start(buffer, f"group{index}", layout)
        future = torch.futures.Future(devices=[buffer.device] if buffer.device.type == "cuda" else None)
        self._pending.append(_Pending(index, buffer, communicator, handle, future, local))
        if bucket.is_last():
            self._finish_step()
        return future

    def _begin_step(self, device: torch.device) -> None:
        if self._agreement is None:
            self._agreement = StepAgreement(self.backend, device)
        self.backend.mark_step(self.steps)
        self._preflight = self._agreement.preflight(self.facts())
        self._new_layouts = {}
        self._deferred = []
        self._regather = bool(self.layouts) and self._ddp_first_iteration()

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
        started = {p.index for p in self._pending}
        held = {i: key for i, key in sorted(self.layouts.items()) if i not in started}
        where = {view.name: (d.buffer, view.offset, view.numel) for d in deferred for view in d.layout}
        wanted = {name: numel for key in held.values() for name, numel in key}
        fits = wanted == {name: numel for name, (_, _, numel) in where.items()} and len(
            {where[name][0].dtype for name in wanted}) <= 1
        if not fits:
            for d in deferred:  # as for buckets that changed for good
                self._new_layouts[d.index] = tuple((v.name, v.numel) for v in d.layout)
                handle = self._bypass.start(d.buffer, f"group{d.index}", d.layout)
                self._pending.append(_Pending(d.index, d.buffer, self._bypass, handle, d.future, None))
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
            send = self._send_mode(index)
            communicator = self.communicator if send == "compress" else self._raw_communicator(send)
            local = None
            if communicator is self.communicator and self.nonfinite != "off":
                local = nonfinite_flag(buffer)
                zero_if(buffer, local)
            handle = communicator.start(buffer, f"group{index}", tuple(views))
            self._pending.append(_Pending(index, buffer, communicator, handle, None, local, pieces))
        self._deferred = deferred  # their futures complete with the step

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
            name = self.names.get(id(param)) if self.names is not None else None
            if name is None:
                name = f"bucket{bucket.index()}.{position}"
            offset = (grad.data_ptr() - base) // size if grad.numel() else (
                views[-1].offset + views[-1].numel if views else 0)
            views.append(ParamView(name, param.shape, offset))
            key.append((name, param.numel()))
        return tuple(views), tuple(key)

    # -- the end of the step -------------------------------------------------------------------
    def _finish_step(self) -> None:
        if self._deferred:
            self._gather_held_groups()
        pending, self._pending = self._pending, []
        deferred, self._deferred = self._deferred, []
        averages = [p.communicator.finish(p.handle).reshape(-1) for p in pending]
        if self.nonfinite == "off":
            outcome = StepOutcome([], False, self.backend.size)
        else:
            local = [p.local_nonfinite for p in pending if p.local_nonfinite is not None]
            outcome = self._agreement.outcome(
                torch.stack(local).any() if local else None,
                torch.stack([nonfinite_flag(a) for a in averages]).any(), active=True)
        communicators_used = self.communicators() + [self._bypass]
        if outcome.finite:
            for communicator in communicators_used:
                communicator.commit()
        else:
            for communicator in communicators_used:
                communicator.rollback()
            self.skipped_steps += 1
            for average in averages:
                average.fill_(float("nan"))
        if self._new_layouts:
            self._follow_layouts()
        self.steps += 1
        self._steps_here += 1
        for p, average in zip(pending, averages):
            for bucket, at, offset, numel in p.pieces:
                bucket.narrow(0, at, numel).copy_(average.narrow(0, offset, numel))
            if p.future is not None:
                p.future.set_result(average.view_as(p.buffer))
        for d in deferred:
            d.future.set_result(d.buffer)
        if not outcome.finite:
            message = (f"step {self.steps - 1}: {outcome.describe()}; the step's buckets are NaN on every "
                       "rank and compressor/error-feedback state is as before the step")
            if self.nonfinite == "raise":
                raise NonFiniteGradient(message)
            warnings.warn(f"mergecomp: {message}; {self.skipped_steps} step(s) dropped so far",
                          RuntimeWarning, stacklevel=3)

    def _follow_layouts(self) -> None:
        """DDP changed buckets: move per-bucket state to the new buckets by parameter."""
        old = {f"group{i}": _pieces(key) for i, key in self.layouts.items()}
        merged = dict(self.layouts)
        merged.update(self._new_layouts)
        new = {f"group{i}": _pieces(key) for i, key in merged.items()}
        state = self.communicator.state_dict()
        try:
            moved = regroup_state(state, old, new)
        except (CannotRegroup, KeyError, ValueError) as error:
            if any(_holds_tensors(v) for v in state.values()):
                warnings.warn(f"mergecomp: DDP changed its buckets and the compression state could not "
                              f"follow the parameters ({error}); it starts afresh", RuntimeWarning)
            moved = None
        self.layouts = merged
        self._new_layouts = {}
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
        if self._pending or self._deferred:
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
        self.skipped_steps = int(state.get("skipped_steps", 0))
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
                         "nonfinite", "steps", "skipped_steps", "epoch", "layouts", "loaded")}
        kept["state"] = checkpoint.seal(self.communicator.state_dict())
        kept["names"] = None  # ids of parameters mean nothing in another process
        return kept

    def __setstate__(self, kept: Dict[str, Any]) -> None:
        """Checks the compression state (checksum, finite values; its shapes are checked
        against the buckets when they arrive) before anything is rebuilt."""
        state = kept.pop("state")
        where = "the pickled HookState"
        checkpoint.verify(state, "compression state", None, where=where)
        checkpoint.check_finite(state, "compression state", None, {}, "communicator", where=where)
        state = {k: v for k, v in state.items() if k != checkpoint.CHECKSUM}
        self.__dict__.update(kept)
        self.process_group = None
        self._advised = None
        self._know(None)
        self._connect(None)
        self.communicator.load_state_dict(state)

    def attach(self, model: torch.nn.Module) -> "HookState":
        """Name the parameters after unpickling (ids do not survive a restart); returns self."""
        self.names = _parameter_names(model)
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
