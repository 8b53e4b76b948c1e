"""PowerSGD on the whole fused buffer viewed as one matrix (the batched variant).

Vogels et al., "PowerSGD: Practical Low-Rank Gradient Compression for Distributed
Optimization", NeurIPS 2019; PyTorch ships the same idea as ``batched_powerSGD_hook``.

    M = the buffer as one r × c matrix;  P = M·Q;  allreduce P;  P̂ = orthonormalise(ΣP);
    Q = Mᵀ·P̂;  allreduce Q;  decode: P̂·(ΣQ)ᵀ.

On the wire: 4·k·(r + c) bytes in two allreduces.
"""
from __future__ import annotations

import zlib
from typing import Dict

import torch

from . import recipes, register
from ..staging import StagedDict
from .base import AllReduce, Compressor
from .lowrank import FoldsAdamFirstMoment, check_flag, check_rank, orthonormalize
from .matrix import as_matrix, factor_element_size, from_matrix, matrix_shape


@register("batched_powersgd")
class BatchedPowerSGDCompressor(FoldsAdamFirstMoment, Compressor):
    """Rank-``rank`` PowerSGD of the group buffer laid out as one near-square matrix.

    The buffer (every parameter of the group back to back, its layout ignored) becomes an
    r × c matrix M with r = ⌊√n⌋ (see :mod:`mergecomp.compressors.matrix`) and is
    approximated by P̂ Qᵀ in two allreduces, Algorithm 1 of the paper: P = M Q, allreduce P,
    P̂ = orthonormalize(ΣP); Q = Mᵀ P̂, allreduce Q; the decoded sum over ranks is P̂ (ΣQ)ᵀ.
    One factorisation per group sends fewer bytes than one per layer (``powersgd``) and
    runs a few large products instead of many small ones, but the layers laid end to end
    share no low-rank structure, so a rank-r approximation of the buffer keeps less of the
    gradient and training reaches lower accuracy.  How much lower depends on the grouping,
    not only on the compressor: with one group per tensor (``schedule=0``) each layer is a
    matrix of its own, with the wrapper's default grouping several layers share one
    (docs/results.md#accuracy measures both, and a plain-torch reference of the same
    algorithm); it warns when built, for that reason.

    ``warm_start``: Q starts from the previous step's ΣQ (the power iteration continues
    across steps); the first Q, and every Q without warm start, is a normal draw seeded by
    ``seed``, the group name (and the step, without warm start), identical on every rank.
    ``use_error_feedback``: each rank keeps e = M − P̂ Qₗᵀ (Qₗ its local Q) and adds it to
    the next gradient, as in the paper, so use it with the ``none`` memory.  Biased per
    step; the feedback makes up for it; with it, an Adam's first moment is taken off
    (:class:`~.lowrank.FoldsAdamFirstMoment`).  State is staged per step (``commit``/``rollback``).

    Math and wire are fp32 whatever the input dtype (fp64 stays fp64).
    Wire for n elements, r × c as above: 4·rank·(r + c) bytes, in two allreduces (P, then
    Q).  It has no one-shot form: :meth:`compress` and :meth:`decompress` raise, and
    ``mergecomp.compressors.single_process.run_locally`` drives :meth:`rounds` on one process.
    """

    summable = True
    fixed_size = True
    multi_round = True
    error_feedback = True  # the paper's, per rank; False for an instance without it
    staged_state = ("_queries", "_errors", "_steps")
    unbiased = False
    recommended_memory = "none"
    recommended_communicator = "allreduce"
    recipe = recipes.Recipe(
        reason="one rank-r matrix across every layer of a group keeps too little of the gradient: "
               "with several layers per group (the default grouping) accuracy falls far below "
               "dense and swings from seed to seed; one group per tensor (schedule=0) comes closer "
               "but stays short; use 'powersgd' (one factorisation per layer, at parity) unless "
               "fewer, larger products matter more than accuracy")

    def __init__(self, rank: int = 2, seed: int = 0, warm_start: bool = True,
                 use_error_feedback: bool = True):
        self.rank = check_rank(rank, "batched_powersgd")
        self.seed = int(seed)
        self.warm_start = check_flag(warm_start, "warm_start", "batched_powersgd")
        self.use_error_feedback = check_flag(use_error_feedback, "use_error_feedback", "batched_powersgd")
        self.error_feedback = self.use_error_feedback
        self._queries = StagedDict()
        self._errors = StagedDict()
        self._steps = StagedDict()
        recipes.warn(f"{self!r} does not train at parity with dense SGD. Why: {self.recipe.reason}.")

    def _query(self, name: str, cols: int, rank: int, like: torch.Tensor) -> torch.Tensor:
        if self.warm_start:
            query = self._queries.get(name)
            if query is not None and query.shape == (cols, rank):
                return query.to(like.device)
        step = 0 if self.warm_start else self._steps.get(name, 0)
        generator = torch.Generator().manual_seed(
            self.seed * 1_000_003 + zlib.crc32(name.encode()) + 7919 * step)
        return torch.randn(cols, rank, generator=generator, dtype=like.dtype).to(like.device)

    def rounds(self, tensor, name, layout=None):
        matrix = as_matrix(tensor)  # a new tensor: adding the error in place is safe
        error = self._errors.get(name) if self.use_error_feedback else None
        if error is not None:
            if error.shape != matrix.shape:
                raise ValueError(
                    f"batched_powersgd error of group {name!r} has shape {tuple(error.shape)} but "
                    f"the gradient is viewed as {tuple(matrix.shape)}: the plan changed; create a "
                    "new compressor")
            matrix.add_(error.to(matrix.device))
        rows, cols = matrix.shape
        rank = min(self.rank, rows, cols)
        p = matrix @ self._query(name, cols, rank, matrix)
        (p_sum,) = yield AllReduce((p,))
        p_hat = orthonormalize(p_sum)
        q_local = matrix.t() @ p_hat
        if self.use_error_feedback:
            error = matrix.sub_(p_hat @ q_local.t())
            error.view(-1)[tensor.numel():].zero_()  # the padding is not part of the gradient
            self._errors[name] = error
        (q_sum,) = yield AllReduce((q_local,))
        if self.warm_start:
            self._queries[name] = q_sum.clone()
        self._steps[name] = self._steps.get(name, 0) + 1
        return from_matrix(p_hat @ q_sum.t(), tensor.shape, tensor.dtype)

    def compress(self, tensor, name, layout=None):
        raise TypeError("PowerSGD exchanges in two allreduce rounds and has no one-shot payload: "
                        "use it through a communicator (which drives rounds()), or "
                        "mergecomp.compressors.single_process.run_locally on a single process")

    def decompress(self, payload, ctx):
        self.compress(None, None)

    def wire_nbytes(self, numel: int, element_size: int = 4, payload=None, layout=None) -> int:
        """Bytes one rank sends for a group of ``numel`` elements of ``element_size`` bytes
        (both rounds); ``payload`` and ``layout`` do not change it."""
        rows, cols = matrix_shape(torch.Size([numel]))
        return factor_element_size(element_size) * min(self.rank, rows, cols) * (rows + cols)

    # -- state -----------------------------------------------------------------------------
    @property
    def queries(self) -> Dict[str, torch.Tensor]:
        """The warm-start queries (ΣQ) per group, this step's included."""
        return dict(self._queries)

    @property
    def errors(self) -> Dict[str, torch.Tensor]:
        """The error-feedback matrices per group, this step's included."""
        return dict(self._errors)

    def state_dict(self):
        return {"queries": {k: v.clone() for k, v in self._queries.committed().items()},
                "errors": {k: v.clone() for k, v in self._errors.committed().items()},
                "steps": dict(self._steps.committed())}

    def load_state_dict(self, state):
        unknown = sorted(set(state) - {"queries", "errors", "steps"})
        if unknown:
            raise ValueError(f"batched_powersgd state has unknown keys {unknown}; expected "
                             "'queries', 'errors', 'steps'")
        for key in ("queries", "errors"):
            for group, value in state.get(key, {}).items():
                if not isinstance(value, torch.Tensor):
                    raise ValueError(
                        f"batched_powersgd {key} of group {group!r} must be a tensor, got "
                        f"{type(value).__name__}; per-layer state (a dict per group) belongs to "
                        "the 'powersgd' compressor")
        self._queries.replace({k: v.clone() for k, v in state.get("queries", {}).items()})
        self._errors.replace({k: v.clone() for k, v in state.get("errors", {}).items()})
        self._steps.replace({k: int(v) for k, v in state.get("steps", {}).items()})

    def __repr__(self):
        return (f"BatchedPowerSGDCompressor(rank={self.rank}, warm_start={self.warm_start}, "
                f"use_error_feedback={self.use_error_feedback}, seed={self.seed})")
