"""Error-feedback memories: the registry and the built-ins (``none``, ``residual``, ``dgc``)."""
from ..registry import Registry
from .base import Memory

registry = Registry("memory", Memory, "mergecomp.memories")
register = registry.register
create = registry.create
available = registry.available
get = registry.get

from . import none, residual, dgc, demo  # noqa: E402,F401

__all__ = ["Memory", "register", "create", "available", "get", "registry"]
