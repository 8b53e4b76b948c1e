"""MergeComp's ``--fusion-num``: a fixed number of groups balanced by bytes."""
from __future__ import annotations

from typing import List, Sequence

from . import register
from .base import Scheduler, split_by_type
from ..plan import Group, ParamInfo, Plan, SEND_MODES


def balanced_cuts(sizes: Sequence[int], parts: int) -> List[int]:
    """Indices where to cut ``sizes`` into at most ``parts`` contiguous runs of similar total.

    A cut goes after the tensor whose running byte count first reaches k/parts of the total,
    for k = 1 .. parts−1.  Tensors are never split, so a tensor larger than a share makes
    its run larger, and a list shorter than ``parts`` yields one run per tensor.
    """
    total = sum(sizes)
    cuts, running, k = [], 0, 1
    for index, size in enumerate(sizes[:-1]):
        running += size
        if k < parts and running * parts >= k * total:
            cuts.append(index + 1)
            while k < parts and running * parts >= k * total:
                k += 1
    return cuts


@register("fixed")
class FixedScheduler(Scheduler):
    """``fusion_num`` groups over the backward order (Wang et al., MergeComp, 2021).

    0: one group per tensor (layer-wise); 1: the whole model in one group; y ≥ 2: y
    contiguous groups of about total/y bytes each (see :func:`balanced_cuts`).  Groups are
    also cut where the parameter dtype or device changes.  ``send`` says how every group
    travels: ``"compress"`` (the configured compressor) or raw ``"fp32"``/``"fp16"``/``"bf16"``.
    """

    def __init__(self, fusion_num: int = 1, send: str = "compress"):
        if isinstance(fusion_num, bool) or not isinstance(fusion_num, int) or fusion_num < 0:
            raise ValueError(f"fusion_num must be an integer ≥ 0 (0 = layer-wise, 1 = one group, "
                             f"y = y groups), got {fusion_num!r}")
        if send not in SEND_MODES:
            raise ValueError(f"send must be one of {SEND_MODES}, got {send!r}")
        self.fusion_num = fusion_num
        self.send = send

    def plan(self, params: Sequence[ParamInfo]) -> Plan:
        groups = []
        for run in split_by_type(params):
            if self.fusion_num == 0:
                pieces = [[p] for p in run]
            else:
                cuts = [0] + balanced_cuts([p.nbytes for p in run], self.fusion_num) + [len(run)]
                pieces = [run[a:b] for a, b in zip(cuts, cuts[1:])]
            groups.extend(Group(tuple(p.name for p in piece), self.send) for piece in pieces)
        return Plan(groups)

    def __repr__(self):
        return f"FixedScheduler(fusion_num={self.fusion_num}, send={self.send!r})"
