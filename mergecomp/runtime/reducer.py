"""The Reducer: runs a plan's exchange during backward and writes the averages into ``p.grad``.

The wrapper's entry point into the step lifecycle (:mod:`mergecomp.runtime.step`, which
the DDP hook shares): what is particular to autograd hooks and plans lives here, what every
step does (preflight, launching, finishing, the outcome, commit or rollback, the non-finite
policy, the messages) lives there.  :class:`~mergecomp.optimizer.DistributedOptimizer` is a
thin facade over this class (it adds the wrapped optimizer's ``step``).

1. Construction registers a post-accumulate-grad hook on every trainable parameter.
2. First iteration (recording): the hooks only note the order in which gradients become
   ready.  When backward ends, rank 0 turns that order into a :class:`~mergecomp.plan.Plan`
   with the scheduler and broadcasts it; the groups are then sent at once.
3. Every backward pass, the first ready gradient launches the *preflight* (one tiny
   allreduce of a hash of what ranks must agree on: the plan, the step, the epoch, the
   configuration) and queues a callback for the end of backward.  When the last gradient
   of a group is ready (after ``backward_passes_per_step`` passes), its gradients are
   copied into the group's flat buffer and the lifecycle launches it (compress +
   collective, asynchronously) while backward continues.
   Groups launch strictly in plan order — a group that completes early waits for the ones
   before it — so every rank issues the same collectives in the same order even when a
   parameter gets no gradient on some rank.  A parameter the plan slices completes one
   piece of each group it is in.
4. When backward ends (on the last of ``backward_passes_per_step`` passes), whatever is
   left is launched (missing gradients count as zero) and the lifecycle ends the step: the
   groups finish in launch order, the ranks settle the outcome, state is committed or
   rolled back, and each average (NaN for a dropped step) is written into ``p.grad``.  So,
   as under DDP, ``p.grad`` holds the averaged gradient as soon as ``backward()`` returns:
   clipping it and AMP's ``GradScaler`` (which skips ``step()`` on NaN/Inf) work unchanged.
"""
from __future__ import annotations

import contextlib
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch.utils.hooks import RemovableHandle

from .agreement import StepOutcome
from ..distributed.backends import Backend
from ..distributed.backends.expect import STRING
from ..communicators.base import Communicator
from ..compressors.base import GroupLayout, ParamView
from ..plan import Group, ParamInfo, Plan
from .handover import LoopHandOver
from .plans import PlanHolder
from .step import InFlight, Listeners, SharedSurface, StepLifecycle
from ..schedulers.base import Scheduler


class GroupState:
    """Runtime state of one planned group: its parameters (or slices of them), buffer and progress."""

    def __init__(self, index: int, group: Group, by_name: Dict[str, torch.nn.Parameter]):
        self.index = index
        self.name = f"group{index}"
        self.send = group.send
        #: (name, parameter, first element, end element) per member, in buffer order.
        self.members = [(n, by_name[n], start, stop)
                        for n, start, stop in group.pieces({n: by_name[n].numel() for n in group.names})]
        self.params = [(n, p) for n, p, _, _ in self.members]
        self.offsets = []
        views = []
        offset = 0
        for name, p, start, stop in self.members:
            self.offsets.append(offset)
            whole = stop - start == p.numel()
            views.append(ParamView(name if whole else f"{name}[{start}:{stop}]",
                                   p.shape if whole else torch.Size([stop - start]), offset))
            offset += stop - start
        self.numel = offset
        #: The per-parameter views of the buffer, handed to the compressor.
        self.layout: GroupLayout = tuple(views)
        self.buffer: Optional[torch.Tensor] = None
        self.remaining = 0

    def gather(self) -> torch.Tensor:
        """Copy the parameters' gradients into the flat buffer (zeros where there is none)."""
        first = self.params[0][1]
        if self.buffer is None:
            self.buffer = torch.empty(self.numel, dtype=first.dtype, device=first.device)
        for (name, p, start, stop), offset in zip(self.members, self.offsets):
            part = self.buffer.narrow(0, offset, stop - start)
            if p.grad is None:
                part.zero_()
            elif p.grad.is_sparse:
                raise ValueError(f"parameter {name!r} has a sparse gradient, which mergecomp does "
                                 "not compress; build the layer with sparse=False")
            elif p.grad.data_ptr() == part.data_ptr():  # the grad is already this part
                continue
            elif p.grad.dtype != part.dtype or p.grad.device != part.device:
                raise self._moved_error(name, p, part)
            elif stop - start < p.numel():  # a slice: its elements of the flattened gradient
                part.copy_(p.grad.reshape(-1)[start:stop])
            else:
                part.copy_(p.grad.reshape(-1))
        return self.buffer

    def _moved_error(self, name: str, p: torch.nn.Parameter, part: torch.Tensor) -> RuntimeError:
        """A parameter converted after the plan was made (``model.to(torch.float64)``, a move
        to another device): its group's buffer and error-feedback state are of the old kind,
        and its gradient would be cast to it without a word."""
        return RuntimeError(
            f"parameter {name!r} is now {p.grad.dtype} on {p.grad.device}, but it was {part.dtype} on "
            f"{part.device} when the exchange was planned (group {self.index}): the model was converted "
            "or moved after DistributedOptimizer was built. Convert or move the model first "
            "(model.to(...)), then build the optimizer and DistributedOptimizer around it.")


