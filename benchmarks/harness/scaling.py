"""The simulator's scaling predictions for many workers: FP32, top-k by allgather, top-k by
sparse allreduce, and the optimal plan that chooses between them group by group.

    python benchmarks/simulator.py scaling --model resnet50 --workers 16,32,64,128,256 \\
        --link 10gbit,25gbit,100gbit --out benchmarks/results/<date>-scaling

Besides the grid, two rows of published settings: MergeComp's (8 GPUs in one server, over
PCIe 3.0 x16 and over NVLink) and DGC's (32 workers on 1 Gbit/s Ethernet).

**The per-GPU compute profile** (documented, not measured here): the codec lines are
fitted to the committed GPU table ``benchmarks/results/2026-11-24-compressors-cuda``
(one H100; top-k 1% and FP16 at 1M and 25M elements; decoding and copies at the speed
of ``clone()`` there).  The forward + backward time is an assumption, ``--compute-time``
(default 0.2 s: ResNet-50 at batch 64 on one V100-class GPU, the MergeComp paper's
hardware), with gradients ready evenly over backward (:func:`model_profile`).  Every
link is the α-β model of :mod:`mergecomp.planning.simulate` at line rate.
"""
from __future__ import annotations

import dataclasses

from mergecomp.planning.profile import CodecCost, LinearCost, WireSize
from mergecomp.planning.simulate import model_profile, simulate

from . import models

#: Top-k (1%) and FP16 on one GPU: lines through the committed table's 1M and 25M points.
def _line(ms_small: float, ms_large: float, small: int = 10 ** 6, large: int = 25 * 10 ** 6) -> LinearCost:
    slope = (ms_large - ms_small) * 1e-3 / (large - small)
    return LinearCost(max(0.0, ms_small * 1e-3 - slope * small), slope)


CLONE = _line(0.02, 0.10)  # clone() of 1M / 25M FP32 elements
#: Compress + decompress on one H100, ms at 1M and 25M FP32 elements: the committed table
#: ``benchmarks/results/2026-11-24-compressors-cuda/compressors.md``.
GPU_TABLE = {"batched_powersgd": (0.42, 0.66), "bf16": (0.04, 0.16), "dgc": (0.50, 1.07),
             "efsignsgd": (0.54, 2.36), "fp16": (0.04, 0.15), "graddrop": (0.54, 0.94),
             "onebit": (0.44, 2.35), "powersgd": (0.08, 0.19), "qsgd": (0.88, 1.57), "randk": (0.80, 6.90),
             "signsgd": (0.29, 2.13), "signum": (0.33, 2.28), "tbq": (0.26, 0.47), "terngrad": (0.89, 5.36),
             "topk": (0.40, 1.04)}
GPU_CODECS = {
    "topk": CodecCost(_line(*GPU_TABLE["topk"]), CLONE, WireSize(0.01 * 8, 0.0), add=CLONE),
    "fp16": CodecCost(_line(*GPU_TABLE["fp16"]), CLONE, WireSize(2.0, 0.0)),
}


def gpu_codec(name: str) -> CodecCost:
    """What compressor ``name`` costs on the GPU of the committed table: the table's compress +
    decompress round trip as the encode, a clone as the decode and as each further payload's
    addition (the sparse sums' scatter-add touches k elements, a clone all n: an upper bound).
    The wire bytes are left to the compressor itself."""
    if name not in GPU_TABLE:
        raise ValueError(f"the committed GPU table has no row for compressor {name!r}; it has "
                         f"{', '.join(sorted(GPU_TABLE))} (run benchmarks/compressors.py --devices cuda "
                         "on a GPU for the others), or replay the codecs as they run here (real)")
    return CodecCost(_line(*GPU_TABLE[name]), CLONE, WireSize(None, 0.0), add=CLONE)
GPU_COPY = LinearCost(CLONE.intercept, CLONE.slope / 4)  # per byte

LINKS = {"1gbit": 1e9 / 8, "10gbit": 10e9 / 8, "25gbit": 25e9 / 8, "100gbit": 100e9 / 8,
         "pcie3x16": 12e9, "nvlink": 100e9}
#: Published settings: (label, workers, link, latency in seconds).
SETTINGS = (("MergeComp: 8 GPUs, PCIe 3.0 x16", 8, "pcie3x16", 5e-6),
            ("MergeComp: 8 GPUs, NVLink", 8, "nvlink", 5e-6),
            ("DGC: 32 workers, 1 Gbit/s Ethernet", 32, "1gbit", 50e-6))


def gpu_profile(model: str, compute_time: float):
    base = model_profile(models.get(model).build(), compute_time)
    return dataclasses.replace(base, compressor="topk", communicator="allgather", codecs=dict(GPU_CODECS),
                               copy=GPU_COPY, device="cuda")


def cell(base, workers, link, latency):
    rows = simulate(base, [workers], LINKS[link], latency, "allgather", summable=False,
                    via=("sparse_allreduce",))
    row = rows[0]
    return {"workers": workers, "link": link, "latency_us": latency * 1e6,
            **{label: {"ms": row[label]["iteration_time"] * 1e3, "scaling": row[label]["scaling"],
                       "sends": row[label]["sends"]}
               for label in ("fp32", "compress allgather", "compress sparse_allreduce", "optimal")}}


def table(cells):
    lines = ["| setting | N | link | FP32 ms (scale) | top-k allgather | top-k sparse allreduce | "
             "optimal (per group) | optimal's groups |", "|---|---:|---|---:|---:|---:|---:|---|"]
    for c in cells:
        def show(label):
            return f"{c[label]['ms']:.1f} ({c[label]['scaling']:.2f})"
        sends = ", ".join(f"{k} {v}" for k, v in c["optimal"]["sends"].items() if v)
        lines.append(f"| {c.get('setting', 'grid')} | {c['workers']} | {c['link']} | {show('fp32')} | "
                     f"{show('compress allgather')} | {show('compress sparse_allreduce')} | {show('optimal')} | "
                     f"{sends} |")
    return "\n".join(lines)
