"""Communicators: the registry and the built-ins (``allreduce``, ``allgather``, ``ps``,
``sparse_allreduce``).

``create(name, compressor=..., memory=..., backend=...)`` builds one; a communicator
refuses, at construction, a compressor it cannot carry.
"""
from ..registry import Registry
from .base import Communicator, Handle

registry = Registry("communicator", Communicator, "mergecomp.communicators")
register = registry.register
create = registry.create
available = registry.available
get = registry.get

from . import allreduce, allgather, ps  # noqa: E402,F401
from . import sparse_allreduce  # noqa: E402,F401
from . import hierarchical  # noqa: E402,F401

__all__ = ["Communicator", "Handle", "register", "create", "available", "get", "registry"]
