"""How far the compressed exchange has drifted from dense training, and a controller that
steers each group by it.

**The measure.**  With error feedback, what every step's exchange fails to send is kept and
added to the next step, so after t steps the updates the model has received differ from
what dense training would have applied by exactly what the memory holds: the residual (a
DGC memory's velocity; PowerSGD's error).  So the lag of group g is

    lag_g = ‖held_g‖ / ‖incoming_g‖

where ``held`` is what the group holds back once the step has been compressed and
``incoming`` is the update dense training would have applied this step (the gradient, or the
momentum where the memory applies it before the exchange): the model is ``lag`` steps of
update behind dense in that group.  Each rank measures its own (one read pass over each
residual and each incoming update, on the steps measured: every ``every`` steps), and the
squared norms travel in the step's outcome allreduce, which runs anyway: no collective of
its own, and every rank reads the same sums, ``lag_g = √(Σ_r held² / Σ_r incoming²)``.  The
whole model's lag is the same ratio over every group.  A compressor without error feedback
holds nothing back.  For an unbiased one (QSGD, unclipped TernGrad, unbiased rand-k, with
the ``none`` memory) the reading is its *noise* instead (``kind="noise"``): the same ratio with the
compression's error this step, ``C(g) − g``, in place of what is held (one decode of the
rank's own payload per measured group).  Its meaning differs (a relative error, not steps
behind), so it is logged apart (the step log's ``noise``), neither steered nor warned about:
no threshold for it has been measured against dense's quality.

**The controller.**  :class:`DriftController` raises a group's density (a sparsifier's share
of coordinates) or rank (a low-rank factorisation's) when its lag passes ``raise_above``,
doubling it, and lowers it again once the lag has stayed under ``lower_below`` for
``patience`` measurements, within a byte budget: over the run, the bytes the compressed
groups send may be at most ``byte_budget`` times what they would at the configured setting.
Compressing less where the exchange lags is what Accordion (Agarwal et al., MLSys 2021)
does in the regimes it detects from the gradient norm's rate of change, and what DGC's
warm-up does on a fixed schedule; here the lag itself is the signal, per group.  Its
decisions come from the agreed sums and its own state, at fixed steps, so every rank takes
the same ones; its state is saved with the step lifecycle's, so a resumed run decides as
the first would have.  A scale only changes how many coordinates (or columns) a group sends,
never a compiled path: the group's shapes change at most once per decision.
"""
from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import torch

from ..compressors.base import squared_norm


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


def lags(names: Sequence[str], sums: torch.Tensor) -> Tuple[float, Dict[str, float]]:
    """(whole-model lag, {group: lag}) from the sums over ranks of (held², incoming²) per
    group, in ``names``' order (``sums``: 2 numbers per group)."""
    values = sums.double().tolist()
    held, incoming = values[0::2], values[1::2]
    groups = {name: _ratio(h, i) for name, h, i in zip(names, held, incoming)}
    return _ratio(sum(held), sum(incoming)), groups


def _ratio(held: float, incoming: float) -> float:
    if not (math.isfinite(held) and math.isfinite(incoming)):
        return math.inf
    if incoming <= 0.0:
        return 0.0 if held <= 0.0 else math.inf
    return math.sqrt(held / incoming)


#: A lag (steps of update held back) that, measured ``WARN_AFTER`` times in a row with nothing
#: steering it, says the run will miss dense's quality (docs/results.md#quality-control).
WARN_ABOVE = 1.5
WARN_AFTER = 3


