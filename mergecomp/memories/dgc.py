"""DGC memory: momentum correction, momentum factor masking and local gradient clipping.

Lin et al., "Deep Gradient Compression: Reducing the Communication Bandwidth for
Distributed Training", ICLR 2018, Section 3.2 and Algorithm 1 (lines 6-12).

How it combines with the wrapped optimizer: momentum moves *into* this memory.  Each rank
accumulates velocity locally, u ← m·u + g, v ← v + u (Nesterov: u ← m·(u + g),
v ← v + u + g), and the sparse compressor sends the largest entries of v, which are
already momentum updates; the optimizer must then apply them without a momentum of its
own.  If the optimizer also applied its momentum, momentum would be applied twice.  So an
``SGD(momentum=m)`` has its momentum taken over (:func:`check_optimizer`, through
:func:`mergecomp.momentum.take_over_momentum`): the memory uses m and SGD's Nesterov flag,
and SGD steps with momentum 0 while the learning rate schedule and weight decay stay with
it.  An ``Adam``/``AdamW`` has its first moment β1 taken over the same way (Adam steps at
β1 = 0); an optimizer with another kind of momentum (RMSprop's, NAdam's) is refused.
"""
from __future__ import annotations

from typing import Optional

import torch

from ..momentum import TAKES_OVER, take_over_momentum
from . import register
from .base import (UNITS, Memory, check_flag, check_number, checked_state, combined_scale, in_units,
                   norm_of, sent_positions, units_of, zero_positions)
from ..checkpoint import check_group_tensors
from ..kernels.momentum import momentum_correction
from ..staging import Spares, StagedDict, shares_memory
from .loopclip import LoopClip


def check_optimizer(optimizer, memory: "DGCMemory") -> None:
    """Take over the momentum of an ``SGD(momentum=m)`` or an Adam's β1 into ``memory``;
    ValueError for a momentum it cannot take (RMSprop's, groups that differ, a dampening, a
    memory given another momentum).  See :func:`mergecomp.momentum.take_over_momentum`."""
    take_over_momentum(optimizer, memory, "the dgc memory (momentum correction)")


#: The momentum of a memory given none, when the optimizer has none either.
DEFAULT_MOMENTUM = 0.9


