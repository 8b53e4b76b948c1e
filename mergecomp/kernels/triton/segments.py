"""Per-view sums and per-view scaling on the GPU: one program per block of one view.

A fused group is the concatenation of its parameters' gradients (the views of its
layout), and the sign compressors keep one scale per view: EF-SignSGD's mean magnitude,
1-bit SGD's two side means.  The torch path sums the views with ``torch.segment_reduce``
and expands the scales to every element with ``torch.repeat_interleave`` before a
multiply; on a GPU both are slow kernels for long views (in the GPU check's operator
profile of a GPT-2 small step they took more device time than its matrix multiplies), and
the expansion writes an n-element temporary.

Here the grid is cut along the views: every program reads a block of at most ``BLOCK``
elements that lies inside one view, so it needs no search for its view, loads that view's
scale once, and writes its sums to its own slot.  The block table (each block's first
element, its end and its view) is made once per layout and device and cached.  Sums are
fp32 per block, then summed per view by a second kernel in a fixed order: the same bits
on every run, not those of the CPU's segment sum (a sum's last bits depend on its order),
and nothing read back to the host.  The
scaling gives the CPU path's bits: the scale is converted to the tensor's dtype first and
the product rounded once, as torch's ``mul_`` and ``addcmul_`` do.
"""
from __future__ import annotations

import functools
import itertools
from typing import Optional, Sequence, Tuple

import torch
import triton
import triton.language as tl

from .common import on_device, round_to, widen
from .packing import _SAME_WIDTH, _flat

#: Elements per program (a program never spans two views).
BLOCK = 4096

Spans = Tuple[Tuple[int, int], ...]


@functools.lru_cache(maxsize=256)
def block_table(spans: Spans, device: str) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(first element, end, view) of every block, int64 on ``device``, and the number of
    blocks of each view (a view of n elements has ⌈n/BLOCK⌉, an empty one none)."""
    starts, ends, views, counts = [], [], [], []
    for view, (offset, size) in enumerate(spans):
        blocks = triton.cdiv(size, BLOCK)
        starts.extend(range(offset, offset + size, BLOCK))
        ends.extend(min(offset + size, start + BLOCK) for start in range(offset, offset + size, BLOCK))
        views.extend([view] * blocks)
        counts.append(blocks)
    as_tensor = functools.partial(torch.tensor, dtype=torch.int64, device=device)
    return as_tensor(starts), as_tensor(ends), as_tensor(views), as_tensor(counts)


@triton.jit
def _view_sums_kernel(values_ptr, bits_ptr, starts_ptr, ends_ptr, totals_ptr, magnitudes_ptr, negatives_ptr,
                      SIDES: tl.constexpr, ABSOLUTE: tl.constexpr, NONZERO: tl.constexpr, BLOCK: tl.constexpr):
    """This program's block: Σv (Σ|v| with ABSOLUTE, the count of v ≠ 0 with NONZERO) into
    ``totals``; with SIDES also Σ|v| and the count of set sign bits (``bits_ptr``: the
    values as same-width integers)."""
    program = tl.program_id(0)
    i = tl.load(starts_ptr + program) + tl.arange(0, BLOCK)
    live = i < tl.load(ends_ptr + program)
    raw = tl.load(values_ptr + i, mask=live, other=0)
    values = raw.to(tl.float32)
    if NONZERO:  # tested in the input's own precision: a tiny fp64 value is not zero (±0.0 is, NaN is not)
        tl.store(totals_ptr + program, tl.sum((widen(raw) != 0).to(tl.float32), axis=0))
    elif ABSOLUTE:
        tl.store(totals_ptr + program, tl.sum(tl.abs(values), axis=0))
    else:
        tl.store(totals_ptr + program, tl.sum(values, axis=0))
    if SIDES:
        tl.store(magnitudes_ptr + program, tl.sum(tl.abs(values), axis=0))
        negative = (tl.load(bits_ptr + i, mask=live, other=0) < 0).to(tl.float32)
        tl.store(negatives_ptr + program, tl.sum(negative, axis=0))


@triton.jit
def _scale_views_kernel(x_ptr, scales_ptr, shifts_ptr, starts_ptr, ends_ptr, views_ptr,
                        SHIFT: tl.constexpr, CLEAR: tl.constexpr, BLOCK: tl.constexpr):
    """x = x·scale (+ shift) of this block's view, in place, rounded once to x's dtype; with
    CLEAR, x where the view's scale is not 0 and +0.0 where it is (no product: bit exact)."""
    program = tl.program_id(0)
    i = tl.load(starts_ptr + program) + tl.arange(0, BLOCK)
    live = i < tl.load(ends_ptr + program)
    view = tl.load(views_ptr + program)
    if CLEAR:
        if widen(tl.load(scales_ptr + view)) == 0:
            tl.store(x_ptr + i, tl.zeros((BLOCK,), dtype=x_ptr.dtype.element_ty), mask=live)
    else:
        values = widen(tl.load(x_ptr + i, mask=live, other=0)) * widen(tl.load(scales_ptr + view))
        if SHIFT:
            values = widen(tl.load(shifts_ptr + view)) + values
        tl.store(x_ptr + i, round_to(values, x_ptr.dtype.element_ty), mask=live)


