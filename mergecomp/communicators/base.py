"""The Communicator contract: move one group's gradient between ranks, compressed.

``start(tensor, name)`` runs error feedback and compression and launches the collective
asynchronously; ``finish(handle)`` waits, decodes, aggregates and averages.  Between the
two, backward goes on.  Compressors that need several collectives (PowerSGD) declare
``multi_round`` and yield their requests from :meth:`Compressor.rounds`; the
communicator runs them, so every collective still goes through the backend in a fixed
order.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, Generator, Optional

import torch

from ..distributed.backends.base import Backend, Work
from ..kernels.finite import nonfinite_flag
from ..kernels.scatter import divide_at
from ..compressors.base import (AllReduce, Compressor, Context, GroupLayout, accepts_keyword, accepts_layout,
                                payload_nbytes)
from ..memories.base import Memory


@dataclass
class Handle:
    """One group in flight: what ``finish`` needs to complete it."""

    name: str
    shape: torch.Size
    work: Work
    ctx: Optional[Context] = None
    rounds: Optional[Generator] = None
    extra: Dict[str, Any] = field(default_factory=dict)
    #: The caller's tensor, when it lent it for the result (``start(..., in_place=True)``).
    output: Optional[torch.Tensor] = None
    #: What was sent (single-round exchanges), until ``finish``: the step log counts the
    #: coordinates a sparse payload carries.
    payload: Optional[tuple] = None

    def future(self) -> "torch.futures.Future":
        """A ``torch.futures.Future`` of the group's (first) collective: ``.then`` chains on
        its completion.  Multi-round exchanges (PowerSGD) launch their next collective from
        :meth:`Communicator.finish`, on the caller's thread, so that every rank issues them
        in the same order: chain ``finish`` only for single-round handles."""
        return self.work.future()


class Communicator:
    """Base class: error feedback + compression + one async collective per group."""

    name = "communicator"

    def __init__(self, compressor: Compressor, memory: Memory, backend: Backend):
        if not isinstance(compressor, Compressor):
            raise TypeError(f"compressor must be a mergecomp Compressor, got {compressor!r}")
        if not isinstance(memory, Memory):
            raise TypeError(f"memory must be a mergecomp Memory, got {memory!r}")
        self.compressor = compressor
        self.memory = memory
        self.backend = backend
        compressor.set_process_rank(getattr(backend, "rank", 0))
        self._layout_keyword = accepts_layout(compressor.rounds if compressor.multi_round
                                              else compressor.compress)
        #: Whether ``rounds`` can write the sum into a lent buffer (asked once, not per group).
        self._rounds_take_out = compressor.multi_round and accepts_keyword(compressor.rounds, "out")

    # -- the pipeline ----------------------------------------------------------------
    def start(self, tensor: torch.Tensor, name: str, layout: Optional[GroupLayout] = None,
              in_place: bool = False) -> Handle:
        """Compensate, compress, record the loss, and launch the collective (async).

        ``layout`` gives the per-parameter views of a fused ``tensor`` (see
        :class:`~mergecomp.compressors.base.ParamView`); None treats it as one tensor.
        ``in_place``: the caller does not need ``tensor``'s values once this returns (its
        own flat group buffer, as DDP's allreduce hook reuses its bucket), so
        :meth:`finish` may write the average into it instead of a new tensor.
        """
        compensated = self.memory.compensate(tensor, name)
        if self.compressor.multi_round:
            lent = in_place and tensor.is_contiguous() and self._rounds_take_out
            rounds = self._encode(self.compressor.rounds, compensated, name, layout,
                                  **({"out": tensor.view(-1)} if lent else {}))
            request = next(rounds)
            return Handle(name, tensor.shape, self._launch_request(request), rounds=rounds)
        payload, ctx = self._compressed(compensated, name, layout)
        output = tensor.view(-1) if in_place and tensor.is_contiguous() else None
        return Handle(name, tensor.shape, self._launch(payload, ctx, name), ctx=ctx, output=output,
                      payload=payload)

    def encode(self, tensor: torch.Tensor, name: str, layout: Optional[GroupLayout] = None):
        """Error feedback and compression of one buffer, as a single-round exchange does it
        before its collective: compensate → compress → update.  Returns ``(payload, ctx)``.
        A communicator that sends several buffers in one collective (FSDP2's scatter) encodes
        each with this."""
        return self._compressed(self.memory.compensate(tensor, name), name, layout)

    def _compressed(self, compensated: torch.Tensor, name: str, layout: Optional[GroupLayout]):
        payload, ctx = self._encode(self.compressor.compress, compensated, name, layout)
        self.memory.update(compensated, name, self.compressor, payload, ctx)
        if getattr(self.memory, "measuring", False):  # a measured step: the byte budget counts its payload
            self.memory.note_sent(name, payload_nbytes(payload))
        return payload, ctx

    def _encode(self, method, tensor: torch.Tensor, name: str, layout: Optional[GroupLayout], **options):
        """``compress``/``rounds`` with the layout, for compressors that take one."""
        if self._layout_keyword:
            return method(tensor, name, layout=layout, **options)
        return method(tensor, name, **options)

    def finish(self, handle: Handle) -> torch.Tensor:
        """Wait for the group and return the average of all ranks' gradients (a sparse sum,
        which names the indices it received, divided there only)."""
        handle.payload = None
        handle.extra.pop("received_indices", None)  # of a previous step, never checked  # the handle outlives the step; the payload need not
        if handle.rounds is not None:
            total = self._run_rounds(handle)
        else:
            total = self._combine(handle.work.wait(), handle)
        if self.compressor.average:
            received = handle.extra.get("received_indices")
            if received is not None:  # a sparse sum, zero outside what was received
                total = divide_at(total, received, self.backend.size)
            else:
                total = total.div_(self.backend.size)
        return total.view(handle.shape)

    def nonfinite_flag(self, handle: Handle, average: torch.Tensor) -> torch.Tensor:
        """A 0-d bool tensor, True when ``average`` (what :meth:`finish` returned for
        ``handle``) holds a NaN or an Inf: a non-finite value anywhere in what this rank
        received makes the sum non-finite where it landed.  By default one pass over the
        average; a communicator that knows where the received values landed (the
        allgather of a sparsifier: the received indices, the rest of the sum is zero)
        reads the sum there only, the same answer for O(k·N) instead of O(n)."""
        received = handle.extra.pop("received_indices", None)
        return nonfinite_flag(average, received)

    def _launch_request(self, request) -> Work:
        if not isinstance(request, AllReduce):
            raise TypeError(f"{type(self.compressor).__name__}.rounds() yielded {request!r}; "
                            "expected mergecomp.compressors.AllReduce")
        return self.backend.allreduce_async(request.tensors)

    def _run_rounds(self, handle: Handle) -> torch.Tensor:
        work = handle.work
        while True:
            try:
                request = handle.rounds.send(work.wait())
            except StopIteration as stop:
                if stop.value is None:
                    raise TypeError(f"{type(self.compressor).__name__}.rounds() must return the "
                                    "summed gradient") from None
                return stop.value
            work = self._launch_request(request)

    # -- what each communicator defines -----------------------------------------------
    def _launch(self, payload, ctx: Context, name: str) -> Work:
        raise NotImplementedError

    def _combine(self, result, handle: Handle) -> torch.Tensor:
        """Turn the collective's result into the *sum* over ranks of decoded gradients."""
        raise NotImplementedError

    # -- state ---------------------------------------------------------------------------
    def commit(self) -> None:
        """Keep what this step wrote into compressor and memory state (every rank agreed)."""
        self.compressor.commit()
        self.memory.commit()

    def rollback(self) -> None:
        """Drop what this step wrote into compressor and memory state."""
        self.compressor.rollback()
        self.memory.rollback()

    def state_dict(self) -> Dict[str, Any]:
        return {"compressor": self.compressor.state_dict(), "memory": self.memory.state_dict()}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.compressor.load_state_dict(state.get("compressor", {}))
        self.memory.load_state_dict(state.get("memory", {}))

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.compressor!r}, {self.memory!r})"
