"""ATOMO over the singular value decomposition of each layer's gradient matrix.

Wang et al., "ATOMO: Communication-efficient Learning via Atomic Sparsification",
NeurIPS 2018.

    per layer matrix M = Σ σ_i u_i v_iᵀ:  keep atom i with probability p_i (Σ p_i = budget,
    p_i ∝ σ_i capped at 1);  decode: M̂ = Σ_kept (σ_i/p_i) u_i v_iᵀ, so E[M̂] = M.

On the wire: the kept (u_i, σ_i/p_i, v_i) of every matrix in fp32, an int32 count per
matrix, and the views not factored as they are.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import torch

from . import register
from .base import Compressor, Context, GroupLayout, ParamView, check_layout
from .lowrank import check_rate
from .matrix import (LayerMatrix, compute_dtype, factor_element_size, gather_raw, group_layout,
                     layer_matrix, raw_numel, scatter_raw, split_layout)


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


@dataclass(frozen=True)
class AtomoContext(Context):
    """The group's layout: which views are matrices and where each goes.  It is the same on
    every rank, so one rank's context decodes every rank's payload."""

    layout: GroupLayout = ()


@register("atomo")
class AtomoCompressor(Compressor):
    """Keep singular triplet i of each layer's matrix with probability pᵢ, scaled by 1/pᵢ.

    The group's layout (its per-parameter views) says what a layer is: a view of two or
    more dimensions is the matrix shape[0] × rest (a conv kernel out × in·h·w), decomposed
    as Σ σᵢ uᵢ vᵢᵀ; each atom is kept independently with ATOMO's variance-optimal
    probability for an expected ``budget`` atoms per matrix (:func:`atomo_probabilities`;
    the quality controller raises a group's budget where the exchange's noise is high,
    :meth:`group_budget`) and sent as (uᵢ, σᵢ/pᵢ, vᵢ), so the estimate is unbiased:
    E[decode] = the gradient.
    A matrix is factored only when that gains enough, r·c > ``min_compression_rate``·
    ``budget``·(r + c + 1) (0 factors every matrix); 1-D views (biases, norms, pieces of
    sliced parameters) and small matrices are sent raw, exactly.  Without a layout the
    tensor is one parameter: a matrix if it has two or more dimensions, raw if it is 1-D.
    The SVD costs O(r·c·min(r, c)) per matrix.

    Sampling draws from the compressor's own generator, seeded by ``seed`` and this
    process's rank (:attr:`process_rank`, set by the communicator), so ranks sample
    independently and the training's global random stream is left alone.  Its state is in
    :meth:`state_dict`; :meth:`rollback` restores it as it was at the step's first draw.

    Payload, five tensors whatever the layout: the raw values (gradient dtype), the number
    of atoms kept per factored matrix (int32), then the kept left vectors, scaled singular
    values and right vectors of every matrix back to back (fp32; fp64 stays fp64).  The
    number of atoms varies from step to step (``fixed_size = False``).
    Wire: (raw elements)·(element size) + 4 per factored matrix + 4·m·(r + c + 1) per r × c
    matrix that kept m atoms (8·m·(r + c + 1) for fp64); :meth:`wire_nbytes` computes it.
    """

    summable = False
    fixed_size = False
    unbiased = True  # E[decode] = the gradient: the none memory measures its noise
    recommended_memory = "none"
    recommended_communicator = "allgather"

    def __init__(self, budget: float = 2.0, min_compression_rate: float = 2.0, seed: int = 0):
        budget = float(budget)
        if not budget > 0 or budget == float("inf"):
            raise ValueError(f"atomo budget (expected number of singular triplets sent) must be "
                             f"a positive number, got {budget!r}; 1 to 4 is usual")
        self.budget = budget
        self.min_compression_rate = check_rate(min_compression_rate, "atomo")
        self.seed = int(seed)
        self._generator: Optional[torch.Generator] = None
        self._generator_rank: Optional[int] = None
        self._snapshot: Optional[torch.Tensor] = None  # the generator at this step's first draw

    # -- which views are factored ----------------------------------------------------------
    knob = "rank"

    def group_budget(self, name: str) -> float:
        """The expected atoms per matrix group ``name`` samples now: ``budget`` times its
        scale (the quality controller raises it where the exchange's noise is high, see
        :attr:`knob`).  Which matrices are factored stays fixed by ``budget``, so a scale
        changes how many atoms a group sends, never its layout."""
        return self.budget * self.group_scale(name)

    def factors(self, rows: int, cols: int) -> bool:
        """Whether a rows × cols matrix gains enough to be factored."""
        return rows * cols > self.min_compression_rate * self.budget * (rows + cols + 1)

    def split(self, layout: GroupLayout) -> Tuple[Tuple[ParamView, ...], Tuple[LayerMatrix, ...]]:
        """(views sent raw, views factored) of a group layout."""
        return split_layout(layout, self.factors)

    # -- the random stream -----------------------------------------------------------------
    def _stream(self) -> torch.Generator:
        if self._generator is None:
            self._generator = torch.Generator().manual_seed(
                (self.seed * 1_000_003 + 7_919 * self.process_rank) & ((1 << 63) - 1))
            self._generator_rank = self.process_rank
        return self._generator

    def _uniforms(self, count: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """``count`` uniforms in [0, 1), drawn on the CPU (the same stream on every device)."""
        generator = self._stream()
        if self._snapshot is None:
            self._snapshot = generator.get_state()
        return torch.rand(count, generator=generator, dtype=dtype).to(device)

    def set_process_rank(self, rank: int) -> None:
        super().set_process_rank(rank)
        if self._generator is not None and self._generator_rank != self.process_rank:
            self._generator, self._generator_rank, self._snapshot = None, None, None

    # -- encode / decode -------------------------------------------------------------------
    def compress(self, tensor, name, layout=None):
        layout = group_layout(tensor, name, layout)
        raw, matrices = self.split(layout)
        flat = tensor.reshape(-1)
        dtype = compute_dtype(tensor.dtype)
        budget = self.group_budget(name)
        if matrices:  # one draw per step and group, an atom's uniform fixed by its position
            uniforms = self._uniforms(sum(min(m.rows, m.cols) for m in matrices), dtype, flat.device)
        counts, lefts, scaled, rights = [], [], [], []
        at = 0
        for matrix in matrices:
            u, sigma, vh = torch.linalg.svd(layer_matrix(flat, matrix, dtype), full_matrices=False)
            probabilities = atomo_probabilities(sigma, budget)
            keep = uniforms[at:at + sigma.numel()] < probabilities
            at += sigma.numel()
            counts.append(keep.sum())
            lefts.append(u[:, keep].t().reshape(-1))
            scaled.append(sigma[keep] / probabilities[keep])
            rights.append(vh[keep].reshape(-1))
        empty = torch.empty(0, dtype=dtype, device=flat.device)
        payload = (gather_raw(flat, raw),
                   torch.stack(counts).to(torch.int32) if counts
                   else torch.empty(0, dtype=torch.int32, device=flat.device),
                   torch.cat(lefts) if lefts else empty,
                   torch.cat(scaled) if scaled else empty,
                   torch.cat(rights) if rights else empty)
        return payload, AtomoContext(tensor.shape, tensor.dtype, layout)

    def decompress(self, payload, ctx):
        raw_values, counts, left, scaled, right = payload
        raw, matrices = self.split(ctx.layout)
        if counts.numel() != len(matrices) or raw_values.numel() != raw_numel(raw):
            raise ValueError(f"atomo payload holds {raw_values.numel()} raw values and atoms for "
                             f"{counts.numel()} matrices, but its context's layout sends "
                             f"{raw_numel(raw)} raw and factors {len(matrices)}: decode a payload "
                             "with the context (layout) it was made with")
        out = torch.empty(ctx.numel, dtype=ctx.dtype, device=raw_values.device)
        scatter_raw(raw_values, raw, out)
        left_at = right_at = atom_at = 0
        for matrix, atoms in zip(matrices, counts.tolist()):
            u = left[left_at:left_at + atoms * matrix.rows].view(atoms, matrix.rows)
            s = scaled[atom_at:atom_at + atoms]
            v = right[right_at:right_at + atoms * matrix.cols].view(atoms, matrix.cols)
            left_at += atoms * matrix.rows
            right_at += atoms * matrix.cols
            atom_at += atoms
            out[matrix.start:matrix.stop].view(matrix.rows, matrix.cols).copy_((u.t() * s) @ v)
        return out.view(ctx.shape)

    def wire_nbytes(self, numel: int, element_size: int = 4, payload=None,
                    layout: Optional[GroupLayout] = None) -> int:
        """Bytes of one payload for ``numel`` elements of ``element_size`` bytes laid out as
        ``layout`` (None: one 1-D tensor, sent raw; pass ``whole_layout(tensor)`` for a
        single matrix).  With ``payload`` the atoms it kept are counted; without one, the
        expected size when every factored matrix has at least ``budget`` non-zero singular
        values (min(budget, r, c) atoms each)."""
        if layout is None:
            layout = (ParamView("tensor", torch.Size([numel]), 0),)
        check_layout(layout, numel)
        raw, matrices = self.split(layout)
        factor_size = factor_element_size(element_size)
        if payload is not None:
            atoms = payload[1].tolist()
            if len(atoms) != len(matrices):
                raise ValueError(f"atomo payload has atom counts for {len(atoms)} matrices but the "
                                 f"layout factors {len(matrices)}: pass the layout it was made with")
        else:
            atoms = [min(self.budget, m.rows, m.cols) for m in matrices]
        return raw_numel(raw) * element_size + 4 * len(matrices) + round(sum(
            factor_size * a * (m.rows + m.cols + 1) for m, a in zip(matrices, atoms)))

    # -- state -----------------------------------------------------------------------------
    def commit(self):
        self._snapshot = None

    def rollback(self):
        if self._snapshot is not None:
            self._generator.set_state(self._snapshot)
            self._snapshot = None

    def state_dict(self):
        if self._generator is None:
            return {}
        committed = self._snapshot if self._snapshot is not None else self._generator.get_state()
        return {"generator": committed.clone(), "process_rank": self._generator_rank}

    def load_state_dict(self, state):
        unknown = sorted(set(state) - {"generator", "process_rank"})
        if unknown:
            raise ValueError(f"atomo state has unknown keys {unknown}; expected 'generator', "
                             "'process_rank'")
        if not state:
            self._generator, self._generator_rank, self._snapshot = None, None, None
            return
        saved_rank = int(state.get("process_rank", 0))
        if saved_rank != self.process_rank:
            raise ValueError(
                f"this atomo state was saved on rank {saved_rank} but this process is rank "
                f"{self.process_rank}: ranks sample independently, so save and load one state "
                "per rank")
        generator = torch.Generator()
        generator.set_state(state["generator"].clone())
        self._generator, self._generator_rank, self._snapshot = generator, saved_rank, None

    def __repr__(self):
        return (f"AtomoCompressor(budget={self.budget}, min_compression_rate="
                f"{self.min_compression_rate}, seed={self.seed})")
