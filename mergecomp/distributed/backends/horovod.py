"""Horovod backend: the same collectives through Horovod, for jobs started by ``horovodrun``.

Written against Horovod's documented ``horovod.torch`` API (0.28.1 and its main branch):
``allreduce_async_(tensor, name=, op=hvd.Sum)``, ``allgather_async(tensor, name=)`` (first
dimensions may differ per rank), ``alltoall_async(tensor, splits=, name=)`` whose
``synchronize`` gives ``(output, received_splits)``, ``broadcast_`` and ``barrier``.
Small values (``broadcast_object``, ``allgather_object``) travel as JSON through these
tensor collectives (:class:`~mergecomp.distributed.backends.base.Backend`), never through Horovod's
pickling ``*_object`` calls.  Horovod matches collectives across ranks by name, so
every call gets a name from a per-backend counter: the same on every rank, because every
rank issues the same collectives in the same order.

Variable-size allgather sends, in one collective, one byte blob per rank that starts with
its own int64 header ``[blob bytes, part shapes padded with -1]``; the receiver walks the
concatenation blob by blob.  Fixed-size payloads travel bare.  Bytes are counted as in the
torch backend: everything this rank hands to Horovod, headers and split tables included.

Installing Horovod: ``make horovod`` (``tools/build_horovod.sh``) builds its last release,
0.28.1, against the installed PyTorch: that release asks for C++14, which PyTorch >= 2.1's
headers do not compile with, and the script builds it as C++17 (see docs/horovod.md).
"""
from __future__ import annotations

import importlib
from typing import List, Optional, Sequence

import torch

from .base import Backend, Completed, Work
from .serialize import blob_size, check_blob_size, header_error, pack, shape_header, shapes_from_header, unpack

INSTALL_ADVICE = (
    "Install Horovod for this PyTorch (" + torch.__version__ + ") with 'make horovod' in a "
    "mergecomp checkout (or 'bash tools/build_horovod.sh <python>'): Horovod's last release, "
    "0.28.1, does not build against PyTorch >= 2.1 as published, and the script builds it as "
    "C++17 (docs/horovod.md). Or keep torch.distributed under horovodrun with "
    "MERGECOMP_BACKEND=torch, or launch with torchrun.")


def import_horovod(why: str):
    """``horovod.torch``, or a RuntimeError saying why it was wanted and how to install it."""
    try:
        return importlib.import_module("horovod.torch")
    except Exception as error:  # ImportError, or a built extension that does not load
        raise RuntimeError(f"{why}, so mergecomp uses Horovod's collectives, but 'import "
                           f"horovod.torch' failed ({type(error).__name__}: {error}). "
                           f"{INSTALL_ADVICE}") from error


class _Pending:
    """One Horovod handle; ``wait()`` synchronizes it and keeps its output."""

    def __init__(self, hvd, handle):
        self._hvd, self._handle, self.output = hvd, handle, None

    def wait(self):
        self.output = self._hvd.synchronize(self._handle)
        return self.output


