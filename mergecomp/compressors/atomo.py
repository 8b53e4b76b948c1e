"""ATOMO over the singular value decomposition of each layer's gradient matrix.

Wang et al., "ATOMO: Communication-efficient Learning via Atomic Sparsification",
NeurIPS 2018.

    per layer matrix M = Σ σ_i u_i v_iᵀ:  keep atom i with probability p_i (Σ p_i = s,
    p_i ∝ σ_i capped at 1);  decode: M̂ = Σ_kept (σ_i/p_i) u_i v_iᵀ, so E[M̂] = M.

The paper fixes s, the expected atoms per matrix (``budget=2``).  By default s is chosen per
matrix and step instead, the fewest expected atoms whose variance E‖M̂ − M‖² stays within
``noise``² · ‖M‖² (:func:`atomo_budget`): a fixed s is far too few where a gradient's
spectrum is flat (the noise of 2 atoms on a transformer's gradients is several times the
gradient) and more than needed where one direction dominates.

On the wire: the kept (u_i, σ_i/p_i, v_i) of every matrix in fp32, an int32 count per
matrix (−1: the matrix went raw, as its atoms would cost as much), and the views not
factored as they are.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Tuple, Union

import torch

from . import register
from .base import Compressor, Context, GroupLayout, ParamView, check_layout, positive_finite
from .lowrank import check_rate
from .matrix import (LayerMatrix, compute_dtype, factor_element_size, gather_raw, group_layout,
                     layer_matrix, raw_numel, scatter_raw, split_layout)

#: The count a matrix sent raw has on the wire.
SENT_RAW = -1


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


def atomo_budget(sigma: torch.Tensor, noise: float) -> float:
    """The fewest expected atoms s whose variance-optimal sampling keeps E‖M̂ − M‖² within
    ``noise``² · ‖M‖² for singular values ``sigma`` (descending).

    With the first k atoms kept for sure and the rest at pᵢ = (s − k)·σᵢ/T_k (T_k = Σ_{j≥k} σ_j,
    Q_k = Σ_{j≥k} σ_j²), the variance is T_k²/(s − k) − Q_k; setting it to V = noise²·Σσ²
    gives s = k + T_k²/(V + Q_k), where k is the smallest with p_k ≤ 1, i.e.
    σ_k·T_k ≤ V + Q_k (the same water-filling as :func:`atomo_probabilities`, which gives
    back these probabilities for this s).  One vectorised pass; a zero matrix needs none.
    """
    if sigma.numel() == 0:
        return 0.0
    sigma = sigma.double()
    squares = sigma * sigma
    total = float(squares.sum())
    if total == 0.0:
        return 0.0
    variance = noise * noise * total
    tail = torch.cat([sigma.flip(0).cumsum(0).flip(0), sigma.new_zeros(1)])
    tail_squares = torch.cat([squares.flip(0).cumsum(0).flip(0), sigma.new_zeros(1)])
    padded = torch.cat([sigma, sigma.new_zeros(1)])
    fits = padded * tail <= variance + tail_squares  # always true at k = m (nothing left)
    k = int(fits.to(torch.int8).argmax())
    return min(float(sigma.numel()), k + float(tail[k] ** 2 / (variance + tail_squares[k])))


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
    probability for s expected atoms (:func:`atomo_probabilities`) and sent as
    (uᵢ, σᵢ/pᵢ, vᵢ), so the estimate is unbiased: E[decode] = the gradient.

    s is, per matrix and step, the fewest atoms whose sampling noise stays within ``noise``
    times the matrix's norm (``budget="auto"``, the default: :func:`atomo_budget`), or the
    paper's fixed ``budget`` (then ``noise`` is not given).  Why the default measures:
    ATOMO's noise grows as the gradient's spectrum flattens (a few atoms of a transformer's
    flat spectrum are noise several times the gradient; averaged over N ranks, the variance
    it adds is divided by N only), and an unbiased exchange whose per-rank noise stays well
    under the gradient reached dense where a larger one did not (docs/results.md).  The
    quality controller multiplies a fixed budget where the exchange's measured noise is
    high (:attr:`knob`, :meth:`group_scale`); under ``"auto"`` there is nothing left for it
    to raise (``knob`` is None): every matrix is held at its bound at every step, finer
    than a per-group decision every few steps.  A matrix whose s atoms would cost as many
    bytes as the matrix itself is sent raw instead, exactly.

    Which views are factored is fixed by the layout: a matrix is factored only when that
    gains enough, r·c > ``min_compression_rate``·b·(r + c + 1) with b the fixed ``budget``
    (1 under ``"auto"``: a matrix one atom would not halve never is); 1-D views (biases,
    norms, pieces of sliced parameters) and smaller matrices are sent raw, exactly.  Without
    a layout the tensor is one parameter: a matrix if it has two or more dimensions, raw if
    it is 1-D.  The SVD costs O(r·c·min(r, c)) per matrix.

    Sampling draws from the compressor's own generator, seeded by ``seed`` and this
    process's rank (:attr:`process_rank`, set by the communicator), so ranks sample
    independently and the training's global random stream is left alone.  Its state is in
    :meth:`state_dict`; :meth:`rollback` restores it as it was at the step's first draw.

    Payload, five tensors whatever the layout: the raw values (gradient dtype: the views not
    factored, then the matrices sent raw this step), the number of atoms kept per factored
    matrix (int32, −1 for one sent raw), then the kept left vectors, scaled singular values
    and right vectors of every matrix back to back (fp32; fp64 stays fp64).  Its size varies
    from step to step (``fixed_size = False``).
    Wire: (raw elements)·(element size) + 4 per factored matrix + 4·m·(r + c + 1) per r × c
    matrix that kept m atoms (8·m·(r + c + 1) for fp64); :meth:`wire_nbytes` computes it.
    """

    summable = False
    fixed_size = False
    unbiased = True  # E[decode] = the gradient: the none memory measures its noise
    recommended_memory = "none"
    recommended_communicator = "allgather"
    #: The default bound on each matrix's sampling noise, relative to its norm: under the
    #: quality controller's noise threshold (docs/results.md#atomo-noise-bound).
    DEFAULT_NOISE = 0.5

    def __init__(self, budget: Union[float, str] = "auto", noise: Optional[float] = None,
                 min_compression_rate: float = 2.0, seed: int = 0):
        if budget == "auto":
            noise = self.DEFAULT_NOISE if noise is None else noise
            bound = positive_finite(noise)
            if bound is None:
                raise ValueError(f"atomo noise (each matrix's sampling error over its norm) must be a "
                                 f"positive number, got {noise!r}; {self.DEFAULT_NOISE} is the default")
            self.budget: Union[float, str] = "auto"
            self.noise: Optional[float] = bound
            # each matrix holds its noise under the controller's raise threshold at every
            # step already: nothing for the controller to raise (see the class docstring)
            self.knob = None
        else:
            if noise is not None:
                raise ValueError(f"atomo takes a fixed budget ({budget!r}) or a noise bound "
                                 f"({noise!r}), not both: give budget='auto' with noise, or budget alone")
            value = positive_finite(budget)
            if value is None:
                raise ValueError(f"atomo budget (expected number of singular triplets sent) must be "
                                 f"a positive number, got {budget!r}; 1 to 4 is usual, or 'auto' (the "
                                 "default) for as many as the noise bound needs")
            self.budget, self.noise = value, None
        self.min_compression_rate = check_rate(min_compression_rate, "atomo")
        self.seed = int(seed)
        self._generator: Optional[torch.Generator] = None
        self._generator_rank: Optional[int] = None
        self._snapshot: Optional[torch.Tensor] = None  # the generator at this step's first draw

    # -- how many atoms, which views are factored ------------------------------------------
    knob = "rank"

    def group_budget(self, name: str) -> Optional[float]:
        """The fixed expected atoms per matrix group ``name`` samples now: ``budget`` times
        its scale (the quality controller raises it where the exchange's noise is high, see
        :attr:`knob`); None under ``budget="auto"``, where each matrix's own count is
        :func:`atomo_budget` of its singular values.  Which matrices are factored stays
        fixed, so a scale changes how many atoms a group sends, never its layout."""
        if self.budget == "auto":
            return None
        return self.budget * self.group_scale(name)

    @staticmethod
    def raw_is_cheaper(matrix: LayerMatrix, atoms: float, element_size: int) -> bool:
        """Whether ``atoms`` expected atoms of ``matrix`` cost as many bytes as the matrix sent
        raw in ``element_size``-byte elements (it then goes raw, exactly)."""
        return factor_element_size(element_size) * atoms * (matrix.rows + matrix.cols + 1) \
            >= element_size * matrix.rows * matrix.cols

    def _layout_budget(self) -> float:
        return 1.0 if self.budget == "auto" else self.budget

    def factors(self, rows: int, cols: int) -> bool:
        """Whether a rows × cols matrix gains enough to be factored."""
        return rows * cols > self.min_compression_rate * self._layout_budget() * (rows + cols + 1)

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
    @staticmethod
    def _decompose(flat: torch.Tensor, matrix: LayerMatrix, dtype: torch.dtype):
        """(U, σ, Vᵀ) of ``matrix``'s view of ``flat``, in ``dtype``, thin."""
        return torch.linalg.svd(layer_matrix(flat, matrix, dtype), full_matrices=False)

    def compress(self, tensor, name, layout=None):
        layout = group_layout(tensor, name, layout)
        raw, matrices = self.split(layout)
        flat = tensor.reshape(-1)
        dtype = compute_dtype(tensor.dtype)
        fixed = self.group_budget(name)
        if matrices:  # one draw per step and group, an atom's uniform fixed by its position
            uniforms = self._uniforms(sum(min(m.rows, m.cols) for m in matrices), dtype, flat.device)
        counts, lefts, scaled, rights = [], [], [], []
        sent_raw: List[ParamView] = []
        at = 0
        for matrix in matrices:
            drawn = uniforms[at:at + min(matrix.rows, matrix.cols)]
            at += drawn.numel()
            # the SVD first under "auto" (the bound reads its σ); a fixed budget needs it
            # only for a matrix it factors
            factors = None if fixed is not None else self._decompose(flat, matrix, dtype)
            budget = fixed if fixed is not None else atomo_budget(factors[1], self.noise)
            if self.raw_is_cheaper(matrix, budget, tensor.element_size()):
                counts.append(torch.tensor(SENT_RAW, device=flat.device))
                sent_raw.append(matrix.view)
                continue
            u, sigma, vh = factors if factors is not None else self._decompose(flat, matrix, dtype)
            probabilities = atomo_probabilities(sigma, budget)
            keep = drawn < probabilities
            counts.append(keep.sum())
            lefts.append(u[:, keep].t().reshape(-1))
            scaled.append(sigma[keep] / probabilities[keep])
            rights.append(vh[keep].reshape(-1))
        empty = torch.empty(0, dtype=dtype, device=flat.device)
        payload = (gather_raw(flat, tuple(raw) + tuple(sent_raw)),
                   torch.stack(counts).to(torch.int32) if counts
                   else torch.empty(0, dtype=torch.int32, device=flat.device),
                   torch.cat(lefts) if lefts else empty,
                   torch.cat(scaled) if scaled else empty,
                   torch.cat(rights) if rights else empty)
        return payload, AtomoContext(tensor.shape, tensor.dtype, layout)

    def decompress(self, payload, ctx):
        raw_values, counts, left, scaled, right = payload
        raw, matrices = self.split(ctx.layout)
        atom_counts = counts.tolist()
        raw_views = tuple(raw) + tuple(m.view for m, atoms in zip(matrices, atom_counts) if atoms == SENT_RAW)
        if len(atom_counts) != len(matrices) or raw_values.numel() != raw_numel(raw_views):
            raise ValueError(f"atomo payload holds {raw_values.numel()} raw values and atoms for "
                             f"{counts.numel()} matrices, but its context's layout sends "
                             f"{raw_numel(raw)} raw (and the matrices marked raw) and factors "
                             f"{len(matrices)}: decode a payload with the context (layout) it was made with")
        out = torch.empty(ctx.numel, dtype=ctx.dtype, device=raw_values.device)
        scatter_raw(raw_values, raw_views, out)
        left_at = right_at = atom_at = 0
        for matrix, atoms in zip(matrices, atom_counts):
            if atoms == SENT_RAW:
                continue
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
        single matrix).  With ``payload`` the atoms it kept are counted.  Without one: for a
        fixed budget, the expected size when every factored matrix has at least ``budget``
        non-zero singular values (min(budget, r, c) atoms each, or the matrix raw where
        those cost as much); under ``"auto"``, where the atoms follow the gradient's
        spectrum, the most a payload can be (every factored matrix raw)."""
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
        elif self.budget == "auto":
            atoms = [SENT_RAW] * len(matrices)
        else:
            atoms = [SENT_RAW if self.raw_is_cheaper(m, self.budget, element_size)
                     else min(self.budget, m.rows, m.cols) for m in matrices]
        raw_elements = raw_numel(raw) + sum(m.rows * m.cols for m, a in zip(matrices, atoms) if a == SENT_RAW)
        return raw_elements * element_size + 4 * len(matrices) + round(sum(
            factor_size * a * (m.rows + m.cols + 1) for m, a in zip(matrices, atoms) if a != SENT_RAW))

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
        noise = f", noise={self.noise}" if self.budget == "auto" else ""
        return (f"AtomoCompressor(budget={self.budget!r}{noise}, min_compression_rate="
                f"{self.min_compression_rate}, seed={self.seed})")
