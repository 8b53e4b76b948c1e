"""A sparsifier's density warm-up: dense early, the configured density later.

Lin et al., "Deep Gradient Compression", ICLR 2018, section 3.3: sparse updates early in
training, while the weights change fast, cost accuracy, so the density decays
exponentially from 25% to the configured one over the first epochs (25% → 6.25% →
1.5625% → 0.4% → 0.1% over four epochs at 0.1%).  The schedule follows the epochs the
training loop reports (``set_epoch``) or, for a run that is not epoch-based, the steps
the compressor completes (``warmup_steps``).  What is sent per step changes, never how.
"""
from __future__ import annotations

from typing import Optional, Sequence

from .base import check_ratio, constructor_arguments
from .recipes import first_rank_of_job, warn
from ..momentum import is_adam, is_adam_kind

#: The paper's warm-up: density 25% → 6.25% → 1.5625% → 0.4% → 0.1% over the first epochs.
PAPER_WARMUP = (0.25, 0.0625, 0.015625, 0.004)
#: ``warmup="auto"``: the warm-up, in epochs, under an Adam or AdamW (the paper's four); none otherwise.
ADAM_WARMUP_EPOCHS = 4
#: The step-counted warm-up that the warning without epochs advises, as a share of the run's
#: steps (why a fifth: docs/results.md#lm-topk-lag).
WARMUP_FRACTION_ADVICE = 0.2


#: Under an Adam or AdamW, how many of each group's first exchanges go raised by default
#: (PowerSGD's and rand-k's ``warmup_steps``), and how many times their rank or density.
ADAM_WARMUP_STEPS = 10
ADAM_WARMUP_SCALE = 16


