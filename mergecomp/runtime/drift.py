"""How far the compressed exchange has drifted from dense training: the measure, the meter
the step lifecycle drives, and the warnings.

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
holds nothing back.  For one whose error is noise around the gradient (QSGD, TernGrad,
unbiased rand-k, ATOMO, with the ``none`` memory) the reading is its *noise* instead (``kind="noise"``): the same ratio with the
compression's error this step, ``C(g) − g``, in place of what is held (one decode of the
rank's own payload per measured group).  Its meaning differs (a relative error, not steps
behind), so it is logged apart (the step log's ``noise``) and steered and warned about by
thresholds of its own, measured against dense's quality
(:data:`~mergecomp.runtime.controller.NOISE_THRESHOLDS`).

**The controller** (:mod:`mergecomp.runtime.controller`) steers each group by the lag (or the noise).
"""
from __future__ import annotations

import math
import warnings
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from ..compressors.base import squared_norm
from ..momentum import is_adam
# the controller's input and the controller itself (drift_meter builds it); both also imported from here
from ..plan import is_compressed
from .controller import NOISE_THRESHOLDS, DriftController, DriftReading


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


def lag_warns(optimizer) -> bool:
    """Whether a high lag is warned about under ``optimizer`` (None: not known, yes).  Not
    under an Adam or AdamW: the threshold was measured under SGD, and under AdamW runs whose
    memory takes the first moment over beat dense at lags far above it while others missed
    dense at lags below it (docs/results.md#adamw-topk-default), so the lag says nothing
    there about the quality it would warn of.  It is still measured, logged and steered by."""
    return optimizer is None or not is_adam(optimizer)


def lag_misleads(memory) -> bool:
    """Whether ``memory``'s lag says nothing about the quality it would warn of: while it
    folds the optimizer's momentum (EF-SignSGD's, 1-bit SGD's and TBQ's memory until the
    loop clips, rand-k's for the run).  Measured under SGD, such runs held back far more
    than the threshold's steps of update, and nearly all reached dense's validation loss
    within 2% all the same; the one that missed did so at a lag like that of the runs that
    reached it (docs/results.md#warning-precision).  It is still measured, logged and
    steered by."""
    return bool(getattr(memory, "folding", False))


#: A lag (steps of update held back) that, measured ``WARN_AFTER`` times in a row with nothing
#: steering it (or the controller held at its budget), is warned about: every run with error
#: feedback measured here that missed dense's quality by more than 2% passed it, and so did
#: many that reached it (docs/results.md#warning-precision).
WARN_ABOVE = 1.5
WARN_AFTER = 3
#: The same for a noise reading (each rank's compression error over its gradient's norm,
#: for an unbiased compressor without error feedback), under any optimizer
#: (docs/results.md#noise-threshold).
NOISE_WARN_ABOVE = NOISE_THRESHOLDS[0]


