"""Random-k sparsification with indices shared by all ranks.

Stich et al., "Sparsified SGD with Memory", NeurIPS 2018; Wangni et al., "Gradient
Sparsification for Communication-Efficient Distributed Optimization", NeurIPS 2018.

    I = k indices drawn uniformly without replacement (the same on every rank);
    send g_I (× n/k when unbiased);   decode: ĝ_i = the sent value for i ∈ I, else 0.

On the wire: k values in the gradient's dtype; the indices are derived, not sent.
See ``tests/reference_compressors.py`` for the plain version.
"""
from __future__ import annotations

import zlib
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Mapping, Optional

import torch

from ..kernels import random_subset, scatter
from ..kernels.hashing import MASK64, splitmix64
from ..staging import StagedDict
from . import register
from .base import Compressor, Context, check_ratio
from .recipes import Recipe
from .sparsifier import num_selected
from .warmup import ADAM_WARMUP_STEPS, RaisedFirstExchanges, check_adam_warmup_steps


@dataclass(frozen=True)
class RandKContext(Context):
    indices: torch.Tensor
    scale: float


#: The default density with error feedback and unbiased: the least at which each trains
#: (their recipes' ``min_ratio``; docs/results.md#adamw-more-quantisers).
DEFAULT_RATIO = 0.1
UNBIASED_DEFAULT_RATIO = 0.25
#: The residual memory's options with error feedback: SGD's momentum folded for the whole run
#: and the loop's clip left after the exchange (the memory's ``follow_loop``: its averages
#: carry bursts of 1/ratio steps' backlog, which trip a loop's clip early whatever the model).
FOLD_FOR_THE_RUN = MappingProxyType({"momentum": "fold", "follow_loop": False})


