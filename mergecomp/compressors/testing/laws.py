"""The laws a compressor's capability flags declare, one check each (see the table in
:mod:`mergecomp.compressors.testing`)."""
from __future__ import annotations

import copy
import inspect
import io
import math
from statistics import NormalDist
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from ..base import Compressor, accepts_layout
from .common import (FLOAT_DTYPES, Step, Subject, _expect, _fail, _guarded, _private_rng, _subject, _supported, make_input, round_shapes, run_step, same_bits, same_state, same_step, several_views)


# -- the checks ----------------------------------------------------------------------------------

def check_repr(cls_or_instance, kwargs=None, device="cpu") -> List[str]:
    """``repr`` names every constructor argument (``name=``) and does not depend on the rank."""
    subject = _subject(cls_or_instance, kwargs, device)
    compressor = subject.sample
    text = repr(compressor)
    try:
        parameters = inspect.signature(type(compressor).__init__).parameters
    except (TypeError, ValueError):
        return [f"repr unchecked: the signature of {type(compressor).__name__}.__init__ cannot be read"]
    missing = [name for name, p in parameters.items()
               if name != "self" and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD) and f"{name}=" not in text]
    _expect(not missing, "repr", subject, "construction",
            f"repr {text!r} does not name the constructor arguments {missing}: ranks built with different "
            f"values would look alike (show each as name=value, or keep it as an attribute of the same name "
            f"and use Compressor.__repr__)")
    _expect(repr(subject.fresh(0)) == repr(subject.fresh(3)), "repr", subject, "set_process_rank(0) vs (3)",
            "repr depends on the process rank; it must be the same on every rank")
    return []


def check_round_trip(cls_or_instance, kwargs=None, device="cpu", dtypes=None) -> List[str]:
    """Every declared dtype (and complex ones if declared) decodes to the input's shape, dtype
    and device, finite, without modifying the input."""
    subject = _subject(cls_or_instance, kwargs, device)
    declared = tuple(getattr(subject.sample, "supported_dtypes", FLOAT_DTYPES))
    kinds = _supported(subject, dtypes) + [d for d in declared if d.is_complex and (dtypes is None or d in dtypes)]
    for dtype in kinds:
        for shape, transpose in (((7, 5), False), ((7, 5), True), ((1001,), False)):
            numel = math.prod(shape)
            if dtype.is_complex:
                real = make_input("gaussian", 2 * numel, torch.float64, subject.device, seed=numel).tensor
                tensor = torch.view_as_complex(real.view(numel, 2)).to(dtype).view(shape)
                description = f"complex {dtype} tensor of shape {shape}"
            else:
                made = make_input("gaussian", numel, dtype, subject.device, seed=numel, shape=shape)
                tensor, description = made.tensor, made.description
            if transpose:
                tensor, description = tensor.t(), description + ", transposed (non-contiguous)"
            original = tensor.clone()
            step = _guarded("round trip", subject, description, lambda: run_step(subject.fresh(), tensor))
            out = step.decoded
            _expect(isinstance(out, torch.Tensor) and out.shape == tensor.shape and out.dtype == tensor.dtype
                    and out.device == tensor.device, "round trip", subject, description,
                    f"decoded {type(out).__name__} {getattr(out, 'dtype', '')} of shape "
                    f"{tuple(getattr(out, 'shape', ()))} on {getattr(out, 'device', '?')}; expected the input's "
                    f"shape {tuple(tensor.shape)}, dtype {tensor.dtype} and device {tensor.device}")
            _expect(bool(torch.isfinite(out).all()), "round trip", subject, description,
                    "decoded non-finite values from a finite input")
            _expect(same_bits(tensor, original), "round trip", subject, description, "modified its input")
    return []


