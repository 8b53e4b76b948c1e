"""Deep Gradient Compression: sampled-threshold sparsification with a warm-up schedule.

Lin et al., "Deep Gradient Compression: Reducing the Communication Bandwidth for
Distributed Training", ICLR 2018.  Momentum correction, momentum factor masking and
local gradient clipping are the ``dgc`` memory's job (mergecomp.memories.dgc); this file
is the selection and the wire format.

    t = the k-th largest |g| of a strided sample (scaled to the sample);
    while |{i : |g_i| ≥ t}| < 0.8k: t ← 0.8·t;   I = those i (the top k of them if more);
    send (g_I, I);   decode: ĝ_i = g_i for i ∈ I, else 0.

On the wire: c ≤ k values (gradient dtype, or fp16) and c int32 indices.
"""
from __future__ import annotations

from dataclasses import dataclass

from typing import Optional, Sequence

import torch

from . import register
from .base import Context, check_ratio
from ..kernels import BlockPeaks, Scratch, sampled_threshold
from .recipes import Recipe, first_rank_of_job, warn
from .sparsifier import SparseCompressor, index_dtype, num_selected

#: The paper's warm-up: density 25% → 6.25% → 1.5625% → 0.4% → 0.1% over the first epochs.
PAPER_WARMUP = (0.25, 0.0625, 0.015625, 0.004)
#: The step-counted warm-up that the warning without epochs advises, as a share of the run's
#: steps (why a fifth: docs/results.md#lm-topk-lag).
WARMUP_FRACTION_ADVICE = 0.2


@dataclass(frozen=True)
class DensityContext(Context):
    """DGC's context: the density this group's payload was selected at (the warm-up's, times
    the group's scale), which bounds its size; agreed by every rank, so a layout field."""

    density: float = 0.0
    layout_fields = ("density",)


def _chosen_in_order(chosen: torch.Tensor, count: int) -> torch.Tensor:
    """The ``chosen`` positions among ``count`` candidates, ascending.  ``torch.topk(sorted=False)``
    returns its k in an order of its own, which differs between the CPU and CUDA kernels;
    ascending indices make the payload the same bytes on every device, as the wire format
    promises.  On a GPU a sort of the k (a mask would read its count back to the host); on a
    CPU a mask of ``count`` bools, several times cheaper than the sort."""
    if chosen.is_cuda:
        return chosen.sort().values
    mask = torch.zeros(count, dtype=torch.bool, device=chosen.device)
    mask[chosen] = True
    return mask.nonzero().view(-1)


