#!/usr/bin/env python
"""One prepared GPU session: every check and measurement that needs a GPU, in one command.

    make gpu-check OUT=benchmarks/results/<date>-gpu-check     # on a machine with a GPU
    python benchmarks/gpu_check.py --out DIR                    # the same
    python benchmarks/gpu_check.py --out DIR --dry-run          # a rehearsal on the CPU

It runs with the machine's own python and ``PYTHONPATH=.``: nothing is installed or built
(the native CPU kernels are optional, Triton comes with CUDA builds of torch).  Stages, in
order, each a subprocess with its own time budget; a stage that fails or runs out of time
is recorded and the next one runs:

=================  ===========================================================================
``kernels``        the Triton kernels on the GPU against the CPU paths (bits, index sets, the
                   GPU's rand-k indices against the CPU's) and timed against the torch path
                   (``benchmarks/gpu_kernels.py``)
``cuda-tests``     ``tests/test_cuda.py`` and ``tests/test_triton_kernels.py`` with the
                   interpreter off, split over several pytest processes (one GPU is enough)
``compressors``    ``benchmarks/compressors.py --devices cuda`` at 1M and 25M elements against
                   a clone and ``torch.topk``, with the Triton kernels and with the torch path
``step-profile``   a ResNet-50 and a GPT-2 small training step per compressor, world size 1,
                   bf16 autocast, each timed against a dense twin of the model in
                   alternating steps, and for some compressors the step's operators, kernel
                   launches and host reads (``benchmarks/step_profile.py --operators``)
=================  ===========================================================================

Every result is a file in ``--out``: each stage's own tables and JSON, each command's
output (``<stage>.log``), and ``manifest.json`` (the command, commit, torch, Triton, host,
device, and each stage's status and wall time), rewritten after every stage, so what ran
survives an interrupted session.  The budgets add up to ``--deadline-s`` (430 s, a little over 7
minutes by default), which also caps the last stages when earlier ones overrun.

``--dry-run`` runs every stage's code on CPU tensors at tiny sizes, the Triton kernels in
Triton's interpreter (``TRITON_INTERPRET=1``, ``MERGECOMP_TRITON=interpret``), so the
first GPU session spends its minutes measuring, not debugging.

To add a stage (a scale check with 8 training processes, say), append a :class:`Stage` to
:data:`STAGES` whose ``commands`` returns the processes to run for given :class:`Settings`;
``--stages`` picks a subset by name.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclass(frozen=True)
class Settings:
    """What the stages' commands depend on."""

    out: str
    dry_run: bool
    python: str = sys.executable

    @property
    def device(self) -> str:
        return "cpu" if self.dry_run else "cuda"


@dataclass(frozen=True)
class Command:
    """One process of a stage: its arguments, the file its output goes to (its errors too,
    unless ``errors`` names another), and extra environment."""

    argv: List[str]
    log: str
    env: Dict[str, str] = field(default_factory=dict)
    errors: Optional[str] = None


@dataclass(frozen=True)
class Stage:
    """A named step with a time budget (seconds) and the processes it runs, side by side."""

    name: str
    budget_s: float
    what: str
    commands: Callable[[Settings], List[Command]]


def kernel_commands(settings: Settings) -> List[Command]:
    sizes = "4K" if settings.dry_run else "1M,25M"
    return [Command([settings.python, "benchmarks/gpu_kernels.py", "--device", settings.device, "--sizes", sizes,
                     "--reps", "1" if settings.dry_run else "9", "--out", settings.out], "kernels.log")]


#: Parallel pytest processes of the CUDA tests (16 cores; each test spawns its own ranks);
#: two in a rehearsal.
TEST_WORKERS = 4


def collect_tests(settings: Settings, paths: List[str], selection: Optional[str]) -> List[str]:
    """The node ids pytest would run for ``paths`` (and ``-k selection``)."""
    argv = [settings.python, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *paths]
    if selection:
        argv += ["-k", selection]
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, env=_environment(settings, {}), timeout=300)
    if done.returncode != 0:
        raise RuntimeError(f"pytest could not collect {paths} (exit {done.returncode}): "
                           + " | ".join((done.stdout + done.stderr).strip().splitlines()[-3:]))
    return [line.strip() for line in done.stdout.splitlines() if "::" in line and not line.startswith(" ")]


