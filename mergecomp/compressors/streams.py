"""Private random streams for stochastic compressors, staged like the rest of a step's state.

Stochastic rounding (QSGD, TernGrad) must draw different bits on different ranks (else
every rank rounds the same way and the errors add up instead of averaging out) and the
same bits after a checkpoint is resumed.  Drawing from torch's global generator gives
neither: every library in the process moves it, and a checkpoint does not hold it.

The quantisers need one 31-bit key per step (:func:`~mergecomp.kernels.random_int16`
hashes counters under it).  :class:`RandomStreams` derives that key from (seed, this
process's rank, group name, the group's step count) with the SplitMix64 finaliser, a
counter-based stream: its whole state is one step count per group.  So a group's stream
depends neither on the other groups nor on the order in which they are compressed, the
state is a few integers in ``state_dict()``, staged with the step (:class:`StagedDict`:
``rollback()`` rewinds the count, so a dropped step's keys are drawn again), and when the
plan regroups the parameters the new groups' counts start at zero like every other
per-group counter (:mod:`mergecomp.runtime.regroup`).
"""
from __future__ import annotations

import zlib
from typing import Dict

from ..kernels.hashing import MASK64, splitmix64
from ..staging import StagedDict
from .base import Compressor


def stream_seed(seed: int, rank: int, name: str) -> int:
    """A 64-bit word for (seed, rank, group name): distinct streams for distinct triples."""
    return splitmix64(splitmix64(splitmix64(int(seed) & MASK64) ^ (int(rank) & MASK64)) ^ zlib.crc32(name.encode()))


class RandomStreams:
    """One counter-based key stream per group, from (seed, rank, name); staged step counts."""

    def __init__(self, seed: int):
        self.seed = int(seed)
        self.rank = 0
        self.steps = StagedDict()
        self._bases: Dict[str, int] = {}

    def set_rank(self, rank: int) -> None:
        self.rank = int(rank)
        self._bases.clear()

    def key(self, name: str, numel: int) -> int:
        """This step's key for group ``name``: uniform below 2^31 − ⌈numel/2⌉ (so the
        ⌈numel/2⌉ counters of :func:`~mergecomp.kernels.random_int16` do not wrap)."""
        step = self.steps.get(name, 0)
        self.steps[name] = step + 1
        base = self._bases.get(name)
        if base is None:
            base = self._bases[name] = stream_seed(self.seed, self.rank, name)
        return splitmix64((base + step) & MASK64) % ((1 << 31) - (numel + 1) // 2)

    def commit(self) -> None:
        self.steps.commit()

    def rollback(self) -> None:
        self.steps.rollback()

    def state_dict(self) -> Dict[str, int]:
        return self.steps.committed()

    def load_state_dict(self, steps: Dict[str, int]) -> None:
        self.steps.replace({str(name): int(step) for name, step in steps.items()})


class StochasticCompressor(Compressor):
    """Base of compressors that round stochastically: a private :class:`RandomStreams`
    seeded from ``seed`` and this process's rank, in the state and staged with the step."""

    staged_state = ("streams",)

    def __init__(self, seed: int = 0):
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ValueError(f"seed must be an integer, got {seed!r}")
        self.seed = seed
        self.streams = RandomStreams(seed)

    def set_process_rank(self, rank: int) -> None:
        super().set_process_rank(rank)
        self.streams.set_rank(rank)

    def state_dict(self):
        return {"steps": self.streams.state_dict()}

    def load_state_dict(self, state):
        unknown = set(state) - {"steps"}
        if unknown:
            raise ValueError(f"{type(self).__name__} state has unknown keys {sorted(unknown)}; "
                             f"expected 'steps' (from state_dict())")
        self.streams.load_state_dict(state.get("steps", {}))
