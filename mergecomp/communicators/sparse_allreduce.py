"""Sparse allreduce: the sum of sparse payloads for traffic that does not grow with N.

Summing top-k payloads by allgather sends each rank's k entries to every other rank: about
k·(N−1) entries per rank, which at 64 ranks and 1% density is 64% of the dense gradient.
This communicator sums them the way Ok-Topk (Li & Hoefler, PPoPP 2022) and ZEN (Wang et
al., OSDI 2025) do, in two phases:

1. **Scatter to owners.**  The group's n flat coordinates are cut into N contiguous
   partitions (the first n mod N one element longer, as the PS shards).  Each rank splits
   its (value, index) pairs by the partition an index falls in and sends partition r's
   pairs to rank r in one all-to-all (its own partition's pairs stay home).
2. **Owners sum, then allgather.**  Owner r adds the pairs it received into its partition
   in rank order (the same additions, in the same order, as the allgather's in-place sum:
   bit for bit the same floats), and sends back either

   * ``keep=None`` (exact): every coordinate any rank sent for its partition — the union,
     which can reach min(N·k, n)/N entries per owner: exact, but only cheaper than the
     allgather when ranks' selections overlap; or
   * ``keep=c`` (the default, c = 1): the ⌈c·k/N⌉ entries of largest magnitude of its
     partition's sum (a top-k of the sum, ≈ c·k entries in all, as Ok-Topk and gTop-k
     keep).  What an owner drops is kept as its *owner residual* and added to its
     partition's sum next step (error feedback on the owner, as the PS servers keep,
     Zheng et al., NeurIPS 2019) — unless the job runs without error feedback (memory
     ``none``) or ``owner_residual=False`` asks for it to be dropped.

   The owners' payloads (values in the gradient's dtype, flat int32 indices, int64
   beyond 2^31 elements) are all-gathered and scattered into the result.

**On the compressor's block wire** (top-k's and GradDrop's 8-bit default, the tight 8-bit
one or the 16-bit one, :mod:`~mergecomp.compressors.blockwire`), both phases send the 16-bit
block format (an 8-bit payload's values are exact in bf16): phase 1's chunk for
rank r is (16-bit values, 16-bit offsets, one int32 count per 65,536 coordinates) of r's
partition, offsets counted from its start; with ``keep=c`` the owner's reply is its kept
sums the same way, rounded to bf16, and the rounding stays in its owner residual (with
``owner_residual=False`` it is lost, as the dropped sums are).  ``keep=None`` sends the
exact union indexed, in the gradient's dtype, so it stays the allgather's sum bit for bit.

Contiguous partitions rather than ZEN's hash-balanced ones: the owner's sum and the
result's scatter touch one contiguous range, the indices need no table, and an owner's
additions happen in rank order, so the exact mode is the allgather's sum bit for bit.  The
price is imbalance when the selected coordinates crowd into a few partitions: that costs
phase 1's all-to-all (chunks vary in size; no rank sends more than its k pairs), never
phase 2, whose size is fixed by ``keep``.

**Bytes on the wire per rank** (as the backend counts them: a ring allgather forwards
N−1 blocks, an all-to-all sends every chunk but its own), for a payload of k entries of
v value bytes and i index bytes, m of them outside this rank's partition, g the gradient's
element size, a(x) = x rounded up to 8:

* all-to-all: 8·N·(N−1) bytes of chunk sizes + (v + i)·m (m ≤ k; ≈ k·(N−1)/N);
* allgather, ``keep=c``: (N−1)·(64 + a(g·k′) + a(i·k′)), k′ = min(⌈c·k/N⌉, ⌈n/N⌉) — a
  bounded blob (its shapes inside), one asynchronous collective;
* allgather, ``keep=None``: (N−1)·(64 + a(g·U) + a(i·U)), U the largest union an owner
  holds, after an exchange of the shapes (the 64 bytes) that blocks.

So ``keep=1`` sends about 2·k·(N−1)/N entries per rank where the allgather sends
k·(N−1): N/2 times fewer.  k is the payload's count (variable-size sparsifiers: their
``payload_bound``, e.g. DGC's k; GradDrop: ratio·n).

Summable compressors (rand-k with its shared seed, the casts) already have the same
indices on every rank: their values are summed by one allreduce, as the allreduce
communicator does; multi-round compressors (PowerSGD) run their own allreduce rounds.

Async contract: ``start`` blocks for compression, the all-to-all (gloo's is synchronous)
and the owner's sum, then launches the allgather asynchronously; ``finish`` waits for it
and scatters the owners' sums.  The step's non-finite check reads the result at the
indices the owners sent: a NaN or Inf in any rank's payload lands in an owner's sum, and a
top-k of the sum keeps it (NaN and ±Inf rank first), so every rank sees it.
"""
from __future__ import annotations

