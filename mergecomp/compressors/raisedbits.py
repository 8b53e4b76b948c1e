"""More bits for the one-bit compressors: what the quality controller raises for them.

EF-SignSGD and 1-bit SGD send one bit per element.  Their :attr:`knob` is ``"bits"``: a
group the controller (:mod:`mergecomp.runtime.controller`) raises to scale s goes out at
2, 4 or 8 bits (the largest of them not above s) as sign-and-magnitude codes
(:mod:`mergecomp.kernels.magnitudes`), at one bit in its compressor's own format otherwise.
Why: the controller steers by sending a lagging group at a finer setting, and a one-bit
compressor has no density or rank to raise.  Under SGD on a character
transformer, EF-SignSGD at one bit trailed dense well beyond one seed's spread; raised to
two bits, the momentum kept, it reached dense (docs/results.md#sign-bits).

Not while the memory folds SGD's momentum.  A memory that folds it (EF-SignSGD's and 1-bit
SGD's default until the loop clips) runs SGD without momentum at lr / (1 − m), and at one
bit each coordinate moves by at most its view's mean magnitude a step; raised, the same
step moves the large coordinates whole.  On a character LSTM whose loop never clips,
EF-SignSGD raised that way fell far behind its one-bit run.  So under SGD the controller
raises these compressors only while their memory runs the momentum before the exchange
(:func:`mergecomp.runtime.drift.raisable`), and only measures them otherwise.  Under an
Adam, whose first moment the memory folds (β1 = 0), Adam's own per-coordinate scale bounds
each step, and they are raised: on the character LSTM under AdamW that took EF-SignSGD from
behind dense to ahead of it on the seed where it trailed (docs/results.md#sign-bits).

Momentum factor masking.  At one bit every coordinate moves by its view's mean magnitude
whatever its value, and a memory that masks once the loop clips restarts the momentum of
every coordinate it sent: the run is plain SGD on the fed-back signs, which measured better
than keeping the momentum at one bit.  Once the controller raised a group, the momentum is
kept, in every group (:meth:`masks_sent_momentum`): at two bits and more the magnitude
follows the value, and a group the byte budget holds at one bit for a while moves between
bits, where restarting its momentum at each one-bit step measured worse.  The rule reads
only the groups' scales, which a resumed run restores, so it resumes bit for bit.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..kernels.magnitudes import BITS, decode_magnitude_codes, magnitude_codes
from ..kernels.segments import Spans
from .base import Context
from .views import context_spans


@dataclass(frozen=True)
class MagnitudeContext(Context):
    """A payload's context at ``bits`` > 1: the views (all of the tensor when it has none)
    and the bits, the same on every rank (the controller's decisions are)."""

    spans: Spans
    bits: int
    layout_fields = ("spans", "bits")


class RaisesBits:
    """Mixin of the one-bit compressors whose groups the controller may send at more bits."""

    knob = "bits"

    def bits_of(self, name: str) -> int:
        """Bits per element group ``name`` goes out at now: 1 unless the controller raised it."""
        scale = self.group_scale(name)
        return max([1] + [bits for bits in BITS if bits <= scale])

    def raisable_with(self, memory) -> bool:
        """Not while ``memory`` folds a momentum, unless it is an Adam's first moment (module
        docstring)."""
        return not getattr(memory, "folding", False) or getattr(memory, "momentum_source", None) == "adam"

    def masks_sent_momentum(self, name: str) -> bool:
        """Yes for a group at one bit while no group is raised; else no (module docstring)."""
        return not self.__dict__.get("_group_scales")

    def _raised_context(self, tensor, ctx: Context, bits: int) -> MagnitudeContext:
        return MagnitudeContext(tensor.shape, tensor.dtype, context_spans(ctx), bits)

    def _compress_raised(self, tensor, ctx: MagnitudeContext):
        """The payload at ``ctx.bits``: (packed codes, each view's table)."""
        return magnitude_codes(tensor.reshape(-1), ctx.spans, ctx.bits, self._scratch)

    @staticmethod
    def _decompress_raised(payload, ctx: MagnitudeContext):
        packed, table = payload
        return decode_magnitude_codes(packed, table, ctx.spans, ctx.bits, ctx.numel, ctx.dtype).view(ctx.shape)

    @staticmethod
    def _raised_nbytes(payload) -> int:
        """The bytes of a raised payload: its codes and its fp32 table."""
        packed, table = payload
        return packed.numel() + 4 * table.numel()
