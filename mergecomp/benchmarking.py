"""What ``compress_benchmark.py`` and ``benchmarks/ddp_baseline.py`` share.

Worker set-up, the timing loop and the report live here once, so mergecomp runs and the
DDP baselines are measured the same way: same models and synthetic batches, same thread
count, same iterations, same statistics, same JSON keys.
"""
from __future__ import annotations

import functools
import math
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterator, List, Optional

import torch

from . import launch, models
from .backends.base import Backend


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
