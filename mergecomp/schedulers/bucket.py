"""Groups of a fixed byte size, as PyTorch DDP's ``bucket_cap_mb`` makes them."""
from __future__ import annotations

from typing import List, Optional, Sequence

from . import register
from .base import Scheduler, split_by_type
from ..plan import Group, ParamInfo, Plan, SEND_MODES

#: DDP's default bucket size (``bucket_cap_mb=25``).
DDP_BUCKET_MB = 25.0
#: DDP's first bucket with the default cap (``torch.distributed._DEFAULT_FIRST_BUCKET_BYTES``,
#: 1 MiB): the gradients ready first go out at once instead of waiting for 25 MB more.
DDP_FIRST_BUCKET_MB = 1.0


def capped_cuts(sizes: Sequence[int], cap: int, first_cap: Optional[int] = None) -> List[int]:
    """Indices where to cut ``sizes`` so each run holds about ``cap`` bytes.

    As DDP fills buckets (``compute_bucket_assignment_by_size``): tensors are added in
    order and a run is closed once it reaches its limit, so a tensor over the limit that
    starts a run is a run of its own.  The first run's limit is ``first_cap`` when given,
    the later runs' ``cap``.
    """
    cuts, running, limit = [], 0, cap if first_cap is None else first_cap
    for index, size in enumerate(sizes[:-1]):
        running += size
        if running >= limit:
            cuts.append(index + 1)
            running, limit = 0, cap
    return cuts


@register("bucket")
class BucketScheduler(Scheduler):
    """Contiguous groups of about ``bucket_mb`` megabytes in backward order (Li et al., "PyTorch
    Distributed", VLDB 2020): the plan uncompressed DDP runs, here with any send mode.

    ``send`` says how every group travels, as for the other schedulers: ``"compress"`` (the
    default: the optimizer's compressor, so ``scheduler="bucket"`` changes the grouping,
    never whether gradients are compressed) or raw ``"fp32"``/``"fp16"``/``"bf16"``.  With
    ``send="fp32"`` it is the DDP-equivalent plan the ``auto`` scheduler measures as a
    candidate, so that declining compression never means a coarser overlap than DDP's.
    The first group of each dtype closes at ``first_bucket_mb``; by default DDP's rule: 1 MB
    with DDP's default 25 MB buckets, else the bucket size.
    """

    def __init__(self, bucket_mb: float = DDP_BUCKET_MB, send: str = "compress",
                 first_bucket_mb: Optional[float] = None):
        bucket_mb = self._megabytes("bucket_mb", bucket_mb)
        if first_bucket_mb is None:
            first_bucket_mb = DDP_FIRST_BUCKET_MB if bucket_mb == DDP_BUCKET_MB else bucket_mb
        first_bucket_mb = self._megabytes("first_bucket_mb", first_bucket_mb)
        if send not in SEND_MODES:
            raise ValueError(f"send must be one of {SEND_MODES}, got {send!r}")
        self.bucket_mb, self.first_bucket_mb, self.send = bucket_mb, first_bucket_mb, send

    @staticmethod
    def _megabytes(what: str, value) -> float:
        try:
            value = float(value)
        except (TypeError, ValueError):
            raise ValueError(f"{what} must be a positive number of megabytes, got {value!r}") from None
        if not value > 0:
            raise ValueError(f"{what} must be a positive number of megabytes, got {value!r}; "
                             f"DDP's defaults are {DDP_BUCKET_MB:g} (first bucket {DDP_FIRST_BUCKET_MB:g})")
        return value

    def plan(self, params: Sequence[ParamInfo]) -> Plan:
        cap = max(1, int(self.bucket_mb * 2 ** 20))
        first_cap = max(1, int(self.first_bucket_mb * 2 ** 20))
        groups = []
        for run in split_by_type(params):
            cuts = [0] + capped_cuts([p.nbytes for p in run], cap, first_cap) + [len(run)]
            groups.extend(Group(tuple(p.name for p in run[a:b]), self.send) for a, b in zip(cuts, cuts[1:]))
        return Plan(groups)

    def __repr__(self):
        return (f"BucketScheduler(bucket_mb={self.bucket_mb:g}, first_bucket_mb={self.first_bucket_mb:g}, "
                f"send={self.send!r})")
