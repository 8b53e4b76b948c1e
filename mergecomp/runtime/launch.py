"""Who am I in the job? Rank and rendezvous discovery for every way mergecomp is launched.

Each launcher tells its processes their place through different environment variables:

============  ===================================================================
launcher      variables read
============  ===================================================================
torchrun      RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR,
              MASTER_PORT (recognised by TORCHELASTIC_RUN_ID)
horovodrun    HOROVOD_RANK, HOROVOD_SIZE, HOROVOD_LOCAL_RANK, HOROVOD_LOCAL_SIZE
              (its Gloo mode).  In its MPI mode horovodrun runs ``mpirun`` and
              the processes see exactly what ``mpirun`` gives them, so they are
              reported as "mpirun"; the backend decides whether to use Horovod.
mpirun        Open MPI: OMPI_COMM_WORLD_RANK, OMPI_COMM_WORLD_SIZE,
              OMPI_COMM_WORLD_LOCAL_RANK, OMPI_COMM_WORLD_LOCAL_SIZE;
              MPICH / Intel MPI (Hydra): PMI_RANK, PMI_SIZE, MPI_LOCALRANKID,
              MPI_LOCALNRANKS
spawn         :func:`spawn` below: RANK, WORLD_SIZE, LOCAL_RANK, ... and
              MERGECOMP_LAUNCHER=spawn
env           RANK and WORLD_SIZE set by any other tool (the ``env://`` convention)
single        nothing: one process, rank 0 of 1
============  ===================================================================

torch.distributed then meets over TCP at MASTER_ADDR:MASTER_PORT.  MPI and Horovod do not set
them, so when every rank is on one machine (local size == world size) MASTER_ADDR defaults to
127.0.0.1; across machines pass them explicitly, e.g. ``mpirun -x MASTER_ADDR=<host of rank 0>
-x MASTER_PORT=<port>``.  Without MASTER_PORT the port is derived from the launcher's job id
(the same number on every rank of one job, different for concurrent jobs), or 29500.

Open MPI refuses to start as root unless told to: ``mpirun --allow-run-as-root`` or
``OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1`` (containers often run as root).
"""
from __future__ import annotations

import atexit
import os
import pickle
import re
import socket
import stat
import sys
import time
import traceback
import zlib
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import wait
from typing import Any, Callable, List, Mapping, Optional, Sequence

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from . import watchdog

LAUNCHERS = ("torchrun", "horovodrun", "mpirun", "spawn", "env", "single")
LAUNCHER_VARIABLE = "MERGECOMP_LAUNCHER"
LOOPBACK = "127.0.0.1"
DEFAULT_PORT = 29500
_DERIVED_PORT_BASE, _DERIVED_PORT_SPAN = 20000, 10000  # below Linux's ephemeral range


@dataclass(frozen=True)
class LaunchInfo:
    """This process's place in the job and where torch.distributed meets.

    ``master_addr``/``master_port`` are None only for a single process with nothing set;
    :func:`init_distributed` then picks 127.0.0.1 and a free port.
    """

    launcher: str
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    master_addr: Optional[str] = None
    master_port: Optional[int] = None


def detect(environ: Optional[Mapping[str, str]] = None) -> LaunchInfo:
    """Read the launcher's variables from ``environ`` (default ``os.environ``).

    Raises ValueError naming the variable and its value when they are not integers or do not
    fit together (rank >= world size, world size < 1, ...), and when a multi-machine MPI or
    Horovod job has no MASTER_ADDR.
    """
    env = dict(os.environ if environ is None else environ)
    if env.get(LAUNCHER_VARIABLE) == "spawn":
        return _from_torch_variables("spawn", env)
    if "TORCHELASTIC_RUN_ID" in env:
        return _from_torch_variables("torchrun", env)
    if "HOROVOD_RANK" in env:
        rendezvous = [env.get(f"HOROVOD_GLOO_RENDEZVOUS_{part}") for part in ("ADDR", "PORT")]
        job_id = ":".join(rendezvous) if all(rendezvous) else None
        return _from_mpi_style("horovodrun", env, "HOROVOD_RANK", "HOROVOD_SIZE",
                               "HOROVOD_LOCAL_RANK", "HOROVOD_LOCAL_SIZE", job_id,
                               how_to_pass="set MASTER_ADDR=<host of rank 0> and "
                                           "MASTER_PORT=<port> in the environment of horovodrun")
    if "OMPI_COMM_WORLD_RANK" in env:
        job_id = env.get("OMPI_MCA_ess_base_jobid") or env.get("PMIX_NAMESPACE")
        return _from_mpi_style("mpirun", env, "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
                               "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE", job_id,
                               how_to_pass="pass -x MASTER_ADDR=<host of rank 0> "
                                           "-x MASTER_PORT=<port> to mpirun")
    if "PMI_RANK" in env:
        return _from_mpi_style("mpirun", env, "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID",
                               "MPI_LOCALNRANKS", env.get("PMI_KVSNAME"),
                               how_to_pass="pass -genv MASTER_ADDR <host of rank 0> "
                                           "-genv MASTER_PORT <port> to mpiexec")
    if "RANK" in env or "WORLD_SIZE" in env:
        return _from_torch_variables("env", env)
    return LaunchInfo("single", 0, 1, 0, 1, env.get("MASTER_ADDR") or None,
                      _port(env, "MASTER_PORT") if env.get("MASTER_PORT") else None)


