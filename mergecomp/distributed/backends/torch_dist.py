"""torch.distributed backend: gloo for CPU tensors, NCCL for CUDA tensors.

Every buffer a collective needs (size headers, padded blobs, receive buffers) is made on
the device of the tensors handed in, never on the CPU by default: NCCL takes CUDA tensors
only.  Sizes and shapes that peers send are checked before anything is allocated with
them (:mod:`mergecomp.distributed.backends.serialize`).  A collective that fails because a rank did
not take part raises :class:`mergecomp.distributed.watchdog.CollectiveTimeout` or
:class:`~mergecomp.distributed.watchdog.PeerLost`, naming the ranks behind from their progress
beacons (:meth:`mark_step`).
"""
from __future__ import annotations

import collections
from contextlib import contextmanager
from typing import Any, Deque, List, Optional, Sequence

import torch
import torch.distributed as dist

from .. import watchdog
from ..launch.session import release_before_shutdown
from .base import Backend, Completed, Work, _check_rows
from .serialize import (HeaderError, blob_size, check_blob_size, header_error, pack, pack_bounded,
                        shape_header, shapes_from_header, unpack, unpack_bounded)


def all_gather_single(*args, **kwargs):
    """torch's single-tensor all-gather: ``all_gather_single`` where this torch has it (it
    deprecates ``all_gather_into_tensor`` with a warning), else the older name."""
    return (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)(*args, **kwargs)


def reduce_scatter_single(*args, **kwargs):
    """torch's single-tensor reduce-scatter, chosen as :func:`all_gather_single` is."""
    return (getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor)(*args, **kwargs)


#: How many of the latest collectives' handles a backend keeps (see ``_kept``).
KEPT_WORKS = 256


