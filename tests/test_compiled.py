"""Compiled plugins (mergecomp.compressors.compiled) against their eager selves.

The tests use torch.compile's ``eager`` backend (the graph capture without code
generation), which keeps them fast; ``benchmarks/compressors.py compiled`` measures
the inductor backend.
"""
from __future__ import annotations

import warnings

import pytest
import torch

from mergecomp.compressors import Compressor, Context, compiled
from mergecomp.compressors.testing import check_compiled


class HalfSign(Compressor):
    """Sign of each element scaled by half the mean magnitude (the README's plugin)."""

    def compress(self, tensor, name, layout=None):
        if tensor.numel() == 3:
            raise ValueError("three elements are refused, to see the error pass through")
        flat = tensor.reshape(-1)
        scale = flat.abs().mean().reshape(1) / 2
        return (torch.sign(flat).to(torch.int8), scale), Context(tensor.shape, tensor.dtype)

    def decompress(self, payload, ctx):
        signs, scale = payload
        return (signs.to(ctx.dtype) * scale.to(ctx.dtype)).view(ctx.shape)


def test_a_compiled_plugin_matches_its_eager_class():
    fast = compiled(HalfSign, backend="eager")
    assert issubclass(fast, HalfSign) and fast.eager_class is HalfSign and fast.__name__ == "HalfSign"
    assert check_compiled(fast, sizes=(1001, 64)) == []


def test_a_compiler_failure_warns_once_and_runs_eagerly():
    def broken(graph, inputs):
        raise RuntimeError("no compiler here")

    slow = compiled(HalfSign, backend=broken)
    with pytest.warns(RuntimeWarning, match="could not be compiled.*runs eagerly"):
        notes = check_compiled(slow, sizes=(100,))
    assert notes and "no compiler here" in notes[0]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # warned once: the next steps are quiet
        slow().compress(torch.randn(10), "g")


def test_the_compressor_s_own_errors_pass_through():
    with pytest.raises(ValueError, match="three elements"):
        compiled(HalfSign, backend="eager")().compress(torch.randn(3), "g")


def test_compiled_refuses_what_it_cannot_compile():
    with pytest.raises(TypeError, match="Compressor subclass"):
        compiled(HalfSign())
    from mergecomp.compressors.powersgd import PowerSGDCompressor
    with pytest.raises(ValueError, match="multi-round"):
        compiled(PowerSGDCompressor)
    with pytest.raises(ValueError, match="backend"):
        compiled(HalfSign, backend="")
    with pytest.raises(TypeError, match="compiled"):
        check_compiled(HalfSign)
