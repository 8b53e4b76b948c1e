"""Schedulers: the registry and the built-ins that need no profile: ``fixed`` (MergeComp's
fusion-num), ``bucket`` and ``binary``.  The planners that price plans from a profile,
``optimal`` and ``auto``, sit above them in :mod:`mergecomp.planning` and register here
when it is imported (``import mergecomp`` does)."""
from ..registry import Registry
from .base import AdaptiveScheduler, Scheduler, SchedulerContext, split_by_type

registry = Registry("scheduler", Scheduler, "mergecomp.schedulers")
register = registry.register
create = registry.create
available = registry.available
get = registry.get

from . import fixed, bucket, binary  # noqa: E402,F401

__all__ = ["Scheduler", "AdaptiveScheduler", "SchedulerContext", "register", "create", "available", "get", "registry", "split_by_type"]
