"""What every rank must agree on in a step, checked with two small collectives.

Data parallelism is only correct when every rank runs the same exchange and applies the
same update.  Two things can break that without any rank noticing:

1. *Before* the exchange, ranks may disagree on what it is: another plan, another DGC
   warm-up epoch (so another payload size), a checkpoint loaded on one rank only.  The
   exchange would then pair collectives of different sizes: a crash inside the collective
   library or silently different models.  :meth:`StepAgreement.preflight` launches one
   allreduce of two numbers, (h, h²) for a hash h of the step's *facts*; every rank gets
   the same sums S₁, S₂, and N·S₂ − S₁² = Σ_{i<j} (hᵢ − hⱼ)² is zero exactly when all
   hashes are equal, so a disagreement is seen by every rank at once.  The hash has as
   many bits (at most 20) as keep N²·h² an exact float64 integer.  Only then
   are the facts themselves gathered, to name the ranks and values in the error.  The
   check is launched at the first gradient of the step and waited for just before the
   first group's collective, so its latency hides behind backward.
2. *After* the exchange, a non-finite gradient on one rank (a NaN from a bad batch, an
   overflow) may have been dropped by a sparsifier on its way, or may have poisoned that
   rank's error-feedback state.  :meth:`StepAgreement.outcome` allreduces one small vector:
   a flag per rank (its local gradient was non-finite), a flag for the averaged gradient,
   the count of ranks still training (for ``join``), and optionally the used-parameter map.
   Every rank then takes the same decision: apply the step and commit compressor state, or
   drop it and roll the state back.

Both vectors are made on the parameters' device, so NCCL takes them.
"""
from __future__ import annotations

import json
import zlib
from dataclasses import dataclass
from typing import Any, List, Mapping, Optional

import torch

from ..distributed.backends.base import Backend, Work
from ..distributed.backends.expect import OBJECT
from ..distributed.backends.serialize import header_error

_MAX_HASH_BITS = 20

#: What to tell the user when ranks disagree on a fact, by the fact's key.
_ADVICE = {
    "plan": "every rank must execute the same plan: let rank 0 plan, or load the same plan file on every rank",
    "steps": "a checkpoint was loaded on some ranks only, or ranks stepped a different number of times: "
             "call load_state_dict on every rank (each with its own file) and step() on every rank",
    "epoch": "call set_epoch(e) on every rank with the same e at the start of each epoch",
    "config": "build the same compressor, memory and communicator (same arguments and seeds) on every rank",
    "state": "every rank must load its own checkpoint of the same run (the files differ in their "
             "optimizer state or configuration)",
    "layout": "every rank must hold the same model and bucket layout",
    "added": "unfreeze the same layers and add the same param groups on every rank, between the same steps",
}


class RanksDisagree(RuntimeError):
    """Ranks are about to run different exchanges; raised on every rank alike."""


class NonFiniteGradient(FloatingPointError):
    """A step's gradient was NaN or Inf on some rank (with ``nonfinite="raise"``)."""


class NonFiniteParameters(FloatingPointError):
    """A step was dropped for a non-finite gradient, and the parameters themselves hold NaN
    or Inf: the optimizer's earlier step made them so, and no later step can mend them.
    Raised with either policy, on every rank alike (their parameters are the same); not a
    :class:`NonFiniteGradient`, so a loop that catches that one to go on past a bad batch
    does not go on dropping every step."""


def check_parameters_finite(named_parameters, dropped: str) -> None:
    """Raise :class:`NonFiniteParameters` if any of ``named_parameters`` holds NaN or Inf
    (read on a dropped step only; ``dropped`` says which step and why)."""
    broken = [name for name, p in named_parameters if not bool(torch.isfinite(p.detach()).all())]
    if not broken:
        return
    shown = ", ".join(repr(name) for name in broken[:3]) + (f" and {len(broken) - 3} more" if len(broken) > 3 else "")
    raise NonFiniteParameters(
        f"{dropped}, but the parameters themselves hold NaN or Inf ({shown}): the optimizer's "
        f"step before made them so, and dropping steps cannot mend that. Load a checkpoint from "
        f"before it; common causes: a learning rate too high, or an Adam on fp16 parameters, "
        f"whose eps (1e-8) is 0 in fp16 (keep fp32 parameters under torch.autocast, or pass "
        f"eps=1e-4)")


