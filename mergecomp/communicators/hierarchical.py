"""Hierarchical: dense inside a node, compressed between nodes.

Inside a node GPUs share a fast link (NVLink, PCIe); between nodes the network is slower by
an order of magnitude or more.  Compressing on the fast link buys little and costs encode
time and accuracy, while a flat exchange makes every rank's payload cross the slow link.
DGC's authors name the fix (Lin et al., ICLR 2018, "allreduce dense gradients intra-machine
and allgather sparse gradients inter-machines"); ZeRO++ (Wang et al., 2023), CGX (Markov
et al., 2022), Bagua's ByteGrad and SDP4Bit split the traffic the same way.  For a group of
n elements on M nodes of L ranks:

1. **intra-node allreduce** of the dense buffer (fast link; 2(L−1)/L · 4n bytes per rank):
   every rank of the node holds the node's sum;
2. **compressed exchange between nodes** among the peers of the same local rank (one per
   node): local rank l takes shard l (⌈n/L⌉ elements, the last one shorter) and runs the
   *inner* communicator on it (allgather, allreduce or ps, any compressor), with error
   feedback on that shard (state under ``"<group>/shard<l>"``).  Every rank sends one
   shard, so a node's uplink carries one compressed copy of the group, the L shards side
   by side, where a flat exchange sends L whole payloads per node (an allgather forwards
   N−1 of them);
3. **intra-node allgather** of the shards (fast link; (L−1) · 4⌈n/L⌉ bytes per rank), then
   the average over all M·L ranks.  On gloo the shards are combined by an allreduce of
   the zero-filled buffer instead: gloo's allgather of large tensors is several times
   slower than its allreduce, which is worth its twice as many bytes.

``start`` blocks for step 1 and the encoding (inside the backward hook) and launches step 2
asynchronously; ``finish`` waits for it, decodes and runs step 3.  The node layout comes
from the launcher (:func:`mergecomp.distributed.topology.node_layout`: ``LOCAL_WORLD_SIZE`` under
torchrun) or ``local_size``; every rank's layout is checked before the process groups are
made.  The groups (one per node, one per local rank) are made once per layout with
``torch.distributed.new_group`` on every rank in the same order, and reused by every
hierarchical communicator of the job.  With one node (M = 1) step 2 exchanges with no one
and the two dense exchanges send about twice an FP32 allreduce's bytes: rank 0 warns, naming
the flat communicator to use;
with one rank per node (L = 1) steps 1 and 3 move nothing and the exchange is the inner
communicator's.

Raw groups of a plan (``fp32``/``fp16`` sends) travel by the flat allreduce, as with every
communicator.  The per-shard state follows a plan change exactly
(:mod:`mergecomp.communicators.shard_state`): folded into per-rank state of whole groups
before the regroup (:meth:`fold_shard_state`), and each node's sum of it cut into shards
again for the groups the new plan sends this way (:meth:`spread_shard_state`, a collective
inside each node), so an adaptive scheduler can race flat plans against hierarchical ones.
What cannot move (PowerSGD's matrices of a shard) still keeps the plan
(:class:`~mergecomp.runtime.regroup.CannotRegroup`).
"""
from __future__ import annotations

import contextlib
import warnings
from dataclasses import replace
from typing import Any, Dict, Optional, Tuple

import torch

from . import register, registry
from ..distributed.backends.base import Backend
from ..compressors.base import GroupLayout, clip_layout
from .cost import SendCost, WireSize, collective_cost

from ..distributed import topology
from .base import Communicator, Handle
from .shard_state import fold_shards, spread_to_shards

#: (id of the default process group, world size, ranks per node) → (the default group, the
#: intra-node group of each node, the inter-node group of each local rank).
_GROUPS: Dict[Tuple[int, int, int], tuple] = {}


