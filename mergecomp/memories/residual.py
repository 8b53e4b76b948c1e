"""Residual error feedback.

Seide et al., "1-Bit Stochastic Gradient Descent", Interspeech 2014; Karimireddy et al.,
"Error Feedback Fixes SignSGD and other Gradient Compression Schemes", ICML 2019.
"""
from __future__ import annotations

from typing import Optional, Union

import torch

from . import register
from .loopclip import LoopClip
from .base import (UNITS, Memory, check_flag, check_number, checked_state, combined_scale,
                   in_units, norm_of, sent_positions, subtract_sent, units_of, zero_positions)
from ..kernels.momentum import momentum_correction
from ..checkpoint import check_group_tensors
from ..momentum import TAKES_OVER, is_adam, take_over_momentum
from ..staging import Spares, StagedDict, shares_memory

#: ``momentum=FOLLOW``: SGD's momentum taken over where there is one, none otherwise.
FOLLOW = "optimizer"
#: ``momentum=FOLD``: the optimizer's momentum taken off and applied nowhere (see the class).
FOLD = "fold"


@register("residual")
class ResidualMemory(Memory):
    """e ← β·e + γ·g is compressed; what was not sent, (β·e + γ·g) − decode(payload), is kept.

    With β = γ = 1 (the default) the invariant is exact: over any number of steps,
    everything transmitted plus the current residual equals the sum of the gradients.
    β < 1 lets old errors fade (β = 0 keeps none); γ scales the gradient, e.g. by the
    learning rate as in EF-SGD.

    ``momentum`` m > 0 applies heavy-ball momentum *before* the exchange: u ← m·u + g
    (Nesterov: g + m·u after it), and e ← β·e + γ·u is compressed, so what is sent is
    already a momentum step and the optimizer steps without one (DGC's momentum correction
    without its masking; Lin et al., ICLR 2018, section 3.2).  Why: heavy-ball momentum
    applied *after* an error-feedback exchange replays a backlog released in one step for
    1/(1 − m) steps.  ``momentum="optimizer"`` (top-k's recommendation) takes an
    ``SGD(momentum=m)``'s m and Nesterov flag over through :meth:`check_optimizer` (see
    :func:`mergecomp.momentum.take_over_momentum`) and is plain error feedback with any
    other optimizer, or none; a number must agree with SGD's momentum, if it has one.

    ``adam=True`` (top-k's recommendation too) has ``momentum="optimizer"`` take an Adam's
    or AdamW's first moment β1 over as well, with momentum factor masking: the momentum of
    a coordinate just sent restarts from zero (DGC's memory, Lin et al., section 3.2).
    Why masking: a first moment taken over without it trained far worse than plain error
    feedback before Adam's moments; with it and a density warm-up (top-k's under Adam) it
    reached dense (docs/results.md#adamw-topk-default).  Without ``adam``, an Adam's first
    moment stays with Adam, after the exchange.

    ``momentum="fold"`` (EF-SignSGD's and 1-bit SGD's recommendation) takes the optimizer's
    momentum off and applies it nowhere: an ``SGD(momentum=m)`` steps without momentum at
    lr / (1 − m), the momentum folded into the learning rate (the same steady-state step),
    and an Adam or AdamW steps at β1 = 0; this memory stays plain error feedback.  Why:
    these compressors release a coordinate's backlog in bursts of its view's mean
    magnitude, and a momentum after the exchange multiplies each burst, Adam's first moment
    as SGD's.  Measured: EF-SignSGD and 1-bit SGD under AdamW with its first moment fell far
    behind dense, at β1 = 0 they kept up (docs/results.md#adamw-sign).  An optimizer whose
    momentum cannot be taken (RMSprop's) keeps it, as with ``"optimizer"``.

    Under SGD a fold lasts until the loop is seen clipping (:mod:`~mergecomp.memories.loopclip`);
    from the next step the memory runs SGD's momentum before the exchange, as
    ``"optimizer"`` does, from zero as heavy-ball momentum starts; and the run's first step,
    before anything is known of the loop, is heavy-ball's first step (the momentum from
    zero, a tenth of the folded step at m = 0.9).  SGD steps at lr / (1 − m) without
    momentum throughout, so only the memory changes.  Why: a fold runs plain SGD at
    lr / (1 − m), stable only for curvatures nineteen times smaller than heavy-ball
    momentum at lr (m = 0.9).  On a character transformer whose loop clips
    from the first step every folding compressor ended above twice dense's loss
    (as dense plain SGD at that rate does), and with the momentum taken over it kept up far
    better; on a character LSTM whose loop never clips, folding kept up with dense and taking
    the momentum over fell behind (docs/results.md#sgd-fold-until-clipped).

    Only a loop seen clipping within its first steps (the loop-clip watch's
    ``recorded_steps``) ends the fold; a loop first seen clipping later keeps it for the
    run.  Why: a model that needs heavy-ball's stability clips from its first steps; a clip
    that comes late is the compressed exchange's own (a sign compressor's averages grow
    with its residual) on a model that plain SGD at lr / (1 − m) trains, and switching
    there, mid-run, restarts the momentum from zero and masks it.  Measured on a word-level
    LSTM under SGD, whose dense loop does not clip: EF-SignSGD's and 1-bit SGD's loops first
    clipped hundreds of steps in, their losses jumped after the switch and they ended far
    behind dense; with the fold kept they kept up (docs/results.md#sgd-late-clip-keeps-fold).

    ``follow_loop=False`` (rand-k's recommendation) leaves the loop's clipping where the loop
    put it, after the exchange, and keeps a fold for the run.  Why: rand-k sends a
    coordinate once every 1/ratio steps, so its averages carry bursts of that many steps'
    backlog and trip the loop's clip within its first steps on a model whose dense loop
    never clips, which ended its fold there; with SGD's momentum run before the exchange its
    bursts are velocities, and on a character LSTM it stalled far behind dense where the fold
    kept for the run led it (docs/results.md#randk-fold-kept).

    A step's residuals are staged: :meth:`commit` keeps them, :meth:`rollback` restores
    the previous step's.  A committed residual is never changed in place; the tensors a
    step writes come from the ones earlier commits replaced (page faults of a fresh
    group-sized tensor per step cost more than the arithmetic on a CPU).  So are the
    momenta.
    """

    def __init__(self, beta: float = 1.0, gamma: float = 1.0, clip_norm: Optional[float] = None,
                 momentum: Union[float, str] = 0.0, nesterov: bool = False, adam: bool = False,
                 follow_loop: bool = True):
        self.beta = check_number(beta, "residual memory beta (the residual's decay)", 0.0, 1.0,
                                 advice="1 keeps every error (the usual choice), 0 none; a "
                                        "decay above 1 would grow the residual without bound.")
        self.gamma = check_number(gamma, "residual memory gamma (the gradient's scale)", 0.0,
                                  float("inf"), low_open=True, high_open=True,
                                  advice="1 is usual; 0 or less would send nothing or the "
                                         "opposite of the gradient.")
        if clip_norm is not None:
            clip_norm = check_number(clip_norm, "residual memory clip_norm", 0.0, float("inf"),
                                     low_open=True, high_open=True,
                                     advice="Pass None for no clipping; clip_norm = your clip / √N "
                                            "for N ranks clips as the averaged gradient would.")
        self.clip_norm = clip_norm  # local clipping: the gradient, before the residual is added
        #: Whether the momentum is whatever the SGD optimizer has (``momentum="optimizer"``).
        self.follows_optimizer = isinstance(momentum, str) and momentum == FOLLOW
        #: Whether the optimizer's momentum is taken off and applied nowhere (``momentum="fold"``).
        self.folds = isinstance(momentum, str) and momentum == FOLD
        if not (self.follows_optimizer or self.folds):
            momentum = check_number(momentum, "residual memory momentum", 0.0, 1.0, high_open=True,
                                    advice="0 applies none (the optimizer's acts after the exchange); "
                                           "'optimizer' takes an SGD optimizer's over; 'fold' takes the "
                                           "optimizer's off.")
        #: SGD's momentum, applied here before the exchange (0: none).
        self.sgd_momentum = 0.0 if self.follows_optimizer or self.folds else float(momentum)
        #: The optimizer's momentum taken off (``momentum="fold"``), once it is vetted.
        self.folded = 0.0
        self.nesterov = check_flag(nesterov, "residual memory nesterov")
        #: Whether ``momentum="optimizer"`` takes an Adam's first moment over too.
        self.adam = check_flag(adam, "residual memory adam")
        #: Whether SGD's momentum, run here or folded, follows the loop's clipping (the class).
        self.follow_loop = check_flag(follow_loop, "residual memory follow_loop")
        if self.adam and not self.follows_optimizer:
            raise ValueError(f"residual memory adam=True takes an Adam's first moment over through "
                             f"momentum='optimizer', but momentum={momentum!r} was given: pass "
                             f"momentum='optimizer' with it, or adam=False")
        #: Momentum factor masking: on while the momentum taken over is an Adam's first moment;
        #: with SGD's, once the loop clips (:meth:`~mergecomp.memories.base.Memory.masks_sent`).
        self.masking = False
        self.residuals = StagedDict()
        #: The loop's clipping, applied before the momentum once seen (:mod:`~mergecomp.memories.loopclip`).
        self.loop_clip = LoopClip()
        self.momenta = StagedDict()  # group → u, while the momentum is above 0
        self._made = {}  # group → the tensor compensate() made this step (ours to reuse)
        self._spares = Spares()  # residuals no state holds, reused by compensate() and update()
        self._momentum_spares = Spares()  # the same for the momenta

    @property
    def momentum_role(self) -> Optional[str]:
        """:data:`~mergecomp.momentum.TAKES_OVER` when it follows the optimizer or has a
        momentum; None when the optimizer's momentum acts after the exchange."""
        return TAKES_OVER if self.follows_optimizer or self.folds or self.sgd_momentum > 0.0 else None

    def held_state(self) -> list:
        return [self.momenta, self.residuals]

    def check_optimizer(self, optimizer) -> None:
        """Take SGD's momentum over when this memory follows the optimizer or has a momentum
        of its own (which SGD's must then equal); nothing otherwise.  A memory that follows
        the optimizer refuses nothing: where the momentum is not taken over (Adam's, groups
        that differ, a dampening) it stays plain error feedback and the optimizer keeps it.
        A memory that folds takes SGD's momentum or an Adam's first moment off the same way."""
        if not (self.follows_optimizer or self.folds) and self.sgd_momentum == 0.0:
            return
        try:
            take_over_momentum(optimizer, self, "the residual memory's momentum", adam=self.adam or self.folds)
        except ValueError:
            if not (self.follows_optimizer or self.folds):
                raise
            return
        self.masking = self.adam and is_adam(optimizer)

    @property
    def delivered_momentum(self) -> float:
        return self.sgd_momentum

    @property
    def follows_loop_clip(self) -> bool:
        """SGD's momentum taken over before the exchange, or folded (and taken over once the
        loop clips), no ``clip_norm`` of its own, and ``follow_loop`` not turned off."""
        momentum = self.folded if self.folds else self.sgd_momentum
        return self.follow_loop and self.momentum_source == "sgd" and momentum > 0.0 and self.clip_norm is None

    @property
    def folding(self) -> bool:
        """Whether the optimizer's momentum is folded (``momentum="fold"``) and not taken over
        yet: under an Adam, without a watched loop, before the loop was seen clipping (the
        run's first step included), or for good once the loop was first seen clipping only
        after its first steps."""
        return self.folds and not self._takes_folded(first=False)

    def _takes_folded(self, first: bool) -> bool:
        """Whether a memory that folds SGD's momentum runs it before the exchange: in the
        run's ``first`` step, and once the loop was seen clipping within its first steps (a
        loop first seen clipping later keeps the fold: see the class)."""
        clip = self.loop_clip
        return self.follows_loop_clip and (first or (clip.threshold is not None and not clip.clipped_late))

    def follow_loop_clip(self, threshold: float) -> None:
        super().follow_loop_clip(threshold)
        self._fold_or_take()

    def _fold_or_take(self, first: bool = False) -> None:
        """A memory that folds SGD's momentum runs it before the exchange in the run's
        ``first`` step and from the step after the loop was first seen clipping within its
        first steps (``sgd_momentum`` is then the folded value), and applies none otherwise
        (see the class)."""
        if self.folds:
            self.sgd_momentum = self.folded if self._takes_folded(first) else 0.0

    def _fold_phase(self, name: str) -> None:
        """Before a folding memory's step for group ``name``: take the momentum over or fold
        (:meth:`_fold_or_take`), and while folding drop the group's momentum, so a later
        switch starts it from zero as heavy-ball momentum starts."""
        self._fold_or_take(first=self.loop_clip.before_first_step)
        if self.sgd_momentum == 0.0 and name in self.momenta:
            del self.momenta[name]

    def adopt_momentum(self, momentum: float, nesterov: bool, follow: bool = False) -> None:
        """Use the optimizer's ``momentum`` and ``nesterov`` from now on; ValueError when this
        memory was given another momentum (unless ``follow``: a schedule moved SGD's).  A
        memory that folds records it, and applies it only where :meth:`_fold_or_take` says."""
        if self.folds:
            self.folded, self.nesterov = float(momentum), bool(nesterov)
            self._fold_or_take()
            return
        if not (self.follows_optimizer or follow) and (momentum, nesterov) != (self.sgd_momentum, self.nesterov):
            raise ValueError(
                f"the residual memory was given momentum={self.sgd_momentum}, nesterov={self.nesterov}, but the "
                f"SGD optimizer it takes the momentum over from has momentum={momentum:g}, nesterov={nesterov}: "
                f"one momentum is applied, so give it once (momentum='optimizer' takes SGD's).")
        self.sgd_momentum, self.nesterov = float(momentum), bool(nesterov)

    def _spare(self, spares: Spares, name, like):
        spare = spares.take(name, like)
        return spare if spare is not None else torch.empty_like(like, memory_format=torch.contiguous_format)

    def _momentum_corrected(self, tensor, name):
        """u' = m·u + g and e' = e + u' in DGC's momentum-correction pass
        (:func:`~mergecomp.kernels.momentum.momentum_correction`: one native pass
        with local clipping's factor applied on the way, and the block peaks a top-k
        selection of e' reads), into spares, never into the committed u and e."""
        scale = combined_scale(self.local_clip_factor(tensor, name), self.units_factor(self.sgd_momentum))
        previous = checked_state(self.momenta, name, tensor, "momentum")
        residual = checked_state(self.residuals, name, tensor, "residual")
        previous, residual = self.caught_up(name, previous, residual)
        zeros = torch.zeros_like(tensor) if previous is None or residual is None else None
        momentum, compensated = momentum_correction(
            tensor, zeros if previous is None else previous, zeros if residual is None else residual,
            self.sgd_momentum, False, self._spare(self._momentum_spares, name, tensor),
            self._spare(self._spares, name, tensor), scale)
        self.momenta[name] = momentum
        self._made[name] = compensated
        self._note_incoming(name, momentum)
        return compensated

    def _with_momentum(self, tensor, name, previous):
        """u ← m·u + g into a new tensor (the committed u, ``previous``, is never changed in
        place); the tensor to compensate: u, or g + m·u with Nesterov."""
        out = self._momentum_spares.take(name, tensor)
        if previous is None:
            momentum = tensor.clone() if out is None else out.copy_(tensor)
        else:
            momentum = torch.add(tensor, previous, alpha=self.sgd_momentum, out=out)
        self.momenta[name] = momentum
        return tensor + self.sgd_momentum * momentum if self.nesterov else momentum

    def compensate(self, tensor, name):
        if self.folds:
            self._fold_phase(name)
        if self.sgd_momentum > 0.0 and not self.nesterov and self.beta == 1.0 and self.gamma == 1.0:
            return self._momentum_corrected(tensor, name)  # top-k's default: one pass
        clip = self.local_clip_factor(tensor, name)
        if clip is not None:
            tensor = tensor * clip
        previous, residual = self.caught_up(name, checked_state(self.momenta, name, tensor, "momentum"),
                                            checked_state(self.residuals, name, tensor, "residual"))
        if self.sgd_momentum > 0.0:
            units = self.units_factor(self.sgd_momentum)
            tensor = self._with_momentum(tensor if units == 1.0 else tensor * units, name, previous)
        self._note_incoming(name, tensor)
        if residual is None:
            self._made.pop(name, None)
            return tensor if self.gamma == 1.0 else tensor * self.gamma
        out = self._spares.take(name, tensor)
        if self.gamma == 1.0 and self.beta == 1.0:
            compensated = torch.add(tensor, residual, out=out)
        else:
            scaled = tensor if self.gamma == 1.0 else tensor * self.gamma
            compensated = torch.add(scaled, residual if self.beta == 1.0 else residual * self.beta, out=out)
        self._made[name] = compensated
        return compensated

    def update(self, tensor, name, compressor, payload, ctx):
        made = self._made.pop(name, None)
        if compressor.lossless:  # everything was sent exactly: nothing to carry
            self.residuals.pop(name, None)
            self._note_held(name)
            return
        if made is tensor and not shares_memory(payload, (tensor,)):
            residual = tensor  # made by compensate() this step, sent already: it becomes the residual
        else:
            spare = self._spares.take(name, tensor)
            residual = tensor.clone() if spare is None else spare.copy_(tensor)
        subtract_sent(residual, compressor, payload, ctx)
        self.residuals[name] = residual
        self._note_held(name, residual)
        if self.masks_sent(name, True if self.masking else None, False) and name in self.momenta \
                and compressor.masks_sent_momentum(name):
            self._mask_sent(name, compressor, payload, ctx)

    def _mask_sent(self, name, compressor, payload, ctx) -> None:
        """Momentum factor masking: the momentum of the coordinates this payload sent restarts
        from zero (in place when this step made it and the payload does not share it)."""
        momentum = self.momenta[name]
        in_place = self.momenta.is_pending(name) and not shares_memory(payload, (momentum,))
        flat = zero_positions(momentum.reshape(-1), sent_positions(compressor, payload, ctx), in_place)
        self.momenta[name] = flat.view_as(momentum)

    def commit(self):
        self._made.clear()
        self.loop_clip.commit()
        self._spares.recycle_commit(self.residuals)
        self._momentum_spares.recycle_commit(self.momenta)

    def rollback(self):
        self._made.clear()
        self.loop_clip.rollback()
        self._spares.recycle_rollback(self.residuals)
        self._momentum_spares.recycle_rollback(self.momenta)

    def error_norm(self):
        """The norm of the residuals: what was computed but not yet sent."""
        return norm_of(self.residuals.committed().values())

    def state_dict(self):
        state = {"residuals": {k: v.detach().clone() for k, v in self.residuals.committed().items()}}
        momenta = self.momenta.committed()
        if momenta:  # only a memory with a momentum has them (older states have none)
            state["momenta"] = {k: v.detach().clone() for k, v in momenta.items()}
            state["units"] = UNITS[self.gradient_units]
        return self.with_loop_clip_state(state)

    def check_state(self, state, groups):
        """Residuals (and momenta, when there is a momentum) are flat tensors of their
        group's size and dtype."""
        unknown = sorted(set(state) - {"residuals", "momenta", "units", "loop_clip"})
        if unknown:
            raise ValueError(f"residual memory state has unknown keys {unknown}; expected 'residuals' "
                             f"(and 'momenta', 'units', 'loop_clip')")
        self.check_loop_clip_state(state, "residual memory")
        units_of(state)
        check_group_tensors("residual", state.get("residuals", {}), groups)
        check_group_tensors("residual memory momentum", state.get("momenta", {}), groups)

    def load_state_dict(self, state):
        self._made.clear()
        self._spares.clear()
        self._momentum_spares.clear()
        momenta = state.get("momenta", {})
        self.loop_clip.load_state_dict(state.get("loop_clip", {}))
        self._fold_or_take()  # a fold that had seen the loop clip runs SGD's momentum again
        # a state saved in the other units (an older run, or one whose momentum was not taken
        # over) is converted: the residuals and momenta are both in the momentum's units
        saved = units_of(state) if momenta else self.gradient_units
        convert = (lambda tensors: in_units(tensors, saved, self, self.sgd_momentum)) if momenta else \
            (lambda tensors: {k: v.clone() for k, v in tensors.items()})
        self.residuals.replace(convert(state.get("residuals", {})))
        self.momenta.replace(convert(momenta))

    def __repr__(self):
        clip = "" if self.clip_norm is None else f", clip_norm={self.clip_norm}"
        momentum = ", momentum='fold'" if self.folds else "" if self.sgd_momentum == 0.0 else \
            f", momentum={self.sgd_momentum}"
        nesterov = ", nesterov=True" if self.nesterov and not self.folds else ""  # a fold follows SGD's
        adam = ", adam=True" if self.adam else ""
        loop = "" if self.follow_loop else ", follow_loop=False"
        return f"ResidualMemory(beta={self.beta}, gamma={self.gamma}{clip}{momentum}{nesterov}{adam}{loop})"