class DriftMeter:
    """The step lifecycle's side of the measure: which steps are measured (every ``every``
    steps of the lifecycle's agreed count), the terms the components noted for each
    compressed group, and the reading, which it hands to ``controller`` (if any)."""

    def __init__(self, every: int = 10, controller: Optional["DriftController"] = None):
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(f"the drift is measured every `every` steps: a whole number ≥ 1, got {every!r}")
        self.every = every
        self.controller = controller
        #: The latest reading (None before the first measured step).
        self.reading: Optional[DriftReading] = None
        self._components: Tuple[Any, ...] = ()
        self._compressor = None
        self._kind = "lag"  # what the last step's terms measured (DriftTerms.drift_kind)
        self._numels: Dict[str, int] = {}
        self._sent: Dict[str, int] = {}  # each measured group's payload bytes, the same on every rank
        self._high = 0  # measurements in a row above WARN_ABOVE with nothing steering the lag
        self.warned = False

    def start(self, step_count: int, compressor, memory) -> bool:
        """At a step's beginning: whether it is measured; if so the components note their terms."""
        if step_count % self.every:
            return False
        self._components = (memory, compressor)
        self._compressor = compressor
        for component in self._components:
            component.measuring = True
        return True

    def _bytes_at_scale_one(self, name: str) -> float:
        """Group ``name``'s payload bytes this step over its scale: what the configured
        setting sends now (a compressor that does not say, e.g. one exchanging in rounds,
        counts its elements: the groups' shares are then by size)."""
        sent = self._sent.get(name)
        if not sent:
            return 4.0 * self._numels.get(name, 0)
        scale = self.controller.scales.get(name, 1.0) if self.controller is not None else 1.0
        return sent / scale

    def terms(self, flights) -> Tuple[List[str], Optional[torch.Tensor]]:
        """(group names, one float32 vector) of the step's compressed groups that hold
        something back, in launch order (the same on every rank): their (held², incoming²)
        pairs, then each one's payload bytes (summed over ranks with the rest, so that the
        byte budget counts what every rank agrees on, even where payload sizes differ)."""
        names, values, sent, kinds = [], [], [], set()
        for flight in flights:
            found = None
            for component in self._components:
                found = component.drift_terms(flight.name)
                if found is not None:
                    kinds.add(getattr(component, "drift_kind", "lag"))
                    break
            if found is not None:
                names.append(flight.name)
                values.extend(found)
                self._numels[flight.name] = flight.numel
                sent.append(float(self._components[0].drift_sent(flight.name)))
        # one memory and one compressor per run: the groups measure one kind (a mix, which
        # no built-in pairing makes, is read as a lag, the kind the controller acts on)
        self._kind = "noise" if kinds == {"noise"} else "lag"
        if not values:
            return names, None
        device = values[0].device
        return names, torch.cat([torch.stack([v.to(device) for v in values]),
                                 torch.tensor(sent, dtype=torch.float32, device=device)])

    def read(self, step: int, names: Sequence[str], sums: torch.Tensor) -> DriftReading:
        """The reading from the sums over ranks (every rank the same); the controller, if
        any, decides from it."""
        pairs = 2 * len(names)
        whole, groups = lags(names, sums[:pairs])
        self._sent = dict(zip(names, sums[pairs:].double().tolist()))
        self.reading = DriftReading(step, whole, groups, self._kind)
        compressor = self._compressor
        if self._kind == "noise":  # measured and logged; no threshold to steer or warn by
            return self.reading
        steering = self.controller is not None and getattr(compressor, "knob", None) is not None
        if steering:
            weights = {name: self._bytes_at_scale_one(name) for name in names}
            # the steps sent at the scales now in force: those since the last decision (the
            # controller's count of steps, saved with it, so a resumed run counts the same)
            since = max(1, step + 1 - self.controller.steps)
            for group, scale in self.controller.decide(self.reading, weights, since, self.every).items():
                compressor.set_group_scale(group, scale)
            # steering, but held at the budget while the lag stays high: a larger budget would help
            held = self.controller.starved and whole > WARN_ABOVE and self.controller.steps > self._front()
            self._high = self._high + 1 if held else 0
        else:
            self._high = self._high + 1 if whole > WARN_ABOVE else 0
        if self._high >= WARN_AFTER and not self.warned:
            self.warned = True
            self._warn(compressor, steering)
        return self.reading

    def _front(self) -> int:
        """The steps over which the controller may spend ahead of its budget's pace."""
        controller = self.controller
        return controller.horizon if controller.horizon is not None else controller.front * self.every

    def _warn(self, compressor, steering: bool = False) -> None:
        """Once per run (the same decision on every rank; rank 0 says it): the lag says the
        run will miss dense, and nothing steers it (or the controller is held at its budget)."""
        if getattr(compressor, "process_rank", 0) != 0:
            return
        if steering:
            what = (f"the quality controller is held at its byte budget ({self.controller.byte_budget:g}× the "
                    f"configured setting's bytes, {self.controller.bytes_ratio:.2g}× spent so far): a larger "
                    f"budget, mergecomp.DriftController(byte_budget=...), or a denser setting would bring the "
                    f"run closer to dense")
        elif self.controller is None:
            what = ("the quality controller is off: turn it on (controller='auto', the default), which "
                    "raises the density or rank of the groups that lag, within a byte budget")
        else:
            what = (f"{type(compressor).__name__} has no density or rank the controller could raise: "
                    "use a compressor that has one (topk, dgc, powersgd, ...) or a less lossy setting")
        warnings.warn(
            f"mergecomp: at step {self.reading.step} {self.reading.describe()} for the last {WARN_AFTER} "
            f"measurements, above the {WARN_ABOVE:g} steps at which runs measured here missed dense's "
            f"validation loss by more than 2% (docs/results.md#quality-control); {what}.",
            RuntimeWarning, stacklevel=2)

    def density_scale(self) -> float:
        """The compressed groups' scale now, weighted by their elements (1: the configured
        setting)."""
        if self.controller is None or not self._numels:
            return 1.0
        total = sum(self._numels.values())
        return sum(n * self.controller.scales.get(g, 1.0) for g, n in self._numels.items()) / total

    def regrouped(self, compressor, names: Sequence[str] = ()) -> None:
        """The groups were regrouped (a new plan, priced at the scales now in force): a
        group's name now stands for other parameters, so each new group in ``names`` starts
        at the scale the old groups sent at overall (rounded down to a power of two), and
        the controller steers each from there (the budget spent so far stays spent)."""
        if self.controller is None:
            return
        overall = self.density_scale()
        carried = 2.0 ** math.floor(math.log2(overall)) if overall > 1.0 else 1.0
        self.controller.scales = {name: carried for name in names} if carried > 1.0 else {}
        self.controller._calm.clear()
        self.controller._cooling.clear()
        self._numels.clear()
        self._sent.clear()
        self.apply(compressor)

    def apply(self, compressor) -> None:
        """Set ``compressor``'s group scales to the controller's (after its state was loaded)."""
        if self.controller is None or getattr(compressor, "knob", None) is None:
            return
        for group in list(getattr(compressor, "_group_scales", {})):
            compressor.set_group_scale(group, 1.0)
        for group, scale in self.controller.scales.items():
            compressor.set_group_scale(group, scale)

    def stop(self) -> None:
        """At a step's end (or its abort): the components forget their terms."""
        for component in self._components:
            component.measuring = False
            component.forget_drift()
        self._components = ()


