"""What a user can set on the ``auto`` scheduler, checked once, plus the measurement constants."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

from ..optimal import checked_chunk_mb


@dataclass(frozen=True)
class AutoSettings:
    """The ``auto`` scheduler's settings (see :class:`~mergecomp.planning.auto.AutoScheduler`
    for what each one does); a clear error for each bad value."""

    profile_steps: int = 5
    check_steps: int = 3
    watch_every: int = 50
    drift: float = 0.25
    allow_half: bool = False
    profile_out: Optional[str] = None
    interference_steps: int = 3
    check_rounds: int = 3
    contender_margin: float = 0.15
    fusion_candidates: Tuple[int, ...] = (0, 1, 2, 3, 4, 6, 8)
    compression_margin: float = 0.05
    speed_correction: bool = True
    chunk_mb: Optional[float] = None

    #: The profile is rescaled to the check's compute speed only from this many timed
    #: forward passes (pooled over ranks) or more.
    live_forward_samples: int = 3
    #: A visit's forward further than this factor from the check's median is a pause in
    #: that forward pass (a collection, a page fault), not the host's speed: clamped.
    speed_clamp: float = 2.0
    #: The dummy allreduce of an interference step lasts this many backward spans (by the
    #: measured allreduce cost), so that it is still in flight when backward ends ...
    interference_span: float = 2.5
    #: ... but it never holds more than this many bytes.
    interference_max_bytes: int = 2 ** 28
    #: The short dummy allreduce of a slowdown step lasts this many backward spans (by the
    #: measured allreduce cost), so that it is done before backward ends.
    slowdown_span: float = 0.4

    def __post_init__(self):
        for what, least in (("profile_steps", 2), ("check_steps", 1), ("watch_every", 1),
                            ("interference_steps", 0), ("check_rounds", 1)):
            value = getattr(self, what)
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(f"auto scheduler {what} must be an integer ≥ {least}, got {value!r}")
        if not self.drift > 0:
            raise ValueError(f"auto scheduler drift must be a fraction > 0 (0.25 = 25% slower), got {self.drift!r}")
        fusion_candidates = tuple(self.fusion_candidates)
        if any(isinstance(k, bool) or not isinstance(k, int) or k < 0 for k in fusion_candidates):
            raise ValueError(f"auto scheduler fusion_candidates must be integers ≥ 0 (fusion-nums, 0 = "
                             f"layer-wise), got {fusion_candidates!r}")
        if not self.contender_margin >= 0:
            raise ValueError(f"auto scheduler contender_margin must be a fraction ≥ 0 (0.15 = within 15% of "
                             f"the fastest), got {self.contender_margin!r}")
        margin = self.compression_margin
        if isinstance(margin, bool) or not isinstance(margin, (int, float)) or not 0 <= margin < 1:
            raise ValueError(f"auto scheduler compression_margin must be a fraction in [0, 1) (0.05: a "
                             f"lossy plan must measure 5% faster than the best FP32 plan), got {margin!r}")
        if not isinstance(self.speed_correction, bool):
            raise ValueError(f"auto scheduler speed_correction must be True or False, got "
                             f"{self.speed_correction!r}")
        # Normalised forms, as the scheduler always stored them.
        object.__setattr__(self, "fusion_candidates", fusion_candidates)
        object.__setattr__(self, "chunk_mb", checked_chunk_mb(self.chunk_mb, "auto scheduler chunk_mb"))
        object.__setattr__(self, "drift", float(self.drift))
        object.__setattr__(self, "contender_margin", float(self.contender_margin))
        object.__setattr__(self, "compression_margin", float(margin))
        object.__setattr__(self, "allow_half", bool(self.allow_half))
