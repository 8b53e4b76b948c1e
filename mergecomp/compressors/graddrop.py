"""Gradient dropping.

Aji & Heafield, "Sparse Communication for Distributed Gradient Descent", EMNLP 2017.
"""
from __future__ import annotations

from . import register
from .base import Context, check_ratio
from .packing import Scratch
from .selection import BlockPeaks, sampled_threshold
from .topk import SparseCompressor, index_dtype, num_selected


@register("graddrop")
class GradDropCompressor(SparseCompressor):
    """Drop every element below a magnitude threshold chosen so that a fraction R survives.

    As in Aji & Heafield, the threshold is the (1 − R) quantile of a sample of |g|
    (``sample_ratio`` of the elements, strided), not an exact top-k: the number sent is
    about R·n and varies from step to step (``fixed_size = False``), with no refinement
    or cap (that is DGC's addition).  Biased; the dropped values must be accumulated,
    which the ``residual`` memory does.

    Wire for n elements, c ≈ R·n sent: c × (value bytes + 4) — values in the input dtype,
    int32 indices (int64 beyond 2^31 elements).
    """

    summable = False
    fixed_size = False
    recommended_memory = "residual"
    recommended_communicator = "allgather"

    def __init__(self, compress_ratio: float = 0.01, sample_ratio: float = 0.001, min_samples: int = 1024):
        self.compress_ratio = check_ratio(compress_ratio)
        self.sample_ratio = check_ratio(sample_ratio, "sample_ratio")
        if isinstance(min_samples, bool) or not isinstance(min_samples, int) or min_samples < 1:
            raise ValueError(f"min_samples must be a positive integer, got {min_samples!r}")
        self.min_samples = min_samples
        self._scratch = Scratch()

    def compress(self, tensor, name):
        flat = tensor.reshape(-1)
        n = flat.numel()
        threshold = sampled_threshold(flat, num_selected(n, self.compress_ratio),
                                      self.sample_ratio, self.min_samples)
        indices = BlockPeaks(flat, self._scratch).indices_at_least(threshold)
        return (flat[indices], indices.to(index_dtype(n))), Context(tensor.shape, tensor.dtype)

    def __repr__(self):
        return f"GradDropCompressor(compress_ratio={self.compress_ratio}, sample_ratio={self.sample_ratio})"
