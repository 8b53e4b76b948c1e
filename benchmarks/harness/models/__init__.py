"""Benchmark models defined in the project, each with synthetic data and a loss.

``available()`` lists them, ``get(name)`` returns a :class:`ModelSpec` whose ``build``,
``batch`` and ``loss`` are all a benchmark needs.  The set covers the parameter-size profiles
that matter for gradient compression: many small tensors (resnet20), a deep ImageNet CNN
(resnet50), a few huge tensors (vgg16, lstm) and a transformer in between.
"""
from .spec import ModelSpec, available, count_parameters, get, register
from . import lstm, mlp, resnet, transformer, vgg  # noqa: F401  (registers the specs)

__all__ = ["ModelSpec", "available", "count_parameters", "get", "register"]


def __getattr__(name: str):
    """``models.<name>``: the factory of a registered model (``--model benchmarks.harness.models:vgg16``
    for the simulator's command line)."""
    if name.startswith("_") or name not in available():
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return get(name).build
