#!/usr/bin/env python
"""Benchmark sweeps: a grid of compress_benchmark.py / ``headline.py ddp`` runs on the emulated cluster.

    python benchmarks/sweep.py benchmarks/sweeps/default.yaml [--out DIR] [--dry-run] [--retry-failed]
                               [--rerun LABEL ...]

The YAML file names the grid (see ``benchmarks/sweeps/default.yaml`` for every key)::

    models:      [{name: vgg16, batch_size: 8}, lstm]         # name, optional batch_size
    compressors: [none, fp16, {name: topk, compress_ratio: 0.01, comm: [allgather]}]
    fusion_num:  [0, 1, 2, 4]
    profiles:    [1gbit]                                      # benchmarks/harness/profiles.py names
    workers:     [2]                                          # every count ≥ 2
    baselines:   [{hook: fp32}, {hook: fp16}, {hook: powersgd, rank: 1, bucket_cap_mb: 1000},
                  {hook: mergecomp, compressor: dgc, groups: 4}]      # DDP with mergecomp's hook
    iterations:  {num_warmup_batches: 2, num_batches_per_iter: 2, num_iters: 3}
    threads_per_worker: 1
    timeout_s: 300

Cells: every model × compressor entry × its communicators × fusion_num × profile × workers
(``compress_benchmark.py --compress``), every model × baseline × profile × workers
(``headline.py ddp``), and one single-worker reference per model (``compress_benchmark.py
--nproc 1`` without compression, on this host, no network).  A compressor entry without
``memory``/``comm`` takes the compressor's ``recommended_memory``/``recommended_communicator``
(or, where a compressor lacks them, none/allreduce if it is summable, else residual/allgather).

Multi-worker cells run inside ``Cluster(num_workers=N, profile=...)`` with a fresh cluster per
cell.  A cell is keyed by all of its parameters (iteration counts and threads included); its
result goes as one JSON line to ``DIR/results.jsonl`` as soon as it ends, so an interrupted
sweep resumes where it stopped.  A failed cell (non-zero exit, or killed at ``timeout_s``) is
recorded with its error message and retried only with ``--retry-failed``; ``--rerun LABEL``
measures the cells of that label again (the newest record of a cell is the one that counts).

Scaling factor (written to ``DIR/summary.csv``)::

    scaling_factor = rate_total(N workers) / (N × rate(1 worker))

where ``rate(1 worker)`` is the throughput of the single-worker reference of the SAME model,
batch size, threads per worker and iteration counts, FP32 and uncompressed, from the same
sweep.  1.0 is linear scaling: communication cost nothing.  Threads per worker are the same in
both runs, so the N-worker run has N times the compute of the reference.
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import warnings
from typing import Callable, Iterable, List, Optional

import yaml

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks.harness, run as a file

from benchmarks.harness import latest, read_records

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG_KEYS = {"models", "compressors", "fusion_num", "schedulers", "profiles", "workers", "baselines",
               "iterations", "threads_per_worker", "timeout_s"}
#: ``fixed`` crosses ``fusion_num``; the adaptive schedulers choose their own plan (one cell).
SCHEDULERS = ("fixed", "binary", "auto")
ITERATION_KEYS = ("num_warmup_batches", "num_batches_per_iter", "num_iters")
HOOKS = ("fp32", "fp16", "powersgd", "mergecomp")
SUMMARY_FIELDS = ["model", "kind", "label", "compressor", "compress_ratio", "memory", "comm",
                  "fusion_num", "scheduler", "groups", "compressed_groups", "search_steps", "hook", "powersgd_rank", "bucket_cap_mb", "profile", "workers",
                  "batch_size", "status", "rate_per_worker", "rate_per_worker_ci", "rate_total",
                  "iteration_time_s", "bytes_per_step", "compression_ratio", "scaling_factor",
                  "error"]


class ConfigError(ValueError):
    """The sweep file is wrong; the message names the key, the value and what is expected."""


# ------------------------------------------------------------------------ configuration

def load_config(path: str) -> dict:
    """Read and validate a sweep file; returns the normalised configuration."""
    try:
        with open(path) as f:
            raw = yaml.safe_load(f)
    except OSError as err:
        raise ConfigError(f"cannot read sweep file {path!r}: {err.strerror}") from None
    except yaml.YAMLError as err:
        raise ConfigError(f"sweep file {path!r} is not valid YAML: {err}") from None
    return validate(raw, source=path)


def validate(raw, source: str = "<config>") -> dict:
    """Check every key of a parsed sweep file and fill in defaults."""
    from mergecomp import compressors
    from benchmarks.harness import models
    from benchmarks.harness.profiles import parse_profile

    where = f"sweep file {source!r}"
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: expected a mapping of keys, got {type(raw).__name__}")
    unknown = sorted(set(raw) - CONFIG_KEYS)
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {unknown}; allowed: {sorted(CONFIG_KEYS)}")
    for key in ("models", "profiles", "workers"):
        if not isinstance(raw.get(key), list) or not raw[key]:
            raise ConfigError(f"{where}: '{key}' must be a non-empty list, got {raw.get(key)!r}")

    config = {"models": [], "compressors": [], "baselines": []}
    for entry in raw["models"]:
        entry = {"name": entry} if isinstance(entry, str) else entry
        if not isinstance(entry, dict) or set(entry) - {"name", "batch_size"} or "name" not in entry:
            raise ConfigError(f"{where}: a model entry is a name or {{name, batch_size}}, got {entry!r}")
        spec = _check(lambda: models.get(entry["name"]), where)
        batch = entry.get("batch_size", spec.default_batch_size)
        _positive_int(batch, f"{where}: model {entry['name']!r} batch_size")
        config["models"].append({"name": entry["name"], "batch_size": batch})

    for entry in raw.get("compressors") or []:
        config["compressors"].append(_compressor_entry(entry, where, compressors))
    fusion = raw.get("fusion_num", [1])
    if not isinstance(fusion, list) or not fusion or not all(
            isinstance(f, int) and not isinstance(f, bool) and f >= 0 for f in fusion):
        raise ConfigError(f"{where}: 'fusion_num' must be a list of integers ≥ 0, got {fusion!r}")
    config["fusion_num"] = fusion
    chosen = raw.get("schedulers", ["fixed"])
    if not isinstance(chosen, list) or not chosen or any(s not in SCHEDULERS for s in chosen):
        raise ConfigError(f"{where}: 'schedulers' must be a non-empty list of {list(SCHEDULERS)}, "
                          f"got {chosen!r}")
    config["schedulers"] = chosen

    for name in raw["profiles"]:
        _check(lambda: parse_profile(name), where)
    config["profiles"] = [str(p) for p in raw["profiles"]]
    for n in raw["workers"]:
        if not isinstance(n, int) or isinstance(n, bool) or n < 2:
            raise ConfigError(f"{where}: every 'workers' count must be an integer ≥ 2 (the "
                              f"single-worker reference is added by itself), got {n!r}")
    config["workers"] = raw["workers"]

    for entry in raw.get("baselines") or []:
        entry = {"hook": entry} if isinstance(entry, str) else entry
        allowed = {"hook", "compressor", "memory", "comm", "groups"} if isinstance(entry, dict) and \
            entry.get("hook") == "mergecomp" else {"hook", "rank", "bucket_cap_mb"}
        if not isinstance(entry, dict) or entry.get("hook") not in HOOKS or set(entry) - allowed:
            raise ConfigError(f"{where}: a baseline is {{hook: one of {list(HOOKS)}, rank: R "
                              f"(powersgd only), bucket_cap_mb: MB (optional)}} or {{hook: mergecomp, "
                              f"compressor: NAME, memory, comm (optional), groups: N (default 4)}}, "
                              f"got {entry!r}")
        if entry["hook"] == "mergecomp":
            compressor = entry.get("compressor")
            if not isinstance(compressor, str):
                raise ConfigError(f"{where}: a mergecomp baseline needs 'compressor' (a name), got {entry!r}")
            _check_names(compressor, entry.get("memory"), entry.get("comm"), where)
            groups = entry.get("groups", 4)
            _positive_int(groups, f"{where}: mergecomp baseline 'groups'")
            config["baselines"].append({"hook": "mergecomp", "compressor": compressor,
                                        "memory": entry.get("memory"), "comm": entry.get("comm"),
                                        "groups": groups})
            continue
        cap = entry.get("bucket_cap_mb")
        if cap is not None and (not isinstance(cap, (int, float)) or isinstance(cap, bool) or cap <= 0):
            raise ConfigError(f"{where}: baseline bucket_cap_mb must be a positive number of MB, "
                              f"got {cap!r}")
        rank = entry.get("rank")
        if entry["hook"] == "powersgd":
            _positive_int(rank, f"{where}: powersgd baseline 'rank'")
        elif rank is not None:
            raise ConfigError(f"{where}: 'rank' only applies to the powersgd hook, got {entry!r}")
        config["baselines"].append({"hook": entry["hook"], "rank": rank, "bucket_cap_mb": cap})

    iterations = raw.get("iterations") or {}
    if not isinstance(iterations, dict) or set(iterations) - set(ITERATION_KEYS):
        raise ConfigError(f"{where}: 'iterations' takes {list(ITERATION_KEYS)}, got {iterations!r}")
    config["iterations"] = {"num_warmup_batches": 2, "num_batches_per_iter": 2, "num_iters": 3,
                            **iterations}
    for key, value in config["iterations"].items():
        _positive_int(value, f"{where}: iterations.{key}")
    if any(b["hook"] == "powersgd" for b in config["baselines"]) and \
            config["iterations"]["num_warmup_batches"] < 2:
        raise ConfigError(f"{where}: PowerSGD baselines need iterations.num_warmup_batches ≥ 2 "
                          f"(PyTorch's hook allreduces the first 2 steps uncompressed), got "
                          f"{config['iterations']['num_warmup_batches']}")
    config["threads_per_worker"] = raw.get("threads_per_worker", 1)
    _positive_int(config["threads_per_worker"], f"{where}: threads_per_worker")
    config["timeout_s"] = raw.get("timeout_s", 600)
    if not isinstance(config["timeout_s"], (int, float)) or config["timeout_s"] <= 0:
        raise ConfigError(f"{where}: 'timeout_s' must be a positive number of seconds, got "
                          f"{config['timeout_s']!r}")
    return config


def _compressor_entry(entry, where, compressors) -> dict:
    entry = {"name": entry} if isinstance(entry, str) else entry
    allowed = {"name", "compress_ratio", "memory", "comm"}
    if not isinstance(entry, dict) or "name" not in entry or set(entry) - allowed:
        raise ConfigError(f"{where}: a compressor entry is a name or a mapping with keys "
                          f"{sorted(allowed)}, got {entry!r}")
    cls = _check(lambda: compressors.get(entry["name"]), where)
    summable = getattr(cls, "summable", False)
    memory = entry.get("memory") or getattr(cls, "recommended_memory", None) or \
        ("none" if summable else "residual")
    comm = entry.get("comm") or getattr(cls, "recommended_communicator", None) or \
        ("allreduce" if summable else "allgather")
    comms = comm if isinstance(comm, list) else [comm]
    if not comms or not all(isinstance(c, str) for c in comms):
        raise ConfigError(f"{where}: compressor {entry['name']!r} 'comm' must be a name or a list "
                          f"of names, got {comm!r}")
    ratio = entry.get("compress_ratio")
    if ratio is not None and not (isinstance(ratio, (int, float)) and 0 < ratio <= 1):
        raise ConfigError(f"{where}: compressor {entry['name']!r} compress_ratio must be in (0, 1], "
                          f"got {ratio!r}")
    return {"name": entry["name"], "compress_ratio": ratio, "memory": memory, "comms": comms}


def _check_names(compressor, memory, comm, where) -> None:
    """Every name of a mergecomp baseline is registered (a ConfigError names the bad one)."""
    from mergecomp import communicators, compressors, memories
    _check(lambda: compressors.get(compressor), where)
    if memory is not None:
        _check(lambda: memories.get(memory), where)
    if comm is not None:
        _check(lambda: communicators.get(comm), where)


def _check(thunk, where):
    try:
        return thunk()
    except ValueError as err:
        raise ConfigError(f"{where}: {err}") from None


def _positive_int(value, what: str) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(f"{what} must be an integer ≥ 1, got {value!r}")


# ------------------------------------------------------------------------ cells

def expand(config: dict) -> List[dict]:
    """Every cell of the grid, single-worker references first, then grouped by model."""
    common = {"threads": config["threads_per_worker"], **config["iterations"]}
    cells = []
    for model in config["models"]:
        base = {"model": model["name"], "batch_size": model["batch_size"], **common}
        cells.append({"kind": "single", "profile": "local", "workers": 1, **base})
    for model in config["models"]:
        base = {"model": model["name"], "batch_size": model["batch_size"], **common}
        for profile in config["profiles"]:
            for workers in config["workers"]:
                place = {"profile": profile, "workers": workers, **base}
                for b in config["baselines"]:
                    if b["hook"] == "mergecomp":
                        cells.append({"kind": "ddp", "hook": "mergecomp", "compressor": b["compressor"],
                                      "memory": b["memory"], "comm": b["comm"], "groups": b["groups"], **place})
                        continue
                    cap = {"bucket_cap_mb": b["bucket_cap_mb"]} if b["bucket_cap_mb"] else {}
                    cells.append({"kind": "ddp", "hook": b["hook"], "powersgd_rank": b["rank"], **cap, **place})
                for c in config["compressors"]:
                    for comm in c["comms"]:
                        exchange = {"kind": "mergecomp", "compressor": c["name"],
                                    "compress_ratio": c["compress_ratio"], "memory": c["memory"],
                                    "comm": comm, **place}
                        if "fixed" in config.get("schedulers", ["fixed"]):
                            cells.extend({**exchange, "fusion_num": fusion} for fusion in config["fusion_num"])
                        # "scheduler" is in a cell only when not fixed, so fixed cells keep the keys
                        # of results recorded before the schedulers axis existed.
                        cells.extend({**exchange, "fusion_num": None, "scheduler": s}
                                     for s in config.get("schedulers", ["fixed"]) if s != "fixed")
    # Run order: references and baselines first, then the first two fusion settings of every
    # model before the rest, so that a sweep cut short still compares every model.
    kinds = {"single": 0, "ddp": 1, "mergecomp": 2}
    early = set(config["fusion_num"][:2])
    return sorted(cells, key=lambda c: (kinds[c["kind"]], c.get("fusion_num") not in early))


def cell_key(cell: dict) -> str:
    """A cell's identity: all of its parameters as canonical JSON."""
    return json.dumps(cell, sort_keys=True)


