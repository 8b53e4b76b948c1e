"""FSDP2's units as mergecomp sees them: the collectives installed on each, and one backward as
one step of the shared step lifecycle.

FSDP2 reduces a unit's gradient in the middle of backward and reads the result at once, so
each unit's exchange is launched *and finished* when FSDP calls it
(:meth:`~mergecomp.runtime.step.StepLifecycle.finish_now`); what the lifecycle settles
step-wide is settled when autograd finishes the backward (an autograd callback queued by
the first unit, which runs after FSDP's own end-of-backward callback, so FSDP's state is
final by then):

- the first unit begins the step: the preflight checks that every rank agrees on the
  configuration, the units and the step count before the first payload travels
  (:class:`~mergecomp.runtime.agreement.RanksDisagree` naming the difference);
- each unit's gradient is checked for NaN/Inf and zeroed before a compressor or a residual
  sees it;
- at the end one small allreduce settles the outcome on every rank: all units' compressor
  and error-feedback state is committed, or the backward is dropped whole (state as before
  it, every gradient of the model NaN, counted) and the policy speaks: a warning
  (``nonfinite="skip"``) or :class:`~mergecomp.runtime.agreement.NonFiniteGradient` raised
  from ``loss.backward()`` (``"raise"``), after FSDP has resharded its parameters.

:class:`CompressedReduceScatter` is a unit's reduce-scatter (a 1-D mesh);
:class:`ExplainedAllGather` and :class:`ExplainedReduceScatter` are FSDP's own collectives,
unchanged but for naming a lost or stopped rank; :class:`BackwardStep` is the step.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from ..compressors.base import GroupLayout
from ..distributed.backends.torch_dist import all_gather_single, reduce_scatter_single
from ..runtime import gate
from ..runtime.step import StepLifecycle
from .scatter import ScatterCommunicator, UnitShape, scale_of

try:  # FSDP2's public module and its custom-collective interface (torch >= 2.6 has both)
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter
except ImportError:  # pragma: no cover - an older torch
    FSDPModule, ReduceScatter = None, object
try:  # a custom all-gather came later than a custom reduce-scatter
    from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather
except ImportError:  # pragma: no cover - an older torch
    AllGather = object


class BackwardStep:
    """One lifecycle step per backward of an FSDP2 ``model``: the units' exchanges through
    ``communicator``, the agreement and outcome over ``world`` (every rank); ``facts``: the
    configuration and the units, which every rank must agree on."""

    def __init__(self, model: torch.nn.Module, communicator, world, nonfinite: str, facts: Dict[str, Any],
                 collective: str):
        self.model = model
        self._facts = dict(facts)
        self.lifecycle = StepLifecycle(communicator, world, self.facts, nonfinite)
        #: The collective a rank without mergecomp runs where this one exchanges a unit
        #: (FSDP's ``"reduce_scatter"``, or under HSDP the replicas' ``"allreduce"``).
        self.collective = collective
        self._registration_checked = False
        self._queued = False
        #: The loop's clipping seen at the optimizer's step (:mod:`.handover`), once installed.
        self.loop = None

    def facts(self) -> Dict[str, Any]:
        """What ranks must agree on besides the lifecycle's step count and epoch."""
        return self._facts

    @property
    def steps(self) -> int:
        """Backwards settled on this rank (committed or dropped): the step count ranks agree on."""
        return self.lifecycle.steps

    @property
    def dropped(self) -> int:
        """Backwards dropped because a gradient was non-finite on some rank."""
        return self.lifecycle.skipped_steps

    def exchange(self, index: int, buffer: torch.Tensor, layout: Optional[GroupLayout]) -> torch.Tensor:
        """Exchange unit ``index``'s ``buffer`` now and return the result (the step settles
        at the end of the backward)."""
        lifecycle = self.lifecycle
        if not self._registration_checked:
            self._check_registered(buffer)
        if not lifecycle.in_step:
            lifecycle.begin(self.steps, buffer.device)
            self._queue_end()
        try:
            flight = lifecycle.launch(index, buffer, layout, lend=True)
            return lifecycle.finish_now(flight)
        except BaseException:
            lifecycle.abort()
            raise

    def _check_registered(self, buffer: torch.Tensor) -> None:
        """Once, before the first exchange: a rank without mergecomp runs FSDP's own collective
        for this unit where this rank would run the preflight, so the first collective is
        shaped like FSDP's and pairs with it (:func:`mergecomp.runtime.gate.check_registered`)."""
        self._registration_checked = True
        gate.check_registered(
            self.lifecycle.communicator.backend, buffer, self.collective,
            "mergecomp.fsdp.register", f"FSDP's own {self.collective.replace('_', '-')}",
            "Call mergecomp.fsdp.register(model, ...) on every rank, with the same arguments, after "
            "fully_shard (or replicate) and before the first backward.")

    def _queue_end(self) -> None:
        try:
            torch.autograd.Variable._execution_engine.queue_callback(self.end)
            self._queued = True
        except RuntimeError:  # outside a backward (a direct call): the caller ends the step
            self._queued = False

    def end(self) -> None:
        """Settle the step: commit every unit's state, or drop the whole backward."""
        self._queued = False
        lifecycle = self.lifecycle
        if not lifecycle.in_step:
            return
        try:
            outcome = lifecycle.end_step(_ignore)
        except BaseException:
            lifecycle.abort()
            raise
        lifecycle.count_step()
        if not outcome.finite:
            self._poison_gradients()
        if self.loop is not None:
            self.loop.deliver(outcome.finite)
        lifecycle.close_step()

    def end_if_direct(self) -> None:
        """End a step begun outside a backward (a unit's collective called directly)."""
        if not self._queued:
            self.end()

    def _poison_gradients(self) -> None:
        with torch.no_grad():
            for parameter in self.model.parameters():
                if parameter.grad is not None:
                    grad = parameter.grad
                    (grad.to_local() if hasattr(grad, "to_local") else grad).fill_(float("nan"))


