"""The Compressor contract.

A compressor turns one flat gradient buffer into a *payload* (a tuple of tensors that
travel over the network) and a *context* (a small local structure needed to decode).
Every byte a compressor sends is in the payload, so the bytes on the wire can be counted
from it exactly.

Capabilities are class attributes the communicators rely on:

``summable``
    payloads from all ranks can be added elementwise and decompressed once
    (``decompress(sum of payloads) == sum of decompress(payload)``), so allreduce can
    carry them.
``fixed_size``
    payload shapes depend only on the input's numel, never on its values, so an
    allgather needs no size exchange.
``average``
    the aggregate is divided by the world size (False for majority vote, whose
    aggregate is already the update direction).
``multi_round``
    the compressor needs several collectives per step (PowerSGD); it then implements
    :meth:`rounds` and the communicator drives the exchange.
``dense`` / ``lossless``
    every coordinate is sent (the casts) / and exactly (FP32).  Memories use them: a
    dense send leaves no coordinate behind, a lossless one leaves no residual at all.
``sums_in_place``
    :meth:`decompress_sum` adds every payload into one buffer instead of decoding each
    into a dense tensor of its own (sparse payloads: one scatter-add per rank).  The cost
    model prices the extra payloads by the profiled ``CodecCost.add``.
``unbiased``
    E[decode(compress(g))] = g over the compressor's randomness (True/False; None when a
    plugin does not say).  An instance may refine it (rand-k's depends on its options).
``error_feedback``
    the compressor keeps its own error feedback (PowerSGD's per-layer error, Vogels et al.
    2019): a memory around it would feed each error back twice, so it pairs with the
    ``none`` memory only (``mergecomp.arguments.check_pairing`` refuses others).  An
    instance may refine it (PowerSGD's ``use_error_feedback=False``).
``supported_dtypes``
    the gradient dtypes it carries (:func:`check_dtypes` refuses the others up front).

The bytes on the wire.  Every built-in compressor states its wire format as a method,
``wire_nbytes(numel, element_size, payload=None, layout=None)``: the bytes one rank puts
on the wire for ``numel`` elements of ``element_size`` bytes (a variable-size compressor
reads the count from ``payload`` and checks it against its bound).  The conformance kit
(:mod:`mergecomp.compressors.testing`) compares it with the payload it really sends; a
plugin without it is checked for everything else.

The group's layout.  A fused buffer holds several parameters' gradients back to back;
``compress(tensor, name, layout)`` and ``rounds(tensor, name, layout)`` receive the
per-parameter views of it (:class:`ParamView`: name, shape, offset — what DDP's
``GradBucket.gradients()`` gives), so a low-rank method can factor each layer's own
matrix.  Elementwise compressors ignore it.  ``layout`` is None when the caller has
none (a bare tensor), and a compressor must then treat the tensor as one parameter.

Transactional state.  A step can be dropped after its collectives are in flight (a
non-finite gradient on some rank, a shadow step nobody applies).  Components that keep
state between steps (residuals, warm starts, random streams) stage the step's writes
(:class:`mergecomp.staging.StagedDict`) and keep them on :meth:`commit`, forget them on
:meth:`rollback`; the reducer calls exactly one of the two per step, on every rank.

Buffers are reused.  The tensor handed to ``compress``/``rounds`` belongs to the caller
(a memory writes the next step's values into it, a communicator may write the average
into the group's buffer): a compressor must not keep a reference to it past the call, and
a payload that shares its memory is copied by the memories before they touch it.
"""
from __future__ import annotations

import inspect
import math
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Dict, Generator, List, Mapping, Optional, Sequence, Tuple

import torch

Payload = Tuple[torch.Tensor, ...]


def squared_norm(tensor: torch.Tensor) -> torch.Tensor:
    """‖tensor‖² as a 0-d float32 tensor on its device (one read pass, no host sync)."""
    return torch.linalg.vector_norm(tensor, dtype=torch.float32).square()



