"""ATOMO over the singular value decomposition.

Wang et al., "ATOMO: Communication-efficient Learning via Atomic Sparsification",
NeurIPS 2018.
"""
from __future__ import annotations

import torch

from . import register
from .base import Compressor, Context
from .matrix import as_matrix, from_matrix, matrix_shape


def atomo_probabilities(sigma: torch.Tensor, budget: float) -> torch.Tensor:
    """Variance-optimal keep probabilities for singular values ``sigma`` (descending).

    ATOMO's Algorithm 2 minimises the variance Σ σᵢ²/pᵢ subject to Σ pᵢ = s, pᵢ ≤ 1:
    pᵢ = s·σᵢ/Σσ, and while some pᵢ would exceed 1 those are fixed to 1 and the rest of
    the budget is spread over the others the same way.  With σ sorted, the atoms fixed to
    1 are the first k for the smallest k with (s − k)·σ_k ≤ Σ_{j≥k} σ_j, found here in
    one vectorised pass.  Zero singular values get probability 0.
    """
    m = sigma.numel()
    tail = sigma.flip(0).cumsum(0).flip(0)
    positions = torch.arange(m, device=sigma.device, dtype=sigma.dtype)
    fits = ((budget - positions) * sigma <= tail) & (positions < budget)
    if not bool(fits.any()):  # the budget covers every atom
        return (sigma > 0).to(sigma.dtype)
    k = int(fits.to(torch.int8).argmax())
    spread = (budget - k) * sigma / tail[k].clamp(min=torch.finfo(sigma.dtype).tiny)
    probabilities = spread.clamp_(max=1.0)
    probabilities[:k] = 1.0
    return torch.where(sigma > 0, probabilities, torch.zeros_like(probabilities))


@register("atomo")
class AtomoCompressor(Compressor):
    """Keep singular triplet i of the gradient matrix with probability pᵢ, scaled by 1/pᵢ.

    The gradient is viewed as a matrix (see :mod:`mergecomp.compressors.matrix`: a flat
    fused buffer of n elements becomes a near-square ⌊√n⌋ × ⌈n/⌊√n⌋⌉ matrix), decomposed
    as Σ σᵢ uᵢ vᵢᵀ, and each atom is sampled with ATOMO's variance-optimal probability for
    an expected ``budget`` atoms (:func:`atomo_probabilities`).  Sent atoms carry σᵢ/pᵢ,
    so the estimate is unbiased: E[decode] = the gradient.  The number of atoms varies
    from step to step (``fixed_size = False``).  The SVD costs O(r·c·min(r, c)): ATOMO is
    meant for layers, not for fused buffers of tens of millions of elements.

    Wire for an r × c matrix and m sampled atoms: 4·m·(r + c + 1) bytes (fp32 factors
    u, v and the scaled singular values, whatever the input dtype).
    """

    summable = False
    fixed_size = False
    recommended_memory = "none"
    recommended_communicator = "allgather"

    def __init__(self, budget: float = 2.0):
        budget = float(budget)
        if not budget > 0 or budget == float("inf"):
            raise ValueError(f"atomo budget (expected number of singular triplets sent) must be "
                             f"a positive number, got {budget!r}; 1 to 4 is usual")
        self.budget = budget

    def compress(self, tensor, name):
        matrix = as_matrix(tensor)
        u, sigma, vh = torch.linalg.svd(matrix, full_matrices=False)
        probabilities = atomo_probabilities(sigma, self.budget)
        keep = torch.rand(sigma.shape, device=sigma.device, dtype=sigma.dtype) < probabilities
        scaled = sigma[keep] / probabilities[keep]
        payload = (u[:, keep].t().contiguous().view(-1), scaled, vh[keep].contiguous().view(-1))
        return payload, Context(tensor.shape, tensor.dtype)

    def decompress(self, payload, ctx):
        left, scaled, right = payload
        rows, cols = matrix_shape(ctx.shape)
        atoms = scaled.numel()
        matrix = (left.view(atoms, rows).t() * scaled) @ right.view(atoms, cols)
        return from_matrix(matrix, ctx.shape, ctx.dtype)

    def __repr__(self):
        return f"AtomoCompressor(budget={self.budget})"
