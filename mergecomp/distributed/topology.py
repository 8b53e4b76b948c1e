"""Which ranks share a machine: the node layout of the job.

Clusters join the GPUs of one node by a fast link (NVLink, PCIe) and nodes by a slower
network.  A hierarchical exchange (:mod:`mergecomp.communicators.hierarchical`, and HSDP's
replicate/shard split) sends dense data inside a node and compressed data between nodes,
so it must know which ranks share a node.  Launchers say so in the environment:

================  ====================================================================
launcher          ranks per node
================  ====================================================================
torchrun          ``LOCAL_WORLD_SIZE`` (``--nproc-per-node``); ``GROUP_RANK`` is the node
mpirun            ``OMPI_COMM_WORLD_LOCAL_SIZE`` (Open MPI), ``MPI_LOCALNRANKS`` (Hydra)
horovodrun        ``HOROVOD_LOCAL_SIZE``
emulated cluster  ``benchmarks/cluster.py --nodes M --workers-per-node L`` sets torchrun's
================  ====================================================================

:func:`node_layout` reads them through :func:`mergecomp.distributed.launch.detect`;
``MERGECOMP_LOCAL_SIZE`` or the ``local_size`` argument overrides what the launcher says
(a job started with one process per node and threads inside, a scheduler that sets the
variables wrongly).  The layout assumes the launchers' own numbering: the ranks of a node
are consecutive, ``rank = node · L + local_rank``.  A job whose ranks are placed otherwise
(``mpirun --map-by node``) is refused with the rank that breaks it, as is a world size that
is not a multiple of L.  :func:`agreed_layout` compares every rank's layout, so a job where
ranks disagree stops with the ranks named before any group of processes is made.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Dict, List, Mapping, Optional

from .backends.expect import INT, STRING, one_of, tuple_of
from .launch import detect

#: Overrides the launcher's ranks per node (an integer ≥ 1).
LOCAL_SIZE_VARIABLE = "MERGECOMP_LOCAL_SIZE"


@dataclass(frozen=True)
class NodeLayout:
    """Where one rank sits: ``world_size`` ranks in ``num_nodes`` nodes of ``local_size``.

    Rank r is local rank ``r % local_size`` of node ``r // local_size``.
    """

    rank: int
    world_size: int
    local_size: int
    source: str = "argument"

    def __post_init__(self):
        for what in ("rank", "world_size", "local_size"):
            value = getattr(self, what)
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"node layout {what} must be an int, got {value!r}")
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise ValueError(f"node layout: rank {self.rank} of world size {self.world_size} is not a "
                             "place in the job")
        if self.local_size < 1 or self.world_size % self.local_size:
            raise ValueError(
                f"world size {self.world_size} is not a multiple of {self.local_size} ranks per node "
                f"(from {self.source}): every node must run the same number of ranks. Launch L ranks "
                f"on each of M nodes, or set {LOCAL_SIZE_VARIABLE} (or local_size=) to the ranks per node")

    @property
    def local_rank(self) -> int:
        return self.rank % self.local_size

    @property
    def node(self) -> int:
        return self.rank // self.local_size

    @property
    def num_nodes(self) -> int:
        return self.world_size // self.local_size

    def node_ranks(self, node: int) -> List[int]:
        """The ranks of ``node``, in local-rank order (the fast link's group)."""
        return list(range(node * self.local_size, (node + 1) * self.local_size))

    def peer_ranks(self, local_rank: int) -> List[int]:
        """The ranks with local rank ``local_rank``, one per node (the slow link's group)."""
        return list(range(local_rank, self.world_size, self.local_size))

    def describe(self) -> str:
        return (f"{self.num_nodes} node(s) × {self.local_size} rank(s): rank {self.rank} is local rank "
                f"{self.local_rank} of node {self.node} (from {self.source})")


def node_layout(rank: int, world_size: int, local_size: Optional[int] = None,
                environ: Optional[Mapping[str, str]] = None) -> NodeLayout:
    """This rank's :class:`NodeLayout` in a job of ``world_size`` ranks.

    Ranks per node, first found: ``local_size``; ``MERGECOMP_LOCAL_SIZE``; the launcher's
    local size (:func:`~mergecomp.distributed.launch.detect`), whose local rank must then be
    ``rank % local_size``; a launch that says nothing (one process, or RANK/WORLD_SIZE
    alone) is one node holding every rank.  Raises ValueError naming the value and where
    it came from when it does not fit the job.
    """
    env = os.environ if environ is None else environ
    if local_size is not None:
        if isinstance(local_size, bool) or not isinstance(local_size, int) or local_size < 1:
            raise ValueError(f"local_size must be an int ≥ 1 (ranks per node), got {local_size!r}")
        return NodeLayout(rank, world_size, local_size, "local_size=")
    text = env.get(LOCAL_SIZE_VARIABLE, "").strip()
    if text:
        try:
            value = int(text)
        except ValueError:
            value = 0
        if value < 1:
            raise ValueError(f"{LOCAL_SIZE_VARIABLE}={env[LOCAL_SIZE_VARIABLE]!r} must be an integer ≥ 1 "
                             "(ranks per node); unset it to use the launcher's")
        return NodeLayout(rank, world_size, value, LOCAL_SIZE_VARIABLE)
    info = detect(env)
    if info.launcher == "single" or info.world_size != world_size:
        return NodeLayout(rank, world_size, world_size, "one node: the launcher names no nodes")
    layout = NodeLayout(rank, world_size, info.local_world_size, f"{info.launcher}'s local world size")
    if info.local_rank != layout.local_rank:
        raise ValueError(
            f"rank {rank} has local rank {info.local_rank} of {info.local_world_size} per node, but a node "
            f"layout needs consecutive ranks per node (local rank {layout.local_rank} = rank % "
            f"{info.local_world_size}); launch with the launcher's default placement (torchrun does; "
            f"mpirun --map-by slot), or set {LOCAL_SIZE_VARIABLE}")
    return layout


def agreed_layout(backend, local_size: Optional[int] = None,
                  environ: Optional[Mapping[str, str]] = None) -> NodeLayout:
    """:func:`node_layout` of this rank, checked against every rank's (one small allgather
    through ``backend``, a collective): the same ranks per node everywhere.  A rank whose
    layout cannot be read makes every rank raise, naming it, instead of leaving the others
    waiting in a collective it never joins."""
    try:
        layout, mine = node_layout(backend.rank, backend.size, local_size, environ), None
    except (TypeError, ValueError) as error:
        layout, mine = None, str(error)
    everyone = backend.allgather_object(mine if layout is None else [layout.local_size, layout.source],
                                        expect=one_of(STRING, tuple_of(INT, STRING)))
    problems = [f"rank {rank}: {value}" for rank, value in enumerate(everyone) if isinstance(value, str)]
    if problems:
        raise ValueError("the node layout cannot be read on every rank; " + "; ".join(problems))
    sizes: Dict[int, List[str]] = {}
    for rank, (size, source) in enumerate(everyone):
        sizes.setdefault(size, []).append(f"{rank} ({source})")
    if len(sizes) > 1:
        seen = "; ".join(f"{size} on ranks {', '.join(ranks)}" for size, ranks in sorted(sizes.items()))
        raise ValueError(f"ranks disagree on the ranks per node ({seen}): launch every node with the same "
                         f"number of ranks, or set {LOCAL_SIZE_VARIABLE} (or local_size=) alike everywhere")
    return layout
