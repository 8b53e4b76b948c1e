"""Gradient compressors: the registry and the built-in algorithms.

``register("name")`` decorates a :class:`Compressor` subclass; ``create("name", **kw)``
instantiates one; ``available()`` lists every name, plugins from the
``mergecomp.compressors`` entry-point group included.  ``mergecomp.compressors.testing``
is the conformance kit a plugin's tests run (``check_compressor``).
"""
from ..registry import Registry
from .base import (AllReduce, Compressor, Context, GroupLayout, ParamView, Payload, check_dtypes,
                   check_ratio, clip_layout, payload_nbytes, whole_layout)

registry = Registry("compressor", Compressor, "mergecomp.compressors")
register = registry.register
create = registry.create
available = registry.available
get = registry.get

from .compiled import compiled  # noqa: E402

# Built-ins register themselves on import.
from . import none, halfprecision, topk, randk  # noqa: E402,F401
from . import (sign, onebit, qsgd, terngrad, dgc, graddrop, tbq, atomo,  # noqa: E402,F401
               powersgd, batched_powersgd, demo, sparseloco)

__all__ = ["Compressor", "Context", "Payload", "AllReduce", "ParamView", "GroupLayout", "register",
           "create", "available", "get", "registry", "payload_nbytes", "check_ratio", "check_dtypes",
           "clip_layout", "whole_layout", "compiled"]