@register("dgc")
class DGCMemory(Memory):
    """Accumulate momentum-corrected velocity; zero what was sent, in velocity and momentum.

    ``compensate(g)``: optionally clip g to L2 norm ``clip_norm`` (local gradient
    clipping, applied before accumulation as in the paper; the paper uses the global
    threshold scaled by N^(-1/2) for N ranks — pass that value), then
    u ← m·u + g, v ← v + u (plain) or u ← m·(u + g), v ← v + u + g (Nesterov), and return
    v for compression.  ``update``: the coordinates the payload sent are zeroed in v
    (they have been applied) and in u (momentum factor masking, which stops stale momentum
    from pushing a coordinate again after it was sent).  Clipping acts on a fused group,
    the unit the memory sees, rather than on the whole model.

    ``masking=False`` keeps the momentum of a sent coordinate (only v is zeroed), so it
    carries on as heavy-ball momentum does under dense SGD; ``True`` masks in every step.
    Left as None (the default), it masks in every step, except where the memory follows the
    loop's clipping (SGD's momentum taken over, the wrapper or the DDP hook watching the
    loop): then once the loop was seen clipping, and not under a loop that has not clipped,
    as the paper pairs the two (:mod:`mergecomp.memories.loopclip`).  Why: masking
    restarts a coordinate's momentum from zero at every send, so a coordinate sent every T
    steps moves by Σₜ (1 − mᵗ)/(1 − m) per unit of gradient instead of T/(1 − m), a fraction
    1 − m(1 − mᵀ)/((1 − m)T) of momentum SGD's step: 0.1 at T = 1, about 0.23 at T = 4 and
    0.41 at T = 10 for m = 0.9, near 1 only for T ≫ 1/(1 − m).  The paper's long runs at
    0.1% density sit in the last regime; a short run, or one where the same coordinates pass
    the threshold step after step (the warm-up's high densities, a language model's
    frequent rows), loses most of its step size to masking.  The bytes on the wire do not
    change.  Without masking a transformer's run, whose loop's clip binds, blew up early
    where the masked one trained, while the LSTM, whose clip never bound, gained from it
    (docs/results.md#sgd-dgc-masking, docs/results.md#sgd-mask-once-clipped).
    """

    needs_plain_optimizer = True
    momentum_role = TAKES_OVER

    def __init__(self, momentum: Optional[float] = None, nesterov: Optional[bool] = None,
                 clip_norm: Optional[float] = None, masking: Optional[bool] = None):
        if momentum is not None:
            momentum = check_number(momentum, "dgc memory momentum", 0.0, 1.0, high_open=True,
                                    advice="0.9 is usual; leave it None to take the SGD optimizer's.")
        if nesterov is not None:
            nesterov = check_flag(nesterov, "dgc memory nesterov")
        #: What the caller gave (None: the optimizer's, see :meth:`adopt_momentum`).
        self._given = (momentum, nesterov)
        self.momentum = DEFAULT_MOMENTUM if momentum is None else momentum
        self.nesterov = bool(nesterov)
        if clip_norm is not None:
            clip_norm = check_number(clip_norm, "dgc memory clip_norm", 0.0, float("inf"),
                                     low_open=True, high_open=True,
                                     advice="Pass None for no clipping; the paper clips at the "
                                            "global threshold times N^(-1/2) for N ranks.")
        self.clip_norm = clip_norm
        #: Masking in every step (as the paper), unless ``masking`` was left None (the
        #: default) and the memory follows the loop's clipping: then once the loop clips
        #: (:meth:`masks_sent`).
        self.masking = True if masking is None else check_flag(masking, "dgc memory masking")
        self._masking_given = masking is not None
        self.momenta = StagedDict()
        self.velocities = StagedDict()
        #: The loop's clipping, applied before the momentum once seen (:mod:`~mergecomp.memories.loopclip`).
        self.loop_clip = LoopClip()
        self._spares = Spares()  # momenta and velocities no state holds, reused by compensate()

    def check_optimizer(self, optimizer) -> None:
        """See :func:`mergecomp.memories.dgc.check_optimizer`."""
        check_optimizer(optimizer, self)

    def held_state(self) -> list:
        return [self.momenta, self.velocities]

    @property
    def masking_given(self) -> bool:
        """Whether ``masking`` was given (a memory pickled before it could be left None
        counts as given where it was False)."""
        return getattr(self, "_masking_given", not self.masking)

    @property
    def delivered_momentum(self) -> float:
        return self.momentum

    @property
    def follows_loop_clip(self) -> bool:
        """SGD's momentum taken over, and no ``clip_norm`` of its own."""
        return self.momentum_source == "sgd" and self.momentum > 0.0 and self.clip_norm is None

    def adopt_momentum(self, momentum: float, nesterov: bool, follow: bool = False) -> None:
        """Use the optimizer's ``momentum`` and ``nesterov`` from now on.  ValueError when
        the caller gave this memory a different momentum or Nesterov flag, unless
        ``follow`` (a momentum schedule moving the optimizer's value after the first check)."""
        given_momentum, given_nesterov = self._given
        if not follow and ((given_momentum is not None and given_momentum != momentum)
                           or (given_nesterov is not None and given_nesterov != nesterov)):
            raise ValueError(
                f"the dgc memory was given momentum={given_momentum}, nesterov={given_nesterov}, but the "
                f"optimizer it takes the momentum over from has momentum={momentum:g}, "
                f"nesterov={nesterov}: one momentum is applied, so give it once (leave the memory's "
                f"None to take the optimizer's, or set the optimizer's momentum to 0).")
        self.momentum, self.nesterov = float(momentum), bool(nesterov)

    def _state(self, name, tensor):
        momentum = checked_state(self.momenta, name, tensor, "dgc memory")
        if momentum is None:
            return torch.zeros_like(tensor), torch.zeros_like(tensor)
        return momentum, self.velocities[name]

    def _spare(self, key, like):
        spare = self._spares.take(key, like)
        return spare if spare is not None else torch.empty_like(like, memory_format=torch.contiguous_format)

    def compensate(self, tensor, name):
        # Local clipping's factor is applied inside the momentum correction's pass.
        scale = combined_scale(self.local_clip_factor(tensor, name), self.units_factor(self.momentum))
        momentum, velocity = self.caught_up(name, *self._state(name, tensor))
        # Into other tensors (spares this memory made earlier, when it has them), never the
        # committed ones changed in place: a step dropped after this (rollback) must find
        # the previous step's state intact.
        new_u, new_v = self._spare("u/" + name, tensor), self._spare("v/" + name, tensor)
        # One pass on the CPU where the native kernels are built (with the velocity's block
        # peaks for DGC's selection), else two torch passes: the same bits either way.
        momentum, velocity = momentum_correction(tensor, momentum, velocity, self.momentum, self.nesterov,
                                                 new_u, new_v, scale)
        self.momenta[name], self.velocities[name] = momentum, velocity
        self._note_incoming(name, momentum)
        return velocity

    def update(self, tensor, name, compressor, payload, ctx):
        # ``tensor`` is the velocity compensate() returned, possibly shared with the payload
        # (a dense compressor sends it as it is): new tensors replace it, it is never
        # changed in place, so the payload is not erased before it is sent.
        momentum, velocity = self._state(name, tensor)
        if compressor.dense and compressor.lossless:
            # Every coordinate went out exactly (a raw FP32 group): the velocity restarts
            # from zero and the momentum is not masked, so a group sent uncompressed trains
            # with plain momentum SGD, as DGC treats uncompressed layers.
            self.velocities[name] = torch.zeros_like(velocity)
            self._note_held(name)
            return
        flat_v, flat_u = velocity.reshape(-1), momentum.reshape(-1)
        if compressor.dense:
            # A 16-bit cast went out: the velocity keeps only its rounding error.
            sent = compressor.decompress(payload, ctx).reshape(-1).to(flat_v.dtype)
            self.velocities[name] = (flat_v - sent).view_as(velocity)
            self._note_held(name, self.velocities[name])
            return
        # Zeroed in place when this step's compensate() made both tensors (they are pending,
        # so a rollback never sees them) and no payload tensor shares their memory (it may
        # still be in flight): two passes over the group fewer than zeroing copies.
        in_place = (self.momenta.is_pending(name) and self.velocities.is_pending(name)
                    and not shares_memory(payload, (velocity, momentum)))
        sent = sent_positions(compressor, payload, ctx)
        if getattr(compressor, "subtract_sent", None) is not None:
            # The values sent leave the velocity, not the whole coordinate: a payload that
            # rounds them (top-k's compact wire, DGC's fp16 values) keeps the rounding for the
            # next step; exact values leave exactly 0 there, as zeroing does.
            flat_v = flat_v if in_place else flat_v.clone()
            compressor.subtract_sent(flat_v, payload, ctx)
        else:
            flat_v = zero_positions(flat_v, sent, in_place)
        if self.masks_sent(name, self.masking if self.masking_given else None, True):
            flat_u = zero_positions(flat_u, sent, in_place)
        self.velocities[name] = flat_v.view_as(velocity)
        self.momenta[name] = flat_u.view_as(momentum)
        self._note_held(name, flat_v)

    def commit(self):
        self.loop_clip.commit()
        self._spares.recycle_commit(self.momenta, "u/")
        self._spares.recycle_commit(self.velocities, "v/")

    def rollback(self):
        self.loop_clip.rollback()
        self._spares.recycle_rollback(self.momenta, "u/")
        self._spares.recycle_rollback(self.velocities, "v/")

    def error_norm(self):
        """The norm of the velocities: accumulated updates not yet sent."""
        return norm_of(self.velocities.committed().values())

    def state_dict(self):
        return self.with_loop_clip_state(
            {"momenta": {k: v.detach().clone() for k, v in self.momenta.committed().items()},
             "velocities": {k: v.detach().clone() for k, v in self.velocities.committed().items()},
             "units": UNITS[self.gradient_units]})

    def check_state(self, state, groups):
        """Momenta and velocities are flat tensors of their group's size and dtype, one of
        each per group."""
        unknown = sorted(set(state) - {"momenta", "velocities", "units", "loop_clip"})
        if unknown:
            raise ValueError(f"dgc memory state has unknown keys {unknown}; expected 'momenta', 'velocities' "
                             f"(and 'units', 'loop_clip')")
        self.check_loop_clip_state(state, "dgc memory")
        units_of(state)
        momenta, velocities = state.get("momenta", {}), state.get("velocities", {})
        check_group_tensors("dgc momentum", momenta, groups)
        check_group_tensors("dgc velocity", velocities, groups)
        if set(momenta) != set(velocities):
            raise ValueError(f"dgc memory state has momenta for groups {sorted(momenta)} but velocities "
                             f"for {sorted(velocities)}: one of each per group")

    def load_state_dict(self, state):
        self._spares.clear()
        saved = units_of(state)  # a state saved in the other units is converted
        self.momenta.replace(in_units(state.get("momenta", {}), saved, self, self.momentum))
        self.velocities.replace(in_units(state.get("velocities", {}), saved, self, self.momentum))
        self.loop_clip.load_state_dict(state.get("loop_clip", {}))

    def __repr__(self):
        masking = f", masking={self.masking}" if self.masking_given else ""
        return (f"DGCMemory(momentum={self.momentum}, nesterov={self.nesterov}, "
                f"clip_norm={self.clip_norm}{masking})")