def _from_torch_variables(launcher: str, env: dict) -> LaunchInfo:
    rank = _integer(env, "RANK")
    world_size = _integer(env, "WORLD_SIZE")
    _check_rank("RANK", rank, "WORLD_SIZE", world_size)
    local_rank = _integer(env, "LOCAL_RANK", default=rank if world_size == 1 else None)
    local_world_size = _integer(env, "LOCAL_WORLD_SIZE",
                                default=world_size if local_rank == rank else None)
    _check_rank("LOCAL_RANK", local_rank, "LOCAL_WORLD_SIZE", local_world_size)
    addr = env.get("MASTER_ADDR") or None
    port = _port(env, "MASTER_PORT") if env.get("MASTER_PORT") else None
    if world_size > 1 and (addr is None or port is None):
        raise ValueError(f"{launcher} launch with WORLD_SIZE={world_size} needs MASTER_ADDR and "
                         f"MASTER_PORT, got MASTER_ADDR={addr!r} MASTER_PORT={port!r}; set both "
                         f"to the host and a free port of rank 0")
    return LaunchInfo(launcher, rank, world_size, local_rank, local_world_size, addr, port)


def _from_mpi_style(launcher: str, env: dict, rank_var: str, size_var: str, local_rank_var: str,
                    local_size_var: str, job_id: Optional[str], how_to_pass: str) -> LaunchInfo:
    rank, world_size = _integer(env, rank_var), _integer(env, size_var)
    _check_rank(rank_var, rank, size_var, world_size)
    local_rank, local_size = _integer(env, local_rank_var), _integer(env, local_size_var)
    _check_rank(local_rank_var, local_rank, local_size_var, local_size)
    if local_size > world_size:
        raise ValueError(f"{local_size_var}={local_size} is larger than {size_var}={world_size}")
    addr = env.get("MASTER_ADDR") or None
    if addr is None:
        if local_size != world_size:
            raise ValueError(
                f"{launcher} started {world_size} ranks on several machines ({local_size} on "
                f"this one) and MASTER_ADDR is not set, so the ranks cannot find each other: "
                f"{how_to_pass}")
        addr = LOOPBACK
    if env.get("MASTER_PORT"):
        port = _port(env, "MASTER_PORT")
    elif job_id:
        port = _DERIVED_PORT_BASE + zlib.crc32(job_id.encode()) % _DERIVED_PORT_SPAN
    else:
        port = DEFAULT_PORT
    return LaunchInfo(launcher, rank, world_size, local_rank, local_size, addr, port)


def _integer(env: dict, name: str, default: Optional[int] = None) -> int:
    raw = env.get(name)
    if raw is None or raw == "":
        if default is not None:
            return default
        raise ValueError(f"environment variable {name} is not set; the launcher must set it "
                         f"(or set it yourself)")
    try:
        return int(raw.strip())
    except ValueError:
        raise ValueError(f"environment variable {name} must be an integer, got {raw!r}") from None


def _check_rank(rank_name: str, rank: int, size_name: str, size: int) -> None:
    if size < 1:
        raise ValueError(f"{size_name} must be at least 1, got {size}")
    if not 0 <= rank < size:
        raise ValueError(f"{rank_name}={rank} must be in [0, {size_name}={size})")


def _port(env: dict, name: str) -> int:
    port = _integer(env, name)
    if not 1 <= port <= 65535:
        raise ValueError(f"{name} must be a TCP port in [1, 65535], got {port}")
    return port


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((LOOPBACK, 0))
        return sock.getsockname()[1]


