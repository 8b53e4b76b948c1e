"""HSDP: compress the replicas' all-reduce, leave the shard group's reduce-scatter to FSDP.

With a 2-D mesh (``init_device_mesh(..., mesh_dim_names=("replicate", "shard"))`` passed
to ``fully_shard``) FSDP2 reduces a unit's gradient in two hops: a reduce-scatter inside
the shard group (the fast link, within a node) and an all-reduce of the resulting shard
across the replicas (the slow link, between nodes).  Only the second is worth
compressing, and it carries an already-sharded gradient, so error feedback and
PowerSGD's factors are sharded too: a residual costs one gradient shard per unit, 1/S of
the model for S ranks per shard group.

FSDP2's own HSDP all-reduce cannot be swapped: ``set_all_reduce_hook`` runs *after* it.
So :func:`take_over` gives the unit's parameter group the plain 1-D mesh description of
its shard dimension (the parameters keep their 2-D ``DTensor`` placements, checkpoints
and ``full_tensor()`` are unchanged) and installs, through ``set_all_reduce_hook``, a
:class:`ReplicaAllReduce` that runs where FSDP's all-reduce ran: on the reduce-scatter's
output, in place, through the compressor's communicator over the replicate group.  This
reads FSDP2's parameter-group internals (``mesh_info``), checked on registration.

``replicate`` (``torch.distributed._composable.replicate_with_fsdp``), PyTorch's data
parallelism built on FSDP2's machinery, is the same exchange without a shard dimension:
its units keep whole parameters on a 1-D ``("replicate",)`` mesh, FSDP's reduce-scatter is
a local copy (a group of one) and its all-reduce averages the whole gradient over every
rank.  :func:`take_over` gives such a unit's parameter group a mesh description that is
neither sharded nor replicated, so FSDP runs neither collective, and the same
:class:`ReplicaAllReduce` exchanges the whole gradient over the replicate group: error
feedback then costs one gradient per unit, as under DDP.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from ..compressors.base import GroupLayout
from .units import BackwardStep

try:
    from torch.distributed.fsdp._fully_shard._fsdp_common import FSDPMeshInfo, HSDPMeshInfo
except ImportError:  # pragma: no cover - an older torch
    FSDPMeshInfo = HSDPMeshInfo = None
try:  # the mesh descriptions of replicate(), which came after HSDP's
    from torch.distributed.fsdp._fully_shard._fsdp_common import DataParallelMeshInfo, DDPMeshInfo
except ImportError:  # pragma: no cover - an older torch
    DataParallelMeshInfo = DDPMeshInfo = None

#: What :func:`exchange_kind` answers: the collective of a unit that mergecomp compresses.
SHARD, HSDP, REPLICATE = "shard", "hsdp", "replicate"


def is_hsdp(param_group) -> bool:
    """Whether FSDP2 would all-reduce this parameter group's shard across replicas itself."""
    return HSDPMeshInfo is not None and isinstance(getattr(param_group, "mesh_info", None), HSDPMeshInfo)


def is_replicated(param_group) -> bool:
    """Whether the group is ``replicate``'s: whole parameters that FSDP2 all-reduces over
    every replica, with no shard dimension."""
    info = getattr(param_group, "mesh_info", None)
    return (DDPMeshInfo is not None and isinstance(info, DDPMeshInfo)
            and not (FSDPMeshInfo is not None and isinstance(info, FSDPMeshInfo)))


def exchange_kind(param_group) -> str:
    """Which of the unit's collectives mergecomp compresses: :data:`SHARD` (FSDP's
    reduce-scatter, a 1-D ``fully_shard`` mesh), :data:`HSDP` (the replicas' all-reduce of
    the shard) or :data:`REPLICATE` (``replicate``'s all-reduce of the whole gradient)."""
    if is_hsdp(param_group):
        return HSDP
    return REPLICATE if is_replicated(param_group) else SHARD


