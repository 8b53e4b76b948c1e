"""The loop's gradient clipping, moved before a momentum that the exchange carries.

A memory that takes SGD's momentum over (top-k's, GradDrop's, DGC's) runs it *before* the
exchange, so what reaches ``p.grad`` is a momentum, not a gradient.  A loop that clips
``p.grad`` after the exchange, as under DDP, then clips the momentum and what the error
feedback releases, not the gradients dense training clips.  Measured on a character
transformer under SGD with the averaged gradient clipped after the exchange, top-k at its
defaults diverged, and clipping each rank's whole gradient at the loop's threshold before
the momentum, with the loop's clip after it kept, still left it far behind dense
(docs/results.md#loop-clip, docs/results.md#sgd-topk-gpt).

What worked is the DGC paper's local clipping (Lin et al., ICLR 2018, section 3.2): each
rank's gradient of each group clipped on its own at the threshold over √(ranks), before the
momentum, and no clip after the exchange.  So, in four parts:

- **Seen from the first step.**  The wrapper hands the loop the averages in a gradient's
  scale from the first step (:meth:`mergecomp.memories.base.Memory.delivery_scale`: a
  momentum that starts from zero is divided by ``1 − m^(t+1)``, as Adam corrects its
  moments), and multiplies them back at ``step()``; so a loop that clips, clips from the
  first step, where dense training's clip is also at work, and
  :class:`mergecomp.runtime.drift.ClipWatch` sees its threshold there (the averages' norm
  fell between the exchange and ``step()`` by a factor that is not a power of two; every
  rank reads the same number).
- **Clipped before the momentum.**  From the next step the memory clips each group of this
  rank's gradient at the threshold over √(ranks) (:meth:`LoopClip.scale`).  What the
  memory took in unclipped before the threshold was known (its momentum and what it holds
  back) is scaled once, when it starts following, by the clip those steps would have
  taken, weighted by their norms (:meth:`~mergecomp.memories.base.Memory.follow_loop_clip`;
  between steps, so that a regrouping after it, as DDP's after its first iteration, keeps
  it): for one step, exactly the state clipping would have left
  (a top-k selection does not change under a scale).  On that transformer even one step
  taken in unclipped and left so cost a clear part of what the clipping gains
  (docs/results.md#sgd-loop-follow).
- **Not clipped again after it.**  Where the loop clips at the threshold it was seen at,
  the wrapper undoes that clip on the groups whose memory clipped before the momentum
  (a rescale to another norm, such as a division for gradient accumulation, is left alone).
- **Masked once the loop clips.**  The DGC paper pairs local clipping with momentum factor
  masking (section 3.2): both tame training whose gradients outgrow the threshold.  A
  memory that follows the loop masks the momentum of the coordinates it sends once the
  loop was seen clipping, and not under a loop that has not clipped
  (:meth:`~mergecomp.memories.base.Memory.masks_sent`).  Measured under SGD: top-k without
  masking trailed dense on a character transformer, whose loop clips from the first step,
  and DGC with masking trailed it far on a character LSTM, whose loop's clip never bound
  (masking restarts the momentum of coordinates sent often, most of their step).  Masking
  only in the steps where a group was clipped helped both but left DGC on the transformer
  at two workers far behind, where masking from the loop's first clip on kept it ahead
  (docs/results.md#sgd-mask-once-clipped).

Under AMP's ``GradScaler`` the gradients the memory takes in carry the loss scale S, and the
loop unscales the averages before it clips them: the threshold is then in the loss's units
and the memory's gradients in S times them.  The wrapper finds the scaler whose ``step()``
called the optimizer's (:meth:`LoopClip.attach`) and the memory clips at S times its share,
its norms kept in the loss's units; the clip watch reads the loop's clip with the unscaling
taken out.  Without that, a run under a scaler clipped each rank's gradient to about 1/S
of its share and hardly moved.

A memory given ``clip_norm`` (explicit local clipping) keeps it and does not follow the
loop; one that takes an Adam's first moment over does not either (Adam divides by its own
scale, and its runs were measured without it), nor a residual memory built with
``follow_loop=False`` (rand-k's: its averages trip the loop's clip by themselves).  A
residual memory that folds SGD's momentum (``momentum="fold"``) follows it too, and from
the loop's first clip on, if that came within the loop's first steps
(:attr:`LoopClip.clipped_late` says it did not), runs the momentum it folded before the
exchange (:class:`~mergecomp.memories.residual.ResidualMemory`).
"""
from __future__ import annotations

import math
from typing import Any, Dict, Optional, Tuple

import torch

from ..staging import StagedDict


