"""The quality controller: raises a group's density, rank or bits where the exchange lags dense.

:class:`DriftController` raises a group's density (a sparsifier's share of coordinates),
rank (a low-rank factorisation's) or bits (a low-bit compressor's: to 2, 4, 8) when its lag
passes ``raise_above``, doubling it, and lowers it again once the lag has stayed under ``lower_below`` for
``patience`` measurements, within a byte budget: over the run, the bytes the compressed
groups send may be at most ``byte_budget`` times what they would at the configured setting.
Compressing less where the exchange lags is what Accordion (Agarwal et al., MLSys 2021)
does in the regimes it detects from the gradient norm's rate of change, and what DGC's
warm-up does on a fixed schedule; here the lag itself is the signal, per group.  Its
decisions come from the agreed sums and its own state, at fixed steps, so every rank takes
the same ones; its state is saved with the step lifecycle's, so a resumed run decides as
the first would have.  A scale only changes how many coordinates (or columns) a group sends,
never a compiled path: the group's shapes change at most once per decision.  The lag it
reads is measured by :mod:`mergecomp.runtime.drift` and handed over as a :class:`DriftReading`;
for an unbiased compressor without error feedback (ATOMO, unbiased rand-k) the reading is the
exchange's noise, steered the same way by thresholds of its own; a raised group is then
lowered only when the noise a step down would read is calm (:meth:`DriftController._noise_below`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Tuple, Union

from ..momentum import is_adam

#: ``raise_above`` and ``lower_below`` under SGD (and any optimizer not vetted yet), in steps
#: of update held back: where the lag separated the runs that reached dense from those that
#: missed it under SGD (docs/results.md#quality-control).
SGD_THRESHOLDS = (1.5, 0.5)
#: The same under an Adam or AdamW with a memory that takes its first moment over with
#: momentum factor masking (top-k's, GradDrop's and DGC's there).  Such a memory at top-k's
#: density settles below the raise threshold in runs that reach dense with nothing raised,
#: while at DGC's it climbs far above it and the run misses dense unless raised
#: (docs/results.md#adamw-thresholds): SGD's thresholds would spend the whole budget on the first.
ADAM_THRESHOLDS = (24.0, 8.0)
#: ``raise_above`` and ``lower_below`` for a noise reading (an unbiased compressor without
#: error feedback, e.g. ATOMO's: each rank's compression error over its gradient's norm),
#: whatever the optimizer: where that noise separated the runs that reached dense from those
#: that missed it (docs/results.md#noise-threshold, docs/results.md#noise-0.6).
NOISE_THRESHOLDS = (0.6, 0.3)


@dataclass(frozen=True)
class DriftReading:
    """One measurement, the same on every rank, at ``step``: of the whole model and of each
    group, the ``lag`` (``kind="lag"``: steps of update error feedback holds back) or, for an
    unbiased compressor without error feedback (``kind="noise"``), the exchange's relative
    noise ``√(Σ_r ‖C(g_r) − g_r‖² / Σ_r ‖g_r‖²)``: how large one rank's compression error is
    against its gradient (averaging over N ranks divides the variance it adds by N)."""

    step: int
    lag: float
    groups: Dict[str, float] = field(default_factory=dict)
    kind: str = "lag"

    @property
    def column(self) -> str:
        """The step log's column for it: ``drift`` (a lag) or ``noise``."""
        return "noise" if self.kind == "noise" else "drift"

    @property
    def noise(self) -> Optional[float]:
        """The whole model's relative noise (a noise reading), else None."""
        return self.lag if self.kind == "noise" else None

    def describe(self, limit: int = 4) -> str:
        worst = sorted(self.groups.items(), key=lambda kv: -kv[1])[:limit]
        most = ", ".join(f"{name} {value:.3g}" for name, value in worst)
        if self.kind == "noise":
            return f"each rank's compressed gradient is off by {self.lag:.3g} times its norm (the most: {most})"
        return f"the exchange holds back {self.lag:.3g} steps of update (the most: {most})"


