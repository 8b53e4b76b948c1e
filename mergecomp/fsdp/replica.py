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


def is_hsdp(param_group) -> bool:
    """Whether FSDP2 would all-reduce this parameter group across replicas itself."""
    return HSDPMeshInfo is not None and isinstance(getattr(param_group, "mesh_info", None), HSDPMeshInfo)


def take_over(name: str, param_group) -> Tuple[object, object]:
    """Make FSDP treat ``param_group`` as sharded over its shard dimension only (so it does
    not all-reduce across replicas); return (shard group, replicate group)."""
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


class ReplicaAllReduce:
    """The replicas' all-reduce of one HSDP unit's gradient shard, compressed (the
    ``set_all_reduce_hook`` of the unit).

    It averages across replicas, as FSDP's all-reduce does, or sums when the unit has a
    gradient divide factor (FSDP's reduce-scatter then already applied it).  On the wire:
    what the compressor's communicator sends for one shard, instead of FSDP's ring
    all-reduce of 2·(R−1)/R of the shard in the reduce dtype for R replicas.
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
                             "all-reduce for a later backward, which the compressed HSDP all-reduce does not "
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