class Reducer(SharedSurface, PlanHolder):
    """Runs the exchange of ``named_params``' gradients by a plan, from autograd hooks.

    Args:
        named_params: (name, parameter) of every trainable parameter, in a fixed order that
            is the same on every rank.
        communicator: carries compressed groups; raw groups get an allreduce sharing its
            memory.
        backend: the collective layer.
        scheduler: plans from the first backward's order (rank 0) unless ``plan`` is given.
        plan: a fixed plan.
        backward_passes_per_step: gradient accumulation: backward passes per step.
        find_unused_parameters: keep ``grad = None`` for a parameter no rank used.
        nonfinite: the policy for a step whose gradient is NaN/Inf on some rank
            (:data:`~mergecomp.runtime.step.NONFINITE_POLICIES`, applied by the lifecycle).
        config: what ranks must agree on about the configuration (checked every step).
    """

    def __init__(self, named_params: Sequence[Tuple[str, torch.nn.Parameter]], communicator: Communicator,
                 backend: Backend, scheduler: Scheduler, plan: Optional[Plan] = None,
                 backward_passes_per_step: int = 1, find_unused_parameters: bool = False,
                 nonfinite: str = "skip", config: str = "",
                 communicator_options: Optional[Dict[str, Dict[str, Any]]] = None):
        self.params = list(named_params)
        if not self.params:
            raise ValueError("no trainable parameters to exchange: every parameter has requires_grad=False")
        self.position = {name: i for i, (name, _) in enumerate(self.params)}
        self.numels = {name: p.numel() for name, p in self.params}
        self.device = self.params[0][1].device
        self.communicator = communicator
        self.backend = backend
        self.scheduler = scheduler
        self.backward_passes_per_step = backward_passes_per_step
        self.find_unused_parameters = find_unused_parameters
        self.config = config
        self.lifecycle = StepLifecycle(communicator, backend, self.facts, nonfinite, communicator_options)

        self.plan: Optional[Plan] = None
        self._plan_digest: Optional[str] = None
        self.groups: List[GroupState] = []
        self._group_of: Dict[str, List[GroupState]] = {}
        self._ready_order: List[str] = []
        self._passes: Dict[str, int] = {name: 0 for name, _ in self.params}
        self._next_launch = 0
        self._backward_passes = 0
        self._in_backward = False
        #: True once this step's averages are in ``p.grad`` (until the next backward).
        self.synchronized = False
        self._awaiting_step = False
        self._written: Dict[str, torch.Tensor] = {}
        #: Digest of the last loaded state (ranks must have loaded alike).
        self.loaded = ""
        #: Parameters taken in after construction (:meth:`add_params`), in order.
        self.added: List[str] = []
        #: Inside ``join()`` (on every rank): each step says how many ranks still train.
        self.joining = False
        self.last_outcome: Optional[StepOutcome] = None
        #: Seconds the last synchronisation took (finishing groups, outcome, write-back).
        self.last_sync_time = 0.0
        self.ready_listeners = Listeners()
        #: The averages' way to the optimizer for memories that follow the loop's clipping.
        self.hand_over = LoopHandOver(self.lifecycle, backend)
        if plan is not None:
            self.install_plan(plan, check_ranks=True)
        self._hooks = [p.register_post_accumulate_grad_hook(self._make_hook(name))
                       for name, p in self.params]

    # ------------------------------------------------------------------ public surface --
    def param_infos(self, order: Optional[Sequence[str]] = None) -> List[ParamInfo]:
        """What a scheduler knows of each parameter, in ``order`` (default: plan order, or
        definition order before the first plan)."""
        if order is None:
            order = self.plan.order() if self.plan is not None else [n for n, _ in self.params]
        by_name = dict(self.params)
        return [ParamInfo(n, by_name[n].numel(), str(by_name[n].dtype), str(by_name[n].device),
                          by_name[n].element_size()) for n in order]

    def add_ready_listener(self, callback: Callable[[str], None]) -> RemovableHandle:
        """Call ``callback(name)`` whenever a parameter's gradient is ready; ``.remove()`` the
        handle to stop."""
        return self.ready_listeners.add(callback)

    @property
    def steps(self) -> int:
        """Steps applied (counted through :meth:`step_done`)."""
        return self.lifecycle.steps

    def facts(self) -> Dict[str, Any]:
        """What every rank must agree on before a step's exchange besides the lifecycle's
        step count and epoch (see mergecomp.runtime.agreement)."""
        facts = {"plan": self._plan_digest,
                 "config": self.config, "state": self.loaded}
        if self.added:
            facts["added"] = self.added
        return facts

    def install_plan(self, plan: Plan, check_ranks: bool = False) -> None:
        """Check the plan against the model (and, with ``check_ranks``, across ranks by
        digest: a collective), then build the groups."""
        plan.validate((n for n, _ in self.params), self.numels)
        if check_ranks:
            digests = self.backend.allgather_object(plan.digest(), expect=STRING)
            if len(set(digests)) != 1:
                raise ValueError(f"ranks were given different plans (digests {digests}); load "
                                 "the same plan on every rank or let rank 0 plan")
        for send in dict.fromkeys(g.send for g in plan.groups):
            self.lifecycle.communicator_for(send)  # a mode that cannot be built fails here, not mid-step
        by_name = dict(self.params)
        groups = [GroupState(i, g, by_name) for i, g in enumerate(plan.groups)]
        for group in groups:
            kinds = {(str(p.dtype), str(p.device)) for _, p in group.params}
            if len(kinds) > 1:
                raise ValueError(f"plan group {group.index} mixes dtypes/devices {sorted(kinds)}; "
                                 "a fused buffer needs one of each")
        if self.plan is not None and self.lifecycle.meter is not None:
            self.lifecycle.meter.regrouped(self.communicator.compressor, [g.name for g in groups])
        self.plan, self.groups = plan, groups
        self._plan_digest = plan.digest()  # what ranks agree on each step: computed once per plan
        # A sliced parameter is in several groups: its gradient completes a piece of each.
        self._group_of = {}
        for group in self.groups:
            for n, _ in group.params:
                self._group_of.setdefault(n, []).append(group)
        self._reset_iteration()

    def in_iteration(self) -> bool:
        """Whether a step's exchange is under way (between its first gradient and its end)."""
        return any(self._passes.values()) or self._next_launch > 0 or self._in_backward

    def _reset_iteration(self) -> None:
        for group in self.groups:
            group.remaining = len(group.members) * self.backward_passes_per_step
        for name in self._passes:
            self._passes[name] = 0
        self._next_launch = 0
        self._backward_passes = 0

    # --------------------------------------------------------------------------- hooks --
    def _make_hook(self, name: str):
        def hook(param: torch.nn.Parameter) -> None:
            self._on_gradient_ready(name)
        return hook

    def _on_gradient_ready(self, name: str) -> None:
        if not self._in_backward:
            self._begin_backward_pass(name)
        if self.ready_listeners:
            self.ready_listeners(name)
        passes = self._passes[name] + 1
        if passes > self.backward_passes_per_step:
            raise RuntimeError(
                f"parameter {name!r} received gradient {passes} times since the last step, "
                f"but backward_passes_per_step={self.backward_passes_per_step}. Call step() after "
                f"each {self.backward_passes_per_step} backward pass(es), or raise "
                "backward_passes_per_step to the number of passes you accumulate.")
        self._passes[name] = passes
        if self.plan is None:
            if passes == 1:
                self._ready_order.append(name)
            return
        complete = False
        for group in self._group_of[name]:
            group.remaining -= 1
            complete = complete or group.remaining == 0
        if complete:
            try:
                self._launch_ready_groups()
            except BaseException:  # a disagreement, a lost peer: nothing of the step is kept
                self.lifecycle.abort()
                self._reset_iteration()
                self._in_backward = False
                raise

    def _begin_backward_pass(self, name: str) -> None:
        """First gradient of a backward pass: check the step is a fresh one, launch the
        preflight (on the first pass of a step), and ask autograd to call us at its end."""
        if self._awaiting_step and self._backward_passes == 0:
            grad = dict(self.params)[name].grad
            if grad is not None and grad is self._written.get(name):
                raise RuntimeError(
                    f"a new backward pass started while p.grad still holds the averaged gradient of "
                    f"the previous {self.backward_passes_per_step} (backward_passes_per_step="
                    f"{self.backward_passes_per_step}; no step() and no zero_grad() in between). To "
                    "accumulate gradients over k backward passes, pass backward_passes_per_step=k; "
                    "after a step that was skipped (e.g. GradScaler found inf), call "
                    "optimizer.zero_grad() first.")
        self._awaiting_step = False
        self._written = {}
        self.synchronized = False
        self._in_backward = True
        if self._backward_passes == 0 and not self.lifecycle.in_step:
            self.lifecycle.begin(self.steps, self.device)
        torch.autograd.Variable._execution_engine.queue_callback(self._backward_done)

    def _backward_done(self) -> None:
        """Autograd's callback at the end of a backward pass."""
        self._in_backward = False
        self._backward_passes += 1
        if self._backward_passes >= self.backward_passes_per_step:
            self.synchronize()

    def _launch_ready_groups(self) -> None:
        """Launch complete groups in plan order; stop at the first incomplete one."""
        while self._next_launch < len(self.groups) and self.groups[self._next_launch].remaining == 0:
            self._launch(self.groups[self._next_launch])

    def _launch(self, group: GroupState) -> None:
        started = time.perf_counter()
        # The buffer is ours and not read after the launch: lend it for the result.
        self.lifecycle.launch(group.index, group.gather(), group.layout, group.send, lend=True, owner=group,
                              since=started)
        group.remaining = -1  # launched
        self._next_launch += 1

    # -------------------------------------------------------------------------- step --
    @torch.no_grad()
    def synchronize(self, active: bool = True) -> StepOutcome:
        """Finish every group, settle the step's outcome with every rank, write ``p.grad``.

        Runs by itself when backward ends; call it yourself only to exchange without a
        backward pass (``active=False`` for a rank that has run out of data, see ``join``).
        Returns the outcome every rank agreed on.
        """
        if self.synchronized:
            return self.last_outcome
        started = time.perf_counter()
        try:
            if not self.lifecycle.in_step:  # no backward began it
                self.lifecycle.begin(self.steps, self.device)
            if self.plan is None:
                self.lifecycle.check_preflight()
                self.install_plan(self._make_plan())
            while self._next_launch < len(self.groups):
                self._launch(self.groups[self._next_launch])
            used = self._used_map() if self.find_unused_parameters else None
            outcome = self.lifecycle.end_step(self._write_back, active=active, used=used, joining=self.joining)
        except BaseException:
            self.lifecycle.abort()
            raise
        self._reset_iteration()
        self.synchronized = True
        self._awaiting_step = True
        self.last_outcome = outcome
        self.hand_over.deliver(self.groups, outcome.finite)
        self.last_sync_time = time.perf_counter() - started
        # Last, once the step is closed: a caller that catches a NonFiniteGradient can
        # zero_grad() and go on, as after a warning.
        self.lifecycle.close_step(self.params)
        return outcome

    @property
    def clip_watch(self):
        """The hand-over's :class:`~mergecomp.runtime.drift.ClipWatch`."""
        return self.hand_over.watch

    def _used_map(self) -> torch.Tensor:
        """1 where this rank has a gradient, per parameter, on the parameters' device."""
        used = torch.tensor([p.grad is not None for _, p in self.params], dtype=torch.float32)
        return used.to(self.device)

    def _write_back(self, flight: InFlight, averaged: torch.Tensor, outcome: StepOutcome) -> None:
        """Hand the averaged gradient to the parameters (the lifecycle's ``deliver``).

        A dropped step's average is NaN and goes to every parameter of the group, so the
        caller and ``GradScaler`` see the step is bad; a step in which no rank trains any
        more (the end of ``join``) writes nothing.

        A raw group is averaged in place in its own flat buffer, which nothing touches
        until the next step's gather: each ``p.grad`` becomes a view of its part, saving a
        copy of every raw gradient per step (DDP's ``gradient_as_bucket_view``).  The
        caller's ``zero_grad()`` then drops the views (or zeroes them, with
        ``set_to_none=False``, and backward accumulates into the buffer, which the gather
        recognises).  A gradient kept across steps without ``clone()`` sees the next step's
        values, as under DDP's bucket views.  A compressed group's average lands in its
        buffer too: written there by the communicator when it can (the buffer is lent to
        ``start``), else copied there (the compressor may keep the tensor it decoded), so
        its parameters get views alike.  A slice of a parameter is
        copied into its part of ``p.grad`` (every group is gathered before the first is
        written back, so no group reads another's average).
        """
        if outcome.finite and outcome.active_ranks == 0:
            return
        group: GroupState = flight.owner
        used = outcome.used if outcome.finite else None
        flat = averaged.reshape(-1)
        own_buffer = group.buffer is not None and flat.data_ptr() == group.buffer.data_ptr() \
            and flat.numel() == group.buffer.numel()
        if (not own_buffer and group.buffer is not None and flat.numel() == group.buffer.numel()
                and flat.dtype == group.buffer.dtype):
            # A compressed group's average in a tensor of its own: into the group's buffer,
            # which nothing needs after the launch, so p.grad gets views as for raw groups
            # instead of a new tensor per parameter and step.
            flat = group.buffer.copy_(flat)
            own_buffer = True
        positions = used.tolist() if used is not None else None
        for (name, p, start, stop), offset in zip(group.members, group.offsets):
            if positions is not None and positions[self.position[name]] == 0:
                continue
            if stop - start < p.numel():  # a slice: the other groups write the rest
                if p.grad is None:
                    p.grad = torch.zeros(p.shape, dtype=p.dtype, device=p.device)
                elif not p.grad.is_contiguous():
                    p.grad = p.grad.contiguous()
                p.grad.view(-1)[start:stop].copy_(flat.narrow(0, offset, stop - start))
            else:
                value = flat.narrow(0, offset, p.numel()).view_as(p)
                if own_buffer:
                    p.grad = value
                elif p.grad is None:
                    p.grad = value.clone()
                else:
                    p.grad.copy_(value)
            self._written[name] = p.grad

    @contextlib.contextmanager
    def joined(self):
        """Inside ``join()`` (on every rank): each step's outcome counts the ranks still
        training, even with ``nonfinite="off"``."""
        self.joining = True
        try:
            yield
        finally:
            self.joining = False

    def note_loaded(self, digest: str, steps: Optional[int] = None) -> None:
        """A checkpoint was loaded (between steps): ranks must have loaded alike (``digest``
        joins the facts); ``steps``, when it holds a step count, continues it."""
        self.loaded = digest
        if steps is not None:
            self.lifecycle.steps = steps
            self.synchronized = False

    def zero_grad_called(self) -> None:
        """The owner's ``zero_grad()`` ran: a new backward pass is a new step."""
        self._awaiting_step = False

    def step_done(self, applied: bool) -> None:
        """The owner's step is over (``applied``: its optimizer stepped): the next exchange,
        with or without a backward pass, is a new step."""
        if applied:
            self.lifecycle.count_step()
        self._awaiting_step = False
        self.synchronized = False

    def remove_hooks(self) -> None:
        """Detach from the parameters (e.g. before wrapping them again)."""
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
