"""Plain references of every built-in compressor, written from its paper.

Each reference is what the paper says in a few lines of torch: no packing, no kernels, no
scratch buffers, no fast paths.  ``reference(compressor, x, layout, generator)`` returns
what one step of a fresh ``compressor`` should decode ``x`` to (its options read from the
compressor; ``layout`` None for a bare tensor), drawing any randomness from ``generator``.
The conformance kit's ``check_reference`` compares them with the real compressors:
exactly (to float rounding) for the deterministic ones, in distribution for the stochastic
ones (``STOCHASTIC``).

Randomness that ranks share and the paper leaves free (PowerSGD's first query) is taken
as the compressor documents it, so that the deterministic step can be compared exactly.
"""
from __future__ import annotations

import math
import zlib

import torch

from mergecomp.compressors.lowrank import seeded_normal

#: The group name the kit compresses under (PowerSGD's seeded start depends on it).
GROUP = "group"


def _views(x, layout):
    """The (offset, numel, shape) of each parameter view; the whole tensor without a layout."""
    if layout is None:
        return [(0, x.numel(), tuple(x.shape))]
    return [(v.offset, v.numel, tuple(v.shape)) for v in layout]


def _negative(v):
    """The IEEE sign bit, which the sign compressors send (−0.0 counts as negative)."""
    return torch.signbit(v)


# -- no compression and casts ---------------------------------------------------------------

def identity(compressor, x, layout, generator):
    return x.clone()


def cast(dtype):
    def reference(compressor, x, layout, generator):
        return x.to(dtype).to(x.dtype)
    return reference


# -- sparsifiers ------------------------------------------------------------------------------

def _keep(x, indices):
    flat = x.reshape(-1)
    out = torch.zeros_like(flat)
    out[indices] = flat[indices]
    return out.view(x.shape)


def _on_the_wire(compressor, kept):
    """The kept values as the wire carries them: the compact wire rounds a value wider than
    16 bits to bf16; the 8-bit ones (compact8, tight8) divide every value by the power of two 2^e with
    max |kept| / 448 in [2^(e-1), 2^e) and rounds it to fp8 e4m3."""
    wire = getattr(compressor, "wire_format", "indexed")
    if wire == "compact" and kept.element_size() > 2:
        return kept.to(torch.bfloat16).to(kept.dtype)
    if wire in ("compact8", "tight8", "auto") and kept.numel():
        peak = kept.abs().max().float()
        scale = 2.0 ** torch.frexp(peak / 448.0).exponent.float() if peak > 0 else torch.tensor(1.0)
        return ((kept.float() / scale).to(torch.float8_e4m3fn).float() * scale).to(kept.dtype)
    return kept


def topk(compressor, x, layout, generator):
    """Aji & Heafield 2017: keep the k = ratio·n entries of largest magnitude."""
    flat = x.reshape(-1)
    k = min(flat.numel(), max(1, int(flat.numel() * compressor.compress_ratio)))
    return _on_the_wire(compressor, _keep(x, flat.abs().argsort(descending=True)[:k]))


def randk(compressor, x, layout, generator):
    """Stich et al. 2018: keep k coordinates drawn uniformly; ×n/k when unbiased (Wangni et al.)."""
    flat = x.reshape(-1)
    n = flat.numel()
    k = min(n, max(1, int(n * compressor.compress_ratio)))
    kept = _keep(x, torch.randperm(n, generator=generator)[:k])
    return kept * (n / k) if compressor.unbiased else kept


