#!/usr/bin/env python
"""Speed of every compressor: compress + decode of one fp32 tensor, against a clone() of it.

For each compressor and size (default 1M and 25M elements) on the CPU (and CUDA when
available) the table gives the median time of compress + decompress (PowerSGD: its two
rounds with the identity in place of the allreduces), the input bandwidth in GB/s, the
bytes on the wire, and the ratio to ``tensor.clone()`` timed in the same run: a clone
reads and writes every byte once, the floor any compressor that touches its input pays.
The sparsifiers' rows (DGC, top-k, GradDrop) also compare their selection (``compress``:
the values and indices they send) with ``torch.topk`` of |g| on the same tensor, the exact
selection they replace.

The tensor is handed over as one parameter of matrix shape (rows × cols = n, as square as
n allows: 1000 × 1000 for 1M, 5000 × 5000 for 25M), as a layer's gradient arrives, so the
compressors that factor each layer (PowerSGD, ATOMO) factor a matrix: given a flat vector
they would send it raw and the row would measure nothing.  Elementwise compressors do not
look at the shape.  On CUDA, the kernels run on Triton where it is present (the header
says; ``MERGECOMP_TRITON=0`` times the torch path instead).

Timings run on one thread by default (``--threads``) so that numbers from shared
machines stay comparable.  ATOMO above ``--atomo-max`` elements is skipped: its SVD is
cubic and it is meant for layers, not fused buffers.

    python benchmarks/compressors.py                      # everything, 1M and 25M
    python benchmarks/compressors.py --sizes 1M --compressors dgc,qsgd,signsgd

``compressors.py memory`` times what a rank does on its compute core per step with an
error-feedback memory: the memory's compensate, compress, the memory's update and commit
(DGC's momentum correction and selection by default), on the native kernels and on the
torch path in the same run, on i.i.d. tensors or a model's real gradient (``--gradients
vgg16,lstm``; see ``compressors.py memory --help``).

``compressors.py compiled`` times a plugin written in plain torch ops (the README's
HalfSign) eagerly and through ``compressors.compiled`` (torch.compile, inductor), the
first call's compile apart (see ``compressors.py compiled --help``).

``compressors.py sparse-sum`` times the finish phase of sparse payloads instead (see
``compressors.py sparse-sum --help``).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

import os
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks.harness, run as a file

from benchmarks import harness
from mergecomp import compressors
from mergecomp.compressors.base import ParamView
from mergecomp.kernels import native
from mergecomp.kernels import triton as gpu_kernels
from mergecomp.compressors.single_process import run_locally
from mergecomp.compressors.sparsifier import num_selected


def parse_size(text: str) -> int:
    """'25M' → 25_000_000, '512K' → 512_000, '1000' → 1000."""
    text = text.strip().upper()
    scale = {"K": 10 ** 3, "M": 10 ** 6, "G": 10 ** 9}.get(text[-1:], 1)
    number = text[:-1] if scale != 1 else text
    try:
        value = int(float(number) * scale)
    except ValueError:
        raise argparse.ArgumentTypeError(f"size {text!r} is not a number like 1M, 25M or 4096") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"size must be at least 1 element, got {text!r}")
    return value


def _timed(fn, device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (time.perf_counter() - start) * 1e3


def paired_median_ms(fn, reference, device: torch.device, reps: int):
    """Medians (ms) of ``fn`` and ``reference``, timed alternately after one warm-up each.

    Alternating the two keeps their ratio honest on a machine whose load changes during
    the run: both medians see the same conditions.
    """
    fn()
    reference()
    fn_times, reference_times = [], []
    for _ in range(reps):
        reference_times.append(_timed(reference, device))
        fn_times.append(_timed(fn, device))
    return statistics.median(fn_times), statistics.median(reference_times)


#: Compressors with fused native CPU kernels (``mergecomp/kernels/native_kernels.c``).
NATIVE_KERNELS = ("signsgd", "efsignsgd", "signum", "onebit", "terngrad", "qsgd")

#: Sparsifiers whose selection is timed against ``torch.topk`` of |g|.
SELECTORS = ("dgc", "topk", "graddrop")


def matrix_shape(numel: int):
    """(rows, cols) with rows · cols = ``numel`` and rows the largest divisor ≤ √numel."""
    rows = max(1, int(numel ** 0.5))
    while numel % rows:
        rows -= 1
    return rows, numel // rows


def matrix_layout(numel: int):
    """The benchmark tensor as one parameter of shape :func:`matrix_shape`."""
    return (ParamView("bench", torch.Size(matrix_shape(numel)), 0),)


def benchmark_compressor(name: str, tensor: torch.Tensor, reps: int, compare_fallback: bool = False):
    compressor = compressors.create(name)
    layout = matrix_layout(tensor.numel())
    state = {}

    def step():
        state["decoded"], state["nbytes"] = run_locally(compressor, tensor, "bench", layout)

    ms, clone_ms = paired_median_ms(step, tensor.clone, tensor.device, reps)
    row = {"compressor": name, "ms": ms, "gbps": tensor.numel() * tensor.element_size() / ms / 1e6,
           "wire": state["nbytes"], "clone_ms": clone_ms, "vs_clone": ms / clone_ms, "note": ""}
    if compare_fallback and name in NATIVE_KERNELS and native.usable(tensor):
        fallback = compressors.create(name)

        def fallback_step():
            with native.disabled():
                run_locally(fallback, tensor, "bench", layout)

        fallback_ms, native_ms = paired_median_ms(fallback_step, step, tensor.device, reps)
        row["note"] = (f"torch/numpy path {fallback_ms:.2f} ms, native {native_ms:.2f} ms "
                       f"alternately: {fallback_ms / native_ms:.1f}x faster")
    if name in SELECTORS:  # selection against selection: compress, |g| and an exact top-k
        ratio = compressor.density() if name == "dgc" else compressor.compress_ratio
        k = num_selected(tensor.numel(), ratio)
        topk_ms, select_ms = paired_median_ms(lambda: torch.topk(tensor.abs(), k, sorted=False),
                                              lambda: compressor.compress(tensor, "bench"), tensor.device, reps)
        row["note"] = (f"selection {select_ms:.2f} ms, torch.topk {topk_ms:.2f} ms: "
                       f"{name} selects {topk_ms / select_ms:.1f}x faster")
    return row


def human_bytes(n: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"


def speed_main(argv) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1M,25M", help="comma-separated element counts (default 1M,25M)")
    parser.add_argument("--compressors", default=None,
                        help="comma-separated names (default: every registered compressor)")
    parser.add_argument("--devices", default=None, help="comma-separated devices (default: cpu, and cuda if present)")
    parser.add_argument("--reps", type=int, default=5, help="timed repetitions per cell; the median is reported")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    parser.add_argument("--compare-fallback", action="store_true",
                        help="also time the torch/numpy path of the compressors with native CPU "
                             "kernels, alternately with the native one (the speed-up of the kernels)")
    parser.add_argument("--atomo-max", type=parse_size, default=parse_size("4M"),
                        help="largest size ATOMO is run at (its SVD is cubic; default 4M)")
    args = parser.parse_args(argv)

    sizes = [parse_size(s) for s in args.sizes.split(",") if s.strip()]
    names = args.compressors.split(",") if args.compressors else compressors.available()
    for name in names:
        compressors.get(name)  # unknown names fail now, with the list of valid ones
    if args.reps < 1:
        parser.error(f"--reps must be at least 1, got {args.reps}")
    devices = (args.devices.split(",") if args.devices
               else ["cpu"] + (["cuda"] if torch.cuda.is_available() else []))
    torch.set_num_threads(args.threads)

    print(f"torch {torch.__version__}, {args.threads} CPU thread(s), median of {args.reps}; "
          f"CPU quantisers on {native.status()}; CUDA tensors on {gpu_kernels.status()}; "
          f"one matrix parameter per tensor ({' and '.join('×'.join(map(str, matrix_shape(s))) for s in sizes)})\n")
    print("| device | elements | compressor | ms | GB/s in | wire | clone ms | × clone | note |")
    print("|---|---|---|---:|---:|---:|---:|---:|---|")
    for device in map(torch.device, devices):
        for size in sizes:
            tensor = torch.randn(size, generator=torch.Generator().manual_seed(0)).to(device)
            for name in names:
                if name == "atomo" and size > args.atomo_max:
                    print(f"| {device} | {size:,} | atomo | | | | | | skipped: SVD above --atomo-max |")
                    continue
                row = benchmark_compressor(name, tensor, args.reps, args.compare_fallback)
                print(f"| {device} | {size:,} | {name} | {row['ms']:.2f} | {row['gbps']:.2f} | "
                      f"{human_bytes(row['wire'])} | {row['clone_ms']:.2f} | {row['vs_clone']:.2f} | "
                      f"{row['note']} |", flush=True)


# -------------------------------------------------------------------------- sparse-sum --

SPARSE_SUM_DOC = """The finish phase of sparse payloads: the in-place sum against decode-then-aggregate.