def label(cell: dict) -> str:
    """Short name for progress bars and plots: 'topk', 'ddp-fp32', 'ddp-powersgd-r4', 'single'."""
    if cell["kind"] == "ddp" and cell["hook"] == "mergecomp":
        return f"ddp-mergecomp-{cell['compressor']}-g{cell['groups']}"
    if cell["kind"] == "ddp":
        return f"ddp-{cell['hook']}" + (f"-r{cell['powersgd_rank']}" if cell["hook"] == "powersgd" else "") \
            + (f"-b{cell['bucket_cap_mb']:g}" if cell.get("bucket_cap_mb") else "")
    if cell["kind"] == "single":
        return "single"
    return cell["compressor"]


def command(cell: dict, json_path: str) -> List[str]:
    """The command line that runs ``cell`` (on every worker of the cluster)."""
    iters = [f"--{k.replace('_', '-')}={cell[k]}" for k in ITERATION_KEYS]
    common = ["--model", cell["model"], "--batch-size", str(cell["batch_size"]), *iters,
              "--threads", str(cell["threads"]), "--no-cuda", "--json", json_path]
    if cell["kind"] == "ddp":
        extra = ["--hook", cell["hook"]]
        if cell["hook"] == "mergecomp":
            extra += ["--compressor", cell["compressor"], "--fusion-num", str(cell["groups"])]
            extra += [f"--{k}={cell[k]}" for k in ("memory", "comm") if cell.get(k)]
        if cell["hook"] == "powersgd":
            extra += ["--powersgd-rank", str(cell["powersgd_rank"])]
        if cell.get("bucket_cap_mb"):
            extra += ["--bucket-cap-mb", f"{cell['bucket_cap_mb']:g}"]
        return [sys.executable, os.path.join(ROOT, "benchmarks", "headline.py"), "ddp", *common, *extra]
    script = [sys.executable, os.path.join(ROOT, "compress_benchmark.py"), *common]
    if cell["kind"] == "single":
        return script + ["--nproc", "1"]
    extra = ["--compress", "--compressor", cell["compressor"], "--memory", cell["memory"],
             "--comm", cell["comm"]]
    if cell.get("scheduler", "fixed") == "fixed":
        extra += ["--fusion-num", str(cell["fusion_num"])]
    else:
        extra += ["--scheduler", cell["scheduler"]]
    if cell["compress_ratio"] is not None:
        extra += ["--compress-ratio", str(cell["compress_ratio"])]
    return script + extra


