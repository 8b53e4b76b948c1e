"""The HSDP mesh that follows the machines: replicas across nodes, shards within a node.

HSDP pays for two hops: FSDP's reduce-scatter within the shard group, with every byte of a
unit's gradient, and the replicas' all-reduce of the shard, 1/S of it for S ranks per shard
group.  :func:`mergecomp.fsdp.register` compresses the second hop only, so the mesh must put
it on the slow link: the ranks of one node form a shard group (the fast link, NVLink or
PCIe), and the ranks with the same local rank on every node form a replica group (the
network between nodes).  :func:`node_mesh` builds that mesh from the job's node layout
(:mod:`mergecomp.distributed.topology`: the launcher's ranks per node, or ``local_size``),
checked on every rank first, so a job whose ranks read different layouts stops, naming
them, instead of building process groups that do not match.
"""
from __future__ import annotations

from typing import Optional

import torch.distributed as dist

from ..distributed.backends.torch_dist import TorchDistributedBackend
from ..distributed.topology import LOCAL_SIZE_VARIABLE, agreed_layout

#: The mesh's dimension names, the ones FSDP2's HSDP expects: replicate first, then shard.
MESH_DIM_NAMES = ("replicate", "shard")


def node_mesh(device_type: Optional[str] = None, local_size: Optional[int] = None):
    """A ``(num_nodes, ranks_per_node)`` device mesh named ``("replicate", "shard")``.

    Rank r sits at ``(r // L, r % L)`` for L ranks per node (the launchers' numbering): its
    shard group is its node, its replica group one rank per node.  ``device_type``: the
    mesh's device (``"cuda"``, ``"cpu"``...); default ``"cuda"`` where NCCL is a backend of
    the default group, else ``"cpu"``.
    ``local_size``: ranks per node, overriding ``MERGECOMP_LOCAL_SIZE`` and the launcher's
    local world size.  A collective: call it on every rank, after ``init_process_group``.

    Raises ValueError on a job of one node (there is no slow link to compress: shard over
    every rank with ``fully_shard``'s default mesh) or when ranks disagree on the layout.
    """
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("mergecomp.fsdp.node_mesh needs torch.distributed initialised: call "
                           "mergecomp.launch.init_distributed() (or init_process_group) first")
    layout = agreed_layout(TorchDistributedBackend(), local_size)
    if layout.num_nodes < 2:
        raise ValueError(
            f"node_mesh: the job is one node of {layout.local_size} rank(s) (from {layout.source}), so "
            f"HSDP's replica dimension would have size 1 and nothing would cross a slow link; shard over "
            f"every rank with fully_shard(module) (a 1-D mesh), or give local_size= (or "
            f"{LOCAL_SIZE_VARIABLE}) if the launcher misreports the ranks per node")
    if device_type is None:
        device_type = "cuda" if "nccl" in dist.get_backend() else "cpu"  # also "cpu:gloo,cuda:nccl"
    from torch.distributed.device_mesh import init_device_mesh
    return init_device_mesh(device_type, (layout.num_nodes, layout.local_size), mesh_dim_names=MESH_DIM_NAMES)