def _ignore(flight, average, outcome) -> None:
    """Each unit's result was handed to FSDP when it finished; a dropped step is poisoned whole."""


class CompressedReduceScatter(ReduceScatter):
    """One FSDP unit's reduce-scatter (``FSDPModule.set_custom_reduce_scatter``), exchanged
    by the shared :class:`~mergecomp.fsdp.scatter.ScatterCommunicator` as step ``index``'s
    group ``index`` of the backward.

    ``wire_bytes``: what this rank has put on the wire for this unit so far;
    ``uncompressed_bytes``: what FSDP's own reduce-scatter of the same gradients would have
    (the chunks for the other ranks, in the reduce dtype).
    """

    def __init__(self, name: str, index: int, backward: BackwardStep, communicator: ScatterCommunicator):
        self.name, self.index = name, index
        self.backward = backward
        self.communicator = communicator
        self.label = f"group{index}"

    @property
    def wire_bytes(self) -> int:
        return self.communicator.wire_bytes.get(self.label, 0)

    @property
    def uncompressed_bytes(self) -> int:
        return self.communicator.uncompressed_bytes.get(self.label, 0)

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group, op,
                 async_op: bool = False):
        """Write this rank's shard of the reduced ``input_tensor`` into ``output_tensor``.

        Runs to completion before it returns (FSDP2 reads the shard right after a
        synchronous call), so it returns None even when ``async_op`` is asked for.
        """
        self.communicator.scaling = scale_of(op, dist.get_world_size(group))
        average = self.backward.exchange(self.index, input_tensor.view(-1), None)
        output_tensor.copy_(average.reshape(output_tensor.shape))
        self.backward.end_if_direct()
        return None


