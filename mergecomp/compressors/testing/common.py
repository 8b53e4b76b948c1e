"""The kit's common parts: the compressor under test, the inputs it is tried on, one step
run through the public contract, bit-level comparisons, and the statistics of the
stochastic checks."""
from __future__ import annotations

import copy
import math
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from ..base import AllReduce, Compressor, ParamView, accepts_layout, payload_nbytes
from ..single_process import run_locally


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


def _mean_error(draws: torch.Tensor) -> torch.Tensor:
    """The standard error of each column's mean."""
    return draws.std(0) / math.sqrt(draws.shape[0])


def _variance_error(draws: torch.Tensor) -> torch.Tensor:
    """The standard error of each column's sample variance, √((μ₄ − σ⁴)/m)."""
    centred = draws - draws.mean(0)
    fourth = centred.pow(4).mean(0)
    return (fourth - centred.pow(2).mean(0).square()).clamp(min=0).div(draws.shape[0]).sqrt()
