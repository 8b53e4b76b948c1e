"""DistributedOptimizer: compressed, fused, overlapped gradient exchange around any optimizer.

A thin facade over :class:`~mergecomp.runtime.reducer.Reducer` (which runs the exchange from
autograd hooks): it builds the components from names, checks that every rank holds the
same model and configuration, makes every rank start from rank 0's model, and adds the
wrapped optimizer's ``step()``.  The user's optimizer is wrapped, never replaced: this
object shares its ``param_groups`` and ``state``, so LR schedulers and checkpoints see one
optimizer.

After ``loss.backward()`` returns, ``p.grad`` holds the gradient averaged over all ranks,
as under DDP: clip it, unscale it (AMP's ``GradScaler``), then ``step()``.
"""
from __future__ import annotations

import contextlib
import time
import warnings
import zlib
from typing import Any, Dict, Iterable, Iterator, List, Optional, Tuple, Union

import torch

from . import checkpoint, communicators, arguments, compressors, schedulers
from .distributed.backends import Backend, default_backend
from .communicators.base import Communicator
from .compressors.base import Compressor
from .memories.base import Memory
from .plan import ParamInfo, Plan
from .runtime import gate
from .runtime.controller import DriftController
from .runtime.drift import drift_meter
from .runtime.reducer import GroupState, Reducer
from .runtime.step import SharedSurface, StepLifecycle, check_communicator_options, check_nonfinite_policy
from .schedulers.base import Scheduler, SchedulerContext
from .schedulers.fixed import FixedScheduler

#: How the groups are formed when the caller does not say: four groups balanced by bytes
#: (fusion of a few groups is what lets compression overlap backward; see docs/design.md).
DEFAULT_SCHEDULE = 4
#: Format of the ``"mergecomp"`` part of a state dict (3: the envelope every entry point shares,
#: :func:`mergecomp.runtime.gate.seal_state`; 2 and older are read too).
STATE_FORMAT = 3
Schedule = Union[int, str, Scheduler, Plan]


