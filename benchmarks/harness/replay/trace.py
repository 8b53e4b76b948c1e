"""A replay trace: what a model's training step looks like from the exchange's side.

The emulated cluster runs many workers on few host cores.  Real forward and backward
passes then compete with the collectives for the cores, and the step measures the host,
not the links.  On a GPU cluster the accelerator computes and the host's cores serve the
communication; a replayed worker does the same on a CPU host: its forward and backward
are *waits* of the profiled durations, and its gradients appear in the order, sizes and
dtypes of the real model's, so that mergecomp's hooks, groups, compression, collectives
and overlap all run for real while the compute costs no processor time
(:class:`~benchmarks.harness.replay.model.ReplayModel`).

A trace holds, per trainable parameter in the order its gradient becomes ready, its name,
shape, dtype and ready time (seconds after the first gradient, as in
:class:`mergecomp.planning.profile.Profile`'s timeline), plus the forward time (the
step's start to the first gradient) and the optimizer step.  It is made by
:func:`record` (the real model timed on this machine), :func:`from_profile` (a saved
mergecomp profile's timeline, with the shapes of the model it came from), and rescaled
by :meth:`ReplayTrace.with_compute_time` (the same order and relative spacing, the
compute time of another device, e.g. the documented GPU assumption of
:mod:`benchmarks.harness.scaling`).

Traces are plain JSON (``mergecomp-replay/1``), so one recorded here replays anywhere.
"""
from __future__ import annotations

import dataclasses
import json
import math
import statistics
import time
from dataclasses import dataclass, field
from typing import Dict, List, Tuple

import torch

FORMAT = "mergecomp-replay/1"
_DTYPES = {str(d): d for d in (torch.float16, torch.bfloat16, torch.float32, torch.float64)}


@dataclass(frozen=True)
class ReplayParam:
    """One trainable parameter: its gradient is ready ``ready`` seconds after the first."""

    name: str
    shape: Tuple[int, ...]
    dtype: str
    ready: float

    def __post_init__(self):
        if not self.name or not isinstance(self.name, str):
            raise ValueError(f"a replayed parameter needs a name, got {self.name!r}")
        if not self.shape or any(isinstance(d, bool) or not isinstance(d, int) or d < 1 for d in self.shape):
            raise ValueError(f"parameter {self.name!r}: shape must be positive integers, got {self.shape!r}")
        if self.dtype not in _DTYPES:
            raise ValueError(f"parameter {self.name!r}: dtype must be one of {sorted(_DTYPES)}, got {self.dtype!r}")
        if not (isinstance(self.ready, (int, float)) and math.isfinite(self.ready) and self.ready >= 0):
            raise ValueError(f"parameter {self.name!r}: ready time must be finite and ≥ 0 s, got {self.ready!r}")

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype]


