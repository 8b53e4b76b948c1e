"""What the real-data examples share: the exchange flags, the wrapped optimizer, the launch.

The flags are compress_benchmark.py's (``--compressor``, ``--compress-ratio``,
``--memory``, ``--comm``, ``--fusion-num``, ``--nproc``) plus ``--momentum``, which goes
where it belongs:

* with the ``dgc`` memory (DGC's momentum correction, Lin et al., ICLR 2018) the momentum
  moves into the memory and the optimizer is plain SGD.  The weight decay stays with the
  optimizer, applied after the exchange, where no momentum amplifies it; it is divided by
  (1 - momentum) so that its steady-state pull matches momentum SGD's (the authors'
  reference code keeps a local momentum for the decay term, to the same effect);
* with a compressor that keeps its own momentum (``signum``) SGD has none;
* otherwise SGD has the momentum, as in ordinary training.
"""
from __future__ import annotations

import argparse
import inspect
import math
import os
import sys
from typing import List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import mergecomp  # noqa: E402
from benchmarks import harness  # noqa: E402
from mergecomp import launch

#: The density warm-up of DGC's paper: 25% → 6.25% → 1.5625% → 0.4% → the final density.
PAPER_DENSITY_WARMUP_EPOCHS = 4


def add_exchange_arguments(p: argparse.ArgumentParser, compressor: str, compress_ratio: float,
                           momentum: float, fusion_num: int = 2) -> None:
    """The gradient-exchange flags, with this example's defaults."""
    g = p.add_argument_group("gradient exchange")
    g.add_argument("--compressor", default=compressor,
                   help=f"one of {', '.join(mergecomp.compressors.available())}; 'none' is the "
                        f"FP32 baseline (default {compressor})")
    g.add_argument("--compress-ratio", type=float, default=None,
                   help=f"fraction of the elements a sparsifier (topk, randk, dgc, ...) sends "
                        f"(default {compress_ratio})")
    g.add_argument("--density-warmup-epochs", type=int, default=None,
                   help=f"dgc: epochs over which the density falls exponentially from 25%% to "
                        f"--compress-ratio (default {PAPER_DENSITY_WARMUP_EPOCHS}, the paper's)")
    g.add_argument("--memory", default=None,
                   help="none, residual or dgc (default: the compressor's recommendation)")
    g.add_argument("--comm", default=None,
                   help="allreduce, allgather or ps (default: the compressor's recommendation)")
    g.add_argument("--fusion-num", type=int, default=fusion_num,
                   help=f"0: one group per tensor, 1: one group, y: y groups (default {fusion_num})")
    g.add_argument("--momentum", type=float, default=momentum,
                   help=f"momentum, in the dgc memory or in SGD (default {momentum})")
    g.add_argument("--nesterov", action="store_true", help="Nesterov momentum")
    p.set_defaults(example_compress_ratio=compress_ratio)
    r = p.add_argument_group("workers")
    r.add_argument("--nproc", type=int, default=None,
                   help="spawn this many local workers (when not started by torchrun/mpirun)")
    r.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="cuda (one GPU per local worker, NCCL) or cpu (gloo); auto: cuda if "
                        "available")
    r.add_argument("--threads", type=int, default=None,
                   help="torch threads per worker on the CPU (default: cores / local workers)")


def check_exchange_arguments(p: argparse.ArgumentParser, args) -> None:
    """``p.error`` (exit 2) on a flag out of range or a combination that cannot run,
    before any worker starts."""
    for name in ("nproc", "threads"):
        value = getattr(args, name)
        if value is not None and value < 1:
            p.error(f"--{name} must be ≥ 1, got {value}")
    if args.fusion_num < 0:
        p.error(f"--fusion-num must be ≥ 0, got {args.fusion_num}")
    if not 0.0 <= args.momentum < 1.0:
        p.error(f"--momentum must be in [0, 1), got {args.momentum}")
    if args.nesterov and args.momentum == 0:
        p.error("--nesterov needs --momentum > 0")
    if args.density_warmup_epochs is not None:
        if args.compressor != "dgc":
            p.error(f"--density-warmup-epochs is DGC's warm-up; it does not apply to "
                    f"--compressor {args.compressor}")
        if args.density_warmup_epochs < 0:
            p.error(f"--density-warmup-epochs must be ≥ 0, got {args.density_warmup_epochs}")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda was asked for but torch.cuda.is_available() is False")
    try:
        compressor = build_compressor(args)
        memory = args.memory or compressor.recommended_memory
        comm = args.comm or compressor.recommended_communicator
        mergecomp.memories.get(memory)
        mergecomp.communicators.get(comm)
    except (ValueError, TypeError) as error:
        p.error(str(error))
    if comm == "allreduce" and not compressor.summable:
        p.error(f"--comm allreduce adds payloads elementwise, which {args.compressor} payloads "
                f"cannot be; use --comm allgather or --comm ps")