# ------------------------------------------------------------------------ running

def run_cell(cell: dict, timeout_s: float) -> dict:
    """Run one cell for real; returns {"status": "ok", "result": {...}} or {"status": "failed",
    "error": "..."}.  Multi-worker cells run in a fresh emulated cluster."""
    with tempfile.TemporaryDirectory(prefix="mc-sweep-") as tmp:
        json_path = os.path.join(tmp, "result.json")
        argv = command(cell, json_path)
        if cell["workers"] == 1:
            failure, stderr = _run_local(argv, timeout_s)
        else:
            from benchmarks.harness.cluster import Cluster
            try:
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    with Cluster(num_workers=cell["workers"], profile=cell["profile"]) as cluster:
                        results = cluster.run(argv, timeout_s=timeout_s, cwd=ROOT)
            except (RuntimeError, ValueError, OSError) as err:  # ClusterUnavailable and set-up errors
                return {"status": "failed", "error": f"cluster: {err}"}
            for message in {str(w.message) for w in caught} - _WARNED:  # e.g. "no netem": once
                _WARNED.add(message)
                print(f"warning: {message}", file=sys.stderr)
            failure = results.failure
            failed = [r for r in results if r.returncode not in (0, None) and not r.note] or list(results)
            stderr = failed[0].stderr if failure else ""
        if failure is None and os.path.exists(json_path):
            with open(json_path) as f:
                return {"status": "ok", "result": json.load(f)}
        failure = failure or "exited 0 but wrote no JSON result"
        return {"status": "failed", "error": f"{failure}: {error_tail(stderr)}"}


