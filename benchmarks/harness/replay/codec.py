"""Replayed compression: the job's compressor, its processor time replaced by a wait of its
cost on another device.

With compute replayed, a worker's compression still runs on the host's cores; on 32
workers sharing two cores, top-k's selection alone can make the host the bottleneck,
while on a GPU cluster it runs on the accelerator in a millisecond or so.  ``--replay-codecs
gpu`` makes the compressor wait what the committed GPU table says it costs
(:data:`benchmarks.harness.scaling.GPU_TABLE`, lines through its 1M- and 25M-element
points) instead of computing:

* ``compress`` computes the real payload of a group once, on the group's first step
  (kept in a :class:`ResultCache` of bounded size),
  and sends a copy of it every step after, having waited the codec's encode cost (the first
  call's own computing time counts towards its wait);
* ``decompress`` and ``decompress_sum`` likewise: a dense result copied out after waiting
  the decode cost (plus the cost of adding each further payload, for compressors that sum
  in place), taken from one buffer per dtype: the real result of the largest group decoded
  so far (a search tries many group sizes, and one dense result per size would fill a
  worker's memory);
* ``rounds`` (PowerSGD) records the first step's requests and result, and replays them:
  the same collectives of the same sizes, the encode cost spread over the rounds.

So every collective carries the bytes the real compressor sends, at the sizes and in the
order it sends them, and what stays on the host is the exchange's own work: the
communicators' packing, the sparse allreduce's owner sums, the error-feedback memory's
passes, averaging and the write-back.  The values carried are the first step's (a
timing run does not train), and every rank still sends its own.

The replayed compressor is an instance of a subclass of the real compressor's class
(:func:`replayed`), so every check a communicator makes of it (a sparsifier for the
sparse allreduce, summable for the allreduce) sees what it sees in training.
"""
from __future__ import annotations

import collections
import copy
import time
from typing import Hashable, Optional

import torch

from mergecomp.compressors.base import AllReduce, Compressor, accepts_keyword, accepts_layout
from mergecomp.planning.profile import CodecCost


#: How many MiB of replayed results a compressor keeps (:class:`ResultCache`).
CACHE_MB = 128


def _nbytes(value) -> int:
    """The bytes of the tensors in ``value`` (a tensor, or tuples and lists of them)."""
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (tuple, list)):
        return sum(_nbytes(v) for v in value)
    return 0


class ResultCache:
    """The replayed results by key, the least recently used dropped past ``limit_bytes``.

    What it holds: each group's first payload (and PowerSGD's recorded rounds); the dense
    decodes and sums are one buffer per dtype (:meth:`ReplayedCodec._dense`).  Why bounded:
    an adaptive scheduler tries many plans while it searches, each with its own group names
    and sizes, in each of 32 workers sharing one host's memory.  The few plans a timing run
    then rotates through fit within the bound, so their steps reuse their results and never
    compute."""

    def __init__(self, limit_bytes: int):
        self.limit_bytes = int(limit_bytes)
        self.nbytes = 0
        self._entries: "collections.OrderedDict[Hashable, tuple]" = collections.OrderedDict()

    def __contains__(self, key) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def __getitem__(self, key):
        self._entries.move_to_end(key)
        return self._entries[key][0]

    def __setitem__(self, key, value) -> None:
        if key in self._entries:
            self.nbytes -= self._entries.pop(key)[1]
        size = _nbytes(value)
        self._entries[key] = (value, size)
        self.nbytes += size
        while self.nbytes > self.limit_bytes and len(self._entries) > 1:  # the newest always stays
            self.nbytes -= self._entries.popitem(last=False)[1][1]


