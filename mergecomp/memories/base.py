"""The Memory contract: error feedback around a compressor.

Before compression ``compensate`` folds what earlier steps failed to send into the
gradient; after compression ``update`` records what this step fails to send.  State is
kept per group name and is part of the optimizer's state dict, so a resumed run
continues exactly.

State is transactional, like a compressor's: a memory stages what a step writes
(:class:`mergecomp.staging.StagedDict`) and keeps it on :meth:`commit`, forgets it on
:meth:`rollback`, so a step dropped after its exchange (a non-finite gradient on some
rank) leaves every residual as it was.  Never change a committed tensor in place.
"""
from __future__ import annotations

import math
import numbers
from typing import Any, Dict, Optional

import torch

from ..compressors.base import DriftTerms
from .loopclip import LoopClip


class Memory(DriftTerms):
    """Base class of error-feedback memories; the default does nothing."""

    name = "memory"
    #: True once the memory took SGD's momentum over (:func:`mergecomp.momentum.take_over_momentum`):
    #: it then runs its momentum in gradient units, ``u ← m·u + (1 − m)·g``, and the optimizer
    #: steps at ``lr / (1 − m)``: the same steps as heavy-ball ``u ← m·u + g`` at ``lr``, but what
    #: the exchange delivers into ``p.grad`` has a gradient's scale, so a loop that clips the
    #: averaged gradient after the exchange clips what dense training would (a velocity is up to
    #: 1/(1 − m) times larger, and clipped at a gradient's threshold it would take steps that much
    #: smaller).
    gradient_units = False
    #: Whose momentum the memory took over: ``"sgd"`` or ``"adam"`` (None: none), set by
    #: :func:`mergecomp.momentum.take_over_momentum`.
    momentum_source = None
    #: Whether the loop's clipping threshold, once seen, is applied to each rank's gradient
    #: before this memory's momentum (:mod:`mergecomp.memories.loopclip`).
    follows_loop_clip = False
    #: A :class:`~mergecomp.memories.loopclip.LoopClip`, in a memory that can follow the loop.
    loop_clip = None
    #: Explicit local clipping (each rank's gradient, before error feedback), where a memory has it.
    clip_norm = None

    def follow_loop_clip(self, threshold: float) -> None:
        """Clip each rank's gradient at the loop's ``threshold`` from the next step on (see
        :mod:`mergecomp.memories.loopclip`); only for a memory that :attr:`follows_loop_clip`."""
        if self.loop_clip is None:
            raise NotImplementedError(f"{type(self).__name__} does not follow the loop's clipping")
        self.loop_clip.follow(threshold)
        # What was taken in before the threshold is scaled now, between steps, rather than at
        # each group's next step: a regrouping in between (DDP rebuilds its buckets after its
        # first iteration) restarts per-group factors and would lose it.
        factors = self.loop_clip.take_catch_up()
        for held in self.held_state() if factors else ():
            committed = held.committed()
            scaled = {name: committed[name] * factor for name, factor in factors.items() if name in committed}
            if scaled:
                held.replace({**committed, **scaled})

    def masks_sent(self, name: str, masking: Optional[bool], default: bool) -> bool:
        """Whether the momentum of the coordinates group ``name`` sent in this step restarts
        from zero (momentum factor masking), for a memory whose own setting is ``masking``
        (None: left to it).  Left to it, a memory that follows the loop's clipping, with an
        entry point watching the loop for it, masks once the loop was seen clipping and not
        before (:mod:`mergecomp.memories.loopclip`); any other masks as its ``default`` says."""
        if masking is not None:
            return masking
        if self.follows_loop_clip and self.loop_clip.watched:
            return self.loop_clip.threshold is not None
        return default

    def held_state(self) -> list:
        """The staged per-group tensors this memory carries from step to step (what the
        loop's clipping scales once it is followed)."""
        return []

    def with_loop_clip_state(self, state: dict) -> dict:
        """``state`` with the loop's clipping added under ``"loop_clip"`` once a threshold was
        seen (so the states of runs that never clip are as before)."""
        loop_clip = self.loop_clip.state_dict() if self.loop_clip is not None else {}
        if loop_clip:
            state["loop_clip"] = loop_clip
        return state

    def check_loop_clip_state(self, state: dict, what: str) -> None:
        """ValueError naming what is wrong with ``state``'s ``"loop_clip"``, if it has one."""
        if "loop_clip" in state:
            LoopClip.check_state(state["loop_clip"], what)

    def local_clip_factor(self, tensor: torch.Tensor, name: str):
        """Local clipping's factor for this rank's gradient of group ``name`` (None: none):
        ``clip_norm``'s, or the loop's threshold once seen."""
        if self.clip_norm is not None:
            return clip_scale(tensor, self.clip_norm)
        return self.loop_clip.scale(tensor, name) if self.follows_loop_clip else None

    def caught_up(self, name: str, *tensors):
        """``tensors`` (this memory's committed state for group ``name``, None where it has
        none) scaled before this step's gradient joins them
        (:meth:`~mergecomp.memories.loopclip.LoopClip.catch_up`: a loss scale that moved, or a
        catch-up a saved state still owed); new tensors, or the same ones when there is
        nothing to scale."""
        factor = self.loop_clip.catch_up(name) if self.follows_loop_clip else None
        if factor is None:
            return tensors
        return tuple(None if t is None else t * factor for t in tensors)

    #: The momentum this memory runs in gradient units before the exchange (0: none).
    delivered_momentum = 0.0

    def delivery_scale(self, step: int) -> float:
        """What the wrapper multiplies this memory's averages by from the exchange until
        ``step()`` (and then divides again), at run step ``step`` (from 0): ``1 / (1 −
        m^(step+1))`` for a memory that follows the loop's clipping with a momentum m in
        gradient units, else 1.  A momentum that starts from zero delivers a tenth of a
        gradient's scale at its first step (m = 0.9); corrected, as Adam corrects its moments,
        the loop sees a gradient's scale from the first step, and its clipping from there
        (:mod:`mergecomp.memories.loopclip`).  1 once the correction is below float32's
        resolution."""
        momentum = self.delivered_momentum
        if not (self.follows_loop_clip and self.gradient_units and 0.0 < momentum < 1.0):
            return 1.0
        young = momentum ** (step + 1)
        return 1.0 if young < 2.0 ** -25 else 1.0 / (1.0 - young)

    def units_factor(self, momentum: float) -> float:
        """What the gradient is multiplied by before it enters the momentum: ``1 − m`` in
        gradient units, else 1."""
        return 1.0 - momentum if self.gradient_units and 0.0 < momentum < 1.0 else 1.0

    def compensate(self, tensor: torch.Tensor, name: str) -> torch.Tensor:
        """Return the tensor to compress for group ``name`` (may be ``tensor`` itself)."""
        raise NotImplementedError(f"{type(self).__name__} must implement compensate()")

    def update(self, tensor: torch.Tensor, name: str, compressor, payload, ctx) -> None:
        """Record what compressing ``tensor`` into ``payload`` lost."""
        raise NotImplementedError(f"{type(self).__name__} must implement update()")

    def commit(self) -> None:
        """Keep the state this step wrote."""

    def rollback(self) -> None:
        """Forget the state this step wrote, as if the step had not happened."""

    def error_norm(self):
        """The L2 norm of what this memory holds back for later steps (every group's
        committed state together), or None for a memory that holds nothing.  Read by the
        step log (:class:`mergecomp.steplog.StepLog`) on the steps it records, so it costs
        nothing otherwise."""
        return None

    def state_dict(self) -> Dict[str, Any]:
        return {}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        if state:
            raise ValueError(f"{type(self).__name__} has no state but was given keys {sorted(state)}")

    def check_state(self, state: Dict[str, Any], groups) -> None:
        """Raise ValueError if ``state`` (from :meth:`state_dict`) does not fit the groups this
        run exchanges (``groups``: name → :class:`~mergecomp.checkpoint.GroupSpec`), naming
        the group and the shape or dtype found.  Called on a checkpoint before anything is
        loaded; the default accepts what :meth:`load_state_dict` accepts."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


def checked_state(table, name: str, tensor, what: str):
    """``table``'s tensor for group ``name`` (None when it has none); ValueError when its shape
    is not the gradient's, which only a plan switch that did not carry the state can cause."""
    state = table.get(name)
    if state is not None and state.shape != tensor.shape:
        raise ValueError(
            f"{what} of group {name!r} has shape {tuple(state.shape)} but the gradient "
            f"has shape {tuple(tensor.shape)}: the plan changed without resetting memory")
    return state


