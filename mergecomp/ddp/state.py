"""The hook's state: one DDP bucket per mergecomp group, driven through the step lifecycle.

See :mod:`mergecomp.ddp` for what the hook does and what DDP's buckets make different;
the checks against DDP's silent failure modes are in :mod:`.guards`, and how per-bucket
state follows re-bucketing and checkpoints in :mod:`.buckets`.
"""
from __future__ import annotations

import weakref
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import torch
import torch.distributed

from .. import checkpoint, communicators, arguments
from . import buckets, guards
from .buckets import BucketKey
from .handover import HookHandOver
from ..runtime import gate
from ..runtime.agreement import StepOutcome
from ..distributed.backends import Backend
from ..distributed.backends.torch_dist import TorchDistributedBackend
from ..communicators.base import Communicator
from ..communicators.ps import PSCommunicator
from ..compressors import recipes
from ..compressors.base import Compressor, GroupLayout, ParamView
from ..memories.base import Memory
from ..runtime.controller import DriftController
from ..runtime.drift import drift_meter
from ..runtime.step import InFlight, SharedSurface, StepLifecycle, check_nonfinite_policy

#: Format of a hook state (2: the envelope every entry point shares,
#: :func:`mergecomp.runtime.gate.seal_state`; 1, without ``format``, is read too).
STATE_FORMAT = 2


class _Bucket:
    """What the hook does with one group's average: complete DDP's ``future`` (None for a
    group gathered from several buckets) and copy ``pieces`` back into DDP's buckets: (bucket
    buffer, offset there, offset in the group, elements) per parameter of a gathered group
    (see ``HookState._gather_held_groups``).  ``layout``: the group's parameters (each a
    name, shape and offset), or only their ``names`` for a gathered group."""

    def __init__(self, future: Optional[torch.futures.Future],
                 pieces: Sequence[Tuple[torch.Tensor, int, int, int]] = (), layout: GroupLayout = (),
                 names: Sequence[str] = ()):
        self.future, self.pieces, self.layout = future, pieces, layout
        self.names = list(names) or [view.name for view in layout]


class _Deferred:
    """A bucket of DDP's first iteration, exchanged inside the groups the state holds."""

    def __init__(self, index: int, buffer: torch.Tensor, layout: GroupLayout, future: torch.futures.Future):
        self.index, self.buffer, self.layout, self.future = index, buffer, layout, future


