"""The compressors' kernels: one function per operation, each picking its backend itself.

A compressor file states its algorithm in terms of these operations and never chooses how
they run.  Each operation picks, per call, from the tensor it is given:

* the native C kernels (:mod:`.native`, ``native_kernels.c`` built with the package) for a
  CPU tensor of a dtype they take (fp32; any float for the sign bits), where the library
  is built and not switched off (``MERGECOMP_NATIVE=0``, :func:`native.disabled`);
* numpy's vectorised loops (:mod:`.numpy_cpu`) for the CPU work torch does slowly there
  (1-bit packing, the sign test, the random-bit hash, table lookups);
* Triton kernels (:mod:`.triton`) for a CUDA tensor where ``triton`` imports: one fused
  kernel per operation, imported on the first CUDA tensor, compiled by Triton on first use;
* torch ops on the tensor's own device otherwise: CUDA without Triton, and the fallback on
  the CPU.

Every backend gives the same bits for the same inputs and random key
(``tests/test_native_kernels.py``, ``tests/test_fast_paths.py`` and
``tests/test_triton_kernels.py`` compare them); the exceptions are sums whose last bits
depend on the order of addition: 1-bit SGD's side means and EF-SignSGD's per-view scales.

=====================  ====================================================================
packing                ``pack_bits``, ``unpack_bits``, ``decode_values`` (a 256-row table
                       gather), ``bits_for``, ``packed_nbytes``
signs                  ``sign_bits``, ``pack_signs``, ``unpack_signs``,
                       ``signs_and_side_means`` (1-bit SGD's encoder)
buckets                ``bucket_norms``, ``bucket_peaks`` (one fp32 per bucket),
                       ``padded_fp32_buckets``, ``check_bucket_size``, ``num_buckets``
quantize               ``quantize_packed`` (stochastic rounding to integer levels, packed),
                       ``dequantize_packed``, ``random_int16``, ``random_key``
selection              ``exact_top_k``, ``sampled_threshold``, ``BlockPeaks`` (indices of
                       the elements at or above a threshold), ``gather``, ``top_positions``
subsets                ``random_subset`` (rand-k's k indices: a keyed permutation's first k,
                       the same on every device for the same key)
scatter                ``scatter`` (the sparse decode: values set, added or subtracted),
                       ``divide_at`` (a sparse sum averaged where it is not zero)
finite                 ``nonfinite_flag`` (any NaN or Inf, without a host sync), ``zero_if``
segments               ``view_abs_sums``, ``signs_and_view_side_sums``, ``scale_views``
                       (one number per parameter view of a group: EF-SignSGD, 1-bit SGD)
momentum               ``momentum_correction`` (DGC's momentum and velocity in one pass,
                       with the velocity's block peaks for the selection that follows)
scratch                ``Scratch``: per-thread reusable work buffers
=====================  ====================================================================
"""
from .buckets import bucket_norms, bucket_peaks, check_bucket_size, num_buckets, padded_fp32_buckets
from .packing import bits_for, decode_values, pack_bits, packed_nbytes, unpack_bits
from .quantize import dequantize_packed, quantize_packed, random_int16, random_key
from .momentum import momentum_correction
from .scratch import Scratch
from .finite import nonfinite_flag, zero_if
from .scatter import divide_at, scatter
from .selection import BlockPeaks, exact_top_k, gather, sampled_threshold, top_positions
from .signs import pack_signs, sign_bits, signs_and_side_means, unpack_signs
from .subsets import random_subset

__all__ = ["Scratch", "bits_for", "packed_nbytes", "pack_bits", "unpack_bits", "decode_values",
           "sign_bits", "pack_signs", "unpack_signs", "signs_and_side_means",
           "bucket_norms", "bucket_peaks", "padded_fp32_buckets", "check_bucket_size", "num_buckets",
           "quantize_packed", "dequantize_packed", "random_int16", "random_key",
           "exact_top_k", "gather", "top_positions", "sampled_threshold", "BlockPeaks", "random_subset", "momentum_correction",
           "scatter", "divide_at", "nonfinite_flag", "zero_if"]