class DriftTerms:
    """How far a step's exchange lags dense training, as the component that holds the
    difference sees it: an error-feedback memory (its residual), or a compressor with error
    feedback of its own (PowerSGD's error).  The step lifecycle sets :attr:`measuring` on the
    steps it measures, reads :meth:`drift_terms` per group and calls :meth:`forget_drift`
    (:mod:`mergecomp.runtime.drift`)."""

    #: Set by the step lifecycle on the steps it measures the drift on (:meth:`drift_terms`).
    measuring = False
    #: What the terms measure: ``"lag"`` (what error feedback holds back) or ``"noise"``
    #: (an unbiased compressor's error this step, which nothing holds: the ``none`` memory's).
    drift_kind = "lag"

    def drift_terms(self, name: str):
        """``(held², incoming²)`` of group ``name`` on a measuring step (0-d float32 tensors,
        no host sync): the squared norm of what this component holds back once the step
        has been compressed, and of the update dense training would have applied this step
        (the gradient, or the momentum where a memory applies it before the exchange).  Their
        ratio is how many steps of update the exchange lags dense by
        (:mod:`mergecomp.runtime.drift`).  None for a component that holds nothing back, or
        when the step was not measured."""
        terms = self.__dict__.get("_drift_terms", {})
        if name in terms:
            return terms[name]
        pieces = [found for key, found in terms.items() if key.startswith(name + "#")]
        if not pieces:  # a group exchanged in pieces (FSDP2's chunks: "group0#shard1") adds them up
            return None
        return tuple(sum(parts) for parts in zip(*pieces))

    def drift_sent(self, name: str) -> int:
        """The payload bytes group ``name`` sent this measured step (its pieces summed; 0 when
        not noted), which the quality controller's byte budget counts."""
        sent = self.__dict__.get("_drift_sent", {})
        return sum(n for key, n in sent.items() if key == name or key.split("#", 1)[0] == name)

    def note_sent(self, name: str, nbytes: int) -> None:
        """On a measuring step: group ``name`` (or a piece of it) sent ``nbytes`` of payload."""
        if self.measuring:
            self.__dict__.setdefault("_drift_sent", {})[name] = int(nbytes)

    def forget_drift(self) -> None:
        """Drop the measured terms (the lifecycle has read them)."""
        self.__dict__.pop("_drift_terms", None)
        self.__dict__.pop("_drift_incoming", None)
        self.__dict__.pop("_drift_sent", None)

    def _note_incoming(self, name: str, tensor: torch.Tensor) -> None:
        """On a measuring step: the update dense training would apply for group ``name``."""
        if self.measuring:
            self.__dict__.setdefault("_drift_incoming", {})[name] = squared_norm(tensor)

    def _note_held(self, name: str, *tensors: torch.Tensor) -> None:
        """On a measuring step: what group ``name`` holds back after its compression (in one
        tensor or several pieces; none: nothing)."""
        if self.measuring:
            incoming = self.__dict__.get("_drift_incoming", {}).pop(name, None)
            if incoming is not None:
                held = sum((squared_norm(t) for t in tensors), torch.zeros((), device=incoming.device))
                self.__dict__.setdefault("_drift_terms", {})[name] = (held, incoming)


@dataclass(frozen=True)
class Context:
    """What every decoder needs: the shape and dtype of the original tensor.

    Compressors that need more (shared random indices, a bucket layout) subclass this
    dataclass with named fields; a context never carries data that differs between
    ranks, so one rank's context decodes every rank's payload.

    ``layout_fields`` names the fields that follow from shape, dtype and the group's layout
    alone (never from the values or a random stream): a parameter server may decode its
    recompressed shard with a worker's context only when every extra field is one of them.
    """

    shape: torch.Size
    dtype: torch.dtype
    layout_fields = ()  # class attribute, not a field

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class ParamView:
    """One parameter's gradient inside a group buffer: elements ``offset .. offset + numel``,
    viewed with ``shape``.  A piece of a parameter (a plan that slices a large tensor) is a
    1-D view of the piece, named ``"<param>[start:stop]"``."""

    name: str
    shape: torch.Size
    offset: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


#: The per-parameter views of a group buffer, in buffer order, covering it exactly.
GroupLayout = Tuple[ParamView, ...]


def whole_layout(tensor: torch.Tensor, name: str = "tensor") -> GroupLayout:
    """The layout of a tensor that is one parameter: a single view of its own shape."""
    return (ParamView(name, tensor.shape, 0),)