class HookState(SharedSurface):
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
        controller: the quality controller, as for ``DistributedOptimizer`` (``"auto"``,
            ``"off"`` or a :class:`~mergecomp.DriftController`).
        optimizer: the optimizer that will step on the averaged gradients, if known now:
            checked as the wrapper checks its own (:meth:`check_optimizer`), and its steps
            watched for the loop's clipping (:mod:`.handover`).  It is not kept (the state
            pickles without it); frameworks that build it later call :meth:`check_optimizer`
            then, and so does a script that unpickles the state.
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
                 optimizer: Optional[torch.optim.Optimizer] = None,
                 controller: Union[str, None, DriftController] = "auto"):
        check_nonfinite_policy(nonfinite)  # before anything is built
        drift_meter(controller)  # a wrong value is refused before anything is built
        self.controller_setting = controller
        if isinstance(communicator, Communicator):
            raise TypeError("HookState takes the communicator by name (e.g. 'allgather', with "
                            "communicator_options=...), so that the state can be pickled with a "
                            "checkpoint and rebuilt")
        self.compressor, self.memory, self.communicator_name = arguments.resolve(compressor, memory, communicator)
        self.communicator_options = dict(communicator_options or {})
        self.sends = list(sends) if sends is not None else None
        self.nonfinite = nonfinite
        self.names = guards.parameter_names(model) if model is not None else None
        #: Parameters frozen when the state was built: DDP does not reduce them (see _check_frozen).
        self._frozen = guards.frozen_parameters(model)
        self._conversion_check = guards.watch_conversion(model)
        self._know(model)
        self._dtypes = set()
        if model is not None:
            guards.refuse_sparse_gradients(model)
            self._dtypes = {p.dtype for p in model.parameters() if p.requires_grad}
        self.layouts: Dict[int, BucketKey] = {}
        self.loaded = ""
        self.process_group = process_group
        self._connect(process_group)
        self._advised: Optional[str] = None  # the recipe advice already given, not repeated
        # Without the optimizer, what can be judged alone: the dtypes, the memory and the ratio.
        self.check_optimizer(optimizer)

    def check_optimizer(self, optimizer: Optional[torch.optim.Optimizer]) -> Optional[str]:
        """Vet the optimizer that steps on this hook's averages, as ``DistributedOptimizer``
        vets the one it wraps: components that own the momentum (the ``dgc`` memory, SIGNUM)
        refuse one with its own (ValueError), and a setting that contradicts the compressor's
        recipe warns (:class:`~mergecomp.compressors.recipes.RecipeWarning`).  Returns the
        recipe's advice, or None."""
        message = gate.vet_optimizer(optimizer, self.compressor, self.memory, self._dtypes, warn=False)
        if optimizer is not None:
            self.lifecycle.meter.follow_optimizer(optimizer, self.memory)
            self.loop.watch(optimizer, self.compressor, self.memory)
        if message is not None and message != self._advised:
            recipes.warn(message)
            self._advised = message
        return message

    # -- the process-local half (rebuilt after unpickling) -------------------------------------
    def _connect(self, process_group) -> None:
        self.backend: Backend = TorchDistributedBackend(process_group)  # DDP runs on torch.distributed
        self.communicator = communicators.create(self.communicator_name, compressor=self.compressor,
                                                 memory=self.memory, backend=self.backend,
                                                 **self.communicator_options)
        meter = drift_meter(self.controller_setting)
        steering = [repr(meter.controller)] if self.controller_setting != "auto" else []
        self.config = gate.config_digest(self.compressor, self.memory, self.communicator, self.sends, self.nonfinite,
                                         *steering)  # the default keeps older configurations' digests
        self.lifecycle = StepLifecycle(self.communicator, self.backend, self.facts, self.nonfinite)
        self.lifecycle.meter = meter
        #: The loop's clipping seen between the step's end and the optimizer's step.
        self.loop = HookHandOver(self.lifecycle, self.backend)
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

    def _know(self, model: Optional[torch.nn.Module]) -> None:
        """Remember the model's parameter shapes and dtypes by name (to check a checkpoint's
        state against them) and the DDP wrapper, weakly (to tell its first iteration)."""
        from torch.nn.parallel import DistributedDataParallel
        module = getattr(model, "module", model)
        self._shapes = ({n: (p.shape, p.dtype) for n, p in module.named_parameters()}
                        if module is not None else {})
        self._ddp = weakref.ref(model) if isinstance(model, DistributedDataParallel) else None

    def facts(self) -> Dict[str, Any]:
        """What ranks must agree on besides the lifecycle's step count and epoch."""
        return {"config": self.config, "state": self.loaded}

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
        self.loop.know([view.name for view in layout], bucket.parameters())
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
        self.lifecycle.launch(index, buffer, layout, send, owner=_Bucket(future, layout=layout))
        self._started.add(index)

    def _begin_step(self, buffer: torch.Tensor) -> None:
        guards.check_frozen(self._frozen)
        if not self._registration_checked:
            guards.check_every_rank_registered(self.backend, buffer)
            self._registration_checked = True
        self.lifecycle.begin(self.steps, buffer.device)
        self.loop.begin_step()
        self._step_keys = {}
        self._started = set()
        self._deferred = []
        self._regather = bool(self.layouts) and self._ddp_first_iteration()

    def _sparse_error(self, bucket) -> ValueError:
        names = [self._name(param, bucket.index(), position)
                 for position, param in enumerate(bucket.parameters())]
        return guards.sparse_bucket_error(bucket.index(), names)

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
                self.lifecycle.launch(d.index, d.buffer, d.layout, "exact", owner=_Bucket(d.future, layout=d.layout))
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
                                  owner=_Bucket(None, pieces, names=[name for name, _ in key]))
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
        outcome = self.lifecycle.end_step(self._complete)
        self.loop.deliver(outcome.finite)  # scaled for the loop, then DDP's futures complete
        if self._step_keys != self.layouts:
            self._move_state(self._step_keys)
        self.lifecycle.count_step()
        self._steps_here += 1
        for d in deferred:
            d.future.set_result(d.buffer)
        self.lifecycle.close_step()

    def _complete(self, flight: InFlight, average: torch.Tensor, outcome: StepOutcome) -> None:
        """Hand a group's average to DDP: into the buckets it was gathered from, or as the
        result of its bucket's future (NaN for a dropped step: what an allreduce of a NaN
        gives), completed at the step's end."""
        bucket: _Bucket = flight.owner
        parts = []
        for source, at, offset, numel in bucket.pieces:
            parts.append(source.narrow(0, at, numel))
            parts[-1].copy_(average.narrow(0, offset, numel))
        if bucket.future is not None:
            result = average.view_as(flight.buffer)
            parts = [result.narrow(0, view.offset, view.shape.numel()) for view in bucket.layout]
            self.loop.complete(bucket.future, result)
        self.loop.hand(flight.send, parts, bucket.names)

    def _move_state(self, keys: Dict[int, BucketKey]) -> None:
        """DDP changed buckets: move per-bucket state to the new buckets by parameter.

        Runs between the steps' exchanges (at the end of a step, or before the first bucket
        of a held step is sent), when the state holds no step's uncommitted writes."""
        if not self.layouts:  # nothing was kept per bucket yet
            self.layouts = dict(keys)
            return
        sizes = {f"group{i}": sum(numel for _, numel in key) for i, key in self.layouts.items()}
        # The hierarchical exchange's per-shard state is folded into whole buckets to move,
        # and cut into shards again after (a collective inside each node, on every rank alike).
        held = self.lifecycle.fold_shard_state(self.communicator.state_dict(), sizes)
        moved = buckets.regrouped(held, self.layouts, keys, self.names is not None)
        self.layouts = dict(keys)
        self._connect_state(moved)
        if self.lifecycle.meter is not None:  # a bucket's name now stands for other parameters
            self.lifecycle.meter.regrouped(self.communicator.compressor, [f"group{i}" for i in sorted(keys)])
        sends = self.sends or ()
        self.lifecycle.spread_shard_state([
            (f"group{i}", sends[i] if i < len(sends) else "compress", sum(numel for _, numel in key))
            for i, key in sorted(keys.items())])

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
        return gate.seal_state("ddp", STATE_FORMAT, self.backend, self.config, self.lifecycle.state_dict(), {
            "communicator": self.communicator.state_dict(),
            "layouts": {i: [list(p) for p in key] for i, key in self.layouts.items()}})

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
                layouts = buckets.read_layouts(state.get("layouts", {}), where)
            except checkpoint.CheckpointError:
                checkpoint.verify(state, "hook state", source)  # names the damage, if sealed
                raise
            groups = buckets.group_specs(self._shapes, layouts)
            checkpoint.verify(state, "hook state", source, groups)
            gate.check_envelope(state, "ddp", STATE_FORMAT, self.backend, self.config, checkpoint.ADVICE,
                                described=f"{self.compressor!r}, {self.memory!r}, {self.communicator_name}")
            checkpoint.check_state(self.communicator, state.get("communicator", {}), groups, source)
            self.communicator.load_state_dict(state.get("communicator", {}))
        else:
            self._connect_state(None)
        self.lifecycle.load_state_dict(gate.lifecycle_state(state))
        self.layouts = layouts
        self.loaded = gate.config_digest(self.steps, self.config, sorted(self.layouts.items()))
        self._steps_here = 0

    def __getstate__(self) -> Dict[str, Any]:
        """Pickled with a checkpoint like PyTorch's ``PowerSGDState``: the configuration and
        the state, not the process group; unpickling reconnects to the default group."""
        kept = {k: v for k, v in self.__dict__.items()
                if k in ("compressor", "memory", "communicator_name", "communicator_options", "sends",
                         "nonfinite", "layouts", "loaded", "_dtypes", "controller_setting")}
        kept["lifecycle"] = self.lifecycle.state_dict()
        kept["state"] = checkpoint.seal(self.communicator.state_dict())
        kept["names"] = None  # ids of parameters mean nothing in another process
        return kept

    def __setstate__(self, kept: Dict[str, Any]) -> None:
        """Checks the compression state (checksum, finite values; its shapes are checked
        against the buckets when they arrive) before anything is rebuilt."""
        state = kept.pop("state")
        counters = gate.lifecycle_state(kept)
        for older in ("lifecycle", "steps", "epoch", "skipped_steps"):
            kept.pop(older, None)
        kept.setdefault("_dtypes", set())
        kept.setdefault("controller_setting", "auto")
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
        self.lifecycle.load_state_dict(counters)
        self.communicator.load_state_dict(state)

    def attach(self, model: torch.nn.Module) -> "HookState":
        """Name the parameters after unpickling (ids do not survive a restart); returns self."""
        self.names = guards.parameter_names(model)
        self._frozen = guards.frozen_parameters(model)
        if self._conversion_check is not None:
            self._conversion_check.remove()
        self._conversion_check = guards.watch_conversion(model)
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
