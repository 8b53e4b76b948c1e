"""FSDP2 set-ups the benchmarks share: a mesh, a model sharded unit by unit, and the bytes
FSDP2's own gradient reduction moves (what ``mergecomp.fsdp`` is compared with)."""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn


def mesh(hsdp: bool):
    """None (one shard group of every rank) or, for HSDP, a 2×2 mesh: two replicas of two
    shards each (``("replicate", "shard")``); needs exactly four ranks."""
    if not hsdp:
        return None
    world = torch.distributed.get_world_size()
    if world != 4:
        raise ValueError(f"an HSDP run takes a 2×2 mesh, 4 ranks; this run has {world}: launch 4 "
                         f"workers, or drop --hsdp")
    from torch.distributed.device_mesh import init_device_mesh
    return init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))


def shard(module: nn.Module, device_mesh, reduce_dtype: Optional[torch.dtype] = None) -> None:
    """``fully_shard(module)``, with FSDP2's reduce dtype ``reduce_dtype`` where given."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    policy = MixedPrecisionPolicy(reduce_dtype=reduce_dtype) if reduce_dtype is not None else MixedPrecisionPolicy()
    fully_shard(module, mesh=device_mesh, mp_policy=policy)


def sharded_mlp(width: int, depth: int, device_mesh, reduce_dtype: Optional[torch.dtype] = None) -> nn.Module:
    """``depth`` layers Linear(width, width) + ReLU, then Linear(width, 10), each linear one
    FSDP unit and the whole the root unit; the same weights on every rank (seed 0)."""
    torch.manual_seed(0)
    layers = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.ReLU()]
    model = nn.Sequential(*layers, nn.Linear(width, 10))
    for layer in model:
        if isinstance(layer, nn.Linear):
            shard(layer, device_mesh, reduce_dtype)
    shard(model, device_mesh, reduce_dtype)
    return model


def own_reduce_bytes(model: nn.Module, element_size: int, hsdp: bool) -> int:
    """What FSDP2's own collective puts on the wire per step and rank: a reduce-scatter sends
    (W−1)/W of each unit's padded gradient, i.e. W−1 shards; under HSDP the replicas' ring
    all-reduce of the shard between two replicas, 2·(R−1)/R = 1 shard."""
    world = torch.distributed.get_world_size()
    total = 0
    for parameter in model.parameters():
        shard_bytes = parameter.to_local().numel() * element_size
        total += shard_bytes if hsdp else shard_bytes * (world - 1)
    return total
