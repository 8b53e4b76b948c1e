"""What a low-communication run exchanges, and when: its fragments and their schedule.

DiLoCo (Douillard et al., "DiLoCo: Distributed Low-Communication Training of Language
Models", 2023) exchanges the whole model every H inner steps.  Streaming DiLoCo (Douillard
et al., "Streaming DiLoCo with overlapping communication", 2025) cuts the model into K
fragments, each still exchanged every H steps but at staggered offsets, so the bytes of one
outer step are spread over H instead of arriving at once; and it lets each exchange run
while the next ``overlap`` inner steps compute.

Here fragment f (of K) has offset o_f = ⌊f·H / K⌋; its exchange is launched after inner step
t whenever t > 0 and (t − o_f) mod H = 0 (fragment 0 at H, 2H, ...; fragment f first at
o_f), and finished after inner step t + ``overlap``.  At most one exchange is in flight at
a time (``overlap`` is at most the gap between consecutive offsets), so every rank finishes
what it launched, in launch order, before the next launch: the step lifecycle's contract.

A :class:`Fragment` holds one contiguous run of parameters: its flat *anchor* (the weights
every rank shares since the last outer step) and the buffer its pseudo-gradient is formed
in.  :func:`parameter_changes` says what of the model changed since the fragments were cut.
"""
from __future__ import annotations

from typing import Iterator, List, Optional, Sequence, Tuple

import torch

from ..compressors.base import ParamView
from ..schedulers.fixed import balanced_cuts