import math
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from . import register
from .base import Communicator
from .ps import shard_sizes
from ..distributed.backends.serialize import MAX_DIMS, header_error
from ..compressors.base import Compressor
from ..kernels import Scratch, exact_top_k
from ..compressors import blockwire
from ..compressors.sparsifier import SparseCompressor, index_dtype, num_selected
from ..memories.none import NoneMemory
from ..memories.residual import ResidualMemory
from .cost import SendCost, collective_cost
from ..staging import StagedDict


@register("sparse_allreduce")
class SparseAllreduceCommunicator(Communicator):
    """Index-partitioned sparse allreduce: all-to-all to owners, owners sum, allgather.

    Args:
        compressor, memory, backend: as for every communicator.  Carries the sparsifiers
            whose payload is ``(values, indices)`` and decodes by scatter (top-k, DGC,
            GradDrop); summable compressors (rand-k, casts) go by allreduce.
        keep: how many entries each owner sends back, as a multiple c of its share k/N of
            the payload's k (⌈c·k/N⌉ per owner, the largest magnitudes of its sum), or
            None for the exact sum (the union of what it received).  Every rank must pass
            the same value (it is part of the configuration the ranks compare).
        owner_residual: keep what an owner drops and add it to its partition's sum next
            step.  None (the default): on when ``keep`` is set and ``memory`` feeds errors
            back, off with the ``none`` memory.  ``False`` with ``keep`` set loses what
            the owners drop.
    """

    def __init__(self, compressor: Compressor, memory, backend, keep: Optional[float] = 1.0,
                 owner_residual: Optional[bool] = None):
        super().__init__(compressor, memory, backend)
        if keep is not None and (isinstance(keep, bool) or not isinstance(keep, (int, float))
                                 or not math.isfinite(keep) or keep <= 0):
            raise ValueError(f"keep must be a positive number (entries per owner, as a multiple of "
                             f"its share k/N of the payload) or None for the exact sum, got {keep!r}")
        if owner_residual is not None and not isinstance(owner_residual, bool):
            raise ValueError(f"owner_residual must be True, False or None (automatic), got {owner_residual!r}")
        self.keep = None if keep is None else float(keep)
        self.sparse = not (compressor.summable or compressor.multi_round)
        if self.sparse:
            _check_sparsifier(compressor)
        if owner_residual is None:
            owner_residual = not isinstance(memory, NoneMemory)
        self.owner_residual = bool(owner_residual) and self.keep is not None and self.sparse
        self.owner_residuals = StagedDict()  # staged like the memories': see commit()
        self._scratch = Scratch()

    # -- phase 1 and the owner's sum (blocking), phase 2 launched --------------------------
    def _launch(self, payload, ctx, name):
        if not self.sparse:
            return self.backend.allreduce_async(payload)
        rank, size = self.backend.rank, self.backend.size
        values, indices = self.compressor.entries(payload, ctx)  # the compact wire's, unpacked
        if self.compact:  # 8-bit values decode to fp32; bf16 holds them exactly (blockwire.fp8_values)
            values = blockwire.wire_values(values)
        n, device = ctx.numel, values.device
        parts = shard_sizes(n, size)
        starts = _starts(parts)
        owner = _owners(indices.long(), n, size)
        counts = torch.bincount(owner, minlength=size).tolist()
        if not self.compact:  # the compact wire's indices come ascending: grouped by owner already
            indices = indices.to(index_dtype(n))
            order = torch.argsort(owner, stable=True)
            values, indices = values[order], indices[order]
        own_values, own_indices = _split(values, counts)[rank], _split(indices, counts)[rank]
        empty = torch.empty(0, dtype=torch.uint8, device=device)
        chunks = [empty if r == rank else self._chunk(v, i, starts[r], parts[r])
                  for r, (v, i) in enumerate(zip(_split(values, counts), _split(indices, counts)))]
        bound = self._count_bound(payload, ctx)
        received = self.backend.alltoall(chunks, limit=self._chunk_limit(values, indices, min(bound, parts[rank]),
                                                                         parts[rank]))
        lo, hi = starts[rank], starts[rank] + parts[rank]
        total = torch.zeros(parts[rank], dtype=ctx.dtype, device=device)
        touched = None if self.keep is not None else torch.zeros(parts[rank], dtype=torch.bool, device=device)
        for source in range(size):
            if source == rank:
                got_values, got_indices = own_values, own_indices
            elif self.compact:
                got_values, got_indices = _uncompact(received[source], values.dtype, lo, hi, source, rank)
            else:
                got_values, got_indices = _unchunk(received[source], values.dtype, indices.dtype, lo, hi,
                                                   source, rank)
            local = got_indices.long() - lo
            total.index_add_(0, local, got_values.to(ctx.dtype))
            if touched is not None:
                touched[local] = True
        reply = self._owner_reply(total, touched, lo, n, f"{name}/owner", bound, max(parts))
        if self.keep is None:
            return self.backend.allgather_async(reply, same_shapes=False)
        kept = min(math.ceil(self.keep * bound / size), max(parts))
        shapes = (torch.Size([kept]), torch.Size([kept]))
        if self.compact:
            shapes += (torch.Size([blockwire.num_blocks(max(parts))]),)
        return self.backend.allgather_async(reply, same_shapes=False, bound=shapes)

    @property
    def compact(self) -> bool:
        """Whether the pairs travel on the compressor's compact wire (:mod:`~mergecomp.compressors.blockwire`):
        16-bit values and 16-bit offsets within the blocks of each rank's partition.  A
        ``"compact8"`` payload's values travel in bf16 here, exactly as they were decoded."""
        return self.sparse and getattr(self.compressor, "wire_format", "indexed") in blockwire.BLOCK_FORMATS

    def _chunk(self, values: torch.Tensor, indices: torch.Tensor, lo: int, part: int) -> torch.Tensor:
        """The bytes of the pairs bound for the partition [lo, lo + part): (values, indices),
        or on the compact wire (values, offsets, counts) with indices counted from ``lo``."""
        if self.compact:
            tensors = blockwire.pack(values, indices.long() - lo, part)
        else:
            tensors = (values, indices)
        return torch.cat([t.contiguous().view(torch.uint8) for t in tensors])

    def _chunk_limit(self, values: torch.Tensor, indices: torch.Tensor, count: int, part: int) -> int:
        """The most bytes a peer's chunk of at most ``count`` pairs for a partition of ``part``
        elements may hold."""
        if self.compact:
            return blockwire.compact_nbytes(count, part, values.element_size())
        return (values.element_size() + indices.element_size()) * count

    def _count_bound(self, payload, ctx) -> int:
        """The most entries a rank's payload for this group holds, the same on every rank."""
        bound = self.compressor.payload_bound(ctx)
        if bound is not None:
            return int(bound[0][0])
        if self.compressor.fixed_size:
            return int(payload[0].numel())
        return num_selected(ctx.numel, self.compressor.compress_ratio)

    def _owner_reply(self, total: torch.Tensor, touched: Optional[torch.Tensor], lo: int, n: int,
                     key: str, bound: int, longest: int) -> Tuple[torch.Tensor, torch.Tensor]:
        """What the owner sends back: (summed values, flat indices) of its partition."""
        if touched is not None:  # exact: every coordinate some rank sent
            local = torch.nonzero(touched).reshape(-1)
            return total[local], (local + lo).to(index_dtype(n))
        if self.owner_residual:
            residual = self.owner_residuals.get(key)
            if residual is not None:
                if residual.shape != total.shape:
                    raise ValueError(
                        f"owner residual of {key!r} has {residual.numel()} elements but this rank's "
                        f"partition has {total.numel()}: the plan or world size changed; build a new "
                        "communicator (or load a matching state)")
                total = total.add_(residual)
        kept = min(math.ceil(self.keep * bound / self.backend.size), longest, total.numel())
        # The largest magnitudes, NaN and ±Inf first (as torch.topk ranks them): a
        # non-finite sum is always sent.
        local = exact_top_k(total, kept, self._scratch).long() if kept else total.new_empty(0, dtype=torch.long)
        if self.compact:  # ascending, in 16 bits: the rounding stays in the owner's residual
            local = local.sort().values
            values = blockwire.wire_values(total[local])
        else:
            values = total[local]
        if self.owner_residual:  # what is sent leaves the owner's residual
            if self.compact:
                total[local] -= values.to(total.dtype)
            else:
                total[local] = 0
            self.owner_residuals[key] = total
        if self.compact:
            return blockwire.pack(values, local, total.numel())
        return values, (local + lo).to(index_dtype(n))

    # -- finish: the owners' sums scattered into the group -------------------------------
    def _combine(self, result, handle):
        ctx = handle.ctx
        if not self.sparse:
            return self.compressor.decompress(result, ctx).reshape(-1)
        parts = shard_sizes(ctx.numel, self.backend.size)
        starts = _starts(parts)
        out = handle.output
        if out is None or out.numel() != ctx.numel or out.dtype != ctx.dtype:
            out = torch.empty(ctx.numel, dtype=ctx.dtype, device=result[0][0].device)
        total = out.zero_()
        received = []
        for source, reply in enumerate(result):
            if len(reply) == 3:  # compact: offsets counted from the owner's partition start
                values, local = _unpacked(reply, parts[source], source)
                indices = local + starts[source]
            else:
                values, indices = reply
            if values.numel() != indices.numel():
                raise header_error(source, f"its owner sum has {values.numel()} values and "
                                           f"{indices.numel()} indices")
            flat = indices.long()
            _check_range(flat, starts[source], starts[source] + parts[source], source, "its owner sum")
            total.index_copy_(0, flat, values.to(ctx.dtype))
            received.append(flat)
        # The sum is zero outside what the owners sent: the average divides and the
        # non-finite check reads it there only.
        handle.extra["received_indices"] = torch.cat(received)
        return total

    # -- state ------------------------------------------------------------------------------
    def commit(self) -> None:
        super().commit()
        self.owner_residuals.commit()

    def rollback(self) -> None:
        super().rollback()
        self.owner_residuals.rollback()

    def state_dict(self) -> Dict[str, Any]:
        state = super().state_dict()
        state["owner_residuals"] = {k: v.detach().clone() for k, v in self.owner_residuals.committed().items()}
        return state

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.owner_residuals.replace({k: v.clone() for k, v in state.get("owner_residuals", {}).items()})

    # -- beside another communicator (a "compress:sparse_allreduce" send mode) --------------
    def check_foldable(self) -> None:
        """Refuse owner residuals that :meth:`fold_owner_residuals` could not fold: they need
        the ``residual`` memory with β = 1 (added to it, they keep their exact value)."""
        if self.owner_residual and not (isinstance(self.memory, ResidualMemory) and self.memory.beta == 1.0):
            raise ValueError(
                f"the sparse allreduce beside the job's communicator keeps owner residuals, which move "
                f"between plans and into checkpoints through the 'residual' memory (beta=1) only, not "
                f"{self.memory!r}; pass communicator_options={{'sparse_allreduce': {{'owner_residual': "
                "False}}} (what owners drop is lost) or {'keep': None} (the exact sum), or make "
                "'sparse_allreduce' the job's communicator")

    def fold_owner_residuals(self, memory_state: Dict[str, Any], sizes: Dict[str, int]) -> Dict[str, Any]:
        """``memory_state`` (the residual memory's) with each committed owner residual added to
        this rank's residual of its group, at the elements of this rank's partition.

        An owner residual is part of the *sum* over ranks that the owner adds next step; added
        to one rank's residual it enters that sum the same way, through the rank's payload.
        So the sum of everything held back is unchanged when a plan switch regroups the
        memory (owners' partitions change with the groups) or a checkpoint saves it.
        ``sizes``: elements per group name."""
        owned = self.owner_residuals.committed()
        if not owned:
            return memory_state
        self.check_foldable()
        residuals = dict(memory_state.get("residuals", {}))
        rank, size = self.backend.rank, self.backend.size
        for key, held in owned.items():
            group = key[:-len("/owner")]
            if group not in sizes:
                raise ValueError(f"owner residual {key!r} belongs to no group of the current plan "
                                 f"({sorted(sizes)[:5]}...)")
            lo = _starts(shard_sizes(sizes[group], size))[rank]
            current = residuals.get(group)
            total = (torch.zeros(sizes[group], dtype=held.dtype, device=held.device) if current is None
                     else current.reshape(-1).clone())
            total[lo:lo + held.numel()] += held.to(total.dtype)
            residuals[group] = total if current is None else total.view_as(current)
        return dict(memory_state, residuals=residuals)

    def drop_owner_residuals(self) -> None:
        """Forget the owner residuals (once :meth:`fold_owner_residuals` moved them)."""
        self.owner_residuals.replace({})

    def __repr__(self) -> str:
        return (f"SparseAllreduceCommunicator({self.compressor!r}, {self.memory!r}, keep={self.keep}, "
                f"owner_residual={self.owner_residual})")

    # -- cost model (mergecomp.planning.costmodel.communicator_formula) -----------------------
    #: The collectives the formula below prices with; the profile measures them.
    cost_collectives = ("alltoall", "allgather")
    #: start() waits for the all-to-all and sums the owner's partition: its time in the live
    #: run holds a collective, not only local work (see costmodel.phases_are_local).
    phases_are_local = False

    @classmethod
    def send_cost(cls, codec, profile):
        """A compressed group with the default ``keep=1``: an all-to-all of the payload (its
        pairs by owner), then an allgather of each owner's ≈ 1/N of it.  The owner adds N
        pieces of ≈ k/N pairs and takes a top-k of its n/N partition (relay work on the
        channel, between the two collectives, priced as the codec's add and encode over 1/N
        of the group); a rank scatters the N owner sums once (one decode).  ``start``
        waits for the all-to-all and the owner's sum (``blocking``): backward waits with
        it.  Payload headers, block counts and the all-to-all's size exchange are not
        modelled; both phases send pairs in the payload's format (indexed, or the compact
        wire's 4 bytes), so the payload's bytes price them."""
        alltoall = collective_cost(profile, "alltoall", "the sparse allreduce's first phase")
        allgather = collective_cost(profile, "allgather", "the sparse allreduce's second phase")
        world = profile.world_size
        gather = codec.add.scaled(world, 1 / world) if codec.add is not None else codec.decode.scaled(1, 1 / world)
        relay = gather + codec.encode.scaled(1, 1 / world)
        return SendCost(codec.encode, codec.wire, alltoall + allgather.scaled(1, 1 / world),
                        decode=codec.decode, relay=relay, blocking=alltoall)


