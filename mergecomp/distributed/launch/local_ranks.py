"""Local ranks without a launcher: :func:`spawn` starts ``nprocs`` processes on this machine,
reports the first failure with the child's traceback, and stops the rest."""
from __future__ import annotations

import os
import pickle
import sys
import time
import traceback
import warnings
from dataclasses import dataclass
from multiprocessing.connection import wait
from typing import Any, Callable, List, Optional, Sequence

import torch.multiprocessing as mp

from .identity import LAUNCHER_VARIABLE, LOOPBACK, free_port
from .session import record_uncaught, shutdown


class SpawnedProcessError(RuntimeError):
    """A process started by :func:`spawn` failed.

    ``rank`` is the rank that failed first, ``exitcode`` its exit code (negative: killed by
    that signal), ``child_traceback`` its traceback if it raised, ``also_failed`` the ranks
    that failed after it (usually as a consequence).
    """

    def __init__(self, rank: int, exitcode: Optional[int], child_traceback: Optional[str],
                 also_failed: Sequence[int] = ()):
        self.rank, self.exitcode, self.child_traceback = rank, exitcode, child_traceback
        self.also_failed = list(also_failed)
        if child_traceback:
            what = "raised"
        elif exitcode is not None and exitcode < 0:
            what = f"was killed by signal {-exitcode}"
        else:
            what = f"exited with code {exitcode} without a result"
        after = f" (then ranks {self.also_failed} failed too)" if self.also_failed else ""
        details = f":\n{child_traceback}" if child_traceback else ""
        super().__init__(f"spawned rank {rank} {what}{after}{details}")


#: Seconds a rank may take to exit once every rank's result is in (rank 0 lingers up to
#: ``SHUTDOWN_LINGER_S`` for the others to leave; this is well beyond it).
EXIT_GRACE_S = 60.0


def spawn(fn: Callable[..., Any], nprocs: int, args: Sequence[Any] = (),
          master_port: Optional[int] = None, timeout_s: Optional[float] = None,
          exit_grace_s: float = EXIT_GRACE_S) -> List[Any]:
    """Run ``fn(*args)`` in ``nprocs`` local processes, as ranks of one job; return their results.

    Each process gets RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR=127.0.0.1,
    MASTER_PORT and MERGECOMP_LAUNCHER=spawn, so ``fn`` can call :func:`init_distributed`.
    The port is ``master_port``, else the environment's ``MASTER_PORT`` (a port the job was
    told to use, e.g. one a firewall opens), else a free one; a ``MASTER_PORT`` that is no
    port is refused (ValueError) before any process starts.
    ``fn`` and ``args`` must be picklable (module-level function), as with any "spawn" start.

    When a process raises or dies, the others are terminated (they may be blocked in a
    collective waiting for it) and :class:`SpawnedProcessError` is raised with its rank and
    traceback or exit code.  ``timeout_s`` bounds the whole run (TimeoutError).

    Once every rank has sent its result the work is done; a rank that then does not exit
    within ``exit_grace_s`` (stuck leaving its process group) is terminated with a
    RuntimeWarning naming it, and the results are returned: a hang at the very end of a run
    never blocks the caller.
    """
    if isinstance(nprocs, bool) or not isinstance(nprocs, int) or nprocs < 1:
        raise ValueError(f"nprocs must be a positive integer, got {nprocs!r}")
    if timeout_s is not None and (not isinstance(timeout_s, (int, float)) or timeout_s <= 0):
        raise ValueError(f"timeout_s must be a positive number of seconds or None, got "
                         f"{timeout_s!r}")
    if isinstance(exit_grace_s, bool) or not isinstance(exit_grace_s, (int, float)) or not exit_grace_s > 0:
        raise ValueError(f"exit_grace_s must be a positive number of seconds, got {exit_grace_s!r}")
    port = _environment_port() if master_port is None else master_port
    if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
        raise ValueError(f"master_port must be a TCP port in [1, 65535], got {master_port!r}")
    ctx = mp.get_context("spawn")
    env = {LAUNCHER_VARIABLE: "spawn", "WORLD_SIZE": str(nprocs),
           "LOCAL_WORLD_SIZE": str(nprocs), "MASTER_ADDR": LOOPBACK, "MASTER_PORT": str(port)}
    processes, pipes = [], []
    for rank in range(nprocs):
        receiver, sender = ctx.Pipe(duplex=False)
        child_env = dict(env, RANK=str(rank), LOCAL_RANK=str(rank))
        process = ctx.Process(target=_run_child, args=(fn, tuple(args), child_env, sender),
                              name=f"mergecomp-rank-{rank}")
        process.start()
        sender.close()
        processes.append(process)
        pipes.append(receiver)
    try:
        return _collect(processes, pipes, timeout_s, exit_grace_s=exit_grace_s)
    finally:
        _stop(processes)
        for pipe in pipes:
            pipe.close()