def _positive_int(value, what: str, advice: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{what} must be an integer ≥ 1, got {value!r}. {advice}")
    return value


class SyncSchedule:
    """Fragment offsets and the inner steps at which each fragment's exchange starts and ends."""

    def __init__(self, sync_every: int, fragments: int = 1, overlap: int = 0):
        self.sync_every = _positive_int(sync_every, "sync_every (H, inner steps between two exchanges of a "
                                        "fragment)", "DiLoCo uses H in the hundreds; H = 1 exchanges every step.")
        self.fragments = _positive_int(fragments, "fragments (K)", "1 is DiLoCo; K > 1 streams K fragments.")
        if fragments > sync_every:
            raise ValueError(f"fragments={fragments} is more than sync_every={sync_every}: each fragment "
                             f"needs its own inner step to start its exchange; use fragments ≤ {sync_every}")
        self.offsets = [f * sync_every // fragments for f in range(fragments)]
        gaps = [b - a for a, b in zip(self.offsets, self.offsets[1:] + [self.offsets[0] + sync_every])]
        self.max_overlap = min(min(gaps), sync_every - 1)
        if isinstance(overlap, bool) or not isinstance(overlap, int) or not 0 <= overlap <= self.max_overlap:
            raise ValueError(
                f"overlap must be an integer in [0, {self.max_overlap}] (inner steps an exchange runs behind; "
                f"at most the {min(gaps)} steps between two fragments' exchanges and less than "
                f"sync_every={sync_every}, so one exchange is in flight at a time), got {overlap!r}")
        self.overlap = overlap

    def launching(self, step: int) -> List[int]:
        """The fragments whose exchange starts after inner step ``step`` (1-based)."""
        return [f for f, offset in enumerate(self.offsets)
                if step > 0 and step >= offset and (step - offset) % self.sync_every == 0]

    def finishing(self, step: int) -> List[int]:
        """The fragments whose exchange, launched ``overlap`` steps earlier, ends after ``step``."""
        return self.launching(step - self.overlap) if step - self.overlap > 0 else []

    def __repr__(self) -> str:
        return f"SyncSchedule(sync_every={self.sync_every}, fragments={self.fragments}, overlap={self.overlap})"


def fragment_cuts(numels: Sequence[int], fragments: int) -> List[int]:
    """Where to cut the parameters (in model order) into ``fragments`` contiguous runs of
    about equal size (the fixed scheduler's balanced cuts); ValueError when the model has
    too few parameters to make that many."""
    cuts = balanced_cuts(list(numels), fragments)
    if len(cuts) + 1 != fragments:
        raise ValueError(f"fragments={fragments} cannot be made from {len(numels)} parameter tensors "
                         f"({sum(numels)} elements; a tensor is never split and a larger one fills "
                         f"several shares): use fragments ≤ {len(cuts) + 1}")
    return cuts


class Fragment:
    """A contiguous run of parameters exchanged together: their flat anchor, and the buffer
    their pseudo-gradient is formed in.

    An exchange is every H inner steps a handful of passes over the fragment, and nothing
    else: the pseudo-gradient is written parameter by parameter into ``delta``, a buffer
    kept from one exchange to the next (a new one each time would cost a fresh allocation
    of the fragment's size, page faults included), and the outer step and the merge write
    in place.  The price is one more copy of the fragment held between exchanges (two with
    overlap: the pseudo-gradient in flight is kept for a checkpoint taken meanwhile).
    ``outer`` is the outer optimizer that steps ``anchor`` (shared by every fragment: one
    optimizer over all anchors, each stepped when its own exchange ends).
    """

    def __init__(self, index: int, params: List[Tuple[str, torch.nn.Parameter]]):
        self.index, self.params = index, params
        dtypes = sorted({str(p.dtype) for _, p in params})
        if len(dtypes) > 1:
            raise ValueError(f"fragment {index} ({params[0][0]} .. {params[-1][0]}) mixes dtypes {dtypes}: "
                             "its pseudo-gradient is one flat buffer; use parameters of one dtype, or more "
                             "fragments so that a dtype change falls between two")
        offset, views = 0, []
        for name, p in params:
            views.append(ParamView(name, p.shape, offset))
            offset += p.numel()
        self.layout, self.numel = tuple(views), offset
        self.anchor = self.flat().clone()
        self.delta = torch.empty_like(self.anchor)
        self.kept: Optional[torch.Tensor] = None  # with overlap: the pseudo-gradient in flight, for checkpoints
        self.outer: Optional[torch.optim.Optimizer] = None  # set by DiLoCo once every anchor exists
        #: Each parameter's storage when the fragment was cut (see :func:`parameter_changes`).
        self.storage = [_storage(p) for _, p in params]

    def flat(self) -> torch.Tensor:
        """The local weights, as one new flat tensor."""
        return torch.cat([p.detach().reshape(-1) for _, p in self.params])

    def _pairs(self) -> Iterator[Tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """(anchor slice, delta slice, local weights) per parameter, in the parameter's shape."""
        for view, (_, p) in zip(self.layout, self.params):
            end = view.offset + view.numel
            yield self.anchor[view.offset:end].view(p.shape), self.delta[view.offset:end].view(p.shape), p.detach()

    def pseudo_gradient(self) -> torch.Tensor:
        """Δ = anchor − local weights, written into ``delta`` (one pass, no new tensor)."""
        for anchor, delta, local in self._pairs():
            torch.sub(anchor, local, out=delta)
        return self.delta

    def outer_step(self, average: torch.Tensor) -> None:
        """The outer optimizer's ``step()`` on ``anchor`` with gradient ``average`` (the
        pseudo-gradient averaged over ranks); the other fragments' anchors have no gradient,
        so the step leaves them as they are."""
        self.anchor.grad = average
        try:
            self.outer.step()
        finally:
            self.anchor.grad = None

    def merge(self, mix: float) -> None:
        """Local weights ← (1 − mix)·anchor + mix·local, in place (mix = 0: the anchor)."""
        with torch.no_grad():
            for anchor, _, local in self._pairs():
                if mix == 0.0:
                    local.copy_(anchor)
                else:
                    torch.lerp(anchor, local, mix, out=local)

    def write(self, flat: torch.Tensor) -> None:
        """Set the local weights from a flat tensor."""
        with torch.no_grad():
            for view, (_, p) in zip(self.layout, self.params):
                p.copy_(flat[view.offset:view.offset + view.numel].view_as(p))


def _storage(p: torch.Tensor) -> Tuple[int, Tuple[int, ...], str, str]:
    return (p.data_ptr(), tuple(p.shape), str(p.dtype), str(p.device))


def parameter_changes(fragments: Sequence[Fragment], trainable: Sequence[Tuple[str, torch.nn.Parameter]]
                      ) -> Optional[str]:
    """What changed since the fragments were cut, or None: a parameter whose tensor was
    replaced (``param.data = ...``), a parameter that now requires a gradient (a layer
    unfrozen, a param group added), a module's parameter replaced by a new one
    (``model.fc = nn.Linear(...)``).  ``trainable``: the parameters that require a gradient
    now (the inner optimizer's, and the model's when it is known).  Any of these would let
    each rank train weights the exchange never averages (or average weights no rank trains
    any more): the ranks' models would drift apart without a word.  A layer frozen later is
    no change: its pseudo-gradient is zero on every rank."""
    cut = {id(p): name for fragment in fragments for name, p in fragment.params}
    for fragment in fragments:
        for (name, p), storage in zip(fragment.params, fragment.storage):
            if _storage(p) != storage:
                return (f"parameter {name!r} now holds another tensor (param.data = ... or a .to() in "
                        f"place: shape {list(storage[1])} {storage[2]} on {storage[3]} became "
                        f"{list(p.shape)} {p.dtype} on {p.device})")
    new = [name for name, p in trainable if id(p) not in cut]
    if new:
        return (f"parameter(s) {new[:5]}{' ...' if len(new) > 5 else ''} now require a gradient and were "
                "not there when DiLoCo was built (a layer unfrozen, a param group added, or a module's "
                "parameters replaced, e.g. model.fc = nn.Linear(...))")
    return None