class DistributedOptimizer(SharedSurface, torch.optim.Optimizer):
    """Wraps ``optimizer`` so that gradients are averaged, compressed, over all ranks.

    Args:
        optimizer: any ``torch.optim.Optimizer``; its ``step()`` is called unchanged.
        named_parameters: ``model.named_parameters()``; names key the plan and the state
            dict.  Defaults to ``model``'s, else to ``param.<i>`` in the optimizer's order.
        model: the ``nn.Module`` being trained: its parameters are named from it, and its
            parameters *and buffers* are made equal on every rank at construction.
        compressor: a registered name or an instance (``"none"``: no compression).
        memory: error feedback: a name, an instance, or ``"auto"`` (the compressor's
            ``recommended_memory``); ``"none"`` is no error feedback.
        communicator: ``"allreduce"``, ``"allgather"``, ``"ps"``, a plugin name, an instance,
            or ``"auto"`` (the compressor's ``recommended_communicator``).
        schedule: how gradients are fused into groups and how each group is sent: an int
            (MergeComp's fusion-num: 0 layer-wise, 1 one group, y groups), a scheduler name
            (``"auto"``, ``"optimal"``, ``"bucket"``, ...) or instance, or a fixed
            :class:`~mergecomp.plan.Plan`.  Default: 4 groups.
        backward_passes_per_step: gradient accumulation: backward passes per ``step()``.
        find_unused_parameters: exchange a used-map each step so a parameter that got no
            gradient on any rank keeps ``grad = None``.  Off, it receives a zero gradient.
        initial_sync: ``"broadcast"`` (default: rank 0's parameters and buffers are copied
            to every rank, as DDP and Horovod do) or ``"check"`` (they must already be
            equal; a difference is an error naming the tensor).
        nonfinite: what a step whose gradient is NaN/Inf on any rank does: ``"skip"``
            (default: dropped on every rank, ``p.grad`` is NaN, compressor and error-feedback
            state stay as before it, a warning and :attr:`skipped_steps` say so; AMP's
            ``GradScaler`` then skips as usual), ``"raise"``, or ``"off"`` (unchecked, as DDP).
        controller: the quality controller (:mod:`mergecomp.runtime.drift`): ``"auto"`` (the
            default) measures how far the compressed exchange lags dense and raises a
            group's density (or rank) where it lags, within a byte budget; ``"off"`` only
            measures (the step log shows it, and a warning says when the run will miss
            dense); a :class:`~mergecomp.DriftController` with settings of your own.
        communicator_options: keyword arguments of the communicators a plan's
            ``"compress:<name>"`` groups travel by, per name (e.g. ``{"sparse_allreduce":
            {"keep": None}}``); see :mod:`mergecomp.plan`.
        backend: a collective backend; the torch.distributed default group if omitted.
    """

    def __init__(self, optimizer: torch.optim.Optimizer,
                 named_parameters: Optional[Iterable[Tuple[str, torch.nn.Parameter]]] = None,
                 compressor: Union[str, Compressor] = "none",
                 memory: Union[None, str, Memory] = "auto",
                 communicator: Union[None, str, Communicator] = "auto",
                 schedule: Optional[Schedule] = None,
                 *,
                 model: Optional[torch.nn.Module] = None,
                 backward_passes_per_step: int = 1,
                 find_unused_parameters: bool = False,
                 initial_sync: str = "broadcast",
                 nonfinite: str = "skip",
                 communicator_options: Optional[Dict[str, Dict[str, Any]]] = None,
                 controller: Union[str, None, DriftController] = "auto",
                 backend: Optional[Backend] = None):
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
        if isinstance(backward_passes_per_step, bool) or not isinstance(backward_passes_per_step, int) \
                or backward_passes_per_step < 1:
            raise ValueError(f"backward_passes_per_step must be an integer ≥ 1, got {backward_passes_per_step!r}")
        if initial_sync not in ("broadcast", "check"):
            raise ValueError(f"initial_sync must be 'broadcast' (copy rank 0's model to every rank) or "
                             f"'check' (require equal models), got {initial_sync!r}")
        check_nonfinite_policy(nonfinite)  # before any collective
        if model is not None and not isinstance(model, torch.nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        schedule = _check_schedule(schedule)
        super().__init__(optimizer.param_groups, optimizer.defaults)
        # Share, do not copy: LR schedulers and checkpoints act on the wrapped optimizer.
        self.optimizer = optimizer
        self._share_inner()

        self.backend = backend if backend is not None else default_backend()
        if named_parameters is None and model is not None:
            named_parameters = model.named_parameters()
        if named_parameters is not None:
            named_parameters = list(named_parameters)
        params = gate.trainable_parameters(optimizer, named_parameters)
        gate.check_same_parameters(self.backend, params)
        # What is watched for parameters that join the training later (_take_in_new_parameters).
        self._model = model
        self._given_names = {id(p): n for n, p in named_parameters or ()}
        self._frozen = [(n, p) for n, p in gate.named_in_optimizer(optimizer, self._given_names)
                        if not p.requires_grad]
        self._group_count = len(optimizer.param_groups)

        self.compressor, self.memory, communicator = arguments.resolve(compressor, memory, communicator)
        self.communicator = communicator if isinstance(communicator, Communicator) else communicators.create(
            communicator, compressor=self.compressor, memory=self.memory, backend=self.backend)
        # Components that own part of the update (DGC's or SIGNUM's momentum) vet the optimizer;
        # the compressor must carry the parameters' dtypes; its recipe may warn.
        gate.vet_optimizer(self.optimizer, self.compressor, self.memory, {p.dtype for _, p in params})
        fixed_plan = schedule if isinstance(schedule, Plan) else None
        if isinstance(schedule, int):
            schedule = FixedScheduler(schedule)
        elif isinstance(schedule, str):
            schedule = schedulers.create(schedule)
        elif fixed_plan is not None:
            schedule = FixedScheduler(DEFAULT_SCHEDULE)  # not used: the plan is fixed
        self.scheduler = schedule
        options = check_communicator_options(communicator_options)
        meter = drift_meter(controller)
        meter.follow_optimizer(self.optimizer, self.memory)
        steering = [repr(meter.controller)] if controller != "auto" else []
        config = gate.config_digest(self.compressor, self.memory, self.communicator, self.scheduler,
                                    backward_passes_per_step, bool(find_unused_parameters), nonfinite,
                                    *([options] if options else []), *steering)  # older ones keep their digest
        gate.check_ranks_agree(self.backend, "on the configuration at construction", {
            "compressor": repr(self.compressor), "memory": repr(self.memory),
            "communicator": repr(self.communicator), "scheduler": repr(self.scheduler),
            "controller": repr(meter.controller), "config": config})
        # Frozen parameters too: equal everywhere, they can be unfrozen later.
        gate.start_from_rank0(self.backend, params + self._frozen, model, initial_sync)
        self.reducer = Reducer(params, self.communicator, self.backend, self.scheduler, plan=fixed_plan,
                               backward_passes_per_step=backward_passes_per_step,
                               find_unused_parameters=bool(find_unused_parameters),
                               nonfinite=nonfinite, config=config, communicator_options=options)
        self.reducer.lifecycle.meter = meter
        # What an adaptive scheduler sees of this job, in place of the optimizer itself.
        self._scheduler_context = SchedulerContext(self.reducer, self.optimizer, self.backend, self.compressor,
                                                   self.communicator.memory, self.communicator)
        self._last_step_end: Optional[float] = None

    # ----------------------------------------------------------------- reducer surface --
    @property
    def plan(self) -> Optional[Plan]:
        return self.reducer.plan

    @property
    def lifecycle(self) -> StepLifecycle:
        """The step lifecycle the exchange runs through (its listeners, counters, epoch)."""
        return self.reducer.lifecycle

    @property
    def last_sync_time(self) -> float:
        """Seconds the last exchange's finishing took (groups, outcome, write-back)."""
        return self.reducer.last_sync_time

    def param_infos(self, order: Optional[List[str]] = None) -> List[ParamInfo]:
        """What a scheduler knows of each trainable parameter (default: plan order)."""
        return self.reducer.param_infos(order)

    def named_parameters(self) -> List[Tuple[str, torch.nn.Parameter]]:
        """The (name, parameter) pairs whose gradients are exchanged."""
        return list(self.reducer.params)

    def add_ready_listener(self, callback):
        """See :meth:`mergecomp.runtime.reducer.Reducer.add_ready_listener`."""
        return self.reducer.add_ready_listener(callback)

    def set_plan(self, plan: Plan) -> None:
        """See :meth:`mergecomp.runtime.reducer.Reducer.set_plan`."""
        self.reducer.set_plan(plan)

    # -------------------------------------------------------------------------- step --
    def synchronize(self) -> None:
        """Finish the exchange and write the averaged gradients into ``p.grad``.

        Backward already does this when it ends; calling it again is a no-op.  Without a
        backward pass since the last step it exchanges the current ``p.grad`` (missing
        gradients count as zero).
        """
        self.reducer.synchronize()

    def step(self, closure=None):
        """Apply the averaged gradients with the wrapped optimizer's ``step()``.

        A step that every rank agreed to drop (a NaN/Inf gradient somewhere) is skipped.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        outcome = self.reducer.synchronize()
        self._drop_unexchanged(self._take_in_new_parameters())
        self._watch_clipping()
        applied = outcome.finite and outcome.active_ranks > 0
        if applied:
            self.optimizer.step()
        self.reducer.step_done(applied)
        self._after_step()
        return loss

    def _watch_clipping(self) -> None:
        """What the loop did to the averages between the exchange and ``step()``, for the
        memories that follow its clipping (:mod:`mergecomp.runtime.handover`)."""
        self.reducer.hand_over.settle(self.reducer.groups, self.compressor, self.communicator.memory)

    def _after_step(self) -> None:
        """Let an adaptive scheduler (auto, binary) measure this step and switch plans."""
        if not getattr(self.scheduler, "adaptive", False):
            return
        now = time.perf_counter()
        seconds = None if self._last_step_end is None else now - self._last_step_end
        self.scheduler.after_step(self._scheduler_context, seconds)
        self._last_step_end = time.perf_counter()

    def restart_step_clock(self) -> None:
        """Do not count the time since the last ``step()`` as a training step.

        Adaptive schedulers (``auto``, ``binary``) time each step from the end of the one
        before; call this on every rank after a pause (evaluation, checkpointing, another
        model's steps) so the pause is not taken for a slow plan.
        """
        self._last_step_end = None

    @contextlib.contextmanager
    def join(self) -> Iterator[None]:
        """For ranks with different numbers of batches (DDP's ``Join``): wrap the loop.

        Every rank must enter it.  A rank whose loop ends first keeps taking part in the
        others' exchanges with a zero gradient and applies the same averaged updates, so
        all ranks keep the same model; the block exits on every rank once every rank's loop
        has ended.  Averages are over all ranks (a rank that has joined contributes zero).
        """
        reducer = self.reducer
        with reducer.joined():
            yield
            try:
                while True:
                    self.optimizer.zero_grad(set_to_none=True)
                    outcome = reducer.synchronize(active=False)
                    if outcome.active_ranks == 0:
                        reducer.step_done(applied=False)
                        break
                    self.step()
            finally:
                self.optimizer.zero_grad(set_to_none=True)

    def add_param_group(self, param_group: Dict[str, Any]) -> None:
        """Add a param group to the wrapped optimizer; its trainable parameters are exchanged
        from the next backward on.  Call it on every rank alike, between steps."""
        if not hasattr(self, "optimizer"):  # torch.optim.Optimizer.__init__ building the groups
            return super().add_param_group(param_group)
        if self.reducer.in_iteration():
            raise RuntimeError("add_param_group() must be called between steps, not during backward")
        self.optimizer.add_param_group(param_group)
        self._take_in_new_parameters()

    def _take_in_new_parameters(self) -> List[str]:
        """Parameters the optimizer steps but the exchange does not know yet join the exchange.

        A layer unfrozen during training (``requires_grad_(True)``) or a param group added to
        the wrapped optimizer would otherwise be stepped with each rank's own gradient, and
        the ranks' models would drift apart.  The usual case costs one length and one flag
        per frozen parameter: only when the optimizer's groups or a frozen parameter changed
        are the parameters walked.  Returns the names taken in.
        """
        if len(self.optimizer.param_groups) == self._group_count and \
                not any(p.requires_grad for _, p in self._frozen):
            return []
        self._group_count = len(self.optimizer.param_groups)
        known = {id(p) for _, p in self.reducer.params}
        names = dict(self._given_names)
        if self._model is not None:
            names.update((id(p), n) for n, p in self._model.named_parameters())
        new, frozen = [], []
        for name, p in gate.named_in_optimizer(self.optimizer, names):
            if id(p) not in known:
                (new if p.requires_grad else frozen).append((name, p))
        self._frozen = frozen
        if new:
            compressors.check_dtypes(self.compressor, sorted({p.dtype for _, p in new}, key=str))
            self.reducer.add_params(new)
        return [n for n, _ in new]

    def _drop_unexchanged(self, names: List[str]) -> None:
        """Parameters that joined after this step's backward began hold a gradient no other
        rank saw: it is not applied (``grad = None``, which the optimizer skips); they are
        exchanged from the next step on."""
        by_name = dict(self.reducer.params)
        dropped = [n for n in names if by_name[n].grad is not None]
        for name in dropped:
            by_name[name].grad = None
        if dropped:
            warnings.warn(
                f"mergecomp: parameter(s) {dropped[:5]}{'...' if len(dropped) > 5 else ''} started "
                "requiring gradients (or were added to the optimizer) after this step's backward began: "
                "their gradients were not averaged over ranks, so this step does not apply them; from "
                "the next step on they are exchanged. Unfreeze layers or add param groups before "
                "zero_grad() (between step() and the next backward) to lose no step.",
                RuntimeWarning, stacklevel=3)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)
        self.reducer.zero_grad_called()
        if not self.reducer.in_iteration():
            self._take_in_new_parameters()

    # -------------------------------------------------------------------------- state --
    def state_dict(self) -> Dict[str, Any]:
        """The wrapped optimizer's state plus this rank's plan, residuals and compressor state.

        Memories hold per-rank residuals: save one file per rank.  The state records the
        rank, the world size and the configuration it belongs to, and
        :meth:`load_state_dict` refuses a file of another.  The ``"mergecomp"`` part is
        sealed with a checksum (:mod:`mergecomp.checkpoint`) that loading verifies.
        """
        reducer = self.reducer
        return {
            "optimizer": self.optimizer.state_dict(),
            "mergecomp": gate.seal_state("wrapper", STATE_FORMAT, self.backend, reducer.config,
                                         self.lifecycle.state_dict(), {
                                             "plan": reducer.plan.to_dict() if reducer.plan is not None else None,
                                             "communicator": reducer.compression_state(),  # raw groups share its memory
                                         }),
        }

    def _share_inner(self) -> None:
        """Point at the wrapped optimizer's param_groups and state (its load_state_dict
        replaces both objects, which would leave LR schedulers editing stale dicts)."""
        self.param_groups = self.optimizer.param_groups
        self.state = self.optimizer.state

    def load_state_dict(self, state_dict: Dict[str, Any], restore_compression: bool = True) -> None:
        """Restore a state saved by :meth:`state_dict` on this rank of a run like this one.

        No collective runs here, so a checkpoint loaded on some ranks only cannot hang: the
        next step finds the ranks disagree and says so on every rank.  To resume on another
        number of ranks (residuals are per rank), pass ``restore_compression=False``: the
        wrapped optimizer's state and the step count are restored, compression state starts
        afresh (error feedback restarts from zero, which is safe).

        Compression state is checked before anything is loaded (:mod:`mergecomp.checkpoint`):
        its checksum, finite values, and the shapes and dtypes this run's groups need; the
        wrapped optimizer's state must be finite too (it steps the parameters next); a
        refusal (:class:`~mergecomp.checkpoint.CheckpointError`) names the tensor and the
        file (when read with :func:`mergecomp.load`), and leaves this optimizer as it was.
        """
        reducer = self.reducer
        if reducer.in_iteration():
            raise RuntimeError("load_state_dict() must be called between steps, not during backward")
        if "mergecomp" not in state_dict:  # a plain optimizer checkpoint
            gate.check_finite_state(state_dict, "the wrapped optimizer's state", None)
            self.optimizer.load_state_dict(state_dict)
            self._share_inner()
            reducer.note_loaded(_state_digest(self.optimizer.state_dict()))
            return
        ours = state_dict["mergecomp"]
        plan = None
        if restore_compression:
            plan = self._checked_compression_state(ours)
        # What steps the parameters next (Adam's moments, a momentum buffer) must be finite too.
        gate.check_finite_state(state_dict.get("optimizer", {}), "the wrapped optimizer's state",
                                ours.get(checkpoint.SOURCE))
        self.optimizer.load_state_dict(state_dict["optimizer"])
        self._share_inner()
        if restore_compression:
            if plan is not None:
                reducer.install_plan(plan)
            reducer.load_compression_state(ours.get("communicator", {}))
        counters = gate.lifecycle_state(ours)
        self.lifecycle.load_state_dict(counters)
        reducer.note_loaded(_state_digest(state_dict["optimizer"], ours.get("config"), counters["steps"]),
                            steps=int(counters["steps"] or 0))

    def _checked_compression_state(self, ours: Dict[str, Any]) -> Optional[Plan]:
        """Every check of the checkpoint's compression state, before anything changes:
        checksum, rank/world size/configuration, the plan against this model, values and
        shapes.  Returns the checkpoint's plan (None if it was saved before the first step)."""
        source = ours.get(checkpoint.SOURCE)
        plan, problem = self.reducer.plan, None
        if ours.get("plan") is not None:
            try:
                plan = Plan.from_dict(ours["plan"])
                plan.validate((n for n, _ in self.reducer.params), self.reducer.numels)
            except ValueError as error:
                plan, problem = None, error
        by_name = dict(self.reducer.params)
        groups = {}
        for index, group in enumerate(plan.groups if plan is not None else ()):
            state = GroupState(index, group, by_name)
            groups[state.name] = checkpoint.GroupSpec(state.numel, state.params[0][1].dtype, state.layout)
        checkpoint.verify(ours, "compression state", source, groups)
        gate.check_envelope(ours, "wrapper", STATE_FORMAT, self.backend, self.reducer.config, checkpoint.ADVICE,
                            described=f"compressor {self.compressor!r}, memory {self.memory!r}, communicator "
                                      f"{type(self.communicator).__name__}, scheduler {self.scheduler!r}")
        if problem is not None:
            raise checkpoint.CheckpointError(
                f"{checkpoint.describe_source(source)}: its plan does not fit this model: {problem}")
        checkpoint.check_state(self.communicator, ours.get("communicator", {}), groups, source)
        return plan if ours.get("plan") is not None else None

    def remove_hooks(self) -> None:
        """Detach from the parameters (e.g. before wrapping them again)."""
        self.reducer.remove_hooks()

    def __repr__(self) -> str:
        return (f"DistributedOptimizer({type(self.optimizer).__name__}, {self.communicator!r}, "
                f"scheduler={self.scheduler!r}, ranks={self.backend.size})")


def _check_schedule(schedule: Optional[Schedule]) -> Schedule:
    """The schedule, or the default when None; a value of another kind is an error."""
    if schedule is None:
        return DEFAULT_SCHEDULE
    if isinstance(schedule, bool) or not isinstance(schedule, (int, str, Scheduler, Plan)):
        raise TypeError(f"schedule must be a fusion-num (int), a scheduler name, a Scheduler or a Plan, "
                        f"got {schedule!r}")
    if isinstance(schedule, int) and schedule < 0:
        raise ValueError(f"schedule as a fusion-num must be ≥ 0 (0 layer-wise, 1 one group, y groups), "
                         f"got {schedule}")
    return schedule


def _state_digest(*parts: Any) -> str:
    """A digest of loaded state that is equal on ranks that loaded equal files."""

    def fold(value) -> str:
        if isinstance(value, torch.Tensor):
            t = value.detach()
            if t.is_floating_point() or t.is_complex():
                return f"T{tuple(t.shape)}:{float(t.double().sum()) if t.numel() else 0.0!r}"
            return f"T{tuple(t.shape)}:{int(t.long().sum()) if t.numel() else 0}"
        if isinstance(value, dict):
            return "{" + ",".join(f"{k!r}:{fold(v)}" for k, v in sorted(value.items(), key=lambda kv: repr(kv[0]))) + "}"
        if isinstance(value, (list, tuple)):
            return "[" + ",".join(fold(v) for v in value) + "]"
        return repr(value)

    return f"{zlib.crc32(''.join(fold(p) for p in parts).encode()):08x}"
