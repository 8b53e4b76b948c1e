"""Gradient compressors: the registry and the built-in algorithms.

``register("name")`` decorates a :class:`Compressor` subclass; ``create("name", **kw)``
instantiates one; ``available()`` lists every name, plugins from the
``mergecomp.compressors`` entry-point group included.
"""
from ..registry import Registry
from .base import AllReduce, Compressor, Context, Payload, check_ratio, payload_nbytes

registry = Registry("compressor", Compressor, "mergecomp.compressors")
register = registry.register
create = registry.create
available = registry.available
get = registry.get

# Built-ins register themselves on import.
from . import none, halfprecision, topk, randk  # noqa: E402,F401
from . import (sign, onebit, qsgd, terngrad, dgc, graddrop, tbq, atomo,  # noqa: E402,F401
               powersgd)

__all__ = ["Compressor", "Context", "Payload", "AllReduce", "register", "create", "available",
           "get", "registry", "payload_nbytes", "check_ratio"]