def clip_local(tensor, clip_norm: float):
    """``tensor`` scaled down to L2 norm ``clip_norm`` when it is longer (a new tensor; the
    input is never changed).  Local gradient clipping: a rank's own gradient, before error
    feedback or momentum accumulates it, so what is clipped is never owed later."""
    scale = clip_scale(tensor, clip_norm)
    return tensor if scale is None else tensor * scale


def combined_scale(clip, units: float):
    """Local clipping's factor (or None) times a momentum's :meth:`Memory.units_factor`, or
    None when the product is 1: the one factor a fused momentum pass multiplies the gradient by."""
    if units == 1.0:
        return clip
    return units if clip is None else clip * units


def clip_scale(tensor, clip_norm: float):
    """The factor :func:`clip_local` multiplies ``tensor`` by, or None when it is short
    enough: for a memory that fuses the product into its own pass over the tensor."""
    norm = torch.linalg.vector_norm(tensor, dtype=torch.float32)
    if norm > clip_norm:
        return clip_norm / float(norm)
    return None


def subtract_sent(residual, compressor, payload, ctx) -> None:
    """Take what ``payload`` carries out of ``residual`` (the compensated gradient, a tensor
    of the group's shape), in place, leaving what was not sent: a sparse payload's values at
    their indices where the compressor can (``subtract_sent``), else its whole decode."""
    sparse = getattr(compressor, "subtract_sent", None)
    if sparse is not None:
        sparse(residual.view(-1), payload, ctx)
    else:
        residual.sub_(compressor.decompress(payload, ctx).view_as(residual))