class DriftController:
    """Raises a group's density (or rank) where the exchange lags dense, lowers it where it
    does not, within a byte budget (see the module docstring).

    Args:
        raise_above: a group whose lag (steps of update held back) passes this is sent at
            twice its scale, up to ``max_scale``.
        lower_below: a group whose lag stayed under this for ``patience`` measurements in a
            row is sent at half its scale, down to 1 (the configured setting).
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

    def __init__(self, raise_above: float = 1.5, lower_below: float = 0.5, byte_budget: float = 2.0,
                 max_scale: float = 16.0, patience: int = 3, horizon: Optional[int] = None, front: int = 10,
                 every: int = 10, start_scale: Optional[float] = 1.0):
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
        self.starved = False
        #: Decisions left before a group that gave back for the budget may be raised again.
        self._cooling: Dict[str, int] = {}
        #: (step, {group: scale}) after every decision that changed a scale.
        self.history: List[Tuple[int, Dict[str, float]]] = []
        #: Whether the first decision (which starts the groups at ``start_scale``) was taken.
        self.started = False
        #: The groups the warm start raised, until the decision that ends it.
        self._warm: List[str] = []

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
        for group, lag in sorted(reading.groups.items(), key=lambda kv: -kv[1]):
            if warm_start:
                break
            scale = self.scales.get(group, 1.0)
            if lag > self.raise_above and scale < self.max_scale:
                wanted = min(self.max_scale, 2 * scale)
                if group not in self._cooling and self._affordable(weights, total, steps, group, wanted):
                    changed[group] = wanted
                else:
                    self.starved = True
                self._calm[group] = 0
            elif lag < self.lower_below:
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
                "steps": self.steps, "cooling": dict(self._cooling), "started": self.started,
                "warm": list(self._warm),
                "history": [[step, dict(scales)] for step, scales in self.history]}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.scales = {str(g): float(s) for g, s in dict(state.get("scales", {})).items()}
        self._calm = {str(g): int(c) for g, c in dict(state.get("calm", {})).items()}
        self.spent, self.base = float(state.get("spent", 0.0)), float(state.get("base", 0.0))
        self.steps = int(state.get("steps", 0))
        self._cooling = {str(g): int(c) for g, c in dict(state.get("cooling", {})).items()}
        # a state from before the warm start: started once it had decided anything
        self.started = bool(state.get("started", self.steps > 0))
        self._warm = [str(g) for g in state.get("warm", [])]
        self.history = [(int(step), {str(g): float(s) for g, s in dict(scales).items()})
                        for step, scales in state.get("history", [])]

    def __repr__(self) -> str:
        return (f"DriftController(raise_above={self.raise_above:g}, lower_below={self.lower_below:g}, "
                f"byte_budget={self.byte_budget:g}, max_scale={self.max_scale:g}, patience={self.patience}, "
                f"horizon={self.horizon}, front={self.front}, every={self.every}"
                + (f", start_scale={self.start_scale:g})" if self.start_scale != 1.0 else ")"))


#: How often the drift is measured when the controller is off (for the step log and warnings).
MEASURE_EVERY = 10


def drift_meter(controller) -> DriftMeter:
    """The meter an entry point's ``controller`` argument asks for: ``"auto"`` (the default)
    steers with :class:`DriftController`'s defaults; ``"off"`` (or None) only measures;
    a :class:`DriftController` steers with its own settings."""
    if controller == "auto":
        controller = DriftController()
    elif controller is None or controller == "off":
        return DriftMeter(MEASURE_EVERY, None)
    if not isinstance(controller, DriftController):
        raise TypeError(f"controller must be 'auto' (on, the default), 'off', or a mergecomp.DriftController, "
                        f"got {controller!r}")
    return DriftMeter(controller.every, controller)


class ClipWatch:
    """Notices a training loop that clips the averaged gradient after the exchange, where
    the compressor's recipe asks for each rank's gradient to be clipped before its error
    feedback (top-k, DGC, GradDrop: :attr:`Recipe.local_clipping`), and says so once.

    On a measured step the averages' squared norm is noted when they are handed to the
    parameters (:meth:`note`); at ``step()`` it is read again (:meth:`changed`).  A norm that
    fell by a factor that is not a power of two was clipped (or rescaled) in between: a
    power of two is AMP's ``GradScaler`` unscaling, which is no clipping.  Two passes over the
    compressed groups' averages, on measured steps only.
    """

    def __init__(self):
        self._buffers: List[torch.Tensor] = []
        self._noted: Optional[torch.Tensor] = None
        self.warned = False

    def note(self, buffers: Sequence[torch.Tensor]) -> None:
        self._buffers = list(buffers)
        self._noted = sum((squared_norm(b) for b in self._buffers), torch.zeros(())) if self._buffers else None

    def changed(self) -> Optional[float]:
        """The averages' norm now over when noted (None: nothing noted, or unchanged)."""
        if self._noted is None:
            return None
        before, self._noted = float(self._noted), None
        now = float(sum((squared_norm(b) for b in self._buffers), torch.zeros(())))
        self._buffers = []
        if not (before > 0.0 and math.isfinite(before) and math.isfinite(now)):
            return None
        ratio = math.sqrt(now / before)
        exponent = math.log2(ratio) if ratio > 0 else 0.0
        if ratio > 0.99 or abs(exponent - round(exponent)) < 1e-6:
            return None
        return ratio

    def advise(self, compressor, memory, ratio: float) -> Optional[str]:
        """The warning for a clip seen after the exchange (None when the recipe does not mind)."""
        recipe = getattr(compressor, "recipe", None)
        if self.warned or recipe is None or not getattr(recipe, "local_clipping", False) \
                or getattr(memory, "clip_norm", None) is not None:
            return None
        self.warned = True
        follows = getattr(memory, "follows_optimizer", False)
        memory_call = (f"mergecomp.memories.create('{getattr(memory, 'name', 'residual')}', clip_norm=YOUR_CLIP / √ranks"
                       + (", momentum='optimizer')" if follows else ")"))
        return (f"mergecomp: the averaged gradient's norm fell to {ratio:.3g} of what the exchange "
                f"delivered between backward and step(): the loop clips (or rescales) it after the "
                f"exchange, and {type(compressor).__name__}'s recipe asks for each rank's gradient to be "
                f"clipped before its error feedback instead ({recipe.reason}). Clip there, with "
                f"memory={memory_call}, and remove the clipping after backward.")