def check_edge_tensors(cls_or_instance, kwargs=None, device="cpu", dtypes=None) -> List[str]:
    """0 elements, 1 element and all zeros compress and decode without error, to the input's
    shape and dtype; 0-element and all-zero inputs decode to zeros."""
    subject = _subject(cls_or_instance, kwargs, device)
    for dtype in _supported(subject, dtypes):
        for kind, numel in (("zeros", 0), ("gaussian", 1), ("zeros", 1), ("zeros", 1001)):
            made = make_input(kind, numel, dtype, subject.device)
            step = _guarded("edge tensors", subject, made.description,
                            lambda: run_step(subject.fresh(), made.tensor))
            out = step.decoded
            _expect(out.shape == made.tensor.shape and out.dtype == dtype, "edge tensors", subject,
                    made.description, f"decoded {out.dtype} of shape {tuple(out.shape)}")
            if kind == "zeros" and bool(out.any()):
                _fail("edge tensors", subject, made.description,
                      f"a zero input decoded to non-zero values (max |x| = {out.abs().max().item():g})")
            else:
                _expect(bool(torch.isfinite(out).all()), "edge tensors", subject, made.description,
                        "decoded non-finite values from a finite input")
    return []


def check_non_finite(cls_or_instance, kwargs=None, device="cpu", seed: int = 0) -> List[str]:
    """A NaN or ±inf in the input gives a payload or a ValueError, never another error; after
    ``rollback()`` the compressor is exactly as before (the next step is bit-identical to
    that of a twin that never saw the bad tensor)."""
    subject = _subject(cls_or_instance, kwargs, device)
    for kind in ("nan", "inf", "-inf"):
        for numel in (3, 1001):
            bad = make_input(kind, numel, torch.float32, subject.device, seed=1)
            good = make_input("gaussian", numel, torch.float32, subject.device, seed=2)
            warm = make_input("gaussian", numel, torch.float32, subject.device, seed=3)
            twin, tested = subject.fresh(), subject.fresh()
            for compressor in (twin, tested):
                with _private_rng(seed, subject.device):
                    run_step(compressor, warm.tensor)
                compressor.commit()
            before = tested.state_dict()

            def bad_step():
                try:
                    with _private_rng(seed + 1, subject.device):
                        run_step(tested, bad.tensor)
                except ValueError as error:
                    _expect(bool(str(error)), "non-finite input", subject, bad.description,
                            "raised a ValueError without a message")

            _guarded("non-finite input", subject, bad.description, bad_step)
            tested.rollback()
            found = same_state(before, tested.state_dict())
            _expect(found is None, "non-finite input", subject, bad.description,
                    f"state_dict() after rollback() differs from before the step: {found}")
            with _private_rng(seed + 2, subject.device):
                expected = run_step(twin, good.tensor)
            with _private_rng(seed + 2, subject.device):
                got = _guarded("non-finite input", subject, f"{good.description} after {bad.description}",
                               lambda: run_step(tested, good.tensor))
            found = same_step(expected, got)
            _expect(found is None, "non-finite input", subject, bad.description,
                    f"after rollback() the next step differs from a twin that never saw it: {found}")
    return []


def wire_formula(compressor: Compressor) -> Optional[Callable]:
    """The compressor's ``wire_nbytes`` called with the arguments it accepts, or None."""
    method = getattr(compressor, "wire_nbytes", None)
    if not callable(method):
        return None
    try:
        parameters = inspect.signature(method).parameters
    except (TypeError, ValueError):
        parameters = {}
    variadic = any(p.kind is p.VAR_KEYWORD for p in parameters.values())

    def formula(numel, element_size, payload=None, layout=None):
        arguments = [numel]
        if "element_size" in parameters or variadic or len(parameters) >= 2:
            arguments.append(element_size)
        keywords = {key: value for key, value in (("payload", payload), ("layout", layout))
                    if key in parameters or variadic}
        return method(*arguments, **keywords)

    return formula


