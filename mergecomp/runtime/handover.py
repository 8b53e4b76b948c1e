"""The averages' way from the exchange to the optimizer's ``step()``, for the memories that
follow the loop's clipping (:mod:`mergecomp.memories.loopclip`).

Between the end of backward and ``step()`` the training loop may clip ``p.grad``.  A memory
that runs SGD's momentum before the exchange wants that clip on each rank's gradient,
before its momentum, not on the momentum the exchange delivers.  :class:`LoopHandOver`
holds the two halves of that hand-over together, for an entry point that writes the
averages where the loop reads them and then calls the optimizer:

1. :meth:`LoopHandOver.deliver`, when the step's averages are written: each group's
   averages are multiplied by its memory's
   :meth:`~mergecomp.memories.base.Memory.delivery_scale` (a momentum that starts from zero,
   bias-corrected, so that the loop sees a gradient's scale from the first step), and the
   clip watch notes their norm on the steps it watches
   (:class:`~mergecomp.runtime.drift.ClipWatch`).
2. :meth:`LoopHandOver.settle`, at ``step()``: what the loop did is read back (under AMP's
   ``GradScaler``, whose ``step()`` called the optimizer's, the unscaling taken out and the
   memories told the loss scale their gradients carry); a first clip
   (or one at another threshold) has the following memories clip at the threshold over
   √(ranks) from the next step, and the loop is advised once where its compressor's recipe
   asks for it; a clip at the threshold they follow is undone on their groups; then the
   delivery scales are divided back out.
"""
from __future__ import annotations

import math
import sys
import warnings
from typing import Dict, Optional, Sequence

import torch

from ..momentum import innermost
from .drift import ClipWatch


def calling_grad_scaler(frames: int = 12):
    """The ``torch.amp.GradScaler`` whose ``step()`` called the optimizer's, found among the
    callers of the function that asks (None: none).  Its scale multiplied the loss, so the
    averages the exchange delivered carry it until the loop unscales them; every framework's
    AMP loop (Lightning's, Accelerate's) steps through ``scaler.step(optimizer)``."""
    frame = sys._getframe(1)
    for _ in range(frames):
        if frame is None:
            return None
        caller = frame.f_locals.get("self")
        if isinstance(caller, torch.amp.GradScaler):
            return caller
        frame = frame.f_back
    return None


class LoopHandOver:
    """The clip watch and the delivery scales of one entry point's groups.

    ``lifecycle``: the entry point's :class:`~mergecomp.runtime.step.StepLifecycle` (its
    communicators' memories, the settled step, the drift reading); ``backend``: its ranks.
    Groups are objects with a ``buffer`` (the averages the loop reads: a tensor, a list of
    tensors, or None) and a ``send`` mode, in the same order at :meth:`deliver` and
    :meth:`settle` (where the buffers are read again: under DDP, the parameters' ``p.grad``
    into which DDP copied the averages).
    """

    def __init__(self, lifecycle, backend, total=None):
        self.lifecycle = lifecycle
        self.backend = backend
        #: Notices a loop that clips the averages after the exchange (``total``: sums over
        #: the ranks that hold different shards of them, :attr:`ClipWatch.total`).
        self.watch = ClipWatch(total)
        self._delivered: Dict[int, float] = {}  # group index → the delivery scale its averages carry
        self.mark_watched()

    def mark_watched(self) -> None:
        """Tell the memories that can follow the loop's clipping that it is watched for them
        (they mask where it clips: :meth:`~mergecomp.memories.base.Memory.masks_sent`)."""
        for communicator in self.lifecycle.communicators():
            if communicator.memory.loop_clip is not None:
                communicator.memory.loop_clip.watched = True

    def followers(self) -> list:
        """The memories that follow the loop's clipping."""
        return [c.memory for c in self.lifecycle.communicators() if c.memory.follows_loop_clip]

    def deliver(self, groups: Sequence, finite: bool) -> None:
        """The step's averages are in the groups' buffers (``finite``: the step was kept):
        scale them for the loop, and note them on a watched step (a measured step, every
        early step until a following memory has seen the loop clip, every step once one
        has)."""
        reading = self.lifecycle.drift
        step = self.lifecycle.settled_step
        self.mark_watched()  # a communicator made since (a plan's send mode) is watched too
        followers = self.followers()
        # a memory's own threshold, not the watch's, so that a resumed run watches as before
        learning = any(m.loop_clip.threshold is not None for m in followers) or (
            bool(followers) and step is not None and step < self.watch.every_step_for)
        self._scale(groups, step if finite else None)  # a dropped step's averages are not stepped on
        if finite and (learning or (reading is not None and reading.step == step)):
            self.watch.note([t for g in groups for t in _tensors(g)])

    def settle(self, groups: Sequence, compressor, memory) -> None:
        """At ``step()``, before the optimizer's: what the loop did to the averages since
        :meth:`deliver` (``compressor`` and ``memory``: the entry point's, whose recipe the
        advice quotes), then the averages back at the momentum's scale."""
        followers = self.followers()
        scaler = calling_grad_scaler() if followers else None
        loss_scale = float(scaler.get_scale()) if scaler is not None else 1.0
        for follower in followers if scaler is not None else ():
            follower.loop_clip.attach(scaler, loss_scale)
        ratio = self.watch.changed(loss_scale, [t for g in groups for t in _tensors(g)])
        unclip = None
        if ratio is not None:
            if self._clipped_where_followed(followers, self.watch.threshold):
                unclip = 1.0 / ratio
            else:
                share = self.watch.threshold / math.sqrt(self.backend.size)
                for follower in followers:
                    follower.follow_loop_clip(share)
                message = self.watch.advise(compressor, memory, ratio)
                if message is not None and self.backend.rank == 0:
                    warnings.warn(message, RuntimeWarning, stacklevel=4)
        self._unscale(groups, unclip)

    def _clipped_where_followed(self, followers, norm: float) -> bool:
        """Whether the loop clipped the averages to the threshold every following memory
        clips at the share of (``norm``: their norm after the loop's clip); read from the
        memories' own state, so a resumed run decides as the uninterrupted one."""
        shares = {m.loop_clip.threshold for m in followers}
        if not shares or None in shares or len(shares) > 1:
            return False
        threshold = shares.pop() * math.sqrt(self.backend.size)
        return abs(norm - threshold) <= 1e-3 * threshold

    def _scale(self, groups: Sequence, step: Optional[int]) -> None:
        """Multiply each group's averages by its memory's delivery scale at ``step`` (None:
        none) until :meth:`_unscale`."""
        self._delivered = {}
        if step is None:
            return
        for index, group in enumerate(groups):
            scale = self.lifecycle.communicator_for(group.send).memory.delivery_scale(step)
            if scale != 1.0 and _tensors(group):
                for tensor in _tensors(group):
                    tensor.mul_(scale)
                self._delivered[index] = scale

    def _unscale(self, groups: Sequence, unclip: Optional[float]) -> None:
        """Divide what :meth:`_scale` multiplied, and multiply the averages of the groups
        whose memory follows the loop's clipping by ``unclip`` (the inverse of its clip)."""
        delivered, self._delivered = self._delivered, {}
        for index, group in enumerate(groups):
            factor = 1.0 / delivered[index] if index in delivered else 1.0
            if unclip is not None and self.lifecycle.communicator_for(group.send).memory.follows_loop_clip:
                factor *= unclip
            if factor != 1.0:
                for tensor in _tensors(group):
                    tensor.mul_(factor)


