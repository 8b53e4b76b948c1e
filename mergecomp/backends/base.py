"""The collective layer.  Compressors and communicators never call torch.distributed.

A backend moves tuples of tensors between ranks and counts every byte it is handed, so
the benchmark's bytes-per-iteration come from what actually went to the network library,
not from an estimate.  Two counters:

``bytes_sent``
    the bytes of the tensors this rank handed to collectives (payloads, size headers,
    padding): what the compressors produced.
``wire_bytes``
    what this rank transmits for them under the standard algorithms: a ring allreduce
    sends 2(N−1)/N of its buffer, a ring allgather forwards N−1 blocks, an all-to-all
    sends every chunk but its own.  Derived from the handed bytes, so it is exact for
    those algorithms and a model for others (tree allreduce, NCCL's protocol choices).
    It is what makes allgather's cost growth with N visible next to allreduce.  Async operations return a :class:`Work` whose ``wait()`` gives
the result.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, List, Optional, Sequence, Tuple

import torch

Tensors = Tuple[torch.Tensor, ...]


class Work:
    """An operation in flight: ``wait()`` blocks until done and returns its result."""

    def __init__(self, handles: Sequence[Any] = (), finalize: Optional[Callable[[], Any]] = None):
        self._handles = list(handles)
        self._finalize = finalize
        self._done = False
        self._result = None

    def wait(self):
        if not self._done:
            for handle in self._handles:
                handle.wait()
            self._result = self._finalize() if self._finalize is not None else None
            self._done = True
        return self._result


class Completed(Work):
    """A Work whose result is already known."""

    def __init__(self, result):
        super().__init__()
        self._result = result
        self._done = True


class Backend:
    """Base class of collective backends (torch.distributed, Horovod)."""

    name = "backend"

    def __init__(self):
        self.bytes_sent = 0
        self.wire_bytes = 0
        self.collectives = 0

    # -- identity ---------------------------------------------------------------------
    @property
    def rank(self) -> int:
        raise NotImplementedError

    @property
    def size(self) -> int:
        raise NotImplementedError

    # -- accounting -------------------------------------------------------------------
    @staticmethod
    def _nbytes(tensors: Sequence[torch.Tensor]) -> int:
        return sum(t.numel() * t.element_size() for t in tensors)

    def _count_allreduce(self, tensors: Sequence[torch.Tensor]) -> None:
        handed = self._nbytes(tensors)
        self.collectives += 1
        self.bytes_sent += handed
        self.wire_bytes += handed * 2 * (self.size - 1) // self.size

    def _count_allgather(self, tensors: Sequence[torch.Tensor]) -> None:
        handed = self._nbytes(tensors)
        self.collectives += 1
        self.bytes_sent += handed
        self.wire_bytes += handed * (self.size - 1)

    def _count_alltoall(self, chunks: Sequence[torch.Tensor], extra: Sequence[torch.Tensor] = ()) -> None:
        """``chunks[r]`` goes to rank r (the own chunk stays local); ``extra`` goes to all."""
        handed = self._nbytes(chunks) + self._nbytes(extra)
        self.collectives += 1
        self.bytes_sent += handed
        self.wire_bytes += (self._nbytes(chunks) - self._nbytes([chunks[self.rank]])
                            + self._nbytes(extra) * (self.size - 1))

    @contextlib.contextmanager
    def uncounted(self) -> Iterator[None]:
        """Collectives issued inside this block are not counted: on exit the counters
        (``bytes_sent``, ``wire_bytes``, ``collectives``) are what they were on entry.

        For measurement traffic (probes, a scheduler's dummy collectives), which is no
        part of what training sends.  Wrap only the probe's own calls: a training
        collective issued inside the block, from this thread or another, would go
        uncounted too.
        """
        counters = (self.bytes_sent, self.wire_bytes, self.collectives)
        try:
            yield
        finally:
            self.bytes_sent, self.wire_bytes, self.collectives = counters

    # -- collectives ------------------------------------------------------------------
    def allreduce_async(self, tensors: Sequence[torch.Tensor]) -> Work:
        """Sum each tensor over all ranks, in place; ``wait()`` returns the tuple."""
        raise NotImplementedError

    def allgather_async(self, tensors: Sequence[torch.Tensor], same_shapes: bool,
                        bound: Optional[Sequence[torch.Size]] = None) -> Work:
        """Gather a tuple of tensors from every rank; ``wait()`` returns one tuple per rank.

        With ``same_shapes`` every rank sends tensors of the local shapes; otherwise shapes
        may differ per rank (including empty tensors).  Then ``bound``, the largest shape
        of each part (the same on every rank), lets the shapes travel inside one
        fixed-size blob; without it a backend whose collectives need sizes up front
        exchanges the shapes first, a blocking collective: the caller waits for every rank.
        """
        raise NotImplementedError

    def alltoall(self, chunks: Sequence[torch.Tensor]) -> List[torch.Tensor]:
        """Send 1-D uint8 ``chunks[r]`` to rank r; return the chunk received from each rank."""
        raise NotImplementedError

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Overwrite ``tensor`` with rank ``src``'s, in place (blocking); returns it."""
        raise NotImplementedError

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        raise NotImplementedError

    def allgather_object(self, obj: Any) -> List[Any]:
        raise NotImplementedError

    def barrier(self) -> None:
        raise NotImplementedError
