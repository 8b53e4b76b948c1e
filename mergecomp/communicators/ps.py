"""PS: a colocated, sharded parameter server built from collectives.

As in BytePS (Jiang et al., OSDI 2020) and MergeComp's PS mode, every rank is a worker and
also the server of one shard.  For a group of n elements on N ranks:

1. the buffer is cut into N contiguous shards (the first n mod N shards hold one element
   more, so sizes differ by at most one; shards are empty when n < N);
2. each worker runs error feedback and compression per shard, under the names
   ``f"{name}/shard{r}"`` (memory and compressor state are kept per shard);
3. an all-to-all sends shard r's payload to rank r (nothing is sent to oneself);
4. server r combines its N payloads:

   * summable compressors (``none``, fp16, bf16, rand-k with shared indices): the payloads
     are added elementwise.  ``decode(Σ payloads) == Σ decode(payload)`` is what summable
     means, so the sum *is* the aggregate, exact and already compressed: the server has
     nothing to recompress and keeps no residual.  With ``none`` this is a reduce-scatter
     (gloo has none, so it is an all-to-all plus a local sum), and step 5 is the allgather
     that completes the allreduce: 2·(N−1)/N·4n bytes per rank, like a ring allreduce;
   * any other compressor: the payloads are combined by ``compressor.decompress_sum``
     (each decoded, then ``aggregate``: majority vote for signSGD; sparse payloads are
     scatter-added into one buffer), divided by N when ``compressor.average``, the server's
     residual is added, the result is compressed again and what that loses becomes the new
     server residual (error feedback on the server, Zheng et al., NeurIPS 2019);

5. every server's payload is all-gathered back and each worker decodes and concatenates the
   shards into the averaged group.

Majority-vote compressors (``average = False``: signSGD, SIGNUM) send the vote back as
packed signs with ``signsgd``, as in Bernstein et al. (ICLR 2019): the vote is already a
sign vector, and SIGNUM's momentum belongs to the workers, not to the vote.

Non-summable compressors must have contexts that carry only shape, dtype and the shard's
layout (true for every built-in): workers decode the server's recompressed shard with their
own shard context, and the server compresses its shard with the same clipped layout.

Wire per rank for n elements, p(m) the payload bytes of m elements, s = ⌈n/N⌉:
all-to-all (N−1)·p(s) plus N·8 bytes of sizes (plus a shape header per shard for
variable-size payloads); allgather p(s) padded to the largest server payload, plus a small
header.  Compare allgather's p(n) sent and N·p(n) received per rank.

Async contract: ``start`` blocks for compression, the all-to-all and the server's work (it
runs inside the backward hook), then launches the allgather asynchronously; ``finish``
waits for the allgather and decodes.  Multi-round compressors (PowerSGD) go through the
base class's allreduce rounds instead.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from . import register
from .cost import SendCost, collective_cost
from .base import Communicator, Handle
from ..distributed.backends.serialize import (MAX_DIMS, blob_size, check_blob_size, header_error, pack, payload_limit,
                                  unpack)
from .. import compressors
from ..compressors.base import Compressor, Context, GroupLayout, accepts_layout, clip_layout
from ..memories.none import NoneMemory
from ..staging import StagedDict

#: dtypes a self-describing blob can carry, by code.
_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.uint8,
           torch.int8, torch.int16, torch.int32, torch.int64, torch.bool, torch.float8_e4m3fn)
_HEADER_ROW = 2 + MAX_DIMS  # dtype code, ndim, dims


def shard_sizes(numel: int, world_size: int) -> List[int]:
    """N contiguous shard lengths summing to ``numel``; the first ``numel % N`` get one more."""
    base, extra = divmod(numel, world_size)
    return [base + (1 if r < extra else 0) for r in range(world_size)]


def encode(payload: Sequence[torch.Tensor], device) -> torch.Tensor:
    """One uint8 blob holding a payload and its own shapes and dtypes.

    Layout: int64 header ``[parts, (dtype code, ndim, dims padded with -1) per part]``, then
    the parts, each 8-byte aligned.  Costs 8 + 48 bytes per part over the bare payload.
    """
    rows = [len(payload)]
    for part in payload:
        if part.dtype not in _DTYPES:
            raise ValueError(f"PS cannot carry payload dtype {part.dtype}; supported: "
                             f"{[str(d) for d in _DTYPES]}")
        if part.dim() > MAX_DIMS:
            raise ValueError(f"PS payload parts may have at most {MAX_DIMS} dims, got shape "
                             f"{tuple(part.shape)}")
        rows += [_DTYPES.index(part.dtype), part.dim()] + list(part.shape) + [-1] * (MAX_DIMS - part.dim())
    header = torch.tensor(rows, dtype=torch.int64, device=device)
    return pack((header, *payload), device)


def decode(blob: torch.Tensor, source: Optional[int] = None) -> Tuple[torch.Tensor, ...]:
    """Inverse of :func:`encode`; an empty blob is an empty payload (an empty shard).

    The header comes from rank ``source``: its part count, dtype codes, dims and the bytes
    they describe are checked against the blob before any part is viewed (HeaderError).
    """
    if blob.numel() == 0:
        return ()
    if blob.numel() < 8:
        raise header_error(source, f"a PS blob has an 8-byte header at least, got {blob.numel()} bytes")
    blob = _aligned(blob)
    parts = int(blob[:8].view(torch.int64)[0])
    header_len = 1 + parts * _HEADER_ROW
    if parts < 0 or 8 * header_len > blob.numel():
        room = (blob.numel() // 8 - 1) // _HEADER_ROW
        raise header_error(source, f"its PS blob of {blob.numel()} bytes claims {parts} parts; "
                                   f"its header has room for {room} at most")
    rows = blob[:8 * header_len].view(torch.int64)[1:].view(parts, _HEADER_ROW).tolist()
    shapes, dtypes = [], []
    for index, row in enumerate(rows):
        code, ndim, dims = row[0], row[1], row[2:]
        if (not 0 <= code < len(_DTYPES) or not 0 <= ndim <= MAX_DIMS
                or any(d < 0 for d in dims[:ndim]) or any(d != -1 for d in dims[ndim:])):
            raise header_error(source, f"part {index} of its PS blob has the header row {row}; "
                                       f"expected a dtype code in 0..{len(_DTYPES) - 1}, a dim "
                                       f"count in 0..{MAX_DIMS}, that many sizes >= 0, then -1s")
        shapes.append(torch.Size(dims[:ndim]))
        dtypes.append(_DTYPES[code])
    check_blob_size([torch.Size([header_len])] + shapes, [torch.int64] + dtypes, blob.numel(), source)
    return unpack(blob, [torch.Size([header_len])] + shapes, [torch.int64] + dtypes)[1:]


def _aligned(blob: torch.Tensor) -> torch.Tensor:
    """A uint8 view whose start is 8-byte aligned, so parts can be viewed as any dtype."""
    return blob if blob.storage_offset() % 8 == 0 else blob.clone()


@register("ps")
class PSCommunicator(Communicator):
    """Colocated sharded parameter server: all-to-all up, server recompression, allgather down.

    Args:
        compressor, memory, backend: as for every communicator; ``memory`` is the workers'
            error feedback, applied per shard.
        server_residual: keep the servers' recompression error and add it to the next
            step's aggregate (error feedback on the server).  None (the default) does what
            the workers do: on when the server recompresses (non-summable compressors) and
            ``memory`` feeds errors back; off with the ``none`` memory, the choice for
            unbiased compressors (QSGD, TernGrad, ATOMO), whose large unbiased errors error
            feedback would accumulate instead of averaging out, and for majority vote.
            Summable compressors are aggregated exactly and never keep a server residual.
    """

    def __init__(self, compressor, memory, backend, server_residual: Optional[bool] = None):
        super().__init__(compressor, memory, backend)
        if server_residual is not None and not isinstance(server_residual, bool):
            raise ValueError(f"server_residual must be True, False or None (automatic), got "
                             f"{server_residual!r}")
        self.recompresses = not compressor.summable
        if server_residual is None:
            server_residual = not isinstance(memory, NoneMemory)
        self.server_residual = self.recompresses and server_residual
        self.server_residuals = StagedDict()  # staged like the memories': see commit()
        self._vote_compressor: Optional[Compressor] = None

    @property
    def server_compressor(self) -> Compressor:
        """What the servers send back with: the compressor itself, or ``signsgd`` for a vote."""
        if self.compressor.average:
            return self.compressor
        if self._vote_compressor is None:
            self._vote_compressor = compressors.create("signsgd")
        return self._vote_compressor

    # -- start: workers compress, all-to-all, servers aggregate, allgather launched -----
    def start(self, tensor: torch.Tensor, name: str, layout: Optional[GroupLayout] = None,
              in_place: bool = False) -> Handle:
        """As :meth:`Communicator.start`; the result always comes in a new tensor (the
        shards' replies are decoded per rank), so ``in_place`` changes nothing."""
        if self.compressor.multi_round:
            return super().start(tensor, name, layout)
        rank, size = self.backend.rank, self.backend.size
        flat = tensor.reshape(-1)
        sizes = shard_sizes(flat.numel(), size)
        shards = torch.split(flat, sizes)
        payloads: List[Tuple[torch.Tensor, ...]] = []
        contexts: List[Optional[Context]] = []
        layouts: List[Optional[GroupLayout]] = []
        start = 0
        for r, shard in enumerate(shards):
            layouts.append(None if layout is None else clip_layout(layout, start, start + sizes[r]))
            start += sizes[r]
            payload, ctx = self._compress_shard(shard, f"{name}/shard{r}", layouts[r])
            payloads.append(payload)
            contexts.append(ctx)
        chunks = [self._uplink_chunk(payloads[r], flat.device) if r != rank
                  else torch.empty(0, dtype=torch.uint8, device=flat.device) for r in range(size)]
        # What peers announce is checked against what a shard of this group can take.
        received = self.backend.alltoall(chunks, limit=payload_limit(sizes[rank], flat.dtype))
        mine = [payloads[rank] if r == rank else self._uplink_payload(received[r], payloads[rank], r)
                for r in range(size)]
        reply = self._serve(mine, contexts[rank], f"{name}/shard{rank}", layouts[rank])
        work = self.backend.allgather_async((encode(reply, flat.device),), same_shapes=False,
                                            limit=payload_limit(max(sizes), flat.dtype))
        return Handle(name, tensor.shape, work, extra={"contexts": contexts, "dtype": flat.dtype,
                                                       "device": flat.device})

    def _compress_shard(self, shard: torch.Tensor, shard_name: str, layout: Optional[GroupLayout]):
        if shard.numel() == 0:  # fewer elements than ranks: nothing to send for this shard
            return (), None
        compensated = self.memory.compensate(shard, shard_name)
        payload, ctx = self._encode(self.compressor.compress, compensated, shard_name, layout)
        self.memory.update(compensated, shard_name, self.compressor, payload, ctx)
        if self.recompresses:
            _check_plain_context(ctx, self.compressor)
        return tuple(payload), ctx

    def _uplink_chunk(self, payload, device) -> torch.Tensor:
        """Fixed-size payloads travel bare (the server knows their shapes); others with a header."""
        if not payload:
            return torch.empty(0, dtype=torch.uint8, device=device)
        return pack(payload, device) if self.compressor.fixed_size else encode(payload, device)

    def _uplink_payload(self, chunk: torch.Tensor, own: Tuple[torch.Tensor, ...], source: int):
        """Rank ``source``'s payload for this rank's shard, checked against this rank's own
        payload for it: the same compressor on a shard of the same size gives the same
        parts and dtypes (and, fixed-size, the same bytes)."""
        if not own:
            if chunk.numel():
                raise header_error(source, f"it sent {chunk.numel()} bytes for shard "
                                           f"{self.backend.rank}, which is empty")
            return ()
        if self.compressor.fixed_size:
            expected = blob_size([p.shape for p in own], [p.dtype for p in own])
            if chunk.numel() != expected:
                raise header_error(source, f"it sent {chunk.numel()} bytes for shard "
                                           f"{self.backend.rank}, whose fixed-size payload "
                                           f"takes {expected}")
            return unpack(_aligned(chunk), [p.shape for p in own], [p.dtype for p in own])
        payload = decode(chunk, source)
        if [p.dtype for p in payload] != [p.dtype for p in own]:
            raise header_error(source, f"its payload for shard {self.backend.rank} has parts of "
                                       f"dtypes {_names(payload)}, this rank's compressor "
                                       f"makes {_names(own)}")
        return payload

    def _serve(self, payloads, ctx: Optional[Context], shard_name: str,
               layout: Optional[GroupLayout]) -> Tuple[torch.Tensor, ...]:
        """The server's work for its shard: the aggregate, compressed, to send back."""
        if ctx is None:  # an empty shard
            return ()
        if not self.recompresses:
            total = tuple(part.clone() for part in payloads[0])
            for payload in payloads[1:]:
                for acc, part in zip(total, payload):
                    acc.add_(part)
            return total
        aggregate = self.compressor.decompress_sum(payloads, ctx)
        if self.compressor.average:
            aggregate = aggregate.div_(self.backend.size)
        if self.server_residual:
            residual = self.server_residuals.get(shard_name)
            if residual is not None:
                if residual.shape != aggregate.shape:
                    raise ValueError(
                        f"server residual of {shard_name!r} has {residual.numel()} elements but "
                        f"the shard has {aggregate.numel()}: the plan or world size changed; "
                        "build a new communicator (or load a matching state)")
                aggregate = aggregate.add_(residual)
        server = self.server_compressor
        if server is self.compressor:
            payload, server_ctx = self._encode(server.compress, aggregate, shard_name + "/server", layout)
        elif layout is not None and accepts_layout(server.compress):  # the vote's signs, flagged per view
            payload, server_ctx = server.compress(aggregate, shard_name + "/server", layout=layout)
        else:
            payload, server_ctx = server.compress(aggregate, shard_name + "/server")
        if self.server_residual:
            sent = server.decompress(payload, server_ctx).reshape(-1)
            self.server_residuals[shard_name] = aggregate - sent
        return tuple(payload)

    # -- finish: wait for the servers' shards and reassemble ------------------------------
    def finish(self, handle: Handle) -> torch.Tensor:
        """Wait for the allgather (the only collective left in flight) and decode the shards."""
        if handle.rounds is not None:
            return super().finish(handle)
        contexts = handle.extra["contexts"]
        decoder = self.compressor if not self.recompresses else self.server_compressor
        pieces = []
        for source, ((blob,), ctx) in enumerate(zip(handle.work.wait(), contexts)):
            if ctx is None:
                continue
            pieces.append(decoder.decompress(decode(blob, source), ctx).reshape(-1))
        if not pieces:
            return torch.empty(handle.shape, dtype=handle.extra["dtype"], device=handle.extra["device"])
        total = torch.cat(pieces)
        if not self.recompresses and self.compressor.average:
            total = total.div_(self.backend.size)
        return total.view(handle.shape)

    # -- state ----------------------------------------------------------------------------
    def commit(self) -> None:
        """Keep this step's worker and server state (every rank agreed the step is good)."""
        super().commit()
        self.server_residuals.commit()
        if self._vote_compressor is not None:
            self._vote_compressor.commit()

    def rollback(self) -> None:
        """Drop this step's worker and server state: residuals are the previous step's."""
        super().rollback()
        self.server_residuals.rollback()
        if self._vote_compressor is not None:
            self._vote_compressor.rollback()

    def state_dict(self) -> Dict[str, Any]:
        state = super().state_dict()
        state["server_residuals"] = {k: v.detach().clone()
                                     for k, v in self.server_residuals.committed().items()}
        if self._vote_compressor is not None:
            state["server_compressor"] = self._vote_compressor.state_dict()
        return state

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.server_residuals.replace({k: v.clone() for k, v in state.get("server_residuals", {}).items()})
        if state.get("server_compressor"):
            self.server_compressor.load_state_dict(state["server_compressor"])

    def __repr__(self) -> str:
        return (f"PSCommunicator({self.compressor!r}, {self.memory!r}, "
                f"server_residual={self.server_residual})")

    # -- cost model (mergecomp.planning.costmodel.communicator_formula) ---------------------------
    #: The collectives the formula below prices with; the profile measures them.
    cost_collectives = ("alltoall", "allgather")
    #: start() waits for the alltoall and serves a shard: its time in the live run holds a
    #: collective, not only local work (see costmodel.phases_are_local).
    phases_are_local = False

    @classmethod
    def send_cost(cls, codec, profile):
        """A compressed group: an alltoall of the payload in N shards, then an allgather of
        each server's recompressed 1/N shard.  A server sums N payloads of its shard and
        encodes one (relay work on the channel, between the two collectives); a worker
        decodes N shards.  ``start`` waits for the alltoall and the server's work
        (``blocking``): backward waits with it.  A dense decode-then-aggregate's summation
        passes are not modelled."""
        alltoall = collective_cost(profile, "alltoall", "the PS communicator's first phase")
        allgather = collective_cost(profile, "allgather", "the PS communicator's second phase")
        world = profile.world_size
        serve = codec.decode.scaled(world, 1) if codec.add is None else \
            (codec.decode + codec.add.scaled(world - 1, world - 1)).scaled(1, 1 / world)
        return SendCost(codec.encode, codec.wire, alltoall + allgather.scaled(1, 1 / world),
                        decode=codec.decode.scaled(world, 1), relay=serve + codec.encode.scaled(1, 1 / world), blocking=alltoall)


def _names(payload) -> List[str]:
    return [str(p.dtype).replace("torch.", "") for p in payload]


def _check_plain_context(ctx: Context, compressor: Compressor) -> None:
    """Workers decode the server's recompressed shard with their own context: it must say
    nothing but shape, dtype and layout (the shard's clipped views, which the server
    compresses with too) and what follows from them (``Context.layout_fields``), or the
    server's context (made on one rank) would differ."""
    allowed = ("shape", "dtype", "layout") + tuple(getattr(ctx, "layout_fields", ()))
    extra = [f.name for f in dataclasses.fields(ctx) if f.name not in allowed]
    if extra:
        raise ValueError(
            f"the PS communicator cannot recompress with {compressor.name!r}: its context carries "
            f"{extra}, which a server cannot share with the workers. Use communicator='allgather' "
            "with it, or make the compressor summable so the server adds payloads as they are.")
