"""Profile: what the compression scheduler knows about one training job, and how it is measured.

The cost model (:mod:`mergecomp.costmodel`) predicts the iteration time of a Plan from
four kinds of measurement, all plain data here so that a profile can be saved on one run
and planned from on another:

* the **backward timeline**: for each gradient, in backward order, when it became ready
  (seconds after backward started), plus the forward and backward totals — measured by
  :class:`BackwardTimer`;
* the **codec costs**: compress and decompress time of each compressor as ``a + b·n`` for n
  elements, and the bytes it puts on the wire for n elements (``header + per_element·n``),
  counted from real payloads — :func:`measure_compression_cost`;
* the **collective costs** at this world size, ``α + β·bytes`` per collective kind
  (allreduce, allgather, alltoall), timed through the backend on all ranks —
  :func:`measure_collective_cost`;
* the **copy cost** per byte (gathering gradients into a fused buffer, writing them back) —
  :func:`measure_copy_cost`;
* the **memory cost** per element: the error-feedback memory's ``compensate`` and
  ``update``, which every group (raw groups share the compressed groups' memory) runs in
  its hook before the collective — :func:`measure_memory_cost`.  DGC's momentum
  correction makes several passes over the group, as much work as the compression itself
  on a 2-core CPU; zero (the default, and old profiles) for no memory;
* the **interference** factor k ≥ 1: how many times longer backward takes while a
  collective is in flight (the communication library's threads and the kernel's network
  stack compete with it for CPU time and memory bandwidth) — :func:`interference_factor`
  of backward passes timed with and without a concurrent collective, measured on the live
  run by the ``auto`` scheduler.  1.0 (no interference) is the default, so profiles saved
  before the field existed load unchanged;
* the **finish cost** per send mode: seconds of a group's finish phase after its
  collective — decode, aggregate, average and the write-back into ``p.grad`` — run through
  the job's own communicator on payloads of the world size (allgather: N payloads decoded,
  summed) at sizes up to the model's largest group — :func:`measure_finish_cost`.  On a
  CPU this phase allocates and touches fresh buffers of the group's size for every
  payload, which probes of a few megabytes do not see; profiles without it (the default,
  empty) fall back to the codec's decode cost plus copy passes;
* the **optimizer step**: seconds of the wrapped optimizer's own ``step()`` per iteration,
  timed on the live run (0.0 in profiles saved before the field existed);
* the **live launch and finish costs** per send mode: the hook-side launch (gather copy,
  memory, codec, collective start) and the finish phase (decode … write-back) of every
  group, timed inside the optimizer while the ``auto`` scheduler runs its candidate plans
  (:func:`fit_live_costs`).  An isolated probe allocates fresh buffers and runs while the
  other ranks idle; in the training loop the allocator serves memory the process already
  holds and every rank competes for the same cores, so the probes misjudge both phases
  (on the 2-core cluster the finish about 3× too high, the launch 1.6–7× too low).  A live
  ``finish`` fit replaces the probed one; ``launch``, when present, replaces copy + memory
  + codec as a group's encode cost (empty, the default: priced from the probes);
* the **collective slowdown** c ≥ 1: how many times longer a collective takes while
  backward runs beside it (:func:`collective_slowdown_factor`, from a short dummy allreduce
  timed under backward and alone, by ``auto``); 1.0 (the default) in older profiles.

Linear costs follow MergeComp (Wang et al., 2021), whose scheduler models compression and
communication of a group as affine in its size; α-β collective models are the standard
ones (Thakur et al., 2005) also used by HiPress/SeCoPa (Bai et al., SOSP 2021) and Espresso
(Wang et al., EuroSys 2023).
"""
from __future__ import annotations

import contextlib
import json
import statistics
import time
from dataclasses import dataclass, field
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

import torch

from .plan import ParamInfo

FORMAT = "mergecomp-profile/1"
COLLECTIVE_KINDS = ("allreduce", "allgather", "alltoall")
#: Send modes whose finish phase a profile can hold a measured cost for.
FINISH_SENDS = ("compress", "fp32", "fp16", "bf16")


# ------------------------------------------------------------------------------ linear costs
@dataclass(frozen=True)
class LinearCost:
    """``intercept + slope·x`` seconds; x is elements or bytes, as the field using it says."""

    intercept: float = 0.0
    slope: float = 0.0

    def __post_init__(self):
        for what in ("intercept", "slope"):
            value = getattr(self, what)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0 \
                    or value == float("inf"):
                raise ValueError(f"a cost's {what} must be a finite number ≥ 0 seconds, got {value!r}")

    def __call__(self, x: float) -> float:
        return self.intercept + self.slope * x

    def __add__(self, other: "LinearCost") -> "LinearCost":
        return LinearCost(self.intercept + other.intercept, self.slope + other.slope)

    def scaled(self, intercept_factor: float, slope_factor: float) -> "LinearCost":
        """The cost of ``intercept_factor`` calls that together handle ``slope_factor``·x."""
        return LinearCost(self.intercept * intercept_factor, self.slope * slope_factor)

    def to_dict(self) -> dict:
        return {"intercept": self.intercept, "slope": self.slope}

    @classmethod
    def from_dict(cls, data, what: str = "cost") -> "LinearCost":
        try:
            return cls(float(data["intercept"]), float(data["slope"]))
        except (KeyError, TypeError, ValueError) as error:
            raise ValueError(f"{what}: expected {{'intercept': seconds, 'slope': seconds per unit}}, "
                             f"got {data!r} ({error})") from None


