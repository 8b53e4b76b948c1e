"""DGC memory: momentum correction, momentum factor masking and local gradient clipping.

Lin et al., "Deep Gradient Compression: Reducing the Communication Bandwidth for
Distributed Training", ICLR 2018, Section 3.2 and Algorithm 1 (lines 6-12).

How it combines with the wrapped optimizer: momentum moves *into* this memory.  Each rank
accumulates velocity locally, u ← m·u + g, v ← v + u (Nesterov: u ← m·(u + g),
v ← v + u + g), and the sparse compressor sends the largest entries of v, which are
already momentum updates; the optimizer must then apply them as plain SGD steps.  If the
optimizer also had momentum, momentum would be applied twice.  So the optimizer's own
``momentum`` must be 0 (:func:`check_optimizer` refuses anything else, and
:attr:`DGCMemory.needs_plain_optimizer` tells the wrapper to call it), while weight
decay and the learning rate schedule stay with the optimizer.
"""
from __future__ import annotations

from typing import Dict, Optional

import torch

from ..momentum import refuse_optimizer_momentum
from . import register
from .base import Memory


def check_optimizer(optimizer) -> None:
    """Raise ValueError if any parameter group of ``optimizer`` has momentum > 0.

    The DGC memory already applies momentum (momentum correction); a second momentum in
    the optimizer would compound it.  Weight decay, dampening-free SGD, learning-rate
    schedules are all fine.
    """
    refuse_optimizer_momentum(
        optimizer, "the dgc memory (momentum correction)",
        "Use plain SGD (momentum=0; weight decay is fine) and give the momentum to the memory, "
        "e.g. memories.create('dgc', momentum=0.9).")


@register("dgc")
class DGCMemory(Memory):
    """Accumulate momentum-corrected velocity; zero what was sent, in velocity and momentum.

    ``compensate(g)``: optionally clip g to L2 norm ``clip_norm`` (local gradient
    clipping, applied before accumulation as in the paper; the paper uses the global
    threshold scaled by N^(-1/2) for N ranks — pass that value), then
    u ← m·u + g, v ← v + u (plain) or u ← m·(u + g), v ← v + u + g (Nesterov), and return
    v for compression.  ``update``: the coordinates the payload sent are zeroed in v
    (they have been applied) and in u (momentum factor masking, which stops stale momentum
    from pushing a coordinate again after it was sent).  Clipping acts on a fused group,
    the unit the memory sees, rather than on the whole model.
    """

    needs_plain_optimizer = True

    def __init__(self, momentum: float = 0.9, nesterov: bool = False, clip_norm: Optional[float] = None):
        momentum = float(momentum)
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"dgc memory momentum must be in [0, 1), got {momentum!r}; 0.9 is usual")
        if clip_norm is not None:
            clip_norm = float(clip_norm)
            if not clip_norm > 0:
                raise ValueError(f"clip_norm must be a positive number or None, got {clip_norm!r}")
        self.momentum = momentum
        self.nesterov = bool(nesterov)
        self.clip_norm = clip_norm
        self.momenta: Dict[str, torch.Tensor] = {}
        self.velocities: Dict[str, torch.Tensor] = {}

    @staticmethod
    def check_optimizer(optimizer) -> None:
        """See :func:`mergecomp.memories.dgc.check_optimizer`."""
        check_optimizer(optimizer)

    def _state(self, name, tensor):
        momentum = self.momenta.get(name)
        if momentum is None:
            momentum = self.momenta[name] = torch.zeros_like(tensor)
            self.velocities[name] = torch.zeros_like(tensor)
        elif momentum.shape != tensor.shape:
            raise ValueError(
                f"dgc memory of group {name!r} has shape {tuple(momentum.shape)} but the gradient "
                f"has shape {tuple(tensor.shape)}: the plan changed without resetting memory")
        return momentum, self.velocities[name]

    def compensate(self, tensor, name):
        if self.clip_norm is not None:
            norm = torch.linalg.vector_norm(tensor, dtype=torch.float32)
            if norm > self.clip_norm:
                tensor = tensor * (self.clip_norm / float(norm))
        momentum, velocity = self._state(name, tensor)
        if self.nesterov:
            momentum.add_(tensor).mul_(self.momentum)
            velocity.add_(momentum).add_(tensor)
        else:
            momentum.mul_(self.momentum).add_(tensor)
            velocity.add_(momentum)
        return velocity

    def update(self, tensor, name, compressor, payload, ctx):
        momentum, velocity = self._state(name, tensor)
        if compressor.dense and compressor.lossless:
            # Every coordinate went out exactly (a raw FP32 group): the velocity restarts
            # from zero and the momentum is not masked, so a group sent uncompressed trains
            # with plain momentum SGD, as DGC treats uncompressed layers.  The payload is
            # the velocity itself, still to be sent: the zeros get fresh storage.
            self.velocities[name] = torch.zeros_like(velocity)
            return
        if any(_shares_memory(t, velocity) for t in payload):
            # The payload is a view of the velocity: zeroing in place would erase it
            # before it is sent, so the velocity gets fresh storage.
            velocity = self.velocities[name] = velocity.clone()
        flat_v, flat_u = velocity.view(-1), momentum.view(-1)
        if compressor.dense:
            # A 16-bit cast went out: the velocity keeps only its rounding error.
            flat_v.sub_(compressor.decompress(payload, ctx).reshape(-1).to(flat_v.dtype))
            return
        sent = getattr(compressor, "transmitted_indices", None)
        if sent is not None:
            indices = sent(payload, ctx)
            flat_v.index_fill_(0, indices, 0)
            flat_u.index_fill_(0, indices, 0)
        else:
            mask = compressor.decompress(payload, ctx).reshape(-1) != 0
            flat_v.masked_fill_(mask, 0)
            flat_u.masked_fill_(mask, 0)

    def state_dict(self):
        return {"momenta": {k: v.detach().clone() for k, v in self.momenta.items()},
                "velocities": {k: v.detach().clone() for k, v in self.velocities.items()}}

    def load_state_dict(self, state):
        self.momenta = {k: v.clone() for k, v in state.get("momenta", {}).items()}
        self.velocities = {k: v.clone() for k, v in state.get("velocities", {}).items()}

    def __repr__(self):
        return f"DGCMemory(momentum={self.momentum}, nesterov={self.nesterov}, clip_norm={self.clip_norm})"


def _shares_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.device == b.device and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
