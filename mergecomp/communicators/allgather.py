"""Allgather: every rank receives every rank's payload and decodes each one.

Carries any compressor, including payloads whose size differs per rank (DGC) or is zero.
Each rank receives N payloads, so traffic grows with the world size: use it for
compressors that shrink the gradient a lot.

A variable-size payload with a bound (``Compressor.payload_bound``: DGC sends at most k
values) travels in one asynchronous collective, padded to the bound with its shapes in
front; the padding is what the ranks' largest payload would have cost anyway when the
count reaches k, as DGC's usually does.  Without a bound (GradDrop, ATOMO) the backend
exchanges sizes first, which blocks the hook until every rank has reached it; the sizes
peers announce are checked against :func:`~mergecomp.distributed.backends.serialize.payload_limit`
before anything is allocated for them.
"""
from __future__ import annotations

import torch

from . import register
from ..distributed.backends.serialize import payload_limit
from ..compressors.base import accepts_keyword
from .cost import SendCost, collective_cost
from .base import Communicator


@register("allgather")
class AllgatherCommunicator(Communicator):
    """Gathers all payloads and sums them with the local context (``decompress_sum``)."""

    def _launch(self, payload, ctx, name):
        if self.compressor.fixed_size:
            return self.backend.allgather_async(payload, same_shapes=True)
        return self.backend.allgather_async(payload, same_shapes=False,
                                            bound=self.compressor.payload_bound(ctx),
                                            limit=payload_limit(ctx.numel, ctx.dtype))

    def _combine(self, result, handle):
        options, received = {}, None
        if handle.output is not None and self._accepts("out"):
            options["out"] = handle.output
        if self._scatters_received:
            # The sum is zero outside the received indices: the average (finish) divides and
            # the step's non-finite check (nonfinite_flag) reads it there only, O(k·N) instead of O(n).
            if self._accepts("received"):  # handed over by the sum, each payload decoded once
                received = options["received"] = []
            else:
                handle.extra["received_indices"] = torch.cat(
                    [self.compressor.transmitted_indices(payload, handle.ctx) for payload in result])
        total = self.compressor.decompress_sum(result, handle.ctx, **options)
        if received is not None:
            handle.extra["received_indices"] = torch.cat(received)
        return total

    @property
    def _scatters_received(self) -> bool:
        """Whether ``decompress_sum`` scatter-adds sparse payloads into zeros (a sparsifier
        that sums in place and names the indices it sent), so only those can be non-finite."""
        compressor = self.compressor
        return (getattr(compressor, "sums_in_place", False) and not compressor.dense
                and callable(getattr(compressor, "transmitted_indices", None)))

    def _accepts(self, keyword: str) -> bool:
        """Whether the compressor's ``decompress_sum`` takes ``keyword``: ``out`` (it can write
        into a lent buffer), ``received`` (it hands back the indices it scattered)."""
        known = self.__dict__.setdefault("_sum_keywords", {})
        if keyword not in known:
            known[keyword] = accepts_keyword(self.compressor.decompress_sum, keyword)
        return known[keyword]

    # -- cost model (mergecomp.planning.costmodel.communicator_formula) ---------------------------
    #: The collectives the formula below prices with; the profile measures them.
    cost_collectives = ("allgather",)
    #: start() launches the allgather; finish() decodes and sums the payloads: the times of
    #: both in the live run are local work (see costmodel.phases_are_local).
    phases_are_local = True

    @classmethod
    def send_cost(cls, codec, profile):
        """A compressed group: one allgather of the payload, then N payloads decoded and
        aggregated (a copy of the first and N − 1 additions: N passes); a compressor that
        sums in place (``add`` in its codec cost) pays one decode and N − 1 adds instead."""
        gather = collective_cost(profile, "allgather", "the allgather communicator")
        world = profile.world_size
        if codec.add is None:
            return SendCost(codec.encode, codec.wire, gather, codec.decode.scaled(world, world),
                            aggregate_passes=world)
        return SendCost(codec.encode, codec.wire, gather, codec.decode + codec.add.scaled(world - 1, world - 1))