# ----------------------------------------------------------------------------- init

TIMEOUT_VARIABLE = watchdog.TIMEOUT_VARIABLE
#: How long a collective waits for the slowest rank before it fails, by backend.  The wait
#: covers one step's skew between ranks plus whatever one rank does alone between two
#: collectives (logging, evaluation or checkpointing on rank 0), so it must be longer than
#: that; it also bounds how long the others hang when a rank stops taking part without
#: exiting.  One minute keeps a stopped CPU job from hanging for torch's default 30 minutes
#: while leaving room for slow steps of large models on CPUs.  NCCL jobs keep five minutes:
#: NCCL sets its communicators up lazily, at the first collective, which takes longer at
#: scale, and a NCCL timeout aborts the process rather than raising.
DEFAULT_TIMEOUT_S = {"gloo": 60.0, "mpi": 60.0, "nccl": 300.0}
#: Ranks meet at start-up under a separate, longer limit when no timeout is configured:
#: processes of one job can start minutes apart (containers pulled on several machines, a
#: slow shared file system).  A timeout given as ``timeout_s=`` or MERGECOMP_TIMEOUT bounds
#: the start-up too, so that a job started with too few processes fails as soon as asked.
RENDEZVOUS_TIMEOUT_S = 300.0
#: How long :func:`shutdown` on the rank that hosts the rendezvous store (rank 0) keeps the
#: store up for ranks still reading it (their own shutdown, the progress of the ranks when
#: their last collective failed), at most.
SHUTDOWN_LINGER_S = 10.0


def collective_timeout(timeout_s: Optional[float] = None, backend: str = "gloo",
                       environ: Optional[Mapping[str, str]] = None) -> float:
    """The collective timeout to use: ``timeout_s`` if given, else the MERGECOMP_TIMEOUT
    environment variable (seconds), else :data:`DEFAULT_TIMEOUT_S` for ``backend``."""
    if timeout_s is not None:
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) \
                or not 0 < timeout_s < float("inf"):
            raise ValueError(f"timeout_s must be a positive number of seconds, got {timeout_s!r}")
        return float(timeout_s)
    env = os.environ if environ is None else environ
    raw = env.get(TIMEOUT_VARIABLE, "").strip()
    if raw:
        try:
            value = float(raw)
        except ValueError:
            value = float("nan")
        if not 0 < value < float("inf"):
            raise ValueError(f"environment variable {TIMEOUT_VARIABLE} must be a positive number "
                             f"of seconds, got {env[TIMEOUT_VARIABLE]!r}; e.g. "
                             f"{TIMEOUT_VARIABLE}=120")
        return value
    return DEFAULT_TIMEOUT_S.get(backend, DEFAULT_TIMEOUT_S["gloo"])