class HorovodBackend(Backend):
    """Collectives through ``horovod.torch``; calls ``hvd.init()`` if nobody has yet."""

    name = "horovod"

    def __init__(self, why: str = "the Horovod backend was asked for", device=None):
        super().__init__()
        self.hvd = import_horovod(why)
        if not self.hvd.is_initialized():
            self.hvd.init()
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self._calls = 0

    @property
    def rank(self) -> int:
        return self.hvd.rank()

    @property
    def size(self) -> int:
        return self.hvd.size()

    def _name(self, op: str) -> str:
        """A collective name that is the same on every rank and unique among those in flight."""
        self._calls += 1
        return f"mergecomp.{op}.{self._calls}"

    def allreduce_async(self, tensors: Sequence[torch.Tensor]) -> Work:
        tensors = tuple(tensors)
        for t in tensors:
            if not t.is_contiguous():
                raise ValueError(f"Horovod allreduces contiguous tensors only, got one of shape "
                                 f"{tuple(t.shape)} with strides {t.stride()}; pass t.contiguous()")
        self._count_allreduce(tensors)
        pending = [_Pending(self.hvd, self.hvd.allreduce_async_(t, name=self._name("allreduce"),
                                                                op=self.hvd.Sum))
                   for t in tensors if t.numel()]
        return Work(pending, lambda: tensors)

    def allgather_async(self, tensors: Sequence[torch.Tensor], same_shapes: bool,
                        bound: Optional[Sequence[torch.Size]] = None,
                        limit: Optional[int] = None) -> Work:
        # Horovod's allgather takes a different first dimension per rank: variable shapes
        # travel inline in one collective, so ``bound`` is not needed.
        tensors = tuple(tensors)
        device = tensors[0].device if tensors else self.device
        dtypes = [t.dtype for t in tensors]
        if same_shapes:
            shapes = [t.shape for t in tensors]
            size = blob_size(shapes, dtypes)
            if size == 0:
                return Completed([unpack(torch.empty(0, dtype=torch.uint8, device=device), shapes, dtypes)
                                  for _ in range(self.size)])
            blob = pack(tensors, device)

            def parse(gathered):
                return [unpack(gathered[r * size:(r + 1) * size], shapes, dtypes)
                        for r in range(self.size)]
        else:
            header = shape_header(tensors, device)
            header_bytes = 8 * (1 + header.numel())
            total = header_bytes + blob_size([t.shape for t in tensors], dtypes)
            length = torch.tensor([total], dtype=torch.int64, device=device)
            blob = pack((torch.cat([length, header]), *tensors), device)

            def parse(gathered):
                return _walk_blobs(gathered, self.size, header_bytes, dtypes, limit)
        self._count_allgather([blob])
        pending = _Pending(self.hvd, self.hvd.allgather_async(blob, name=self._name("allgather")))
        return Work([pending], lambda: parse(pending.output))

    def alltoall(self, chunks: Sequence[torch.Tensor], limit: Optional[int] = None) -> List[torch.Tensor]:
        if len(chunks) != self.size:
            raise ValueError(f"alltoall needs one chunk per rank ({self.size}), got {len(chunks)}")
        device = chunks[0].device
        send = torch.cat([c.reshape(-1).view(torch.uint8) for c in chunks])
        # The split table is metadata that Horovod reads on the host, not a buffer it
        # hands to NCCL, so it stays on the CPU whatever the payload's device.
        splits = torch.tensor([c.numel() * c.element_size() for c in chunks], dtype=torch.int32)
        self._count_alltoall(chunks, extra=[splits])
        handle = self.hvd.alltoall_async(send, splits=splits, name=self._name("alltoall"))
        received, received_splits = self.hvd.synchronize(handle)
        sizes = received_splits.tolist()
        for source, size in enumerate(sizes):
            if size < 0 or (limit is not None and size > limit):
                raise header_error(source, f"it sent a {size}-byte all-to-all chunk; a chunk of "
                                           f"this group takes at most {limit} bytes")
        return list(torch.split(received.to(device), sizes))

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        self.collectives += 1
        if self.rank == src:
            self.bytes_sent += tensor.numel() * tensor.element_size()
        self.hvd.broadcast_(tensor, root_rank=src, name=self._name("broadcast"))
        return tensor

    def barrier(self) -> None:
        self.hvd.barrier()


def _walk_blobs(gathered: torch.Tensor, world_size: int, header_bytes: int, dtypes,
                limit: Optional[int] = None) -> List[tuple]:
    """Split Horovod's concatenation of variable-size blobs; each starts with its length.

    Every length and shape comes from a peer: each is checked against what is left of the
    concatenation and against ``limit`` before it is used (HeaderError naming the rank).
    """
    results, offset = [], 0
    for source in range(world_size):
        if gathered.numel() - offset < header_bytes:
            raise header_error(source, f"its blob starts {offset} bytes into a {gathered.numel()}-"
                                       f"byte allgather, with no room for a {header_bytes}-byte header")
        head = gathered[offset:offset + header_bytes]
        if head.storage_offset() % 8:
            head = head.clone()
        words = head.view(torch.int64)
        total = int(words[0])
        shapes = shapes_from_header(words[1:], source)
        header_shape = torch.Size([header_bytes // 8])
        needed = check_blob_size([header_shape] + shapes, [torch.int64] + list(dtypes), limit, source)
        if total != needed or offset + total > gathered.numel():
            raise header_error(source, f"its blob claims {total} bytes, its shapes {needed}, and "
                                       f"{gathered.numel() - offset} bytes are left")
        blob = gathered[offset:offset + total]
        if blob.storage_offset() % 8:
            blob = blob.clone()
        results.append(unpack(blob, [header_shape] + shapes, [torch.int64] + list(dtypes))[1:])
        offset += total
    return results