_WARNED: set = set()


def _run_local(argv: List[str], timeout_s: float):
    proc = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            stdin=subprocess.DEVNULL, text=True, start_new_session=True)
    try:
        _, stderr = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        _, stderr = proc.communicate()
        return f"timeout after {timeout_s:g} s", stderr
    return (None if proc.returncode == 0 else f"exited with code {proc.returncode}"), stderr


_C10D_WARNING = re.compile(r"^\[W\d{4} .*\] \[c10d\]")  # e.g. "hostname cannot be retrieved"


def error_tail(stderr: str, lines: int = 6, chars: int = 1200) -> str:
    """The informative end of a failed run's stderr: its last lines, progress bars dropped."""
    kept = [line.strip() for line in stderr.replace("\r", "\n").splitlines()
            if line.strip() and "it/s]" not in line and "s/it]" not in line
            and not _C10D_WARNING.match(line.strip())]
    return " | ".join(kept[-lines:])[-chars:] or "(no error output)"


def run_sweep(cells: List[dict], out: str, timeout_s: float, retry_failed: bool = False,
              runner: Callable[[dict, float], dict] = run_cell, progress: bool = True,
              rerun: Iterable[str] = ()) -> List[dict]:
    """Run the cells not finished yet; append each result to ``out/results.jsonl``.

    ``rerun``: labels (see :func:`label`) of cells to measure again even if finished, e.g. the
    single-worker references after the machine's load changed; the new record supersedes the
    old one, which stays in the file.  Returns the latest record of every cell of ``cells``.
    """
    rerun = set(rerun)
    from tqdm import tqdm

    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, "results.jsonl")
    done = latest(read_records(path))
    todo = [c for c in cells if cell_key(c) not in done or label(c) in rerun
            or (retry_failed and done[cell_key(c)]["status"] != "ok")]
    bar = tqdm(todo, desc="sweep", unit="cell", disable=not progress, file=sys.stderr)
    if progress and len(todo) < len(cells):
        bar.write(f"{len(cells) - len(todo)} of {len(cells)} cells already in {path}; skipped")
    for cell in bar:
        bar.set_postfix_str(f"{cell['model']} {label(cell)} fusion={cell.get('fusion_num', '-')} "
                            f"{cell['profile']} x{cell['workers']}")
        start = time.monotonic()
        outcome = runner(cell, timeout_s)
        record = {"key": cell_key(cell), "cell": cell, "wall_s": round(time.monotonic() - start, 2),
                  "time": time.strftime("%Y-%m-%dT%H:%M:%S"), **outcome}
        if record["status"] != "ok":
            bar.write(f"FAILED {cell['model']} {label(cell)}: {record.get('error')}")
        with open(path, "a") as f:
            f.write(json.dumps(record) + "\n")
        done[record["key"]] = record
    return [done[cell_key(c)] for c in cells]