def build_compressor(args):
    """The compressor of the flags; a ratio goes to the compressors that take one."""
    cls = mergecomp.compressors.get(args.compressor)
    kwargs = {}
    takes = inspect.signature(cls).parameters
    if "compress_ratio" in takes:
        kwargs["compress_ratio"] = (args.example_compress_ratio if args.compress_ratio is None
                                    else args.compress_ratio)
    elif args.compress_ratio is not None:
        raise ValueError(f"--compress-ratio was given but compressor {args.compressor!r} takes "
                         f"no ratio; drop the flag or choose a sparsifier (topk, randk, dgc, ...)")
    if args.compressor == "dgc":
        kwargs["warmup"] = (PAPER_DENSITY_WARMUP_EPOCHS if args.density_warmup_epochs is None
                            else args.density_warmup_epochs)
    return mergecomp.compressors.create(args.compressor, **kwargs)


def build_optimizer(model: torch.nn.Module, args, lr: float, weight_decay: float = 0.0,
                    memory_clip_norm: Optional[float] = None) -> mergecomp.DistributedOptimizer:
    """SGD on ``model``, wrapped, with the momentum placed as the module docstring says.

    ``memory_clip_norm`` is DGC's local gradient clipping threshold, for the dgc memory only.
    """
    compressor = build_compressor(args)
    memory_name = args.memory or compressor.recommended_memory
    momentum_in_memory = memory_name == "dgc"
    if momentum_in_memory:
        memory = mergecomp.memories.create("dgc", momentum=args.momentum, nesterov=args.nesterov,
                                           clip_norm=memory_clip_norm)
        weight_decay = weight_decay / (1.0 - args.momentum)
    else:
        memory = mergecomp.memories.create(memory_name)
    compressor_owns_momentum = callable(getattr(compressor, "check_optimizer", None))
    sgd_momentum = 0.0 if momentum_in_memory or compressor_owns_momentum else args.momentum
    base = torch.optim.SGD(model.parameters(), lr=lr, momentum=sgd_momentum,
                           nesterov=args.nesterov and sgd_momentum > 0, weight_decay=weight_decay)
    return mergecomp.DistributedOptimizer(
        base, model.named_parameters(), compressor=compressor, memory=memory,
        communicator=args.comm or compressor.recommended_communicator,
        schedule=args.fusion_num)


def start_worker(args) -> Tuple[launch.LaunchInfo, torch.device]:
    """Join the job (NCCL on one GPU per local rank, or gloo on the CPU) and pick the device."""
    use_cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    info = launch.init_distributed(device="cuda" if use_cuda else "cpu")
    if use_cuda:
        return info, torch.device("cuda", torch.cuda.current_device())
    cores = os.cpu_count() or 1
    torch.set_num_threads(args.threads or max(1, cores // info.local_world_size))
    return info, torch.device("cpu")


def all_sum(values: Sequence[float], device: torch.device) -> List[float]:
    """Sum of each value over all ranks (one allreduce, every rank calls it)."""
    total = torch.tensor(list(values), dtype=torch.float64, device=device)
    dist.all_reduce(total)
    return total.tolist()


class Traffic:
    """The bytes this rank handed to collectives, and would transmit, since the last reading."""

    def __init__(self, backend):
        self.backend = backend
        self._last = (backend.bytes_sent, backend.wire_bytes)

    def read(self) -> Tuple[int, int]:
        now = (self.backend.bytes_sent, self.backend.wire_bytes)
        delta = (now[0] - self._last[0], now[1] - self._last[1])
        self._last = now
        return delta


def traffic_line(handed_per_step: float, wire_per_step: float, num_params: int,
                 world_size: int) -> str:
    """Bytes per worker per step, against an FP32 ring allreduce of the same gradient."""
    fp32 = 4 * num_params
    fp32_wire = fp32 * 2 * (world_size - 1) / world_size
    ratio = f", {fp32 / handed_per_step:.1f}x less than FP32" if handed_per_step else ""
    wire = (f"; on the wire {wire_per_step:,.0f} (FP32 ring allreduce {fp32_wire:,.0f})"
            if world_size > 1 else "")
    return f"{handed_per_step:,.0f} bytes/step per worker{ratio}{wire}"


def run(train, args) -> None:
    """``train(args)`` on every rank: spawn ``--nproc`` local ones, or run as launched."""
    harness.run_workers(train, args)


def density_text(optimizer) -> str:
    """", density 0.0039" for DGC (its warm-up density this epoch), else ""."""
    density = getattr(optimizer.compressor, "density", None)
    return f", density {density():.4g}" if callable(density) else ""


def cosine(progress: float) -> float:
    """Half a cosine from 1 at progress 0 to 0 at progress 1."""
    return 0.5 * (1.0 + math.cos(math.pi * min(max(progress, 0.0), 1.0)))
