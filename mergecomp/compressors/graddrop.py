"""Gradient dropping.

Aji & Heafield, "Sparse Communication for Distributed Gradient Descent", EMNLP 2017.

    t = the (1 − R) quantile of |g| over a strided sample;   I = {i : |g_i| ≥ t};
    send (g_I, I);   decode: ĝ_i = g_i for i ∈ I, else 0.

On the wire (the default ``"auto"``: the smaller of the two 8-bit block wires of
:mod:`.blockwire` for the planned R·n, ``"tight8"`` at the default density): c ≈ R·n values
in 8 bits after one power-of-two scale, c 8-bit offsets within blocks of 255 coordinates
and a one-byte count per block; ``"compact8"``: the 8-bit values, 16-bit offsets within
blocks of 65,536 and an int32 count per block; ``"compact"``: 16-bit values;
``wire_format="indexed"``: c values in the gradient's dtype and c int32 indices.
"""
from __future__ import annotations

from types import MappingProxyType

import torch

from . import register
from .base import Context, check_ratio
from ..kernels import BlockPeaks, Scratch, gather, sampled_threshold
from .recipes import Recipe
from .blockwire import check_wire_format
from .sparsifier import RESIDUAL_CLIPPING_REASON, SparseCompressor, num_selected
from .warmup import DensityWarmup


@register("graddrop")
class GradDropCompressor(DensityWarmup, SparseCompressor):
    """Drop every element below a magnitude threshold chosen so that a fraction R survives.

    As in Aji & Heafield, the threshold is the (1 − R) quantile of a strided sample of |g|,
    not an exact top-k: the number sent varies from step to step (``fixed_size = False``),
    with no refinement or cap (that is DGC's addition).  Biased; the dropped values must be
    accumulated, which the ``residual`` memory does.

    It selects what top-k selects, up to the threshold's noise, so it takes top-k's memory,
    warm-up and recipe: the residual with SGD's momentum, or an Adam's first moment with
    momentum factor masking, before the exchange (``memories.create("residual",
    momentum="optimizer", adam=True)``; SGD without momentum: plain error feedback), under
    an Adam DGC's density warm-up (``warmup="auto"``, :class:`~.warmup.DensityWarmup`), and
    each rank's gradient clipped before it is accumulated (why: docs/results.md#lm-catch-up
    and #adamw-topk-default).

    How close to R·n: the sample has m = max(``min_samples``, ``sample_ratio``·n,
    ``sample_survivors``/R) elements (the whole tensor when that reaches n, and then the
    count is k = R·n up to ties), and the threshold is its j-th largest magnitude,
    j = ⌈R·m⌉ ≥ ``sample_survivors``.  For i.i.d. magnitudes the count sent then has mean
    R·n·(1 + O(1/j)) and a relative standard deviation of about 1/√j: 1/√400 = 5% with the
    defaults (gradients whose magnitudes follow a pattern at the sample's stride can do
    worse).  A small sample (the paper's 0.1%) makes the count noisy: at R = 1% a sample
    of 1024 elements keeps j ≈ 10, a relative deviation near 30%.

    NaN elements are never selected (a NaN fails the threshold test) and do not disturb
    the threshold; the reducer drops non-finite steps anyway.

    Wire for n elements, c ≈ R·n sent (``wire_format``): top-k's formats, with c for k
    (:class:`~.topk.TopKCompressor`, :mod:`.blockwire`); ``"auto"``, the default, picks
    between the two 8-bit ones for the planned R·n, which every rank shares.  Its default
    density is top-k's, 3.5%: on the tight wire, fewer bytes than 1% takes on the indexed
    one.
    """

    summable = False
    fixed_size = False
    unbiased = False
    recommended_memory = "residual"
    recommended_memory_options = MappingProxyType({"momentum": "optimizer", "adam": True})
    recommended_communicator = "allgather"
    recipe = Recipe(reason=RESIDUAL_CLIPPING_REASON + "; its default memory applies SGD's "
                           "momentum before the exchange, as top-k's does",
                    local_clipping=True)

    def __init__(self, compress_ratio: float = 0.035, sample_ratio: float = 0.001, min_samples: int = 1024,
                 sample_survivors: int = 400, warmup="auto", warmup_steps: int = 0, wire_format: str = "auto"):
        self.compress_ratio = check_ratio(compress_ratio)
        self.wire_format = check_wire_format(wire_format)
        self._start_warmup(warmup, warmup_steps)
        self.sample_ratio = check_ratio(sample_ratio, "sample_ratio")
        for what, value in (("min_samples", min_samples), ("sample_survivors", sample_survivors)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{what} must be a positive integer, got {value!r}")
        self.min_samples = min_samples
        self.sample_survivors = sample_survivors
        self._scratch = Scratch()

    knob = "density"

    def compress(self, tensor, name, layout=None):
        self._warn_if_warmup_off()
        self._compressed = True
        flat = tensor.reshape(-1)
        n = flat.numel()
        if not n:
            indices = torch.empty(0, dtype=torch.int64, device=flat.device)
            return self.wire_payload(flat[:0], indices, n), Context(tensor.shape, tensor.dtype)
        planned = num_selected(n, self.scaled_ratio(name, self.density()))  # the same on every rank
        threshold = sampled_threshold(flat, planned, self.sample_ratio,
                                      self.min_samples, survivors=self.sample_survivors)
        indices = BlockPeaks(flat, self._scratch).indices_at_least(threshold)  # ascending
        return self.wire_payload(gather(flat, indices), indices, n, planned), Context(tensor.shape, tensor.dtype)

    def wire_nbytes(self, numel, element_size, payload=None, layout=None):
        """c × (value bytes + index bytes) for the c values of ``payload`` (unbounded, so the
        payload is needed)."""
        if payload is None:
            raise ValueError("GradDrop sends a variable number of values with no bound: "
                             "pass the payload to count its bytes")
        count = payload[0].numel()
        if payload[1].numel() != count or count > numel:
            raise ValueError(f"GradDrop payload has {count} values and {payload[1].numel()} indices "
                             f"for {numel} elements; expected as many indices as values, at most n")
        return self.entries_nbytes(count, numel, element_size, payload)
