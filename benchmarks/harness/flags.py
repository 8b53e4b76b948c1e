"""mergecomp's own flags (``compress_benchmark.py``'s, shared by the benchmarks): the
parser, its checks, and the compressor, scheduler and optimizer they build; and the DDP
baselines the benchmarks compare with."""
from __future__ import annotations

import argparse

import torch

import mergecomp

from . import drift
from .replay.codec import replayed
from .running import NoProcessGroup, run_workers
from .scaling import gpu_codec
from .workload import add_workload_arguments, check_workload_arguments, model_spec


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
    p.add_argument("--warmup-steps", type=int, default=None, metavar="STEPS",
                   help="dgc, topk, graddrop: a density warm-up over the first STEPS steps (a "
                        "benchmark sets no epoch; about a fifth of the run's steps; 0: none). Without "
                        "it they send --compress-ratio from the first step: their default warm-up "
                        "runs under an Adam only, and the benchmark trains with SGD")
    # Listed from the registries, so every built-in and plugin is named.
    p.add_argument("--controller", choices=("on", "off"), default=None,
                   help="the quality controller (it raises a group's density where the exchange lags "
                        "dense, so the bytes sent change): on or off (default: the library's, on; off "
                        "with --replay, whose repeated gradients do not train)")
    p.add_argument("--memory", default=None,
                   help=f"error-feedback memory: {', '.join(mergecomp.memories.available())} "
                        "(default: the compressor's recommended)")
    p.add_argument("--comm", default=None,
                   help=f"communicator: {', '.join(mergecomp.communicators.available())} (default: the "
                        "compressor's recommended; hierarchical needs several nodes, see "
                        "docs/hierarchical.md)")
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
            ("--warmup-steps", args.warmup_steps, None), ("--memory", args.memory, None),
            ("--comm", args.comm, None)) if value != unset]
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
    """The compressor from the flags; --compress-ratio goes to those that take one;
    ``--replay-codecs gpu`` replays its cost on the committed GPU table's."""
    if not args.compress:
        return mergecomp.compressors.create("none")
    compressor = _real_compressor(args)
    if getattr(args, "replay_codecs", "real") == "gpu":
        return replayed(compressor, gpu_codec(args.compressor), getattr(args, "replay_time_scale", 1.0))
    return compressor


def _real_compressor(args):
    cls = mergecomp.compressors.get(args.compressor)
    kwargs = {}
    import inspect
    accepted = inspect.signature(cls).parameters
    if args.compress_ratio is not None:
        if "compress_ratio" not in accepted:
            raise ValueError(f"--compress-ratio was given but compressor {args.compressor!r} takes no "
                             "ratio; drop the flag or choose a sparsifier (topk, randk, dgc, ...)")
        kwargs["compress_ratio"] = args.compress_ratio
    if getattr(args, "warmup_steps", None) is not None:
        if "warmup_steps" not in accepted:
            raise ValueError(f"--warmup-steps was given but compressor {args.compressor!r} has no density "
                             "warm-up; drop the flag (dgc, topk and graddrop have one)")
        kwargs["warmup_steps"] = args.warmup_steps
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


def controller_setting(args) -> str:
    """``--controller`` as DistributedOptimizer's keyword: the flag, else ``"off"`` for a
    replayed model and the library's default (``"auto"``) otherwise.

    Why off in a replay: its gradients are the same window of one random pool every step,
    and its codecs resend the first step's payload, so error feedback piles up what no step
    ever sends and the controller, reading a lag no model would show, raises the density
    to its byte budget.  A timing run then sends more bytes than the compressor's setting,
    which is what it measures and what the cost model is asked to predict."""
    choice = getattr(args, "controller", None)
    if choice is None:
        choice = "off" if getattr(args, "replay", None) else "on"
    return drift.VALUES[choice]


def build_optimizer(args, work) -> mergecomp.DistributedOptimizer:
    """SGD on ``work.model`` wrapped as the flags say (fills in args.memory and args.comm);
    the quality controller as :func:`controller_setting` says."""
    compressor = build_compressor(args)
    memory = args.memory or "auto"  # the recommendation with its arguments
    args.memory = args.memory or compressor.recommended_memory
    args.comm = args.comm or compressor.recommended_communicator
    plan = mergecomp.Plan.load(args.plan_in) if args.plan_in else None
    replayed = getattr(work.model, "replay_optimizer", None)  # a replayed model's step waits its traced time
    base = replayed() if replayed else torch.optim.SGD(work.model.parameters(), lr=args.lr)
    return mergecomp.DistributedOptimizer(
        base, work.model.named_parameters(), compressor=compressor,
        memory=memory if args.compress else "none",
        communicator=args.comm if args.compress else "allreduce",
        schedule=plan if plan is not None else build_scheduler(args),
        controller=controller_setting(args))


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
    model_spec(args)
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
        model = model_spec(args).build()
    params = [(name, p.numel()) for name, p in model.named_parameters() if p.requires_grad]
    try:
        plan.validate([name for name, _ in params], dict(params))
    except ValueError as error:
        raise ValueError(f"--plan-in {args.plan_in}: {error}; was it saved (--plan-out) from a run "
                         f"of --model {args.model}?") from None


def parse_spec(text: str):
    """A component as a flag names it, ``name[:key=value...]`` → (name, options): values
    are Python literals where they parse as one (``0.01``, ``None``, ``True``), else strings.
    ``topk:compress_ratio=0.01``, ``sparse_allreduce:keep=2``, ``hierarchical:inner=ps``."""
    import ast
    name, *pairs = text.split(":")
    if not name:
        raise ValueError(f"{text!r} names no component: write name[:key=value...], e.g. topk:compress_ratio=0.01")
    options = {}
    for pair in pairs:
        key, equals, raw = pair.partition("=")
        if not key or not equals:
            raise ValueError(f"{text!r}: {pair!r} is not key=value; write name[:key=value...], "
                             f"e.g. topk:compress_ratio=0.01")
        try:
            options[key] = ast.literal_eval(raw)
        except (ValueError, SyntaxError):
            options[key] = raw
    return name, options