def node_groups(layout: topology.NodeLayout):
    """This rank's (intra-node group, inter-node group), made once per layout.

    A collective over the default group: every rank calls ``new_group`` for every node and
    every local rank, in the same order."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d
    default = c10d._get_default_group()
    key = (id(default), layout.world_size, layout.local_size)
    if key not in _GROUPS:
        intra = [dist.new_group(layout.node_ranks(node)) for node in range(layout.num_nodes)]
        inter = [dist.new_group(layout.peer_ranks(local)) for local in range(layout.local_size)]
        _GROUPS[key] = (default, intra, inter)
    _, intra, inter = _GROUPS[key]
    return intra[layout.node], inter[layout.local_rank]


def _whole_job(backend: Backend) -> bool:
    """Whether ``backend`` is torch.distributed's over every rank of the job in rank order
    (the default group, or DDP's handle to it): node groups are made from global ranks."""
    if not hasattr(backend, "group"):
        return False
    if backend.group is None:
        return True
    import torch.distributed as dist
    return dist.get_process_group_ranks(backend.group) == list(range(dist.get_world_size()))


class _LinkBackend:
    """A torch.distributed backend over one sub-group whose bytes also count in the job's
    backend, so the bytes per step stay what this rank handed to collectives."""

    @staticmethod
    def make(group, parent: Backend) -> Backend:
        # Imported here: the torch backend imports the runtime, which imports communicators.
        from ..distributed.backends.torch_dist import TorchDistributedBackend

        class Counted(TorchDistributedBackend):
            def _count_allreduce(self, tensors):
                self._forward(super()._count_allreduce, tensors)

            def _count_allgather(self, tensors):
                self._forward(super()._count_allgather, tensors)

            def _count_alltoall(self, chunks, extra=()):
                self._forward(lambda _: TorchDistributedBackend._count_alltoall(self, chunks, extra), chunks)

            @contextlib.contextmanager
            def uncounted(self):  # probes of this link count in neither backend
                with parent.uncounted(), TorchDistributedBackend.uncounted(self):
                    yield

            def _forward(self, count, tensors):
                before = (self.bytes_sent, self.wire_bytes)
                count(tensors)
                parent.collectives += 1
                parent.bytes_sent += self.bytes_sent - before[0]
                parent.wire_bytes += self.wire_bytes - before[1]

        return Counted(group)


def _warn_one_node(layout: topology.NodeLayout, compressor) -> None:
    """Say, once per job (rank 0), that a one-node job gains nothing here and pays double:
    with no second node there is no slow link to spare, and the two dense exchanges inside
    the node (the sum, then the shards back) send about twice an FP32 allreduce's bytes."""
    flat = compressor.recommended_communicator
    warnings.warn(
        f"mergecomp: the hierarchical communicator runs on one node ({layout.local_size} ranks per node, "
        f"from {layout.source}, for all {layout.world_size} ranks): nothing crosses a link between nodes, "
        f"and each rank sends its dense gradient inside the node twice, about 2x the bytes of an FP32 "
        f"allreduce. On one node use a flat communicator (communicator={flat!r}, {type(compressor).__name__}'s "
        f"recommendation); if the job does span several nodes, the launcher did not say so: set "
        f"MERGECOMP_LOCAL_SIZE to the ranks per node (or pass local_size=)", UserWarning, stacklevel=3)


@register("hierarchical")
class HierarchicalCommunicator(Communicator):
    """Intra-node allreduce, ``inner`` compressed exchange of a 1/L shard between nodes,
    intra-node allgather.

    Args:
        compressor, memory, backend: as for every communicator (``backend`` over the whole
            job's torch.distributed group).
        inner: the communicator between nodes (a registered name); None takes the
            compressor's recommendation (allreduce for summable ones, allgather otherwise).
        local_size: ranks per node; None reads the launcher's (see
            :func:`mergecomp.distributed.topology.node_layout`).
    """

    def __init__(self, compressor, memory, backend, inner: Optional[str] = None,
                 local_size: Optional[int] = None):
        super().__init__(compressor, memory, backend)
        inner = compressor.recommended_communicator if inner is None else inner
        if not isinstance(inner, str) or inner == "hierarchical" or inner not in registry.available():
            raise ValueError(f"inner must name the communicator between nodes, one of "
                             f"{[n for n in registry.available() if n != 'hierarchical']}, got {inner!r}")
        self.inner_name = inner
        if getattr(backend, "name", None) == "no-process-group":
            # Built before any rank exists, for its checks (compress_benchmark.py): the inner's
            # refusals and a readable layout; the groups need ranks, so it cannot send.
            registry.create(inner, compressor=compressor, memory=memory, backend=backend)
            self.layout = topology.node_layout(backend.rank, backend.size, local_size)
            self.local_size, self.inner = self.layout.local_size, None
            return
        if not _whole_job(backend):
            group = getattr(backend, "group", None)
            raise ValueError(
                f"the hierarchical communicator needs a torch.distributed backend over the whole job "
                f"(its default group) to make its node groups; got {type(backend).__name__}"
                + ("" if not hasattr(backend, "group") else f" over the group {group!r}")
                + ". Use communicator='allgather' or 'allreduce' with this backend")
        # Checked on every rank before any group is made: a mismatch raises, it never hangs.
        self.layout = topology.agreed_layout(backend, local_size)
        intra_group, inter_group = node_groups(self.layout)
        self.intra = _LinkBackend.make(intra_group, backend)
        self.inter = _LinkBackend.make(inter_group, backend)
        self.inner = registry.create(inner, compressor=compressor, memory=memory, backend=self.inter)
        compressor.set_process_rank(backend.rank)  # the inner set its node's index; streams differ per rank
        self.local_size = self.layout.local_size
        import torch.distributed as dist
        self._gather_by_sum = dist.get_backend(intra_group) == "gloo"
        if self.layout.num_nodes == 1 and self.local_size > 1 and backend.rank == 0:
            _warn_one_node(self.layout, compressor)

    # -- the pipeline --------------------------------------------------------------------------
    def _shard(self, numel: int) -> Tuple[int, int, int]:
        """(this rank's first element, its end, the padded shard length ⌈n/L⌉)."""
        length = -(-numel // self.local_size)
        first = min(self.layout.local_rank * length, numel)
        return first, min(first + length, numel), length

    def start(self, tensor: torch.Tensor, name: str, layout: Optional[GroupLayout] = None,
              in_place: bool = False) -> Handle:
        """Node sum (blocking, fast link), then the inner exchange of this rank's shard (async)."""
        if self.inner is None:
            raise RuntimeError("this hierarchical communicator was built without a process group "
                               "(for its checks): build it on the job's backend to send")
        flat = tensor.reshape(-1)
        node_sum = flat if in_place and tensor.is_contiguous() else flat.clone()
        if self.local_size > 1:
            self.intra.allreduce_async((node_sum,)).wait()
        first, end, length = self._shard(flat.numel())
        extra = {"first": first, "end": end, "length": length, "dtype": flat.dtype}
        if end == first:  # fewer elements than ranks per node: every node's peers skip alike
            return Handle(name, tensor.shape, work=_Done(), extra=dict(extra, inner=None))
        shard_layout = None if layout is None else clip_layout(layout, first, end)
        inner = self.inner.start(node_sum[first:end], f"{name}/shard{self.layout.local_rank}",
                                 shard_layout, in_place=True)
        return Handle(name, tensor.shape, inner.work, extra=dict(extra, inner=inner))

    def finish(self, handle: Handle) -> torch.Tensor:
        """Wait for the shard's exchange, then gather the node's shards (fast link)."""
        extra = handle.extra
        first, end, length = extra["first"], extra["end"], extra["length"]
        inner = extra.get("inner")
        shard = self.inner.finish(inner).reshape(-1) if inner is not None else None
        device = shard.device if shard is not None else self.backend_device()
        numel = handle.shape.numel()
        if self.local_size == 1:
            total = shard if shard is not None else torch.zeros(numel, dtype=extra["dtype"], device=device)
        elif self._gather_by_sum:
            # gloo: its allreduce of the zero-filled buffer (each rank's shard in place) beats
            # its allgather of the shards several times over, for twice the bytes.
            total = torch.zeros(numel, dtype=extra["dtype"], device=device)
            if shard is not None:
                total[first:end].copy_(shard)
            self.intra.allreduce_async((total,)).wait()
        else:
            padded = torch.zeros(length, dtype=extra["dtype"], device=device)
            if shard is not None:
                padded[:end - first].copy_(shard)
            parts = self.intra.allgather_async((padded,), same_shapes=True).wait()
            total = torch.cat([part[0] for part in parts])[:numel]
        if self.compressor.average:
            total = total.div_(self.local_size)  # the inner averaged over the nodes
        return total.view(handle.shape)

    def backend_device(self) -> torch.device:
        return torch.device(getattr(self.backend, "device", None) or "cpu")

    # -- state: the inner holds (and shares) the compressor and the memory ----------------------
    def commit(self) -> None:
        self.inner.commit()

    def rollback(self) -> None:
        self.inner.rollback()

    def state_dict(self) -> Dict[str, Any]:
        return self.inner.state_dict()

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.inner.load_state_dict(state)

    # -- state across plan changes (mergecomp.communicators.shard_state) -------------------------
    def _bounds(self, numel: int) -> Tuple[int, int]:
        first, end, _ = self._shard(numel)
        return first, end

    def fold_shard_state(self, state: Dict[str, Any], sizes: Dict[str, int]) -> Dict[str, Any]:
        """``state`` (a communicator state: compressor and memory) with this rank's per-shard
        state of the groups in ``sizes`` (elements per group) folded into per-rank state of
        whole groups, which a plan switch can regroup.  No communication."""
        return fold_shards(state, sizes, self.layout.local_rank, self._bounds)

    def spread_shard_state(self, groups) -> None:
        """Cut the memory's and compressor's per-rank state of ``groups`` (``[(name, numel)]``,
        the groups this communicator sends from now on) into per-shard state: each node's
        sum, local rank l keeping shard l.  A collective inside each node: call it on every
        rank with the same groups (a plan switch does)."""
        if self.inner is None or not groups:
            return
        parts = {"memory": self.memory.state_dict(), "compressor": self.compressor.state_dict()}
        spread = spread_to_shards(parts, list(groups), self.layout.local_rank, self._bounds, self.intra,
                                  self.backend_device())
        if "compressor" in spread:
            self.compressor.load_state_dict(spread["compressor"])
        if "memory" in spread:
            self.memory.load_state_dict(spread["memory"])

    def __repr__(self) -> str:
        return (f"HierarchicalCommunicator({self.compressor!r}, {self.memory!r}, inner={self.inner_name!r}, "
                f"local_size={self.local_size})")

    # -- cost model (mergecomp.planning.costmodel.communicator_formula) ---------------------------
    @property
    def hierarchy(self) -> Dict[str, Any]:
        """What a profile records of the layout (``Profile.hierarchy``)."""
        return {"local_size": self.local_size, "inner": self.inner_name,
                "gather": "allreduce" if self._gather_by_sum else "allgather"}

    def link_backends(self) -> Dict[str, Backend]:
        """The backends over this communicator's own groups, by link (``"intra"``: inside the
        node, ``"inter"``: the same local rank across nodes): what
        :func:`mergecomp.planning.measure.measure_link_costs` times the links through."""
        return {"intra": self.intra, "inter": self.inter}

    #: The collectives the formula prices with: the flat allreduce (raw groups) and the
    #: intra- and inter-node ones, measured through this communicator's groups
    #: (:func:`mergecomp.planning.measure.measure_link_costs`).
    cost_collectives = ("allreduce", "intra_allreduce", "intra_allgather", "inter_allreduce",
                        "inter_allgather")
    #: start() waits for the intra-node allreduce: not local work only.
    phases_are_local = False

    @classmethod
    def send_cost(cls, codec, profile):
        """A compressed group of n elements (4-byte gradients): the intra-node allreduce of
        4n bytes as encoding (``start`` blocks for it, inside the backward hook), the
        allgather of 4⌈n/L⌉ (an allreduce of 4n where ``gather`` is ``"allreduce"``: gloo)
        as decoding (``finish`` blocks for it), and the inner communicator's own price for a
        shard of n/L elements between M nodes, priced with the inter-node collectives
        (``profile.hierarchy``: ``local_size``, ``inner``, ``gather``).  The memory runs on
        the shard only (``memory_share`` 1/L)."""
        hierarchy = profile.hierarchy or {}
        local, inner = int(hierarchy.get("local_size", 1)), hierarchy.get("inner", "allgather")
        if profile.world_size % local:
            raise ValueError(f"profile hierarchy local_size {local} does not divide world size {profile.world_size}")
        intra_reduce = collective_cost(profile, "intra_allreduce", "the hierarchical communicator's node sum")
        intra_gather = collective_cost(profile, "intra_allgather", "the hierarchical communicator's shard gather")
        between = {kind: profile.collectives[f"inter_{kind}"] for kind in ("allreduce", "allgather")
                   if f"inter_{kind}" in profile.collectives}
        nodes = replace(profile, world_size=profile.world_size // local, collectives=between, hierarchy={})
        formula = getattr(registry.get(inner), "send_cost", None)
        if not callable(formula):
            raise ValueError(f"the hierarchical communicator's inner {inner!r} declares no cost formula "
                             "(send_cost), so its groups cannot be priced")
        shard = formula(codec, nodes)
        per = 1.0 / local
        node_sum = intra_reduce.scaled(1, 4)  # start() waits for it, in the backward hook
        if hierarchy.get("gather") == "allreduce":
            gather = intra_reduce.scaled(1, 4)  # finish() waits for it
        else:
            gather = intra_gather.scaled(1, 4 * per)
        per_element = 4.0 if shard.wire.per_element is None else shard.wire.per_element
        return SendCost(shard.encode.scaled(1, per) + node_sum, WireSize(per_element * per, shard.wire.header),
                        shard.collective, decode=shard.decode.scaled(1, per) + gather,
                        relay=shard.relay.scaled(1, per), aggregate_passes=shard.aggregate_passes,
                        memory_share=shard.memory_share * per)


class _Done:
    """The Work of a shard with nothing to exchange."""

    def wait(self):
        return None

    def future(self):
        done = torch.futures.Future()
        done.set_result(None)
        return done

