#!/usr/bin/env python
"""Compile every Triton kernel of mergecomp for a GPU architecture, without a GPU.

Triton's interpreter (``TRITON_INTERPRET=1``) runs the kernels in numpy, which lets
through what the compiler refuses (a type it cannot promote, a loop it cannot lower), so
the CPU tests alone do not prove a kernel builds.  This script hands each kernel, with
every argument type and compile-time constant the wrappers in ``mergecomp/kernels/triton``
launch it with, to Triton's compiler for ``--arch`` (90: H100 and H200), down to the
cubin, as a GPU would on its first call.  It also checks that the stochastic rounding
compiles without fused multiply-adds: one would round f·v + offset once where the CPU
rounds twice, and change a code now and then.

    python tools/triton_compile.py --arch 90        # exit status 1 if any kernel fails
    python tools/triton_compile.py --quick          # each branch of each kernel once (the test)

Run without ``TRITON_INTERPRET`` (the kernels must be compiled objects, not interpreted).
"""
from __future__ import annotations

import argparse
import itertools
import os
import sys
import time

FLOATS = {"fp32": "i32", "fp16": "i16", "bf16": "i16", "fp64": "i64"}  # float → same-width int


def specializations():
    """(kernel, argument types, constants) for every way the wrappers launch each kernel."""
    from mergecomp.kernels.triton import finite, packing, quantize, scatter, segments, selection, subsets
    counts = dict(numel="i32", nbytes="i32")
    for bits in range(1, 8):
        yield packing._pack_kernel, dict(codes_ptr="*u8", out_ptr="*u8", **counts), dict(BITS=bits, BLOCK=packing.BYTES_PER_PROGRAM)
        yield packing._unpack_kernel, dict(packed_ptr="*u8", out_ptr="*u8", **counts), dict(BITS=bits, BLOCK=packing.CODES_PER_PROGRAM)
    for bits, value in itertools.product(range(1, 9), FLOATS):
        yield (packing._decode_kernel, dict(packed_ptr="*u8", values_ptr=f"*{value}", out_ptr=f"*{value}", **counts),
               dict(BITS=bits, BLOCK=packing.CODES_PER_PROGRAM))
    for (value, same), sums in itertools.product(FLOATS.items(), (False, True)):
        partial = ("*fp32", "*fp32", "*i64") if sums else ("*u8", "*u8", "*u8")
        yield (packing._signs_kernel, dict(bits_ptr=f"*{same}", values_ptr=f"*{value}", out_ptr="*u8", totals_ptr=partial[0],
                                           magnitudes_ptr=partial[1], negatives_ptr=partial[2], **counts),
               dict(SUMS=sums, BLOCK=packing.SIGN_BYTES_PER_PROGRAM))
    for value, width in itertools.product(FLOATS, (1, 2, 4, 8)):
        yield (quantize._quantize_kernel, dict(x_ptr=f"*{value}", factors_ptr="*fp32", out_ptr="*u8", bucket_size="i32",
                                               key="i32", offset="i32", **counts),
               dict(BITS=width, BLOCK=quantize.BYTES_PER_PROGRAM))
    # Triton passes an integer argument equal to 1 as a constant: TernGrad's offset, a bucket of 1.
    for value, width in itertools.product(("fp32", "bf16"), (2, 8)):
        yield (quantize._quantize_kernel, dict(x_ptr=f"*{value}", factors_ptr="*fp32", out_ptr="*u8", key="i32", **counts),
               dict(BITS=width, BLOCK=quantize.BYTES_PER_PROGRAM, offset=1, bucket_size=1))
        yield (quantize._dequantize_kernel, dict(packed_ptr="*u8", scales_ptr="*fp32", out_ptr=f"*{value}", **counts),
               dict(BITS=width, BLOCK=quantize.CODES_PER_PROGRAM, offset=1, bucket_size=1))
    for value, bits in itertools.product(FLOATS, range(1, 9)):
        yield (quantize._dequantize_kernel, dict(packed_ptr="*u8", scales_ptr="*fp32", out_ptr=f"*{value}", bucket_size="i32",
                                                 offset="i32", **counts),
               dict(BITS=bits, BLOCK=quantize.CODES_PER_PROGRAM))
    keys = {f"key{r}": "i32" for r in range(6)}
    yield (subsets._subset_kernel, dict(out_ptr="*i64", k="i32", numel="i64", half="i32", **keys),
           dict(BLOCK=subsets.INDICES_PER_PROGRAM))
    for value in FLOATS:
        yield (selection._sample_kernel, dict(x_ptr=f"*{value}", largest_ptr=f"*{value}", out_ptr=f"*{value}", count="i32",
                                              stride="i32"), dict(BLOCK=selection.BLOCK))
        yield (selection._count_kernel, dict(x_ptr=f"*{value}", threshold_ptr=f"*{value}", counts_ptr="*i64", numel="i32"),
               dict(BLOCK=selection.BLOCK))
        yield (selection._write_kernel, dict(x_ptr=f"*{value}", threshold_ptr=f"*{value}", ends_ptr="*i64", counts_ptr="*i64",
                                             out_ptr="*i64", numel="i32"), dict(BLOCK=selection.BLOCK))
        for gather in (False, True):
            yield (finite._nonfinite_kernel, dict(x_ptr=f"*{value}", indices_ptr="*i64" if gather else f"*{value}",
                                                  flag_ptr="*i32", count="i32"), dict(GATHER=gather, BLOCK=finite.BLOCK))
    pairs = [(value, value) for value in FLOATS] + [("fp32", "fp16"), ("fp32", "bf16"), ("fp64", "fp32")]
    for (out, value), index, mode in itertools.product(pairs, ("i32", "i64"), scatter.MODES.values()):
        yield (scatter._scatter_kernel, dict(out_ptr=f"*{out}", indices_ptr=f"*{index}", values_ptr=f"*{value}", count="i32"),
               dict(MODE=mode, BLOCK=scatter.BLOCK))
    table = dict(starts_ptr="*i64", ends_ptr="*i64")
    yield (segments._view_totals_kernel, dict(partials_ptr="*fp32", bounds_ptr="*i64", out_ptr="*fp32", views="i32"),
           dict(CHUNKS=10, CHUNK=segments.CHUNK))
    modes = ((False, False, False), (False, True, False), (False, False, True), (True, False, False))
    for (value, same), (sides, absolute, nonzero) in itertools.product(FLOATS.items(), modes):
        yield (segments._view_sums_kernel, dict(values_ptr=f"*{value}", bits_ptr=f"*{same}" if sides else f"*{value}",
                                                totals_ptr="*fp32", magnitudes_ptr="*fp32", negatives_ptr="*fp32", **table),
               dict(SIDES=sides, ABSOLUTE=absolute, NONZERO=nonzero, BLOCK=segments.BLOCK))
    for value, shift in itertools.product(FLOATS, (False, True)):
        yield (segments._scale_views_kernel, dict(x_ptr=f"*{value}", scales_ptr=f"*{value}", shifts_ptr=f"*{value}",
                                                  views_ptr="*i64", **table),
               dict(SHIFT=shift, CLEAR=False, BLOCK=segments.BLOCK))
        yield (segments._scale_views_kernel, dict(x_ptr=f"*{value}", scales_ptr="*u8", shifts_ptr="*u8",
                                                  views_ptr="*i64", **table), dict(SHIFT=False, CLEAR=True, BLOCK=segments.BLOCK))


