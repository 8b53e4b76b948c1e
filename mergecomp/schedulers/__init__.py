"""Schedulers: the registry and the built-in ``fixed`` (MergeComp's fusion-num)."""
from ..registry import Registry
from .base import AdaptiveScheduler, Scheduler, SchedulerContext, split_by_type

registry = Registry("scheduler", Scheduler, "mergecomp.schedulers")
register = registry.register
create = registry.create
available = registry.available
get = registry.get

from . import fixed, bucket, optimal, binary, auto  # noqa: E402,F401

__all__ = ["Scheduler", "AdaptiveScheduler", "SchedulerContext", "register", "create", "available", "get", "registry", "split_by_type"]