def take_over(name: str, param_group) -> Tuple[Optional[object], object]:
    """Make FSDP skip the replicas' all-reduce of ``param_group`` (HSDP's or ``replicate``'s),
    so that :class:`ReplicaAllReduce` runs it instead; return (shard group, replicate group),
    the shard group None under ``replicate``."""
    if is_replicated(param_group):
        return _take_over_replicate(name, param_group)
    info = param_group.mesh_info
    if FSDPMeshInfo is None or not hasattr(info, "replicate_process_group"):
        raise RuntimeError(f"FSDP unit {name!r}: this torch's FSDP2 does not describe its HSDP mesh as "
                           "mergecomp expects (mesh_info with a replicate_process_group); compress HSDP "
                           "with a torch whose FSDP2 has set_all_reduce_hook (2.6 or later)")
    flat = FSDPMeshInfo(mesh=info.mesh, shard_mesh_dim=info.shard_mesh_dim,
                        dp_mesh_dims=info.dp_mesh_dims, spmd_mesh=info.spmd_mesh)
    for attribute in ("shard_process_group", "shard_mesh_rank", "shard_mesh_size", "reduce_scatter_process_group"):
        setattr(flat, attribute, getattr(info, attribute))
    if param_group.post_forward_mesh_info is info:
        param_group.post_forward_mesh_info = flat
    param_group.mesh_info = flat
    return info.shard_process_group, info.replicate_process_group


def _take_over_replicate(name: str, param_group) -> Tuple[None, object]:
    """Describe a ``replicate`` unit's mesh as neither sharded nor replicated.

    FSDP2 picks its collectives by the type of ``mesh_info``: a sharded one reduce-scatters,
    a replicated one all-reduces after the (local) reduce-scatter and only then calls the
    all-reduce hook.  With the plain base description it runs neither: the reduce is a copy
    of the whole gradient and the hook, :class:`ReplicaAllReduce`, is the exchange.  The
    parameters keep their own ``Replicate()`` placements and mesh.
    """
    info = param_group.mesh_info
    if DataParallelMeshInfo is None or not hasattr(info, "replicate_process_group"):  # pragma: no cover
        raise RuntimeError(f"replicate unit {name!r}: this torch's FSDP2 does not describe replicate's mesh "
                           "as mergecomp expects (a DDPMeshInfo with a replicate_process_group); use "
                           "mergecomp.ddp.register with DistributedDataParallel on this torch")
    param_group.mesh_info = DataParallelMeshInfo(mesh=info.mesh, replicate_mesh_dim=info.replicate_mesh_dim,
                                                 dp_mesh_dims=info.dp_mesh_dims, spmd_mesh=info.spmd_mesh)
    return None, info.replicate_process_group


class ReplicaAllReduce:
    """The replicas' all-reduce of one HSDP unit's gradient shard, or of one ``replicate``
    unit's whole gradient, compressed (the ``set_all_reduce_hook`` of the unit).

    It averages across replicas, as FSDP's all-reduce does, or sums when the unit has a
    gradient divide factor (FSDP's reduce-scatter, or ``replicate``'s local copy, then already
    applied it).  On the wire: what the compressor's communicator sends for one shard (the
    whole gradient under ``replicate``), instead of FSDP's ring all-reduce of 2·(R−1)/R of it
    in the reduce dtype for R replicas.
    """

    def __init__(self, name: str, index: int, param_group, backward: BackwardStep,
                 layout: Optional[GroupLayout], replicas: int):
        self.name, self.index = name, index
        self.param_group = param_group
        self.backward = backward
        self.layout = layout
        self.replicas = replicas
        self.wire_bytes = 0
        self.uncompressed_bytes = 0

    def __call__(self, reduce_output: torch.Tensor) -> None:
        if not self.param_group.all_reduce_grads:
            raise ValueError(f"FSDP unit {self.name!r}: set_requires_all_reduce(False) leaves the replicas' "
                             "all-reduce for a later backward, which the compressed replica all-reduce does not "
                             "do: accumulate with set_requires_gradient_sync(False) instead")
        flat = reduce_output.view(-1)
        layout = self.layout if self.layout is not None and _covers(self.layout, flat.numel()) else None
        communicator = self.backward.lifecycle.communicator
        before = communicator.backend.wire_bytes
        average = self.backward.exchange(self.index, flat, layout)
        if self.param_group.gradient_divide_factor is not None and communicator.compressor.average:
            average = average * self.replicas  # a sum: FSDP's reduce-scatter applied the factor
        if average.data_ptr() != flat.data_ptr():
            flat.copy_(average.reshape(-1))
        self.uncompressed_bytes += 2 * flat.numel() * flat.element_size() * (self.replicas - 1) // self.replicas
        self.wire_bytes += communicator.backend.wire_bytes - before


def _covers(layout: GroupLayout, numel: int) -> bool:
    return sum(view.numel for view in layout) == numel

