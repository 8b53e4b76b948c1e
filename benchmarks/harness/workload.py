"""What a benchmark trains: the model, its synthetic batches, the flags that pick them,
and one training step."""
from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from mergecomp.distributed import launch
from . import models
from .replay import replay_spec


def add_workload_arguments(p) -> None:
    """The flags :func:`prepare`, :func:`run_iterations` and :func:`run_workers` read."""
    p.add_argument("--model", default="resnet20", metavar="NAME",
                   help=f"one of {', '.join(models.available())} (default resnet20)")
    p.add_argument("--batch-size", type=int, default=None, metavar="N", help="per worker (default: the model's)")
    p.add_argument("--num-warmup-batches", type=int, default=10, metavar="N",
                   help="untimed steps before the timed iterations (default 10)")
    p.add_argument("--num-batches-per-iter", type=int, default=10, metavar="N",
                   help="steps in one timed iteration (default 10)")
    p.add_argument("--num-iters", type=int, default=10, metavar="N", help="timed iterations (default 10)")
    p.add_argument("--lr", type=float, default=0.01, help="learning rate of the SGD optimizer (default 0.01)")
    p.add_argument("--no-cuda", action="store_true", help="train on the CPU even if CUDA is available")
    p.add_argument("--nproc", type=int, default=None, metavar="N",
                   help="spawn this many local workers (when not started by torchrun/mpirun/horovodrun)")
    p.add_argument("--threads", type=int, default=None, metavar="N",
                   help="torch threads per worker (default: CPU cores / local workers)")
    p.add_argument("--json", default=None, metavar="PATH", help="write the result as JSON to this path (rank 0)")
    p.add_argument("--seed", type=int, default=42,
                   help="seed of the model's initial weights and of the synthetic batches (default 42)")
    p.add_argument("--progress-every", type=float, default=10.0, metavar="SECONDS",
                   help="when output is not a terminal (a log file, a pipe), print a progress line "
                        "this often during warm-up and timing (default 10; 0: off)")
    replay = p.add_argument_group("replayed compute (benchmarks/harness/replay)")
    replay.add_argument("--replay", default=None, metavar="TRACE",
                        help="train a replayed model instead of --model: forward and backward wait the "
                             "durations of TRACE (benchmarks/replay.py record) and its gradients appear "
                             "in the real model's order, sizes and dtypes; the exchange runs for real")
    replay.add_argument("--replay-shrink", type=int, default=1, metavar="S",
                        help="with --replay: divide every parameter's first dimension by S (about 1/S "
                             "of the bytes: many workers in one host's memory; default 1)")
    replay.add_argument("--replay-time-scale", type=float, default=1.0, metavar="D",
                        help="with --replay: multiply every replayed duration by D (default 1)")
    replay.add_argument("--replay-codecs", choices=("real", "gpu"), default="real",
                        help="with --replay: compress for real on this host's cores (real, the "
                             "default), or wait what the committed GPU table says the compressor "
                             "costs, sending the real payload (gpu; benchmarks/harness/replay/codec.py)")


def check_workload_arguments(p, args) -> None:
    """``p.error`` (exit 2, with the value) on a workload flag out of range."""
    if args.num_warmup_batches < 0:
        p.error(f"--num-warmup-batches must be ≥ 0, got {args.num_warmup_batches}")
    for name in ("num_batches_per_iter", "num_iters", "batch_size", "nproc", "threads"):
        value = getattr(args, name)
        if value is not None and value < 1:
            p.error(f"--{name.replace('_', '-')} must be ≥ 1, got {value}")
    if not 0 <= args.progress_every < float("inf"):
        p.error(f"--progress-every must be a number of seconds ≥ 0 (0: off), got {args.progress_every}")
    replay = getattr(args, "replay", None)
    if replay is None and (args.replay_shrink != 1 or args.replay_time_scale != 1.0 or args.replay_codecs != "real"):
        p.error("--replay-shrink, --replay-time-scale and --replay-codecs change a replayed model: "
                "add --replay TRACE")
    if args.replay_shrink < 1:
        p.error(f"--replay-shrink must be an integer ≥ 1, got {args.replay_shrink}")
    if not 0 < args.replay_time_scale < float("inf"):
        p.error(f"--replay-time-scale must be a factor > 0, got {args.replay_time_scale}")
    if replay is not None:
        try:
            args.model = model_spec(args).name
        except ValueError as error:
            p.error(f"--replay {replay}: {error}")


def model_spec(args) -> models.ModelSpec:
    """What ``args`` train: the replayed trace of ``--replay``, else ``--model``."""
    if getattr(args, "replay", None):
        return replay_spec(args.replay, getattr(args, "replay_shrink", 1), getattr(args, "replay_time_scale", 1.0))
    return models.get(args.model)


#: Launchers that give their ranks a terminal of their own and forward what it shows line
#: by line (Open MPI's pseudo-terminals, which horovodrun's MPI mode uses): a progress bar's
#: carriage returns do not survive that, so its log would show no progress at all.
FAKED_TERMINAL_LAUNCHERS = ("mpirun", "horovodrun")