def check_wire_size(cls_or_instance, kwargs=None, device="cpu", dtypes=None, seed: int = 0) -> List[str]:
    """The bytes of every payload equal ``compressor.wire_nbytes(numel, element_size,
    payload=..., layout=...)`` (for multi-round compressors: the bytes of all rounds)."""
    subject = _subject(cls_or_instance, kwargs, device)
    if wire_formula(subject.sample) is None:
        return [f"wire formula unchecked: {type(subject.sample).__name__} has no "
                f"wire_nbytes(numel, element_size, payload=None, layout=None)"]
    wanted = [d for d in _supported(subject, dtypes) if d in (torch.float32, torch.float16)] or \
        _supported(subject, dtypes)[:1]
    cases = [(n, None) for n in (1, 7, 1000, 4099)] + [(38, several_views(38)), (4099, several_views(4099))]
    for dtype in wanted:
        for numel, layout in cases:
            for kind in ("gaussian", "sparse"):
                made = make_input(kind, numel, dtype, subject.device, seed=numel)
                where = made.description + (f" with a layout of {len(layout)} views" if layout else "")
                compressor = subject.fresh()
                with _private_rng(seed, subject.device):
                    step = _guarded("wire size", subject, where, lambda: run_step(compressor, made.tensor, layout=layout))
                formula = wire_formula(compressor)
                expected = _guarded("wire size", subject, where,
                                    lambda: formula(numel, made.tensor.element_size(), payload=step.payload, layout=layout))
                _expect(step.nbytes == expected, "wire size", subject, where,
                        f"sends {step.nbytes} bytes, wire_nbytes() says {expected}")
    return []


def _shapes(step: Step) -> List[Tuple[torch.dtype, torch.Size]]:
    return [(t.dtype, t.shape) for t in step.payload]


VALUE_KINDS = ("gaussian", "wide", "sparse", "constant", "zeros")


def check_fixed_size(cls_or_instance, kwargs=None, device="cpu", seed: int = 0) -> List[str]:
    """With ``fixed_size``, payload shapes and dtypes (multi-round: every round's) depend on
    the number of elements only, never on their values."""
    subject = _subject(cls_or_instance, kwargs, device)
    if not subject.sample.fixed_size:
        return []
    for numel in (1, 7, 1000, 4099):
        seen = {}
        for kind in VALUE_KINDS:
            made = make_input(kind, numel, torch.float32, subject.device, seed=numel)
            compressor = subject.fresh()
            with _private_rng(seed, subject.device):
                if compressor.multi_round:
                    shapes = _guarded("fixed_size", subject, made.description,
                                      lambda: round_shapes(compressor, made.tensor))
                else:
                    shapes = _shapes(_guarded("fixed_size", subject, made.description,
                                              lambda: run_step(compressor, made.tensor)))
            seen[made.description] = shapes
        first, *rest = seen.items()
        for description, shapes in rest:
            _expect(shapes == first[1], "fixed_size", subject, f"{first[0]} and {description}",
                    f"payload shapes differ for the same numel: {first[1]} vs {shapes}; "
                    f"declare fixed_size = False (and a payload_bound) if the size depends on the values")
    return []


def check_payload_bound(cls_or_instance, kwargs=None, device="cpu", seed: int = 0) -> List[str]:
    """When ``payload_bound(ctx)`` is not None, every payload part fits its bound shape."""
    subject = _subject(cls_or_instance, kwargs, device)
    if subject.sample.multi_round:
        return []
    notes = []
    for numel in (1, 7, 1000, 4099):
        for kind in VALUE_KINDS:
            made = make_input(kind, numel, torch.float32, subject.device, seed=numel)
            compressor = subject.fresh()
            with _private_rng(seed, subject.device):
                step = _guarded("payload_bound", subject, made.description, lambda: run_step(compressor, made.tensor))
            bound = compressor.payload_bound(step.ctx)
            if bound is None:
                if not compressor.fixed_size and not notes:
                    notes.append("no payload_bound: the allgather communicator exchanges sizes first")
                continue
            _expect(len(bound) == len(step.payload), "payload_bound", subject, made.description,
                    f"the bound has {len(bound)} parts, the payload {len(step.payload)}")
            for i, (part, limit) in enumerate(zip(step.payload, bound)):
                fits = part.dim() == len(limit) and all(s <= m for s, m in zip(part.shape, limit))
                _expect(fits, "payload_bound", subject, made.description,
                        f"payload part {i} has shape {tuple(part.shape)}, over its bound {tuple(limit)}")
    return notes


