"""Sign compressors: signSGD, EF-SignSGD and SIGNUM, one bit per element on the wire.

Bernstein et al., "signSGD: Compressed Optimisation for Non-Convex Problems", ICML 2018;
Bernstein et al., "signSGD with Majority Vote is Communication Efficient and Fault
Tolerant", ICLR 2019; Karimireddy et al., "Error Feedback Fixes SignSGD and other Gradient
Compression Schemes", ICML 2019.

    signSGD:     send sign(g);   the update is the majority vote sign(Σ_ranks sign(g_r)).
    SIGNUM:      m ← β·m + (1 − β)·g;   send sign(m);   majority vote as signSGD.
    EF-SignSGD:  send (‖g‖₁/d)·sign(g) per parameter view;   the residual memory keeps the rest.

Signs travel as a packed bit mask (bit set = negative), so n elements cost ⌈n/8⌉ bytes.
What travels is the IEEE sign bit: +0.0 is sent as +1, as in the reference implementations,
and −0.0 as −1 (reading the bit is one integer pass; ``x < 0`` costs several times more).

One exception, per parameter: a parameter whose gradient is all zero on this rank (frozen
in effect, unused, or an embedding row nobody looked up) would otherwise vote +1 on every
coordinate, and under a majority vote a parameter that is zero on every rank would move by
the learning rate every step.  So the payload also carries one bit per parameter view of
the group (the ``layout``; the whole tensor is one view without it), set when the view is
all zero here: that view decodes to 0, the rank abstains on it, and a view that is zero on
every rank gets a zero update.  That is ⌈views/8⌉ more bytes.  Finding the zero views reads
one element per view (its first); only a view whose first element is zero is read whole.
"""
from __future__ import annotations

from types import MappingProxyType

import torch

from ..momentum import OWNS, is_adam, refuse_optimizer_momentum
from ..staging import StagedDict
from . import register
from .base import Compressor, Context, payload_nbytes
from ..kernels import Scratch, decode_values, pack_signs, packed_nbytes, unpack_signs
from ..kernels.segments import clear_flagged_views, scale_views, span_lengths, view_abs_sums, zero_view_flags
from ..kernels.signs import plus_minus_one
from .raisedbits import MagnitudeContext, RaisesBits
from .recipes import Recipe
from .views import RemembersLayoutSpans, ViewsContext, context_spans

#: A sign payload's context when the group has several parameter views (the name it had
#: before the per-view compressors shared one).
SignContext = ViewsContext


def zero_flagged_views(decoded: torch.Tensor, flags: torch.Tensor, ctx: Context) -> torch.Tensor:
    """Set to 0, in place, the views of ``decoded`` (flat) whose bit is set in ``flags``."""
    spans = context_spans(ctx)
    if flags.numel() != packed_nbytes(len(spans), 1):
        raise ValueError(f"sign payload has {flags.numel()} bytes of zero-view flags but its context has "
                         f"{len(spans)} views ({packed_nbytes(len(spans), 1)} bytes): the payload was made "
                         f"with a different layout than the one decoding it")
    return clear_flagged_views(decoded, flags, spans)


class _SignCompressor(RemembersLayoutSpans, Compressor):
    """Sign bits plus one "all zero here" bit per parameter view (module docstring)."""

    summable = False
    fixed_size = True
    unbiased = False

    def _encode(self, source: torch.Tensor, ctx: Context):
        """(packed signs of ``source``, zero-view flags)."""
        flat = source.reshape(-1)
        spans = context_spans(ctx)
        return pack_signs(flat, self._scratch), zero_view_flags(flat, spans)

    def wire_nbytes(self, numel, element_size, payload=None, layout=None):
        """⌈n/8⌉ bytes of signs + ⌈views/8⌉ bytes of zero-view flags (+ a subclass's extras)."""
        views = 1 if layout is None else max(1, len(layout))
        return packed_nbytes(numel, 1) + packed_nbytes(views, 1) + self.extra_nbytes

    extra_nbytes = 0


class _MajorityVote(_SignCompressor):
    """Aggregation by majority vote: the update is the sign of the sum of the ranks' signs."""

    average = False
    recommended_memory = "none"
    recommended_communicator = "allgather"

    def decompress(self, payload, ctx):
        packed, flags = payload
        decoded = unpack_signs(packed, ctx.numel, ctx.dtype).view(ctx.shape)
        zero_flagged_views(decoded.view(-1), flags, ctx)
        return decoded

    def aggregate(self, tensors):
        return super().aggregate(tensors).sign_()