@triton.jit
def _view_totals_kernel(partials_ptr, bounds_ptr, out_ptr, views, CHUNKS: tl.constexpr, CHUNK: tl.constexpr):
    """out[v] = the sum of view v's block partials (blocks bounds[v] .. bounds[views + v]),
    in CHUNKS chunks (enough for the longest view): one program per view, a fixed order, a
    view's NaN kept to itself."""
    view = tl.program_id(0)
    first = tl.load(bounds_ptr + view)
    last = tl.load(bounds_ptr + views + view)
    total = tl.zeros((CHUNK,), dtype=tl.float32)
    for chunk in range(CHUNKS):
        i = first + chunk * CHUNK + tl.arange(0, CHUNK)
        total += tl.load(partials_ptr + i, mask=i < last, other=0)
    tl.store(out_ptr + view, tl.sum(total, axis=0))


#: Block partials a program of the per-view totals adds at a time.
CHUNK = 1024


@functools.lru_cache(maxsize=256)
def _view_bounds(spans: Spans, device: str) -> Tuple[torch.Tensor, int]:
    """Each view's first block and one past its last (int64 on ``device``: its first row
    the firsts, its second the ends), and the chunks of CHUNK blocks the longest view takes."""
    counts = [triton.cdiv(size, BLOCK) for _, size in spans]
    ends = list(itertools.accumulate(counts))
    bounds = torch.tensor([[end - count for end, count in zip(ends, counts)], ends], dtype=torch.int64, device=device)
    return bounds, triton.cdiv(max(counts, default=0), CHUNK)


def _per_view(partials: torch.Tensor, spans: Spans) -> torch.Tensor:
    """Each view's sum of its blocks' partial sums, on the device (a segment kernel would
    read the lengths back to the host)."""
    out = torch.empty(len(spans), dtype=torch.float32, device=partials.device)
    if spans:
        bounds, chunks = _view_bounds(spans, str(partials.device))
        with on_device(partials):
            _view_totals_kernel[(len(spans),)](partials, bounds, out, len(spans), CHUNKS=chunks, CHUNK=CHUNK)
    return out


def _one_sum(tensor: torch.Tensor, spans: Spans, absolute: bool, nonzero: bool) -> torch.Tensor:
    """fp32 (views,): one per-view sum of ``_view_sums_kernel`` (Σv, Σ|v| or the count of v ≠ 0)."""
    flat = _flat(tensor)
    starts, ends, _, _ = block_table(spans, str(flat.device))
    partials = torch.empty(starts.numel(), dtype=torch.float32, device=flat.device)
    if starts.numel():
        with on_device(flat):
            _view_sums_kernel[(starts.numel(),)](flat, flat, starts, ends, partials, partials, partials,
                                                 SIDES=False, ABSOLUTE=absolute, NONZERO=nonzero, BLOCK=BLOCK)
    return _per_view(partials, spans)