def norm_of(tensors) -> float:
    """The L2 norm of several tensors taken as one vector (0.0 for none)."""
    total = sum(float(torch.linalg.vector_norm(t, dtype=torch.float32)) ** 2 for t in tensors)
    return math.sqrt(total)


def check_number(value, what: str, low: float, high: float, low_open: bool = False,
                 high_open: bool = False, advice: str = "") -> float:
    """``value`` as a float, or ValueError naming ``what``, the value and the allowed range.

    NaN and infinities are refused (a NaN factor turns every residual into NaN at the first
    step, silently), and so are booleans and strings, which ``float()`` would accept.
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{what} must be a number, got {value!r}. {advice}".rstrip())
    number = float(value)
    inside = (math.isfinite(number)
              and (number > low if low_open else number >= low)
              and (number < high if high_open else number <= high))
    if not inside:
        if math.isinf(high):
            allowed = f"a finite number {'>' if low_open else '>='} {low:g}"
        else:
            allowed = f"in {'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"
        raise ValueError(f"{what} must be {allowed}, got {value!r}. {advice}".rstrip())
    return number


def check_flag(value, what: str) -> bool:
    """``value`` if it is a bool, else ValueError (``bool("False")`` is True)."""
    if not isinstance(value, bool):
        raise ValueError(f"{what} must be True or False, got {value!r}")
    return value


UNITS = {False: "heavy-ball", True: "gradient"}


def units_of(state: Dict[str, Any]) -> bool:
    """Whether a saved momentum memory's state is in gradient units (states saved before
    there were units are in heavy-ball units)."""
    units = state.get("units", UNITS[False])
    if units not in UNITS.values():
        raise ValueError(f"memory state has units {units!r}; expected one of {sorted(UNITS.values())}")
    return units == UNITS[True]


def in_units(tensors: Dict[str, torch.Tensor], saved_in_gradient_units: bool, memory: "Memory",
             momentum: float) -> Dict[str, torch.Tensor]:
    """``tensors`` (copies) in ``memory``'s units, from the units they were saved in: the
    same run resumed in either form takes the same steps."""
    factor = memory.units_factor(momentum) if memory.gradient_units else 1.0
    saved = (1.0 - momentum) if saved_in_gradient_units and 0.0 < momentum < 1.0 else 1.0
    ratio = factor / saved
    return {k: (v.clone() if ratio == 1.0 else v * ratio) for k, v in tensors.items()}


def sent_positions(compressor, payload, ctx) -> torch.Tensor:
    """Where ``payload`` sent coordinates: their flat indices when the compressor says
    (``transmitted_indices``), else a mask of the nonzero decoded coordinates."""
    transmitted = getattr(compressor, "transmitted_indices", None)
    if transmitted is not None:
        return transmitted(payload, ctx)
    return compressor.decompress(payload, ctx).reshape(-1) != 0


def zero_positions(flat: torch.Tensor, positions: torch.Tensor, in_place: bool) -> torch.Tensor:
    """``flat`` with ``positions`` (:func:`sent_positions`) set to zero: in place, or a copy."""
    if positions.dtype == torch.bool:
        return flat.masked_fill_(positions, 0) if in_place else flat.masked_fill(positions, 0)
    return flat.index_fill_(0, positions, 0) if in_place else flat.index_fill(0, positions, 0)