def _sample_threshold(magnitudes, k, sample_ratio, min_samples, margin=1.0, survivors=0):
    """The j-th largest of a strided sample of m magnitudes, j = ⌈margin·k·m/n⌉."""
    n = magnitudes.numel()
    wanted = max(min_samples, int(n * sample_ratio), math.ceil(survivors * n / max(k, 1)))
    sample = magnitudes[::max(1, n // max(1, min(n, wanted)))]
    j = max(1, min(sample.numel(), math.ceil(margin * k * sample.numel() / n)))
    return sample.sort(descending=True).values[j - 1]


def graddrop(compressor, x, layout, generator):
    """Aji & Heafield 2017: drop every |g| below the (1 − R) quantile of a sample of |g|."""
    magnitudes = x.reshape(-1).abs()
    k = min(magnitudes.numel(), max(1, int(magnitudes.numel() * compressor.compress_ratio)))
    threshold = _sample_threshold(magnitudes, k, compressor.sample_ratio, compressor.min_samples,
                                  survivors=compressor.sample_survivors)
    return _on_the_wire(compressor, _keep(x, (magnitudes >= threshold).nonzero().view(-1)))


def dgc(compressor, x, layout, generator):
    """Lin et al. 2018: a sampled threshold, lowered by 0.8 while fewer than 0.8k pass, and the
    top k of the passing ones when more than k pass."""
    magnitudes = x.reshape(-1).abs()
    n = magnitudes.numel()
    k = min(n, max(1, int(n * compressor.density())))
    if k >= n:
        return x.clone()
    threshold = _sample_threshold(magnitudes, k, compressor.sample_ratio, compressor.min_samples,
                                  compressor.sample_margin)
    for _ in range(compressor.max_adjust + 1):
        chosen = (magnitudes >= threshold).nonzero().view(-1)
        if chosen.numel() >= 0.8 * k:
            break
        threshold = threshold * 0.8
    if chosen.numel() > k:
        chosen = chosen[magnitudes[chosen].argsort(descending=True)[:k]]
    kept = _keep(x, chosen)
    return kept.half().to(x.dtype) if compressor.fp16_values else _on_the_wire(compressor, kept)


# -- signs and thresholds -----------------------------------------------------------------------

def _per_view(x, layout, decode_view):
    """Each view decoded by ``decode_view(values)``, a view that is all zero decoded to 0."""
    flat = x.reshape(-1)
    out = torch.zeros_like(flat)
    for offset, size, _ in _views(x, layout):
        values = flat[offset:offset + size]
        if bool(values.any()):
            out[offset:offset + size] = decode_view(values)
    return out.view(x.shape)


def _signs(values):
    return torch.where(_negative(values), -1.0, 1.0).to(values.dtype)


def signsgd(compressor, x, layout, generator):
    """Bernstein et al. 2018: sign(g) (the rank abstains on a view that is all zero)."""
    return _per_view(x, layout, _signs)


def signum(compressor, x, layout, generator):
    """Bernstein et al. 2018: the sign of the momentum m = β·0 + (1 − β)·g after one step."""
    return _per_view(x * (1.0 - compressor.beta), layout, _signs)


def efsignsgd(compressor, x, layout, generator):
    """Karimireddy et al. 2019: (‖g‖₁/d)·sign(g), per parameter view."""
    return _per_view(x, layout, lambda v: v.abs().mean() * _signs(v))


def onebit(compressor, x, layout, generator):
    """Seide et al. 2014: each element becomes the mean of its side (negative / non-negative)."""
    def decode(values):
        negative = _negative(values)
        low = values[negative].mean() if bool(negative.any()) else values.new_zeros(())
        high = values[~negative].mean() if bool((~negative).any()) else values.new_zeros(())
        return torch.where(negative, low, high)
    flat = x.reshape(-1)
    out = torch.empty_like(flat)
    for offset, size, _ in _views(x, layout):
        out[offset:offset + size] = decode(flat[offset:offset + size])
    return out.view(x.shape)


def tbq(compressor, x, layout, generator):
    """Strom 2015: +τ above τ, −τ below −τ, 0 elsewhere; a measured τ ("auto") is each
    view's mean magnitude times ``scale``, at most its largest, and then ±τ from τ on (a zero
    element sends nothing)."""
    tau = compressor.threshold
    if tau != "auto":
        return (tau * (x > tau).to(x.dtype) - tau * (x < -tau).to(x.dtype))
    flat = x.reshape(-1)
    out = torch.zeros_like(flat)
    for offset, size, _ in _views(x, layout):
        view = flat[offset:offset + size]
        magnitudes = view.abs().to(torch.float32)
        tau = torch.minimum(compressor.scale * magnitudes.sum() / max(1, size), magnitudes.max())
        passes = (view.abs() >= tau.to(x.dtype)) & (view != 0)
        out[offset:offset + size] = torch.where(passes, torch.where(_negative(view), -tau, tau).to(x.dtype),
                                                torch.zeros((), dtype=x.dtype))
    return out.view(x.shape)


# -- stochastic quantisers ---------------------------------------------------------------------

def _buckets(x, size):
    """x split into buckets of ``size`` consecutive elements (the last one may be short)."""
    return x.reshape(-1).split(size)


def _stochastic_round(levels, generator):
    """⌊ℓ⌋ + Bernoulli(ℓ − ⌊ℓ⌋): unbiased rounding to an integer."""
    low = levels.floor()
    return low + (torch.rand(levels.shape, generator=generator, dtype=levels.dtype) < levels - low)


def qsgd(compressor, x, layout, generator):
    """Alistarh et al. 2017: v ↦ ‖v‖·sign(v)·ℓ/s, ℓ the stochastic rounding of s·|v|/‖v‖,
    per bucket."""
    s = compressor.levels
    out = []
    for v in _buckets(x.double(), compressor.bucket_size):
        norm = v.norm()
        if norm == 0:
            out.append(torch.zeros_like(v))
            continue
        out.append(norm * v.sign() * _stochastic_round(s * v.abs() / norm, generator) / s)
    return torch.cat(out).to(x.dtype).view(x.shape)


def terngrad(compressor, x, layout, generator):
    """Wen et al. 2017: v ↦ S·sign(v)·Bernoulli(|v|/S), S = max|v| per bucket (after clipping
    to ±c·σ when ``clip`` is set)."""
    out = []
    for v in _buckets(x.double(), compressor.bucket_size):
        if compressor.clip is not None:
            bound = compressor.clip * v.std(unbiased=False)
            v = v.clamp(-bound, bound)
        peak = v.abs().max()
        if peak == 0:
            out.append(torch.zeros_like(v))
            continue
        keep = torch.rand(v.shape, generator=generator, dtype=v.dtype) < v.abs() / peak
        out.append(peak * v.sign() * keep)
    return torch.cat(out).to(x.dtype).view(x.shape)


# -- low rank ------------------------------------------------------------------------------------

def _matrices(compressor, x, layout, gains):
    """(offset, rows, cols) of each view factored as a matrix: two or more dimensions, and
    ``gains(rows, cols)``; every other view is sent as it is."""
    found = []
    for offset, size, shape in _views(x, layout):
        if len(shape) >= 2 and size:
            rows, cols = shape[0], size // shape[0]
            if gains(rows, cols):
                found.append((offset, rows, cols))
    return found


def _atomo_keep_probabilities(sigma, budget):
    """ATOMO's Algorithm 2: pᵢ ∝ σᵢ summing to ``budget``, capped at 1, the rest spread again."""
    p = torch.ones_like(sigma)
    capped = torch.zeros_like(sigma, dtype=torch.bool)
    while True:  # spread the budget left over the atoms not yet capped at 1
        free = ~capped & (sigma > 0)
        if not bool(free.any()):
            break
        p[free] = (budget - capped.sum()) * sigma[free] / sigma[free].sum()
        if not bool((p[free] > 1).any()):
            break
        capped |= free & (p > 1)
        p[capped] = 1.0
    p[sigma == 0] = 0.0
    return p


def _atomo_noise_budget(sigma, noise):
    """The fewest expected atoms whose variance Σ σᵢ²(1/pᵢ − 1) is within noise²·Σσ²,
    found by bisection (the variance falls as the budget grows)."""
    target = noise * noise * float((sigma * sigma).sum())
    low, high = 0.0, float((sigma > 0).sum())
    for _ in range(60):
        middle = (low + high) / 2
        p = _atomo_keep_probabilities(sigma, middle)
        kept = p > 0
        if float((sigma[kept] ** 2 * (1 / p[kept] - 1)).sum()) > target:
            low = middle
        else:
            high = middle
    return high


def atomo(compressor, x, layout, generator):
    """Wang et al. 2018: M = Σ σᵢuᵢvᵢᵀ; keep atom i with probability pᵢ (Σpᵢ = budget,
    pᵢ ∝ σᵢ capped at 1, the variance-optimal choice), scaled by 1/pᵢ.  Under
    ``budget="auto"`` the budget is the fewest atoms within the noise bound; a matrix whose
    atoms would cost as many bytes as it does is sent as it is."""
    out = x.reshape(-1).clone()
    layout_budget = 1.0 if compressor.budget == "auto" else compressor.budget
    gains = lambda r, c: r * c > compressor.min_compression_rate * layout_budget * (r + c + 1)  # noqa: E731
    for offset, rows, cols in _matrices(compressor, x, layout, gains):
        m = out[offset:offset + rows * cols].view(rows, cols).double()
        u, sigma, vh = torch.linalg.svd(m, full_matrices=False)
        draws = torch.rand(sigma.shape, generator=generator, dtype=torch.float64)
        budget = _atomo_noise_budget(sigma, compressor.noise) if compressor.budget == "auto" else compressor.budget
        if 4 * budget * (rows + cols + 1) >= x.element_size() * rows * cols:
            continue  # sent raw, exactly
        p = _atomo_keep_probabilities(sigma, budget)
        keep = draws < p
        scale = torch.where(keep, sigma / p.clamp(min=1e-300), torch.zeros_like(sigma))
        out[offset:offset + rows * cols] = ((u * scale) @ vh).reshape(-1).to(out.dtype)
    return out.view(x.shape)


def _power_step(m, q):
    """One step of Algorithm 1 of Vogels et al. 2019: P = MQ, P̂ = orth(P), Q = MᵀP̂, M ≈ P̂Qᵀ."""
    p_hat = torch.linalg.qr(m @ q).Q
    return p_hat @ (m.t() @ p_hat).t()


def powersgd(compressor, x, layout, generator):
    """Vogels et al. 2019, per layer matrix; the first Q is the compressor's shared seeded
    normal draw (the paper's i.i.d. normal initialisation, seeded alike on every rank)."""
    out = x.reshape(-1).clone()
    views = {v.offset: v.name for v in layout} if layout is not None else {0: GROUP}

    def gains(r, c):
        return r * c > compressor.min_compression_rate * min(compressor.rank, r, c) * (r + c)

    for offset, rows, cols in _matrices(compressor, x, layout, gains):
        m = out[offset:offset + rows * cols].view(rows, cols).double()
        rank = min(compressor.rank, rows, cols)
        start = seeded_normal(f"powersgd/{compressor.seed}/{GROUP}/{views[offset]}/0", cols, rank,
                              torch.empty(0, dtype=torch.float32))
        out[offset:offset + rows * cols] = _power_step(m, start.double()).reshape(-1).to(out.dtype)
    return out.view(x.shape)


def batched_powersgd(compressor, x, layout, generator):
    """Vogels et al. 2019 on the whole buffer as one matrix: shape[0] × rest for a tensor of
    two or more dimensions, else ⌊√n⌋ rows, zero-padded."""
    n = x.numel()
    if x.dim() >= 2:
        rows, cols = x.shape[0], n // x.shape[0]
    else:
        rows = max(1, math.isqrt(n))
        cols = max(1, -(-n // rows))
    m = torch.zeros(rows * cols, dtype=torch.float64)
    m[:n] = x.reshape(-1).double()
    rank = min(compressor.rank, rows, cols)
    start = torch.Generator().manual_seed(compressor.seed * 1_000_003 + zlib.crc32(GROUP.encode()))
    q = torch.randn(cols, rank, generator=start, dtype=torch.float32).double()
    return _power_step(m.view(rows, cols), q).reshape(-1)[:n].to(x.dtype).view(x.shape)


def demo(compressor, x, layout, generator):
    """Peng et al. 2024: per view, rows of ``chunk`` elements (zero-padded), each row's DCT-II
    written out as Σᵢ xᵢ·cos(π(2i + 1)j / 2s) with its orthonormal scale; the ``topk``
    coefficients of largest magnitude kept; the inverse DCT (DCT-III) of what was kept."""
    s, k = compressor.chunk, compressor.topk
    i = torch.arange(s, dtype=torch.float64)
    scale = torch.full((s,), math.sqrt(2.0 / s), dtype=torch.float64)
    scale[0] = math.sqrt(1.0 / s)
    cosines = torch.cos(math.pi * torch.outer(2 * i + 1, i) / (2 * s))  # [element i, frequency j]
    flat, out = x.reshape(-1).double(), torch.zeros(x.numel(), dtype=torch.float64)
    for offset, numel, _ in _views(x, layout):
        for start in range(0, numel, s):
            piece = flat[offset + start:offset + min(start + s, numel)]
            row = torch.zeros(s, dtype=torch.float64)
            row[:piece.numel()] = piece
            coefficients = scale * (row @ cosines)
            kept = torch.zeros(s, dtype=torch.float64)
            chosen = coefficients.abs().argsort(descending=True)[:k]
            kept[chosen] = coefficients[chosen]
            back = cosines @ (scale * kept)
            out[offset + start:offset + start + piece.numel()] = back[:piece.numel()]
    return out.to(x.dtype).view(x.shape)


def sparseloco(compressor, x, layout, generator):
    """SparseLoCo 2025: the flat tensor in rows of ``chunk`` (zero-padded); per row the
    ``topk`` entries of largest magnitude; their mean magnitude μ splits them in two; each
    decodes to its sign times the mean magnitude of its half (below μ, or at least μ)."""
    s, k = compressor.chunk, compressor.topk
    flat, out = x.reshape(-1).double(), torch.zeros(x.numel(), dtype=torch.float64)
    for start in range(0, x.numel(), s):
        row = torch.zeros(s, dtype=torch.float64)
        piece = flat[start:start + s]
        row[:piece.numel()] = piece
        chosen = row.abs().argsort(descending=True)[:k]
        magnitude = row[chosen].abs()
        high = magnitude >= magnitude.mean()
        decoded = torch.zeros(s, dtype=torch.float64)
        for part in (high, ~high):
            if part.any():
                level = magnitude[part].mean().to(x.dtype).double()
                decoded[chosen[part]] = torch.where(row[chosen[part]] < 0, -level, level)
        out[start:start + piece.numel()] = decoded[:piece.numel()]
    return out.to(x.dtype).view(x.shape)


#: The reference of every registered compressor, by registry name.
REFERENCES = {
    "none": identity, "fp32": identity,
    "fp16": cast(torch.float16), "bf16": cast(torch.bfloat16),
    "topk": topk, "randk": randk, "dgc": dgc, "graddrop": graddrop,
    "signsgd": signsgd, "signum": signum, "efsignsgd": efsignsgd, "onebit": onebit, "tbq": tbq,
    "qsgd": qsgd, "terngrad": terngrad, "atomo": atomo,
    "powersgd": powersgd, "batched_powersgd": batched_powersgd, "demo": demo,
    "sparseloco": sparseloco,
}

#: Compressors whose decode is a random draw: compared in distribution.
STOCHASTIC = {"randk", "qsgd", "terngrad", "atomo"}
