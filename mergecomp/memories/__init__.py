"""Error-feedback memories: the registry and the built-ins (``none``, ``residual``, ``residual16``, ``dgc``)."""
from ..registry import Registry
from .base import Memory

registry = Registry("memory", Memory, "mergecomp.memories")
register = registry.register
create = registry.create
available = registry.available
get = registry.get

from . import none, residual, dgc, demo, residual16  # noqa: E402,F401


def recommended(compressor) -> Memory:
    """A new instance of the memory ``compressor`` recommends (``memory="auto"``), with the
    arguments it recommends for it (``recommended_memory_options``)."""
    return create(compressor.recommended_memory, **dict(getattr(compressor, "recommended_memory_options", {})))


__all__ = ["Memory", "register", "create", "available", "get", "registry", "recommended"]
