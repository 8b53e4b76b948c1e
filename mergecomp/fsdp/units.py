"""FSDP2's units, as mergecomp sees them, and the reduce-scatter installed on each."""
from __future__ import annotations

from typing import List, Optional, Tuple

import torch
import torch.distributed as dist

from .backward import BackwardStep
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
            work = dist.all_gather_into_tensor(output_tensor, input_tensor, group=group, async_op=async_op)
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
            work = dist.reduce_scatter_tensor(output_tensor, input_tensor, op=op, group=group, async_op=async_op)
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
    units = [(name or "<root>", m) for name, m in model.named_modules() if isinstance(m, FSDPModule)]
    if not units:
        raise TypeError(f"{type(model).__name__} has no FSDP2 module: call "
                        "torch.distributed.fsdp.fully_shard on its layers and on the model first "
                        "(for DistributedDataParallel use mergecomp.ddp.register)")
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
    return UnitShape(params, group.mesh_info.shard_mesh_size, dtype)


__all__ = ["CompressedReduceScatter", "fsdp_units", "param_group", "unit_shape"]