def raisable(compressor, memory) -> bool:
    """Whether the controller may steer ``compressor`` paired with ``memory`` now: it has a
    :attr:`~mergecomp.compressors.base.Compressor.knob`, and does not refuse the pairing
    (a compressor's ``raisable_with(memory)``, e.g. the low-bit compressors' while their
    memory folds the momentum: :mod:`mergecomp.compressors.raisedbits`)."""
    if getattr(compressor, "knob", None) is None:
        return False
    refuses = getattr(compressor, "raisable_with", None)
    return True if refuses is None else bool(refuses(memory))


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
        self._compressor = self._memory = None
        self._kind = "lag"  # what the last step's terms measured (DriftTerms.drift_kind)
        self._numels: Dict[str, int] = {}
        self._sent: Dict[str, int] = {}  # each measured group's payload bytes, the same on every rank
        #: The measured step's groups that went through the compressor: the controller steers
        #: and counts only those (a raw group's bytes are not the configured setting's).
        self._steered: List[str] = []
        self._high = 0  # measurements in a row above WARN_ABOVE with nothing steering the lag
        self.warned = False
        #: Whether a high lag is warned about (see :func:`lag_warns`; the entry point sets it
        #: from the optimizer it vets).
        self.warns = True

    def follow_optimizer(self, optimizer, memory=None) -> None:
        """What depends on the optimizer the entry point vets (and the memory, vetted by it
        first): whether a high lag is warned about (:func:`lag_warns`) and the controller's
        ``"auto"`` thresholds."""
        self.warns = lag_warns(optimizer)
        if self.controller is not None:
            self.controller.follow_optimizer(optimizer, memory)

    def start(self, step_count: int, compressor, memory) -> bool:
        """At a step's beginning: whether it is measured; if so the components note their terms."""
        if step_count % self.every:
            return False
        self._components = (memory, compressor)
        self._compressor, self._memory = compressor, memory
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
        self._steered = [flight.name for flight in flights if flight.name in names and is_compressed(flight.send)]
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
        steering = self.controller is not None and raisable(compressor, self._memory)
        if steering:
            # the steps sent at the scales now in force: those since the last decision (the
            # controller's count of steps, saved with it, so a resumed run counts the same)
            since = max(1, step + 1 - self.controller.clock)
            steered = {name: groups[name] for name in self._steered}
            if not steered:  # every group went raw (a profile): nothing to steer, nothing spent
                self.controller.rest(since)
            else:
                weights = {name: self._bytes_at_scale_one(name) for name in steered}
                reading = DriftReading(step, whole, steered, self._kind)
                for group, scale in self.controller.decide(reading, weights, since, self.every).items():
                    compressor.set_group_scale(group, scale)
            # steering, but held at the budget while the lag stays high: a larger budget would help
            held = self.controller.starved and whole > self.warn_above and self.controller.steps > self._front()
            self._high = self._high + 1 if held else 0
        else:
            self._high = self._high + 1 if whole > self.warn_above else 0
        # the exemptions are the lag's: under an Adam (lag_warns) and while the memory folds
        # the optimizer's momentum (lag_misleads)
        warns = (self.warns and not lag_misleads(self._memory)) or self._kind == "noise"
        if self._high >= WARN_AFTER and not self.warned and warns:
            self.warned = True
            self._warn(compressor, steering)
        return self.reading

    @property
    def warn_above(self) -> float:
        """The reading above which the run is warned about: :data:`WARN_ABOVE` for a lag,
        :data:`NOISE_WARN_ABOVE` for a noise."""
        return NOISE_WARN_ABOVE if self._kind == "noise" else WARN_ABOVE

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
                    "raises the density, rank or bits of the groups that lag, within a byte budget")
        elif getattr(compressor, "knob", None) is not None:
            what = (f"{type(compressor).__name__}'s {compressor.knob} are not raised with its memory "
                    f"({type(self._memory).__name__}: the compressor's raisable_with refuses it), so a "
                    f"less lossy compressor would bring the run closer to dense")
        else:
            what = (f"{type(compressor).__name__} has no density, rank or bits the controller could raise: "
                    "use a compressor that has one (topk, dgc, powersgd, efsignsgd, ...) or a less lossy setting")
        warnings.warn(
            f"mergecomp: at step {self.reading.step} {self.reading.describe()} for the last {WARN_AFTER} "
            f"measurements, above {self._threshold_said()}; {what}.",
            RuntimeWarning, stacklevel=2)

    def _threshold_said(self) -> str:
        """The threshold passed, in words, with what it meant in the runs measured here and
        the page that measured it."""
        if self._kind == "noise":
            return (f"the noise of {NOISE_WARN_ABOVE:g} times the gradient's norm at which runs measured here "
                    f"missed dense's validation loss by more than 2% (docs/results.md#noise-threshold)")
        return (f"the {WARN_ABOVE:g} steps passed by every run with error feedback measured here that "
                f"missed dense's validation loss by more than 2%, and by many that reached it "
                f"(docs/results.md#warning-precision)")

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
        self.controller.regrouped({name: carried for name in names} if carried > 1.0 else {})
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


def _squared_sum(buffers: Sequence[torch.Tensor]) -> torch.Tensor:
    """Σ‖b‖² over ``buffers``, a 0-d float tensor on their device (a CPU zero for none)."""
    total = torch.zeros((), dtype=torch.float32, device=buffers[0].device if buffers else None)
    for buffer in buffers:
        total = total + squared_norm(buffer).to(total.dtype)
    return total