The allgather communicator hands every rank's payload to ``compressor.decompress_sum``.
For the sparsifiers (top-k, DGC, GradDrop) that is one zeroed buffer and a scatter-add per
rank; before, each payload was decoded into a dense tensor of its own and the tensors
added (``aggregate``).  For each compressor, group size and rank count, the table gives
the median of both, timed alternately in the same run, and their ratio.  The payloads
are real: each "rank" compresses its own standard-normal gradient.

    python benchmarks/compressors.py sparse-sum
    python benchmarks/compressors.py sparse-sum --sizes 1M,15M --ranks 2,4,16 --compressors dgc
"""


def payloads_of(compressor, numel: int, ranks: int):
    """Each rank's payload for its own gradient, and the (shared) decoding context."""
    payloads = []
    for rank in range(ranks):
        gradient = torch.randn(numel, generator=torch.Generator().manual_seed(rank))
        payload, ctx = compressor.compress(gradient, "group")
        payloads.append(payload)
    return payloads, ctx


def sparse_sum_main(argv) -> int:
    p = argparse.ArgumentParser(prog="compressors.py sparse-sum", description=SPARSE_SUM_DOC,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--compressors", default="topk,dgc", help="sparsifiers to time (default topk,dgc)")
    p.add_argument("--compress-ratio", type=float, default=0.01)
    p.add_argument("--sizes", default="1M,5M,15M", help="group sizes in elements (default 1M,5M,15M)")
    p.add_argument("--ranks", default="2,3,4,8", help="payloads summed, one per rank (default 2,3,4,8)")
    p.add_argument("--reps", type=int, default=5, help="timed repetitions per cell; the median is reported")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    args = p.parse_args(argv)
    try:
        sizes = [parse_size(s) for s in args.sizes.split(",")]
        ranks = [int(r) for r in args.ranks.split(",")]
    except ValueError:
        p.error(f"--sizes takes counts like 1M,15M and --ranks integers like 2,4; got {args.sizes!r}, {args.ranks!r}")
    if any(n < 1 for n in sizes) or any(r < 1 for r in ranks) or args.reps < 1 or args.threads < 1:
        p.error(f"sizes, ranks, --reps and --threads must be ≥ 1, got {sizes}, {ranks}, {args.reps}, {args.threads}")
    torch.set_num_threads(args.threads)
    print("| compressor | elements | ranks | decode + aggregate ms | in-place sum ms | speed-up |")
    print("|---|---:|---:|---:|---:|---:|")
    for name in args.compressors.split(","):
        if not getattr(compressors.create(name), "sums_in_place", False):
            p.error(f"compressor {name!r} does not sum in place; choose among topk, dgc, graddrop")
        compressor = compressors.create(name, compress_ratio=args.compress_ratio)
        for numel in sizes:
            for count in ranks:
                payloads, ctx = payloads_of(compressor, numel, count)

                def dense():
                    return compressor.aggregate([compressor.decompress(x, ctx).reshape(-1) for x in payloads])

                in_place_ms, dense_ms = paired_median_ms(lambda: compressor.decompress_sum(payloads, ctx), dense,
                                                         torch.device("cpu"), args.reps)
                print(f"| {name} | {numel:,} | {count} | {dense_ms:.2f} | {in_place_ms:.2f} | "
                      f"{dense_ms / in_place_ms:.2f}× |", flush=True)
    return 0


def memory_step(memory, compressor, tensor: torch.Tensor):
    """One step's work on the compute core: compensate, compress, update, commit."""
    def step():
        velocity = memory.compensate(tensor, "bench")
        payload, ctx = compressor.compress(velocity, "bench")
        memory.update(velocity, "bench", compressor, payload, ctx)
        memory.commit()
        compressor.commit()
    return step


def model_gradient(name: str) -> torch.Tensor:
    """The fused fp32 gradient of benchmark model ``name`` (seed 0, one backward of a
    synthetic batch of 8), in parameter order: a one-group plan's buffer."""
    spec = harness.models.get(name)
    torch.manual_seed(0)
    model = spec.build()
    inputs, targets = spec.batch(8, generator=torch.Generator().manual_seed(0))
    spec.loss(model(inputs), targets).backward()
    return torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None])


