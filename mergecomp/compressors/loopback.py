"""Run any compressor on a single process, as if it were the only rank.

Benchmarks, tests and notebooks need "compress then decode" without a process group.
One-shot compressors do exactly that; multi-round ones (PowerSGD) have their
:meth:`~mergecomp.compressors.base.Compressor.rounds` driven with the identity in place
of each allreduce (the sum over one rank is the tensor itself).
"""
from __future__ import annotations

from typing import Tuple

import torch

from .base import AllReduce, Compressor, payload_nbytes


def run_locally(compressor: Compressor, tensor: torch.Tensor, name: str = "tensor") -> Tuple[torch.Tensor, int]:
    """(decoded tensor, bytes this rank would put on the wire) for one step on one rank."""
    if not compressor.multi_round:
        payload, ctx = compressor.compress(tensor, name)
        return compressor.decompress(payload, ctx), payload_nbytes(payload)
    exchange = compressor.rounds(tensor, name)
    sent = 0
    reply = None
    try:
        while True:
            request = exchange.send(reply)
            if not isinstance(request, AllReduce):
                raise TypeError(f"{type(compressor).__name__}.rounds() yielded {request!r}; "
                                f"it must yield AllReduce requests")
            sent += payload_nbytes(request.tensors)
            reply = tuple(request.tensors)
    except StopIteration as done:
        return done.value, sent