def init_distributed(backend: Optional[str] = None, timeout_s: Optional[float] = None,
                     device: Optional[str] = None) -> LaunchInfo:
    """Detect the launch and initialise the default torch.distributed process group.

    ``backend`` None means "gloo", unless ``device`` is a CUDA device and CUDA is available,
    then "nccl" (with each process pinned to GPU ``local_rank`` of its machine).  A single
    process still gets a 1-rank group on 127.0.0.1 and a free port, so that code paths are the
    same for one and many ranks.  MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE, LOCAL_RANK and
    LOCAL_WORLD_SIZE are exported for code that reads them.  Calling it again once the group
    exists only returns the launch info.

    ``timeout_s`` bounds every collective's wait for the other ranks (see
    :func:`collective_timeout`: default from MERGECOMP_TIMEOUT, else
    :data:`DEFAULT_TIMEOUT_S`); a collective that runs out of it raises
    :class:`mergecomp.runtime.watchdog.CollectiveTimeout` naming the ranks behind.  The start-up
    rendezvous waits as long when ``timeout_s`` or MERGECOMP_TIMEOUT is given, else
    :data:`RENDEZVOUS_TIMEOUT_S`; ranks that do not all meet in that time raise
    :class:`RendezvousError`, saying how many joined.  :func:`shutdown` is registered to
    run at interpreter exit, so a rank whose script ends leaves the group at once and the
    others fail within seconds instead of waiting; an exception that ends the script is
    recorded first (:func:`record_uncaught`), so their errors name it.
    """
    global _initialised_info
    if dist.is_initialized() and _initialised_info is not None:
        return _initialised_info
    info = detect()
    if dist.is_initialized():  # by someone else: check it agrees with the launch
        if dist.get_rank() != info.rank or dist.get_world_size() != info.world_size:
            raise RuntimeError(
                f"torch.distributed is already initialised as rank {dist.get_rank()} of "
                f"{dist.get_world_size()}, but the {info.launcher} launch says rank "
                f"{info.rank} of {info.world_size}")
        return info
    backend = _choose_backend(backend, device, info)
    timeout = collective_timeout(timeout_s, backend)
    configured = timeout_s is not None or bool(os.environ.get(TIMEOUT_VARIABLE, "").strip())
    if info.master_addr is None or info.master_port is None:  # only a single process
        info = LaunchInfo(info.launcher, info.rank, info.world_size, info.local_rank,
                          info.local_world_size, LOOPBACK, free_port())
    os.environ.update(MASTER_ADDR=info.master_addr, MASTER_PORT=str(info.master_port),
                      RANK=str(info.rank), WORLD_SIZE=str(info.world_size),
                      LOCAL_RANK=str(info.local_rank),
                      LOCAL_WORLD_SIZE=str(info.local_world_size))
    # torch.distributed has one timeout for the rendezvous and the collectives; where it
    # can change the collectives' afterwards (gloo and NCCL groups) and no timeout was
    # configured, the rendezvous gets the longer default.
    set_timeout = getattr(dist.distributed_c10d, "_set_pg_timeout", None)
    separate = set_timeout is not None and backend in ("gloo", "nccl")
    rendezvous = max(timeout, RENDEZVOUS_TIMEOUT_S) if separate and not configured else timeout
    sockets_before = _open_sockets()
    try:
        dist.init_process_group(backend, init_method="env://", rank=info.rank,
                                world_size=info.world_size, timeout=timedelta(seconds=rendezvous))
    except Exception as error:
        clearer = _rendezvous_error(error, info, rendezvous, configured)
        if clearer is None:
            raise
        raise clearer from error
    if rendezvous != timeout:
        set_timeout(timedelta(seconds=timeout))
    _collective_sockets[:] = _peer_sockets(_open_sockets() - sockets_before, info.master_port)
    watchdog.configured_timeout_s = timeout
    _initialised_info = info
    _register_exit_handler()
    return info


class RendezvousError(RuntimeError):
    """The ranks did not all meet when the job started.

    ``joined`` is how many ranks reached the rendezvous (None when this rank could not
    tell: it did not reach the rendezvous itself), ``expected`` the world size.
    """

    def __init__(self, message: str, joined: Optional[int], expected: int):
        super().__init__(message)
        self.joined, self.expected = joined, expected


def _rendezvous_error(error: BaseException, info: LaunchInfo, waited_s: float,
                      configured: bool) -> Optional[RendezvousError]:
    """What a failed ``init_process_group`` means when not every rank came: how many joined,
    and how to start the job right (None for other errors)."""
    text = str(error)
    if not re.search(r"timed? ?out|timeout|joined|connect", text, re.IGNORECASE):
        return None
    where = f"{info.master_addr}:{info.master_port}"
    count = re.search(r"(\d+)\s*/\s*(\d+) clients joined", text)
    script = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else "train.py"
    fix = (f"Start WORLD_SIZE={info.world_size} processes, RANK 0 to {info.world_size - 1} "
           f"once each with the same MASTER_ADDR and MASTER_PORT (e.g. {_interpreter()} -m "
           f"torch.distributed.run --nproc_per_node {info.world_size} {script}), or set "
           f"WORLD_SIZE to the number of processes started.")
    if count is not None:
        joined = int(count.group(1))
        head = (f"{joined} of the {info.world_size} ranks the job expects (WORLD_SIZE="
                f"{info.world_size}) joined the rendezvous at {where} within {waited_s:g}s.")
    else:
        joined = None
        head = (f"rank {info.rank} of {info.world_size} did not meet the other ranks at {where} "
                f"within {waited_s:g}s: the rank hosting the rendezvous (rank 0) or some other "
                f"rank did not start, or was given another MASTER_ADDR, MASTER_PORT or "
                f"WORLD_SIZE.")
    if configured:
        waited = (f"The wait was the configured timeout ({TIMEOUT_VARIABLE} or timeout_s=); "
                  f"raise it if the ranks start far apart.")
    else:
        waited = (f"The wait was the start-up default (mergecomp.runtime.launch.RENDEZVOUS_TIMEOUT_S); "
                  f"set {TIMEOUT_VARIABLE}=<seconds> or init_distributed(timeout_s=...) to "
                  f"fail sooner.")
    first_line = text.strip().splitlines()[0] if text.strip() else "-"
    return RendezvousError(f"{head} {fix} {waited} ({type(error).__name__} from torch."
                           f"distributed: {first_line})", joined, info.world_size)