@register("randk")
class RandKCompressor(RaisedFirstExchanges, Compressor):
    """Keep k = ratio·n coordinates chosen uniformly at random.

    The indices are the first k values of a permutation keyed by (seed, group name, step)
    (``kernels.random_subset``), identical on every rank and every device (a GPU draws
    them itself, the same integers as a CPU), so only the k values travel and payloads
    are summable (allreduce works).
    With ``unbiased=True`` values are scaled by n/k, making the estimate unbiased; the
    default leaves them unscaled for use with residual memory (error feedback), whose default
    here takes the optimizer's momentum off (``momentum="fold"``: see the EF-SignSGD
    compressor): a coordinate's backlog goes out once every 1/ratio steps, and a momentum
    after the exchange would multiply each late send.  Under SGD the fold lasts the whole run
    and the loop's clip stays after the exchange (``follow_loop=False``): those late sends
    make the averages' norm trip a loop's clip in the first steps on models whose dense loop
    never clips, and SGD's momentum run before the exchange, which an early clip otherwise
    brings, stalls rand-k (see the residual memory).

    The step counters that key the indices are state: saved by ``state_dict()`` and staged
    with the step (``rollback()`` rewinds them), never derived from the rank, so every rank
    draws the same indices.  ``seed`` must be the same on every rank (it shows in ``repr``).

    ``compress_ratio`` defaults to the least each variant trains at: 0.1 with error feedback
    (a coordinate waits 1/ratio steps for its turn), 0.25 unbiased (each step's variance is
    1/ratio times SGD's).  Below them, prefer a selecting compressor (top-k, DGC).  Not
    enough everywhere under SGD with momentum: error-feedback rand-k blew up on a character
    transformer (at the default density and at twice it, with or without the quality
    controller, its momentum folded, run before the exchange or left after it), while top-k
    at a fifth of its bytes kept up there (docs/results.md#randk-gpt-sgd); the drift warning names the
    run's lag there.

    ``warmup_steps``: under an Adam or AdamW (whatever its β1), each group's first
    ``warmup_steps`` exchanges go at :data:`~.warmup.ADAM_WARMUP_SCALE` times the density
    (at most every element), as PowerSGD's first exchanges go at a higher rank and top-k's
    and DGC's density decays from 25% there.  Why: Adam scales each coordinate by its own
    history, and with error feedback a random tenth of the coordinates per step leaves most
    of them without one in the first steps, then sends each its backlog at once; measured
    on a character LSTM under AdamW, rand-k trailed dense from its first hundreds of steps
    and ended behind it, and with its first exchanges raised it led
    (docs/results.md#randk-adam-warmup).  Under SGD nothing changes: on a character
    transformer the same warm-up did not keep rand-k from blowing up.  Unbiased rand-k
    holds no backlog, and ``warmup_steps`` defaults to 0 for it: on the same LSTM it did
    better without the warm-up than with it.

    Wire for n elements: k × value bytes (4k for fp32); no indices.
    """

    summable = True
    unbiased = False  # per instance: the ``unbiased`` option
    recommended_memory = "residual"
    recommended_communicator = "allreduce"
    fixed_size = True
    staged_state = ("_steps",)

    def __init__(self, compress_ratio: Optional[float] = None, seed: int = 0, unbiased: bool = False,
                 warmup_steps: Optional[int] = None):
        self.unbiased = bool(unbiased)
        if warmup_steps is None:  # the warm-up is for error feedback's backlog (the class docstring)
            warmup_steps = 0 if self.unbiased else ADAM_WARMUP_STEPS
        self.warmup_steps = check_adam_warmup_steps(warmup_steps, "randk")
        if compress_ratio is None:  # a random subset needs more than a selected one to train
            compress_ratio = UNBIASED_DEFAULT_RATIO if self.unbiased else DEFAULT_RATIO
        self.compress_ratio = check_ratio(compress_ratio)
        self.seed = int(seed)
        # Unbiased values need no error feedback: a residual of n/k-scaled values grows
        # without bound (a loss of 1e11 in the first epoch was measured with that pairing).
        self.recommended_memory = "none" if self.unbiased else "residual"
        self._steps = StagedDict()

    @property
    def recommended_memory_options(self) -> Mapping[str, Any]:
        """The residual's: SGD's momentum folded into the learning rate for the run, the
        loop's clip left after the exchange, an Adam's β1 off (the memory's "fold",
        ``follow_loop=False``); none without error feedback.  A property, not an instance
        attribute: a read-only mapping does not pickle, and a compressor must (a spawned
        worker, ``copy.deepcopy``)."""
        return Compressor.recommended_memory_options if self.unbiased else FOLD_FOR_THE_RUN

    @property
    def recipe(self) -> Recipe:
        """What rand-k needs at this instance's settings (:mod:`.recipes`)."""
        if self.unbiased:
            return Recipe(
                reason="the kept values are scaled by 1/ratio, so each step's variance is 1/ratio "
                       "times SGD's: the learning rate shrinks by the ratio, and below a quarter "
                       "of the elements no learning rate keeps up with dense SGD",
                lr_scale=self.compress_ratio, min_ratio=0.25, memory="none")
        return Recipe(
            reason="error feedback over a random subset sends each coordinate once every 1/ratio "
                   "steps, so the update is that many steps stale; under 10% no step size keeps up, "
                   "and momentum applied after the exchange multiplies the late sends",
            paper="Mem-SGD (Stich et al., 2018, Algorithm 1) is plain SGD with memory",
            min_ratio=0.1, fold_momentum=True, memory="residual")

    knob = "density"

    def check_optimizer(self, optimizer) -> None:
        """Under an Adam or AdamW the first exchanges go raised (``warmup_steps``)."""
        self.note_optimizer(optimizer)

    def sent_ratio(self, name: str) -> float:
        """The density group ``name`` sends at in its next exchange: the configured one
        times the controller's scale, and times the warm-up's in its first exchanges under
        an Adam (at most 1)."""
        return self.scaled_ratio(name, self.compress_ratio * self.warmup_scale(name))

    def _indices(self, name: str, numel: int, device) -> torch.Tensor:
        k = num_selected(numel, self.sent_ratio(name))
        step = self._steps.get(name, 0)
        self._steps[name] = step + 1
        group = splitmix64(splitmix64(self.seed & MASK64) ^ zlib.crc32(name.encode()))
        key = splitmix64((group + step) & MASK64)
        return random_subset(numel, k, key, device)

    def compress(self, tensor, name, layout=None):
        flat = tensor.reshape(-1)
        indices = self._indices(name, flat.numel(), flat.device)
        scale = flat.numel() / indices.numel() if self.unbiased and indices.numel() else 1.0
        values = torch.index_select(flat, 0, indices)  # faster than flat[indices] on the CPU
        if scale != 1.0:
            values = values * scale
        return (values,), RandKContext(tensor.shape, tensor.dtype, indices, scale)

    def decompress(self, payload, ctx):
        dense = torch.zeros(ctx.numel, dtype=ctx.dtype, device=payload[0].device)
        return scatter(dense, ctx.indices, payload[0], "set").view(ctx.shape)

    def wire_nbytes(self, numel, element_size, payload=None, layout=None):
        """k values in the input dtype; the indices are not sent."""
        return num_selected(numel, self.compress_ratio) * element_size

    def state_dict(self):
        return {"steps": self._steps.committed()}

    def load_state_dict(self, state):
        unknown = set(state) - {"steps"}
        if unknown:
            raise ValueError(f"RandKCompressor state has unknown keys {sorted(unknown)}; expected 'steps'")
        self._steps.replace(dict(state.get("steps", {})))
