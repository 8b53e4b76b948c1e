"""More bits for the low-bit compressors: what the quality controller raises for them.

EF-SignSGD and 1-bit SGD send one bit per element, TBQ two.  Their :attr:`knob` is
``"bits"``: a group the controller (:mod:`mergecomp.runtime.controller`) raises to scale s
goes out at 2, 4 or 8 bits (the largest of them not above s times the compressor's own)
as sign-and-magnitude codes (:mod:`mergecomp.kernels.magnitudes`), in its compressor's
own format otherwise.
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
each step, and the one-bit compressors are raised: on the character LSTM under AdamW that
took EF-SignSGD from behind dense to ahead of it on the seed where it trailed.  TBQ is not
(``raised_under_adam = False``): its own two bits send about one element in ten, which
keeps Adam's steps those of a noisy gradient, and raised under AdamW it did no better at
twice the bytes (docs/results.md#sign-bits).

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

import torch

from ..kernels.magnitudes import BITS, decode_magnitude_codes, magnitude_codes
from ..kernels.scratch import Scratch
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
    """Mixin of the low-bit compressors whose groups the controller may send at more bits."""

    knob = "bits"
    #: Bits per element of the compressor's own format (a group at scale s may go out at up
    #: to s times as many).
    base_bits = 1
    #: Whether it is raised under an Adam whose first moment its memory folds (module docstring).
    raised_under_adam = True

    def bits_of(self, name: str) -> int:
        """Bits per element group ``name`` goes out at now: :attr:`base_bits` unless the
        controller raised it."""
        scale = self.group_scale(name)
        return max([self.base_bits] + [bits for bits in BITS if self.base_bits < bits <= self.base_bits * scale])

    def raised(self, name: str) -> bool:
        """Whether group ``name`` goes out as sign-and-magnitude codes now."""
        return self.bits_of(name) > self.base_bits

    def raisable_with(self, memory) -> bool:
        """Not while ``memory`` folds a momentum, unless it is an Adam's first moment and
        :attr:`raised_under_adam` (module docstring)."""
        if not getattr(memory, "folding", False):
            return True
        return self.raised_under_adam and getattr(memory, "momentum_source", None) == "adam"

    def masks_sent_momentum(self, name: str) -> bool:
        """Yes while no group is raised (each goes out in its compressor's own format); else
        no (module docstring)."""
        return not self.__dict__.get("_group_scales")

    def _compress_raised(self, tensor, name: str, ctx: Context):
        """(payload, context) of group ``name`` at its raised bits: (packed codes, each view's
        table), with the views of ``ctx`` (the compressor's own context for the layout)."""
        raised = MagnitudeContext(tensor.shape, tensor.dtype, context_spans(ctx), self.bits_of(name))
        scratch = self.__dict__.get("_scratch") or self.__dict__.setdefault("_raised_scratch", Scratch())
        return magnitude_codes(tensor.reshape(-1), raised.spans, raised.bits, scratch), raised

    @staticmethod
    def _decompress_raised(payload, ctx: MagnitudeContext):
        packed, table = payload
        return decode_magnitude_codes(packed, table, ctx.spans, ctx.bits, ctx.numel, ctx.dtype).view(ctx.shape)

    @staticmethod
    def _is_raised(payload) -> bool:
        """Whether ``payload`` is a raised one (its second part is the views' 2-D table); its
        bytes are then :func:`~mergecomp.compressors.base.payload_nbytes`'s."""
        return len(payload) == 2 and isinstance(payload[1], torch.Tensor) and payload[1].dim() == 2
