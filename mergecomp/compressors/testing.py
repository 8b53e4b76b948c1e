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
"""
from __future__ import annotations

import copy
import inspect
import io
import math
from contextlib import contextmanager
from dataclasses import dataclass, field
from statistics import NormalDist
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from .base import AllReduce, Compressor, ParamView, accepts_layout, payload_nbytes
from .single_process import run_locally

#: The real floating dtypes the kit tries (those a compressor declares in ``supported_dtypes``).
FLOAT_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


@dataclass
class Report:
    """What :func:`check_compressor` found: the checks passed and what it could not check."""

    compressor: str
    passed: List[str] = field(default_factory=list)
    notes: List[str] = field(default_factory=list)

    def __str__(self) -> str:
        lines = [f"{self.compressor}: {len(self.passed)} checks passed ({', '.join(self.passed)})"]
        lines += [f"  note: {note}" for note in self.notes]
        return "\n".join(lines)


# -- the compressor under test ---------------------------------------------------------------

class Subject:
    """Makes fresh copies of the compressor under test (a class with ``kwargs``, or an
    instance copied as it was given), each told its process rank."""

    def __init__(self, cls_or_instance, kwargs: Optional[Dict[str, Any]] = None, device="cpu"):
        if isinstance(cls_or_instance, Subject):
            self.__dict__.update(cls_or_instance.__dict__)
            return
        self.device = torch.device(device)
        if isinstance(cls_or_instance, type):
            if not issubclass(cls_or_instance, Compressor):
                raise TypeError(f"check_compressor needs a Compressor subclass or instance, got {cls_or_instance!r}")
            cls, arguments = cls_or_instance, dict(kwargs or {})
            self._make = lambda: cls(**arguments)
        elif isinstance(cls_or_instance, Compressor):
            if kwargs:
                raise TypeError("kwargs= are constructor arguments: pass the class, not an instance")
            pristine = copy.deepcopy(cls_or_instance)
            self._make = lambda: copy.deepcopy(pristine)
        else:
            raise TypeError(f"check_compressor needs a Compressor subclass or instance, got {cls_or_instance!r}")
        self.label = repr(self._make())

    def fresh(self, rank: int = 0) -> Compressor:
        compressor = self._make()
        compressor.set_process_rank(rank)
        return compressor

    @property
    def sample(self) -> Compressor:
        return self._make()


def _subject(cls_or_instance, kwargs=None, device="cpu") -> Subject:
    return cls_or_instance if isinstance(cls_or_instance, Subject) else Subject(cls_or_instance, kwargs, device)


def _fail(law: str, subject: Subject, inputs: str, detail: str) -> None:
    raise AssertionError(f"[{law}] {subject.label} on {inputs}: {detail}")


def _expect(condition: bool, law: str, subject: Subject, inputs: str, detail: str) -> None:
    if not condition:
        _fail(law, subject, inputs, detail)


@contextmanager
def _private_rng(seed: int, device: torch.device):
    """torch's global generators forked and seeded: compressors that draw from them are
    deterministic here, and the caller's random state is untouched."""
    devices = [device.index or 0] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        yield


# -- inputs -----------------------------------------------------------------------------------

@dataclass
class Input:
    """A named test tensor: ``description`` goes into failure messages."""

    description: str
    tensor: torch.Tensor


