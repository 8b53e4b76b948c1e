"""Checks against another implementation of the same algorithm: a plain reference written
from the paper (:func:`check_reference`), and the eager class a compiled one was made
from (:func:`check_compiled`)."""
from __future__ import annotations

import math
from statistics import NormalDist
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from ..base import Compressor
from .common import (Input, Subject, _expect, _guarded, _mean_error, _private_rng, _subject, _variance_error, make_input, run_step, same_bits, several_views)


# -- against a plain reference ----------------------------------------------------------------

#: What a reference is: ``reference(compressor, x, layout, generator)`` → the decoded tensor
#: of one step of a fresh ``compressor`` (its options read from it) on ``x`` with ``layout``
#: (None for a bare tensor), drawing any randomness from ``generator``.
Reference = Callable[[Compressor, torch.Tensor, Any, torch.Generator], torch.Tensor]


def reference_inputs(numel: int = 1001, device="cpu", seed: int = 0) -> List[Tuple[Input, Any]]:
    """The (input, layout) pairs :func:`check_reference` tries for a deterministic compressor:
    a flat Gaussian, a 2-D one (12 × 10), and a group of several views (:func:`several_views`)."""
    return [(make_input("gaussian", numel, torch.float32, device, seed=seed), None),
            (make_input("gaussian", 120, torch.float32, device, seed=seed + 1, shape=(12, 10)), None),
            (make_input("wide", 38, torch.float32, device, seed=seed + 2), several_views(38))]


def check_reference(cls_or_instance, reference: Reference, kwargs=None, device="cpu", stochastic: bool = False,
                    samples: int = 2000, alpha: float = 1e-3, seed: int = 0, rtol: float = 1e-5,
                    atol: float = 1e-6) -> List[str]:
    """decode(encode(x)) of a fresh compressor agrees with ``reference`` (see :data:`Reference`).

    Deterministic (``stochastic=False``): on each of :func:`reference_inputs` the decoded
    tensor equals the reference's within ``rtol``·|expected| + ``atol``·max|x| (float sums
    and factorisations may round differently; selections and casts agree exactly).

    Stochastic: on 48 values of magnitude 0.5 to 1.5, as a bare tensor and as a group of
    several views, ``samples`` decodes of the compressor (its own random streams, committed
    step after step) and ``samples`` draws of the reference (a seeded generator) must have,
    per coordinate, the same mean and the same variance: each difference within z times
    its standard error (z the two-sided normal quantile at α/d for d coordinates, so a false
    alarm has probability about α) plus a slack of ln(d/α)/m of the largest decoded
    magnitude (its square for the variance) for values too rare to be seen in m draws, and
    2⁻¹⁵ of it for the 16-bit resolution of the compressors' random draws.
    """
    subject = _subject(cls_or_instance, kwargs, device)
    if stochastic:
        return _check_reference_distribution(subject, reference, samples, alpha, seed)
    for made, layout in reference_inputs(device=subject.device, seed=seed):
        where = made.description + (f" with views {[v.name for v in layout]}" if layout else "")
        compressor = subject.fresh()
        with _private_rng(seed, subject.device):
            step = _guarded("reference", subject, where, lambda: run_step(compressor, made.tensor, layout=layout))
        expected = reference(subject.fresh(), made.tensor.clone(), layout, torch.Generator().manual_seed(seed))
        got, expected = step.decoded.double().cpu(), expected.double().cpu()
        _expect(got.shape == expected.shape, "reference", subject, where,
                f"decoded shape {tuple(got.shape)}, the reference's is {tuple(expected.shape)}")
        tolerance = rtol * expected.abs() + atol * float(made.tensor.abs().max())
        error = (got - expected).abs()
        worst = int((error - tolerance).reshape(-1).argmax())
        _expect(bool((error <= tolerance).all()), "reference", subject, where,
                f"element {worst} decodes to {got.reshape(-1)[worst].item():.9g} but the reference gives "
                f"{expected.reshape(-1)[worst].item():.9g} ({int((error > tolerance).sum())} elements differ)")
    return []


