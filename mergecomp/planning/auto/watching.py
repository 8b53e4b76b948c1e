"""Phase 3 of the ``auto`` scheduler: run the chosen plan, watch for drift.

Every ``watch_every`` steps the median step time (the slowest rank's) is compared with
what the chosen plan measured in the check; after two windows in a row more than
``drift`` slower, the search starts again from the profile.  Windows close by step count,
never by valid samples, so every rank calls the window's allgather at the same step even
when some steps were not timed (None: the first step, or one after
``restart_step_clock()``).  The median ignores one slow step (an evaluation or a
checkpoint the caller did not announce).

The quality controller (:mod:`mergecomp.runtime.drift`) changes how much the compressed
groups send; a step at twice the density is slower for a reason the plan did not cause, and
another search would not undo it (it prices plans at the density in force).  So when the
context's density scale changes, the window in progress is not judged, and the next one's
median becomes the reference the later windows are compared with.
"""
from __future__ import annotations

import statistics
from typing import List, Optional

from ...distributed.backends.expect import NUMBER, optional
from ...plan import CannotRegroup
from . import decisions
from .phase import Phase, Search


class Watching(Phase):
    """The chosen plan runs; two slow windows in a row start a new search."""

    name = "watch"
    settled = True

    def __init__(self, search: Search):
        super().__init__(search)
        self.samples: List[Optional[float]] = []
        self.strikes = 0
        #: The density scale the reference step time was measured at (None: not yet read),
        #: and that reference when it is not the check's (after the scale changed).
        self.scale: Optional[float] = None
        self.reference: Optional[float] = None
        self.rebasing = False

    def after_step(self, context, seconds) -> Phase:
        best = self.search.findings.best
        if best is None:  # no candidate could be measured: nothing to compare with
            return self
        scale = context.density_scale
        if self.scale is None:
            self.scale = scale
        self.samples.append(seconds)
        if len(self.samples) < self.search.settings.watch_every:
            return self
        timed = [s for s in self.samples if s is not None]
        self.samples = []
        median = decisions.slowest_typical_step(
            context.backend.allgather_object(statistics.median(timed) if timed else None,
                                             expect=optional(NUMBER)))
        if scale != self.scale:  # the controller changed the density: the next window is the reference
            self.scale, self.rebasing, self.strikes = scale, True, 0
            return self
        if median is None:
            return self
        if self.rebasing:
            self.reference, self.rebasing = median, False
            return self
        reference = self.reference if self.reference is not None else best[2]
        self.strikes = self.strikes + 1 if decisions.drifted(median, reference, self.search.settings.drift) else 0
        if self.strikes < 2:
            return self
        try:
            following = self.search.profile(context)
        except CannotRegroup as reason:
            self.search.say(f"auto scheduler: steps drifted but the plan cannot change ({reason})")
            self.strikes = 0
            return self
        self.search.say(f"auto scheduler: steps take {median * 1e3:.1f} ms against {reference * 1e3:.1f} ms "
                        "measured for the chosen plan; profiling again")
        return following
