"""mergecomp as a DDP communication hook: keep ``DistributedDataParallel`` (or Lightning, or
Accelerate), compress its buckets with any mergecomp compressor, memory and communicator.

    model = DistributedDataParallel(model, bucket_cap_mb_list=mergecomp.ddp.bucket_caps(model))
    state = mergecomp.ddp.register(model, compressor="dgc", memory="dgc", communicator="allgather")

or, where a framework registers the hook itself (Lightning's ``DDPStrategy(ddp_comm_state=...,
ddp_comm_hook=...)``)::

    state = mergecomp.ddp.HookState(model, compressor="topk", memory="residual")
    ddp_model.register_comm_hook(state, mergecomp.ddp.hook)

DDP fills a bucket during backward and calls the hook with it (buckets in order, the last one
flagged); the hook returns a ``torch.futures.Future`` of the averaged bucket, which DDP writes
into ``p.grad`` when backward ends.  Here each bucket is one mergecomp group of the step
lifecycle the wrapper uses too (:mod:`mergecomp.runtime.step`); this module holds only what
DDP's buckets make different:

- the bucket's per-parameter views (``GradBucket.gradients()``) are the group's layout, so
  low-rank compressors factor each layer's own matrix;
- error-feedback and compressor state is kept per bucket (named ``"group<i>"``, as the
  optimizer names its groups), transactional:
  a step is committed or rolled back as a whole;
- every bucket's exchange starts in the hook (compression, collective in flight while
  backward goes on); at the last bucket the lifecycle ends the step on the hook's thread
  (finishing in bucket order, so multi-round compressors issue their later rounds in the
  same order on every rank; the outcome; commit or rollback; a dropped step's buckets are
  NaN on every rank, as an allreduce would make them, and ``GradScaler`` skips) and the
  futures are completed.

DDP decides the buckets, not mergecomp: their sizes come from ``bucket_cap_mb`` or, with the
installed torch, per bucket from ``bucket_cap_mb_list`` (:func:`bucket_caps` turns a
mergecomp schedule into that list), and their order is DDP's.  DDP rebuilds its buckets
after the first iteration; in a step whose buckets changed, the buckets wait for the last
one, the state follows its parameters into the new buckets, and then all are sent as
configured, so every step is compressed (that step does not overlap the exchange with
backward).  A restarted job's DDP starts again from definition-order buckets: a hook state
that holds groups (loaded, unpickled) exchanges that first iteration in its own groups
instead, so a resumed run continues bit for bit.  Two cases go exact FP32: the fresh first
step with the ``ps`` communicator (its shard residuals cannot move) or without the model (no
names for the state to follow), and buckets that change after an earlier bucket of the same
step was sent (their state moves at the step's end).  The first exchange also checks, once,
that every rank registered the hook (see :func:`.guards.check_every_rank_registered`).  What DDP cannot
carry: the adaptive schedulers (``auto``, ``binary``) re-plan between steps, and DDP's
buckets are fixed at construction; launching groups in an order of mergecomp's own;
parameter slices.  Use
:class:`~mergecomp.optimizer.DistributedOptimizer` for those.

The package: :mod:`.state` (:class:`HookState`: a bucket's exchange and the end of the
step), :mod:`.buckets` (state that follows DDP's re-bucketing and checkpoints), :mod:`.guards`
(DDP's silent failure modes, refused), :mod:`.handover` (the loop's clipping seen between the
step's end and the optimizer's step, as the wrapper sees it).
"""
from __future__ import annotations

import sys
from typing import List, Union

import torch
import torch.distributed

from .. import arguments, schedulers
from ..compressors.base import Compressor
from ..memories.base import Memory
from ..plan import ParamInfo
from .state import HookState, hook

# Their public names, in reprs and pickles: mergecomp.ddp.HookState, mergecomp.ddp.hook.
HookState.__module__ = hook.__module__ = __name__

__all__ = ["HookState", "hook", "register", "bucket_caps"]


def register(model: torch.nn.Module, compressor: Union[str, Compressor] = "none",
             memory: Union[str, Memory] = "auto", communicator: str = "auto", **options) -> HookState:
    """Build a :class:`HookState` for the DDP-wrapped ``model`` and register :func:`hook`."""
    if not hasattr(model, "register_comm_hook"):
        raise TypeError(_not_ddp(model))
    state = HookState(model, compressor, memory, communicator, **options)
    model.register_comm_hook(state, hook)
    return state


def _not_ddp(model) -> str:
    """Why ``model`` cannot take the hook, and what to do; under Accelerate, the usual cause:
    without GPUs, ``Accelerator()`` runs each process alone and prepare() wraps nothing."""
    message = (f"register() needs the DistributedDataParallel-wrapped model, got {type(model).__name__}: wrap "
               f"it first (DistributedDataParallel(model, bucket_cap_mb_list=mergecomp.ddp.bucket_caps(model, 4)))")
    accelerate = sys.modules.get("accelerate.state")
    # Accelerate's state is shared by its instances: read it, never create it here
    shared = getattr(getattr(accelerate, "PartialState", None), "_shared_state", None) or {}
    if shared.get("num_processes") == 1:
        message += ("; Accelerate prepared it for 1 process, so it wrapped nothing. Without a GPU, "
                    "Accelerate joins the processes of a job only when built with Accelerator(cpu=True) "
                    "(e.g. Accelerator(cpu=not torch.cuda.is_available())); launch several processes "
                    "(accelerate launch --multi_gpu --num_processes 2, or torchrun --nproc_per_node 2)")
    elif not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        message += "; torch.distributed is not initialised here: call mergecomp.launch.init_distributed() first"
    return message


def bucket_caps(model: torch.nn.Module, schedule: Union[int, str, schedulers.Scheduler] = 4) -> List[float]:
    """DDP's ``bucket_cap_mb_list`` that makes its buckets the groups of a mergecomp schedule.

    The schedule plans the trainable parameters in reverse definition order (the order
    backward usually produces, and the order DDP buckets in before its first iteration); each
    group's size in MiB, a hair over, is its bucket's cap, so DDP closes a bucket exactly
    where the group ends.  After its first iteration DDP re-buckets in the real backward
    order with the same caps.
    """
    arguments.check_schedule(schedule, "a fusion-num (int), a scheduler name or a Scheduler", plan=False)
    if isinstance(schedule, int):
        schedule = schedulers.create("fixed", fusion_num=schedule)
    elif isinstance(schedule, str):
        schedule = schedulers.create(schedule)
    if getattr(schedule, "adaptive", False):
        raise ValueError(f"the {schedule!r} scheduler re-plans while training, and DDP's buckets are fixed "
                         "when it is built: use a fusion-num or 'optimal' with a saved profile, or "
                         "mergecomp.DistributedOptimizer")
    module = getattr(model, "module", model)
    params = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
    infos = [ParamInfo(n, p.numel(), str(p.dtype), str(p.device), p.element_size()) for n, p in reversed(params)]
    plan = schedule.plan(infos)
    sizes = {info.name: info.nbytes for info in infos}
    return [sum(sizes[n] for n in group.names) / 2 ** 20 * (1 + 1e-9) for group in plan.groups]
