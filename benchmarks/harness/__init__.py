"""The benchmark harness: what ``compress_benchmark.py`` and every script of ``benchmarks/`` share.

Worker set-up, the timing loop and the report live here once, so mergecomp runs and the
DDP baselines are measured the same way: same models and synthetic batches, same thread
count, same iterations, same statistics, same JSON keys.

The parts: :mod:`.workload` (model, batches, one step), :mod:`.timing` (the timing loop),
:mod:`.results` (fields, statistics, JSON, provenance), :mod:`.running` (modes, exit, ranks),
:mod:`.flags` (``compress_benchmark.py``'s flags and what they build; the DDP baselines),
:mod:`.fsdp` (FSDP2 meshes, sharded models, FSDP2's own bytes).
A script uses them as ``harness.<name>``.
"""
from __future__ import annotations

from .workload import (add_workload_arguments, check_workload_arguments, Progress, Workload,
                       prepare, training_step)
from .timing import (make_timer, operator_profile, interleaved_windows, run_iterations)
from .results import (exchange_fields, report, save_result, finish, saved_results, read_records,
                      latest, ROOT, provenance, record_run, save_with_provenance)
from .running import (run_mode, exit_with, run_workers, value_error_message, NoProcessGroup)
from .flags import (HEADLINE_BASELINE, HEADLINE_MODELS, HEADLINE_LINKS, AllreduceCounter,
                    build_parser, check_arguments, add_rounds_arguments, parse_rounds_arguments,
                    build_compressor, build_scheduler, build_optimizer, warm_up_and_settle,
                    run_or_table, check_names, check_exchange, check_plan, parse_spec)
from . import fsdp

__all__ = ["AllreduceCounter", "HEADLINE_BASELINE", "HEADLINE_LINKS", "HEADLINE_MODELS",
           "NoProcessGroup", "Progress", "ROOT", "Workload", "add_rounds_arguments",
           "add_workload_arguments", "build_compressor", "build_optimizer", "build_parser",
           "build_scheduler", "check_arguments", "check_exchange", "check_names", "check_plan",
           "check_workload_arguments", "exchange_fields", "exit_with", "finish", "fsdp",
           "interleaved_windows", "latest", "make_timer", "operator_profile",
           "parse_rounds_arguments", "parse_spec", "prepare", "provenance", "read_records", "record_run", "report", "save_with_provenance",
           "run_iterations", "run_mode", "run_or_table", "run_workers", "save_result",
           "saved_results", "training_step", "value_error_message", "warm_up_and_settle"]
