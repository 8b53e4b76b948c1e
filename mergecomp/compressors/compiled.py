"""Compiled plugins: a compressor written in plain torch ops, run through ``torch.compile``.

A plugin like the README's ``HalfSign`` makes several passes over the group (``abs``,
``mean``, ``sign``, a cast); compiled, they fuse into one loop.  ``compiled(HalfSign)``
returns a subclass whose ``compress`` and ``decompress`` run through ``torch.compile``
with static shapes: each group shape compiles once, on its first step, and later steps
call the compiled code (a plan has a handful of group shapes; past torch's per-function
limit on recompilations new shapes run eagerly).  The first step of each shape pays the
compile, none after it.

Where compilation is not available (no C++ compiler for inductor on the CPU, an op the
compiler refuses), the first call warns once and the class runs eagerly from then on:
the same results, without the speed.  Errors the compressor raises itself (a bad input)
pass through unchanged.  Check a compiled plugin against its eager self with
:func:`mergecomp.compressors.testing.check_compiled`.
"""
from __future__ import annotations

import inspect
import warnings
from typing import Optional

import torch

from .base import Compressor


def _compile_errors():
    """The exception types that mean "the compiler failed", not "the compressor raised"."""
    errors = []
    try:
        from torch._dynamo import exc as dynamo_exc
        errors += [dynamo_exc.BackendCompilerFailed, dynamo_exc.TorchDynamoException]
    except ImportError:  # pragma: no cover - torch without dynamo
        pass
    try:
        from torch._inductor import exc as inductor_exc
        errors += [getattr(inductor_exc, name) for name in ("InductorError", "CppCompileError")
                   if hasattr(inductor_exc, name)]
    except ImportError:  # pragma: no cover
        pass
    return tuple(errors)


class _CompiledMethod:
    """One method of the compiled class: torch.compile'd once per class, eager after a failure."""

    def __init__(self, cls_name: str, eager, backend, mode: Optional[str]):
        self.cls_name, self.eager = cls_name, eager
        self.backend, self.mode = backend, mode
        self.failed: Optional[str] = None
        self.fast = None
        if not hasattr(torch, "compile"):
            self.failed = f"torch {torch.__version__} has no torch.compile"
        else:
            self.fast = torch.compile(eager, dynamic=False, backend=backend, mode=mode)

    def __call__(self, *args, **kwargs):
        if self.failed is None:
            try:
                return self.fast(*args, **kwargs)
            except _compile_errors() as error:
                self.failed = f"{type(error).__name__}: {' '.join(str(error).split())[:300]}"
                warnings.warn(f"mergecomp: {self.cls_name}.{self.eager.__name__} could not be compiled "
                              f"(backend {self.backend!r}: {self.failed}); it runs eagerly from now on",
                              RuntimeWarning, stacklevel=3)
        return self.eager(*args, **kwargs)


def compiled(cls, backend="inductor", mode: Optional[str] = None):
    """A subclass of the compressor class ``cls`` whose ``compress`` and ``decompress`` run
    through ``torch.compile(..., dynamic=False, backend=backend, mode=mode)``.

    Register it like any plugin (``register("halfsign")(compiled(HalfSign))``) or pass an
    instance.  Multi-round compressors (``rounds``) are refused: their generator exchanges
    collectives between rounds, which a compiled function cannot.
    """
    if not (isinstance(cls, type) and issubclass(cls, Compressor)):
        raise TypeError(f"compiled() takes a Compressor subclass, got {cls!r}; pass the class, "
                        f"e.g. compiled(HalfSign), not an instance")
    if cls.multi_round:
        raise ValueError(f"{cls.__name__} is multi-round (rounds()): only single-round compressors "
                         f"(compress/decompress) can be compiled")
    if not (isinstance(backend, str) and backend) and not callable(backend):
        raise ValueError(f"backend must be a torch.compile backend (a name such as 'inductor', or a "
                         f"callable), got {backend!r}")
    compress = _CompiledMethod(cls.__name__, cls.compress, backend, mode)
    decompress = _CompiledMethod(cls.__name__, cls.decompress, backend, mode)

    def compress_method(self, tensor, name, *args, **kwargs):
        return compress(self, tensor, name, *args, **kwargs)

    def decompress_method(self, payload, ctx):
        return decompress(self, payload, ctx)

    compress_method.__doc__, decompress_method.__doc__ = cls.compress.__doc__, cls.decompress.__doc__
    compress_method.__signature__ = _signature(cls.compress)
    namespace = {"compress": compress_method, "decompress": decompress_method,
                 "eager_class": cls, "compiled_backend": backend,
                 "compiled_methods": (compress, decompress),
                 "__doc__": f"{cls.__name__} with compress/decompress compiled by torch.compile "
                            f"(backend {backend!r}).\n\n{cls.__doc__ or ''}",
                 "__module__": cls.__module__, "__qualname__": f"compiled({cls.__qualname__})"}
    return type(cls.__name__, (cls,), namespace)


def _signature(function):
    """The eager method's signature, so that keyword checks (``layout=``) see the same one."""
    try:
        return inspect.signature(function)
    except (TypeError, ValueError):  # pragma: no cover
        return None
