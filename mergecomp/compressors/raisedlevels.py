"""More levels for the stochastic quantisers: what the quality controller raises for them.

QSGD and TernGrad round each element of a bucket stochastically to one of 2L + 1 levels of
the bucket's scale (QSGD's norm at L = 7 by default, TernGrad's clipped peak at L = 1) and
send the level as a b-bit code.  Neither holds anything back: what they cost is their
*noise*, ‖C(g) − g‖ over ‖g‖, which the drift meter reads (:mod:`mergecomp.runtime.drift`)
and the controller steers by its noise thresholds.  Their :attr:`knob` is ``"bits"``: a
group the controller raised to scale s goes out at b = min(8, ⌊s·b₀⌋) bits (b₀ its own:
QSGD's 4, TernGrad's 2) and L = (2^b − 1) // 2 levels, rounded the same way, by the same
kernels, with the same scale per bucket, so the estimate stays unbiased (TernGrad's up to
its clipping) and only the codes widen.  The bytes grow with s (the codes are all but
the whole payload), which is what the controller's byte budget counts.
Why: stochastic rounding's error falls about as 1/L, so one doubling of the bits takes a
group from TernGrad's ternary codes, whose noise on a character transformer's gradients
passes the controller's threshold, to seven levels, well under it
(docs/results.md#terngrad-levels).

On the wire at b bits: ⌈n·b/8⌉ bytes of codes and the compressor's fp32 scale per bucket.
The levels travel in the payload's context (:class:`LevelsContext`), the same on every rank
(the controller's decisions are).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Tuple

from ..kernels import packed_nbytes
from .base import Context

#: The most bits a code may have (QSGD's largest setting, 127 levels).
MOST_BITS = 8


@dataclass(frozen=True)
class LevelsContext(Context):
    """A raised payload's context: its ``levels`` L and code ``bits``, the same on every rank."""

    levels: int
    bits: int
    layout_fields = ("levels", "bits")


class RaisesLevels:
    """Mixin of the stochastic quantisers whose groups the controller may send at more levels.

    The class sets :attr:`levels` (L) and :attr:`bits` (b₀), its configured setting."""

    levels: int
    bits: int

    @property
    def knob(self):
        """``"bits"``, or None where the configured codes already have :data:`MOST_BITS`."""
        return "bits" if self.bits < MOST_BITS else None

    def levels_of(self, name: str) -> Tuple[int, int]:
        """(levels, bits) group ``name`` goes out at now: the configured ones unless the
        controller raised it (module docstring)."""
        bits = min(MOST_BITS, int(self.bits * self.group_scale(name)))
        if bits <= self.bits:
            return self.levels, self.bits
        return ((1 << bits) - 1) // 2, bits

    def levels_context(self, tensor, levels: int, bits: int) -> Context:
        """The context of a payload at (``levels``, ``bits``): a plain one at the configured setting."""
        if (levels, bits) == (self.levels, self.bits):
            return Context(tensor.shape, tensor.dtype)
        return LevelsContext(tensor.shape, tensor.dtype, levels, bits)

    def codes_nbytes(self, numel: int, payload=None) -> int:
        """Bytes of the codes: a payload's own (its group may be raised), else the configured
        bits' for ``numel`` elements."""
        return packed_nbytes(numel, self.bits) if payload is None else payload[0].numel()

    def context_levels(self, ctx: Context) -> Tuple[int, int]:
        """(levels, bits) a payload with context ``ctx`` was coded at."""
        if isinstance(ctx, LevelsContext):
            return ctx.levels, ctx.bits
        return self.levels, self.bits