@register("dgc")
class DGCCompressor(SparseCompressor):
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

    Density: ``compress_ratio`` after warm-up.  ``warmup`` is either a number of epochs W
    (the density decays exponentially from 25% to ``compress_ratio`` over W epochs, the
    paper's 25% → 6.25% → 1.5625% → 0.4% → 0.1% for W = 4 and 0.1%) or an explicit list
    of densities for epochs 0, 1, ...; never below ``compress_ratio``.  The default is the
    paper's four epochs, because sparse updates early in training, while the weights change
    fast, cost accuracy; ``warmup=0`` turns it off.  The warm-up follows the epochs the
    training loop reports: call ``optimizer.set_epoch(epoch)`` at the start of every epoch
    (the DistributedOptimizer and the DDP hook state pass it on).  A compressor never told an
    epoch (a throughput benchmark, a loop without epochs) sends at ``compress_ratio`` from
    the first step, and warns once (on rank 0) that its warm-up is off (pass ``warmup=0`` to
    mean it).
    ``warmup_steps=S`` measures the warm-up in steps instead, for runs that
    are not epoch-based (a language model on a long stream, a fixed step budget): the density
    decays exponentially from 25% to ``compress_ratio`` over the first S steps this
    compressor completes (counted at each committed step, so a dropped step does not count;
    saved in ``state_dict()``), and the epochs no longer matter.

    Density, warm-up and language models: docs/results.md#lm-topk-lag.

    The epoch is part of ``state_dict()`` (a resumed run keeps its density).  NaN
    elements are never selected (a NaN fails the threshold test) and do not disturb the
    threshold; the reducer drops non-finite steps anyway.

    Wire for n elements, c ≤ k values sent: c × (value bytes + index bytes) — values in
    the input dtype (2 bytes with ``fp16_values=True``), int32 indices (``index_bits=64``
    for int64).
    """

    summable = False
    unbiased = False
    fixed_size = False
    recommended_memory = "dgc"
    recommended_communicator = "allgather"
    recipe = Recipe(
        reason="the velocity it sends carries many steps of momentum-corrected gradient, so "
               "clipping the averaged update after the exchange shrinks the steps far more than "
               "dense SGD's, and what it cuts is never sent again; the warm-up follows epochs "
               "(set_epoch) or, for a run that is not epoch-based, warmup_steps; momentum factor "
               "masking takes most of the step of coordinates sent often, which a run far shorter "
               "than the paper's feels: the dgc memory's masking=False keeps it",
        paper="Lin et al. (2018, section 3.2) clip each node's gradient before accumulation at "
              "the global threshold × N^(-1/2) and warm the density up over the first epochs",
        local_clipping=True)

    def __init__(self, compress_ratio: float = 0.001, warmup=4, sample_ratio: float = 0.01,
                 min_samples: int = 1024, max_adjust: int = 10, fp16_values: bool = False,
                 index_bits: int = 32, sample_margin: float = 1.5, warmup_steps: int = 0):
        self.compress_ratio = check_ratio(compress_ratio)
        self.warmup = self._check_warmup(warmup)
        if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int) or warmup_steps < 0:
            raise ValueError(f"warmup_steps must be a non-negative integer (0: the warm-up follows "
                             f"the epochs), got {warmup_steps!r}")
        self.warmup_steps = warmup_steps
        self.steps = 0  # committed steps, for a warm-up in steps
        self._compressed = False  # compress() ran in the current step
        self.sample_ratio = check_ratio(sample_ratio, "sample_ratio")
        if isinstance(min_samples, bool) or not isinstance(min_samples, int) or min_samples < 1:
            raise ValueError(f"min_samples must be a positive integer, got {min_samples!r}")
        if isinstance(max_adjust, bool) or not isinstance(max_adjust, int) or max_adjust < 0:
            raise ValueError(f"max_adjust must be a non-negative integer, got {max_adjust!r}")
        if index_bits not in (32, 64):
            raise ValueError(f"index_bits must be 32 or 64, got {index_bits!r}")
        sample_margin = float(sample_margin)
        if not 1.0 <= sample_margin <= 10.0:
            raise ValueError(f"sample_margin must be in [1, 10] (1 is the paper's estimate), got {sample_margin!r}")
        self.sample_margin = sample_margin
        self.min_samples = min_samples
        self.max_adjust = max_adjust
        self.fp16_values = bool(fp16_values)
        self.index_bits = index_bits
        self.epoch: Optional[int] = None  # None until set_epoch: no warm-up
        self._warmup_checked = False  # the first compress() says whether the warm-up is off
        self._scratch = Scratch()

    def _check_warmup(self, warmup):
        if isinstance(warmup, bool):
            raise ValueError(f"warmup must be a number of epochs or a list of densities, got {warmup!r}")
        if isinstance(warmup, int):
            if warmup < 0:
                raise ValueError(f"warmup epochs must be >= 0, got {warmup!r}")
            return warmup
        if isinstance(warmup, Sequence) and not isinstance(warmup, str):
            return tuple(check_ratio(r, f"warmup density for epoch {e}") for e, r in enumerate(warmup))
        raise ValueError(f"warmup must be a number of epochs or a list of densities "
                         f"(e.g. {list(PAPER_WARMUP)}), got {warmup!r}")

    def set_epoch(self, epoch: int) -> None:
        """Tell the compressor the current epoch (0-based), which picks the warm-up density."""
        if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 0:
            raise ValueError(f"epoch must be a non-negative integer, got {epoch!r}")
        self.epoch = epoch

    def density(self, epoch: Optional[int] = None) -> float:
        """Fraction of elements sent in ``epoch`` (default: the current one; before any
        :meth:`set_epoch`, ``compress_ratio``)."""
        if self.warmup_steps and epoch is None:
            if self.steps >= self.warmup_steps:
                return self.compress_ratio
            return max(self.compress_ratio,
                       0.25 * (self.compress_ratio / 0.25) ** (self.steps / self.warmup_steps))
        epoch = self.epoch if epoch is None else epoch
        if epoch is None:
            return self.compress_ratio
        if isinstance(self.warmup, tuple):
            return self.warmup[epoch] if epoch < len(self.warmup) else self.compress_ratio
        if epoch >= self.warmup:
            return self.compress_ratio
        return max(self.compress_ratio, 0.25 * (self.compress_ratio / 0.25) ** (epoch / self.warmup))

    def commit(self) -> None:
        """A step that compressed is over and applied: it counts toward ``warmup_steps``."""
        if self._compressed:
            self.steps += 1
        self._compressed = False

    def rollback(self) -> None:
        self._compressed = False

    def warmup_is_off(self) -> bool:
        """Whether a warm-up was asked for (``warmup`` epochs or densities) but cannot run:
        no epoch has been set and no ``warmup_steps`` given, so it sends at
        ``compress_ratio`` from the first step."""
        asked = any(self.density(epoch) > self.compress_ratio for epoch in range(self._warmup_epochs()))
        return asked and self.epoch is None and not self.warmup_steps

    def _warmup_epochs(self) -> int:
        return self.warmup if isinstance(self.warmup, int) else len(self.warmup)

    def _warn_if_warmup_off(self) -> None:
        """Say once, at the first step, that the warm-up asked for is not happening: a loop
        without ``set_epoch`` (a step-counted run, a framework that does not report epochs)
        would otherwise lose the warm-up without a word.  Checked at the first step only, so
        later steps pay nothing for it; said on rank 0 only, since every rank would say it."""
        if self._warmup_checked:
            return
        self._warmup_checked = True
        if not self.warmup_is_off() or not first_rank_of_job():
            return
        epochs = self._warmup_epochs()
        warn(f"{self!r}: no epoch was set before its first step and warmup_steps=0, so its "
             f"density warm-up (down to {self.compress_ratio:g} over the first {epochs} "
             f"epochs) is off and it sends {self.compress_ratio:g} from the first step. Call "
             f"optimizer.set_epoch(epoch) (the DDP hook's state.set_epoch) at the start of every "
             f"epoch; for a run counted in steps, pass warmup_steps = {WARMUP_FRACTION_ADVICE:g} × "
             f"your run's steps (e.g. {round(WARMUP_FRACTION_ADVICE * 1500)} for 1,500); warmup=0 sends "
             f"{self.compress_ratio:g} from the start without this warning. Why: sparse updates "
             f"early in training, while the weights change fast, cost accuracy (Lin et al. 2018, "
             f"section 3.3)")

    knob = "density"

    def compress(self, tensor, name, layout=None):
        self._warn_if_warmup_off()
        self._compressed = True
        flat = tensor.reshape(-1)
        n = flat.numel()
        density = self.scaled_ratio(name, self.density())
        k = num_selected(n, density)
        if k >= n:
            indices = torch.arange(n, device=flat.device)
        else:
            threshold = sampled_threshold(flat, k, self.sample_ratio, self.min_samples, self.sample_margin)
            blocks = BlockPeaks(flat, self._scratch)
            for _ in range(self.max_adjust + 1):  # lower the threshold while too few pass
                indices = blocks.indices_at_least(threshold)
                if indices.numel() >= 0.8 * k:
                    break
                threshold = threshold * 0.8
            if indices.numel() > k:  # too many: exactly k among the candidates, kept ascending
                indices = indices[_chosen_in_order(torch.topk(flat[indices].abs(), k, sorted=False).indices,
                                                   indices.numel())]
        values = flat[indices]
        if self.fp16_values and values.dtype == torch.float32:
            values = values.to(torch.float16)
        if self.index_bits == 32 and index_dtype(n) != torch.int32:
            raise ValueError(f"group {name!r} has {n} elements, too many for int32 indices; "
                             f"use index_bits=64")
        wire_index = torch.int32 if self.index_bits == 32 else torch.int64
        return (values, indices.to(wire_index)), DensityContext(tensor.shape, tensor.dtype, density)

    def payload_bound(self, ctx):
        """At most k = density·n values and indices (see the class docstring); the density
        depends on the epoch and on the group's scale (the quality controller's), which every
        rank sets alike."""
        density = getattr(ctx, "density", None)
        k = min(num_selected(ctx.numel, self.density() if density is None else density), ctx.numel)
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
        value_bytes = 2 if self.fp16_values and element_size == 4 else element_size
        return count * (value_bytes + self.index_bits // 8)

    def state_dict(self):
        return {"epoch": self.epoch, "steps": self.steps}

    def load_state_dict(self, state):
        unknown = set(state) - {"epoch", "steps"}
        if unknown:
            raise ValueError(f"DGCCompressor state has unknown keys {sorted(unknown)}; "
                             f"expected 'epoch' and 'steps'")
        steps = state.get("steps", 0)
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
            raise ValueError(f"DGCCompressor state 'steps' must be a non-negative integer, got {steps!r}")
        if state.get("epoch") is not None:
            self.set_epoch(state["epoch"])
        self.steps = steps
        self._compressed = False