class ExplainedAllGather(AllGather):
    """FSDP's own all-gather of a unit's parameters, unchanged, except that a rank lost or
    stopped while it waits is named (``backend.explained``: the ranks behind, from the
    progress records) instead of surfacing as the collective library's raw error."""

    def __init__(self, backend):
        self.backend = backend

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group, async_op: bool = False):
        with self.backend.explained("FSDP's all-gather"):
            work = all_gather_single(output_tensor, input_tensor, group=group, async_op=async_op)
        return self.backend.explained_work(work, "FSDP's all-gather")


class ExplainedReduceScatter(ReduceScatter):
    """FSDP's own reduce-scatter inside the shard group (under HSDP, where mergecomp
    compresses the replicas' all-reduce only), unchanged, its failures named as in
    :class:`ExplainedAllGather`."""

    def __init__(self, backend):
        self.backend = backend

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group, op,
                 async_op: bool = False):
        with self.backend.explained("FSDP's reduce-scatter"):
            work = reduce_scatter_single(output_tensor, input_tensor, op=op, group=group, async_op=async_op)
        return self.backend.explained_work(work, "FSDP's reduce-scatter")


def explain_fsdp_collectives(module: torch.nn.Module, backend, reduce_scatter: bool) -> None:
    """Install :class:`ExplainedAllGather` on ``module`` (and :class:`ExplainedReduceScatter`
    when ``reduce_scatter``), where this torch lets a unit take a custom one."""
    gather = getattr(module, "set_custom_all_gather", None)
    if callable(gather) and AllGather is not object:
        gather(ExplainedAllGather(backend))
    if reduce_scatter:
        module.set_custom_reduce_scatter(ExplainedReduceScatter(backend))


def fsdp_units(model: torch.nn.Module) -> List[Tuple[str, torch.nn.Module]]:
    """(name, module) of every FSDP2 unit in ``model``, or a TypeError saying what to do."""
    if FSDPModule is None:  # pragma: no cover
        raise RuntimeError("mergecomp.fsdp needs FSDP2 (torch.distributed.fsdp.fully_shard, torch >= 2.6)")
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"register() needs the model after fully_shard, got {type(model).__name__}")
    # replicate()'s ReplicateModule is an FSDPModule too: its units are found the same way
    units = [(name or "<root>", m) for name, m in model.named_modules() if isinstance(m, FSDPModule)]
    if not units:
        raise TypeError(f"{type(model).__name__} has no FSDP2 module: call "
                        "torch.distributed.fsdp.fully_shard (or replicate_with_fsdp.replicate) on its "
                        "layers and on the model first (for DistributedDataParallel use mergecomp.ddp.register)")
    return units


def param_group(name: str, module: torch.nn.Module):
    """The unit's FSDP parameter group (None for a unit without parameters of its own)."""
    state = module._get_fsdp_state()
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is not None and len(groups) > 1:
        raise ValueError(f"FSDP unit {name!r} has {len(groups)} parameter groups (a per-parameter mesh from "
                         "shard_placement_fn): FSDP2 takes one custom reduce-scatter per unit; give the "
                         "unit's parameters one mesh")
    group = state._fsdp_param_group
    return group if group is not None and group.fsdp_params else None


def unit_shape(name: str, group) -> Optional[UnitShape]:
    """What the unit's reduce-scatter input holds (its parameters' padded shards, in the
    reduce dtype), or None for a unit without parameters."""
    if group is None:
        return None
    params = tuple((getattr(p, "_param_fqn", None) or f"{name}.{i}", torch.Size(p.padded_sharded_param_size))
                   for i, p in enumerate(group.fsdp_params))
    policy = group.mp_policy
    dtype = policy.reduce_dtype or policy.param_dtype or group.fsdp_params[0].sharded_param.dtype
    # replicate's units have no shard dimension: one "shard", the whole padded gradient
    return UnitShape(params, getattr(group.mesh_info, "shard_mesh_size", 1), dtype)


__all__ = ["CompressedReduceScatter", "fsdp_units", "param_group", "unit_shape"]
