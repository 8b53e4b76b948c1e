"""Conformance kit: check that a compressor keeps the laws its capability flags declare.

``check_compressor(MyCompressor)`` (or an instance, or a class plus ``kwargs=``) runs every
check below and returns a :class:`Report`; a broken law raises ``AssertionError`` whose
message names the law, the compressor (its ``repr``) and the inputs.  Each check is also a
function of its own, for a plugin's test suite to run one at a time:

=========================  ==========================================================
``check_repr``             ``repr`` names every constructor argument, and is the same on
                           every rank (the reducer compares it across ranks)
``check_round_trip``       each declared dtype decodes to the input's shape, dtype and
                           device, finite, and the input is left untouched
``check_edge_tensors``     0 and 1 elements, all zeros: no error; zeros decode to zeros
``check_non_finite``       NaN/±inf: a payload or a ValueError, then ``rollback()`` leaves
                           the compressor exactly as it was
``check_wire_size``        the payload's bytes equal ``wire_nbytes(...)``, the formula
``check_fixed_size``       ``fixed_size``: payload shapes depend on numel only
``check_payload_bound``    every payload fits ``payload_bound(ctx)`` when there is one
``check_shared_context``   one rank's context decodes every rank's payload the same way
``check_summable``         ``summable``: decode(Σ payloads) = Σ decode(payload)
``check_unbiased``         ``unbiased``: the mean of many decodes is the input, within
                           the sample's own standard error
``check_layout``           compressing with a layout of several parameter views works
``check_state``            ``state_dict`` → fresh instance → the next step is bit-identical;
                           ``rollback()`` undoes a step, ``commit()`` keeps it
=========================  ==========================================================

One more check is not in :func:`check_compressor`, because it needs something only the
author can give: :func:`check_reference` compares decode(encode(x)) with a plain
reference of the algorithm (a few lines of torch written from the paper: no packing, no
kernels), exactly for a deterministic compressor and in distribution for a stochastic
one.  The built-in compressors' references are in the project's
``tests/reference_compressors.py``.

Multi-round compressors (``multi_round = True``) are run through
:func:`~mergecomp.compressors.single_process.run_locally` wherever one-shot ``compress`` does not
apply.  The kit uses only the public contract of :mod:`mergecomp.compressors.base`, runs
on the CPU unless told ``device=``, and leaves torch's global random state as it found it
(compressors that draw from it see a fixed seed, so every check is deterministic).
See ``docs/compressor-kit.md``.

The kit's parts: ``common.py`` (the subject, inputs, one step, comparisons, statistics),
``laws.py`` (one check per law), ``comparisons.py`` (against a reference or the eager class).
"""
from __future__ import annotations

import inspect
from typing import Any, Dict, Optional, Sequence

import torch

from .common import (FLOAT_DTYPES, Report, Subject, Input, make_input, several_views, Step,
                     compress, run_step, round_shapes, same_bits, same_step, same_state,
                     _private_rng, _subject)
from .comparisons import (Reference, reference_inputs, check_reference, check_compiled)
from .laws import (check_repr, check_round_trip, check_edge_tensors, check_non_finite,
                   wire_formula, check_wire_size, VALUE_KINDS, check_fixed_size,
                   check_payload_bound, check_shared_context, check_summable, check_unbiased,
                   check_layout, check_state, CHECKS)

__all__ = ["CHECKS", "FLOAT_DTYPES", "Input", "Reference", "Report", "Step", "Subject", "VALUE_KINDS",
           "check_compiled", "check_compressor", "check_edge_tensors", "check_fixed_size", "check_layout",
           "check_non_finite", "check_payload_bound", "check_reference", "check_repr", "check_round_trip",
           "check_shared_context", "check_state", "check_summable", "check_unbiased", "check_wire_size",
           "compress", "make_input", "reference_inputs", "round_shapes", "run_step", "same_bits", "same_state",
           "same_step", "several_views", "wire_formula"]


def check_compressor(cls_or_instance, kwargs: Optional[Dict[str, Any]] = None, device="cpu",
                     dtypes: Optional[Sequence[torch.dtype]] = None, samples: int = 2000,
                     alpha: float = 1e-3, seed: int = 0, skip: Sequence[str] = ()) -> Report:
    """Run every check (minus ``skip``) on a compressor class (built with ``kwargs``) or an
    instance (copied as given); raise AssertionError at the first broken law, else return a
    :class:`Report` of the checks passed and the notes (what could not be checked)."""
    unknown = set(skip) - set(CHECKS)
    if unknown:
        raise ValueError(f"unknown checks {sorted(unknown)} in skip; the checks are {list(CHECKS)}")
    subject = _subject(cls_or_instance, kwargs, device)
    report = Report(subject.label)
    options = {"dtypes": dtypes, "samples": samples, "alpha": alpha, "seed": seed}
    with _private_rng(seed, subject.device):
        for name, check in CHECKS.items():
            if name in skip:
                report.notes.append(f"{name} skipped on request")
                continue
            accepted = inspect.signature(check).parameters
            report.notes += check(subject, **{k: v for k, v in options.items() if k in accepted})
            report.passed.append(name)
    return report