def fit_linear(xs: Sequence[float], ys: Sequence[float], relative: bool = True) -> LinearCost:
    """Least-squares ``a + b·x`` through measured points, in relative error, with a, b ≥ 0.

    ``relative=False`` minimizes the absolute error instead, so the largest sizes decide
    the slope: right for costs that grow faster than linearly past the caches (the finish
    phase, whose group-sized allocations page-fault), where what a plan's time depends on
    is the cost of its large groups.

    Sizes span orders of magnitude, so the fit minimizes Σ((a + b·x − y)/y)²: a plain
    least-squares fit would let the largest size's noise decide the intercept, which then
    dominates every small group.  (A zero time counts as one nanosecond for its weight.)
    A cost model with a negative intercept would reward splitting a group forever, and a
    negative slope would reward merging everything, so noise that pushes a coefficient
    below zero is absorbed instead: a fit with a < 0 becomes a line through the origin,
    one with b < 0 the (weighted) constant.  Needs at least two distinct x values.
    """
    xs, ys = [float(x) for x in xs], [float(y) for y in ys]
    if len(xs) != len(ys):
        raise ValueError(f"fit_linear needs as many x as y values, got {len(xs)} and {len(ys)}")
    if len(set(xs)) < 2:
        raise ValueError(f"fit_linear needs at least two distinct sizes, got {xs}; measure at "
                         "two or more sizes, e.g. 2**12 and 2**20")
    if any(not y >= 0 or y == float("inf") for y in ys):
        raise ValueError(f"fit_linear got negative, infinite or NaN values {ys}")
    weights = [1.0 / max(y, 1e-9) ** 2 if relative else 1.0 for y in ys]
    total = sum(weights)
    mean_x = sum(w * x for w, x in zip(weights, xs)) / total
    mean_y = sum(w * y for w, y in zip(weights, ys)) / total
    sxx = sum(w * (x - mean_x) ** 2 for w, x in zip(weights, xs))
    slope = sum(w * (x - mean_x) * (y - mean_y) for w, x, y in zip(weights, xs, ys)) / sxx
    intercept = mean_y - slope * mean_x
    if slope < 0:
        return LinearCost(max(mean_y, 0.0), 0.0)
    if intercept < 0:
        through_origin = sum(w * x * y for w, x, y in zip(weights, xs, ys)) / \
            sum(w * x * x for w, x in zip(weights, xs))
        return LinearCost(0.0, max(through_origin, 0.0))
    return LinearCost(intercept, slope)


@dataclass(frozen=True)
class WireSize:
    """Bytes one rank puts on the wire for n elements: ``header + per_element·n``.

    ``per_element=None`` means the tensor travels at its own width (raw FP32 sends).
    """

    per_element: Optional[float] = None
    header: float = 0.0

    def __call__(self, numel: int, element_size: int) -> float:
        per = element_size if self.per_element is None else self.per_element
        return self.header + per * numel

    def to_dict(self) -> dict:
        return {"per_element": self.per_element, "header": self.header}

    @classmethod
    def from_dict(cls, data, what: str = "wire") -> "WireSize":
        try:
            per = data["per_element"]
            return cls(None if per is None else float(per), float(data.get("header", 0.0)))
        except (KeyError, TypeError, ValueError) as error:
            raise ValueError(f"{what}: expected {{'per_element': bytes, 'header': bytes}}, got "
                             f"{data!r} ({error})") from None


@dataclass(frozen=True)
class CodecCost:
    """What one compressor costs for n elements: encode and decode seconds, wire bytes."""

    encode: LinearCost
    decode: LinearCost
    wire: WireSize

    def to_dict(self) -> dict:
        return {"encode": self.encode.to_dict(), "decode": self.decode.to_dict(),
                "wire": self.wire.to_dict()}

    @classmethod
    def from_dict(cls, data, what: str = "codec") -> "CodecCost":
        if not isinstance(data, dict):
            raise ValueError(f"{what}: expected an object with encode, decode, wire; got {data!r}")
        return cls(LinearCost.from_dict(data.get("encode"), f"{what}.encode"),
                   LinearCost.from_dict(data.get("decode"), f"{what}.decode"),
                   WireSize.from_dict(data.get("wire"), f"{what}.wire"))


# ------------------------------------------------------------------------------- the profile
@dataclass(frozen=True)
class TensorTiming:
    """One gradient of the backward timeline: ready ``ready`` seconds after backward began."""

    name: str
    numel: int
    nbytes: int
    dtype: str
    device: str
    ready: float

    def __post_init__(self):
        if not isinstance(self.numel, int) or self.numel < 1 or not isinstance(self.nbytes, int) \
                or self.nbytes < self.numel or self.nbytes % self.numel:
            raise ValueError(f"tensor {self.name!r}: numel must be ≥ 1 and nbytes a multiple of it, "
                             f"got numel={self.numel!r}, nbytes={self.nbytes!r}")
        if not self.ready >= 0:
            raise ValueError(f"tensor {self.name!r}: ready time must be ≥ 0 s, got {self.ready!r}")

    @property
    def element_size(self) -> int:
        return self.nbytes // self.numel

    def param_info(self) -> ParamInfo:
        return ParamInfo(self.name, self.numel, self.dtype, self.device, self.element_size)