def hash_bits(world_size: int) -> int:
    """Bits of the fact hash for ``world_size`` ranks: N²·h² < 2⁵³ keeps the check exact."""
    return max(1, min(_MAX_HASH_BITS, (53 - 2 * max(1, world_size).bit_length()) // 2))


def fact_hash(facts: Mapping[str, Any], bits: int = _MAX_HASH_BITS) -> int:
    """A ``bits``-bit hash of the facts (JSON with sorted keys, so every rank hashes alike)."""
    text = json.dumps(facts, sort_keys=True, default=str)
    return zlib.crc32(text.encode()) & ((1 << bits) - 1)


@dataclass
class StepOutcome:
    """What every rank learnt from :meth:`StepAgreement.outcome`, identical on all ranks."""

    bad_ranks: List[int]
    averaged_nonfinite: bool
    active_ranks: int
    used: Optional[torch.Tensor] = None
    #: The sums over ranks of the ``extra`` numbers each rank added (the drift's terms).
    extra: Optional[torch.Tensor] = None

    @property
    def finite(self) -> bool:
        return not self.bad_ranks and not self.averaged_nonfinite

    def describe(self) -> str:
        parts = []
        if self.bad_ranks:
            parts.append(f"the local gradient of rank(s) {self.bad_ranks} held NaN or Inf")
        if self.averaged_nonfinite:
            parts.append("the averaged gradient held NaN or Inf (e.g. an overflow of a 16-bit sum)")
        return "; ".join(parts) or "finite"


class StepAgreement:
    """The preflight check and the outcome vote of one rank, on ``device``."""

    def __init__(self, backend: Backend, device: torch.device):
        self.backend = backend
        self.device = torch.device(device)

    # -- before the exchange -----------------------------------------------------------------
    def preflight(self, facts: Mapping[str, Any]) -> Work:
        """Launch the (h, h²) allreduce for ``facts``; pass the Work to :meth:`check`."""
        h = float(fact_hash(facts, hash_bits(self.backend.size)))
        sums = torch.tensor([h, h * h], dtype=torch.float64, device=self.device)
        return self.backend.allreduce_async([sums])

    def check(self, work: Work, facts: Mapping[str, Any], where: str) -> None:
        """Wait for the preflight; on a disagreement, name it on every rank and raise."""
        (sums,) = work.wait()
        total, squares = (float(x) for x in sums.tolist())
        size = self.backend.size
        if total * total == squares * size:  # every hash equal: zero variance
            return
        everyone = self.backend.allgather_object(dict(facts), expect=OBJECT)
        raise RanksDisagree(describe_disagreement(everyone, where))

    # -- after the exchange ------------------------------------------------------------------
    def outcome(self, local_nonfinite: Optional[torch.Tensor], averaged_nonfinite: Optional[torch.Tensor],
                active: bool, used: Optional[torch.Tensor] = None,
                extra: Optional[torch.Tensor] = None) -> StepOutcome:
        """Allreduce this rank's flags (0-d bool tensors or None) and return the common outcome.

        ``used`` (one entry per parameter, 1 where this rank has a gradient) comes back as
        the number of ranks that used each parameter; ``extra`` (numbers every rank adds, as
        many on each: the drift's terms) comes back summed over ranks.
        """
        size, rank = self.backend.size, self.backend.rank
        mapped = 0 if used is None else used.numel()
        flags = torch.zeros(size + 2 + mapped + (0 if extra is None else extra.numel()),
                            dtype=torch.float32, device=self.device)
        if local_nonfinite is not None:
            flags[rank] = local_nonfinite.to(device=self.device, dtype=torch.float32)
        if averaged_nonfinite is not None:
            flags[size] = averaged_nonfinite.to(device=self.device, dtype=torch.float32)
        flags[size + 1] = 1.0 if active else 0.0
        if used is not None:
            flags[size + 2:size + 2 + mapped] = used.to(device=self.device, dtype=torch.float32)
        if extra is not None:
            flags[size + 2 + mapped:] = extra.to(device=self.device, dtype=torch.float32)
        (summed,) = self.backend.allreduce_async([flags]).wait()
        head = summed[:size + 2].tolist()
        return StepOutcome(bad_ranks=[r for r in range(size) if head[r] > 0],
                           averaged_nonfinite=head[size] > 0, active_ranks=int(round(head[size + 1])),
                           used=summed[size + 2:size + 2 + mapped] if used is not None else None,
                           extra=summed[size + 2 + mapped:] if extra is not None else None)


def agreement_nbytes(world_size: int, parameters_mapped: int = 0) -> int:
    """Bytes one rank hands to the collectives per step for the agreement: the preflight's
    two float64 numbers and the outcome's float32 vector (a flag per rank, the averaged
    gradient's flag, the active count, and one entry per parameter when the used-map is
    exchanged)."""
    return 2 * 8 + 4 * (world_size + 2 + parameters_mapped)


def describe_disagreement(everyone: List[Mapping[str, Any]], where: str) -> str:
    """One message naming every fact on which ranks differ, with each rank's value (a rank
    whose facts are no JSON object is named in a HeaderError instead)."""
    for rank, facts in enumerate(everyone):
        problem = OBJECT.problem(facts, "its set of facts")
        if problem is not None:
            raise header_error(rank, problem)
    keys = sorted({k for facts in everyone for k in facts})
    lines = []
    for key in keys:
        values = [facts.get(key) for facts in everyone]
        if len(set(json.dumps(v, sort_keys=True, default=str) for v in values)) > 1:
            per_rank = ", ".join(f"rank {r}: {v!r}" for r, v in enumerate(values))
            advice = _ADVICE.get(key, "make it the same on every rank")
            lines.append(f"  {key}: {per_rank} — {advice}")
    if not lines:  # a hash collision of different facts is impossible; equal facts, different hashes
        lines.append("  (the facts agree but their hashes do not: ranks run different mergecomp versions?)")
    return f"ranks disagree {where}; nothing was exchanged:\n" + "\n".join(lines)