def _ranks(subject: Subject, numel: int, world: int, seed: int, layout=None, name: str = "group"):
    """``world`` simulated ranks: fresh copies told their rank, each compressing its own tensor."""
    steps, inputs = [], []
    for rank in range(world):
        made = make_input("wide" if rank % 2 else "gaussian", numel, torch.float32, subject.device, seed=100 + rank)
        compressor = subject.fresh(rank)
        with _private_rng(seed + rank, subject.device):
            steps.append(_guarded("ranks", subject, made.description,
                                  lambda: run_step(compressor, made.tensor, name, layout)))
        inputs.append(made)
    return steps, inputs


def check_shared_context(cls_or_instance, kwargs=None, device="cpu", seed: int = 0, world: int = 3) -> List[str]:
    """One rank's context decodes every rank's payload to the same bits as the sender's own
    context (allgather and PS decode all payloads with the local context)."""
    subject = _subject(cls_or_instance, kwargs, device)
    compressor = subject.sample
    if compressor.multi_round:
        return []
    for numel, layout in ((1001, None), (38, several_views(38))):
        steps, inputs = _ranks(subject, numel, world, seed, layout)
        for rank in range(1, world):
            where = f"rank {rank}'s {inputs[rank].description} decoded with rank 0's context"
            mine = _guarded("shared context", subject, where,
                            lambda: compressor.decompress(steps[rank].payload, steps[0].ctx))
            _expect(same_bits(mine, steps[rank].decoded), "shared context", subject, where,
                    "decodes differently from the sender's own context: a context must hold only what "
                    "is the same on every rank")
    return []


def check_summable(cls_or_instance, kwargs=None, device="cpu", seed: int = 0, world: int = 3) -> List[str]:
    """With ``summable``: payload shapes agree across ranks and decoding the elementwise sum of
    the payloads equals the sum of the decoded payloads (to the payload dtype's rounding)."""
    subject = _subject(cls_or_instance, kwargs, device)
    compressor = subject.sample
    if not compressor.summable:
        return []
    if compressor.multi_round:
        return ["summable multi-round compressor: its rounds are allreduces by construction; the "
                "payload-sum law applies to one-shot payloads"]
    for numel in (1, 1001):
        steps, inputs = _ranks(subject, numel, world, seed)
        where = " + ".join(i.description for i in inputs)
        shapes = [_shapes(s) for s in steps]
        _expect(all(s == shapes[0] for s in shapes), "summable", subject, where,
                f"payload shapes differ between ranks: {shapes}")
        total = tuple(sum(parts[1:], parts[0].clone()) for parts in zip(*(s.payload for s in steps)))
        summed = _guarded("summable", subject, where, lambda: compressor.decompress(total, steps[0].ctx)).double()
        decoded = [s.decoded.double() for s in steps]
        reference = sum(decoded[1:], decoded[0].clone())
        eps = max((torch.finfo(p.dtype).eps for p in total if p.dtype.is_floating_point),
                  default=torch.finfo(torch.float32).eps)
        scale = sum(d.abs() for d in decoded)
        error = (summed - reference).abs()
        allowed = 4 * world * eps * scale + torch.finfo(torch.float32).tiny
        _expect(bool((error <= allowed).all()), "summable", subject, where,
                f"decode(sum of payloads) differs from the sum of decodes by up to "
                f"{error.max().item():.3g} (allowed {allowed.max().item():.3g} from rounding)")
    return []


