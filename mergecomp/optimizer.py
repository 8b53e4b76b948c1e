"""DistributedOptimizer: compressed, fused, overlapped gradient exchange around any optimizer.

Read top to bottom, this module is the whole integration:

1. Construction registers a post-accumulate-grad hook on every trainable parameter and
   checks that all ranks hold the same model.
2. First iteration (recording): the hooks only note the order in which gradients become
   ready.  At ``step()`` rank 0 turns that order into a :class:`~mergecomp.plan.Plan`
   with the scheduler and broadcasts it; the groups are then sent synchronously.
3. Later iterations: when the last gradient of a group is ready (after
   ``backward_passes_per_step`` passes), its gradients are copied into the group's flat
   buffer and the communicator starts compress + collective asynchronously, while
   backward continues.  Groups launch strictly in plan order — a group that completes
   early waits for the ones before it — so every rank issues the same collectives in
   the same order even when a parameter gets no gradient on some rank.  A parameter the
   plan slices (a large tensor sent in chunks) completes one piece of each group it is in.
4. ``step()`` launches whatever is left (missing gradients count as zero), finishes the
   groups in launch order, writes the averages into ``p.grad`` and calls the wrapped
   optimizer's own ``step()``.

The user's optimizer is wrapped, never replaced: this object shares its ``param_groups``
and ``state``, so LR schedulers and checkpoints see one optimizer.
"""
from __future__ import annotations

import collections
import contextlib
import time
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple, Union

import torch

from . import communicators, compressors, memories, schedulers
from .backends import Backend, default_backend
from .communicators.base import Communicator, Handle
from .compressors.base import Compressor
from .memories.base import Memory
from .plan import Group, ParamInfo, Plan
from .regroup import Layout, regroup_state
from .schedulers.base import Scheduler
from .schedulers.fixed import FixedScheduler


class _GroupState:
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
        offset = 0
        for _, _, start, stop in self.members:
            self.offsets.append(offset)
            offset += stop - start
        self.numel = offset
        self.buffer: Optional[torch.Tensor] = None
        self.remaining = 0
        self.handle: Optional[Handle] = None

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
            elif stop - start < p.numel():  # a slice: its elements of the flattened gradient
                part.copy_(p.grad.reshape(-1)[start:stop])
            elif p.grad.data_ptr() != part.data_ptr():  # equal: the grad is already this part
                part.copy_(p.grad.reshape(-1))
        return self.buffer