class DriftController:
    """Raises a group's density (or rank) where the exchange lags dense, lowers it where it
    does not, within a byte budget (see the module docstring).

    Args:
        raise_above: a group whose lag (steps of update held back) passes this is sent at
            twice its scale, up to ``max_scale``.  ``"auto"`` (the default) follows the
            optimizer and memory (:meth:`follow_optimizer`): :data:`SGD_THRESHOLDS`, or
            :data:`ADAM_THRESHOLDS` under an Adam or AdamW whose first moment the memory
            holds with momentum factor masking.  A noise reading (an unbiased compressor
            without error feedback) is steered by :data:`NOISE_THRESHOLDS` instead.
        lower_below: a group whose lag stayed under this for ``patience`` measurements in a
            row is sent at half its scale, down to 1 (the configured setting; for a noise
            reading, the noise half the scale would read: :meth:`_noise_below`); ``"auto"``
            as ``raise_above``.  The two follow the optimizer when both are ``"auto"``; with
            one given, the other ``"auto"`` is SGD's and neither follows it.
        byte_budget: over the run, the compressed groups may send at most this many times
            the bytes of the configured setting (2: keep at least half of its saving).
        max_scale: the most a group's density (or rank) is multiplied by.
        horizon: the run's length in steps, if known: the whole budget may then be spent
            early, where the lag matters most; otherwise that of the first ``front``
            measurements (see :meth:`allowed`).
        front: see ``horizon``.
        every: steps between two measurements (and decisions).
        start_scale: the warm start: every group sends at this scale for the first ``every``
            steps after the first decision, as far as the budget's front allows, then at the
            configured setting, and the rules take over (1, the default: no warm start; None:
            ``max_scale``).  Why: under Adam a coordinate that a sparse exchange first sends
            late meets a second moment that never saw it and takes an oversized step; a few
            dense steps at the start give every coordinate one (measured:
            docs/results.md#quality-control), as DGC's density warm-up does for its own.

    The scales act on the compressor's :attr:`~mergecomp.compressors.base.Compressor.knob`;
    a compressor without one is measured (and warned about) but not steered.
    """

    def __init__(self, raise_above: Union[float, str] = "auto", lower_below: Union[float, str] = "auto",
                 byte_budget: float = 2.0,
                 max_scale: float = 16.0, patience: int = 3, horizon: Optional[int] = None, front: int = 10,
                 every: int = 10, start_scale: Optional[float] = 1.0):
        #: Whether the thresholds follow the optimizer (:meth:`follow_optimizer`): both "auto".
        self.auto_thresholds = raise_above == "auto" and lower_below == "auto"
        # one of them given: the other "auto" is SGD's, and neither follows the optimizer
        raise_above = SGD_THRESHOLDS[0] if raise_above == "auto" else raise_above
        lower_below = SGD_THRESHOLDS[1] if lower_below == "auto" else lower_below
        checks = (("raise_above", raise_above, 0.0), ("lower_below", lower_below, 0.0),
                  ("byte_budget", byte_budget, 1.0), ("max_scale", max_scale, 1.0))
        for what, value, least in checks:
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                    or value < least:
                raise ValueError(f"DriftController {what} must be a finite number ≥ {least:g}, got {value!r}")
        if start_scale is None:
            start_scale = max_scale
        if isinstance(start_scale, bool) or not isinstance(start_scale, (int, float)) \
                or not 1.0 <= start_scale <= max_scale:
            raise ValueError(f"DriftController start_scale must be a number from 1 to max_scale ({max_scale!r}), "
                             f"got {start_scale!r}")
        if not lower_below < raise_above:
            raise ValueError(f"DriftController lower_below ({lower_below!r}) must be below raise_above "
                             f"({raise_above!r}), or a group would be raised and lowered in turn")
        for what, value in (("patience", patience), ("front", front), ("every", every)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"DriftController {what} must be a whole number ≥ 1, got {value!r}")
        if horizon is not None and (isinstance(horizon, bool) or not isinstance(horizon, int) or horizon < 1):
            raise ValueError(f"DriftController horizon must be the run's steps (a whole number ≥ 1) or None, "
                             f"got {horizon!r}")
        self.raise_above, self.lower_below = float(raise_above), float(lower_below)
        self.byte_budget, self.max_scale = float(byte_budget), float(max_scale)
        self.patience, self.horizon, self.front = patience, horizon, front
        self.start_scale = float(start_scale)
        #: Steps between two measurements (and decisions).
        self.every = every
        #: Each group's scale now (absent: 1), and how many measurements in a row it was calm.
        self.scales: Dict[str, float] = {}
        self._calm: Dict[str, int] = {}
        #: Bytes sent so far by the steered groups, at the scales of the time, and what the
        #: configured setting would have sent; the steps they cover.
        self.spent = 0.0
        self.base = 0.0
        self.steps = 0
        #: Steps in which no group went through the compressor (a plan that sends every group
        #: raw, as ``auto``'s first profile does): nothing was spent and the configured setting
        #: would have sent nothing either, so they count toward neither.
        self.idle = 0
        self.starved = False
        #: Decisions left before a group that gave back for the budget may be raised again.
        self._cooling: Dict[str, int] = {}
        #: (step, {group: scale}) after every decision that changed a scale.
        self.history: List[Tuple[int, Dict[str, float]]] = []
        #: Whether the first decision (which starts the groups at ``start_scale``) was taken.
        self.started = False
        #: The groups the warm start raised, until the decision that ends it.
        self._warm: List[str] = []
        #: A noise reading's memory (see :meth:`_noise_below`): each group's scale and
        #: reading at the last decision, and for each scale it was raised to, the reading
        #: just before the raise over the first one after it.
        self._seen: Dict[str, Tuple[float, float]] = {}
        self._gain: Dict[str, Dict[float, float]] = {}

    def follow_optimizer(self, optimizer, memory=None) -> None:
        """``"auto"`` thresholds: :data:`ADAM_THRESHOLDS` under an Adam or AdamW whose first
        moment the ``memory`` holds with momentum factor masking (its lag then counts steps of
        that masked moment), :data:`SGD_THRESHOLDS` otherwise (any other optimizer or memory,
        or None: not known)."""
        if self.auto_thresholds:
            masked_adam = (optimizer is not None and is_adam(optimizer)
                           and bool(getattr(memory, "masking", False)))
            self.raise_above, self.lower_below = ADAM_THRESHOLDS if masked_adam else SGD_THRESHOLDS

    def thresholds(self, kind: str = "lag") -> Tuple[float, float]:
        """(raise above, lower below) for a reading of ``kind``: ``raise_above`` and
        ``lower_below`` for a lag (steps of update held back), :data:`NOISE_THRESHOLDS` for
        a noise (a relative error, another unit)."""
        return NOISE_THRESHOLDS if kind == "noise" else (self.raise_above, self.lower_below)

    def decide(self, reading: DriftReading, weights: Mapping[str, float], steps: int,
               ahead: Optional[int] = None) -> Dict[str, float]:
        """The scales for the next ``ahead`` steps (default ``steps``) from ``reading`` (every
        rank the same), ``weights`` (each group's bytes per step at scale 1, as the step
        measured sent them: a density warm-up's larger sends count in the setting's bytes)
        and ``steps`` since the last decision (the scales then in force sent that long).
        Returns the groups whose scale changed, with their new scale."""
        total = sum(weights.values()) or 1.0
        self.spent += steps * sum(w * self.scales.get(g, 1.0) for g, w in weights.items())
        self.base += steps * total
        self.steps += steps
        steps = ahead if ahead is not None else steps
        changed: Dict[str, float] = {}
        #: Whether a group that lags was left where it is for want of budget at this decision.
        self.starved = False
        for group in list(self._cooling):  # a group that gave back for the budget waits before rising again
            self._cooling[group] -= 1
            if self._cooling[group] <= 0:
                del self._cooling[group]
        warm_start = not self.started and self.start_scale > 1.0
        if warm_start:  # the first interval at start_scale; the budget's give-back below trims it
            changed.update({group: self.start_scale for group in reading.groups})
            self._warm = sorted(reading.groups)
        elif self._warm:  # it lasts one interval: back to the configured setting, then the rules
            changed.update({group: 1.0 for group in self._warm if self.scales.pop(group, 1.0) != 1.0})
            self._warm = []
        self.started = True
        raise_above, lower_below = self.thresholds(reading.kind)
        for group, lag in sorted(reading.groups.items(), key=lambda kv: -kv[1]):
            if warm_start:
                break
            scale = self.scales.get(group, 1.0)
            # what lowering would bring back: the lag itself, or a noise a step down
            down = self._noise_below(group, scale, lag) if reading.kind == "noise" else lag
            if lag > raise_above and scale < self.max_scale:
                wanted = min(self.max_scale, 2 * scale)
                if group not in self._cooling and self._affordable(weights, total, steps, group, wanted):
                    changed[group] = wanted
                else:
                    self.starved = True
                self._calm[group] = 0
            elif down < lower_below:
                self._calm[group] = self._calm.get(group, 0) + 1
                if scale > 1.0 and self._calm[group] >= self.patience:
                    changed[group] = max(1.0, scale / 2)
                    self._calm[group] = 0
            else:
                self._calm[group] = 0
        while not self._within(weights, total, steps, {**self.scales, **changed}):
            # over the budget: the calmest raised group gives back first, half at a time
            now = {**self.scales, **changed}
            calmest = min((g for g in now if now[g] > 1.0), key=lambda g: reading.groups.get(g, 0.0), default=None)
            if calmest is None:
                break
            changed[calmest] = max(1.0, now[calmest] / 2)
            self._cooling[calmest] = self.patience  # no raising it straight back: no flapping
        for group, scale in changed.items():
            if scale == 1.0:
                self.scales.pop(group, None)
            else:
                self.scales[group] = scale
        if changed:
            self.history.append((reading.step, dict(self.scales)))
        return changed

    def _noise_below(self, group: str, scale: float, noise: float) -> float:
        """A noise reading as the rules weigh it: at a raised scale, the noise the group
        would read a step down, which is what lowering it would bring back.

        A noise is this step's error alone, a property of the setting and of the gradient
        now, with no history in it (a lag, unlike it, holds the steps before).  So the
        reading the group took just before it was raised, over the first one after, is the
        setting's own gain, and the reading now times that gain says where a step down
        would land.  Weighed by the raised reading itself, a group raised far below the
        lower threshold (QSGD's 7 levels to 127) was lowered after ``patience`` readings and
        raised again at the next, three steps in four; under AdamW each switch between the
        two settings cost more than either setting did alone (docs/results.md#noise-hold).
        Without a measured gain (a group the warm start raised, or one the budget gave back
        and raised again before a reading) the reading is weighed as it is."""
        before = self._seen.get(group)
        if before is not None and before[0] * 2 == scale and noise > 0.0:
            self._gain.setdefault(group, {})[scale] = before[1] / noise  # the first reading after a raise
        self._seen[group] = (scale, noise)
        gain = self._gain.get(group, {}).get(scale)  # measured at a raise: only for a scale ≥ 2
        return noise * gain if gain is not None else noise

    def regrouped(self, scales: Mapping[str, float]) -> None:
        """The groups were regrouped: each name now stands for other parameters, so what
        the controller knew of a group (its calm readings, its cooling, its noise and the
        gain measured at its raise) is forgotten, and the groups start at ``scales``."""
        self.scales = dict(scales)
        for known in (self._calm, self._cooling, self._seen, self._gain):
            known.clear()

    def rest(self, steps: int) -> None:
        """``steps`` steps passed with no compressed group to steer or count (see :attr:`idle`)."""
        self.idle += steps

    @property
    def clock(self) -> int:
        """The steps accounted so far, compressed or not: the step the next decision counts from."""
        return self.steps + self.idle

    def _affordable(self, weights, total, steps, group, wanted) -> bool:
        return self._within(weights, total, steps, {**self.scales, group: wanted})

    def allowed(self, base: float, per_step: float, every: int) -> float:
        """The bytes the run may have sent once the configured setting would have sent
        ``base``: ``base + (byte_budget − 1) · max(H, base)``, with ``H`` the bytes of the
        horizon's steps (or of ``front`` measurements') at ``per_step`` bytes a step.
        Before ``H`` the whole extra of the first ``H`` may be spent at once, where the lag is
        largest; from ``H`` on the run has sent at most ``byte_budget`` times the configured
        setting's bytes."""
        ahead = (self.horizon if self.horizon is not None else self.front * every) * per_step
        return base + (self.byte_budget - 1.0) * max(ahead, base)

    def _within(self, weights, total, steps, scales) -> bool:
        """Whether sending at ``scales`` for the next ``steps`` keeps the run within budget."""
        rate = sum(w * scales.get(g, 1.0) for g, w in weights.items())
        # the configured setting's bytes a step, averaged over the run so far (one step's
        # payloads vary: a threshold's selection, a density warm-up)
        per_step = self.base / self.steps if self.steps else total
        return self.spent + steps * rate <= self.allowed(self.base + steps * total, per_step, steps)

    @property
    def bytes_ratio(self) -> float:
        """Bytes sent so far over the configured setting's (1 before any decision)."""
        return self.spent / self.base if self.base else 1.0

    def state_dict(self) -> Dict[str, Any]:
        return {"scales": dict(self.scales), "calm": dict(self._calm), "spent": self.spent, "base": self.base,
                "steps": self.steps, "idle": self.idle, "cooling": dict(self._cooling), "started": self.started,
                "warm": list(self._warm),
                "seen": {g: list(pair) for g, pair in self._seen.items()},
                "gain": {g: [[scale, gain] for scale, gain in gains.items()] for g, gains in self._gain.items()},
                "history": [[step, dict(scales)] for step, scales in self.history]}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.scales = {str(g): float(s) for g, s in dict(state.get("scales", {})).items()}
        self._calm = {str(g): int(c) for g, c in dict(state.get("calm", {})).items()}
        self.spent, self.base = float(state.get("spent", 0.0)), float(state.get("base", 0.0))
        self.steps = int(state.get("steps", 0))
        self.idle = int(state.get("idle", 0))
        self._cooling = {str(g): int(c) for g, c in dict(state.get("cooling", {})).items()}
        # a state from before the warm start: started once it had decided anything
        self.started = bool(state.get("started", self.steps > 0))
        self._warm = [str(g) for g in state.get("warm", [])]
        self._seen = {str(g): (float(scale), float(noise)) for g, (scale, noise) in dict(state.get("seen", {})).items()}
        self._gain = {str(g): {float(scale): float(gain) for scale, gain in gains}
                      for g, gains in dict(state.get("gain", {})).items()}
        self.history = [(int(step), {str(g): float(s) for g, s in dict(scales).items()})
                        for step, scales in state.get("history", [])]

    def __repr__(self) -> str:
        thresholds = ("raise_above='auto', lower_below='auto'" if self.auto_thresholds
                      else f"raise_above={self.raise_above:g}, lower_below={self.lower_below:g}")
        return (f"DriftController({thresholds}, "
                f"byte_budget={self.byte_budget:g}, max_scale={self.max_scale:g}, patience={self.patience}, "
                f"horizon={self.horizon}, front={self.front}, every={self.every}"
                + (f", start_scale={self.start_scale:g})" if self.start_scale != 1.0 else ")"))
