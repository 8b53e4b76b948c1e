"""The Compressor contract.

A compressor turns one flat gradient buffer into a *payload* (a tuple of tensors that
travel over the network) and a *context* (a small local structure needed to decode).
Every byte a compressor sends is in the payload, so the bytes on the wire can be counted
from it exactly.

Capabilities are class attributes the communicators rely on:

``summable``
    payloads from all ranks can be added elementwise and decompressed once
    (``decompress(sum of payloads) == sum of decompress(payload)``), so allreduce can
    carry them.
``fixed_size``
    payload shapes depend only on the input's numel, never on its values, so an
    allgather needs no size exchange.
``average``
    the aggregate is divided by the world size (False for majority vote, whose
    aggregate is already the update direction).
``multi_round``
    the compressor needs several collectives per step (PowerSGD); it then implements
    :meth:`rounds` and the communicator drives the exchange.
``dense`` / ``lossless``
    every coordinate is sent (the casts) / and exactly (FP32).  Memories use them: a
    dense send leaves no coordinate behind, a lossless one leaves no residual at all.
``sums_in_place``
    :meth:`decompress_sum` adds every payload into one buffer instead of decoding each
    into a dense tensor of its own (sparse payloads: one scatter-add per rank).  The cost
    model prices the extra payloads by the profiled ``CodecCost.add``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Generator, List, Optional, Sequence, Tuple

import torch

Payload = Tuple[torch.Tensor, ...]


@dataclass(frozen=True)
class Context:
    """What every decoder needs: the shape and dtype of the original tensor.

    Compressors that need more (shared random indices, a bucket layout) subclass this
    dataclass with named fields; a context never carries data that differs between
    ranks, so one rank's context decodes every rank's payload.
    """

    shape: torch.Size
    dtype: torch.dtype

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


@dataclass
class AllReduce:
    """A request yielded by :meth:`Compressor.rounds`: sum these tensors over all ranks."""

    tensors: Tuple[torch.Tensor, ...]


class Compressor:
    """Base class of every gradient compressor.  See the module docstring for the contract."""

    name = "compressor"
    summable = False
    fixed_size = True
    average = True
    multi_round = False
    dense = False
    lossless = False
    sums_in_place = False
    #: What to pair it with when the user does not say (allgather carries anything).
    recommended_memory = "none"
    recommended_communicator = "allgather"

    def compress(self, tensor: torch.Tensor, name: str) -> Tuple[Payload, Context]:
        """Encode ``tensor`` (the gradients of group ``name``); return (payload, context)."""
        raise NotImplementedError(f"{type(self).__name__} must implement compress()")

    def decompress(self, payload: Payload, ctx: Context) -> torch.Tensor:
        """Decode one payload (or the elementwise sum of summable payloads)."""
        raise NotImplementedError(f"{type(self).__name__} must implement decompress()")

    def aggregate(self, tensors: List[torch.Tensor]) -> torch.Tensor:
        """Combine the decoded tensors of all ranks; the default is their sum."""
        total = tensors[0].clone()
        for t in tensors[1:]:
            total.add_(t)
        return total

    def payload_bound(self, ctx: Context) -> Optional[Tuple[torch.Size, ...]]:
        """The largest shape of each payload part for ``ctx``, the same on every rank, or
        None (the default) when a variable-size payload has no bound.  With a bound the
        allgather communicator sends a fixed-size blob in one asynchronous collective;
        without one it exchanges sizes first, which blocks the hook until every rank gets
        there."""
        return None

    def decompress_sum(self, payloads: Sequence[Payload], ctx: Context) -> torch.Tensor:
        """The aggregate of every rank's payload, flat: what the allgather and PS
        communicators hand on.  By default each payload is decoded into a dense tensor and
        the tensors are combined by :meth:`aggregate`; compressors with ``sums_in_place``
        override it to skip the dense tensor per rank."""
        return self.aggregate([self.decompress(payload, ctx).reshape(-1) for payload in payloads])

    def rounds(self, tensor: torch.Tensor, name: str) -> Generator[AllReduce, Sequence[torch.Tensor], torch.Tensor]:
        """Multi-round exchange for compressors with ``multi_round = True``.

        A generator: it yields :class:`AllReduce` requests, receives the summed tensors
        back, and finally returns the *sum over ranks* of the decoded gradient (the
        communicator averages it).  Keeping the collectives out of the compressor lets the
        communicator order, time and count them like any other.
        """
        raise NotImplementedError(f"{type(self).__name__} is not a multi-round compressor")

    def state_dict(self) -> Dict[str, Any]:
        return {}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        if state:
            raise ValueError(f"{type(self).__name__} has no state but was given keys {sorted(state)}")

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


def payload_nbytes(payload: Sequence[torch.Tensor]) -> int:
    """Bytes a payload puts on the wire."""
    return sum(t.numel() * t.element_size() for t in payload)


def check_ratio(ratio: float, what: str = "compress_ratio") -> float:
    """Validate a fraction in (0, 1]; raise ValueError with the value otherwise."""
    try:
        value = float(ratio)
    except (TypeError, ValueError):
        raise ValueError(f"{what} must be a number in (0, 1], got {ratio!r}") from None
    if not 0.0 < value <= 1.0:
        raise ValueError(f"{what} must be in (0, 1], got {ratio!r}; e.g. 0.01 keeps 1% of the elements")
    return value