def make_input(kind: str, numel: int, dtype=torch.float32, device="cpu", seed: int = 0, shape=None) -> Input:
    """A deterministic test tensor: ``gaussian``, ``wide`` (magnitudes over six decades),
    ``sparse`` (1 in 20 non-zero), ``constant``, ``zeros``, ``nan``, ``inf`` or ``-inf``
    (a Gaussian with one non-finite element)."""
    generator = torch.Generator().manual_seed(seed)
    if kind in ("gaussian", "nan", "inf", "-inf"):
        values = torch.randn(numel, generator=generator, dtype=torch.float64)
    elif kind == "wide":
        values = torch.randn(numel, generator=generator, dtype=torch.float64)
        values *= 10.0 ** (torch.rand(numel, generator=generator, dtype=torch.float64) * 6 - 3)
    elif kind == "sparse":
        values = torch.randn(numel, generator=generator, dtype=torch.float64)
        values[torch.rand(numel, generator=generator) > 0.05] = 0.0
    elif kind == "constant":
        values = torch.full((numel,), 0.375, dtype=torch.float64)
    elif kind == "zeros":
        values = torch.zeros(numel, dtype=torch.float64)
    else:
        raise ValueError(f"unknown input kind {kind!r}")
    if kind in ("nan", "inf", "-inf") and numel:
        values[numel // 3] = float(kind)
    tensor = values.to(dtype=dtype, device=device)
    if shape is not None:
        tensor = tensor.view(shape)
    return Input(f"{kind} {str(dtype).replace('torch.', '')} tensor of shape {tuple(tensor.shape)} "
                 f"(seed {seed}) on {tensor.device}", tensor)


def several_views(numel: int = 38) -> Tuple[ParamView, ...]:
    """A layout of a 2-D weight, its bias and a 1-D piece of a larger parameter."""
    if numel < 29:
        raise ValueError(f"several_views needs at least 29 elements, got {numel}")
    return (ParamView("layer.weight", torch.Size([4, 6]), 0),
            ParamView("layer.bias", torch.Size([4]), 24),
            ParamView(f"embedding.weight[0:{numel - 28}]", torch.Size([numel - 28]), 28))


# -- running one step --------------------------------------------------------------------------

@dataclass
class Step:
    """One compress + decode on one simulated rank (payload and ctx are None for multi-round)."""

    decoded: torch.Tensor
    nbytes: int
    payload: Optional[Tuple[torch.Tensor, ...]] = None
    ctx: Any = None


def compress(compressor: Compressor, tensor: torch.Tensor, name: str, layout=None):
    """``compressor.compress`` with the layout when it takes one."""
    if layout is not None and accepts_layout(compressor.compress):
        return compressor.compress(tensor, name, layout=layout)
    return compressor.compress(tensor, name)


def run_step(compressor: Compressor, tensor: torch.Tensor, name: str = "group", layout=None) -> Step:
    """Compress and decode ``tensor`` once (through ``run_locally`` for multi-round ones)."""
    if compressor.multi_round:
        decoded, nbytes = run_locally(compressor, tensor, name, layout=layout)
        return Step(decoded, nbytes)
    payload, ctx = compress(compressor, tensor, name, layout)
    payload = tuple(payload)
    return Step(compressor.decompress(payload, ctx), payload_nbytes(payload), payload, ctx)


def round_shapes(compressor: Compressor, tensor: torch.Tensor, name: str = "group") -> List[List[torch.Size]]:
    """The shapes of every tensor a multi-round compressor sends, round by round (identity
    allreduces, as :func:`~mergecomp.compressors.single_process.run_locally`)."""
    exchange = compressor.rounds(tensor, name)
    shapes, reply = [], None
    try:
        while True:
            request = exchange.send(reply)
            if not isinstance(request, AllReduce):
                raise TypeError(f"rounds() yielded {request!r}; it must yield AllReduce requests")
            shapes.append([t.shape for t in request.tensors])
            reply = tuple(request.tensors)
    except StopIteration:
        return shapes


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape and bytes (NaN payloads compare equal to themselves)."""
    if a.dtype != b.dtype or a.shape != b.shape or a.device != b.device:
        return False
    if a.dtype.is_complex:
        a, b = torch.view_as_real(a), torch.view_as_real(b)
    return torch.equal(a.reshape(-1).contiguous().view(torch.uint8), b.reshape(-1).contiguous().view(torch.uint8))


def same_step(a: Step, b: Step) -> Optional[str]:
    """None when two steps sent and decoded the same bits, else what differs."""
    if (a.payload is None) != (b.payload is None):
        return "one step has a payload and the other not"
    if a.payload is not None:
        if len(a.payload) != len(b.payload):
            return f"payloads have {len(a.payload)} and {len(b.payload)} parts"
        for i, (x, y) in enumerate(zip(a.payload, b.payload)):
            if not same_bits(x, y):
                return f"payload part {i} differs ({x.dtype}{tuple(x.shape)} vs {y.dtype}{tuple(y.shape)})"
    if a.nbytes != b.nbytes:
        return f"{a.nbytes} bytes sent vs {b.nbytes}"
    if not same_bits(a.decoded, b.decoded):
        return "the decoded tensors differ"
    return None


def same_state(a: Any, b: Any, path: str = "state") -> Optional[str]:
    """None when two state_dict()s hold the same keys, values and tensor bits, else where not."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and same_bits(a, b)):
            return f"{path} differs"
        return None
    if isinstance(a, dict) and isinstance(b, dict):
        if set(a) != set(b):
            return f"{path} has keys {sorted(map(str, a))} vs {sorted(map(str, b))}"
        for key in a:
            found = same_state(a[key], b[key], f"{path}[{key!r}]")
            if found:
                return found
        return None
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            return f"{path} has {len(a)} vs {len(b)} items"
        for i, (x, y) in enumerate(zip(a, b)):
            found = same_state(x, y, f"{path}[{i}]")
            if found:
                return found
        return None
    return None if a == b else f"{path} is {a!r} vs {b!r}"


def _supported(subject: Subject, dtypes: Optional[Sequence[torch.dtype]]) -> List[torch.dtype]:
    declared = tuple(getattr(subject.sample, "supported_dtypes", FLOAT_DTYPES))
    wanted = dtypes if dtypes is not None else FLOAT_DTYPES
    return [d for d in wanted if d in declared]


def _guarded(law: str, subject: Subject, inputs: str, run: Callable[[], Any]):
    """``run()``, with any exception turned into a failure of ``law`` naming the inputs."""
    try:
        return run()
    except AssertionError:
        raise
    except Exception as error:  # noqa: BLE001 - any error is the finding
        _fail(law, subject, inputs, f"raised {type(error).__name__}: {error}")


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


def _mean_error(draws: torch.Tensor) -> torch.Tensor:
    """The standard error of each column's mean."""
    return draws.std(0) / math.sqrt(draws.shape[0])


def _variance_error(draws: torch.Tensor) -> torch.Tensor:
    """The standard error of each column's sample variance, √((μ₄ − σ⁴)/m)."""
    centred = draws - draws.mean(0)
    fourth = centred.pow(4).mean(0)
    return (fourth - centred.pow(2).mean(0).square()).clamp(min=0).div(draws.shape[0]).sqrt()


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