def _check_sparsifier(compressor: Compressor) -> None:
    """Refuse, at construction, a compressor whose payloads cannot be split by index."""
    if not (isinstance(compressor, SparseCompressor) and compressor.sums_in_place):
        raise ValueError(
            f"the sparse_allreduce communicator cannot carry compressor {compressor.name!r}: it sums "
            "sparse (values, indices) payloads decoded by scatter (topk, dgc, graddrop) and adds "
            "summable ones (randk, fp16, bf16) by allreduce. Use communicator='allgather' or 'ps' "
            "with it.")
    if (not compressor.fixed_size and type(compressor).payload_bound is Compressor.payload_bound
            and not isinstance(getattr(compressor, "compress_ratio", None), float)):
        raise ValueError(
            f"the sparse_allreduce communicator needs to know, on every rank alike, how many entries "
            f"a payload of {compressor.name!r} may hold: give the compressor a payload_bound() or a "
            "compress_ratio, or use communicator='allgather'.")


def _starts(parts: Sequence[int]) -> List[int]:
    starts, at = [], 0
    for size in parts:
        starts.append(at)
        at += size
    return starts


def _owners(indices: torch.Tensor, numel: int, world_size: int) -> torch.Tensor:
    """The partition (of :func:`~mergecomp.communicators.ps.shard_sizes`) each flat index
    falls in: the first ``numel % N`` partitions hold one element more."""
    base, extra = divmod(numel, world_size)
    boundary = extra * (base + 1)
    long_parts = torch.div(indices, base + 1, rounding_mode="floor")
    if base == 0:  # fewer elements than ranks: every element is a partition of its own
        return long_parts
    return torch.where(indices < boundary, long_parts,
                       extra + torch.div(indices - boundary, base, rounding_mode="floor"))