class LoopClip:
    """Each group's clipping threshold on this rank, the loop's threshold over √(ranks) (None
    until the loop is seen clipping), and until then the norms each group's gradient had,
    staged with the memory's state (a dropped step leaves them as they were)."""

    #: Steps of norms kept while no threshold is known; past them the loop is taken not to
    #: clip from its first steps, and a threshold seen later clips from then on only.
    recorded_steps = 100

    def __init__(self):
        self.threshold: Optional[float] = None
        #: AMP's ``GradScaler`` whose ``step()`` calls the optimizer's (:meth:`attach`): not
        #: saved, found again at the first ``step()`` of a resumed run.
        self.scaler = None
        #: The loss scale this memory's gradients carry, once a scaler was seen (saved, so a
        #: resumed run clips its first step as the uninterrupted one).
        self.loss_scale: Optional[float] = None
        self.recording = True
        #: Whether the loop was first seen clipping only after :attr:`recorded_steps` steps
        #: (a loop that did not clip from its first steps; saved with the threshold).
        self.clipped_late = False
        self.norms = StagedDict()  # group → this rank's gradient norms, steps before a threshold
        self._catch_up = StagedDict()  # group → the one-off factor of its earlier state
        self._held = StagedDict()  # "scale" → the loss scale the memory's state was taken in at
        #: An entry point watches the loop for this memory (the wrapper; the DDP hook shown the
        #: optimizer): its threshold, once the loop clips, comes to :meth:`follow`.
        self.watched = False

    @property
    def before_first_step(self) -> bool:
        """Nothing known or recorded yet: no step of the memory's was kept (saved with the
        state, unlike a count of steps)."""
        return self.threshold is None and self.recording and not self.norms.committed()

    def follow(self, threshold: float) -> None:
        """Clip each group at ``threshold`` from the next step, and find by how much what
        the memory took in before is scaled: what that clipping would have taken
        (:meth:`take_catch_up`; a state saved with factors still owed, :meth:`catch_up`)."""
        if not (isinstance(threshold, float) and math.isfinite(threshold) and threshold > 0.0):
            raise ValueError(f"a clipping threshold must be a positive finite float, got {threshold!r}")
        if self.threshold is None:  # the first clip seen: within the first steps, or late
            self.clipped_late = not self.recording
        self.threshold = threshold
        catch_up = {}
        for name, norms in self.norms.committed().items():
            total = sum(norms)
            if total > 0.0:
                kept = sum(min(norm, threshold) for norm in norms) / total
                if kept < 1.0:
                    catch_up[name] = kept
        self._catch_up.replace(catch_up)
        self.norms.replace({})
        self.recording = False

    def attach(self, scaler, scale: float) -> None:
        """``scaler`` (AMP's ``GradScaler``) called the optimizer's ``step()``: the gradients
        this memory takes in are multiplied by its scale (``scale``: this step's).  Norms
        recorded before any scale was known are put in the loss's units."""
        if not (isinstance(scale, float) and math.isfinite(scale) and scale > 0.0):
            raise ValueError(f"a loss scale must be a positive finite float, got {scale!r}")
        if self.loss_scale is None:
            self.norms.replace({name: tuple(norm / scale for norm in norms)
                                for name, norms in self.norms.committed().items()})
        if "scale" not in self._held.committed():
            self._held.replace({"scale": scale})
        self.scaler, self.loss_scale = scaler, scale

    def units(self) -> float:
        """The loss scale the gradients carry now (1 without a ``GradScaler``): the
        scaler's current scale, which its ``update()`` after the last step set."""
        if self.scaler is not None:
            self.loss_scale = float(self.scaler.get_scale())
        return 1.0 if self.loss_scale is None else self.loss_scale

    def scale(self, tensor: torch.Tensor, name: str) -> Optional[float]:
        """The factor ``tensor`` (group ``name``'s gradient on this rank) is multiplied by
        before the momentum, or None (no threshold yet, or short enough).  The memory calls it
        first for each group, so it reads the scaler's scale for the step (:meth:`catch_up`
        uses what it read)."""
        units = self.units()
        if self.threshold is None and not self.recording:
            return None
        norm = float(torch.linalg.vector_norm(tensor, dtype=torch.float32))
        if self.threshold is None:
            norms = self.norms.get(name, ())
            if len(norms) >= self.recorded_steps:
                self.recording = False
                self.norms.replace({})
            else:
                self.norms[name] = norms + (norm / units,)
            return None
        limit = self.threshold * units
        return limit / norm if norm > limit else None

    def __getstate__(self) -> Dict[str, Any]:
        """Pickled (with a pickled DDP hook state) without the live scaler; the entry point
        that unpickles it finds it again."""
        return {**self.__dict__, "scaler": None}

    def __setstate__(self, state: Dict[str, Any]) -> None:
        """What an older pickle lacks starts as a new instance has it."""
        self.__dict__.update({**LoopClip().__dict__, **state})

    def take_catch_up(self) -> Dict[str, float]:
        """The factors :meth:`follow` found, handed over once to a memory that scales its
        state by them at once (:meth:`catch_up` then finds none)."""
        factors = self._catch_up.committed()
        self._catch_up.replace({})
        return factors

    def catch_up(self, name: str) -> Optional[float]:
        """The factor by which the state the memory holds for ``name`` is scaled before this
        step's gradient joins it, or None: once per group after :meth:`follow`, the clipping
        the steps taken in before the threshold would have had; and under a ``GradScaler``
        whose scale moved since that state was taken in (its growth, or its back-off after
        an overflow), the new scale over the old, so that state and gradient carry one."""
        factor = self._catch_up.get(name)
        if factor is not None:
            del self._catch_up[name]
        if self.loss_scale is not None:
            units = self.loss_scale  # read by scale() for this group a moment ago
            held = self._held.committed().get("scale")
            self._held["scale"] = units
            if held is not None and held != units:
                factor = (1.0 if factor is None else factor) * units / held
        return factor

    def commit(self) -> None:
        self.norms.commit()
        self._catch_up.commit()
        self._held.commit()

    def rollback(self) -> None:
        self.norms.rollback()
        self._catch_up.rollback()
        self._held.rollback()

    def state_dict(self) -> Dict[str, Any]:
        """Empty when nothing is known or recorded (so states of runs that never clip are as
        before once the first steps are past)."""
        state: Dict[str, Any] = {}
        if self.threshold is not None:
            state["threshold"] = self.threshold
        if self.clipped_late:
            state["clipped_late"] = True
        catch_up = self._catch_up.committed()
        if catch_up:
            state["catch_up"] = catch_up
        committed = dict(self.norms.committed())
        if committed:
            state["norms"] = {k: list(v) for k, v in committed.items()}
        if not self.recording and self.threshold is None:
            state["recording"] = False
        if self.loss_scale is not None:
            state["loss_scale"] = self.units()
        held = self._held.committed().get("scale")
        if held is not None:
            state["held_scale"] = held
        return state

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.threshold = None if "threshold" not in state else float(state["threshold"])
        self._catch_up.replace({str(k): float(v) for k, v in state.get("catch_up", {}).items()})
        norms: Dict[str, Tuple[float, ...]] = {}
        if self.threshold is None:  # a state saved before per-group clipping kept last norms: not needed
            norms = {str(k): tuple(float(x) for x in v) for k, v in state.get("norms", {}).items()}
        self.norms.replace(norms)
        self.recording = self.threshold is None and bool(state.get("recording", True))
        self.clipped_late = self.threshold is not None and bool(state.get("clipped_late", False))
        self.scaler, self.loss_scale = None, (None if "loss_scale" not in state else float(state["loss_scale"]))
        self._held.replace({} if "held_scale" not in state else {"scale": float(state["held_scale"])})

    @staticmethod
    def check_state(state: Any, what: str) -> None:
        """ValueError naming what is wrong with a saved ``loop_clip`` state."""
        keys = {"threshold", "norms", "catch_up", "recording", "clipped_late", "loss_scale", "held_scale"}
        if not isinstance(state, dict) or set(state) - keys:
            raise ValueError(f"{what} loop_clip state must be a dict with keys among {sorted(keys)}, got {state!r}")
        for key in ("threshold", "loss_scale", "held_scale"):
            value = state.get(key, 1.0)
            if not (isinstance(value, float) and math.isfinite(value) and value > 0.0):
                raise ValueError(f"{what} loop_clip {key} must be a positive finite float, got {value!r}")
        for key in ("recording", "clipped_late"):
            if not isinstance(state.get(key, True), bool):
                raise ValueError(f"{what} loop_clip {key} must be True or False, got {state[key]!r}")

        def finite(value, low, high):
            return isinstance(value, float) and math.isfinite(value) and low <= value <= high

        norms, catch_up = state.get("norms", {}), state.get("catch_up", {})
        if not isinstance(norms, dict) or not all(
                (isinstance(v, (list, tuple)) and all(finite(x, 0.0, math.inf) for x in v)) or finite(v, 0.0, math.inf)
                for v in norms.values()):
            raise ValueError(f"{what} loop_clip norms must map groups to lists of finite norms ≥ 0, got {norms!r}")
        if not isinstance(catch_up, dict) or not all(finite(v, 0.0, 1.0) for v in catch_up.values()):
            raise ValueError(f"{what} loop_clip catch_up must map groups to factors in [0, 1], got {catch_up!r}")
