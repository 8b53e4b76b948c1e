"""Selection for the sparsifiers: exact top-k, threshold selection (DGC, GradDrop).

Threshold selection the plain way — ``(g.abs() >= t).nonzero()`` — writes an n-element
|g| and an n-element bool mask and reads the mask twice (nonzero counts, then writes):
several times a ``clone()``.  When only a small fraction passes (DGC sends
0.1%), almost all of that work is on elements that are then dropped.  Here the tensor is
first read once as blocks of :data:`BLOCK` elements, keeping each block's peak |g|
(two plain reductions, no temporary); only the blocks whose peak passes are gathered and
tested element by element.  At 0.1% density about 6% of the blocks pass for i.i.d.
gradients (fewer for real ones, whose large values cluster by layer); when more than a
half pass the full-pass way is cheaper and is used instead.

The block peaks of fp32 CPU tensors come from one native pass where the kernels are built
(or from no pass at all, when the kernel that wrote the tensor attached them: DGC's
momentum correction does), else from two torch reductions on the tensor's device.  The
selection of fp32 CPU tensors is native too (the passing blocks read once, the indices
written as they are found), else torch.

On a GPU the block peaks do not pay (a bool mask, ``nonzero`` and gathers cost more than
``torch.topk``): where Triton is present, DGC's sample is one kernel and the selection an
ordered compaction in two reads of the tensor (:mod:`.triton.selection`), with the same
indices, in the same ascending order.  Rand-k's random subsets are :mod:`.subsets`.
"""
from __future__ import annotations

import math

import torch

from . import native
from . import triton as gpu
from .scratch import Scratch

#: Elements per block: short enough that few blocks pass at sparse densities, long enough
#: for the per-block reductions to run at memory speed (16 is several times slower).
BLOCK = 64

#: Above this fraction of passing blocks, gathering them costs more than one full pass.
DENSE_BLOCKS = 0.5


def attach_peaks(tensor: torch.Tensor, peaks: torch.Tensor) -> None:
    """Remember the block peaks of ``tensor`` (fp32, one per whole block of :data:`BLOCK`),
    computed while it was written, for the :class:`BlockPeaks` of a later selection.

    They are valid only while ``tensor`` is unchanged: the tensor's version counter is
    kept with them, and any in-place torch op on it (or on a view of it) makes them stale.
    Only a kernel that wrote the tensor through its data pointer may attach them.

    They are kept on the tensor that owns the storage (``tensor`` itself, or the base it is
    a view of): every view of it, ``reshape(-1)`` of ``tensor`` included, names that one as
    its ``_base``, and a view reused for a later step (a memory's spare) must not find the
    record of an earlier step there while its own goes unread.
    """
    owner = tensor if tensor._base is None else tensor._base
    owner._mergecomp_peaks = (tensor._version, tensor.data_ptr(), tensor.numel(), peaks)


def attached_peaks(flat: torch.Tensor):
    """The peaks :func:`attach_peaks` left on ``flat`` (or on the tensor it is a view of,
    covering the same elements), or None when there are none or they are stale."""
    for owner in (flat, flat._base):
        record = getattr(owner, "_mergecomp_peaks", None) if owner is not None else None
        if record is None:
            continue
        version, address, numel, peaks = record
        # A view shares its base's version counter: any write through either makes it stale.
        if (owner._version == version and address == flat.data_ptr()
                and numel == flat.numel() and flat.dtype == torch.float32 and flat.is_contiguous()):
            return peaks
    return None


