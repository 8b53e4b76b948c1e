"""Deep Gradient Compression: sampled-threshold sparsification with a warm-up schedule.

Lin et al., "Deep Gradient Compression: Reducing the Communication Bandwidth for
Distributed Training", ICLR 2018.  Momentum correction, momentum factor masking and
local gradient clipping are the ``dgc`` memory's job (mergecomp.memories.dgc); this file
is the selection and the wire format.

    t = the k-th largest |g| of a strided sample (scaled to the sample);
    while |{i : |g_i| ≥ t}| < 0.8k: t ← 0.8·t;   I = those i (the top k of them if more);
    send (g_I, I);   decode: ĝ_i = g_i for i ∈ I, else 0.

On the wire (the default ``"auto"``: the smaller of the two 8-bit block wires of
:mod:`.blockwire` for the bound k, ``"tight8"`` at the default density): c ≤ k values in 8
bits after one power-of-two scale, c 8-bit offsets within blocks of 255 coordinates, a
one-byte count per block and the scale: 2·c + ⌈n / 255⌉ + 4 bytes.  ``"compact8"``: 16-bit
offsets within blocks of 65,536 and an int32 count per block, 3·c + 4·⌈n / 65,536⌉ + 4.
``"indexed"``, the paper's: c values (gradient dtype, or fp16) and c int32 indices.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from . import register
from .base import Context, check_ratio
from ..kernels import BlockPeaks, Scratch, gather, sampled_threshold, top_positions
from .recipes import Recipe
from . import blockwire
from .blockwire import BLOCK_FORMATS, check_wire_format
from .sparsifier import SparseCompressor, index_dtype, num_selected
from .warmup import DensityWarmup


@dataclass(frozen=True)
class DensityContext(Context):
    """DGC's context: the density this group's payload was selected at (the warm-up's, times
    the group's scale), which bounds its size; agreed by every rank, so a layout field."""

    density: float = 0.0
    layout_fields = ("density",)


@register("dgc")
class DGCCompressor(DensityWarmup, SparseCompressor):
    """Send the elements whose magnitude passes a threshold estimated from a 1% sample.

    Only blocks whose peak passes are examined element by element (``selection``), so
    at the paper's 0.1% density selection reads the tensor about once.

    The threshold is the k-th largest magnitude of a strided sample (k = density·n scaled
    to the sample, times ``sample_margin``).  At 0.1% density a 1% sample keeps only its
    top 10, whose minimum is a noisy estimate: with a margin of 1 about a third of the
    steps pass fewer than 0.8k and pay a second selection; the default 1.5 makes that
    rare (1 in 40 on Gaussian data), and the cap re-selects exactly k anyway.  When too few elements pass (< 0.8k) it is lowered by the factor 0.8 and
    the selection redone (at most ``max_adjust`` times, as the reference implementation's
    adaptation loop; a halving would overshoot to ~100× k in a Gaussian tail); when more than k pass, exactly k are
    re-selected among the candidates by top-k, so at most k values are ever sent.  The
    count varies from step to step: ``fixed_size = False``.  Biased: use the ``dgc``
    memory (momentum correction, masking, clipping), or ``residual``.

    Density: ``compress_ratio`` after its warm-up (:class:`~.warmup.DensityWarmup`).
    ``warmup="auto"``, the default, is the paper's four epochs under an Adam or AdamW (25%
    down to ``compress_ratio``, following ``set_epoch``; ``warmup_steps=S``: the first S steps
    instead) and none under SGD, as top-k's: with the quality controller on, the warm-up's
    dense first epochs took the bytes the controller would have spent later, and under SGD
    the run ended further from dense than top-k's at the same bytes (docs/results.md#dgc-compact8).
    ``warmup=4`` asks for the paper's warm-up under any optimizer; a compressor asked for one
    but never told an epoch sends at ``compress_ratio`` from the first step and warns once.

    The epoch is part of ``state_dict()`` (a resumed run keeps its density).  NaN
    elements are never selected (a NaN fails the threshold test) and do not disturb the
    threshold; the reducer drops non-finite steps anyway.

    Wire for n elements, c ≤ k values sent (``wire_format``): top-k's formats, with c for k
    (:class:`~.topk.TopKCompressor`, :mod:`.blockwire`); ``"auto"``, the default, picks
    between the two 8-bit ones for the bound k.  On ``"indexed"`` the values travel in the
    input dtype (2 bytes with ``fp16_values=True``) with int32 indices (``index_bits=64``
    for int64), the only wire those two options shape.  The default density, 3.5%, is
    top-k's: on the tight wire, fewer bytes than 1% takes on the indexed one.  The paper's
    setting: ``compress_ratio=0.001, warmup=4, wire_format="indexed"``.
    """

    summable = False
    unbiased = False
    fixed_size = False
    recommended_memory = "dgc"
    recommended_communicator = "allgather"
    recipe = Recipe(
        reason="the velocity it sends carries many steps of momentum-corrected gradient, so "
               "clipping the averaged update after the exchange shrinks the steps far more than "
               "dense SGD's, and what it cuts is never sent again; under an Adam its warm-up follows "
               "epochs (set_epoch) or, for a run that is not epoch-based, warmup_steps; momentum factor "
               "masking takes most of the step of coordinates sent often, which a run far shorter "
               "than the paper's feels: under SGD with a loop the wrapper or the DDP hook watches, "
               "the dgc memory masks only once the loop clips (masking=False or True fixes it; "
               "a transformer whose loop clips diverged without masking)",
        paper="Lin et al. (2018, section 3.2) clip each node's gradient before accumulation at "
              "the global threshold × N^(-1/2) and warm the density up over the first epochs",
        local_clipping=True)

    def __init__(self, compress_ratio: float = 0.035, warmup="auto", sample_ratio: float = 0.01,
                 min_samples: int = 1024, max_adjust: int = 10, fp16_values: bool = False,
                 index_bits: int = 32, sample_margin: float = 1.5, warmup_steps: int = 0,
                 wire_format: str = "auto"):
        self.compress_ratio = check_ratio(compress_ratio)
        self.wire_format = check_wire_format(wire_format)
        self._start_warmup(warmup, warmup_steps)
        self.sample_ratio = check_ratio(sample_ratio, "sample_ratio")
        if isinstance(min_samples, bool) or not isinstance(min_samples, int) or min_samples < 1:
            raise ValueError(f"min_samples must be a positive integer, got {min_samples!r}")
        if isinstance(max_adjust, bool) or not isinstance(max_adjust, int) or max_adjust < 0:
            raise ValueError(f"max_adjust must be a non-negative integer, got {max_adjust!r}")
        if index_bits not in (32, 64):
            raise ValueError(f"index_bits must be 32 or 64, got {index_bits!r}")
        if self.wire_format in BLOCK_FORMATS and (fp16_values or index_bits != 32):
            raise ValueError(f"fp16_values and index_bits shape the 'indexed' wire; the {wire_format!r} "
                             f"wire has its own value and offset widths (got fp16_values={fp16_values!r}, "
                             f"index_bits={index_bits!r}): drop them, or use wire_format='indexed'")
        sample_margin = float(sample_margin)
        if not 1.0 <= sample_margin <= 10.0:
            raise ValueError(f"sample_margin must be in [1, 10] (1 is the paper's estimate), got {sample_margin!r}")
        self.sample_margin = sample_margin
        self.min_samples = min_samples
        self.max_adjust = max_adjust
        self.fp16_values = bool(fp16_values)
        self.index_bits = index_bits
        self._scratch = Scratch()

    knob = "density"

    def compress(self, tensor, name, layout=None):
        self._warn_if_warmup_off()
        self._compressed = True
        flat = tensor.reshape(-1)
        n = flat.numel()
        density = self.scaled_ratio(name, self.density())
        k = num_selected(n, density)
        if k >= n:
            indices, values = torch.arange(n, device=flat.device), flat.clone()
        else:
            threshold = sampled_threshold(flat, k, self.sample_ratio, self.min_samples, self.sample_margin)
            blocks = BlockPeaks(flat, self._scratch)
            for _ in range(self.max_adjust + 1):  # lower the threshold while too few pass
                indices = blocks.indices_at_least(threshold)
                if indices.numel() >= 0.8 * k:
                    break
                threshold = threshold * 0.8
            values = gather(flat, indices)
            if indices.numel() > k:  # too many: exactly k among the candidates, kept ascending
                chosen = top_positions(values.abs(), k, ascending=True)
                indices, values = gather(indices, chosen), gather(values, chosen)
        if self.wire_format in BLOCK_FORMATS:  # the indices are ascending, as a block wire needs
            payload = self.wire_payload(values, indices, n, planned=k)  # k: the same on every rank
        else:
            payload = self._indexed_payload(values, indices, n, name)
        return payload, DensityContext(tensor.shape, tensor.dtype, density)

    def _indexed_payload(self, values, indices, n, name):
        """The paper's wire: the values (fp16 with ``fp16_values``) and ``index_bits`` indices."""
        if self.fp16_values and values.dtype == torch.float32:
            values = values.to(torch.float16)
        if self.index_bits == 32 and index_dtype(n) != torch.int32:
            raise ValueError(f"group {name!r} has {n} elements, too many for int32 indices; "
                             f"use index_bits=64")
        return values, indices.to(torch.int32 if self.index_bits == 32 else torch.int64)

    def payload_bound(self, ctx):
        """At most k = density·n values and indices (see the class docstring); the density
        depends on the epoch and on the group's scale (the quality controller's), which every
        rank sets alike."""
        density = getattr(ctx, "density", None)
        k = min(num_selected(ctx.numel, self.density() if density is None else density), ctx.numel)
        if self.wire_format in BLOCK_FORMATS:
            return blockwire.largest_shapes(k, ctx.numel, self.wire_format)
        return (torch.Size([k]), torch.Size([k]))

    def wire_nbytes(self, numel, element_size, payload=None, layout=None):
        """c × (value bytes + index bytes) for the c values of ``payload`` (at most k, which
        is checked); without a payload, the most it can be (c = k)."""
        k = self.payload_bound(Context(torch.Size([numel]), torch.float32))[0][0]
        count = k
        if payload is not None:
            count = payload[0].numel()
            if count > k or payload[1].numel() != count:
                raise ValueError(f"DGC payload has {count} values and {payload[1].numel()} indices "
                                 f"for {numel} elements; at most k = {k} of each, as many indices as values")
        if self.wire_format in BLOCK_FORMATS:
            return self.entries_nbytes(count, numel, element_size, payload, planned=k)
        value_bytes = 2 if self.fp16_values and element_size == 4 else element_size
        return count * (value_bytes + self.index_bits // 8)