class ClipWatch:
    """Notices a training loop that clips the averaged gradient after the exchange, where
    the compressor's recipe asks for each rank's gradient to be clipped before its error
    feedback (top-k, DGC, GradDrop: :attr:`Recipe.local_clipping`), and says so once.

    On a measured step the averages' squared norm is noted when they are handed to the
    parameters (:meth:`note`); at ``step()`` it is read again (:meth:`changed`).  A norm that
    fell by a factor that is not a power of two was clipped (or rescaled) in between: a
    power of two is AMP's ``GradScaler`` unscaling, which is no clipping.  Two passes over the
    compressed groups' averages, on measured steps only, and on every one of the first
    :attr:`every_step_for` steps while a memory that follows the loop's clipping waits for its
    threshold (a loop that clips does so from its first steps, where gradients are largest; a
    loop that starts later is seen at a measured step, and one that never clips costs no more
    than the measure); once a memory follows it, on every step (the wrapper undoes the loop's
    clip at that threshold on its groups: :mod:`mergecomp.memories.loopclip`).
    """

    #: Steps from the first in which every step is watched while a threshold is awaited.
    every_step_for = 100

    def __init__(self, total: Optional[Callable[[torch.Tensor], torch.Tensor]] = None):
        #: Sums a tensor over the ranks that hold different shards of the averages (FSDP2:
        #: each rank reads its own shard, and the loop clips by the whole gradient's norm);
        #: None where every rank holds all of them.
        self.total = total
        self._buffers: List[torch.Tensor] = []
        self._noted: Optional[torch.Tensor] = None
        self.warned = False
        #: The norm the loop clipped the averages to, the last time it was seen clipping: its
        #: threshold, when it clips every gradient the exchange delivered (as
        #: ``clip_grad_norm_(model.parameters(), ...)`` does).  Every rank reads the same.
        self.threshold: Optional[float] = None

    def note(self, buffers: Sequence[torch.Tensor]) -> None:
        """The averages every group handed to the parameters (``buffers``), before the loop
        sees them."""
        self._buffers = list(buffers)
        self._noted = _squared_sum(self._buffers) if self._buffers or self.total is not None else None

    def changed(self, loss_scale: float = 1.0, buffers: Optional[Sequence[torch.Tensor]] = None) -> Optional[float]:
        """The averages' norm now over when noted, times ``loss_scale`` (the loss scale of a
        ``GradScaler`` known to have unscaled them in between: its unscaling is taken out),
        or None (nothing noted, or unchanged); a clip sets :attr:`threshold`.  ``buffers``:
        where the averages are now, when not where they were noted (DDP copies them into
        ``p.grad``)."""
        if self._noted is None:
            return None
        noted, self._noted = self._noted, None
        now = _squared_sum(self._buffers if buffers is None else buffers)
        self._buffers = []
        if self.total is not None:  # one small collective on every rank: the shards' sums
            noted, now = self.total(torch.stack([noted, now.to(noted.device)]).double()).tolist()
        before, now = float(noted), float(now)
        if not (before > 0.0 and math.isfinite(before) and math.isfinite(now)):
            return None
        ratio = math.sqrt(now / before) * loss_scale
        exponent = math.log2(ratio) if ratio > 0 else 0.0
        if ratio > 0.99 or abs(exponent - round(exponent)) < 1e-6:
            return None
        self.threshold = math.sqrt(now)
        return ratio

    def advise(self, compressor, memory, ratio: float) -> Optional[str]:
        """The warning for a clip seen after the exchange (None when the recipe does not mind,
        or when the memory follows the loop's clipping: it then clips as the recipe asks, and
        the loop's clip is undone, :mod:`mergecomp.memories.loopclip`)."""
        recipe = getattr(compressor, "recipe", None)
        if self.warned or recipe is None or not getattr(recipe, "local_clipping", False) \
                or getattr(memory, "clip_norm", None) is not None or memory.follows_loop_clip:
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
