"""Planning: what a job costs and which plan is fastest.

:mod:`.profile` (the data a live job measures), :mod:`.measure` (measuring it here),
:mod:`.costmodel` (a plan's predicted step, each group priced by its communicator's own
formula), :mod:`.optimal` (the exact planner over that model), :mod:`.auto` (the adaptive
scheduler that profiles, plans and races the contenders), :mod:`.simulate` (the same model
for clusters larger than the one at hand).  The two planners register as the ``optimal``
and ``auto`` schedulers.
"""
from . import auto, optimal  # noqa: F401  (register the schedulers)
