"""What a run reports and keeps: the result's fields and statistics, the JSON written and
read back, sweep records, and the provenance every result carries."""
from __future__ import annotations

import datetime
import math
import os
import platform
import shlex
import subprocess
import statistics
import sys
import time
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional

import torch

from mergecomp.plan import is_compressed
from mergecomp.distributed import launch
from .workload import Workload


def exchange_fields(args, optimizer, search_steps: int) -> Dict[str, Any]:
    """What a run of ``compress_benchmark.py``'s flags exchanged, for :func:`report`: the
    compressor, memory and communicator (FP32 allreduce without ``--compress``), the
    scheduler's search, and the plan it settled on."""
    return {
        "compress": args.compress, "compressor": args.compressor if args.compress else "none",
        "compress_ratio": args.compress_ratio, "memory": args.memory if args.compress else "none",
        "comm": args.comm if args.compress else "allreduce", "fusion_num": args.fusion_num,
        "scheduler": args.scheduler, "search_steps": search_steps, "groups": len(optimizer.plan),
        "compressed_groups": sum(is_compressed(g.send) for g in optimizer.plan.groups),
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


# --------------------------------------------------------------------------- provenance --

#: The checkout the benchmarks run from (its commit is part of a result's provenance).
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


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


def save_with_provenance(path: str, data: Dict[str, Any], started: Optional[Dict[str, Any]] = None) -> None:
    """``data`` as indented JSON at ``path`` with its ``provenance`` (``started``, the one
    taken when the run began, or :func:`provenance` now): how the reference and convergence
    tools write a result file."""
    import json
    with open(path, "w") as f:
        json.dump({**data, "provenance": started or provenance()}, f, indent=1)


def record_run(folder: str, argv) -> None:
    """Append this run's :func:`provenance` to ``folder/manifest.json``'s ``runs`` (created
    if absent): a results folder filled by several commands keeps each one."""
    import json
    path = os.path.join(folder, "manifest.json")
    manifest = {"runs": []}
    if os.path.exists(path):
        with open(path) as f:
            manifest = json.load(f)
        if not isinstance(manifest, dict):
            raise ValueError(f"{path} is not a manifest (a JSON object); move it away or pick another folder")
    manifest.setdefault("runs", []).append(provenance(argv))
    with open(path, "w") as f:
        json.dump(manifest, f, indent=2)