def _interpreter() -> str:
    """This Python as a user would type it: relative to the working directory when it lives
    below it (``.venv/bin/python``), else its full path."""
    executable = sys.executable or "python"
    relative = os.path.relpath(executable) if os.path.isabs(executable) else executable
    if relative.startswith(os.pardir):
        return executable
    return relative if os.sep in relative else os.path.join(os.curdir, relative)


# ----------------------------------------------------------------------------- leaving

#: This process's connections to the other ranks' collectives (file descriptor, inode),
#: found when init_distributed made the group.  :func:`shutdown` closes them: objects that
#: still hold the process group (a DDP model, an exception's traceback) keep them open
#: otherwise, and peers waiting on them would not learn that this rank left.
_collective_sockets: List[tuple] = []


def _open_sockets() -> set:
    """(descriptor, inode) of every socket this process has open; empty where the system
    does not list a process's descriptors."""
    for folder in ("/proc/self/fd", "/dev/fd"):
        try:
            names = os.listdir(folder)
        except OSError:
            continue
        found = set()
        for name in names:
            try:
                status = os.fstat(int(name))
            except (OSError, ValueError):
                continue
            if stat.S_ISSOCK(status.st_mode):
                found.add((int(name), status.st_ino))
        return found
    return set()


def _peer_sockets(candidates: set, store_port: Optional[int]) -> List[tuple]:
    """The TCP connections among ``candidates`` that lead to another process, except the
    rendezvous store's (at ``store_port``): the collectives' connections."""
    kept = []
    for fd, inode in sorted(candidates):
        try:
            with socket.socket(fileno=os.dup(fd)) as sock:
                if sock.family not in (socket.AF_INET, socket.AF_INET6):
                    continue
                local, peer = sock.getsockname()[1], sock.getpeername()[1]
        except OSError:  # closed meanwhile, or listening (no peer)
            continue
        if store_port not in (local, peer):
            kept.append((fd, inode))
    return kept


def _close_collective_sockets() -> None:
    """Shut the collectives' connections down, so that peers waiting on them fail at once."""
    for fd, inode in _collective_sockets:
        try:
            if os.fstat(fd).st_ino != inode:
                continue  # the descriptor was closed and reused for something else
            with socket.socket(fileno=os.dup(fd)) as sock:
                sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            continue
    _collective_sockets.clear()


def record_uncaught(error: BaseException) -> None:
    """Record in this rank's progress beacon that ``error`` ends its script, so that the
    ranks whose collectives then fail say "rank 1 raised ValueError('...')" instead of
    "rank 1 left".  Run by the exception hook :func:`init_distributed` installs, and by
    :func:`spawn`'s processes."""
    for beacon in watchdog.beacons():
        beacon.raised(error)


_initialised_info: Optional[LaunchInfo] = None  # what init_distributed set up, for repeat calls
_exit_handler_registered = False


def _register_exit_handler() -> None:
    """Leave the job when the script ends: at interpreter exit, and, for an exception that
    ends it, right after its traceback is printed, having recorded the exception first."""
    global _exit_handler_registered
    if not _exit_handler_registered:
        atexit.register(shutdown)
        previous = sys.excepthook

        def leave_on_uncaught(kind, error, trace):
            record_uncaught(error)
            previous(kind, error, trace)
            shutdown()

        sys.excepthook = leave_on_uncaught
        _exit_handler_registered = True