@register("signsgd")
class SignSGDCompressor(_MajorityVote):
    """Send sign(g); the ranks' signs are combined by majority vote (sign of their sum).

    Biased (the magnitude is lost), which the majority vote analysis of Bernstein et al.
    (ICLR 2019) accepts: use a small learning rate, as for Adam-like updates.  Ties of an
    even number of ranks give 0 (no step on that coordinate); a parameter that is all zero
    on a rank abstains there (module docstring).

    Wire for n elements in v parameter views: ⌈n/8⌉ + ⌈v/8⌉ bytes (v = 1 without a
    layout).  ``average = False``: the vote is the update.
    """

    recipe = Recipe(
        reason="every coordinate moves by ±lr whatever its gradient's size, so the learning rate "
               "lives on Adam's scale, not SGD's; clipping the vote, whose norm is √n, to a "
               "gradient's norm shrinks every step by that factor",
        lr_scale=0.01, max_lr=5e-4, no_clipping=True)

    def __init__(self):
        self._scratch = Scratch()

    def compress(self, tensor, name, layout=None):
        ctx = self._views_context(tensor, layout)
        packed, flags = self._encode(tensor, ctx)
        return (packed, flags), ctx


@register("signum")
class SignumCompressor(_MajorityVote):
    """SIGNUM: send the sign of the momentum m ← β·m + (1 − β)·g, combined by majority vote.

    Bernstein et al. (ICML 2018, ICLR 2019).  The momentum lives here, per group, so the
    wrapped optimizer must be plain SGD without momentum.  Biased like signSGD.  A
    parameter whose momentum is all zero on a rank abstains there (module docstring).

    The momentum is state: staged with the step (a new tensor each step, never the
    committed one changed in place; the buffer a commit replaces is reused, so a group
    holds two momentum-sized buffers), saved by ``state_dict()``.

    Wire for n elements in v parameter views: ⌈n/8⌉ + ⌈v/8⌉ bytes.  ``average = False``.
    """

    momentum_role = OWNS
    recipe = Recipe(
        reason="every coordinate moves by ±lr whatever its momentum's size, so the learning rate "
               "lives on Adam's scale, not SGD's; clipping the vote, whose norm is √n, to a "
               "gradient's norm shrinks every step by that factor",
        lr_scale=0.02, max_lr=2e-3, no_clipping=True)

    def check_optimizer(self, optimizer) -> None:
        """Refuse an optimizer with its own momentum: SIGNUM's momentum lives here."""
        if is_adam(optimizer):  # one bit a coordinate with error feedback: closer to dense there than a vote
            advice = ("Under an Adam, use the efsignsgd compressor (one bit a coordinate with error "
                      "feedback; its memory sets Adam's first moment to 0), which stayed close to "
                      "dense's loss under AdamW on every model measured, where the signsgd compressor's "
                      "majority vote (Adam's first moment averaging the votes) trailed it further "
                      "(docs/results.md#defaults-now); or pass betas=(0, beta2) to keep this "
                      "compressor's momentum (docs/results.md#adamw-more-quantisers).")
        else:
            advice = f"Use plain SGD (momentum=0) and set the compressor's beta (now {self.beta})."
        refuse_optimizer_momentum(optimizer, "the signum compressor (sign of momentum)", advice)

    def __init__(self, beta: float = 0.9):
        beta = float(beta)
        if not 0.0 <= beta < 1.0:
            raise ValueError(f"signum momentum beta must be in [0, 1), got {beta!r}; 0.9 is usual")
        self.beta = beta
        self._scratch = Scratch()
        self.momenta = StagedDict()
        self._written = set()  # groups whose momentum this step wrote
        self._spare = {}  # name → a tensor no state refers to any more, reused as the next output

    def compress(self, tensor, name, layout=None):
        ctx = self._views_context(tensor, layout)
        momentum = self.momenta.get(name)
        if momentum is not None and momentum.shape != tensor.shape:
            raise ValueError(
                f"signum momentum of group {name!r} has shape {tuple(momentum.shape)} but the "
                f"gradient has shape {tuple(tensor.shape)}: the plan changed; create a new compressor")
        spare = self._spare.pop(name, None)
        if spare is None or spare.shape != tensor.shape or spare.dtype != tensor.dtype or spare.device != tensor.device:
            spare = torch.empty(tensor.shape, dtype=tensor.dtype, device=tensor.device)
        if momentum is None:  # m = (1 − β)·g
            updated = torch.mul(tensor, 1.0 - self.beta, out=spare)
        else:  # m = β·m + (1 − β)·g in one pass, into a buffer no state holds
            updated = torch.lerp(tensor, momentum, self.beta, out=spare)
        if name in self._written:  # a second compress in one step: the first one's output is free
            self._spare[name] = momentum
        self._written.add(name)
        self.momenta[name] = updated
        packed, flags = self._encode(updated, ctx)
        return (packed, flags), ctx

    def commit(self):
        before = self.momenta.committed()
        for name in self._written:
            if name in before:  # replaced: nothing refers to it any more
                self._spare[name] = before[name]
        self.momenta.commit()
        self._written.clear()

    def rollback(self):
        for name in self._written:
            self._spare[name] = self.momenta[name]
        self.momenta.rollback()
        self._written.clear()

    def state_dict(self):
        return {"momenta": {k: v.detach().clone() for k, v in self.momenta.committed().items()}}

    def load_state_dict(self, state):
        unknown = set(state) - {"momenta"}
        if unknown:
            raise ValueError(f"SignumCompressor state has unknown keys {sorted(unknown)}; expected 'momenta'")
        self.momenta.replace({k: v.clone() for k, v in state.get("momenta", {}).items()})
        self._written.clear()
        self._spare.clear()