def _environment_port() -> int:
    """``MASTER_PORT`` from the environment when it is set, else a free port."""
    text = os.environ.get("MASTER_PORT", "").strip()
    if not text:
        return free_port()
    try:
        port = int(text)
    except ValueError:
        port = 0
    if not 1 <= port <= 65535:
        raise ValueError(f"MASTER_PORT={os.environ['MASTER_PORT']!r} in the environment is not a TCP port, and "
                         f"spawn's ranks would meet there: set it to a port in [1, 65535], or unset it to let "
                         f"spawn pick a free port")
    return port


def _run_child(fn, args, env, sender) -> None:
    os.environ.update(env)
    try:
        message = ("ok", fn(*args))
    except BaseException as error:  # report everything, SystemExit and KeyboardInterrupt included
        record_uncaught(error)
        message = ("error", traceback.format_exc(), time.time())
    try:
        # Plain pickle, by value: multiprocessing's own pickler would pass tensors as
        # shared-memory handles, which die with this process before the parent opens them.
        # Pickle is safe here: the pipe joins this process to the parent that started it,
        # on the same machine; nothing from another rank or machine is ever unpickled.
        sender.send_bytes(pickle.dumps(message))
    except Exception:  # the result could not be pickled: report that instead
        message = ("error", traceback.format_exc(), time.time())
        sender.send_bytes(pickle.dumps(message))
    sender.close()
    if message[0] == "error":
        os._exit(1)  # skip interpreter teardown, which can block on a broken collective
    shutdown()
    exit_without_teardown(0)


def exit_without_teardown(code: int) -> None:
    """Flush stdout and stderr, then end this rank with ``code`` at once.

    A rank's work is done (its result sent or written) by the time it exits, but the
    interpreter's teardown still destroys the collectives' C++ objects, and a worker
    thread found joinable there aborts the process ("terminate called without an active
    exception", signal 6) after a successful run, rarely and at random.  Skipping the
    teardown makes the exit code the run's own.
    """
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # a closed or broken stream: nothing more can be written anyway
            pass
    os._exit(code)


@dataclass
class _Failure:
    rank: int
    when: float  # wall clock: the earliest failure is the cause, the others its consequences
    child_traceback: Optional[str] = None
    exitcode: Optional[int] = None


def _collect(processes, pipes, timeout_s, settle_s: float = 1.0, exit_grace_s: float = EXIT_GRACE_S) -> List[Any]:
    """Results of every rank, or SpawnedProcessError for the rank that failed first.

    When a rank fails, its peers usually fail a moment later (their collective lost a member);
    waiting ``settle_s`` for their reports lets the error name the rank that failed first.
    Once every result is in, ranks still running after ``exit_grace_s`` are left to
    :func:`_stop`, with a warning.
    """
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    results: dict = {}
    failures: dict = {}
    waiting = {pipe: rank for rank, pipe in enumerate(pipes)}
    running = {process.sentinel: rank for rank, process in enumerate(processes)}
    settle_until = exit_until = None
    while running or waiting:
        now = time.monotonic()
        if settle_until is not None and now >= settle_until:
            break
        if exit_until is not None and now >= exit_until:
            warnings.warn(f"spawned ranks {sorted(running.values())} sent their results but did not exit within "
                          f"{exit_grace_s:g} s (stuck leaving the process group); they were terminated",
                          RuntimeWarning, stacklevel=3)
            break
        if settle_until is None and exit_until is None and deadline is not None and now >= deadline:
            raise TimeoutError(f"spawned ranks {sorted(running.values())} did not finish within "
                               f"{timeout_s}s; they were terminated")
        limits = [t - now for t in (deadline, settle_until, exit_until) if t is not None]
        for ready in wait(list(waiting) + list(running), max(0.0, min(limits)) if limits else None):
            if ready in waiting:
                rank = waiting.pop(ready)
                try:
                    message = pickle.loads(ready.recv_bytes())
                except EOFError:  # closed without a message: the exit code tells what happened
                    continue
                if message[0] == "ok":
                    results[rank] = message[1]
                else:
                    failures.setdefault(rank, _Failure(rank, message[2], message[1]))
            else:
                rank = running.pop(ready)
                processes[rank].join()
        for rank, process in enumerate(processes):
            if process.sentinel in running or pipes[rank] in waiting:
                continue  # still running, or its report is not read yet
            if process.exitcode != 0 or rank not in results:
                failures.setdefault(rank, _Failure(rank, time.time())).exitcode = process.exitcode
        if failures and settle_until is None:
            settle_until = time.monotonic() + settle_s
        elif not failures and exit_until is None and len(results) == len(processes):
            exit_until = time.monotonic() + exit_grace_s
    if failures:
        first = min(failures.values(), key=lambda failure: failure.when)
        others = sorted(rank for rank in failures if rank != first.rank)
        raise SpawnedProcessError(first.rank, first.exitcode, first.child_traceback, others)
    return [results[rank] for rank in range(len(processes))]


def _stop(processes, grace_s: float = 3.0) -> None:
    """Terminate processes still running, then kill those that ignore SIGTERM."""
    for process in processes:
        if process.is_alive():
            process.terminate()
    for process in processes:
        process.join(grace_s)
        if process.is_alive():
            process.kill()
            process.join()