def sampled_threshold(flat: torch.Tensor, k: int, sample_ratio: float, min_samples: int,
                      margin: float = 1.0, survivors: int = 0) -> torch.Tensor:
    """Estimate the (margin·k)-th largest |g| of ``flat`` from a strided sample of it.

    A sample of m = max(min_samples, sample_ratio·n, survivors·n/k) elements (all of them
    when that reaches n), taken every ⌊n/m⌋-th element, keeps its top j = ⌈margin·k·m/n⌉
    magnitudes; their minimum is the threshold.  Costs a top-k over m elements instead of n.

    How good the estimate is: for i.i.d. magnitudes the fraction of the tensor at or above
    the j-th largest of m samples has mean j/(m + 1) and a relative standard deviation of
    about 1/√j, so ``survivors`` (a floor on j) sets the precision of the count.  A NaN
    sample counts as 0 and an infinite one as the dtype's largest finite value, so neither
    can make the threshold NaN or inf.
    """
    n = flat.numel()
    wanted = max(min_samples, int(n * sample_ratio), math.ceil(survivors * n / max(k, 1)))
    stride = max(1, n // max(1, min(n, wanted)))
    # A NaN would rank first in topk and make the threshold NaN (nothing would pass); an inf
    # threshold would pass only infs.  Both are mapped in the sample, not in the tensor.
    if gpu.usable(flat):  # one kernel: the strided read, |·| and the mapping
        from .triton import selection as triton_selection
        sample = triton_selection.sample_magnitudes(flat, stride)
    else:
        sample = flat[::stride].abs().nan_to_num_(nan=0.0, posinf=torch.finfo(flat.dtype).max)
    top = max(1, min(sample.numel(), math.ceil(margin * k * sample.numel() / n)))
    return torch.topk(sample, top, sorted=False).values.min()


class BlockPeaks:
    """The peak |g| of every block of :data:`BLOCK` elements of a flat tensor, read once.

    Keeps the peaks so that a second threshold (DGC lowers it when too few pass) costs only
    the passing blocks, not another pass over the tensor.  The peaks are read on first use:
    on a GPU with Triton the selection does without them (an ordered compaction of the
    whole tensor), and only top-k's threshold asks for them.
    """

    def __init__(self, flat: torch.Tensor, scratch: Scratch):
        self.flat = flat if flat.is_contiguous() else flat.contiguous()
        self.scratch = scratch
        self.whole = self.flat.numel() // BLOCK  # blocks of exactly BLOCK elements; the rest is the tail
        self._peaks = None
        self._compact = gpu.usable(self.flat)

    @property
    def peaks(self):
        """fp32 peak |g| of each whole block (None when there is none), read once."""
        flat = self.flat
        if self._peaks is not None or not self.whole:
            return self._peaks
        if attached_peaks(flat) is not None:  # computed when the tensor was written
            self._peaks = attached_peaks(flat)
        elif flat.dtype == torch.float32 and native.usable(flat):  # one pass instead of two
            self._peaks = native.bucket_peaks(flat[: self.whole * BLOCK], BLOCK)
        else:
            rows = flat[: self.whole * BLOCK].view(self.whole, BLOCK)
            self._peaks = torch.maximum(rows.amax(dim=1), rows.amin(dim=1).neg())
        return self._peaks

    def indices_at_least(self, threshold: torch.Tensor) -> torch.Tensor:
        """Ascending int64 indices i with |flat[i]| ≥ threshold (a NaN never passes; the
        other elements of a block that holds one do, as on every path)."""
        flat, n = self.flat, self.flat.numel()
        if self._compact:
            from .triton import selection as triton_selection
            return triton_selection.indices_at_least(flat, threshold)
        if self.peaks is None:
            return self._full_pass(threshold)
        if flat.dtype == torch.float32 and native.usable(flat):  # the passing blocks read once
            return native.select_at_least(flat, self.peaks, BLOCK, threshold.to(torch.float32), self.scratch)
        blocks = (self.peaks < threshold).logical_not_().nonzero().view(-1)  # a NaN peak: test its block
        if blocks.numel() > DENSE_BLOCKS * self.whole:
            return self._full_pass(threshold)
        rows = flat[: self.whole * BLOCK].view(self.whole, BLOCK).index_select(0, blocks)
        hits = (rows.abs_() >= threshold).nonzero()  # (row, column) pairs, ascending
        indices = blocks[hits[:, 0]] * BLOCK + hits[:, 1]
        if n > self.whole * BLOCK:
            tail = flat[self.whole * BLOCK:]
            indices = torch.cat([indices, (tail.abs() >= threshold).nonzero().view(-1) + self.whole * BLOCK])
        return indices

    def _full_pass(self, threshold: torch.Tensor) -> torch.Tensor:
        flat, n = self.flat, self.flat.numel()
        magnitudes = torch.abs(flat, out=self.scratch.get("abs", n, flat.dtype, flat.device))
        mask = torch.ge(magnitudes, threshold, out=self.scratch.get("mask", n, torch.bool, flat.device))
        return mask.nonzero().view(-1)


def gather(flat: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """``flat``'s values at the 1-D ``indices``: ``index_select``, the same values as
    ``flat[indices]`` at a fraction of its time on a CPU (advanced indexing takes a general
    path there, about three times slower for a few hundred thousand indices)."""
    return torch.index_select(flat, 0, indices)


def in_order(chosen: torch.Tensor, count: int) -> torch.Tensor:
    """The ``chosen`` positions among ``count`` candidates, ascending.  ``torch.topk(sorted=False)``
    returns its k in an order of its own, which differs between the CPU and CUDA kernels;
    ascending indices make a payload the same bytes on every device, and are what a block
    wire needs.  On a GPU a sort of the k (a mask would read its count back to the host); on
    a CPU a mask of ``count`` bools, several times cheaper than the sort."""
    if chosen.is_cuda:
        return chosen.sort().values
    mask = torch.zeros(count, dtype=torch.bool, device=chosen.device)
    mask[chosen] = True
    return mask.nonzero().view(-1)


def exact_top_k(flat: torch.Tensor, k: int, scratch: Scratch, ascending: bool = False) -> torch.Tensor:
    """Indices of the k largest |g| of ``flat`` — the same set as ``torch.topk`` (up to ties),
    in ascending order with ``ascending`` (the candidates come ascending, so :func:`in_order`
    keeps them so for less than a sort of the k), else in no particular order.

    The k-th largest block peak t is at most the k-th largest |g| (the k largest elements
    lie in at most k blocks), so every element of the top k passes |g| ≥ t, and at least
    k elements do.  A top-k over the n/64 peaks, the threshold selection, and a top-k over
    the candidates replace a top-k over all n elements.

    Real gradients cluster: a layer's large values fill whole blocks, and a layer that got
    no gradient (an embedding's unused rows) fills blocks with zeros, so the k-th peak can
    lie far below the k-th value and leave tens of times k candidates — or all n, when it
    is zero.  On the CPU, where ``torch.topk`` costs about its input's length whatever k,
    such candidates are narrowed first by a sampled threshold (:func:`narrowed`), and when
    the peaks rule out fewer than half of the blocks (or k exceeds the n/64 peaks) that cut
    is taken over all n elements instead (:func:`_top_of_all`).

    A NaN ranks above every number, as in ``torch.topk``: on the CPU a tensor whose block
    peaks or tail hold a NaN goes to the plain ``torch.topk`` over all n elements (a NaN
    fails every threshold test, so no cut would keep it).
    """
    if k <= 0:
        return torch.empty(0, dtype=torch.int64, device=flat.device)
    blocks = BlockPeaks(flat, scratch)
    on_cpu = flat.device.type == "cpu"
    if blocks.peaks is None or (k > blocks.whole and not on_cpu) or (on_cpu and _holds_nan(blocks)):
        return _top(None, flat.abs(), k, ascending, finite=False)
    if k > blocks.whole:
        return _top_of_all(blocks, k, ascending)
    threshold = torch.topk(blocks.peaks, k, sorted=False).values.min()
    if on_cpu and int((blocks.peaks >= threshold).sum()) > DENSE_BLOCKS * blocks.whole:
        return _top_of_all(blocks, k, ascending)
    candidates = blocks.indices_at_least(threshold)
    if candidates.numel() < k:  # only with a NaN (on a GPU, where it is not looked for first)
        return _top(None, flat.abs(), k, ascending, finite=False)
    magnitudes = gather(blocks.flat, candidates).abs()
    if on_cpu:
        candidates, magnitudes = narrowed(candidates, magnitudes, k)
    return _top(candidates, magnitudes, k, ascending)


def _holds_nan(blocks: BlockPeaks) -> bool:
    """Whether the tensor holds a NaN: its block peaks (a NaN makes its block's peak NaN) or
    its tail do; n/64 + 63 elements read, not n."""
    tail = blocks.flat[blocks.whole * BLOCK:]
    return bool(blocks.peaks.isnan().any()) or bool(tail.isnan().any())


def _top_of_all(blocks: BlockPeaks, k: int, ascending: bool = False) -> torch.Tensor:
    """The top k of all n elements of a CPU tensor without a NaN (:func:`exact_top_k` sends
    one with a NaN to ``torch.topk``), cut by a sampled threshold first instead of
    ``torch.topk`` over n.  Where the native selection takes the tensor, the cut is the
    selection's one read of the blocks whose peak passes; else one |g| pass into scratch, a
    mask and a compaction."""
    flat = blocks.flat
    if flat.dtype == torch.float32 and native.usable(flat):
        threshold = sampled_threshold(flat, k, sample_ratio=0.0, min_samples=4096,
                                      margin=NARROW_MARGIN, survivors=NARROW_SURVIVORS)
        candidates = blocks.indices_at_least(threshold)
        if candidates.numel() >= k:  # at least k pass t: all of the top k do
            return _top(candidates, gather(flat, candidates).abs(), k, ascending)
    magnitudes = torch.abs(flat, out=blocks.scratch.get("abs", flat.numel(), flat.dtype, flat.device))
    indices, magnitudes = narrowed(None, magnitudes, k)
    return _top(indices, magnitudes, k, ascending)


#: Candidates per selected element above which :func:`narrowed` samples a tighter threshold.
NARROW_ABOVE = 4

#: The sampled threshold aims at this many times k survivors (so that the count clears k) ...
NARROW_MARGIN = 1.25

#: ... from a sample whose top holds at least this many elements: the relative spread of the
#: count is about 1/√(this), a few percent, well inside the margin.
NARROW_SURVIVORS = 1024


def narrowed(indices, magnitudes: torch.Tensor, k: int):
    """``(indices, magnitudes)`` cut to those with a magnitude at or above a sampled estimate
    of the k-th largest (aimed :data:`NARROW_MARGIN` × k survivors) — when more than
    :data:`NARROW_ABOVE` × k are given and at least k survive, else unchanged.

    Exact whatever the sample: when at least k magnitudes pass a threshold t, the k-th
    largest is at least t, so all of the top k pass.  An unlucky sample only costs time
    (the input comes back whole).  ``indices`` None means positions in ``magnitudes``.
    """
    if magnitudes.numel() <= NARROW_ABOVE * k:
        return (indices, magnitudes)
    threshold = sampled_threshold(magnitudes, k, sample_ratio=0.0, min_samples=4096,
                                  margin=NARROW_MARGIN, survivors=NARROW_SURVIVORS)
    keep = (magnitudes >= threshold).nonzero().view(-1)
    if keep.numel() < k or keep.numel() == magnitudes.numel():
        return (indices, magnitudes)
    return (keep if indices is None else gather(indices, keep), gather(magnitudes, keep))


def _top(indices, magnitudes: torch.Tensor, k: int, ascending: bool = False,
         finite: bool = True) -> torch.Tensor:
    """The positions (``indices``' entries, ascending, or positions in ``magnitudes`` when
    None) of the k largest ``magnitudes``; ascending with ``ascending``."""
    top = top_positions(magnitudes, k, ascending, finite)
    return top if indices is None else gather(indices, top)


def top_positions(magnitudes: torch.Tensor, k: int, ascending: bool = False,
                  finite: bool = True) -> torch.Tensor:
    """Positions of the k largest ``magnitudes`` (0 < k ≤ their number), the same set as
    ``torch.topk`` (up to ties); ascending with ``ascending``.  ``finite``: no NaN among
    them, so that a CPU may cut them by two sampled bounds first (:func:`banded_top`)."""
    if finite:
        band = banded_top(magnitudes, k)
        if band is not None:
            return band
    top = torch.topk(magnitudes, k, sorted=False).indices
    return in_order(top, magnitudes.numel()) if ascending else top


#: Candidates above which a CPU's final top-k is cut by two sampled bounds (below it
#: ``torch.topk`` is cheap enough) ...
BAND_ABOVE = 65_536

#: ... drawn from a strided sample of about this many magnitudes ...
BAND_SAMPLES = 16_384

#: ... this many standard deviations of the k-th largest's rank in the sample either side of
#: it, so that the bounds miss it about once in a billion draws (and then cost a top-k).
BAND_SIGMAS = 6.0


def banded_top(magnitudes: torch.Tensor, k: int):
    """Ascending positions of the k largest of ``magnitudes`` (finite; a CPU tensor of more
    than :data:`BAND_ABOVE`), or None where this does not apply or the bounds missed.

    ``torch.topk`` on a CPU costs about its input's length times a log whatever k, and at
    the sparsifiers' default densities its input is hundreds of thousands of candidates.
    A strided sample puts two bounds around the k-th largest: u, above which fewer than k
    lie, and l, at or above which at least k do.  Everything above u is in the top k; the
    rest come from the narrow band [l, u] by a top-k over the band alone.  Two comparisons,
    two counts and two compactions of the candidates replace the top-k over all of them,
    and the positions come out ascending (no sort) — the same set as ``torch.topk`` up to
    ties.  Bounds that miss (an unlucky sample; many equal values) give None."""
    count = magnitudes.numel()
    if magnitudes.device.type != "cpu" or count <= BAND_ABOVE or not 0 < k < count:
        return None
    sample = magnitudes[:: max(1, count // BAND_SAMPLES)].contiguous()
    size = sample.numel()
    rank = k * size / count  # where the k-th largest falls in the sample, from the top
    spread = BAND_SIGMAS * math.sqrt(max(rank * (1.0 - k / count), 1.0)) + 1.0
    # the (i + 1)-th largest of the sample is its (size − i)-th smallest
    upper = torch.kthvalue(sample, size - max(0, int(rank - spread))).values
    lower = torch.kthvalue(sample, size - min(size - 1, math.ceil(rank + spread))).values
    above = torch.gt(magnitudes, upper)
    taken = int(torch.count_nonzero(above))
    within = torch.ge(magnitudes, lower)
    if not taken <= k <= int(torch.count_nonzero(within)):
        return None
    if taken < k:
        band = within.logical_and_(above.logical_not()).nonzero().view(-1)
        picked = torch.topk(gather(magnitudes, band), k - taken, sorted=False).indices
        above[gather(band, picked)] = True
    return above.nonzero().view(-1)