@register("efsignsgd")
class EFSignSGDCompressor(RaisesBits, _SignCompressor):
    """EF-SignSGD: send (‖g‖₁/d)·sign(g) per parameter, the scaled sign, and keep the error
    as residual.

    Karimireddy et al. (ICML 2019): the scale makes the compressor a δ-approximate one, so
    error feedback (the ``residual`` memory) restores SGD's convergence.  Biased.  The scale
    is per parameter view of the group (the ``layout``), as the paper's experiments apply the
    compressor layer by layer: one scale for a fused group would move a layer of small
    gradients (a large classifier matrix) by the mean magnitude of another (a convolution),
    and error feedback would then spend many steps undoing it.  Without a layout the whole
    tensor has one scale.  A view that is all zero here has scale 0 and decodes to 0 (its
    zero-view flag says so too, module docstring).

    Wire for n elements in v parameter views: ⌈n/8⌉ bytes of signs + ⌈v/8⌉ bytes of
    zero-view flags + 4·v bytes for the fp32 scales.  A group the quality controller raised
    goes out at 2, 4 or 8 bits per element instead (:mod:`~mergecomp.compressors.raisedbits`).

    Its default memory takes the optimizer's momentum off (the ``residual`` memory's
    ``momentum="fold"``): SGD's is folded into the learning rate, as the paper's plain SGD on
    the fed-back update, and an Adam's first moment is set to 0; after the exchange either
    would multiply the residual's bursts (docs/results.md#adamw-sign).  Under SGD, once the
    loop clips, the memory runs SGD's momentum before the exchange instead (see the memory).
    """

    recommended_memory = "residual"
    #: SGD's momentum folded into the learning rate, an Adam's β1 off (the memory's "fold").
    recommended_memory_options = MappingProxyType({"momentum": "fold"})
    recommended_communicator = "allgather"
    recipe = Recipe(
        reason="the residual releases a coordinate's backlog in bursts of the view's mean magnitude, "
               "and momentum applied after the exchange multiplies each burst; the same step "
               "without it trains at parity",
        paper="EF-SGD (Karimireddy et al., 2019, Algorithm 2) is plain SGD on the fed-back update",
        fold_momentum=True, memory="residual")

    def __init__(self):
        self._scratch = Scratch()

    def compress(self, tensor, name, layout=None):
        ctx = self._views_context(tensor, layout)
        if self.raised(name):
            return self._compress_raised(tensor, name, ctx)
        flat = tensor.reshape(-1)
        packed, flags = self._encode(flat, ctx)
        spans = context_spans(ctx)
        if len(spans) == 1:
            magnitudes = torch.abs(flat, out=self._scratch.get("abs", flat.numel(), flat.dtype, flat.device))
            scales = (magnitudes.sum(dtype=torch.float32) / max(1, flat.numel())).reshape(1)
        else:
            sums = view_abs_sums(flat, spans, self._scratch)
            scales = sums / span_lengths(spans, str(flat.device)).clamp(min=1)
        return (packed, flags, scales), ctx

    def wire_nbytes(self, numel, element_size, payload=None, layout=None):
        """⌈n/8⌉ bytes of signs + ⌈v/8⌉ bytes of zero-view flags + 4 bytes per view's scale
        (a raised payload: its codes and table)."""
        if payload is not None and self._is_raised(payload):
            return payload_nbytes(payload)
        views = 1 if layout is None else max(1, len(layout))
        return packed_nbytes(numel, 1) + packed_nbytes(views, 1) + 4 * views

    def decompress(self, payload, ctx):
        if isinstance(ctx, MagnitudeContext):
            return self._decompress_raised(payload, ctx)
        packed, flags, scales = payload
        spans = context_spans(ctx)
        if scales.numel() != len(spans):
            raise ValueError(f"EF-SignSGD payload has {scales.numel()} scales but its context has "
                             f"{len(spans)} views: the payload was made with another layout")
        if len(spans) == 1:
            # ±scale straight from the table: the same bits as ±1 times the scale, one pass.
            scale = scales.reshape(1).to(ctx.dtype)
            decoded = decode_values(packed, 1, ctx.numel, torch.cat([scale, -scale]))
        else:
            decoded = decode_values(packed, 1, ctx.numel, plus_minus_one(ctx.dtype, str(packed.device)))
            decoded = scale_views(decoded, spans, scales)
        return zero_flagged_views(decoded, flags, ctx).view(ctx.shape)
