"""Run any compressor on a single process, as if it were the only rank.

Benchmarks, tests and notebooks need "compress then decode" without a process group.
One-shot compressors do exactly that; multi-round ones (PowerSGD) have their
:meth:`~mergecomp.compressors.base.Compressor.rounds` driven with the identity in place
of each allreduce (the sum over one rank is the tensor itself).
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from .base import AllReduce, Compressor, GroupLayout, accepts_layout, payload_nbytes


def run_locally(compressor: Compressor, tensor: torch.Tensor, name: str = "tensor",
                layout: Optional[GroupLayout] = None) -> Tuple[torch.Tensor, int]:
    """(decoded tensor, bytes this rank would put on the wire) for one step on one rank.

    ``layout`` (the group's parameter views) is passed on to compressors that take one.
    """
    method = compressor.rounds if compressor.multi_round else compressor.compress
    args = (tensor, name)
    kwargs = {"layout": layout} if accepts_layout(method) else {}
    if not compressor.multi_round:
        payload, ctx = compressor.compress(*args, **kwargs)
        return compressor.decompress(payload, ctx), payload_nbytes(payload)
    exchange = compressor.rounds(*args, **kwargs)
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