def quick(specs):
    """Each kernel once per compile-time branch: codes of 1, 3 and 8 bits (whole codes per
    byte, codes across bytes, one per byte), fp32, and bf16 once per kernel."""
    seen = set()
    for kernel, types, constants in specs:
        if constants.get("BITS", 1) not in (1, 3, 8):
            continue
        floats = {t.lstrip("*") for t in types.values()} & set(FLOATS)
        key = (kernel.__name__, tuple(sorted(constants.items())), "bf16" in floats)
        if "offset" in constants:  # the integer-1 constants: once per kernel
            key = (kernel.__name__, "offset", constants["BITS"] > 2)
        if key in seen or (floats - {"fp32", "bf16"}):
            continue
        seen.add(key)
        yield kernel, types, constants


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, default=90, help="CUDA compute capability × 10 (default 90: H100/H200)")
    parser.add_argument("--quick", action="store_true", help="each compile-time branch of each kernel once")
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        parser.error("unset TRITON_INTERPRET: interpreted kernels cannot be compiled")
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from mergecomp.kernels.triton import quantize

    target = GPUTarget("cuda", args.arch, 32)
    started, failures, count = time.perf_counter(), [], 0
    for kernel, types, constants in (quick(specializations()) if args.quick else specializations()):
        count += 1
        signature = {name: "constexpr" if name in constants else types[name] for name in kernel.arg_names}
        where = f"{kernel.__name__}{constants} {types}"
        rounding = kernel in (quantize._quantize_kernel, quantize._dequantize_kernel)
        try:
            compiled = triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=constants), target=target,
                                      options={"enable_fp_fusion": False} if rounding else {})
        except Exception as error:  # every failure is reported, then the exit status says it
            failures.append(f"{where}: {type(error).__name__}: {error}")
            continue
        if rounding and "fma." in compiled.asm["ptx"]:
            failures.append(f"{where}: the rounding compiled with a fused multiply-add")
    print(f"{count - len(failures)} of {count} kernel specializations compiled for sm_{args.arch} "
          f"in {time.perf_counter() - started:.1f} s")
    for failure in failures:
        print("FAILED", failure)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
