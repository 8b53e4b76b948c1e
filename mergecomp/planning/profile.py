"""Profile: what the compression scheduler knows about one training job, as plain data.

The cost model (:mod:`mergecomp.planning.costmodel`) predicts the iteration time of a Plan from
four kinds of measurement, all plain data here so that a profile can be saved on one run
and planned from on another (the probes that measure them are in :mod:`mergecomp.planning.measure`):

* the **backward timeline**: for each gradient, in backward order, when it became ready
  (seconds after backward started), plus the forward and backward totals — measured by
  :class:`~mergecomp.planning.measure.BackwardTimer`;
* the **codec costs**: compress and decompress time of each compressor as ``a + b·n`` for n
  elements, and the bytes it puts on the wire for n elements (``header + per_element·n``),
  counted from real payloads — :func:`~mergecomp.planning.measure.measure_compression_cost`;
* the **collective costs** at this world size, ``α + β·bytes`` per collective kind
  (allreduce, allgather, alltoall), timed through the backend on all ranks —
  :func:`~mergecomp.planning.measure.measure_collective_cost`;
* the **copy cost** per byte (gathering gradients into a fused buffer, writing them back) —
  :func:`~mergecomp.planning.measure.measure_copy_cost`;
* the **memory cost** per element: the error-feedback memory's ``compensate`` and
  ``update``, which every group (raw groups share the compressed groups' memory) runs in
  its hook before the collective — :func:`~mergecomp.planning.measure.measure_memory_cost`.  DGC's
  momentum correction makes several passes over the group, on a CPU comparable to the
  compression itself; zero (the default, and old profiles) for no memory;
* the **interference** factor k ≥ 1: how many times longer backward takes while a
  collective is in flight (the communication library's threads and the kernel's network
  stack compete with it for CPU time and memory bandwidth) — :func:`interference_factor`
  of backward passes timed with and without a concurrent collective, measured on the live
  run by the ``auto`` scheduler.  1.0 (no interference) is the default, so profiles saved
  before the field existed load unchanged;
* the **finish cost** per send mode: seconds of a group's finish phase after its
  collective — decode, aggregate, average and the write-back into ``p.grad`` — run through
  the job's own communicator on payloads of the world size (allgather: N payloads decoded,
  summed) at sizes up to the model's largest group —
  :func:`~mergecomp.planning.measure.measure_finish_cost`.  On a CPU this phase allocates and
  touches fresh buffers of the group's size for every payload, which probes of a few
  megabytes do not see; profiles without it (the default, empty) fall back to the codec's
  decode cost plus copy passes.  A ``"compress:<name>"`` mode (a flat allgather beside a
  hierarchical job) has its own line when its communicator can be probed locally;
* the **optimizer step**: seconds of the wrapped optimizer's own ``step()`` per iteration,
  timed on the live run (0.0 in profiles saved before the field existed);
* the **live launch and finish costs** per send mode: the hook-side launch (gather copy,
  memory, codec, collective start) and the finish phase (decode … write-back) of every
  group, timed inside the optimizer while the ``auto`` scheduler runs its candidate plans
  (:func:`fit_live_costs`).  An isolated probe allocates fresh buffers and runs while the
  other ranks idle; in the training loop the allocator serves memory the process already
  holds and every rank competes for the same cores, so the probes misjudge both phases
  (the finish too high, the launch too low).  A live
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

import dataclasses
import json
import math
import statistics
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

from ..plan import ParamInfo
from ..communicators.cost import LinearCost, WireSize  # the cost terms, a leaf the communicators import too

FORMAT = "mergecomp-profile/1"
COLLECTIVE_KINDS = ("allreduce", "allgather", "alltoall")
#: Collectives of one link of a node layout (the hierarchical communicator's): inside a node,
#: and between the peers of one local rank across nodes.
LINK_KINDS = ("intra_allreduce", "intra_allgather", "inter_allreduce", "inter_allgather")
#: Send modes whose finish phase a profile can hold a measured cost for; so can every
#: ``"compress:<communicator>"`` mode (:func:`is_measured_send`).
FINISH_SENDS = ("compress", "fp32", "fp16", "bf16")
#: The prefix of a send mode that names the communicator of a compressed group
#: (``mergecomp.plan.COMPRESS_VIA``).
_COMPRESS_VIA = "compress:"


def is_measured_send(send) -> bool:
    """Whether a profile may hold a measured finish or launch cost for send mode ``send``:
    one of :data:`FINISH_SENDS`, or ``"compress:<communicator>"``."""
    return isinstance(send, str) and (send in FINISH_SENDS or
                                      (send.startswith(_COMPRESS_VIA) and len(send) > len(_COMPRESS_VIA)))


# ------------------------------------------------------------------------------ linear costs
def _checked_points(xs: Sequence[float], ys: Sequence[float], fit: str) -> Tuple[List[float], List[float]]:
    """``xs`` and ``ys`` as floats, or a ValueError naming ``fit`` and what is wrong: as many
    of each, two distinct sizes at least, times finite and ≥ 0."""
    xs, ys = [float(x) for x in xs], [float(y) for y in ys]
    if len(xs) != len(ys):
        raise ValueError(f"{fit} needs as many x as y values, got {len(xs)} and {len(ys)}")
    if len(set(xs)) < 2:
        raise ValueError(f"{fit} needs at least two distinct sizes, got {xs}; measure at "
                         "two or more sizes, e.g. 2**12 and 2**20")
    if any(not y >= 0 or y == float("inf") for y in ys):
        raise ValueError(f"{fit} got negative, infinite or NaN values {ys}")
    return xs, ys


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
    xs, ys = _checked_points(xs, ys, "fit_linear")
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


def fit_from_smallest(xs: Sequence[float], ys: Sequence[float]) -> LinearCost:
    """``a + b·x`` through the smallest size's time, its slope fitted to the larger sizes
    in absolute error, with a, b ≥ 0: the smallest probe gives the per-call cost, the large
    sizes the cost per element.

    For codec and memory probes from a few thousand elements to the whole model.  Their
    cost per element grows past the caches (and with the fresh output buffers a decode
    allocates), so a fit in relative error (:func:`fit_linear`) follows the cache-sized
    probes and prices a group of tens of megabytes several times too low; a plain
    least-squares fit lets the largest size's noise decide the intercept, which then
    dominates every small group.  Needs at least two distinct x values.
    """
    xs, ys = _checked_points(xs, ys, "fit_from_smallest")
    x0 = min(xs)
    y0 = min(y for x, y in zip(xs, ys) if x == x0)
    slope = sum((x - x0) * (y - y0) for x, y in zip(xs, ys)) / sum((x - x0) ** 2 for x in xs)
    slope = max(slope, 0.0)
    return LinearCost(max(y0 - slope * x0, 0.0), slope)


@dataclass(frozen=True)
class CodecCost:
    """What one compressor costs for n elements: encode and decode seconds, wire bytes.

    ``add``: for compressors that sum payloads in place (``Compressor.sums_in_place``),
    the seconds each payload after the first adds to ``decompress_sum``; None for the
    others, whose every payload is decoded in full and then aggregated."""

    encode: LinearCost
    decode: LinearCost
    wire: WireSize
    add: Optional[LinearCost] = None

    def to_dict(self) -> dict:
        data = {"encode": self.encode.to_dict(), "decode": self.decode.to_dict(),
                "wire": self.wire.to_dict()}
        if self.add is not None:  # only then: older profiles and their digests stay as they were
            data["add"] = self.add.to_dict()
        return data

    @classmethod
    def from_dict(cls, data, what: str = "codec") -> "CodecCost":
        if not isinstance(data, dict):
            raise ValueError(f"{what}: expected an object with encode, decode, wire; got {data!r}")
        return cls(LinearCost.from_dict(data.get("encode"), f"{what}.encode"),
                   LinearCost.from_dict(data.get("decode"), f"{what}.decode"),
                   WireSize.from_dict(data.get("wire"), f"{what}.wire"),
                   LinearCost.from_dict(data["add"], f"{what}.add") if "add" in data else None)


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
    #: interference).  See :func:`interference_factor` and :mod:`mergecomp.planning.costmodel`.
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
    #: The node layout a hierarchical communicator prices with: ``{"local_size": L,
    #: "inner": name}`` (empty: a flat job).  Its links' costs are ``collectives``'
    #: ``intra_*`` and ``inter_*`` kinds.
    hierarchy: Dict[str, Any] = field(default_factory=dict)

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
        unknown = sorted(set(self.collectives) - set(COLLECTIVE_KINDS) - set(LINK_KINDS))
        if unknown:
            raise ValueError(f"profile has collective kinds {unknown}; known kinds are "
                             f"{COLLECTIVE_KINDS + LINK_KINDS}")
        for what, costs in (("finish", self.finish), ("launch", self.launch)):
            unknown = sorted(send for send in costs if not is_measured_send(send))
            if unknown:
                raise ValueError(f"profile has {what} costs for send modes {unknown}; known modes "
                                 f"are {FINISH_SENDS} and 'compress:<communicator>'")
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
            "hierarchy": dict(self.hierarchy),
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
                collective_slowdown=float(data.get("collective_slowdown", 1.0)),
                hierarchy=dict(data.get("hierarchy", {})))
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


# ------------------------------------------------------------------------ compute speed
def scaled_compute(profile: Profile, factor: float) -> Profile:
    """``profile`` with every processor-side time multiplied by ``factor``: forward, backward
    and the gradients' ready times, codecs, copies, error-feedback memory, launch and finish
    phases, the optimizer step.  The collectives (the network) stay as they are.

    What-if questions ("a device twice as fast": 0.5), and calibration to the speed a
    host actually ran at: on a shared machine the same host's compute speed drifts
    between a profile and the minutes after it, which no network model can predict
    (the ``auto`` scheduler compares its check's visits at one speed with it, the
    simulator check rescales a profile to a timed window).
    """
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not factor > 0:
        raise ValueError(f"a compute scale must be a positive factor (0.5: twice as fast), got {factor!r}")
    codecs = {name: dataclasses.replace(codec, encode=_scaled(codec.encode, factor),
                                        decode=_scaled(codec.decode, factor),
                                        add=None if codec.add is None else _scaled(codec.add, factor))
              for name, codec in profile.codecs.items()}
    return dataclasses.replace(
        profile,
        timeline=[dataclasses.replace(t, ready=t.ready * factor) for t in profile.timeline],
        forward_time=profile.forward_time * factor, backward_time=profile.backward_time * factor,
        codecs=codecs, copy=_scaled(profile.copy, factor), memory=_scaled(profile.memory, factor),
        finish={k: _scaled(v, factor) for k, v in profile.finish.items()},
        launch={k: _scaled(v, factor) for k, v in profile.launch.items()},
        optimizer_step=profile.optimizer_step * factor)


def with_density(profile: Profile, scale: float) -> Profile:
    """``profile`` with the configured compressor sending ``scale`` times its configured
    density (or rank, or bits): the payload bytes per element scale with it (a sparsifier
    sends ``scale`` times the values and indices, a low-rank factorisation ``scale`` times
    the columns, a low-bit compressor ``scale`` times the bits, at most 8), the header does not.  The quality controller's scales reach the planner this
    way (:attr:`~mergecomp.schedulers.base.SchedulerContext.density_scale`): a plan is
    priced at the bytes the groups send now, not at the configured setting's."""
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not (scale >= 1.0 and math.isfinite(scale)):
        raise ValueError(f"a density scale must be a finite number ≥ 1 (1: the configured setting), got {scale!r}")
    codec = profile.codecs.get(profile.compressor)
    if scale == 1.0 or codec is None or codec.wire.per_element is None:
        return profile
    wire = dataclasses.replace(codec.wire, per_element=codec.wire.per_element * scale)
    return dataclasses.replace(profile, codecs={**profile.codecs,
                                                profile.compressor: dataclasses.replace(codec, wire=wire)})


def _scaled(cost: LinearCost, factor: float) -> LinearCost:
    return LinearCost(cost.intercept * factor, cost.slope * factor)


# ------------------------------------------------------------------ fits of live samples
def interference_factor(alone: Sequence[float], overlapped: Sequence[float]) -> float:
    """How many times longer backward takes while a collective is in flight.

    ``alone``: backward durations with no collective running; ``overlapped``: durations of
    passes during which a collective was in flight from start to end.  The factor is the
    ratio of the medians (medians: a pass hit by an unrelated stall must not decide it),
    at least 1.0 — noise can make the overlapped passes faster, but a collective does not
    speed compute up, and the cost model needs k ≥ 1 (see :mod:`mergecomp.planning.costmodel`).
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
        if not is_measured_send(send):
            raise ValueError(f"fit_live_costs got samples of send mode {send!r}; known modes are "
                             f"{FINISH_SENDS} and 'compress:<communicator>'")
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