def test_commands(settings: Settings) -> List[Command]:
    """The CUDA tests, the node ids dealt round-robin to :data:`TEST_WORKERS` pytest processes."""
    paths = ["tests/test_cuda.py", "tests/test_triton_kernels.py"]
    # Rehearsal: test_cuda's tests skip without a GPU; two interpreted kernel tests stand for the rest.
    selection = "test_cuda or (test_packing and 1003-3) or test_the_gpu_draws and 1000-10" if settings.dry_run else None
    ids = collect_tests(settings, paths, selection)
    if not ids:
        raise RuntimeError(f"pytest collected no tests from {paths}")
    workers = min(2 if settings.dry_run else TEST_WORKERS, len(ids))
    return [Command([settings.python, "-m", "pytest", "-q", "-rfEs", "-p", "no:cacheprovider",
                     f"--junitxml={os.path.join(settings.out, f'cuda-tests-{w}.xml')}", *ids[w::workers]],
                    f"cuda-tests-{w}.log") for w in range(workers)]


def compressor_commands(settings: Settings) -> List[Command]:
    if settings.dry_run:
        options = ["--devices", "cpu", "--sizes", "4K", "--reps", "1"]
    else:
        options = ["--devices", "cuda", "--sizes", "1M,25M", "--reps", "7"]
    argv = [settings.python, "benchmarks/compressors.py", *options]
    return [Command(argv, "compressors-triton.md", errors="compressors-triton.log"),
            Command(argv, "compressors-torch.md", env={"MERGECOMP_TRITON": "0"}, errors="compressors-torch.log")]


def profile_commands(settings: Settings) -> List[Command]:
    argv = [settings.python, "benchmarks/step_profile.py", "--device", settings.device, "--out", settings.out]
    if settings.dry_run:
        argv += ["--tiny", "--steps", "1", "--warmup", "0", "--compressors", "qsgd,randk,dgc",
                 "--operators", "1", "--operator-compressors", "none,dgc"]
    else:
        argv += ["--budget-s", "160", "--per-compressor-s", "10", "--operators", "3"]
    return [Command(argv, "step-profile.log")]


STAGES: List[Stage] = [
    Stage("kernels", 60, "Triton kernels against the CPU paths, timed against the torch path", kernel_commands),
    Stage("cuda-tests", 140, "tests/test_cuda.py and tests/test_triton_kernels.py, interpreter off", test_commands),
    Stage("compressors", 50, "compress + decompress at 1M and 25M, Triton and torch paths", compressor_commands),
    Stage("step-profile", 180, "ResNet-50 and GPT-2 small training steps per compressor, and the operators, "
                               "kernel launches and host reads of some", profile_commands),
]

#: Seconds of the deadline a stage needs left to be started at all.
MIN_STAGE_S = 5

#: Stages whose commands run one after the other (timings must not share the GPU).
SEQUENTIAL = {"compressors"}


def _environment(settings: Settings, extra: Dict[str, str]) -> Dict[str, str]:
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    if settings.dry_run:
        env.update(TRITON_INTERPRET="1", MERGECOMP_TRITON="interpret", CUDA_VISIBLE_DEVICES="")
    else:
        env.pop("TRITON_INTERPRET", None)
    env.update(extra)
    return env


def run_commands(stage: Stage, commands: List[Command], settings: Settings, budget_s: float) -> dict:
    """Run a stage's commands (side by side, or in turn for :data:`SEQUENTIAL` stages), each
    writing into its log; the result: status, return codes, wall time."""
    started = time.perf_counter()
    deadline = started + budget_s
    groups = [[c] for c in commands] if stage.name in SEQUENTIAL else [commands]
    codes: Dict[str, object] = {}
    for group in groups:
        running = []
        for command in group:
            log = open(os.path.join(settings.out, command.log), "w")
            errors = open(os.path.join(settings.out, command.errors), "w") if command.errors else None
            settings_line = "".join(f"{key}={value} " for key, value in command.env.items())
            (errors or log).write(f"$ {settings_line}{shlex.join(command.argv)}\n")
            (errors or log).flush()
            process = subprocess.Popen(command.argv, cwd=ROOT, stdout=log, stderr=errors or subprocess.STDOUT,
                                       env=_environment(settings, command.env), start_new_session=True)
            running.append((command, process, [log] + ([errors] if errors else [])))
        for command, process, files in running:
            try:
                codes[command.log] = process.wait(timeout=max(1.0, deadline - time.perf_counter()))
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, 9)  # the command and whatever it spawned
                process.wait()
                codes[command.log] = "killed: over the stage's time budget"
            for file in files:
                file.close()
    wall = time.perf_counter() - started
    timed_out = any(isinstance(code, str) for code in codes.values())
    failed = timed_out or any(code != 0 for code in codes.values())
    status = "timed out" if timed_out else ("failed" if failed else "ok")
    return {"name": stage.name, "what": stage.what, "status": status, "wall_s": round(wall, 1),
            "budget_s": round(budget_s, 1), "exit": codes,
            "files": [name for c in commands for name in (c.log, c.errors) if name]}