def _is_step_count(value) -> bool:
    """Whether ``value`` is a whole number of steps ≥ 0 (an int, not a bool)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def check_adam_warmup_steps(warmup_steps, who: str) -> int:
    """``warmup_steps`` of :class:`RaisedFirstExchanges` as an int ≥ 0; ValueError naming ``who``."""
    if not _is_step_count(warmup_steps):
        raise ValueError(f"{who} warmup_steps must be a whole number of steps ≥ 0 (0: none), "
                         f"got {warmup_steps!r}")
    return warmup_steps


class RaisedFirstExchanges:
    """Mixin of the compressors whose first exchanges under an Adam or AdamW go raised:
    each group's first ``warmup_steps`` exchanges at :data:`ADAM_WARMUP_SCALE` times its
    rank or density (capped by what the group has), then as configured.  The class keeps
    ``_steps`` (group → exchanges sent, staged with the step, so a dropped step does not
    count) and sets :attr:`under_adam` when it vets the optimizer.  Each class's docstring
    says why it needs the warm-up."""

    warmup_steps = 0
    #: Whether the optimizer it was checked against is an Adam or AdamW (β1 of any value).
    under_adam = False

    def note_optimizer(self, optimizer) -> None:
        """Whether the warm-up runs: under an Adam or AdamW, whatever its β1 (an error
        feedback takes β1 off, and the warm-up is for the second moment's sake)."""
        self.under_adam = is_adam_kind(optimizer)

    def warming_up(self, name: str) -> bool:
        """Whether group ``name`` is in its first exchanges, sent raised (``warmup_steps``)."""
        return self.under_adam and self._steps.get(name, 0) < self.warmup_steps

    def warmup_scale(self, name: str) -> int:
        """How many times its rank or density group ``name`` goes at for the warm-up now."""
        return ADAM_WARMUP_SCALE if self.warming_up(name) else 1


def check_warmup(warmup):
    """``warmup`` as a number of epochs (an int ≥ 0) or a tuple of densities; ValueError otherwise."""
    if isinstance(warmup, bool):
        raise ValueError(f"warmup must be a number of epochs or a list of densities, got {warmup!r}")
    if isinstance(warmup, int):
        if warmup < 0:
            raise ValueError(f"warmup epochs must be >= 0, got {warmup!r}")
        return warmup
    if isinstance(warmup, Sequence) and not isinstance(warmup, str):
        return tuple(check_ratio(r, f"warmup density for epoch {e}") for e, r in enumerate(warmup))
    raise ValueError(f"warmup must be a number of epochs or a list of densities "
                     f"(e.g. {list(PAPER_WARMUP)}), got {warmup!r}")


def check_warmup_steps(warmup_steps) -> int:
    """``warmup_steps`` as an int ≥ 0; ValueError otherwise."""
    if not _is_step_count(warmup_steps):
        raise ValueError(f"warmup_steps must be a non-negative integer (0: the warm-up follows "
                         f"the epochs), got {warmup_steps!r}")
    return warmup_steps


class DensityWarmup:
    """The warm-up schedule a sparsifier mixes in: :meth:`density` is the density to send
    now, ``compress_ratio`` once the warm-up is over.

    ``warmup`` is either a number of epochs W (the density decays exponentially from 25% to
    ``compress_ratio`` over W epochs) or an explicit list of densities for epochs 0, 1, ...;
    never below ``compress_ratio``; 0 turns it off.  It follows the epochs the training loop
    reports (``optimizer.set_epoch(epoch)``, the DDP hook state's ``set_epoch``).  Never told
    an epoch, the compressor sends at ``compress_ratio`` from the first step and warns once
    (on rank 0) that its warm-up is off.  ``warmup_steps=S`` measures the warm-up in steps
    instead: the density decays from 25% to ``compress_ratio`` over the first S steps this
    compressor completes (counted at each committed step, so a dropped step does not
    count), and the epochs no longer matter.  The epoch and the step count are the
    compressor's ``state_dict()``, so a resumed run keeps its density.

    ``warmup="auto"`` follows the optimizer (:meth:`check_optimizer`): the paper's four
    epochs under an Adam or AdamW, none under any other optimizer (or before one is
    vetted); ``repr`` then says ``warmup='auto'``, so a configuration's digest does not
    change when the optimizer is vetted (a hook state rebuilt from a pickle vets it later
    than the one it saved).

    The class using it sets ``compress_ratio`` and calls :meth:`_start_warmup` from its
    constructor and :meth:`_warn_if_warmup_off` plus ``self._compressed = True`` from
    ``compress()``.
    """

    compress_ratio: float

    def _start_warmup(self, warmup, warmup_steps: int) -> None:
        #: Whether the warm-up follows the optimizer (``"auto"``), resolved by :meth:`check_optimizer`.
        self._auto_warmup = isinstance(warmup, str) and warmup == "auto"
        self.warmup = 0 if self._auto_warmup else check_warmup(warmup)
        self.warmup_steps = check_warmup_steps(warmup_steps)
        self.steps = 0  # committed steps, for a warm-up in steps
        self._compressed = False  # compress() ran in the current step
        self.epoch: Optional[int] = None  # None until set_epoch: no warm-up
        self._warmup_checked = False  # the first compress() says whether the warm-up is off

    def check_optimizer(self, optimizer) -> None:
        """``warmup="auto"``: the paper's four epochs under an Adam or AdamW, none otherwise."""
        if self._auto_warmup:
            self.warmup = ADAM_WARMUP_EPOCHS if is_adam(optimizer) else 0

    def __repr__(self) -> str:
        arguments = [(name, "auto" if name == "warmup" and self._auto_warmup else value)
                     for name, value in constructor_arguments(self)]
        return f"{type(self).__name__}({', '.join(f'{k}={v!r}' for k, v in arguments)})"

    def set_epoch(self, epoch: int) -> None:
        """Tell the compressor the current epoch (0-based), which picks the warm-up density."""
        if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 0:
            raise ValueError(f"epoch must be a non-negative integer, got {epoch!r}")
        self.epoch = epoch

    def density(self, epoch: Optional[int] = None) -> float:
        """Fraction of elements sent in ``epoch`` (default: the current one; before any
        :meth:`set_epoch`, ``compress_ratio``)."""
        if self.warmup_steps and epoch is None:
            if self.steps >= self.warmup_steps:
                return self.compress_ratio
            return max(self.compress_ratio,
                       0.25 * (self.compress_ratio / 0.25) ** (self.steps / self.warmup_steps))
        epoch = self.epoch if epoch is None else epoch
        if epoch is None:
            return self.compress_ratio
        if isinstance(self.warmup, tuple):
            return self.warmup[epoch] if epoch < len(self.warmup) else self.compress_ratio
        if epoch >= self.warmup:
            return self.compress_ratio
        return max(self.compress_ratio, 0.25 * (self.compress_ratio / 0.25) ** (epoch / self.warmup))

    def commit(self) -> None:
        """A step that compressed is over and applied: it counts toward ``warmup_steps``."""
        if self._compressed:
            self.steps += 1
        self._compressed = False

    def rollback(self) -> None:
        self._compressed = False

    def warmup_is_off(self) -> bool:
        """Whether a warm-up was asked for (``warmup`` epochs or densities) but cannot run:
        no epoch has been set and no ``warmup_steps`` given, so it sends at
        ``compress_ratio`` from the first step."""
        asked = any(self.density(epoch) > self.compress_ratio for epoch in range(self._warmup_epochs()))
        return asked and self.epoch is None and not self.warmup_steps

    def _warmup_epochs(self) -> int:
        return self.warmup if isinstance(self.warmup, int) else len(self.warmup)

    def _warn_if_warmup_off(self) -> None:
        """Say once, at the first step, that the warm-up asked for is not happening: a loop
        without ``set_epoch`` (a step-counted run, a framework that does not report epochs)
        would otherwise lose the warm-up without a word.  Checked at the first step only, so
        later steps pay nothing for it; said on rank 0 only, since every rank would say it."""
        if self._warmup_checked:
            return
        self._warmup_checked = True
        if not self.warmup_is_off() or not first_rank_of_job():
            return
        epochs = self._warmup_epochs()
        warn(f"{self!r}: no epoch was set before its first step and warmup_steps=0, so its "
             f"density warm-up (down to {self.compress_ratio:g} over the first {epochs} "
             f"epochs) is off and it sends {self.compress_ratio:g} from the first step. Call "
             f"optimizer.set_epoch(epoch) (the DDP hook's state.set_epoch) at the start of every "
             f"epoch; for a run counted in steps, pass warmup_steps = {WARMUP_FRACTION_ADVICE:g} × "
             f"your run's steps (e.g. {round(WARMUP_FRACTION_ADVICE * 1500)} for 1,500); warmup=0 sends "
             f"{self.compress_ratio:g} from the start without this warning. Why: sparse updates "
             f"early in training, while the weights change fast, cost accuracy (Lin et al. 2018, "
             f"section 3.3)")

    def state_dict(self):
        return {"epoch": self.epoch, "steps": self.steps}

    def load_state_dict(self, state):
        name = type(self).__name__
        unknown = set(state) - {"epoch", "steps"}
        if unknown:
            raise ValueError(f"{name} state has unknown keys {sorted(unknown)}; "
                             f"expected 'epoch' and 'steps'")
        steps = state.get("steps", 0)
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
            raise ValueError(f"{name} state 'steps' must be a non-negative integer, got {steps!r}")
        if state.get("epoch") is not None:
            self.set_epoch(state["epoch"])
        self.steps = steps
        self._compressed = False