@dataclass(frozen=True)
class ReplayTrace:
    """A model's step as the exchange sees it (module docstring); ``params`` in ready order."""

    model: str
    params: Tuple[ReplayParam, ...]
    forward_time: float
    optimizer_step: float = 0.0
    #: How the times were obtained (recorded where, rescaled to what): travels with the trace.
    source: str = ""
    unit: str = "sample"
    batch_size: int = 1
    extra: Dict[str, object] = field(default_factory=dict)
    #: The parameters' names in the model's definition order (``named_parameters()``), which
    #: the replayed model keeps; empty: the reverse of the ready order.
    definition: Tuple[str, ...] = ()

    def __post_init__(self):
        object.__setattr__(self, "params", tuple(self.params))
        object.__setattr__(self, "definition", tuple(self.definition))
        if not self.params:
            raise ValueError(f"trace of {self.model!r} has no parameters: nothing would be exchanged")
        names = [p.name for p in self.params]
        if len(set(names)) != len(names):
            raise ValueError(f"trace of {self.model!r} names a parameter twice: "
                             f"{sorted({n for n in names if names.count(n) > 1})[:5]}")
        if self.definition and sorted(self.definition) != sorted(names):
            raise ValueError(f"trace of {self.model!r}: its definition order names other parameters "
                             "than its ready order")
        readies = [p.ready for p in self.params]
        if readies != sorted(readies):
            raise ValueError(f"trace of {self.model!r}: parameters must be listed in ready order "
                             "(ready times non-decreasing)")
        for what in ("forward_time", "optimizer_step"):
            value = getattr(self, what)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                raise ValueError(f"trace of {self.model!r}: {what} must be finite and ≥ 0 s, got {value!r}")

    def defined(self) -> Tuple[ReplayParam, ...]:
        """The parameters in the model's definition order."""
        if not self.definition:
            return self.params[::-1]
        by_name = {p.name: p for p in self.params}
        return tuple(by_name[n] for n in self.definition)

    @property
    def backward_time(self) -> float:
        """The first gradient to the last."""
        return self.params[-1].ready

    @property
    def compute_time(self) -> float:
        """Forward plus backward: what a step takes without any exchange."""
        return self.forward_time + self.backward_time

    @property
    def numel(self) -> int:
        return sum(p.numel for p in self.params)

    @property
    def nbytes(self) -> int:
        return sum(p.numel * p.torch_dtype.itemsize for p in self.params)

    def scaled(self, factor: float, why: str) -> "ReplayTrace":
        """Every time multiplied by ``factor`` (> 0); ``why`` is appended to the source."""
        if not (isinstance(factor, (int, float)) and math.isfinite(factor) and factor > 0):
            raise ValueError(f"a trace's times scale by a positive factor, got {factor!r}")
        return dataclasses.replace(
            self, params=tuple(dataclasses.replace(p, ready=p.ready * factor) for p in self.params),
            forward_time=self.forward_time * factor, optimizer_step=self.optimizer_step * factor,
            source=f"{self.source}; {why}" if self.source else why)

    def with_compute_time(self, seconds: float) -> "ReplayTrace":
        """The same order and relative spacing, forward + backward taking ``seconds`` (the
        optimizer step scaled alike): another device's speed with this model's shape."""
        if not (isinstance(seconds, (int, float)) and math.isfinite(seconds) and seconds > 0):
            raise ValueError(f"--compute-time must be a positive number of seconds, got {seconds!r}")
        if not self.compute_time > 0:
            raise ValueError(f"trace of {self.model!r} has no compute time to rescale (forward and "
                             "backward are 0 s)")
        return self.scaled(seconds / self.compute_time, f"rescaled to {seconds:g} s of forward + backward")

    def shrunk(self, factor: int) -> "ReplayTrace":
        """Every parameter's first dimension divided by ``factor`` (rounded up): about
        1/factor of the bytes, the same tensors, names, dtypes and times.  For clusters
        whose host memory cannot hold the full model once per worker; the links are then
        slowed by the same factor to keep each transfer's duration."""
        if isinstance(factor, bool) or not isinstance(factor, int) or factor < 1:
            raise ValueError(f"a trace shrinks by an integer factor ≥ 1, got {factor!r}")
        if factor == 1:
            return self
        params = tuple(dataclasses.replace(p, shape=(-(-p.shape[0] // factor),) + p.shape[1:])
                       for p in self.params)
        shrink = factor * int(self.extra.get("shrink", 1))
        return dataclasses.replace(self, params=params, extra={**self.extra, "shrink": shrink},
                                   source=f"{self.source}; first dimensions divided by {factor}")

    # -- plain data -------------------------------------------------------------------------
    def to_dict(self) -> dict:
        return {"format": FORMAT, "model": self.model, "unit": self.unit, "batch_size": self.batch_size,
                "source": self.source, "forward_time": self.forward_time,
                "optimizer_step": self.optimizer_step, "extra": dict(self.extra),
                "definition": list(self.definition),
                "params": [{"name": p.name, "shape": list(p.shape), "dtype": p.dtype, "ready": p.ready}
                           for p in self.params]}

    @classmethod
    def from_dict(cls, data) -> "ReplayTrace":
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            found = data.get("format") if isinstance(data, dict) else type(data).__name__
            raise ValueError(f"not a replay trace: expected format {FORMAT!r}, found {found!r}; make one "
                             "with benchmarks/replay.py record (or from-profile)")
        try:
            params = tuple(ReplayParam(str(p["name"]), tuple(int(d) for d in p["shape"]), str(p["dtype"]),
                                       float(p["ready"])) for p in data["params"])
            return cls(str(data["model"]), params, float(data["forward_time"]),
                       float(data.get("optimizer_step", 0.0)), str(data.get("source", "")),
                       str(data.get("unit", "sample")), int(data.get("batch_size", 1)),
                       dict(data.get("extra", {})), tuple(str(n) for n in data.get("definition", ())))
        except (KeyError, TypeError) as error:
            raise ValueError(f"replay trace is missing or has a malformed field: {error!r}") from None

    def save(self, path: str) -> None:
        with open(path, "w") as f:
            json.dump(self.to_dict(), f, indent=1)
            f.write("\n")

    @classmethod
    def load(cls, path: str) -> "ReplayTrace":
        try:
            with open(path) as f:
                data = json.load(f)
        except OSError as error:
            raise ValueError(f"cannot read replay trace {path!r}: {error.strerror}; make one with "
                             "benchmarks/replay.py record") from None
        except json.JSONDecodeError as error:
            raise ValueError(f"replay trace {path!r} is not valid JSON: {error}") from None
        return cls.from_dict(data)


def _trainable(model: torch.nn.Module) -> Dict[str, torch.nn.Parameter]:
    return {n: p for n, p in model.named_parameters() if p.requires_grad}


def record(model: torch.nn.Module, batch, loss, steps: int = 5, warmup: int = 1,
           name: str = "model", unit: str = "sample", batch_size: int = 1) -> ReplayTrace:
    """Time ``steps`` real training steps of ``model`` here (after ``warmup`` untimed ones):
    each gradient's ready time after the first (median over steps), the order of the
    median times, the forward (step start to first gradient) and a plain SGD step.

    ``batch`` is ``(inputs, targets)``; ``loss(outputs, targets)`` a scalar."""
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"record needs steps ≥ 1 (timed steps), got {steps!r}")
    params = _trainable(model)
    if not params:
        raise ValueError(f"{type(model).__name__} has no trainable parameter: nothing to replay")
    inputs, targets = batch
    optimizer = torch.optim.SGD(params.values(), lr=1e-6)
    ready: Dict[str, List[float]] = {n: [] for n in params}
    forwards, optimizer_steps = [], []
    current: Dict[str, float] = {}

    def stamp(name):
        def hook(_param) -> None:
            current.setdefault(name, time.perf_counter())
        return hook
    hooks = [p.register_post_accumulate_grad_hook(stamp(n)) for n, p in params.items()]
    try:
        for step in range(warmup + steps):
            current.clear()
            start = time.perf_counter()
            optimizer.zero_grad()
            loss(model(inputs), targets).backward()
            began = time.perf_counter()
            optimizer.step()
            ended = time.perf_counter()
            if step < warmup:
                continue
            first = min(current.values())
            forwards.append(first - start)
            optimizer_steps.append(ended - began)
            for n in params:  # a parameter without a gradient is ready at the end
                ready[n].append(current.get(n, max(current.values())) - first)
    finally:
        for hook in hooks:
            hook.remove()
    medians = {n: statistics.median(times) for n, times in ready.items()}
    order = sorted(params, key=lambda n: medians[n])
    return ReplayTrace(name, tuple(ReplayParam(n, tuple(params[n].shape), str(params[n].dtype), medians[n])
                                   for n in order),
                       statistics.median(forwards), statistics.median(optimizer_steps),
                       f"recorded: median of {steps} steps, {torch.get_num_threads()} thread(s), "
                       f"{str(next(iter(params.values())).device)}", unit, batch_size, definition=tuple(params))


def from_profile(profile, model: torch.nn.Module, name: str = "model") -> ReplayTrace:
    """A trace from a :class:`mergecomp.planning.profile.Profile`'s timeline (its order,
    ready times, forward and optimizer step) with the shapes of ``model``, the model the
    profile was taken of (build it on the meta device: only shapes are read)."""
    params = _trainable(model)
    timeline = sorted(profile.timeline, key=lambda t: t.ready)
    missing = [t.name for t in timeline if t.name not in params]
    extra = sorted(set(params) - {t.name for t in timeline})
    if missing or extra:
        raise ValueError(f"the profile and the model name different parameters (in the profile only: "
                         f"{missing[:3]}, in the model only: {extra[:3]}); pass the model the profile was taken of")
    for t in timeline:
        if params[t.name].numel() != t.numel:
            raise ValueError(f"parameter {t.name!r} has {params[t.name].numel()} elements in the model but "
                             f"{t.numel} in the profile; pass the model the profile was taken of")
    return ReplayTrace(name, tuple(ReplayParam(t.name, tuple(params[t.name].shape), t.dtype, t.ready)
                                   for t in timeline),
                       profile.forward_time, profile.optimizer_step,
                       f"from a mergecomp profile of {profile.world_size} worker(s) on {profile.device}",
                       definition=tuple(params))