def clip_layout(layout: GroupLayout, start: int, stop: int) -> GroupLayout:
    """The views of elements ``start .. stop`` of a buffer (a PS shard), offsets relative to
    ``start``; a parameter cut by the range becomes a 1-D piece."""
    clipped = []
    for view in layout:
        lo, hi = max(view.offset, start), min(view.offset + view.numel, stop)
        if lo >= hi:
            continue
        if lo == view.offset and hi == view.offset + view.numel:
            clipped.append(ParamView(view.name, view.shape, lo - start))
        else:
            first = lo - view.offset
            clipped.append(ParamView(f"{view.name}[{first}:{first + hi - lo}]",
                                     torch.Size([hi - lo]), lo - start))
    return tuple(clipped)


def check_layout(layout: GroupLayout, numel: int) -> None:
    """Raise ValueError unless ``layout`` tiles a buffer of ``numel`` elements in order."""
    offset = 0
    for view in layout:
        if view.offset != offset:
            raise ValueError(f"layout view {view.name!r} starts at element {view.offset}, "
                             f"expected {offset}: views must tile the buffer in order")
        offset += view.numel
    if offset != numel:
        raise ValueError(f"layout covers {offset} elements but the buffer has {numel}")


#: Real floating types: what the quantisers, sparsifiers and casts handle.
REAL_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


@dataclass
class AllReduce:
    """A request yielded by :meth:`Compressor.rounds`: sum these tensors over all ranks."""

    tensors: Tuple[torch.Tensor, ...]


