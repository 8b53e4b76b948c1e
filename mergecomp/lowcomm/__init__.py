"""Low-communication training: local steps between exchanges (DiLoCo, streaming DiLoCo).

:class:`DiLoCo` wraps the user's optimizer; :class:`~mergecomp.lowcomm.schedule.SyncSchedule`
says when each fragment is exchanged.  See docs/low-communication.md.
"""
from .diloco import DiLoCo, recommended_outer_momentum
from .schedule import SyncSchedule

__all__ = ["DiLoCo", "SyncSchedule", "recommended_outer_momentum"]