class TorchDistributedBackend(Backend):
    """Collectives over an initialised torch.distributed process group.

    Variable-size allgather: each rank first gathers every rank's part shapes (one small
    int64 collective), then the payloads travel as one padded byte blob per rank.
    Fixed-size payloads skip the shape exchange.
    """

    name = "torch"

    def __init__(self, group: Optional[Any] = None):
        super().__init__()
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "torch.distributed is not initialised: call mergecomp.distributed.launch.init_distributed() "
                "first (it reads torchrun / mpirun / horovodrun variables), or launch with "
                "'torchrun --nproc_per_node N script.py'")
        self.group = group
        self._rank = dist.get_rank(group)
        self._size = dist.get_world_size(group)
        self.device = self._default_device()
        self.beacon = watchdog.beacon_for(group)
        #: The handles of the latest collectives (this step's), kept until the next step begins
        #: (:meth:`_kept`); bounded, for a backend that never marks a step.
        self._step_works: Deque[Any] = collections.deque(maxlen=KEPT_WORKS)
        release_before_shutdown(self)

    def _default_device(self) -> torch.device:
        if dist.get_backend(self.group) == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def size(self) -> int:
        return self._size

    # -- progress and failures -----------------------------------------------------------
    def mark_step(self, step: int) -> None:
        if self.beacon is not None:
            self.beacon.mark(step, self.collectives)
        self._step_works.clear()  # the last step's collectives are done: released here, on this thread

    def release(self) -> None:
        """Drop the collectives' handles this backend keeps (before its group is destroyed)."""
        self._step_works.clear()

    def _kept(self, work):
        """``work``, also kept here until the next step begins.

        A collective launched during backward captures the autograd engine's thread-local
        state, which holds a Python object (torch stashes a context there), so destroying its
        handle takes the GIL.  If gloo's worker thread dropped the last reference, that could
        happen while the main thread destroys the process group holding the GIL and joining
        that very worker (a script's teardown: a deadlock).  Held here, the handles are only
        ever released by this process's own Python code.

        The oldest handles whose collectives have completed are dropped here (by this Python
        thread, as ``mark_step`` would): a handle holds its collective's outputs, and a step
        that runs many collectives (the ``auto`` scheduler's probes: an allgather's output is
        every rank's payload) would otherwise keep all of them alive until the step ends."""
        kept = self._step_works
        while kept and kept[0].is_completed():
            kept.popleft()
        kept.append(work)
        return work

    def _explain(self, op: str, number: int):
        """For a Work: what a failure of collective ``op`` (this rank's ``number``-th) means."""
        def explain(error: BaseException):
            return watchdog.explain(error, op, self.beacon, self._rank, self._size, number)
        return explain

    @contextmanager
    def _guard(self, op: str):
        """Blocking collectives: a timeout or a lost peer becomes a CollectiveError; a bad
        header from a peer is recorded in this rank's beacon, so the others learn why."""
        number = self.collectives
        try:
            yield
        except HeaderError as error:
            if self.beacon is not None:
                self.beacon.fail(f"HeaderError in {op}: {error}")
            raise
        except Exception as error:
            clearer = watchdog.explain(error, op, self.beacon, self._rank, self._size, number)
            if clearer is None:
                raise
            raise clearer from error

    def explained(self, op: str):
        return self._guard(op)

    def explained_work(self, work, op: str):
        if work is None:
            return None
        return _ExplainedWork(self._kept(work), self._explain(op, self.collectives))

    def _checked(self, op: str, finalize):
        """``finalize`` with a bad peer header recorded in the beacon, as in :meth:`_guard`."""
        def run():
            with self._guard(op):
                return finalize()
        return run

    # -- collectives ---------------------------------------------------------------------
    def allreduce_async(self, tensors: Sequence[torch.Tensor]) -> Work:
        tensors = tuple(tensors)
        self._count_allreduce(tensors)
        with self._guard("allreduce"):
            handles = [self._kept(dist.all_reduce(t, group=self.group, async_op=True)) for t in tensors if t.numel()]
        return Work(handles, lambda: tensors, explain=self._explain("allreduce", self.collectives))

    def allgather_async(self, tensors: Sequence[torch.Tensor], same_shapes: bool,
                        bound: Optional[Sequence[torch.Size]] = None,
                        limit: Optional[int] = None) -> Work:
        tensors = tuple(tensors)
        device = tensors[0].device if tensors else self.device
        dtypes = [t.dtype for t in tensors]
        if not same_shapes and bound is not None and tensors:
            blob = pack_bounded(tensors, bound, device)
            received = [torch.empty_like(blob) for _ in range(self._size)]
            self._count_allgather([blob])
            with self._guard("allgather"):
                handle = self._kept(dist.all_gather(received, blob, group=self.group, async_op=True))
            return Work([handle], self._checked("allgather", lambda: [
                unpack_bounded(r, dtypes, bound, source) for source, r in enumerate(received)]),
                explain=self._explain("allgather", self.collectives))
        if same_shapes:
            shapes_per_rank = [[t.shape for t in tensors]] * self._size
            sizes = [blob_size(shapes_per_rank[0], dtypes)]
        else:
            header = shape_header(tensors, device)
            gathered = [torch.empty_like(header) for _ in range(self._size)]
            self._count_allgather([header])
            with self._guard("allgather (shape exchange)"):
                self._kept(dist.all_gather(gathered, header, group=self.group, async_op=True)).wait()
                shapes_per_rank = [shapes_from_header(h, source) for source, h in enumerate(gathered)]
                sizes = [check_blob_size(shapes, dtypes, limit, source)
                         for source, shapes in enumerate(shapes_per_rank)]
        longest = max(sizes)
        if longest == 0:
            return Completed([unpack(torch.empty(0, dtype=torch.uint8, device=device), s, dtypes)
                              for s in shapes_per_rank])
        blob = pack(tensors, device, size=longest)
        received = [torch.empty(longest, dtype=torch.uint8, device=device) for _ in range(self._size)]
        self._count_allgather([blob])
        with self._guard("allgather"):
            handle = self._kept(dist.all_gather(received, blob, group=self.group, async_op=True))

        def finalize():
            return [unpack(r, s, dtypes) for r, s in zip(received, shapes_per_rank)]

        return Work([handle], finalize, explain=self._explain("allgather", self.collectives))

    def alltoall(self, chunks: Sequence[torch.Tensor], limit: Optional[int] = None) -> List[torch.Tensor]:
        if len(chunks) != self._size:
            raise ValueError(f"alltoall needs one chunk per rank ({self._size}), got {len(chunks)}")
        device = chunks[0].device
        counts = [c.numel() * c.element_size() for c in chunks]
        send_sizes = torch.tensor(counts, dtype=torch.int64, device=device)
        all_sizes = [torch.empty_like(send_sizes) for _ in range(self._size)]
        self._count_allgather([send_sizes])
        with self._guard("alltoall (size exchange)"):
            self._kept(dist.all_gather(all_sizes, send_sizes, group=self.group, async_op=True)).wait()
            recv_sizes = [self._received_size(sizes, source, limit)
                          for source, sizes in enumerate(all_sizes)]
        send = torch.cat([c.reshape(-1).view(torch.uint8) for c in chunks])
        recv = torch.empty(sum(recv_sizes), dtype=torch.uint8, device=device)
        self._count_alltoall(chunks)
        with self._guard("alltoall"):
            self._kept(dist.all_to_all_single(recv, send, output_split_sizes=recv_sizes,
                                              input_split_sizes=counts, group=self.group, async_op=True)).wait()
        return list(torch.split(recv, recv_sizes))

    def reduce_scatter(self, chunks: torch.Tensor) -> torch.Tensor:
        _check_rows(chunks, self._size, "reduce_scatter")
        out = torch.empty_like(chunks[0])
        self._count_alltoall(list(chunks))
        with self._guard("reduce_scatter"):
            self._kept(reduce_scatter_single(out, chunks.contiguous().view(-1), group=self.group,
                                                  async_op=True)).wait()
        return out

    def alltoall_fixed(self, chunks: torch.Tensor) -> torch.Tensor:
        _check_rows(chunks, self._size, "alltoall_fixed")
        received = torch.empty_like(chunks)
        self._count_alltoall(list(chunks))
        with self._guard("alltoall"):
            self._kept(dist.all_to_all_single(received.view(-1), chunks.contiguous().view(-1), group=self.group,
                                              async_op=True)).wait()
        return received

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        self.collectives += 1
        if self._rank == src:
            self.bytes_sent += tensor.numel() * tensor.element_size()
        with self._guard("broadcast"):
            self._kept(dist.broadcast(tensor, src=src, group=self.group, async_op=True)).wait()
        return tensor

    def _received_size(self, sizes: torch.Tensor, source: int, limit: Optional[int]) -> int:
        """The byte count rank ``source`` announces for this rank, checked."""
        announced = sizes.tolist()
        if any(n < 0 for n in announced):
            raise header_error(source, f"its all-to-all sizes {announced} include negative counts")
        size = announced[self._rank]
        if limit is not None and size > limit:
            raise header_error(source, f"it announces a {size}-byte chunk for rank {self._rank}, "
                                       f"more than the {limit} bytes a chunk of this group may take")
        return size

    def barrier(self) -> None:
        with self._guard("barrier"):
            self._kept(dist.barrier(group=self.group, async_op=True)).wait()


class _ExplainedWork(dist.Work):
    """A torch.distributed Work whose ``wait()`` failures are the backend's named errors (a
    ``dist.Work`` itself, so code that checks ``isinstance(work, dist.Work)`` still waits)."""

    def __init__(self, inner, explain):
        super().__init__()
        self._inner, self._explain_error = inner, explain

    def wait(self, timeout=None):
        try:
            return self._inner.wait() if timeout is None else self._inner.wait(timeout)
        except Exception as error:
            clearer = self._explain_error(error)
            if clearer is None:
                raise
            raise clearer from error

    def is_completed(self):
        return self._inner.is_completed()

    def is_success(self):
        return self._inner.is_success()

    def get_future(self):
        return self._inner.get_future()