class Compressor(DriftTerms):
    """Base class of every gradient compressor.  See the module docstring for the contract."""

    name = "compressor"
    summable = False
    fixed_size = True
    average = True
    multi_round = False
    dense = False
    lossless = False
    sums_in_place = False
    #: E[decode(compress(g))] = g (None: not declared; the conformance kit says so).
    unbiased: Optional[bool] = None
    #: It keeps its own error feedback: no memory may be put around it (see above).
    error_feedback = False

    @property
    def reads_noise(self) -> bool:
        """Whether its error this step, ``decode(compress(g)) − g``, is noise around the
        gradient that the drift meter reads under the ``none`` memory
        (:mod:`mergecomp.runtime.drift`): an unbiased compressor's (a plugin may say yes
        for a small bias that comes with its noise, as clipped TernGrad does)."""
        return self.unbiased is True
    #: The gradient dtypes this compressor carries; :func:`check_dtypes` refuses others.
    supported_dtypes: Tuple[torch.dtype, ...] = REAL_FLOATS
    #: What to pair it with when the user does not say (allgather carries anything).
    recommended_memory = "none"
    #: Arguments for that memory beyond its defaults (``memories.recommended`` passes them).
    recommended_memory_options: Mapping[str, Any] = MappingProxyType({})
    recommended_communicator = "allgather"
    #: What it needs beyond dense SGD's settings (a :class:`~mergecomp.compressors.recipes.Recipe`),
    #: or None when it trains at them; the optimizer warns when its settings contradict it.
    recipe = None
    #: This process's rank, set by the communicator (:meth:`set_process_rank`): compressors
    #: with a private random stream that must differ between ranks (stochastic rounding)
    #: derive it from their seed and this.
    process_rank = 0
    #: What the quality controller (:class:`mergecomp.runtime.drift.DriftController`) may raise
    #: for one group when its exchange lags dense: ``"density"`` (a sparsifier's share of
    #: coordinates), ``"rank"`` (a low-rank factorisation's rank), ``"bits"`` (a low-bit
    #: compressor's bits per element), or None (nothing to raise).
    knob: Optional[str] = None

    def masks_sent_momentum(self, name: str) -> bool:
        """Whether a memory that masks the momentum of the coordinates a payload sent does so
        for group ``name`` (momentum factor masking, for a sparsifier's selection): not for a
        dense send, which sends every coordinate."""
        return not self.dense

    def group_scale(self, name: str) -> float:
        """How many times its configured density (or rank) group ``name`` sends now: 1 unless
        the quality controller raised it.  The same on every rank: the controller decides from
        quantities every rank agreed on."""
        scales = self.__dict__.get("_group_scales")
        if not scales:
            return 1.0
        # a piece of a group (FSDP2's chunks: "group0#shard1") is sent as its group is
        return scales.get(name, scales.get(name.split("#", 1)[0], 1.0))

    def set_group_scale(self, name: str, scale: float) -> None:
        """Send group ``name`` at ``scale`` times the configured density (or rank), from its next
        step on; 1 restores the configuration.  Only a compressor with a :attr:`knob`."""
        if self.knob is None:
            raise ValueError(f"{type(self).__name__} has no density, rank or bits to raise (knob is None)")
        if not (isinstance(scale, (int, float)) and scale >= 1.0 and math.isfinite(scale)):
            raise ValueError(f"a group's scale must be a finite number ≥ 1, got {scale!r}")
        scales = self.__dict__.setdefault("_group_scales", {})
        if scale == 1.0:
            scales.pop(name, None)
        else:
            scales[name] = float(scale)

    def scaled_ratio(self, name: str, ratio: float) -> float:
        """``ratio`` (a density) times group ``name``'s scale, at most 1."""
        return min(1.0, ratio * self.group_scale(name))

    def set_process_rank(self, rank: int) -> None:
        """Called once by the communicator that carries this compressor."""
        self.process_rank = int(rank)

    def compress(self, tensor: torch.Tensor, name: str,
                 layout: Optional[GroupLayout] = None) -> Tuple[Payload, Context]:
        """Encode ``tensor`` (the gradients of group ``name``, laid out as ``layout``);
        return (payload, context)."""
        raise NotImplementedError(f"{type(self).__name__} must implement compress()")

    def decompress(self, payload: Payload, ctx: Context) -> torch.Tensor:
        """Decode one payload (or the elementwise sum of summable payloads)."""
        raise NotImplementedError(f"{type(self).__name__} must implement decompress()")

    def aggregate(self, tensors: List[torch.Tensor]) -> torch.Tensor:
        """Combine the decoded tensors of all ranks; the default is their sum."""
        total = tensors[0].clone()
        for t in tensors[1:]:
            total.add_(t)
        return total

    def payload_bound(self, ctx: Context) -> Optional[Tuple[torch.Size, ...]]:
        """The largest shape of each payload part for ``ctx``, the same on every rank, or
        None (the default) when a variable-size payload has no bound.  With a bound the
        allgather communicator sends a fixed-size blob in one asynchronous collective;
        without one it exchanges sizes first, which blocks the hook until every rank gets
        there."""
        return None

    def decompress_sum(self, payloads: Sequence[Payload], ctx: Context) -> torch.Tensor:
        """The aggregate of every rank's payload, flat: what the allgather and PS
        communicators hand on.  By default each payload is decoded into a dense tensor and
        the tensors are combined by :meth:`aggregate`; compressors with ``sums_in_place``
        override it to skip the dense tensor per rank."""
        return self.aggregate([self.decompress(payload, ctx).reshape(-1) for payload in payloads])

    def rounds(self, tensor: torch.Tensor, name: str,
               layout: Optional[GroupLayout] = None) -> Generator[AllReduce, Sequence[torch.Tensor], torch.Tensor]:
        """Multi-round exchange for compressors with ``multi_round = True``.

        A generator: it yields :class:`AllReduce` requests, receives the summed tensors
        back, and finally returns the *sum over ranks* of the decoded gradient (the
        communicator averages it).  Keeping the collectives out of the compressor lets the
        communicator order, time and count them like any other.
        """
        raise NotImplementedError(f"{type(self).__name__} is not a multi-round compressor")

    #: Attributes holding this compressor's staged state (a ``StagedDict``, or anything with
    #: ``commit()`` and ``rollback()``): the default :meth:`commit` and :meth:`rollback` act
    #: on each, in this order.
    staged_state: Tuple[str, ...] = ()

    def commit(self) -> None:
        """Keep the state this step wrote (see "Transactional state" above)."""
        for name in self.staged_state:
            getattr(self, name).commit()

    def rollback(self) -> None:
        """Forget the state this step wrote, as if the step had not happened."""
        for name in self.staged_state:
            getattr(self, name).rollback()

    def state_dict(self) -> Dict[str, Any]:
        return {}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        if state:
            raise ValueError(f"{type(self).__name__} has no state but was given keys {sorted(state)}")

    def check_state(self, state: Dict[str, Any], groups) -> None:
        """Raise ValueError if ``state`` (from :meth:`state_dict`) does not fit the groups this
        run exchanges (``groups``: name → :class:`~mergecomp.checkpoint.GroupSpec`, whose
        ``layout`` may be None when the parameters' shapes are unknown), naming the group,
        the tensor and the shape found.  Called on a checkpoint before anything is loaded,
        so a wrong shape is refused instead of failing in the middle of a step; the default
        accepts what :meth:`load_state_dict` accepts."""

    def __repr__(self) -> str:
        """``Name(arg=value, ...)`` for every constructor argument kept as an attribute of
        the same name.  The reducer compares ``repr`` across ranks, so every argument that
        changes what is sent (a seed, above all) must show; this process's rank must not."""
        return f"{type(self).__name__}({', '.join(f'{k}={v!r}' for k, v in constructor_arguments(self))})"


