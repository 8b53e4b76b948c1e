#!/usr/bin/env python
"""The Triton kernels on one device: each checked against the CPU path, and timed against
the torch path it replaces and against a ``clone()``.

For every kernel operation of ``mergecomp.kernels`` that has a Triton path, at each size:

* ``matches``: the device's result, moved to the CPU, against the CPU path's for the same
  inputs and key (bit for bit; the same index set for the selections; 1-bit SGD's means
  to a relative 1e-5, being sums in another order), checked at the first size;
* ``triton ms`` and ``torch ms``: medians of the Triton path and of the torch path on the
  same device (``kernels.triton.disabled()``), timed alternately, and ``clone ms``.

Rand-k's indices get their own rows: the device's indices for a key against the CPU's
(they are never sent, so every rank and device must derive the same ones).

    python benchmarks/gpu_kernels.py --device cuda --out results/kernels   # kernels.json, kernels.md
    TRITON_INTERPRET=1 MERGECOMP_TRITON=interpret python benchmarks/gpu_kernels.py --device cpu --sizes 4K
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Callable, Dict, List, Tuple

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from mergecomp import kernels  # noqa: E402
from mergecomp.kernels import Scratch  # noqa: E402
from mergecomp.kernels import triton as gpu  # noqa: E402


def parse_size(text: str) -> int:
    """'25M' → 25_000_000, '64K' → 64_000, '4096' → 4096."""
    text = text.strip().upper()
    scale = {"K": 10 ** 3, "M": 10 ** 6}.get(text[-1:], 1)
    return int(float(text[:-1] if scale != 1 else text) * scale)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_ms(fn: Callable[[], object], device: torch.device, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        _synchronize(device)
        start = time.perf_counter()
        fn()
        _synchronize(device)
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def _same(a, b) -> bool:
    if isinstance(a, (tuple, list)):
        return all(_same(x, y) for x, y in zip(a, b))
    a, b = a.detach().cpu(), b.detach().cpu()
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.reshape(-1).view(torch.uint8),
                                                                     b.reshape(-1).view(torch.uint8))


def operations(n: int) -> Dict[str, Tuple[Callable, Callable]]:
    """name → (prepare, run): ``prepare(x)`` derives the operation's inputs from a tensor of
    ``n`` elements as a compressor would (codes, bucket factors, a packed payload), on the
    tensor's device and untimed; ``run(*inputs)`` is the timed kernel operation."""
    scratch = Scratch()

    def codes(bits):
        return lambda t: ((t.view(torch.int32) & ((1 << bits) - 1)).to(torch.uint8),)

    def factors(levels, bucket):
        def prepare(t):
            stats = kernels.bucket_norms(t, bucket, scratch) if levels > 1 else kernels.bucket_peaks(t, bucket, scratch)
            return t, torch.where(stats > 0, levels / stats, torch.zeros_like(stats))
        return prepare

    def payload(t):
        norms = kernels.bucket_norms(t, 128, scratch)
        factors = torch.where(norms > 0, 7 / norms, torch.zeros_like(norms))
        return kernels.quantize_packed(t, 128, factors, 7, 4, scratch, key=5).clone(), norms / 7

    def sparse(t):
        indices = torch.arange(0, n, 100, device=t.device, dtype=torch.int32)
        return t[::100].clone(), indices

    k = max(1, n // 100)
    table = torch.tensor([-1.0, 0.0, 1.0, 2.0])
    return {
        "pack_bits 2-bit": (codes(2), lambda c: kernels.pack_bits(c, 2)),
        "pack_bits 3-bit": (codes(3), lambda c: kernels.pack_bits(c, 3)),
        "decode_values 2-bit": (lambda t: (kernels.pack_bits(codes(2)(t)[0], 2), table.to(t.device)),
                                lambda p, v: kernels.decode_values(p, 2, n, v)),
        "pack_signs": (lambda t: (t,), lambda t: kernels.pack_signs(t, scratch)),
        "unpack_signs": (lambda t: (kernels.pack_signs(t, scratch).clone(),),
                         lambda p: kernels.unpack_signs(p, n, torch.float32)),
        "signs_and_side_means": (lambda t: (t,), lambda t: kernels.signs_and_side_means(t, scratch)),
        "quantize_packed qsgd 4-bit": (factors(7, 128), lambda t, f: kernels.quantize_packed(t, 128, f, 7, 4, scratch, key=5)),
        "quantize_packed terngrad 2-bit": (factors(1, 512),
                                           lambda t, f: kernels.quantize_packed(t, 512, f, 1, 2, scratch, key=5)),
        "dequantize_packed qsgd 4-bit": (payload, lambda p, s: kernels.dequantize_packed(p, 4, n, 7, s, 128, torch.float32,
                                                                                          scratch)),
        "sampled_threshold + indices_at_least (dgc 0.1%)": (
            lambda t: (t,), lambda t: kernels.BlockPeaks(t, scratch).indices_at_least(
                kernels.sampled_threshold(t, max(1, n // 1000), 0.01, 1024, 1.5))),
        "scatter add (1%)": (sparse, lambda v, i: kernels.scatter(torch.zeros(n, device=v.device), i, v, "add")),
        "nonfinite_flag": (lambda t: (t,), kernels.nonfinite_flag),
        "random_subset (1%)": (lambda t: (t.device,), lambda device: kernels.random_subset(n, k, 11, device)),
    }


#: Operations whose result is a sum in another order on the device: compared to a tolerance.
APPROXIMATE = {"signs_and_side_means"}


def _to(value, device: torch.device):
    if isinstance(value, torch.Tensor):
        return value.to(device)
    return device if isinstance(value, torch.device) else value


def check(name: str, prepare, run, x: torch.Tensor) -> str:
    """'yes', or what differs, for the device's result against the CPU path's, both from the
    inputs prepared on the CPU (bucket norms are sums: the GPU's own would differ in their
    last bits, and with them a code now and then)."""
    with gpu.disabled():
        inputs = prepare(x.cpu())
        expected = run(*inputs)
    got = run(*(_to(value, x.device) for value in inputs))
    if name in APPROXIMATE:
        ok = _same(got[0], expected[0]) and torch.allclose(got[1].cpu(), expected[1], rtol=1e-5)
    else:
        ok = _same(got, expected)
    return "yes" if ok else "NO: differs from the CPU path"


def randk_rows(device: torch.device, sizes: List[int]) -> List[dict]:
    """The device's rand-k indices against the CPU's, for several keys and ratios."""
    rows = []
    for n in sizes:
        for ratio in (0.001, 0.01, 0.1):
            k = max(1, int(n * ratio))
            same = all(torch.equal(kernels.random_subset(n, k, key, device).cpu(),
                                   kernels.random_subset(n, k, key, "cpu")) for key in (0, 1, 2 ** 40 + 3))
            rows.append({"operation": f"random_subset k={k:,} of {n:,}", "size": n,
                         "matches": "yes" if same else "NO: the device draws other indices than the CPU"})
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", help="where the kernels run (default cuda)")
    parser.add_argument("--sizes", default="1M,25M", help="elements per tensor (default 1M,25M)")
    parser.add_argument("--reps", type=int, default=9, help="timed repetitions per cell (median)")
    parser.add_argument("--out", required=True, help="folder for kernels.json and kernels.md")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    os.makedirs(args.out, exist_ok=True)
    print(f"# {gpu.status()} on {device}", flush=True)
    rows: List[dict] = []
    failed = False
    for index, n in enumerate(sizes):
        x = torch.randn(n, generator=torch.Generator().manual_seed(0)).to(device)
        clone_ms = median_ms(x.clone, device, args.reps)
        for name, (prepare, run) in operations(n).items():
            row = {"operation": name, "size": n, "clone_ms": clone_ms}
            try:
                if index == 0:
                    row["matches"] = check(name, prepare, run, x)
                    failed |= row["matches"] != "yes"
                inputs = prepare(x)
                row["triton_ms"] = median_ms(lambda: run(*inputs), device, args.reps)
                with gpu.disabled():
                    inputs = prepare(x)
                    row["torch_ms"] = median_ms(lambda: run(*inputs), device, args.reps)
            except Exception as error:  # recorded, and the next operation runs
                row["error"] = f"{type(error).__name__}: {error}"
                failed = True
            rows.append(row)
            print(json.dumps(row), flush=True)
    for row in randk_rows(device, sizes):
        failed |= row["matches"] != "yes"
        rows.append(row)
        print(json.dumps(row), flush=True)
    with open(os.path.join(args.out, "kernels.json"), "w") as f:
        json.dump({"device": str(device), "status": gpu.status(), "rows": rows}, f, indent=1)
    with open(os.path.join(args.out, "kernels.md"), "w") as f:
        f.write(f"Kernels on {device} ({gpu.status()}), median of {args.reps}\n\n")
        f.write("| operation | elements | matches the CPU | Triton ms | torch ms | torch / Triton | clone ms | note |\n")
        f.write("|---|---:|---|---:|---:|---:|---:|---|\n")
        for row in rows:
            triton_ms, torch_ms = row.get("triton_ms"), row.get("torch_ms")
            speedup = f"{torch_ms / triton_ms:.1f}" if triton_ms and torch_ms else ""
            cells = [row["operation"], f"{row['size']:,}", row.get("matches", ""),
                     f"{triton_ms:.3f}" if triton_ms is not None else "", f"{torch_ms:.3f}" if torch_ms is not None else "",
                     speedup, f"{row['clone_ms']:.3f}" if "clone_ms" in row else "", row.get("error", "")]
            f.write("| " + " | ".join(cells) + " |\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