def view_sums(tensor: torch.Tensor, spans: Spans, absolute: bool = False) -> torch.Tensor:
    """fp32 (views,): each view's Σv, or Σ|v| with ``absolute``."""
    return _one_sum(tensor, spans, absolute, nonzero=False)


def view_nonzero_counts(tensor: torch.Tensor, spans: Spans) -> torch.Tensor:
    """fp32 (views,): how many elements of each view are not zero (NaN counts; a view's
    count is 0 exactly when it is all ±0.0 or empty)."""
    return _one_sum(tensor, spans, absolute=False, nonzero=True)


def view_side_sums(tensor: torch.Tensor, spans: Spans) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """fp32 (views,) each: Σv, Σ|v| and the number of set sign bits (−0.0 counts) of each
    view, in one read of the tensor: 1-bit SGD's encoder, view by view."""
    flat = _flat(tensor)
    if flat.dtype not in _SAME_WIDTH:
        raise TypeError(f"sign bits need a float16, bfloat16, float32 or float64 tensor, got {flat.dtype}")
    starts, ends, _, _ = block_table(spans, str(flat.device))
    partials = torch.empty(3, starts.numel(), dtype=torch.float32, device=flat.device)
    if starts.numel():
        with on_device(flat):
            _view_sums_kernel[(starts.numel(),)](flat, flat.view(_SAME_WIDTH[flat.dtype]), starts, ends,
                                                 partials[0], partials[1], partials[2],
                                                 SIDES=True, ABSOLUTE=False, NONZERO=False, BLOCK=BLOCK)
    return tuple(_per_view(row, spans) for row in partials)


def scale_views_(tensor: torch.Tensor, spans: Spans, scales: torch.Tensor,
                 shifts: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``tensor`` (contiguous) with each view v set, in place, to v·scale (+ shift) of that
    view; ``scales`` and ``shifts`` hold one value per view and are converted to the
    tensor's dtype first."""
    if not tensor.is_contiguous():
        raise ValueError("scale_views_ works in place and needs a contiguous tensor")
    flat = tensor.view(-1)
    starts, ends, views, _ = block_table(spans, str(flat.device))
    shift = shifts is not None
    scales = scales.to(device=flat.device, dtype=flat.dtype).contiguous()
    shifts = shifts.to(device=flat.device, dtype=flat.dtype).contiguous() if shift else scales
    if starts.numel():
        with on_device(flat, scales, shifts):
            _scale_views_kernel[(starts.numel(),)](flat, scales, shifts, starts, ends, views,
                                                   SHIFT=shift, CLEAR=False, BLOCK=BLOCK)
    return tensor


def clear_views_(tensor: torch.Tensor, spans: Spans, keep: torch.Tensor) -> torch.Tensor:
    """``tensor`` (contiguous) with each view whose ``keep`` entry is 0 set to +0.0, in place;
    the other views are not written."""
    if not tensor.is_contiguous():
        raise ValueError("clear_views_ works in place and needs a contiguous tensor")
    flat = tensor.view(-1)
    starts, ends, views, _ = block_table(spans, str(flat.device))
    keep = keep.to(device=flat.device).contiguous()
    if starts.numel():
        with on_device(flat, keep):
            _scale_views_kernel[(starts.numel(),)](flat, keep, keep, starts, ends, views,
                                                   SHIFT=False, CLEAR=True, BLOCK=BLOCK)
    return tensor


__all__: Sequence[str] = ["BLOCK", "block_table", "view_sums", "view_nonzero_counts", "view_side_sums",
                           "scale_views_", "clear_views_"]