def constructor_arguments(compressor) -> List[Tuple[str, Any]]:
    """(name, value) of each ``__init__`` argument of ``compressor``'s class that the instance
    keeps as an attribute of the same name, in signature order."""
    try:
        parameters = inspect.signature(type(compressor).__init__).parameters
    except (TypeError, ValueError):
        return []
    found = []
    for name, parameter in parameters.items():
        if name == "self" or parameter.kind in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD):
            continue
        if hasattr(compressor, name):
            found.append((name, getattr(compressor, name)))
    return found


def accepts_keyword(method, keyword: str) -> bool:
    """Whether ``method`` takes ``keyword`` (by name, or through ``**kwargs``)."""
    try:
        parameters = inspect.signature(method).parameters
    except (TypeError, ValueError):
        return False
    return keyword in parameters or any(p.kind is inspect.Parameter.VAR_KEYWORD
                                        for p in parameters.values())


def accepts_layout(method) -> bool:
    """Whether ``compress``/``rounds`` takes the ``layout`` keyword (plugins written before
    layouts existed take ``(tensor, name)`` only and are called that way)."""
    return accepts_keyword(method, "layout")


def payload_nbytes(payload: Sequence[torch.Tensor]) -> int:
    """Bytes a payload puts on the wire."""
    return sum(t.numel() * t.element_size() for t in payload)


def check_dtypes(compressor: Compressor, dtypes) -> None:
    """Raise ValueError unless ``compressor`` carries every dtype in ``dtypes``.

    The message names the compressor, the dtype and what to do instead, so a model with
    complex or integer parameters fails at construction, not in the middle of a step.
    """
    supported = tuple(getattr(compressor, "supported_dtypes", REAL_FLOATS))
    for dtype in dtypes:
        if dtype in supported:
            continue
        carried = ", ".join(str(d).replace("torch.", "") for d in supported)
        if dtype.is_complex:
            advice = ("only the 'none'/'fp32' compressor carries complex gradients: view those "
                      "parameters as real pairs (torch.view_as_real) or send them raw (uncompressed)")
        elif not dtype.is_floating_point:
            advice = "integer and bool tensors have no gradient to compress: leave them out of the parameters"
        else:
            advice = "send those parameters raw (uncompressed) or cast them to a supported dtype"
        raise ValueError(f"{compressor!r} cannot carry {str(dtype).replace('torch.', '')} gradients "
                         f"(it carries {carried}); {advice}")


def positive_finite(value) -> Optional[float]:
    """``value`` as a float when it is a finite number > 0 (a bool is not), else None: the
    caller raises its own error, which says what the number means."""
    if isinstance(value, bool):
        return None
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return number if 0.0 < number < float("inf") else None


def check_ratio(ratio: float, what: str = "compress_ratio") -> float:
    """Validate a fraction in (0, 1]; raise ValueError with the value otherwise."""
    try:
        value = float(ratio)
    except (TypeError, ValueError):
        raise ValueError(f"{what} must be a number in (0, 1], got {ratio!r}") from None
    if not 0.0 < value <= 1.0:
        raise ValueError(f"{what} must be in (0, 1], got {ratio!r}; e.g. 0.01 keeps 1% of the elements")
    return value