def shutdown(linger_s: float = SHUTDOWN_LINGER_S) -> None:
    """Leave the job: record it in this rank's progress beacon and destroy the process group
    at once, without waiting for the other ranks.

    Ranks still waiting in a collective for this one then fail within seconds, with an error
    that says this rank left (:class:`mergecomp.runtime.watchdog.PeerLost`), instead of hanging until
    their timeout.  At the end of training every rank has completed the same collectives, so
    nothing is lost by not waiting.  The rank hosting the rendezvous store (rank 0, unless
    torchrun's agent hosts it) keeps the store up after destroying its group until every rank
    has left, at most ``linger_s`` seconds, so that the others can still record their exit
    and read why a collective failed.

    :func:`init_distributed` registers this to run at interpreter exit; calling it earlier
    is fine, and calling it again does nothing.  Leaving the interpreter with a live gloo
    group can abort the process ("terminate called without an active exception") when its
    threads are destroyed mid-flight, which this avoids.
    """
    global _initialised_info
    if dist.is_available() and dist.is_initialized():
        beacons = watchdog.beacons()
        for beacon in beacons:
            beacon.leave()
        hosts_store = (dist.get_rank() == 0
                       and os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() != "true")
        world_size = dist.get_world_size()
        dist.destroy_process_group()
        _close_collective_sockets()
        if hosts_store and world_size > 1 and beacons:
            deadline = time.monotonic() + linger_s
            while time.monotonic() < deadline and not all(_everyone_left(b) for b in beacons):
                time.sleep(0.05)
    watchdog.forget_beacons()
    _initialised_info = None


def _everyone_left(beacon: "watchdog.Beacon") -> bool:
    """Whether every rank of the beacon's group has left (or its store is gone)."""
    count = beacon.left_count()
    return count is None or count >= beacon.world_size


def _choose_backend(backend: Optional[str], device: Optional[str], info: LaunchInfo) -> str:
    wants_cuda = device is not None and torch.device(device).type == "cuda"
    if wants_cuda and not torch.cuda.is_available():
        raise ValueError(f"device={device!r} was asked for but torch.cuda.is_available() is "
                         f"False; use device='cpu' or run on a machine with a GPU")
    if backend is None:
        backend = "nccl" if wants_cuda else "gloo"
    if backend not in ("gloo", "nccl", "mpi"):
        raise ValueError(f"backend must be 'gloo', 'nccl' or 'mpi', got {backend!r}")
    if backend == "nccl":
        if not torch.cuda.is_available():
            raise ValueError("backend='nccl' needs CUDA, but torch.cuda.is_available() is "
                             "False; use backend='gloo'")
        torch.cuda.set_device(info.local_rank % torch.cuda.device_count())
    return backend


# ----------------------------------------------------------------------------- spawn

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


def spawn(fn: Callable[..., Any], nprocs: int, args: Sequence[Any] = (),
          master_port: Optional[int] = None, timeout_s: Optional[float] = None) -> List[Any]:
    """Run ``fn(*args)`` in ``nprocs`` local processes, as ranks of one job; return their results.

    Each process gets RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR=127.0.0.1,
    MASTER_PORT and MERGECOMP_LAUNCHER=spawn, so ``fn`` can call :func:`init_distributed`.
    ``fn`` and ``args`` must be picklable (module-level function), as with any "spawn" start.

    When a process raises or dies, the others are terminated (they may be blocked in a
    collective waiting for it) and :class:`SpawnedProcessError` is raised with its rank and
    traceback or exit code.  ``timeout_s`` bounds the whole run (TimeoutError).
    """
    if isinstance(nprocs, bool) or not isinstance(nprocs, int) or nprocs < 1:
        raise ValueError(f"nprocs must be a positive integer, got {nprocs!r}")
    if timeout_s is not None and (not isinstance(timeout_s, (int, float)) or timeout_s <= 0):
        raise ValueError(f"timeout_s must be a positive number of seconds or None, got "
                         f"{timeout_s!r}")
    port = free_port() if master_port is None else master_port
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
        return _collect(processes, pipes, timeout_s)
    finally:
        _stop(processes)
        for pipe in pipes:
            pipe.close()


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


def _collect(processes, pipes, timeout_s, settle_s: float = 1.0) -> List[Any]:
    """Results of every rank, or SpawnedProcessError for the rank that failed first.

    When a rank fails, its peers usually fail a moment later (their collective lost a member);
    waiting ``settle_s`` for their reports lets the error name the rank that failed first.
    """
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    results: dict = {}
    failures: dict = {}
    waiting = {pipe: rank for rank, pipe in enumerate(pipes)}
    running = {process.sentinel: rank for rank, process in enumerate(processes)}
    settle_until = None
    while running or waiting:
        now = time.monotonic()
        if settle_until is not None and now >= settle_until:
            break
        if settle_until is None and deadline is not None and now >= deadline:
            raise TimeoutError(f"spawned ranks {sorted(running.values())} did not finish within "
                               f"{timeout_s}s; they were terminated")
        limits = [t - now for t in (deadline, settle_until) if t is not None]
        for ready in wait(list(waiting) + list(running), min(limits) if limits else None):
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
