"""torch.distributed backend: gloo for CPU tensors, NCCL for CUDA tensors."""
from __future__ import annotations

from typing import Any, List, Optional, Sequence

import torch
import torch.distributed as dist

from .base import Backend, Completed, Work
from .serialize import blob_size, pack, pack_bounded, shape_header, shapes_from_header, unpack, unpack_bounded


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
                "torch.distributed is not initialised: call mergecomp.launch.init_distributed() "
                "first (it reads torchrun / mpirun / horovodrun variables), or launch with "
                "'torchrun --nproc_per_node N script.py'")
        self.group = group
        self._rank = dist.get_rank(group)
        self._size = dist.get_world_size(group)
        self.device = self._default_device()

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

    def allreduce_async(self, tensors: Sequence[torch.Tensor]) -> Work:
        tensors = tuple(tensors)
        self._count_allreduce(tensors)
        handles = [dist.all_reduce(t, group=self.group, async_op=True) for t in tensors if t.numel()]
        return Work(handles, lambda: tensors)

    def allgather_async(self, tensors: Sequence[torch.Tensor], same_shapes: bool,
                        bound: Optional[Sequence[torch.Size]] = None) -> Work:
        tensors = tuple(tensors)
        device = tensors[0].device if tensors else self.device
        dtypes = [t.dtype for t in tensors]
        if not same_shapes and bound is not None and tensors:
            blob = pack_bounded(tensors, bound, device)
            received = [torch.empty_like(blob) for _ in range(self._size)]
            self._count_allgather([blob])
            handle = dist.all_gather(received, blob, group=self.group, async_op=True)
            return Work([handle], lambda: [unpack_bounded(r, dtypes) for r in received])
        if same_shapes:
            shapes_per_rank = [[t.shape for t in tensors]] * self._size
        else:
            header = shape_header(tensors, device)
            gathered = [torch.empty_like(header) for _ in range(self._size)]
            self._count_allgather([header])
            dist.all_gather(gathered, header, group=self.group)
            shapes_per_rank = [shapes_from_header(h) for h in gathered]
        sizes = [blob_size(shapes, dtypes) for shapes in shapes_per_rank]
        longest = max(sizes)
        if longest == 0:
            return Completed([unpack(torch.empty(0, dtype=torch.uint8, device=device), s, dtypes)
                              for s in shapes_per_rank])
        blob = pack(tensors, device, size=longest)
        received = [torch.empty(longest, dtype=torch.uint8, device=device) for _ in range(self._size)]
        self._count_allgather([blob])
        handle = dist.all_gather(received, blob, group=self.group, async_op=True)

        def finalize():
            return [unpack(r, s, dtypes) for r, s in zip(received, shapes_per_rank)]

        return Work([handle], finalize)

    def alltoall(self, chunks: Sequence[torch.Tensor]) -> List[torch.Tensor]:
        if len(chunks) != self._size:
            raise ValueError(f"alltoall needs one chunk per rank ({self._size}), got {len(chunks)}")
        device = chunks[0].device
        send_sizes = torch.tensor([c.numel() for c in chunks], dtype=torch.int64, device=device)
        all_sizes = [torch.empty_like(send_sizes) for _ in range(self._size)]
        self._count_allgather([send_sizes])
        dist.all_gather(all_sizes, send_sizes, group=self.group)
        recv_sizes = [int(s[self._rank]) for s in all_sizes]
        send = torch.cat([c.reshape(-1).view(torch.uint8) for c in chunks]) if chunks else \
            torch.empty(0, dtype=torch.uint8, device=device)
        recv = torch.empty(sum(recv_sizes), dtype=torch.uint8, device=device)
        self._count_alltoall(chunks)
        dist.all_to_all_single(recv, send, output_split_sizes=recv_sizes,
                               input_split_sizes=send_sizes.tolist(), group=self.group)
        return list(torch.split(recv, recv_sizes))

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        self.collectives += 1
        if self._rank == src:
            self.bytes_sent += tensor.numel() * tensor.element_size()
        dist.broadcast(tensor, src=src, group=self.group)
        return tensor

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        box = [obj]
        dist.broadcast_object_list(box, src=src, group=self.group, device=self.device)
        return box[0]

    def allgather_object(self, obj: Any) -> List[Any]:
        out: List[Any] = [None] * self._size
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def barrier(self) -> None:
        dist.barrier(group=self.group)