def on_terminal(stream, launcher: str) -> bool:
    """Whether ``stream`` reaches a person's terminal, where a progress bar redraws in place:
    a terminal, and not one that ``launcher`` (:attr:`LaunchInfo.launcher`) made for its
    ranks (:data:`FAKED_TERMINAL_LAUNCHERS`)."""
    isatty = getattr(stream, "isatty", None)
    return bool(isatty and isatty()) and launcher not in FAKED_TERMINAL_LAUNCHERS


class Progress:
    """Plain progress lines for output that is not a terminal.

    On a terminal the timed iterations get a progress bar.  Redirected to a log file or a
    pipe, or under a launcher that forwards its ranks' terminals line by line (mpirun), a
    bar's carriage returns garble or hide the lines, and without one a long warm-up (minutes
    for a large model on CPUs) prints nothing at all.  So there, rank 0 counts the steps and
    prints a line such as ``warm-up: step 4 of 10, 41 s`` at most once per ``every_s``
    seconds; :meth:`phase` names what the steps are for (see :func:`on_terminal`).
    """

    def __init__(self, show: bool = False, every_s: float = 10.0):
        self.show = show and every_s > 0
        self.every_s = every_s
        self._name, self._total, self._done = "steps", None, 0
        self._started = self._last = time.perf_counter()

    def phase(self, name: str, total: Optional[int] = None) -> None:
        """The steps from now on are ``name`` (``total`` of them, when known)."""
        self._name, self._total, self._done = name, total, 0
        self._started = self._last = time.perf_counter()

    def step(self) -> None:
        """One step done; print a line if ``every_s`` passed since the last."""
        if not self.show:
            return
        self._done += 1
        now = time.perf_counter()
        if now - self._last >= self.every_s:
            self._last = now
            of = f" of {self._total}" if self._total else ""
            print(f"{self._name}: step {self._done}{of}, {now - self._started:.0f} s", flush=True)


@dataclass
class Workload:
    """One worker's model, batch and device, ready to time."""

    info: launch.LaunchInfo
    device: torch.device
    spec: models.ModelSpec
    batch_size: int
    model: torch.nn.Module
    inputs: torch.Tensor
    targets: torch.Tensor
    num_params: int
    #: Progress lines on rank 0 when stdout is not a terminal (see :class:`Progress`).
    progress: Progress = field(default_factory=Progress)

    @property
    def rank(self) -> int:
        return self.info.rank

    @property
    def size(self) -> int:
        return self.info.world_size

    def log(self, text: str) -> None:
        if self.rank == 0:
            print(text, flush=True)


def prepare(args) -> Workload:
    """Initialise the process group and build the model and its synthetic batch.

    ``args`` needs ``no_cuda``, ``threads``, ``seed``, ``model`` and ``batch_size``; an
    optional ``timeout`` (seconds) bounds every collective's wait, an optional
    ``model_options`` (a dict) goes to the model's ``build`` and ``batch`` (a size).
    On the CPU each worker gets cores / local workers threads unless ``threads`` says.
    """
    device_name = "cuda" if torch.cuda.is_available() and not args.no_cuda else "cpu"
    info = launch.init_distributed(device=device_name, timeout_s=getattr(args, "timeout", None))
    device = torch.device("cuda", info.local_rank) if device_name == "cuda" else torch.device("cpu")
    if device.type == "cpu":
        cores = os.cpu_count() or 1
        torch.set_num_threads(args.threads or max(1, cores // max(1, info.local_world_size)))
    torch.manual_seed(args.seed)
    spec = model_spec(args)
    batch_size = args.batch_size or spec.default_batch_size
    options = getattr(args, "model_options", None) or {}
    if getattr(args, "replay", None):  # each rank draws its own gradients
        options = {**options, "seed": args.seed + info.rank}
    model = spec.build(**options).to(device)
    generator = torch.Generator(device=device).manual_seed(args.seed + info.rank)
    inputs, targets = spec.batch(batch_size, device=device, generator=generator, **options)
    num_params = sum(p.numel() for p in model.parameters() if p.requires_grad)
    progress = Progress(show=info.rank == 0 and not on_terminal(sys.stdout, info.launcher),
                        every_s=getattr(args, "progress_every", 10.0))
    return Workload(info, device, spec, batch_size, model, inputs, targets, num_params, progress)


def training_step(work: Workload, model: torch.nn.Module, optimizer) -> Callable[[], None]:
    """One synthetic training step of ``model`` on ``work``'s batch: zero_grad, forward, loss,
    backward, ``optimizer.step()`` — the step every benchmark times (counted for
    ``work.progress``)."""
    def step() -> None:
        optimizer.zero_grad()
        work.spec.loss(model(work.inputs), work.targets).backward()
        optimizer.step()
        work.progress.step()
    return step