@dataclass
class Profile:
    """Everything the cost model needs about one job at one world size (see module docstring).

    ``compressor`` names the configured compressor (a key of ``codecs``), ``communicator``
    the collective that carries its payloads.  Raw FP16/BF16 sends use the ``fp16``/``bf16``
    codecs when present.  Raw sends always travel by allreduce, as in the optimizer.
    """

    world_size: int
    timeline: List[TensorTiming]
    forward_time: float
    backward_time: float
    compressor: str = "none"
    communicator: str = "allreduce"
    codecs: Dict[str, CodecCost] = field(default_factory=dict)
    collectives: Dict[str, LinearCost] = field(default_factory=dict)
    copy: LinearCost = field(default_factory=LinearCost)
    device: str = "cpu"
    #: Backward runs this many times slower while a collective is in flight (≥ 1; 1.0: no
    #: interference).  See :func:`interference_factor` and :mod:`mergecomp.costmodel`.
    interference: float = 1.0
    #: Seconds of the error-feedback memory's compensate + update for n elements, per group.
    memory: LinearCost = field(default_factory=LinearCost)
    #: Measured seconds of the finish phase (decode, aggregate, average, write-back) of a
    #: group of n elements, per send mode (``compress``, ``fp32``, ``fp16``, ``bf16``); a
    #: mode missing here is priced from its decode cost and copy passes.
    finish: Dict[str, LinearCost] = field(default_factory=dict)
    #: Seconds of the wrapped optimizer's ``step()`` per iteration (after the finish loop).
    optimizer_step: float = 0.0
    #: Measured seconds of a group's hook-side launch (gather copy, memory, codec, collective
    #: start) for n elements, per send mode, timed in the live run; a mode missing here is
    #: priced as copy + memory + codec encode.
    launch: Dict[str, LinearCost] = field(default_factory=dict)
    #: Collectives run this many times slower while backward (and hook-side encoding) runs
    #: beside them (≥ 1; 1.0: not slowed).  See :func:`collective_slowdown_factor`.
    collective_slowdown: float = 1.0

    def __post_init__(self):
        if isinstance(self.world_size, bool) or not isinstance(self.world_size, int) or self.world_size < 1:
            raise ValueError(f"profile world_size must be an integer ≥ 1, got {self.world_size!r}")
        if not self.timeline:
            raise ValueError("profile timeline is empty: record at least one backward pass")
        names = [t.name for t in self.timeline]
        if len(set(names)) != len(names):
            raise ValueError(f"profile timeline names a tensor twice: "
                             f"{sorted({n for n in names if names.count(n) > 1})[:5]}")
        for what in ("forward_time", "backward_time"):
            if not getattr(self, what) >= 0:
                raise ValueError(f"profile {what} must be ≥ 0 s, got {getattr(self, what)!r}")
        last = max(t.ready for t in self.timeline)
        if self.backward_time < last:
            raise ValueError(f"profile backward_time {self.backward_time} s is earlier than the last "
                             f"gradient's ready time {last} s; backward ends after its last gradient")
        k = self.interference
        if isinstance(k, bool) or not isinstance(k, (int, float)) or not 1.0 <= k < float("inf"):
            raise ValueError(f"profile interference must be a finite factor ≥ 1.0 (1.0: collectives "
                             f"do not slow backward), got {k!r}")
        unknown = sorted(set(self.collectives) - set(COLLECTIVE_KINDS))
        if unknown:
            raise ValueError(f"profile has collective kinds {unknown}; known kinds are {COLLECTIVE_KINDS}")
        for what, costs in (("finish", self.finish), ("launch", self.launch)):
            unknown = sorted(set(costs) - set(FINISH_SENDS))
            if unknown:
                raise ValueError(f"profile has {what} costs for send modes {unknown}; known modes "
                                 f"are {FINISH_SENDS}")
            for send, cost in costs.items():
                if not isinstance(cost, LinearCost):
                    raise ValueError(f"profile {what} cost of {send!r} must be a LinearCost, got {cost!r}")
        c = self.collective_slowdown
        if isinstance(c, bool) or not isinstance(c, (int, float)) or not 1.0 <= c < float("inf"):
            raise ValueError(f"profile collective_slowdown must be a finite factor ≥ 1.0 (1.0: "
                             f"backward does not slow collectives), got {c!r}")
        step = self.optimizer_step
        if isinstance(step, bool) or not isinstance(step, (int, float)) or not 0.0 <= step < float("inf"):
            raise ValueError(f"profile optimizer_step must be a finite number of seconds ≥ 0, got {step!r}")

    def params(self) -> List[ParamInfo]:
        """The timeline as ParamInfo, in backward order: what a scheduler's ``plan`` receives."""
        return [t.param_info() for t in self.timeline]

    # -- plain data ------------------------------------------------------------------------
    def to_dict(self) -> dict:
        return {
            "format": FORMAT, "world_size": self.world_size, "device": self.device,
            "compressor": self.compressor, "communicator": self.communicator,
            "forward_time": self.forward_time, "backward_time": self.backward_time,
            "timeline": [{"name": t.name, "numel": t.numel, "nbytes": t.nbytes, "dtype": t.dtype,
                          "device": t.device, "ready": t.ready} for t in self.timeline],
            "codecs": {k: v.to_dict() for k, v in self.codecs.items()},
            "collectives": {k: v.to_dict() for k, v in self.collectives.items()},
            "copy": self.copy.to_dict(), "interference": self.interference,
            "memory": self.memory.to_dict(),
            "finish": {k: v.to_dict() for k, v in self.finish.items()},
            "optimizer_step": self.optimizer_step,
            "launch": {k: v.to_dict() for k, v in self.launch.items()},
            "collective_slowdown": self.collective_slowdown,
        }

    @classmethod
    def from_dict(cls, data: dict) -> "Profile":
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            found = data.get("format") if isinstance(data, dict) else type(data).__name__
            raise ValueError(f"not a mergecomp profile: expected format {FORMAT!r}, found {found!r}")
        try:
            timeline = [TensorTiming(str(t["name"]), int(t["numel"]), int(t["nbytes"]), str(t["dtype"]),
                                     str(t["device"]), float(t["ready"])) for t in data["timeline"]]
            return cls(
                world_size=int(data["world_size"]), timeline=timeline,
                forward_time=float(data["forward_time"]), backward_time=float(data["backward_time"]),
                compressor=str(data.get("compressor", "none")),
                communicator=str(data.get("communicator", "allreduce")),
                codecs={k: CodecCost.from_dict(v, f"codecs.{k}") for k, v in data.get("codecs", {}).items()},
                collectives={k: LinearCost.from_dict(v, f"collectives.{k}")
                             for k, v in data.get("collectives", {}).items()},
                copy=LinearCost.from_dict(data.get("copy", {"intercept": 0, "slope": 0}), "copy"),
                device=str(data.get("device", "cpu")),
                interference=float(data.get("interference", 1.0)),
                memory=LinearCost.from_dict(data.get("memory", {"intercept": 0, "slope": 0}), "memory"),
                finish={k: LinearCost.from_dict(v, f"finish.{k}") for k, v in data.get("finish", {}).items()},
                optimizer_step=float(data.get("optimizer_step", 0.0)),
                launch={k: LinearCost.from_dict(v, f"launch.{k}") for k, v in data.get("launch", {}).items()},
                collective_slowdown=float(data.get("collective_slowdown", 1.0)))
        except (KeyError, TypeError, AttributeError) as error:
            raise ValueError(f"mergecomp profile is missing or has a malformed field: {error!r}") from None

    def to_json(self, indent: Optional[int] = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_json(cls, text: str) -> "Profile":
        return cls.from_dict(json.loads(text))

    def save(self, path: str) -> None:
        with open(path, "w") as f:
            f.write(self.to_json() + "\n")

    @classmethod
    def load(cls, path: str) -> "Profile":
        try:
            with open(path) as f:
                text = f.read()
        except OSError as error:
            raise ValueError(f"cannot read profile {path!r}: {error.strerror}; write one with "
                             "the benchmark's --profile-out") from None
        try:
            return cls.from_json(text)
        except json.JSONDecodeError as error:
            raise ValueError(f"profile {path!r} is not valid JSON: {error}") from None


# ------------------------------------------------------------------------------ measurement
def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class BackwardTimer:
    """Records when each gradient becomes ready during backward, with its own hooks.

    It registers a post-accumulate-grad hook on every trainable parameter (next to any
    the optimizer has) and times ``iterations`` backward passes after ``warmup`` ones::

        timer = BackwardTimer(model.named_parameters(), iterations=5)
        while not timer.done:
            with timer.forward():
                loss = loss_fn(model(inputs), targets)
            with timer.backward():
                loss.backward()
            optimizer.step(); optimizer.zero_grad()
        timeline, forward_time, backward_time = timer.result()
        timer.remove()

    Ready times are medians over the timed passes; the order is that of the first timed
    pass.  On CUDA each hook synchronizes the device (``synchronize=True`` by default
    there), so a ready time is when the gradient exists, not when its kernel was queued;
    this slows the timed passes a little, and the profile says so by its device field.
    """

    def __init__(self, named_parameters: Iterable[Tuple[str, torch.nn.Parameter]],
                 iterations: int = 5, warmup: int = 1, synchronize: Optional[bool] = None):
        if isinstance(iterations, bool) or not isinstance(iterations, int) or iterations < 1:
            raise ValueError(f"BackwardTimer iterations must be an integer ≥ 1, got {iterations!r}")
        if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
            raise ValueError(f"BackwardTimer warmup must be an integer ≥ 0, got {warmup!r}")
        self._params = [(n, p) for n, p in named_parameters if p.requires_grad]
        if not self._params:
            raise ValueError("BackwardTimer got no trainable parameters; pass model.named_parameters()")
        self.device = self._params[0][1].device
        self.synchronize = (self.device.type == "cuda") if synchronize is None else bool(synchronize)
        self.iterations, self.warmup = iterations, warmup
        self._passes = 0
        self._start: Optional[float] = None
        self._current: Dict[str, float] = {}
        self._order: List[str] = []
        self._ready: Dict[str, List[float]] = {n: [] for n, _ in self._params}
        self._forward: List[float] = []
        self._backward: List[float] = []
        self._hooks = [p.register_post_accumulate_grad_hook(self._hook(n)) for n, p in self._params]

    @property
    def done(self) -> bool:
        return self._passes >= self.warmup + self.iterations

    @property
    def _timing(self) -> bool:
        return self.warmup <= self._passes < self.warmup + self.iterations

    def _hook(self, name: str):
        def hook(param):
            if self._start is None or name in self._current:
                return
            if self.synchronize:
                _synchronize(self.device)
            self._current[name] = time.perf_counter() - self._start
        return hook

    @contextlib.contextmanager
    def forward(self):
        """Time the forward pass (and loss) inside this block."""
        if self.synchronize:
            _synchronize(self.device)
        start = time.perf_counter()
        yield
        if self.synchronize:
            _synchronize(self.device)
        if self._timing:
            self._forward.append(time.perf_counter() - start)

    @contextlib.contextmanager
    def backward(self):
        """Time ``loss.backward()`` inside this block and record its gradients' ready times."""
        if self.synchronize:
            _synchronize(self.device)
        self._current = {}
        self._start = time.perf_counter()
        try:
            yield
            if self.synchronize:
                _synchronize(self.device)
            total = time.perf_counter() - self._start
        finally:
            self._start = None
        if self._timing:
            if not self._order:
                self._order = sorted(self._current, key=self._current.get)
            for name, ready in self._current.items():
                self._ready[name].append(ready)
            self._backward.append(total)
        self._passes += 1

    def result(self) -> Tuple[List[TensorTiming], float, float]:
        """(timeline in backward order, forward seconds, backward seconds), medians."""
        if not self._backward:
            raise ValueError(f"BackwardTimer has timed no backward pass yet ({self._passes} passes "
                             f"seen, {self.warmup} warm-up); run backward inside timer.backward()")
        backward = statistics.median(self._backward)
        forward = statistics.median(self._forward) if self._forward else 0.0
        by_name = dict(self._params)
        # Parameters that never got a gradient go last, as the optimizer orders them.
        order = self._order + [n for n, _ in reversed(self._params) if n not in set(self._order)]
        timeline = []
        for name in order:
            p = by_name[name]
            ready = statistics.median(self._ready[name]) if self._ready[name] else backward
            timeline.append(TensorTiming(name, p.numel(), p.numel() * p.element_size(), str(p.dtype),
                                         str(p.device), min(ready, backward)))
        return timeline, forward, backward

    def remove(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks = []


def _best_time(fn, device: torch.device, repeats: int) -> float:
    """The fastest of ``repeats`` runs: noise (other processes, interrupts) only adds time."""
    times = []
    for _ in range(repeats):
        _synchronize(device)
        start = time.perf_counter()
        fn()
        _synchronize(device)
        times.append(time.perf_counter() - start)
    return min(times)


def _check_sizes(sizes: Sequence[int], what: str) -> List[int]:
    sizes = list(sizes)
    if len(set(sizes)) < 2 or any(isinstance(s, bool) or not isinstance(s, int) or s < 1 for s in sizes):
        raise ValueError(f"{what} must be at least two distinct positive integers, got {sizes}")
    return sizes


def _encode_once(compressor, tensor: torch.Tensor):
    """(payload tuple, ctx or None, wire bytes): one compression of ``tensor``.

    A multi-round compressor (PowerSGD) is driven through its rounds on this rank alone,
    each request summed over one rank (itself); its wire bytes are those of every round.
    """
    from .compressors.base import payload_nbytes
    if compressor.multi_round:
        rounds = compressor.rounds(tensor, "profile")
        wire = 0
        try:
            request = next(rounds)
            while True:
                wire += payload_nbytes(request.tensors)
                request = rounds.send(request.tensors)
        except StopIteration:
            return None, None, wire
    payload, ctx = compressor.compress(tensor, "profile")
    return payload, ctx, payload_nbytes(payload)


def measure_compression_cost(compressor, sizes: Sequence[int] = (2 ** 12, 2 ** 16, 2 ** 20),
                             device="cpu", repeats: int = 5, dtype=torch.float32) -> CodecCost:
    """Time compress and decompress of ``compressor`` on ``device`` at each size; fit a + b·n.

    Inputs are standard-normal tensors (a gradient's distribution matters little to the
    cost of these kernels, but it does to value-dependent payload sizes such as DGC's, for
    which the fitted wire size is an estimate).  The wire size is fitted to the payload
    bytes actually produced.  Multi-round compressors have all their work in ``encode``.
    """
    sizes = _check_sizes(sizes, "measure_compression_cost sizes")
    device = torch.device(device)
    generator = torch.Generator(device=device).manual_seed(0)
    encode, decode, wire = [], [], []
    for n in sizes:
        tensor = torch.randn(n, generator=generator, device=device, dtype=dtype)
        payload, ctx, nbytes = _encode_once(compressor, tensor)  # warm-up, and the wire size
        wire.append(nbytes)
        encode.append(_best_time(lambda: _encode_once(compressor, tensor), device, repeats))
        if payload is None:
            decode.append(0.0)
        else:
            compressor.decompress(payload, ctx)
            decode.append(_best_time(lambda: compressor.decompress(payload, ctx), device, repeats))
    wire_fit = _fit_wire(sizes, wire)
    return CodecCost(fit_linear(sizes, encode), fit_linear(sizes, decode), wire_fit)


def _fit_wire(sizes: Sequence[int], nbytes: Sequence[int]) -> WireSize:
    line = fit_linear(sizes, nbytes)
    return WireSize(line.slope, line.intercept)


def measure_copy_cost(sizes: Sequence[int] = (2 ** 14, 2 ** 18, 2 ** 22), device="cpu",
                      repeats: int = 5) -> LinearCost:
    """Seconds to copy ``x`` bytes on ``device`` (gather into a fused buffer, write-back)."""
    sizes = _check_sizes(sizes, "measure_copy_cost sizes")
    device = torch.device(device)
    times = []
    for nbytes in sizes:
        source = torch.empty(nbytes, dtype=torch.uint8, device=device).fill_(1)
        target = torch.empty_like(source)
        target.copy_(source)
        times.append(_best_time(lambda: target.copy_(source), device, repeats))
    return fit_linear(sizes, times)


def measure_memory_cost(memory, compressor, sizes: Sequence[int] = (2 ** 12, 2 ** 16, 2 ** 20),
                        device="cpu", repeats: int = 3, dtype=torch.float32) -> LinearCost:
    """Seconds of ``memory.compensate`` + ``memory.update`` for n elements; fit a + b·n.

    Runs on a deep copy of ``memory`` under a probe name, so the job's residuals are
    neither read nor changed.  ``update`` gets a payload of ``compressor`` (as in the
    communicator); for a multi-round compressor only ``compensate`` runs, as there.
    """
    import copy as copying
    sizes = _check_sizes(sizes, "measure_memory_cost sizes")
    device = torch.device(device)
    probe = copying.deepcopy(memory)
    generator = torch.Generator(device=device).manual_seed(0)
    times = []
    for n in sizes:
        name = f"profile-memory-{n}"
        tensor = torch.randn(n, generator=generator, device=device, dtype=dtype)
        compensated = probe.compensate(tensor, name)
        if compressor.multi_round:
            times.append(_best_time(lambda: probe.compensate(tensor, name), device, repeats))
            continue
        payload, ctx = compressor.compress(compensated, name)
        probe.update(compensated, name, compressor, payload, ctx)

        def once():
            probe.update(probe.compensate(tensor, name), name, compressor, payload, ctx)
        times.append(_best_time(once, device, repeats))
    return fit_linear(sizes, times)


def measure_finish_cost(communicator, sizes: Sequence[int], device="cpu", repeats: int = 3,
                        dtype=torch.float32) -> LinearCost:
    """Seconds of one group's finish phase for n elements, through ``communicator``; fit a + b·n.

    What ``DistributedOptimizer.synchronize`` does for a group once its collective is
    done: ``communicator.finish`` (decode, aggregate, average) on a completed handle, then
    the write-back of the average into the parameters' gradients (one copy into existing
    tensors).  The handle's result is what the collective would return at this world size:
    for ``allgather`` one payload per rank (copies of a real payload of this compressor,
    each in its own memory, as received), for ``allreduce`` the summed payload.  So the
    probe runs the code the optimizer runs, allocations and page faults of group-sized
    buffers included; sizes should reach the largest group a plan may form.  Each size
    is timed ``repeats`` times after one warm-up; its time is the median (not the
    fastest: the allocations' cost recurs every step).  The fit minimizes the absolute
    error (see :func:`fit_linear`): the cost per element grows past the caches, and the
    large groups are the ones whose finish decides a plan's time.

    Local work only (no collective).  Communicators whose finish phase runs collectives
    (``ps``'s second phase, multi-round compressors) cannot be probed this way.
    """
    from .backends.base import Completed
    from .communicators.base import Handle
    sizes = _check_sizes(sizes, "measure_finish_cost sizes")
    kind = getattr(communicator, "name", None)
    if kind not in ("allreduce", "allgather"):
        raise ValueError(f"measure_finish_cost probes the allreduce and allgather communicators; "
                         f"{kind!r} runs collectives in its finish phase")
    if communicator.compressor.multi_round:
        raise ValueError(f"compressor {communicator.compressor.name!r} is multi-round: its finish "
                         "phase runs collectives and cannot be probed locally")
    device = torch.device(device)
    world = communicator.backend.size
    generator = torch.Generator(device=device).manual_seed(0)
    times = []
    for n in sizes:
        tensor = torch.randn(n, generator=generator, device=device, dtype=dtype)
        payload, ctx = communicator.compressor.compress(tensor, f"profile-finish-{n}")
        target = torch.zeros(n, device=device, dtype=dtype)

        def once():
            if kind == "allgather":
                result = [tuple(part.clone() for part in payload) for _ in range(world)]
            else:
                result = tuple(part.clone() for part in payload)
            _synchronize(device)
            start = time.perf_counter()
            averaged = communicator.finish(Handle("profile-finish", tensor.shape,
                                                  Completed(result), ctx=ctx))
            target.copy_(averaged.reshape(-1))
            _synchronize(device)
            return time.perf_counter() - start
        once()
        times.append(statistics.median(once() for _ in range(repeats)))
        tensor = payload = target = None  # free the group-sized buffers before the next size
    return fit_linear(sizes, times, relative=False)


def measure_collective_cost(backend, kind: str, sizes: Sequence[int] = (2 ** 12, 2 ** 18, 2 ** 22),
                            repeats: int = 3, device=None) -> LinearCost:
    """Time one collective through ``backend`` at each payload size (bytes per rank); fit α + β·B.

    A collective: every rank must call this with the same ``kind``, ``sizes`` and
    ``repeats`` in the same order.  Each size is timed ``repeats`` times after one warm-up,
    each time starting from a barrier; a rank's time is its median, and the size's time
    is the maximum over ranks (the slowest rank decides when a collective is over).
    The backend's byte counters are restored afterwards, so probes do not show up in the
    benchmark's bytes per iteration.
    """
    if kind not in COLLECTIVE_KINDS:
        raise ValueError(f"unknown collective kind {kind!r}; measure one of {COLLECTIVE_KINDS}")
    sizes = _check_sizes(sizes, "measure_collective_cost sizes")
    device = torch.device(device if device is not None else getattr(backend, "device", "cpu"))
    world = backend.size
    counters = (backend.bytes_sent, backend.collectives)
    local, actual = [], []
    for nbytes in sizes:
        if kind == "alltoall":
            per_rank = max(1, nbytes // world)
            chunks = [torch.ones(per_rank, dtype=torch.uint8, device=device) for _ in range(world)]
            actual.append(per_rank * world)

            def op():
                backend.alltoall(chunks)
        else:
            numel = max(1, nbytes // 4)
            tensor = torch.ones(numel, dtype=torch.float32, device=device)
            actual.append(numel * 4)
            if kind == "allreduce":
                def op():
                    backend.allreduce_async([tensor]).wait()
            else:
                def op():
                    backend.allgather_async([tensor], same_shapes=True).wait()
        times = []
        for attempt in range(repeats + 1):
            backend.barrier()
            _synchronize(device)
            start = time.perf_counter()
            op()
            _synchronize(device)
            if attempt:
                times.append(time.perf_counter() - start)
        local.append(statistics.median(times))
    everyone = backend.allgather_object(local)
    slowest = [max(per_size) for per_size in zip(*everyone)]
    backend.bytes_sent, backend.collectives = counters
    return fit_linear(actual, slowest)


def interference_factor(alone: Sequence[float], overlapped: Sequence[float]) -> float:
    """How many times longer backward takes while a collective is in flight.

    ``alone``: backward durations with no collective running; ``overlapped``: durations of
    passes during which a collective was in flight from start to end.  The factor is the
    ratio of the medians (medians: a pass hit by an unrelated stall must not decide it),
    at least 1.0 — noise can make the overlapped passes faster, but a collective does not
    speed compute up, and the cost model needs k ≥ 1 (see :mod:`mergecomp.costmodel`).
    """
    alone, overlapped = [float(x) for x in alone], [float(x) for x in overlapped]
    if not alone or not overlapped:
        raise ValueError(f"interference_factor needs durations with and without a concurrent "
                         f"collective, got {len(alone)} alone and {len(overlapped)} overlapped")
    if any(not x > 0 or x == float("inf") for x in alone + overlapped):
        raise ValueError(f"interference_factor needs finite durations > 0 s, got {alone} and {overlapped}")
    return max(1.0, statistics.median(overlapped) / statistics.median(alone))


def collective_slowdown_factor(alone: Sequence[float], overlapped: Sequence[float]) -> float:
    """How many times longer a collective takes while backward runs beside it.

    ``alone``: durations of a collective with nothing else running; ``overlapped``:
    durations of the same collective launched during backward and done before backward
    ended (so compute ran beside it from start to end).  The ratio of the medians, at
    least 1.0 (compute does not speed a collective up; the cost model needs c ≥ 1).
    """
    alone, overlapped = [float(x) for x in alone], [float(x) for x in overlapped]
    if not alone or not overlapped:
        raise ValueError(f"collective_slowdown_factor needs durations of the collective alone and "
                         f"under backward, got {len(alone)} alone and {len(overlapped)} overlapped")
    if any(not x > 0 or x == float("inf") for x in alone + overlapped):
        raise ValueError(f"collective_slowdown_factor needs finite durations > 0 s, got {alone} "
                         f"and {overlapped}")
    return max(1.0, statistics.median(overlapped) / statistics.median(alone))


def fit_live_costs(samples: Dict[str, Sequence[Tuple[int, float]]]) -> Dict[str, LinearCost]:
    """Cost lines per send mode from ``(elements, seconds)`` samples timed in the live run.

    Sizes with several samples count with their median (a stall must not decide a line).
    Two or more distinct sizes: :func:`fit_linear` in absolute error, so the large groups
    decide the slope; one size: a line through the origin through its median; a send mode
    without samples is left out (the probes price it).
    """
    costs = {}
    for send, pairs in samples.items():
        if send not in FINISH_SENDS:
            raise ValueError(f"fit_live_costs got samples of send mode {send!r}; known modes are "
                             f"{FINISH_SENDS}")
        by_size: Dict[int, List[float]] = {}
        for numel, seconds in pairs:
            if isinstance(numel, bool) or not isinstance(numel, int) or numel < 1:
                raise ValueError(f"fit_live_costs: group sizes must be integers ≥ 1, got {numel!r}")
            if not seconds >= 0 or seconds == float("inf"):
                raise ValueError(f"fit_live_costs: seconds must be finite and ≥ 0, got {seconds!r}")
            by_size.setdefault(numel, []).append(float(seconds))
        if not by_size:
            continue
        sizes = sorted(by_size)
        medians = [statistics.median(by_size[n]) for n in sizes]
        if len(sizes) == 1:
            costs[send] = LinearCost(0.0, medians[0] / sizes[0])
        else:
            costs[send] = fit_linear(sizes, medians, relative=False)
    return costs


def assemble_profile(timer: BackwardTimer, compressor_name: str, compressor, backend,
                     communicator: str = "allreduce",
                     compression_sizes: Sequence[int] = (2 ** 12, 2 ** 16, 2 ** 20),
                     collective_sizes: Sequence[int] = (2 ** 12, 2 ** 18, 2 ** 22)) -> Profile:
    """A full profile from a finished :class:`BackwardTimer` plus codec, copy and collective probes.

    Collective: call on every rank.  Measures the configured compressor and the FP16/BF16
    casts (for raw half-precision sends), allreduce always (raw sends use it), and the
    collectives of ``communicator`` (allgather; PS = alltoall + allgather).
    """
    timeline, forward, backward = timer.result()
    return profile_from_timeline(timeline, forward, backward, timer.device, compressor_name,
                                 compressor, backend, communicator, compression_sizes,
                                 collective_sizes)


def profile_from_timeline(timeline: List[TensorTiming], forward: float, backward: float, device,
                          compressor_name: str, compressor, backend, communicator: str = "allreduce",
                          compression_sizes: Sequence[int] = (2 ** 12, 2 ** 16, 2 ** 20),
                          collective_sizes: Sequence[int] = (2 ** 12, 2 ** 18, 2 ** 22),
                          memory=None, copy_sizes: Sequence[int] = (2 ** 14, 2 ** 18, 2 ** 22),
                          communicator_object=None, finish_sizes: Optional[Sequence[int]] = None,
                          optimizer_step: float = 0.0) -> Profile:
    """A full profile from a measured backward timeline (however recorded) plus the probes.

    Collective: call on every rank (see :func:`assemble_profile`).  ``memory``: the
    job's error-feedback memory, whose cost is measured on a copy (None: not measured,
    zero).  Sizes should reach the largest group a plan may form: costs measured on
    cache-sized buffers extrapolate badly to tens of megabytes.

    ``communicator_object``: the job's communicator; when given, the finish phase of
    compressed groups is measured through it and that of raw FP32/FP16/BF16 groups through
    allreduce communicators with the casts (:func:`measure_finish_cost`, at
    ``finish_sizes``, by default ``compression_sizes``).  ``optimizer_step``: the wrapped
    optimizer's measured step seconds, stored as they are.
    """
    from . import compressors
    device = torch.device(device)
    codecs = {compressor_name: measure_compression_cost(compressor, compression_sizes, device)}
    for half in ("fp16", "bf16"):
        if half not in codecs:
            codecs[half] = measure_compression_cost(compressors.create(half), compression_sizes, device)
    kinds = ["allreduce"] + {"allreduce": [], "allgather": ["allgather"],
                             "ps": ["alltoall", "allgather"]}.get(communicator, [])
    collectives = {kind: measure_collective_cost(backend, kind, collective_sizes) for kind in kinds}
    finish = {}
    if communicator_object is not None:
        finish = measure_finish_costs(communicator_object, compressor_name,
                                      compression_sizes if finish_sizes is None else finish_sizes, device)
    return Profile(world_size=backend.size, timeline=timeline, forward_time=forward,
                   backward_time=backward, compressor=compressor_name, communicator=communicator,
                   codecs=codecs, collectives=collectives,
                   copy=measure_copy_cost(copy_sizes, device=device), device=str(device),
                   memory=LinearCost() if memory is None else
                   measure_memory_cost(memory, compressor, compression_sizes, device),
                   finish=finish, optimizer_step=optimizer_step)


def measure_finish_costs(communicator, compressor_name: str, sizes: Sequence[int],
                         device="cpu") -> Dict[str, LinearCost]:
    """:func:`measure_finish_cost` of every send mode the cost model prices: raw FP32,
    FP16 and BF16 groups (an allreduce communicator with the cast, as the optimizer builds
    for raw groups) and, when ``communicator`` can be probed locally, compressed groups."""
    from . import communicators, compressors, memories
    costs = {}
    for send in ("fp32", "fp16", "bf16"):
        raw = communicators.create("allreduce", compressor=compressors.create("none" if send == "fp32" else send),
                                   memory=memories.create("none"), backend=communicator.backend)
        costs[send] = measure_finish_cost(raw, sizes, device)
    if compressor_name in ("none", "fp32"):
        costs["compress"] = costs["fp32"]
    elif getattr(communicator, "name", None) in ("allreduce", "allgather") \
            and not communicator.compressor.multi_round:
        costs["compress"] = measure_finish_cost(communicator, sizes, device)
    return costs