# ------------------------------------------------------------------------ summary

def reference_key(cell: dict) -> str:
    """What a cell's single-worker reference must share with it."""
    return json.dumps([cell["model"], cell["batch_size"], cell["threads"],
                       *(cell[k] for k in ITERATION_KEYS)])


def summarize(records: List[dict]) -> List[dict]:
    """One summary row per record, with the scaling factor where a reference exists."""
    references = {reference_key(r["cell"]): r["result"]["rate_per_worker"] for r in records
                  if r["cell"]["kind"] == "single" and r["status"] == "ok"}
    rows = []
    for r in records:
        cell, result = r["cell"], r.get("result") or {}
        row = {key: cell.get(key) for key in SUMMARY_FIELDS}
        row.update(kind=cell["kind"], label=label(cell), status=r["status"], error=r.get("error", ""))
        row["scheduler"] = cell.get("scheduler", "fixed" if cell["kind"] == "mergecomp" else None)
        for key in ("rate_per_worker", "rate_per_worker_ci", "rate_total", "iteration_time_s",
                    "bytes_per_step", "compression_ratio", "groups", "compressed_groups", "search_steps"):
            row[key] = result.get(key)
        single = references.get(reference_key(cell))
        if r["status"] == "ok" and single:
            row["scaling_factor"] = result["rate_total"] / (cell["workers"] * single)
        rows.append(row)
    return rows


