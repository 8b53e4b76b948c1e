"""The plans the ``auto`` scheduler's check runs, from the profile of the live run.

Three plans from the DP (:class:`~mergecomp.planning.optimal.OptimalScheduler`) — the
optimum, the best plan without compression, the best plan compressing every group, each
free to send tensors over ``chunk_mb`` in pieces when that is set — and, where compressed
groups may also travel by other communicators (``"compress:<name>"`` send modes: a flat
exchange beside the hierarchical one, the sparse allreduce beside the allgather), the DP's
best all-compressed plan through each communicator on its own, MergeComp's fixed
plans for each of ``fusion_candidates`` (by default the whole sweep a user would otherwise
run by hand: the neighbours a cost model is most likely to misjudge), and DDP's plan (raw
FP32 buckets of 25 MB), duplicates dropped.  Measuring them all means a mispredicting
cost model cannot make training slower than the best uncompressed plan, DDP's buckets
or the best fixed fusion-num.
"""
from __future__ import annotations

from typing import Callable, List, Sequence

from ..costmodel import NoCostFormula, communicator_formula, predict, priced_collectives
from ...plan import COMPRESS_VIA, ParamInfo, Plan
from ..profile import Profile
from ...schedulers.bucket import BucketScheduler
from ...schedulers.fixed import FixedScheduler
from ..optimal import OptimalScheduler
from .phase import Candidate
from .settings import AutoSettings


def profiling_plan(params: Sequence[ParamInfo]) -> Plan:
    """The plan the profile runs: the whole model, raw FP32, one group."""
    return FixedScheduler(1, send="fp32").plan(params)


def check_priceable(context) -> None:
    """Refuse, before any profiling step and on every rank alike, a communicator the cost
    model cannot price (a plugin without a cost formula), with what to implement."""
    if context.compressor.name in ("none", "fp32"):
        return  # compressed groups are raw: priced as FP32 allreduce
    communicator = context.communicator
    try:
        communicator_formula(communicator.name)
    except NoCostFormula:
        raise
    except ValueError:
        raise ValueError(
            f"the auto scheduler prices plans with the cost model, which finds a communicator's cost "
            f"formula by its registered name; {type(communicator).__qualname__} is not registered as "
            f"{communicator.name!r}. Register it with @mergecomp.communicators.register(name) and give "
            "it a send_cost classmethod (see mergecomp.planning.costmodel.communicator_formula), or use a "
            "schedule that needs no cost model (a fusion-num, 'bucket' or 'binary').") from None


def plan_candidates(profile: Profile, settings: AutoSettings, say: Callable[[str], None],
                    carriers: Sequence[str] = ()) -> List[Candidate]:
    """The candidates, each with the cost model's step time, in the order the check visits
    them (see the module docstring).  The DP's compressed groups may also travel by any of
    ``carriers`` whose collectives the profile measured (``"compress:<name>"`` modes,
    chosen group by group).  A DP plan the profile cannot price is left out, and said."""
    params = profile.params()
    via = tuple(name for name in carriers if set(priced_collectives(name)) <= set(profile.collectives))
    found: List[Candidate] = []

    def add(label: str, plan: Plan) -> None:
        if all(plan.digest() != candidate.plan.digest() for candidate in found):
            found.append(Candidate(label, plan, predict(plan, profile).iteration_time))

    for label, kwargs in (("optimal", {"allow_half": settings.allow_half, "communicators": via}),
                          ("no compression", {"allow_compress": False, "allow_half": settings.allow_half}),
                          ("all compressed", {"sends": ("compress",) + tuple(COMPRESS_VIA + name for name in via)})):
        try:
            plan = OptimalScheduler(profile, chunk_mb=settings.chunk_mb, **kwargs).plan(params)
        except ValueError as error:  # e.g. a send mode the profile cannot price
            say(f"auto scheduler: no '{label}' candidate: {error}")
            continue
        add(label, plan)
    if via:  # each communicator's best all-compressed plan: which carries a group faster is
        # what the cost model misjudges most easily (a hierarchical against a flat exchange)
        for name, send in [(profile.communicator, "compress")] + [(name, COMPRESS_VIA + name) for name in via]:
            try:
                add(f"all compressed by {name}",
                    OptimalScheduler(profile, chunk_mb=settings.chunk_mb, sends=(send,)).plan(params))
            except ValueError as error:
                say(f"auto scheduler: no 'all compressed by {name}' candidate: {error}")
    fixed = [(f"fusion-num {groups}", FixedScheduler(groups, send="compress"))
             for groups in settings.fusion_candidates]
    for label, scheduler in fixed + [("DDP buckets", BucketScheduler(send="fp32"))]:
        add(label, scheduler.plan(params))
    return found
