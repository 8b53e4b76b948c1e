"""The ``auto`` scheduler: :class:`AutoScheduler` (in :mod:`.scheduler`) and its parts.

Read in this order:

* :mod:`.scheduler` — :class:`AutoScheduler`, registered as ``auto``: the phases in
  sequence, and what the search found;
* :mod:`.settings` — what a user can set, checked once;
* :mod:`.phase` — the phase protocol and what a search has found (:class:`Findings`);
* :mod:`.instruments` — timers attached through the optimizer's public listeners and
  torch's optimizer hooks, each removed when its phase is over;
* :mod:`.profiling` — phase 1: profile the live run, then the interference and collective
  slowdown steps;
* :mod:`.planning` — the candidate plans from the profile;
* :mod:`.racing` — phase 2: the measured check, in rounds of visits;
* :mod:`.decisions` — the check's decisions as pure functions (contenders, the speed
  correction, the winner, the refitted profile), tested without a process group;
* :mod:`.watching` — phase 3: watch for drift, profile again.
"""
from .scheduler import AutoScheduler, describe_findings

__all__ = ["AutoScheduler", "describe_findings"]
