"""PowerSGD: rank-r compression by one step of subspace iteration, warm-started.

Vogels et al., "PowerSGD: Practical Low-Rank Gradient Compression for Distributed
Optimization", NeurIPS 2019.
"""
from __future__ import annotations

import zlib
from typing import Dict

import torch

from . import register
from .base import AllReduce, Compressor
from .matrix import as_matrix, from_matrix, matrix_shape


def orthonormalize(matrix: torch.Tensor) -> torch.Tensor:
    """Orthonormal basis of the columns of ``matrix`` (reduced QR; zero columns stay finite)."""
    return torch.linalg.qr(matrix, mode="reduced").Q


@register("powersgd")
class PowerSGDCompressor(Compressor):
    """Approximate the gradient matrix M (r × c) by P̂ Qᵀ of rank ``rank`` in two allreduces.

    Algorithm 1 of the paper, run as two rounds through the communicator (``rounds``):
    P = M Q, allreduce P, P̂ = orthonormalize(ΣP); Q = Mᵀ P̂, allreduce Q; the decoded sum
    over ranks is P̂ (ΣQ)ᵀ.  Q is warm-started from the previous step's ΣQ (the power
    iteration continues across steps) and starts from a normal draw seeded by the group
    name, identical on every rank.  Error feedback is built in, as in the paper: each rank
    keeps e = M − P̂ Qₗᵀ (Qₗ its local Q) and adds it to the next gradient, so use it with
    the ``none`` memory.  Biased per step; the feedback makes up for it.

    The matrix view is :mod:`mergecomp.compressors.matrix` (a flat fused buffer becomes a
    near-square matrix); math and wire are fp32 whatever the input dtype (fp64 stays fp64).

    Wire for an r × c matrix: 4·rank·(r + c) bytes, in two allreduces (P, then Q).
    PowerSGD has no one-shot form: :meth:`compress` and :meth:`decompress` raise, and
    ``mergecomp.compressors.loopback.run_locally`` drives :meth:`rounds` on one process.
    """

    summable = True
    fixed_size = True
    multi_round = True
    recommended_memory = "none"
    recommended_communicator = "allreduce"

    def __init__(self, rank: int = 2, seed: int = 0):
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
            raise ValueError(f"powersgd rank must be a positive integer, got {rank!r}; 1 to 4 is usual")
        self.rank = rank
        self.seed = int(seed)
        self.queries: Dict[str, torch.Tensor] = {}
        self.errors: Dict[str, torch.Tensor] = {}

    def _query(self, name: str, cols: int, rank: int, like: torch.Tensor) -> torch.Tensor:
        query = self.queries.get(name)
        if query is not None and query.shape == (cols, rank):
            return query
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + zlib.crc32(name.encode()))
        return torch.randn(cols, rank, generator=generator, dtype=like.dtype).to(like.device)

    def rounds(self, tensor, name):
        matrix = as_matrix(tensor)
        error = self.errors.get(name)
        if error is not None:
            if error.shape != matrix.shape:
                raise ValueError(
                    f"powersgd error of group {name!r} has shape {tuple(error.shape)} but the "
                    f"gradient is viewed as {tuple(matrix.shape)}: the plan changed; create a new compressor")
            matrix.add_(error)
        rows, cols = matrix.shape
        rank = min(self.rank, rows, cols)
        p = matrix @ self._query(name, cols, rank, matrix)
        (p_sum,) = yield AllReduce((p,))
        p_hat = orthonormalize(p_sum)
        q_local = matrix.t() @ p_hat
        error = matrix.sub_(p_hat @ q_local.t())
        error.view(-1)[tensor.numel():].zero_()  # the padding is not part of the gradient
        self.errors[name] = error
        (q_sum,) = yield AllReduce((q_local,))
        self.queries[name] = q_sum.clone()
        return from_matrix(p_hat @ q_sum.t(), tensor.shape, tensor.dtype)

    def compress(self, tensor, name):
        raise TypeError("PowerSGD exchanges in two allreduce rounds and has no one-shot payload: "
                        "use it through a communicator (which drives rounds()), or "
                        "mergecomp.compressors.loopback.run_locally on a single process")

    def decompress(self, payload, ctx):
        self.compress(None, None)

    def wire_nbytes(self, numel: int) -> int:
        """Bytes one rank sends for a group of ``numel`` elements (both rounds)."""
        rows, cols = matrix_shape(torch.Size([numel]))
        return 4 * min(self.rank, rows, cols) * (rows + cols)

    def state_dict(self):
        return {"queries": {k: v.clone() for k, v in self.queries.items()},
                "errors": {k: v.clone() for k, v in self.errors.items()}}

    def load_state_dict(self, state):
        self.queries = {k: v.clone() for k, v in state.get("queries", {}).items()}
        self.errors = {k: v.clone() for k, v in state.get("errors", {}).items()}

    def __repr__(self):
        return f"PowerSGDCompressor(rank={self.rank})"
