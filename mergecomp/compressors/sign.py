"""Sign compressors: signSGD, EF-SignSGD and SIGNUM, one bit per element on the wire.

Bernstein et al., "signSGD: Compressed Optimisation for Non-Convex Problems", ICML 2018;
Bernstein et al., "signSGD with Majority Vote is Communication Efficient and Fault
Tolerant", ICLR 2019; Karimireddy et al., "Error Feedback Fixes SignSGD and other Gradient
Compression Schemes", ICML 2019.

Signs travel as a packed bit mask (bit set = negative), so n elements cost ⌈n/8⌉ bytes.
What travels is the IEEE sign bit: +0.0 is sent as +1, as in the reference implementations,
and −0.0 as −1 (reading the bit is one integer pass; ``x < 0`` costs several times more).
"""
from __future__ import annotations

import functools
from typing import Dict

import torch

from ..momentum import refuse_optimizer_momentum
from . import native, register
from .base import Compressor, Context
from .packing import Scratch, decode_values, pack_bits
from .quantize import sign_bits


def pack_signs(tensor: torch.Tensor, scratch: Scratch) -> torch.Tensor:
    """⌈n/8⌉ bytes: bit i is set where element i has its sign bit set (is negative, or −0.0).

    One native pass on the CPU (read the sign bits, pack them); elsewhere a flag pass and
    a packing pass.
    """
    if native.usable(tensor):
        return native.pack_signs(tensor)
    return pack_bits(sign_bits(tensor, scratch), 1)


@functools.lru_cache(maxsize=16)
def _plus_minus_one(dtype: torch.dtype, device: str) -> torch.Tensor:
    return torch.tensor([1, -1], dtype=dtype, device=device)


def unpack_signs(packed: torch.Tensor, ctx: Context) -> torch.Tensor:
    """New ±1 tensor of ``ctx``'s shape and dtype from :func:`pack_signs`' bytes.

    One table gather writes the output: a clear bit becomes +1, a set bit −1, already in
    ``ctx.dtype``.
    """
    return decode_values(packed, 1, ctx.numel, _plus_minus_one(ctx.dtype, str(packed.device))).view(ctx.shape)


class _MajorityVote(Compressor):
    """Aggregation by majority vote: the update is the sign of the sum of the ranks' signs."""

    summable = False
    fixed_size = True
    average = False
    recommended_memory = "none"
    recommended_communicator = "allgather"

    def aggregate(self, tensors):
        return super().aggregate(tensors).sign_()


@register("signsgd")
class SignSGDCompressor(_MajorityVote):
    """Send sign(g); the ranks' signs are combined by majority vote (sign of their sum).

    Biased (the magnitude is lost), which the majority vote analysis of Bernstein et al.
    (ICLR 2019) accepts: use a small learning rate, as for Adam-like updates.  Ties of an
    even number of ranks give 0 (no step on that coordinate).

    Wire for n elements: ⌈n/8⌉ bytes.  ``average = False``: the vote is the update.
    """

    def __init__(self):
        self._scratch = Scratch()

    def compress(self, tensor, name):
        return (pack_signs(tensor, self._scratch),), Context(tensor.shape, tensor.dtype)

    def decompress(self, payload, ctx):
        return unpack_signs(payload[0], ctx)


@register("signum")
class SignumCompressor(_MajorityVote):
    """SIGNUM: send the sign of the momentum m ← β·m + (1 − β)·g, combined by majority vote.

    Bernstein et al. (ICML 2018, ICLR 2019).  The momentum lives here, per group, so the
    wrapped optimizer must be plain SGD without momentum.  Biased like signSGD.

    Wire for n elements: ⌈n/8⌉ bytes.  ``average = False``.
    """

    def check_optimizer(self, optimizer) -> None:
        """Refuse an optimizer with its own momentum: SIGNUM's momentum lives here."""
        refuse_optimizer_momentum(
            optimizer, "the signum compressor (sign of momentum)",
            f"Use plain SGD (momentum=0) and set the compressor's beta (now {self.beta}).")

    def __init__(self, beta: float = 0.9):
        beta = float(beta)
        if not 0.0 <= beta < 1.0:
            raise ValueError(f"signum momentum beta must be in [0, 1), got {beta!r}; 0.9 is usual")
        self.beta = beta
        self._scratch = Scratch()
        self.momenta: Dict[str, torch.Tensor] = {}

    def compress(self, tensor, name):
        momentum = self.momenta.get(name)
        if momentum is None:
            momentum = self.momenta[name] = torch.zeros_like(tensor)
        elif momentum.shape != tensor.shape:
            raise ValueError(
                f"signum momentum of group {name!r} has shape {tuple(momentum.shape)} but the "
                f"gradient has shape {tuple(tensor.shape)}: the plan changed; create a new compressor")
        momentum.mul_(self.beta).add_(tensor, alpha=1.0 - self.beta)
        return (pack_signs(momentum, self._scratch),), Context(tensor.shape, tensor.dtype)

    def decompress(self, payload, ctx):
        return unpack_signs(payload[0], ctx)

    def state_dict(self):
        return {"momenta": {k: v.detach().clone() for k, v in self.momenta.items()}}

    def load_state_dict(self, state):
        self.momenta = {k: v.clone() for k, v in state.get("momenta", {}).items()}

    def __repr__(self):
        return f"SignumCompressor(beta={self.beta})"


@register("efsignsgd")
class EFSignSGDCompressor(Compressor):
    """EF-SignSGD: send (‖g‖₁/n)·sign(g), the scaled sign, and keep the error as residual.

    Karimireddy et al. (ICML 2019): the scale makes the compressor a δ-approximate one, so
    error feedback (the ``residual`` memory) restores SGD's convergence.  Biased.

    Wire for n elements: ⌈n/8⌉ bytes of signs + 4 bytes for the fp32 scale.
    """

    summable = False
    fixed_size = True
    recommended_memory = "residual"
    recommended_communicator = "allgather"

    def __init__(self):
        self._scratch = Scratch()

    def compress(self, tensor, name):
        flat = tensor.reshape(-1)
        magnitudes = torch.abs(flat, out=self._scratch.get("abs", flat.numel(), flat.dtype, flat.device))
        scale = magnitudes.sum(dtype=torch.float32) / max(1, flat.numel())
        return (pack_signs(flat, self._scratch), scale.reshape(1)), Context(tensor.shape, tensor.dtype)

    def decompress(self, payload, ctx):
        packed, scale = payload
        # ±scale straight from the table: the same bits as ±1 times the scale, one pass.
        scale = scale.reshape(1).to(ctx.dtype)
        return decode_values(packed, 1, ctx.numel, torch.cat([scale, -scale])).view(ctx.shape)
