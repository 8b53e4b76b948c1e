"""Run compressors on a single process, as if it were one rank or several.

Benchmarks, tests and notebooks need "compress then decode" without a process group.
One-shot compressors do exactly that; multi-round ones (PowerSGD) have their
:meth:`~mergecomp.compressors.base.Compressor.rounds` driven with the identity in place
of each allreduce (the sum over one rank is the tensor itself).  :func:`run_workers`
plays several ranks in one process, one compressor instance each, with every collective
computed in memory: a reference for what the communicators produce on real ranks.
"""
from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch

from .base import AllReduce, Compressor, GroupLayout, accepts_layout, payload_nbytes


def _with_layout(method, tensor, name, layout):
    """``compress``/``rounds`` with the layout, as the communicators call it: compressors
    that take none (elementwise ones, plugins written before layouts) without it."""
    if layout is not None and accepts_layout(method):
        return method(tensor, name, layout=layout)
    return method(tensor, name)


def run_locally(compressor: Compressor, tensor: torch.Tensor, name: str = "tensor",
                layout: Optional[GroupLayout] = None) -> Tuple[torch.Tensor, int]:
    """(decoded tensor, bytes this rank would put on the wire) for one step on one rank.

    ``layout``: the per-parameter views of ``tensor`` (see
    :class:`~mergecomp.compressors.base.ParamView`), for the compressors that factor each
    layer; None treats the tensor as one parameter."""
    if not compressor.multi_round:
        payload, ctx = _with_layout(compressor.compress, tensor, name, layout)
        return compressor.decompress(payload, ctx), payload_nbytes(payload)
    exchange = _with_layout(compressor.rounds, tensor, name, layout)
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


def run_workers(compressors: Sequence[Compressor], tensors: Sequence[torch.Tensor],
                name: str = "tensor", layout: Optional[GroupLayout] = None) -> torch.Tensor:
    """One step of ``len(compressors)`` ranks, rank r compressing ``tensors[r]`` with
    ``compressors[r]``: the averaged gradient every rank ends with (divided by the number
    of ranks unless the compressor's ``average`` is False), as the allreduce or allgather
    communicator returns it, with the ``none`` memory.

    Each compressor should be its own instance (state is per rank) with its
    ``process_rank`` set like a communicator would (:meth:`Compressor.set_process_rank`)."""
    if len(compressors) != len(tensors) or not compressors:
        raise ValueError(f"run_workers needs one compressor per tensor, got {len(compressors)} "
                         f"compressors and {len(tensors)} tensors")
    first = compressors[0]
    if first.multi_round:
        exchanges = [_with_layout(c.rounds, t, name, layout) for c, t in zip(compressors, tensors)]
        replies: List[Optional[Tuple[torch.Tensor, ...]]] = [None] * len(exchanges)
        while True:
            requests, results = [], []
            for r, exchange in enumerate(exchanges):
                try:
                    request = exchange.send(replies[r])
                except StopIteration as done:
                    results.append(done.value)
                    continue
                if not isinstance(request, AllReduce):
                    raise TypeError(f"{type(compressors[r]).__name__}.rounds() yielded {request!r}; "
                                    f"it must yield AllReduce requests")
                requests.append(request.tensors)
            if results:
                if requests:
                    raise RuntimeError("ranks finished their rounds after different numbers of "
                                       "collectives: every rank must issue the same collectives")
                total = results[0]
                break
            if len({len(parts) for parts in requests}) != 1:
                raise RuntimeError("ranks issued allreduces of different numbers of tensors")
            sums = [torch.stack([parts[i] for parts in requests]).sum(0)
                    for i in range(len(requests[0]))]
            replies = [tuple(s.clone() for s in sums) for _ in exchanges]
    else:
        encoded = [_with_layout(c.compress, t, name, layout) for c, t in zip(compressors, tensors)]
        total = first.decompress_sum([payload for payload, _ in encoded], encoded[0][1])
    total = total.reshape(tensors[0].shape)
    return total / len(compressors) if first.average else total