def write_summary(rows: List[dict], path: str) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=SUMMARY_FIELDS)
        writer.writeheader()
        for row in rows:
            writer.writerow({k: _fmt(row.get(k)) for k in SUMMARY_FIELDS})


def _fmt(value):
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.6g}"
    return value


# ------------------------------------------------------------------------ CLI

def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("config", help="sweep YAML file")
    p.add_argument("--out", default=None,
                   help="results folder (default benchmarks/results/<config name>)")
    p.add_argument("--dry-run", action="store_true", help="print the cells and their commands, run nothing")
    p.add_argument("--retry-failed", action="store_true", help="run failed cells again")
    p.add_argument("--rerun", action="append", default=[], metavar="LABEL",
                   help="measure cells with this label again (single, ddp-fp32, topk, ...); repeatable")
    p.add_argument("--no-plot", action="store_true", help="do not render PNGs after the sweep")
    args = p.parse_args(argv)
    try:
        config = load_config(args.config)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    stem = os.path.splitext(os.path.basename(args.config))[0]
    out = args.out or os.path.join(ROOT, "benchmarks", "results", stem)
    cells = expand(config)
    if args.dry_run:
        done = latest(read_records(os.path.join(out, "results.jsonl")))
        for cell in cells:
            state = done.get(cell_key(cell), {}).get("status", "todo")
            argv = [os.path.relpath(a, ROOT) if a.startswith(ROOT) else a
                    for a in command(cell, "RESULT.json")[1:]]
            print(f"[{state}] {cell['profile']} x{cell['workers']}: python {' '.join(argv)}")
        print(f"{len(cells)} cells, results in {out}")
        return 0
    records = run_sweep(cells, out, config["timeout_s"], retry_failed=args.retry_failed,
                        rerun=args.rerun)
    rows = summarize(records)
    write_summary(rows, os.path.join(out, "summary.csv"))
    failed = sum(r["status"] != "ok" for r in records)
    print(f"{len(records) - failed} cells ok, {failed} failed; summary: {os.path.join(out, 'summary.csv')}")
    if not args.no_plot:
        # the figures in plot.py's own process: matplotlib is the optional 'plots' extra, and
        # plot.py says what to install when it is missing
        subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "plot.py"),
                        os.path.join(out, "summary.csv"), "--out", out])
    return 0


if __name__ == "__main__":
    sys.exit(main())