class StepHookedHandOver:
    """The half an entry point without its own ``step()`` shares (the DDP hook, FSDP2): the
    hand-over, settled by a step pre-hook on the optimizer it was shown.  A subclass says
    what the averages are at the step's end and at ``step()`` (:meth:`_settle`).

    The optimizer it was shown also skips a dropped step: the step's averages are NaN (as
    an allreduce of a NaN would leave them), and a loop that calls ``step()`` anyway, as
    most do without a ``GradScaler``, would write NaN into every parameter.  So, for the
    ``step()`` after a dropped backward, its parameters' gradients are set aside (``None``,
    which every torch optimizer skips: no update, no moment, no weight decay) and put back
    after it, NaN as before, for a loop that reads them."""

    def __init__(self, lifecycle, backend, total=None):
        self.hand_over = LoopHandOver(lifecycle, backend, total)
        self._handles: list = []
        self._settled_by: tuple = ()  # the compressor and memory the advice quotes
        self._dropped = False  # the last settled step was dropped, and no step() ran since
        self._set_aside: list = []  # (parameter, its NaN gradient) during a skipped step()

    @property
    def active(self) -> bool:
        """An optimizer was shown: its steps settle what the step's end scaled."""
        return bool(self._handles)

    def watch(self, optimizer, compressor, memory) -> None:
        """Settle at every ``step()`` of ``optimizer`` (the one inside a framework's wrapper),
        and skip the one after a dropped backward; one shown another optimizer stops
        watching the first."""
        self.close()
        self._settled_by = (compressor, memory)
        inner = innermost(optimizer)
        self._handles = [inner.register_step_pre_hook(self._before_step),
                         inner.register_step_post_hook(self._put_back),
                         self.hand_over.lifecycle.step_listeners.add(self._on_step)]
        self.hand_over.mark_watched()

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _on_step(self, step: int, outcome) -> None:
        self._dropped = not outcome.finite

    def _before_step(self, optimizer, *_) -> None:
        self._put_back()  # a step that raised left them aside
        self._settle()
        if self._dropped:
            self._dropped = False
            self._set_aside = [(p, p.grad) for group in optimizer.param_groups for p in group["params"]
                               if p.grad is not None]
            for p, _ in self._set_aside:
                p.grad = None

    def _put_back(self, *_) -> None:
        set_aside, self._set_aside = self._set_aside, []
        for p, grad in set_aside:
            p.grad = grad

    def _settle(self, *_) -> None:
        raise NotImplementedError


def _tensors(group) -> list:
    """A group's averages as tensors (none when its buffer is None)."""
    buffer = group.buffer
    if buffer is None:
        return []
    return list(buffer) if isinstance(buffer, (list, tuple)) else [buffer]
