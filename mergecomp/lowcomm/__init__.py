"""Low-communication training: local steps between exchanges (DiLoCo, streaming DiLoCo).

:class:`DiLoCo` wraps the user's optimizer; :class:`~mergecomp.lowcomm.fragments.SyncSchedule`
says when each fragment is exchanged.  See docs/low-communication.md.
"""
from .diloco import DiLoCo, nesterov_sgd, recommended_outer_momentum
from .fragments import SyncSchedule

__all__ = ["DiLoCo", "SyncSchedule", "nesterov_sgd", "recommended_outer_momentum"]