class ReplayedCodec:
    """The mix-in of :func:`replayed`: caches and waits around the real class's methods."""

    def _replay_init(self, cost: CodecCost, time_scale: float, cache_mb: float = CACHE_MB) -> None:
        self._cost, self._scale = cost, float(time_scale)
        self._cache = ResultCache(cache_mb * 2 ** 20)
        self._dense_results: dict = {}  # dtype -> the largest real dense result so far
        base = type(self).__mro__[2]  # the real compressor's class
        self._takes_layout = accepts_layout(base.rounds if self.multi_round else base.compress)
        self._sum_takes_out = accepts_keyword(base.decompress_sum, "out")

    def _wait(self, seconds: float, began: float) -> None:
        left = seconds * self._scale - (time.perf_counter() - began)
        if left > 0:
            time.sleep(left)

    def compress(self, tensor, name, layout=None):
        began = time.perf_counter()
        key = ("compress", name, tensor.numel(), tensor.dtype)
        if key not in self._cache:
            extra = {"layout": layout} if self._takes_layout else {}
            self._cache[key] = super().compress(tensor, name, **extra)
        payload, ctx = self._cache[key]
        self._wait(self._cost.encode(tensor.numel()), began)
        return tuple(t.clone() for t in payload), ctx

    def decompress(self, payload, ctx):
        began = time.perf_counter()
        result = self._dense(ctx, lambda: super(ReplayedCodec, self).decompress(payload, ctx))
        self._wait(self._cost.decode(ctx.numel), began)
        return result.clone()

    def decompress_sum(self, payloads, ctx, out: Optional[torch.Tensor] = None):
        began = time.perf_counter()
        result = self._dense(ctx, lambda: super(ReplayedCodec, self).decompress_sum(payloads, ctx))
        extra = len(payloads) - 1
        cost = self._cost.decode(ctx.numel) + (self._cost.add(ctx.numel) * extra if self._cost.add else 0.0)
        self._wait(cost, began)
        if out is not None and out.numel() == result.numel() and out.dtype == result.dtype:
            return out.view(result.shape).copy_(result)
        return result.clone()

    def _dense(self, ctx, compute) -> torch.Tensor:
        """A dense result of ``ctx``'s size and shape: a view of the largest real result of
        ``ctx``'s dtype computed so far (``compute()`` runs only when this group is larger)."""
        kept = self._dense_results.get(ctx.dtype)
        if kept is None or kept.numel() < ctx.numel:
            kept = self._dense_results[ctx.dtype] = compute().reshape(-1).clone()
        return kept[: ctx.numel].view(ctx.shape)

    def rounds(self, tensor, name, layout=None, out: Optional[torch.Tensor] = None):
        key = ("rounds", name, tensor.numel(), tensor.dtype)
        if key in self._cache:
            return self._replay_rounds(self._cache[key], tensor.numel(), out)
        return self._record_rounds(key, tensor, name, layout, out)

    def _record_rounds(self, key, tensor, name, layout, out):
        began = time.perf_counter()
        extra = {"layout": layout} if self._takes_layout else {}
        inner = super().rounds(tensor, name, **extra)
        requests = []
        request = next(inner)
        while True:
            requests.append(tuple(t.clone() for t in request.tensors))
            result = yield request
            try:
                request = inner.send(result)
            except StopIteration as stop:
                total = stop.value
                break
        self._cache[key] = (requests, total.clone())
        self._wait(self._cost.encode(tensor.numel()) + self._cost.decode(tensor.numel()), began)
        return out.copy_(total.reshape(-1)) if out is not None else total

    def _replay_rounds(self, recorded, numel, out):
        requests, total = recorded
        share = self._cost.encode(numel) / len(requests)
        for tensors in requests:
            began = time.perf_counter()
            self._wait(share, began)
            yield AllReduce(tuple(t.clone() for t in tensors))
        self._wait(self._cost.decode(numel), time.perf_counter())
        return out.copy_(total.reshape(-1)) if out is not None else total.clone()


def replayed(compressor: Compressor, cost: CodecCost, time_scale: float = 1.0,
             cache_mb: float = CACHE_MB) -> Compressor:
    """A copy of ``compressor`` whose compress, decompress, decompress_sum and rounds wait
    ``cost`` (× ``time_scale``) instead of computing after their first call (module
    docstring), keeping at most ``cache_mb`` MiB of results (:class:`ResultCache`); its
    class subclasses the real one."""
    if not isinstance(compressor, Compressor):
        raise TypeError(f"replayed() takes a mergecomp Compressor, got {compressor!r}")
    if not time_scale > 0:
        raise ValueError(f"a replayed codec's time scale must be > 0, got {time_scale!r}")
    cls = type(compressor)
    # Fixed as the real instance has it: a sparsifier derives it from which methods its class
    # overrides, and the replay overrides them all.
    subclass = type(f"Replayed{cls.__name__}", (ReplayedCodec, cls),
                    {"__module__": __name__, "sums_in_place": bool(compressor.sums_in_place)})
    twin = copy.copy(compressor)
    twin.__class__ = subclass
    if not cache_mb > 0:
        raise ValueError(f"a replayed codec keeps > 0 MiB of results, got {cache_mb!r}")
    twin._replay_init(cost, time_scale, cache_mb)
    return twin
