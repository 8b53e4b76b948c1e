"""Replayed compute: workers whose forward and backward are waits of a traced model's
durations, so that an emulated cluster of many workers on few cores measures its links,
not its processors (:mod:`.trace`, :mod:`.model`)."""
from .model import ReplayModel, ReplayedStep, replay_spec
from .trace import ReplayParam, ReplayTrace, from_profile, record

__all__ = ["ReplayModel", "ReplayParam", "ReplayTrace", "ReplayedStep", "from_profile", "record",
           "replay_spec"]