def check_unbiased(cls_or_instance, kwargs=None, device="cpu", samples: int = 2000, alpha: float = 1e-3,
                   numel: int = 48, seed: int = 0) -> List[str]:
    """With ``unbiased`` True: over ``samples`` draws (the compressor's own random streams,
    committed step after step; torch's global generator seeded), every coordinate's mean
    decode is within z·σ̂/√m of the input, σ̂ the sample's own standard deviation and z the
    two-sided normal quantile at α/d for d coordinates (Bonferroni), plus a slack of
    ln(d/α)/m times the largest decoded magnitude for values too rare to be seen in m draws
    (and 2⁻¹⁵ of it for the codes' rounding resolution).  A false alarm has probability
    about α; the result is deterministic."""
    subject = _subject(cls_or_instance, kwargs, device)
    flag = getattr(subject.sample, "unbiased", None)
    if flag is None:
        return [f"unbiasedness not declared: set unbiased = True or False on {type(subject.sample).__name__}"]
    if not flag:
        return []
    generator = torch.Generator().manual_seed(seed + 7)
    magnitudes = 0.5 + torch.rand(numel, generator=generator, dtype=torch.float64)
    signs = torch.where(torch.rand(numel, generator=generator) < 0.5, -1.0, 1.0).double()
    x = (magnitudes * signs).to(dtype=torch.float32, device=subject.device)
    where = f"{numel} float32 values of magnitude 0.5 to 1.5 (seed {seed + 7}), {samples} draws"
    compressor = subject.fresh()
    draws = torch.empty(samples, numel, dtype=torch.float64)
    with _private_rng(seed, subject.device):
        for i in range(samples):
            draws[i] = _guarded("unbiased", subject, where, lambda: run_step(compressor, x)).decoded.double().cpu()
            compressor.commit()
    mean, std = draws.mean(0), draws.std(0)
    z = NormalDist().inv_cdf(1 - alpha / (2 * numel))
    largest = float(draws.abs().max())
    slack = (math.log(numel / alpha) / samples + 2.0 ** -15) * largest
    tolerance = z * std / math.sqrt(samples) + slack
    error = (mean - x.double().cpu()).abs()
    worst = int((error / tolerance).argmax())
    _expect(bool((error <= tolerance).all()), "unbiased", subject, where,
            f"the mean decode of coordinate {worst} is {mean[worst].item():.6g} for an input of "
            f"{x[worst].item():.6g}: off by {error[worst].item():.3g}, more than z·σ̂/√m + slack = "
            f"{tolerance[worst].item():.3g} (z = {z:.2f})")
    _expect(bool((std > 0).any()) or bool((error == 0).all()), "unbiased", subject, where,
            "the decodes never vary yet differ from the input")
    return []


def check_layout(cls_or_instance, kwargs=None, device="cpu", seed: int = 0) -> List[str]:
    """Compressing a group with a layout of several parameter views (a 2-D weight, a bias,
    a 1-D piece of a larger parameter) works, leaves its input alone and decodes to the
    group's shape and dtype."""
    subject = _subject(cls_or_instance, kwargs, device)
    compressor = subject.sample
    method = compressor.rounds if compressor.multi_round else compressor.compress
    if not accepts_layout(method):
        return [f"layout unchecked: {type(compressor).__name__}.{method.__name__} takes no layout keyword "
                f"(it is called without one)"]
    for numel in (38, 4099):
        layout = several_views(numel)
        for kind in ("gaussian", "sparse"):
            made = make_input(kind, numel, torch.float32, subject.device, seed=numel)
            where = f"{made.description} with views {[v.name for v in layout]}"
            original = made.tensor.clone()
            with _private_rng(seed, subject.device):
                step = _guarded("layout", subject, where, lambda: run_step(subject.fresh(), made.tensor, layout=layout))
            _expect(same_bits(made.tensor, original), "layout", subject, where, "modified its input")
            _expect(step.decoded.shape == made.tensor.shape and step.decoded.dtype == made.tensor.dtype,
                    "layout", subject, where,
                    f"decoded {step.decoded.dtype} of shape {tuple(step.decoded.shape)}, expected the group's")
            _expect(bool(torch.isfinite(step.decoded).all()), "layout", subject, where, "decoded non-finite values")
    return []