def memory_main(argv) -> int:
    """The compute-core work of a compressor with its memory, native kernels against the
    torch path, each against a clone timed alternately with it."""
    from mergecomp import memories
    p = argparse.ArgumentParser(prog="compressors.py memory", description=memory_main.__doc__)
    p.add_argument("--pairs", default="dgc:dgc", help="memory:compressor pairs (default dgc:dgc)")
    p.add_argument("--sizes", default="14728266,25M",
                   help="group sizes in elements (default vgg16's fused gradient, 25M), i.i.d. normal")
    p.add_argument("--gradients", default="",
                   help="comma-separated benchmark models (e.g. vgg16,lstm): their real fused gradient "
                        "(one backward of a batch of 8) instead of --sizes; real gradients cluster by "
                        "layer, which a selection's cost depends on")
    p.add_argument("--reps", type=int, default=7, help="timed repetitions per cell; the median is reported")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    p.add_argument("--clip-norm", type=float, default=None,
                   help="the dgc memory's local clipping norm (default none; below the gradient's norm, "
                        "every step clips)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    options = {"dgc": {"clip_norm": args.clip_norm}} if args.clip_norm is not None else {}
    pairs = [pair.split(":") for pair in args.pairs.split(",")]
    print(f"# compute-core work per step, cpu, {args.threads} thread(s); {native.status()}"
          + (f"; dgc memory clip_norm={args.clip_norm}" if args.clip_norm is not None else ""))
    print(f"| {'gradient' if args.gradients else 'elements'} | memory | compressor | path | ms | clone ms | × clone |")
    print("|---|---|---|---|---:|---:|---:|")
    tensors = ([(name, model_gradient(name)) for name in args.gradients.split(",")] if args.gradients else
               [(f"{size:,}", torch.randn(size, generator=torch.Generator().manual_seed(0))) for size in sizes])
    for label, tensor in tensors:
        for memory_name, compressor_name in pairs:
            for path in ("native", "torch"):
                if path == "native" and not native.usable(tensor):
                    continue
                memory = memories.create(memory_name, **options.get(memory_name, {}))
                step = memory_step(memory, compressors.create(compressor_name), tensor)
                if path == "torch":
                    plain = step

                    def step():
                        with native.disabled():
                            plain()
                ms, clone_ms = paired_median_ms(step, tensor.clone, tensor.device, args.reps)
                print(f"| {label} | {memory_name} | {compressor_name} | {path} | {ms:.2f} | {clone_ms:.2f} | "
                      f"{ms / clone_ms:.2f} |", flush=True)
    return 0


class HalfSign(compressors.Compressor):
    """The README's plugin: the sign of each element scaled by half the mean magnitude."""

    def compress(self, tensor, name, layout=None):
        flat = tensor.reshape(-1)
        scale = flat.abs().mean().reshape(1) / 2
        return (torch.sign(flat).to(torch.int8), scale), compressors.Context(tensor.shape, tensor.dtype)

    def decompress(self, payload, ctx):
        signs, scale = payload
        return (signs.to(ctx.dtype) * scale.to(ctx.dtype)).view(ctx.shape)


def compiled_main(argv) -> int:
    """A plain-torch plugin eagerly and compiled (compress + decode), each against a clone
    timed alternately with it; the compile of each shape is timed apart, on its first call."""
    from mergecomp.compressors.testing import check_compiled
    p = argparse.ArgumentParser(prog="compressors.py compiled", description=compiled_main.__doc__)
    p.add_argument("--sizes", default="14728266,25M",
                   help="group sizes in elements (default vgg16's fused gradient, 25M), i.i.d. normal")
    p.add_argument("--gradients", default="",
                   help="comma-separated benchmark models (e.g. vgg16,lstm): their real fused gradient "
                        "(one backward of a batch of 8) instead of --sizes; real gradients cluster by "
                        "layer, which a selection's cost depends on")
    p.add_argument("--backend", default="inductor", help="torch.compile backend (default inductor)")
    p.add_argument("--reps", type=int, default=7, help="timed repetitions per cell; the median is reported")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    fast_class = compressors.compiled(HalfSign, backend=args.backend)
    eager, fast = HalfSign(), fast_class()
    print(f"# HalfSign eager and compiled ({args.backend}), cpu, {args.threads} thread(s)")
    print("| elements | path | ms | clone ms | × clone | first call (compile) s |")
    print("|---|---|---:|---:|---:|---:|")
    for size in map(parse_size, args.sizes.split(",")):
        tensor = torch.randn(size, generator=torch.Generator().manual_seed(0))
        started = time.perf_counter()
        run_locally(fast, tensor, "bench")
        compile_s = time.perf_counter() - started
        for label, compressor, first in (("eager", eager, ""), ("compiled", fast, f"{compile_s:.1f}")):
            ms, clone_ms = paired_median_ms(lambda: run_locally(compressor, tensor, "bench"), tensor.clone,
                                            tensor.device, args.reps)
            print(f"| {size:,} | {label} | {ms:.2f} | {clone_ms:.2f} | {ms / clone_ms:.2f} | {first} |", flush=True)
    notes = check_compiled(fast_class, sizes=(4096,))
    print("check_compiled: " + ("; ".join(notes) if notes else "same payload and decode as eager"))
    return 0


def main(argv=None) -> int:
    return harness.run_mode("compressors.py", __doc__, {"speed": speed_main, "sparse-sum": sparse_sum_main,
                                                        "memory": memory_main, "compiled": compiled_main},
                                 argv, default="speed")


if __name__ == "__main__":
    sys.exit(main())