def _split(tensor: torch.Tensor, counts: Sequence[int]) -> Tuple[torch.Tensor, ...]:
    return torch.split(tensor, list(counts))


def _unchunk(chunk: torch.Tensor, value_dtype: torch.dtype, index_type: torch.dtype, lo: int, hi: int,
             source: int, rank: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """Rank ``source``'s (values, indices) for this rank's partition [lo, hi), checked."""
    value_size = torch.empty((), dtype=value_dtype).element_size()
    pair = value_size + torch.empty((), dtype=index_type).element_size()
    if chunk.numel() % pair:
        raise header_error(source, f"it sent {chunk.numel()} bytes for partition {rank}, not a whole "
                                   f"number of {pair}-byte (value, index) pairs")
    count = chunk.numel() // pair
    values = chunk[:count * value_size].clone().view(value_dtype)
    indices = chunk[count * value_size:].clone().view(index_type)
    _check_range(indices.long(), lo, hi, source, f"its pairs for partition {rank}")
    return values, indices


def _uncompact(chunk: torch.Tensor, value_dtype: torch.dtype, lo: int, hi: int, source: int,
               rank: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """Rank ``source``'s compact chunk for this rank's partition [lo, hi): (values, indices)."""
    value_size = torch.empty((), dtype=value_dtype).element_size()
    blocks = blockwire.num_blocks(hi - lo)
    rest = chunk.numel() - 4 * blocks
    if rest < 0 or rest % (value_size + 2):
        raise header_error(source, f"it sent {chunk.numel()} bytes for partition {rank}, not {blocks} "
                                   f"block counts and whole ({value_size}-byte value, 2-byte offset) pairs")
    count = rest // (value_size + 2)
    parts = (chunk[:count * value_size].clone().view(value_dtype),
             chunk[count * value_size:rest].clone().view(torch.int16),
             chunk[rest:].clone().view(torch.int32))
    values, local = _unpacked(parts, hi - lo, source)
    return values, local + lo


def _unpacked(payload, part: int, source: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """:func:`~mergecomp.compressors.blockwire.unpack`, its refusal named as rank ``source``'s."""
    try:
        return blockwire.unpack(payload, part)
    except ValueError as error:
        raise header_error(source, str(error)) from None


def _check_range(indices: torch.Tensor, lo: int, hi: int, source: int, what: str) -> None:
    if indices.numel() and (int(indices.min()) < lo or int(indices.max()) >= hi):
        raise header_error(source, f"{what} hold indices in [{int(indices.min())}, {int(indices.max())}], "
                                   f"outside the partition [{lo}, {hi})")


#: Bytes of the shape header of a two-part allgather payload (values, indices).
SHAPE_HEADER_BYTES = 2 * MAX_DIMS * 8