def _checkpoint(state: Any) -> Any:
    """``state`` through torch.save and torch.load(weights_only=True), as a checkpoint goes."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def check_state(cls_or_instance, kwargs=None, device="cpu", seed: int = 0, numel: int = 1001) -> List[str]:
    """Transactional, resumable state (random streams included):

    * ``state_dict()`` in the middle of a step exports the committed state, and a saved
      state is a copy (later steps do not change it);
    * resume: ``state_dict()`` through torch.save/torch.load(weights_only=True) into a fresh
      instance, and the next step is bit-identical to the original's;
    * ``rollback()`` after a step restores the state: the next step is bit-identical to that
      of a twin that never took it; ``commit()`` keeps it (a rollback right after is a no-op).
    """
    subject = _subject(cls_or_instance, kwargs, device)
    inputs = [make_input("gaussian" if i % 2 else "wide", numel, torch.float32, subject.device, seed=10 + i)
              for i in range(4)]

    def step(compressor, i, rng=None):
        return _guarded("state", subject, inputs[i].description, lambda: _seeded_step(compressor, inputs[i], rng or seed + i))

    def _seeded_step(compressor, made, rng):
        with _private_rng(rng, subject.device):
            return run_step(compressor, made.tensor)

    original = subject.fresh(1)
    for i in range(2):
        step(original, i)
        original.commit()
    saved = original.state_dict()
    kept = copy.deepcopy(saved)
    step(original, 2)  # a step in progress
    found = same_state(kept, original.state_dict())
    _expect(found is None, "state", subject, inputs[2].description,
            f"state_dict() in the middle of a step differs from the committed state: {found}")
    original.rollback()
    found = same_state(kept, saved)
    _expect(found is None, "state", subject, inputs[2].description,
            f"a state_dict() taken earlier changed with later steps (return copies, not live tensors): {found}")
    try:
        restored = _checkpoint(saved)
    except Exception as error:  # noqa: BLE001
        _fail("state", subject, "state_dict()", f"does not survive torch.save/torch.load(weights_only=True): "
                                                f"{type(error).__name__}: {error}")
    resumed = subject.fresh(1)
    _guarded("state", subject, "load_state_dict(state_dict())", lambda: resumed.load_state_dict(restored))
    found = same_step(step(original, 2, rng=seed + 50), step(resumed, 2, rng=seed + 50))
    _expect(found is None, "state", subject, inputs[2].description,
            f"after load_state_dict(state_dict()) into a fresh instance the next step differs: {found}")

    twin, tested = subject.fresh(1), subject.fresh(1)
    for compressor in (twin, tested):
        step(compressor, 0)
        compressor.commit()
    step(tested, 1)
    tested.rollback()
    found = same_step(step(twin, 2), step(tested, 2))
    _expect(found is None, "state", subject, f"{inputs[1].description} rolled back",
            f"the step after rollback() differs from a twin that never took the rolled-back step: {found}")
    for compressor in (twin, tested):
        compressor.commit()
        step(compressor, 3)
        compressor.commit()
    tested.rollback()  # after a commit: nothing to undo
    found = same_step(step(twin, 0, rng=seed + 60), step(tested, 0, rng=seed + 60))
    _expect(found is None, "state", subject, f"{inputs[3].description} committed, then rollback()",
            f"a rollback() right after commit() undid committed state: {found}")
    return []


#: Every check, in the order :func:`check_compressor` runs them.
CHECKS: Dict[str, Callable[..., List[str]]] = {
    "repr": check_repr,
    "round_trip": check_round_trip,
    "edge_tensors": check_edge_tensors,
    "non_finite": check_non_finite,
    "wire_size": check_wire_size,
    "fixed_size": check_fixed_size,
    "payload_bound": check_payload_bound,
    "shared_context": check_shared_context,
    "summable": check_summable,
    "unbiased": check_unbiased,
    "layout": check_layout,
    "state": check_state,
}