def _check_reference_distribution(subject: Subject, reference: Reference, samples: int, alpha: float,
                                  seed: int) -> List[str]:
    numel = 48
    generator = torch.Generator().manual_seed(seed + 11)
    magnitudes = 0.5 + torch.rand(numel, generator=generator, dtype=torch.float64)
    signs = torch.where(torch.rand(numel, generator=generator) < 0.5, -1.0, 1.0).double()
    x = (magnitudes * signs).to(dtype=torch.float32, device=subject.device)
    draws_of = torch.Generator().manual_seed(seed + 13)
    for layout in (None, several_views(numel)):
        where = (f"{numel} float32 values of magnitude 0.5 to 1.5 (seed {seed + 11})"
                 + (f" with views {[v.name for v in layout]}" if layout else "") + f", {samples} draws each")
        compressor = subject.fresh()
        ours = torch.empty(samples, numel, dtype=torch.float64)
        theirs = torch.empty(samples, numel, dtype=torch.float64)
        with _private_rng(seed, subject.device):
            for i in range(samples):
                step = _guarded("reference", subject, where, lambda: run_step(compressor, x, layout=layout))
                ours[i] = step.decoded.double().cpu().reshape(-1)
                compressor.commit()
        for i in range(samples):
            theirs[i] = reference(subject.fresh(), x.clone(), layout, draws_of).double().cpu().reshape(-1)
        z = NormalDist().inv_cdf(1 - alpha / (2 * numel))
        largest = float(torch.maximum(ours.abs().max(), theirs.abs().max()))
        rare = math.log(numel / alpha) / samples + 2.0 ** -15
        for what, statistic, error_of, slack in (
                ("mean", lambda d: d.mean(0), _mean_error, rare * largest),
                ("variance", lambda d: d.var(0), _variance_error, rare * largest ** 2)):
            difference = (statistic(ours) - statistic(theirs)).abs()
            tolerance = z * (error_of(ours) ** 2 + error_of(theirs) ** 2).sqrt() + slack
            worst = int((difference / tolerance).argmax())
            _expect(bool((difference <= tolerance).all()), "reference", subject, where,
                    f"the {what} of coordinate {worst} is {statistic(ours)[worst].item():.6g} over the "
                    f"compressor's decodes but {statistic(theirs)[worst].item():.6g} over the reference's "
                    f"draws: off by {difference[worst].item():.3g}, more than {tolerance[worst].item():.3g}")
    return []


def check_compiled(compiled_class, kwargs: Optional[Dict[str, Any]] = None, device="cpu",
                   sizes: Sequence[int] = (1001, 4096), rtol: float = 1e-5, atol: float = 1e-6,
                   seed: int = 0) -> List[str]:
    """A class made by :func:`mergecomp.compressors.compiled` against its eager class, both
    built with ``kwargs``: for each size (a new shape compiles anew), the same payload (the
    same shapes and dtypes; integer and bool parts bit for bit, floating parts within
    ``rtol``/``atol``, since a compiled reduction may add in another order) and the same
    decode within ``rtol``/``atol``, in the input's shape, dtype and device.

    Returns notes: one when compilation was unavailable and the class ran eagerly (then
    the check compared eager with eager)."""
    eager_class = getattr(compiled_class, "eager_class", None)
    if eager_class is None:
        raise TypeError(f"check_compiled takes a class made by mergecomp.compressors.compiled(...), "
                        f"got {compiled_class!r}")
    subject = _subject(compiled_class, kwargs, device)
    eager = Subject(eager_class, kwargs, device)
    for numel in sizes:
        made = make_input("gaussian", numel, torch.float32, subject.device, seed=seed + numel)
        with _private_rng(seed, subject.device):
            fast = _guarded("compiled", subject, made.description, lambda: run_step(subject.fresh(), made.tensor))
        with _private_rng(seed, subject.device):
            slow = run_step(eager.fresh(), made.tensor)
        _expect(len(fast.payload) == len(slow.payload), "compiled", subject, made.description,
                f"payload has {len(fast.payload)} parts compiled, {len(slow.payload)} eager")
        for i, (a, b) in enumerate(zip(fast.payload, slow.payload)):
            _expect(a.dtype == b.dtype and a.shape == b.shape, "compiled", subject, made.description,
                    f"payload part {i} is {a.dtype}{tuple(a.shape)} compiled, {b.dtype}{tuple(b.shape)} eager")
            close = (torch.allclose(a, b, rtol=rtol, atol=atol, equal_nan=True)
                     if a.dtype.is_floating_point or a.dtype.is_complex else same_bits(a, b))
            _expect(close, "compiled", subject, made.description,
                    f"payload part {i} differs from the eager class's "
                    f"({'beyond rtol/atol' if a.dtype.is_floating_point else 'in its bits'})")
        _expect(fast.decoded.shape == made.tensor.shape and fast.decoded.dtype == made.tensor.dtype
                and fast.decoded.device == made.tensor.device, "compiled", subject, made.description,
                f"decoded {fast.decoded.dtype}{tuple(fast.decoded.shape)} on {fast.decoded.device}; expected "
                f"the input's {made.tensor.dtype}{tuple(made.tensor.shape)} on {made.tensor.device}")
        worst = (fast.decoded - slow.decoded).abs().max().item() if numel else 0.0
        _expect(torch.allclose(fast.decoded, slow.decoded, rtol=rtol, atol=atol, equal_nan=True), "compiled",
                subject, made.description, f"decodes differently from the eager class (largest difference {worst:.3g})")
    failed = {method.failed for method in compiled_class.compiled_methods}
    return [f"compilation unavailable, compared eagerly: {reason}" for reason in failed if reason]