def _output(argv: List[str]) -> str:
    try:
        done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=30)
        return done.stdout.strip() if done.returncode == 0 else ""
    except (OSError, subprocess.TimeoutExpired):
        return ""


def manifest(settings: Settings, argv: List[str]) -> dict:
    """The facts a result needs: what ran, on which code, with which software, on what."""
    import torch
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    device = "CPU (dry run)"
    if not settings.dry_run and torch.cuda.is_available():
        driver = _output(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"])
        device = f"{torch.cuda.get_device_name(0)} ({torch.cuda.device_count()} visible" + \
                 (f", driver {driver.splitlines()[0]}" if driver else "") + ")"
    dirty = bool(_output(["git", "status", "--porcelain", "--untracked-files=no"]))
    return {"command": shlex.join(["python", "benchmarks/gpu_check.py", *argv]),
            "commit": _output(["git", "rev-parse", "HEAD"]) + (" (with uncommitted changes)" if dirty else ""),
            "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
            "python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
            "triton": triton_version, "host": f"{platform.node()}, {os.cpu_count()} CPU cores, {platform.platform()}",
            "device": device, "dry_run": settings.dry_run, "stages": []}


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--out", required=True, help="the folder every result is written to")
    parser.add_argument("--dry-run", action="store_true", help="rehearse every stage on the CPU at tiny sizes")
    parser.add_argument("--stages", default=None,
                        help=f"comma-separated stages to run (default all: {','.join(s.name for s in STAGES)})")
    parser.add_argument("--deadline-s", type=float, default=430.0, help="the whole run (default 430 s)")
    args = parser.parse_args(argv)
    names = args.stages.split(",") if args.stages else [s.name for s in STAGES]
    unknown = set(names) - {s.name for s in STAGES}
    if unknown:
        parser.error(f"unknown stages {sorted(unknown)}; choose among {[s.name for s in STAGES]}")
    settings = Settings(out=os.path.abspath(args.out), dry_run=args.dry_run)
    if not settings.dry_run:
        import torch
        if not torch.cuda.is_available():
            parser.error("no CUDA device here: run on a machine with a GPU, or rehearse with --dry-run")
    os.makedirs(settings.out, exist_ok=True)
    started = time.perf_counter()
    record = manifest(settings, argv)
    manifest_path = os.path.join(settings.out, "manifest.json")
    for stage in (s for s in STAGES if s.name in names):
        left = args.deadline_s - (time.perf_counter() - started)
        budget = min(stage.budget_s, left)
        print(f"[{time.perf_counter() - started:5.0f} s] {stage.name}: {stage.what} (budget {budget:.0f} s)", flush=True)
        if left < MIN_STAGE_S:
            result = {"name": stage.name, "what": stage.what, "status": "not run: the deadline was reached"}
        else:
            try:
                result = run_commands(stage, stage.commands(settings), settings, budget)
            except Exception as error:  # a stage that cannot even start is recorded; the next runs
                result = {"name": stage.name, "what": stage.what, "status": f"failed to start: {error}"}
        record["stages"].append(result)
        record["wall_s"] = round(time.perf_counter() - started, 1)
        with open(manifest_path, "w") as f:
            json.dump(record, f, indent=1)
        print(f"[{time.perf_counter() - started:5.0f} s] {stage.name}: {result['status']}"
              + (f" in {result['wall_s']} s" if "wall_s" in result else ""), flush=True)
    failed = [s["name"] for s in record["stages"] if s["status"] != "ok"]
    print(f"done in {time.perf_counter() - started:.0f} s; results in {settings.out}"
          + (f"; not ok: {', '.join(failed)}" if failed else ""), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
