"""The benchmark harness: what ``compress_benchmark.py`` and every script of ``benchmarks/`` share.

Worker set-up, the timing loop and the report live here once, so mergecomp runs and the
DDP baselines are measured the same way: same models and synthetic batches, same thread
count, same iterations, same statistics, same JSON keys.
"""
from __future__ import annotations

import argparse
import datetime
import functools
import math
import os
import platform
import shlex
import subprocess
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional

import torch

import mergecomp

from ..runtime import launch
from . import models
from ..backends.base import Backend


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


class Progress:
    """Plain progress lines for output that is not a terminal.

    On a terminal the timed iterations get a progress bar.  Redirected to a log file or a
    pipe, a bar's carriage returns garble the lines, and without one a long warm-up (minutes
    for a large model on CPUs) prints nothing at all.  So there, rank 0 counts the steps and
    prints a line such as ``warm-up: step 4 of 10, 41 s`` at most once per ``every_s``
    seconds; :meth:`phase` names what the steps are for.
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
    optional ``timeout`` (seconds) bounds every collective's wait.
    On the CPU each worker gets cores / local workers threads unless ``threads`` says.
    """
    device_name = "cuda" if torch.cuda.is_available() and not args.no_cuda else "cpu"
    info = launch.init_distributed(device=device_name, timeout_s=getattr(args, "timeout", None))
    device = torch.device("cuda", info.local_rank) if device_name == "cuda" else torch.device("cpu")
    if device.type == "cpu":
        cores = os.cpu_count() or 1
        torch.set_num_threads(args.threads or max(1, cores // max(1, info.local_world_size)))
    torch.manual_seed(args.seed)
    spec = models.get(args.model)
    batch_size = args.batch_size or spec.default_batch_size
    model = spec.build().to(device)
    generator = torch.Generator(device=device).manual_seed(args.seed + info.rank)
    inputs, targets = spec.batch(batch_size, device=device, generator=generator)
    num_params = sum(p.numel() for p in model.parameters() if p.requires_grad)
    progress = Progress(show=info.rank == 0 and not sys.stdout.isatty(),
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


def make_timer(step: Callable[[], None], device: torch.device) -> Callable[[int], float]:
    """``timed(n)``: seconds for n calls of ``step``, the device synchronised at both ends."""
    def timed(batches: int) -> float:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        for _ in range(batches):
            step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter() - start
    return timed


def operator_profile(timed: Callable[[int], float], steps: int, device: torch.device, rows: int = 25) -> str:
    """A table of the operators ``steps`` more steps spend their time in, per step.

    Where the phases say *that* a step is slow, this says *in what*: torch's profiler
    around ``timed(steps)``, operators sorted by their own time (their children's
    excluded: on CUDA the device's, else the CPU's), so a compressor's elementwise passes
    show up beside the model's convolutions.  Collectives appear as the time this rank
    spends starting and waiting for them.
    """
    from torch.profiler import ProfilerActivity, profile
    on_cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_cuda else [])
    with profile(activities=activities) as prof:
        timed(steps)

    def own(event) -> float:  # ms per step
        return (event.self_device_time_total if on_cuda else event.self_cpu_time_total) / steps / 1e3

    events = sorted(prof.key_averages(), key=own, reverse=True)
    total = sum(own(e) for e in events)
    where = "device" if on_cuda else "CPU"
    lines = [f"Operators over {steps} step(s), by own {where} time per step (all operators: {total:.1f} ms):",
             f"| operator | calls per step | own {where} ms | share |", "|---|---:|---:|---:|"]
    for event in events[:rows]:
        lines.append(f"| {event.key} | {event.count / steps:g} | {own(event):.2f} | "
                     f"{own(event) / total if total else 0:.1%} |")
    return "\n".join(lines)


def interleaved_windows(steps: Dict[str, Callable[[], None]], rounds: int, window: int,
                        before: Optional[Dict[str, Callable[[], None]]] = None) -> Dict[str, List[float]]:
    """Per-round seconds per step of each named step function, timed in interleaved windows.

    On a shared machine speed drifts within minutes; comparing runs taken one after the
    other mixes that drift into the result.  Here each round runs one window of every
    configuration, the order rotated by one each round (AB, BA, ... for two), so all of
    them see the same conditions.  ``before[name]``, when given, runs before each of that
    name's windows (switching a plan, resetting a clock); then one untimed step (the other
    configurations left the caches and allocator cold) and ``window`` timed steps.
    Returns {name: [seconds per step, one per round]} on this rank.
    """
    names = list(steps)
    per_step: Dict[str, List[float]] = {name: [] for name in names}
    for round_index in range(rounds):
        shift = round_index % len(names)
        for name in names[shift:] + names[:shift]:
            if before and name in before:
                before[name]()
            steps[name]()
            started = time.perf_counter()
            for _ in range(window):
                steps[name]()
            per_step[name].append((time.perf_counter() - started) / window)
    return per_step


def run_iterations(timed, work: Workload, args, counters: Callable[[], Dict[str, float]]) -> Dict[str, List[float]]:
    """``num_iters`` timed iterations of ``num_batches_per_iter`` training steps each.

    Returns one entry per iteration in each list: ``rates`` (samples/s), ``step_times``
    (seconds per training step), and for each key of ``counters()`` its increase per
    training step (bytes sent, ...).
    """
    series: Dict[str, List[float]] = {"rates": [], "step_times": []}
    work.progress.phase("timed", args.num_iters * args.num_batches_per_iter)
    iterations, write = _progress(args.num_iters, show=work.rank == 0 and sys.stderr.isatty())
    for i in iterations:
        before = counters()
        seconds = timed(args.num_batches_per_iter)
        after = counters()
        for key in before:
            series.setdefault(key, []).append((after[key] - before[key]) / args.num_batches_per_iter)
        series["step_times"].append(seconds / args.num_batches_per_iter)
        series["rates"].append(work.batch_size * args.num_batches_per_iter / seconds)
        if work.rank == 0:
            write(f"Iter #{i}: {series['rates'][-1]:.1f} {work.spec.unit}/sec per worker")
    return series


def _progress(iterations: int, show: bool):
    """``range(iterations)`` and a function that prints a line: with a progress bar on
    stderr when ``show`` (rank 0 on a terminal: in logs the bar's carriage returns garble
    lines), the bar's own ``write``, which keeps the bar below the lines.

    The bar gets a thread lock.  tqdm's default lock adds a multiprocessing semaphore,
    created by every bar even a disabled one; a rank ends without the interpreter's
    teardown (:func:`launch.exit_without_teardown`), so that semaphore is never released
    and the resource tracker reports it as leaked when the launching process exits.
    """
    if not show:
        return range(iterations), functools.partial(print, flush=True)
    import threading
    from tqdm import tqdm
    tqdm.set_lock(threading.RLock())
    return tqdm(range(iterations), desc="iterations", file=sys.stderr, leave=False), tqdm.write


def exchange_fields(args, optimizer, search_steps: int) -> Dict[str, Any]:
    """What a run of ``compress_benchmark.py``'s flags exchanged, for :func:`report`: the
    compressor, memory and communicator (FP32 allreduce without ``--compress``), the
    scheduler's search, and the plan it settled on."""
    return {
        "compress": args.compress, "compressor": args.compressor if args.compress else "none",
        "compress_ratio": args.compress_ratio, "memory": args.memory if args.compress else "none",
        "comm": args.comm if args.compress else "allreduce", "fusion_num": args.fusion_num,
        "scheduler": args.scheduler, "search_steps": search_steps, "groups": len(optimizer.plan),
        "compressed_groups": sum(g.send == "compress" for g in optimizer.plan.groups),
        "plan": optimizer.plan.digest()}


def report(work: Workload, series: Dict[str, List[float]], gather: Callable[[Any], List[Any]],
           fields: Dict[str, Any]) -> Dict[str, Any]:
    """Combine every worker's series into the result (printed on rank 0 and returned).

    ``series`` needs ``bytes_sent`` and ``wire_bytes`` per step; ``gather`` is an
    allgather of Python objects.  ``fields`` describe the exchange (compressor, comm, ...).
    """
    everyone = gather(series)
    rates = series["rates"]
    mean = statistics.mean(rates)
    conf = 1.96 * (statistics.stdev(rates) if len(rates) > 1 else 0.0)
    total = sum(statistics.mean(s["rates"]) for s in everyone)
    sent = statistics.mean(statistics.mean(s["bytes_sent"]) for s in everyone)
    wire = statistics.mean(statistics.mean(s["wire_bytes"]) for s in everyone)
    size = work.size
    fp32_bytes = 4 * work.num_params
    fp32_wire = fp32_bytes * 2 * (size - 1) // size  # a ring allreduce of the FP32 gradient
    result = {
        "model": work.spec.name, "unit": work.spec.unit, **fields,
        "workers": size, "launcher": work.info.launcher, "device": str(work.device),
        "batch_size": work.batch_size, "num_params": work.num_params,
        "rate_per_worker": mean, "rate_per_worker_ci": conf, "rate_total": total,
        # seconds per training step (MergeComp's "iteration time"; the sweeps read this key)
        "iteration_time_s": statistics.mean(series["step_times"]),
        "bytes_per_step": sent, "fp32_bytes_per_step": fp32_bytes,
        "compression_ratio": fp32_bytes / sent if sent else math.inf,
        "wire_bytes_per_step": wire, "fp32_wire_bytes_per_step": fp32_wire,
        "rates": rates, "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    unit = work.spec.unit
    work.log(f"{unit.capitalize()}/sec per worker: {mean:.1f} +-{conf:.1f}")
    work.log(f"Total {unit}/sec on {size} worker{'s' if size != 1 else ''}: {total:.1f} +-{conf * size:.1f}")
    work.log(f"Bytes sent per worker per training step: {sent:,.0f} ({sent / 1e6:.3f} MB); FP32 gradient: "
             f"{fp32_bytes:,} bytes; compression ratio {result['compression_ratio']:.1f}x")
    if size > 1:
        work.log(f"On the wire per worker per training step (ring/direct algorithms): {wire:,.0f} bytes; "
                 f"FP32 ring allreduce: {fp32_wire:,} bytes ({fp32_wire / wire if wire else math.inf:.1f}x)")
    return result


def save_result(result: Dict[str, Any], path: Optional[str], work: Workload) -> None:
    """Write the result as JSON on rank 0 (sweeps read it)."""
    if path and work.rank == 0:
        import json
        with open(path, "w") as f:
            json.dump(result, f, indent=2)


def finish(result: Dict[str, Any], path: Optional[str], work: Workload) -> Optional[Dict[str, Any]]:
    """End a benchmark worker: save the result (rank 0 writes ``path``), tear the process
    group down (every rank waits for the others there), and return the result on rank 0,
    None on the others."""
    save_result(result, path, work)
    launch.shutdown()
    return result if work.rank == 0 else None


def saved_results(paths, needs: str, written_by: str) -> Iterator[Dict[str, Any]]:
    """The results saved at ``paths`` (JSON files written by :func:`save_result`), in order.

    A file that is not JSON, or whose result lacks the key ``needs``, raises ValueError
    naming it and the script (``written_by``) whose results are expected.
    """
    import json
    for path in paths:
        try:
            with open(path) as f:
                result = json.load(f)
        except OSError as error:
            raise ValueError(f"cannot read {path}: {error.strerror}") from None
        except json.JSONDecodeError as error:
            raise ValueError(f"{path} is not a JSON result ({error}); pass the --json files of "
                             f"{written_by}") from None
        if not isinstance(result, dict) or needs not in result:
            raise ValueError(f"{path} is not a result of {written_by} (it has no {needs!r}); pass "
                             f"the files its --json wrote")
        yield result


def run_mode(prog: str, doc: str, modes: Dict[str, Callable[[List[str]], int]], argv=None,
             default: Optional[str] = None) -> int:
    """``prog MODE [flags]``: a tool that answers one question several ways takes the way as
    its first word and hands the rest of ``argv`` to ``modes[MODE]``.  With ``default``, flags
    alone (``--help`` included) go to that mode, so the tool's plain form keeps working."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in modes:
        return modes[argv[0]](argv[1:])
    if default is not None and (not argv or argv[0].startswith("-")):
        return modes[default](argv)
    if argv[:1] in (["-h"], ["--help"]):
        print(f"usage: {prog} {{{','.join(modes)}}} ...\n\n{doc.strip()}")
        return 0
    given = f"unknown mode {argv[0]!r}" if argv else "no mode given"
    print(f"usage: {prog} {{{','.join(modes)}}} ...\n{prog}: error: {given}: the first word is one of "
          f"{', '.join(modes)} (then '{prog} MODE --help' for its flags)", file=sys.stderr)
    raise SystemExit(2)


def exit_with(main: Callable[[], int]) -> None:
    """Run a benchmark script's ``main()`` and exit with its code; a ValueError (an unknown
    name, a value out of range, a clash of flags) is printed as one line,
    ``script.py: error: ...`` as argparse prints its errors, and exits 2, without a
    traceback.

    A rank started by a launcher (torchrun, mpirun) exits without the interpreter's
    teardown once ``main()`` returned (see :func:`launch.exit_without_teardown`).
    """
    try:
        code = main()
    except ValueError as error:
        print(f"{os.path.basename(sys.argv[0])}: error: {error}", file=sys.stderr)
        sys.exit(2)
    if launch.detect().launcher not in ("single", "spawn"):
        launch.exit_without_teardown(code or 0)
    sys.exit(code)


def run_workers(worker: Callable[[Any], Any], args) -> None:
    """Run ``worker(args)`` here when a launcher started us, or spawn ``args.nproc`` local ranks.

    Check the flags before (:class:`NoProcessGroup` builds what needs no ranks); a
    ValueError a spawned rank still raises (bad input only a rank can see) comes back as a
    ValueError naming the rank, without the rank's traceback; any other failure keeps it.
    """
    launcher = launch.detect().launcher
    if args.nproc is not None and launcher not in ("single", "spawn"):
        raise SystemExit(f"--nproc {args.nproc} was given but this process was started by "
                         f"{launcher}; use one or the other")
    if args.nproc is not None and launcher == "single":
        try:
            launch.spawn(worker, args.nproc, args=(args,))
        except launch.SpawnedProcessError as failure:
            message = value_error_message(failure.child_traceback)
            if message is None:
                raise
            raise ValueError(f"rank {failure.rank}: {message}") from None
    else:
        worker(args)


def value_error_message(formatted: Optional[str]) -> Optional[str]:
    """The message of the exception ``formatted`` (a ``traceback.format_exc()`` text) ends
    with, if that exception is a ValueError; None otherwise (or for no traceback)."""
    if not formatted:
        return None
    lines = formatted.rstrip("\n").split("\n")
    # The last exception's text starts at the first unindented line after its last frame.
    last_frame = max((i for i, line in enumerate(lines) if line.startswith("  File ")), default=-1)
    start = next((i for i in range(last_frame + 1, len(lines)) if lines[i] and not lines[i][0].isspace()), None)
    if start is None or not lines[start].startswith("ValueError: "):
        return None
    return "\n".join(lines[start:])[len("ValueError: "):]


class NoProcessGroup(Backend):
    """A backend with no process group behind it, for building components before any rank
    exists.

    The launching process builds the communicator the ranks will build with it, so the
    checks communicators make at construction (allreduce refusing a compressor whose
    payloads do not add up, ...) fail before processes are spawned, in one line, instead
    of in every rank.  It is rank 0 of ``size``; every collective raises.
    """

    name = "no-process-group"

    def __init__(self, size: int = 1):
        super().__init__()
        self._size = size

    @property
    def rank(self) -> int:
        return 0

    @property
    def size(self) -> int:
        return self._size

    def _refuse(self, *args, **kwargs):
        raise RuntimeError("NoProcessGroup has no process group: it builds components for their "
                           "checks, it cannot run collectives")

    allreduce_async = allgather_async = alltoall = _refuse
    broadcast_object = allgather_object = barrier = _refuse


# ------------------------------------------------------------------------ sweep records --

def read_records(path: str) -> List[dict]:
    """Every record of a sweep's results.jsonl (``benchmarks/sweep.py``) (a truncated last line, from a killed sweep, is skipped)."""
    if not os.path.exists(path):
        return []
    records = []
    with open(path) as f:
        for line in f:
            try:
                records.append(__import__('json').loads(line))
            except ValueError:
                continue
    return records


def latest(records: Iterable[dict]) -> Dict[str, dict]:
    """The last record of every cell key."""
    return {r["key"]: r for r in records}


# ------------------------------------------------------------------------ DDP baselines --

#: The headline's reference, the cells of its campaign (``benchmarks/headline.py``), which
#: its figure (``benchmarks/plot.py``) draws in this order.
HEADLINE_BASELINE = "ddp-fp16"
HEADLINE_MODELS = ("vgg16", "lstm", "transformer")
HEADLINE_LINKS = ("1gbit", "10gbit", "loopback")


class AllreduceCounter:
    """Counts the bytes of every tensor handed to ``torch.distributed.all_reduce``.

    The DDP hooks call ``torch.distributed.all_reduce`` through the module attribute, also from the
    callbacks of their futures (PowerSGD's Q step), so replacing the attribute sees them all.
    """

    def __init__(self):
        self.bytes_sent = 0
        self._original = torch.distributed.all_reduce

    def __enter__(self):
        def counting_all_reduce(tensor, *args, **kwargs):
            self.bytes_sent += tensor.numel() * tensor.element_size()
            return self._original(tensor, *args, **kwargs)
        torch.distributed.all_reduce = counting_all_reduce
        return self

    def __exit__(self, *exc):
        torch.distributed.all_reduce = self._original


# ------------------------------------------------------------------ mergecomp's own flags --

def build_parser(description: str) -> argparse.ArgumentParser:
    """``compress_benchmark.py``'s flags: the workload, and how mergecomp compresses,
    groups and schedules (the benchmarks that train through mergecomp add theirs to this
    parser)."""
    p = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_workload_arguments(p)
    p.add_argument("--compress", action="store_true", help="compress gradients (else FP32 allreduce)")
    p.add_argument("--compressor", default="none", help="compressor name (see --list)")
    p.add_argument("--compress-ratio", type=float, default=None,
                   help="fraction kept by sparsifiers (topk, randk, dgc, graddrop, ...)")
    p.add_argument("--memory", default=None,
                   help="error-feedback memory: none, residual, dgc (default: the compressor's recommended)")
    p.add_argument("--comm", default=None,
                   help="communicator: allreduce, allgather, ps (default: the compressor's recommended)")
    p.add_argument("--fusion-num", type=int, default=1,
                   help="0: one group per tensor, 1: one group, y: y groups balanced by bytes")
    p.add_argument("--scheduler", default="fixed",
                   help="fixed (--fusion-num), bucket (DDP-style groups of --bucket-mb), binary "
                        "(MergeComp's search for a 2-group split), optimal (DP over a saved "
                        "--profile-in), auto (profile this run, DP, measured check)")
    p.add_argument("--bucket-mb", type=float, default=25.0, help="group size for --scheduler bucket (MB)")
    p.add_argument("--chunk-mb", type=float, default=None,
                   help="--scheduler optimal/auto: let the DP send tensors larger than this (MB) in "
                        "pieces, pipelining their compression and transfer (default: whole tensors)")
    p.add_argument("--profile-in", default=None, help="a saved profile for --scheduler optimal")
    p.add_argument("--profile-out", default=None, help="save the profile --scheduler auto measures (JSON)")
    p.add_argument("--plan-in", default=None, help="execute this saved plan (JSON)")
    p.add_argument("--plan-out", default=None, help="save the plan used (JSON)")
    p.add_argument("--list", action="store_true", help="list models and components, then exit")
    p.add_argument("--timeout", type=float, default=None, metavar="SECONDS",
                   help="how long a collective waits for the slowest rank before failing with "
                        "the ranks behind named (default: $MERGECOMP_TIMEOUT, else 60 for gloo, "
                        "300 for NCCL)")
    return p


def check_arguments(p: argparse.ArgumentParser, args) -> None:
    """``p.error`` (exit 2, with the value) on a flag out of range."""
    check_workload_arguments(p, args)
    if not args.compress:
        given = [f"{flag} {value}" for flag, value, unset in (
            ("--compressor", args.compressor, "none"), ("--compress-ratio", args.compress_ratio, None),
            ("--memory", args.memory, None), ("--comm", args.comm, None)) if value != unset]
        if given:
            p.error(f"{', '.join(given)} without --compress: compression is off, so "
                    f"{'it' if len(given) == 1 else 'they'} would be ignored and every gradient sent "
                    f"uncompressed in an FP32 allreduce; add --compress")
    if args.timeout is not None and not 0 < args.timeout < float("inf"):
        p.error(f"--timeout must be a positive number of seconds, got {args.timeout}")
    if args.fusion_num < 0:
        p.error(f"--fusion-num must be ≥ 0, got {args.fusion_num}")
    if args.chunk_mb is not None:
        if not 0 < args.chunk_mb < float("inf"):
            p.error(f"--chunk-mb must be a size in MB > 0 (e.g. 4), got {args.chunk_mb}")
        if args.scheduler not in ("optimal", "auto"):
            p.error(f"--chunk-mb is for --scheduler optimal or auto (their DP cuts tensors), "
                    f"not {args.scheduler!r}")


def add_rounds_arguments(p: argparse.ArgumentParser, rounds: int, what: str) -> None:
    """``--rounds``, ``--window`` and ``--table`` of the benchmarks that time several
    configurations in interleaved rounds (``what``: one round's windows, for the help)."""
    p.add_argument("--rounds", type=int, default=rounds, help=f"rounds of {what} (default {rounds})")
    p.add_argument("--window", type=int, default=3, help="timed steps per window (default 3)")
    p.add_argument("--table", nargs="+", default=None, metavar="JSON",
                   help="print a markdown table of saved --json results and exit")


def parse_rounds_arguments(p: argparse.ArgumentParser, argv):
    """Parse; unless ``--table`` was given, check the benchmark's flags and that
    ``--rounds`` and ``--window`` are ≥ 1 (``p.error`` otherwise)."""
    args = p.parse_args(argv)
    if args.table or getattr(args, "summary", None):  # only reads saved results
        return args
    check_arguments(p, args)
    for name in ("rounds", "window"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be ≥ 1, got {getattr(args, name)}")
    return args


def build_compressor(args):
    """The compressor from the flags; --compress-ratio goes to those that take one."""
    if not args.compress:
        return mergecomp.compressors.create("none")
    cls = mergecomp.compressors.get(args.compressor)
    kwargs = {}
    if args.compress_ratio is not None:
        import inspect
        if "compress_ratio" not in inspect.signature(cls).parameters:
            raise ValueError(f"--compress-ratio was given but compressor {args.compressor!r} takes no "
                             "ratio; drop the flag or choose a sparsifier (topk, randk, dgc, ...)")
        kwargs["compress_ratio"] = args.compress_ratio
    return mergecomp.compressors.create(args.compressor, **kwargs)


def build_scheduler(args):
    """The scheduler from the flags (rank-independent: every rank builds the same one)."""
    name = args.scheduler
    send = "compress" if args.compress else "fp32"
    if name == "fixed":
        return mergecomp.schedulers.create("fixed", fusion_num=args.fusion_num, send=send)
    if name == "optimal":
        if not args.profile_in:
            raise ValueError("--scheduler optimal plans from a saved profile: pass --profile-in "
                             "PATH (written by --scheduler auto --profile-out PATH), or use "
                             "--scheduler auto to profile this run")
        return mergecomp.schedulers.create("optimal", profile=args.profile_in, allow_compress=args.compress,
                                           chunk_mb=args.chunk_mb)
    if name == "auto":
        return mergecomp.schedulers.create("auto", profile_out=args.profile_out, chunk_mb=args.chunk_mb)
    if name == "binary":
        return mergecomp.schedulers.create("binary", send=send)
    if name == "bucket":
        return mergecomp.schedulers.create("bucket", bucket_mb=args.bucket_mb, send=send)
    return mergecomp.schedulers.create(name)


def build_optimizer(args, work) -> mergecomp.DistributedOptimizer:
    """SGD on ``work.model`` wrapped as the flags say (fills in args.memory and args.comm)."""
    compressor = build_compressor(args)
    args.memory = args.memory or compressor.recommended_memory
    args.comm = args.comm or compressor.recommended_communicator
    plan = mergecomp.Plan.load(args.plan_in) if args.plan_in else None
    base = torch.optim.SGD(work.model.parameters(), lr=args.lr)
    return mergecomp.DistributedOptimizer(
        base, work.model.named_parameters(), compressor=compressor,
        memory=args.memory if args.compress else "none",
        communicator=args.comm if args.compress else "allreduce",
        schedule=plan if plan is not None else build_scheduler(args))


def warm_up_and_settle(optimizer, timed, args, work) -> int:
    """The warm-up steps, then steps until an adaptive scheduler settles; logs the plan.

    Returns the search steps taken beyond the warm-up (0 for a fixed plan).
    """
    work.progress.phase("warm-up", max(1, args.num_warmup_batches))
    timed(max(1, args.num_warmup_batches))  # at least one step: it records the plan
    search_steps = 0
    scheduler = optimizer.scheduler
    work.progress.phase(f"{args.scheduler} scheduler search")
    while getattr(scheduler, "adaptive", False) and not scheduler.settled:
        if search_steps >= 1000:
            raise RuntimeError(f"the {args.scheduler} scheduler did not settle within 1000 steps")
        timed(1)
        search_steps += 1
    if search_steps:
        work.log(f"Scheduler {args.scheduler} settled after {search_steps} step{'s' if search_steps != 1 else ''} "
                 f"beyond the warm-up")
    work.log(optimizer.plan.describe(optimizer.param_infos(optimizer.plan.order())))
    if args.plan_out and work.rank == 0:
        optimizer.plan.save(args.plan_out)
    return search_steps


def run_or_table(args, worker, table) -> int:
    """``main()`` of the benchmarks built on these flags: print the ``--table`` of saved
    results, or check the names and run ``worker`` on every rank."""
    if args.table:
        print(table(args.table))
        return 0
    check_names(args)
    run_workers(worker, args)
    return 0


def check_names(args) -> None:
    """Fail fast, before any process starts (ValueError): names that do not exist, a
    compressor the communicator cannot carry, a --plan-in that is no plan of this model."""
    models.get(args.model)
    mergecomp.schedulers.get(args.scheduler)
    if args.scheduler == "optimal" and not args.profile_in:
        build_scheduler(args)  # raises the explanation
    if args.compress:
        check_exchange(args)
    if args.plan_in:
        check_plan(args)


def check_exchange(args) -> None:
    """Build the compressor, memory and communicator every rank will build, here, with no
    process group (:class:`NoProcessGroup`): their construction
    checks raise before any rank is spawned."""
    from mergecomp import arguments  # the checks the wrapper makes: types, memory pairing
    compressor, memory, comm = arguments.resolve(build_compressor(args), args.memory, args.comm)
    mergecomp.communicators.create(comm, compressor=compressor, memory=memory,
                                   backend=NoProcessGroup(args.nproc or 1))


def check_plan(args) -> None:
    """Load --plan-in and check it names exactly the model's trainable parameters (the
    model is built on the meta device: names and sizes, no memory)."""
    plan = mergecomp.Plan.load(args.plan_in)
    with torch.device("meta"):
        model = models.get(args.model).build()
    params = [(name, p.numel()) for name, p in model.named_parameters() if p.requires_grad]
    try:
        plan.validate([name for name, _ in params], dict(params))
    except ValueError as error:
        raise ValueError(f"--plan-in {args.plan_in}: {error}; was it saved (--plan-out) from a run "
                         f"of --model {args.model}?") from None


# --------------------------------------------------------------------------- provenance --

#: The checkout the benchmarks run from (its commit is part of a result's provenance).
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _git(*args: str) -> Optional[str]:
    try:
        done = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def provenance(argv=None) -> Dict[str, Any]:
    """The command as typed (relative to the checkout), the commit and whether tracked files
    differed from it, the UTC date, torch, Python, and the host's processor count and
    architecture (never its name or paths)."""
    argv = list(sys.argv if argv is None else argv)
    if argv and os.path.isabs(argv[0]):
        argv[0] = os.path.relpath(argv[0], ROOT)
    status = _git("status", "--porcelain", "--untracked-files=no")
    return {"command": "python " + " ".join(shlex.quote(a) for a in argv),
            "commit": _git("rev-parse", "--short", "HEAD"),
            "uncommitted_changes": None if status is None else bool(status),
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "torch": torch.__version__, "python": platform.python_version(),
            "host": {"cpus": os.cpu_count(), "machine": platform.machine(),
                     "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}}