class DistributedOptimizer(torch.optim.Optimizer):
    """Wraps ``optimizer`` so that ``step()`` first averages compressed gradients over all ranks.

    Args:
        optimizer: any ``torch.optim.Optimizer``; its ``step()`` is called unchanged.
        named_parameters: ``model.named_parameters()``; names key the plan and the state
            dict.  Defaults to ``param.<i>`` in the optimizer's order.
        compressor, memory: a registered name or an instance (``none``, ``residual``, ...).
            ``memory=None`` takes the compressor's ``recommended_memory``.
        communicator: ``"allreduce"``, ``"allgather"``, ``"ps"`` or a registered plugin name;
            None takes the compressor's ``recommended_communicator``.
        fusion_num: MergeComp's groups: 0 layer-wise, 1 one group, y ≥ 2 y groups.
        scheduler: a :class:`Scheduler` (or name) that overrides ``fusion_num``.
        plan: a fixed :class:`Plan` to execute (skips the scheduler).
        compress: False sends every group raw in FP32 (the uncompressed baseline).
        backward_passes_per_step: gradient accumulation: backward passes per ``step()``.
        find_unused_parameters: exchange a used-map each step so a parameter that got no
            gradient on any rank keeps ``grad = None`` (one more small collective per step).
            Off, such a parameter receives a zero gradient.
        backend: a collective backend; the torch.distributed default group if omitted.
    """

    def __init__(self, optimizer: torch.optim.Optimizer,
                 named_parameters: Optional[Iterable[Tuple[str, torch.nn.Parameter]]] = None,
                 compressor: Union[str, Compressor] = "none",
                 memory: Union[None, str, Memory] = None,
                 communicator: Union[None, str, Communicator] = None,
                 fusion_num: int = 1,
                 scheduler: Union[None, str, Scheduler] = None,
                 plan: Optional[Plan] = None,
                 compress: bool = True,
                 backward_passes_per_step: int = 1,
                 find_unused_parameters: bool = False,
                 backend: Optional[Backend] = None):
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
        if isinstance(backward_passes_per_step, bool) or not isinstance(backward_passes_per_step, int) \
                or backward_passes_per_step < 1:
            raise ValueError(f"backward_passes_per_step must be an integer ≥ 1, got {backward_passes_per_step!r}")
        super().__init__(optimizer.param_groups, optimizer.defaults)
        # Share, do not copy: LR schedulers and checkpoints act on the wrapped optimizer.
        self.optimizer = optimizer
        self._share_inner()

        self.backend = backend if backend is not None else default_backend()
        self.backward_passes_per_step = backward_passes_per_step
        self.find_unused_parameters = bool(find_unused_parameters)
        self._params = self._trainable_params(optimizer, named_parameters)
        self._position = {name: i for i, (name, _) in enumerate(self._params)}
        self._numels = {name: p.numel() for name, p in self._params}
        self._check_same_model()

        self.compressor = compressors.create(compressor) if isinstance(compressor, str) else compressor
        if memory is None:
            memory = self.compressor.recommended_memory
        self.memory = memories.create(memory) if isinstance(memory, str) else memory
        if communicator is None:
            communicator = self.compressor.recommended_communicator
        self.communicator = self._build_communicator(communicator)
        self._check_optimizer_compatible()
        self._raw_communicators: Dict[str, Communicator] = {}
        if scheduler is None:
            scheduler = FixedScheduler(fusion_num, send="compress" if compress else "fp32")
        elif isinstance(scheduler, str):
            scheduler = schedulers.create(scheduler)
        self.scheduler = scheduler

        self.plan: Optional[Plan] = None
        self._groups: List[_GroupState] = []
        self._group_of: Dict[str, List[_GroupState]] = {}
        self._ready_order: List[str] = []
        self._passes: Dict[str, int] = {name: 0 for name, _ in self._params}
        self._next_launch = 0
        self._synchronized = False
        self._should_synchronize = True
        self.steps = 0
        #: Seconds spent in step() waiting for groups (exposed for benchmarks).
        self.last_sync_time = 0.0
        #: Called with a parameter name whenever its gradient is ready (profilers use it).
        self.ready_listener = None
        #: Timing only: when set, called as ``phase_listener(phase, group, seconds)`` with
        #: phase ``"launch"`` (gather, memory, compression, collective start) and
        #: ``"finish"`` (after the collective is done: decode, aggregate, average and the
        #: write-back), ``group`` having ``index``, ``send`` and ``numel`` (profilers use it).
        self.phase_listener = None
        self._last_step_end: Optional[float] = None
        if plan is not None:
            self._install_plan(plan)
        self._hooks = [p.register_post_accumulate_grad_hook(self._make_hook(name))
                       for name, p in self._params]

    # ------------------------------------------------------------------ construction --
    @staticmethod
    def _trainable_params(optimizer, named_parameters) -> List[Tuple[str, torch.nn.Parameter]]:
        in_optimizer = [p for group in optimizer.param_groups for p in group["params"]]
        if named_parameters is None:
            named = [(f"param.{i}", p) for i, p in enumerate(in_optimizer)]
        else:
            named = list(named_parameters)
            if named and not (isinstance(named[0], tuple) and len(named[0]) == 2):
                raise ValueError("named_parameters must yield (name, parameter) pairs, e.g. "
                                 "model.named_parameters()")
            counts = collections.Counter(n for n, _ in named)
            duplicates = sorted(n for n, c in counts.items() if c > 1)
            if duplicates:
                raise ValueError(f"named_parameters has duplicate names {duplicates[:5]}")
            known = {id(p) for _, p in named}
            unnamed = sum(1 for p in in_optimizer if id(p) not in known)
            if unnamed:
                raise ValueError(f"{unnamed} parameters of the optimizer are missing from "
                                 "named_parameters; pass model.named_parameters() of the model "
                                 "whose parameters the optimizer holds")
            wanted = {id(p) for p in in_optimizer}
            named = [(n, p) for n, p in named if id(p) in wanted]
        return [(n, p) for n, p in named if p.requires_grad]

    def _check_same_model(self) -> None:
        """Every rank must hold the same trainable parameters, or collectives would hang."""
        signature = [(n, tuple(p.shape), str(p.dtype)) for n, p in self._params]
        everyone = self.backend.allgather_object(signature)
        for rank, theirs in enumerate(everyone):
            if theirs != signature:
                mine = dict((n, (s, d)) for n, s, d in signature)
                other = dict((n, (s, d)) for n, s, d in theirs)
                diff = next((f"{n}: {mine.get(n)} here vs {other.get(n)} on rank {rank}"
                             for n in list(mine) + list(other) if mine.get(n) != other.get(n)),
                            "same parameters in a different order")
                raise ValueError(
                    f"rank {self.backend.rank} and rank {rank} hold different models "
                    f"({len(signature)} vs {len(theirs)} trainable parameters; first difference: "
                    f"{diff}). Build the same model on every rank before wrapping the optimizer.")

    def _build_communicator(self, communicator) -> Communicator:
        if isinstance(communicator, Communicator):
            return communicator
        return communicators.create(communicator, compressor=self.compressor,
                                    memory=self.memory, backend=self.backend)

    def _check_optimizer_compatible(self) -> None:
        """Components that own part of the update (DGC's or SIGNUM's momentum) vet the optimizer."""
        for component in (self.compressor, self.memory):
            check = getattr(component, "check_optimizer", None)
            if callable(check):
                check(self.optimizer)

    def _raw_communicator(self, send: str) -> Communicator:
        """Allreduce with a cast for raw groups, sharing the memory of compressed groups.

        Sharing keeps error feedback whole when a plan turns a compressed group raw (the
        residual goes out with the next raw send) and keeps memory-side momentum (DGC)
        for raw groups.
        """
        if send not in self._raw_communicators:
            wire = "none" if send == "fp32" else send
            self._raw_communicators[send] = communicators.create(
                "allreduce", compressor=compressors.create(wire),
                memory=self.memory, backend=self.backend)
        return self._raw_communicators[send]

    # ------------------------------------------------------------------------ planning --
    def _param_infos(self, order: Sequence[str]) -> List[ParamInfo]:
        by_name = dict(self._params)
        return [ParamInfo(n, by_name[n].numel(), str(by_name[n].dtype), str(by_name[n].device),
                          by_name[n].element_size()) for n in order]

    def _make_plan(self) -> Plan:
        """Rank 0 plans from its recorded backward order; every rank receives that plan."""
        plan = None
        if self.backend.rank == 0:
            seen = set(self._ready_order)
            # Parameters that got no gradient here go last, in reverse definition order
            # (the order backward usually produces).
            order = self._ready_order + [n for n, _ in reversed(self._params) if n not in seen]
            plan = self.scheduler.plan(self._param_infos(order))
        return self.backend.broadcast_object(plan, src=0)

    def _install_plan(self, plan: Plan) -> None:
        """Check the plan against the model and across ranks (by digest), then build groups."""
        plan.validate((n for n, _ in self._params), self._numels)
        digests = self.backend.allgather_object(plan.digest())
        if len(set(digests)) != 1:
            raise ValueError(f"ranks were given different plans (digests {digests}); load "
                             "the same plan on every rank or let rank 0 plan")
        by_name = dict(self._params)
        self.plan = plan
        self._groups = [_GroupState(i, g, by_name) for i, g in enumerate(plan.groups)]
        for group in self._groups:
            kinds = {(str(p.dtype), str(p.device)) for _, p in group.params}
            if len(kinds) > 1:
                raise ValueError(f"plan group {group.index} mixes dtypes/devices {sorted(kinds)}; "
                                 "a fused buffer needs one of each")
        # A sliced parameter is in several groups: its gradient completes a piece of each.
        self._group_of = {}
        for group in self._groups:
            for n, _ in group.params:
                self._group_of.setdefault(n, []).append(group)
        self._reset_iteration()

    def _layout(self, plan: Plan) -> Layout:
        return {f"group{i}": pieces for i, pieces in enumerate(plan.pieces(self._numels))}

    def set_plan(self, plan: Plan) -> None:
        """Switch to ``plan`` between steps; call it on every rank with the same plan.

        Per-group error-feedback state follows its parameters into the new groups (see
        :mod:`mergecomp.regroup`), so the switch is exact.  Raises
        :class:`~mergecomp.regroup.CannotRegroup`, changing nothing, when some state cannot
        move (PowerSGD's matrices, PS shard residuals): keep the current plan then.
        """
        if any(self._passes.values()) or self._next_launch:
            raise RuntimeError("set_plan() must be called between step() and the next backward, "
                               "not in the middle of an iteration")
        plan.validate((n for n, _ in self._params), self._numels)
        if self.plan is None:
            self._install_plan(plan)
            return
        old, new = self._layout(self.plan), self._layout(plan)
        # Raw groups share this memory and their casts are stateless: this is all the state.
        moved = regroup_state(self.communicator.state_dict(), old, new)  # raises, changing nothing
        self._install_plan(plan)
        self.communicator.load_state_dict(moved)

    def _reset_iteration(self) -> None:
        for group in self._groups:
            group.remaining = len(group.members) * self.backward_passes_per_step
            group.handle = None
        for name in self._passes:
            self._passes[name] = 0
        self._next_launch = 0
        self._synchronized = False

    # --------------------------------------------------------------------------- hooks --
    def _make_hook(self, name: str):
        def hook(param: torch.nn.Parameter) -> None:
            self._on_gradient_ready(name)
        return hook

    def _on_gradient_ready(self, name: str) -> None:
        if self.ready_listener is not None:
            self.ready_listener(name)
        passes = self._passes[name] + 1
        if passes > self.backward_passes_per_step:
            raise RuntimeError(
                f"parameter {name!r} received gradient {passes} times since the last step(), "
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
            self._launch_ready_groups()

    def _launch_ready_groups(self) -> None:
        """Launch complete groups in plan order; stop at the first incomplete one."""
        while self._next_launch < len(self._groups) and self._groups[self._next_launch].remaining == 0:
            self._launch(self._groups[self._next_launch])

    def _launch(self, group: _GroupState) -> None:
        listener = self.phase_listener
        started = time.perf_counter() if listener is not None else 0.0
        buffer = group.gather()
        communicator = self.communicator if group.send == "compress" else self._raw_communicator(group.send)
        group.handle = communicator.start(buffer, group.name)
        group.remaining = -1  # launched
        self._next_launch += 1
        if listener is not None:
            listener("launch", group, time.perf_counter() - started)

    # -------------------------------------------------------------------------- step --
    @torch.no_grad()
    def synchronize(self) -> None:
        """Finish every group and write the averaged gradients into ``p.grad``.

        Call it yourself before gradient clipping, then ``step()`` inside
        ``with optimizer.skip_synchronize():``.
        """
        if self._synchronized:
            return
        started = time.perf_counter()
        if self.plan is None:
            self._install_plan(self._make_plan())
        while self._next_launch < len(self._groups):
            self._launch(self._groups[self._next_launch])
        used = self._launch_used_map() if self.find_unused_parameters else None
        globally_used = used.wait()[0] if used is not None else None
        listener = self.phase_listener
        for group in self._groups:
            communicator = self.communicator if group.send == "compress" else self._raw_communicator(group.send)
            if listener is not None and group.handle.rounds is None:
                group.handle.work.wait()  # timing only: finish() would wait here anyway
            finishing = time.perf_counter() if listener is not None else 0.0
            averaged = communicator.finish(group.handle)
            self._write_back(group, averaged, globally_used)
            if listener is not None:
                listener("finish", group, time.perf_counter() - finishing)
        self._synchronized = True
        self.last_sync_time = time.perf_counter() - started

    def _launch_used_map(self):
        """A used-map (1 where this rank has a gradient) summed over ranks.

        Launched after the last group, so it is the last collective of the step on every
        rank whatever the hooks launched during backward.
        """
        flags = torch.tensor([0.0 if p.grad is None else 1.0 for _, p in self._params])
        return self.backend.allreduce_async([flags])

    def _write_back(self, group: _GroupState, averaged: torch.Tensor, globally_used) -> None:
        """Hand the averaged gradient to the parameters.

        A raw group is averaged in place in its own flat buffer, which nothing touches
        until the next step's gather: each ``p.grad`` becomes a view of its part, saving a
        copy of every raw gradient per step (DDP's ``gradient_as_bucket_view``).  The
        caller's ``zero_grad()`` then drops the views (or zeroes them, with
        ``set_to_none=False``, and backward accumulates into the buffer, which the gather
        recognises).  A gradient kept across steps without ``clone()`` sees the next step's
        values, as under DDP's bucket views.  Decoded tensors of compressed groups come from
        the compressor, which may keep them: they are copied.  A slice of a parameter is
        copied into its part of ``p.grad`` (every group is gathered before the first is
        written back, so no group reads another's average).
        """
        flat = averaged.reshape(-1)
        own_buffer = group.buffer is not None and flat.data_ptr() == group.buffer.data_ptr() \
            and flat.numel() == group.buffer.numel()
        for (name, p, start, stop), offset in zip(group.members, group.offsets):
            if globally_used is not None and globally_used[self._position[name]] == 0:
                continue
            if stop - start < p.numel():  # a slice: the other groups write the rest
                if p.grad is None:
                    p.grad = torch.zeros(p.shape, dtype=p.dtype, device=p.device)
                elif not p.grad.is_contiguous():
                    p.grad = p.grad.contiguous()
                p.grad.view(-1)[start:stop].copy_(flat.narrow(0, offset, stop - start))
                continue
            value = flat.narrow(0, offset, p.numel()).view_as(p)
            if own_buffer:
                p.grad = value
            elif p.grad is None:
                p.grad = value.clone()
            else:
                p.grad.copy_(value)

    @contextlib.contextmanager
    def skip_synchronize(self):
        """Inside this block ``step()`` does not synchronize (you already called it)."""
        self._should_synchronize = False
        try:
            yield
        finally:
            self._should_synchronize = True

    def step(self, closure=None):
        """Average gradients over ranks (unless already done), then the wrapped step()."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self._should_synchronize:
            self.synchronize()
        elif not self._synchronized:
            raise RuntimeError("step() inside skip_synchronize() requires calling synchronize() first")
        self.optimizer.step()
        self.steps += 1
        self._reset_iteration()
        self._after_step()
        return loss

    def _after_step(self) -> None:
        """Let an adaptive scheduler (auto, binary) measure this step and switch plans."""
        if not getattr(self.scheduler, "adaptive", False):
            return
        now = time.perf_counter()
        seconds = None if self._last_step_end is None else now - self._last_step_end
        self.scheduler.after_step(self, seconds)
        self._last_step_end = time.perf_counter()

    def restart_step_clock(self) -> None:
        """Do not count the time since the last ``step()`` as a training step.

        Adaptive schedulers (``auto``, ``binary``) time each step from the end of the one
        before; call this on every rank after a pause (evaluation, checkpointing, another
        model's steps) so the pause is not taken for a slow plan.
        """
        self._last_step_end = None

    def add_param_group(self, param_group: Dict[str, Any]) -> None:
        if not hasattr(self, "optimizer"):  # torch.optim.Optimizer.__init__ building the groups
            return super().add_param_group(param_group)
        raise RuntimeError("parameters added after wrapping would get no gradient exchange: add the "
                           "param group to the optimizer before wrapping it in DistributedOptimizer")

    def set_epoch(self, epoch: int) -> None:
        """Tell epoch-scheduled components (DGC's density warm-up) the current epoch."""
        for component in (self.compressor, self.memory):
            if hasattr(component, "set_epoch"):
                component.set_epoch(epoch)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    # -------------------------------------------------------------------------- state --
    def state_dict(self) -> Dict[str, Any]:
        """The wrapped optimizer's state plus this rank's plan, residuals and compressor state.

        Memories hold per-rank residuals: save one file per rank.
        """
        return {
            "optimizer": self.optimizer.state_dict(),
            "mergecomp": {
                "plan": self.plan.to_dict() if self.plan is not None else None,
                "communicator": self.communicator.state_dict(),  # raw groups share its memory
                "steps": self.steps,
            },
        }

    def _share_inner(self) -> None:
        """Point at the wrapped optimizer's param_groups and state (its load_state_dict
        replaces both objects, which would leave LR schedulers editing stale dicts)."""
        self.param_groups = self.optimizer.param_groups
        self.state = self.optimizer.state

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        if "mergecomp" not in state_dict:  # a plain optimizer checkpoint
            self.optimizer.load_state_dict(state_dict)
            self._share_inner()
            return
        ours = state_dict["mergecomp"]
        self.optimizer.load_state_dict(state_dict["optimizer"])
        self._share_inner()
        if ours.get("plan") is not None:
            self._install_plan(Plan.from_dict(ours["plan"]))
        self.communicator.load_state_dict(ours.get("communicator", {}))
        self.steps = int(ours.get("steps", 0))

    def remove_hooks(self) -> None:
        """Detach from the parameters (e.g. before wrapping them again)."""
        for handle in self._hooks:
            handle.remove()
        self._hooks = []

    def __repr__(self) -> str:
        return (f"DistributedOptimizer({type(self.optimizer).__name__}, {self.communicator!r}, "
                f"scheduler={self.scheduler!r}, ranks={self.backend.size})")
