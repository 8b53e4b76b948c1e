"""Joining and leaving the job: the process group's rendezvous with its timeouts and a
clear error when ranks are missing, and a departure that lets the other ranks know why
(an uncaught exception recorded, collective sockets closed, a short linger)."""
from __future__ import annotations

import atexit
import os
import re
import socket
import stat
import sys
import time
import weakref
from datetime import timedelta
from typing import List, Mapping, Optional

import torch
import torch.distributed as dist

from .. import watchdog
from .identity import LOOPBACK, LaunchInfo, detect, free_port


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
    :class:`mergecomp.distributed.watchdog.CollectiveTimeout` naming the ranks behind.  The start-up
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
    _retired_groups.clear()  # the previous session's groups, long idle: destroyed here
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
    rendezvous = max(timeout, _rendezvous_timeout_s()) if separate and not configured else timeout
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


def _rendezvous_timeout_s() -> float:
    """The start-up wait as the user may have set it: the documented setting is the
    package's ``mergecomp.distributed.launch.RENDEZVOUS_TIMEOUT_S`` (defined here, re-exported
    there), so it is read there at each call (the package is loaded: it imported this module)."""
    return sys.modules[__package__].RENDEZVOUS_TIMEOUT_S


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
        waited = (f"The wait was the start-up default (mergecomp.distributed.launch.RENDEZVOUS_TIMEOUT_S); "
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


#: What keeps collectives' handles alive (the backends, weakly): released before the process
#: group is destroyed, so that nothing of the group outlives it (see ``release_before_shutdown``).
_holders: "weakref.WeakSet" = weakref.WeakSet()


#: The process groups :func:`shutdown` destroyed, kept referenced from Python until the next
#: :func:`init_distributed` or the interpreter's exit handlers (after :func:`shutdown`'s
#: own).  A gloo group's worker threads are joined by its C++ destructor, which must run
#: without the GIL: a thread may still be dropping its last collective's tensors, and that
#: needs the GIL.  Dropped from Python,
#: a group is destroyed with the GIL released; dropped last by a C++ owner that holds the
#: GIL (DDP's Reducer, when the DDP model is deleted after the group), the two threads wait
#: on each other forever.  Holding the group here makes Python's reference the last one.
#: Only a group :func:`init_distributed` made is held: its connections are known and shut
#: at leaving, so the peers still learn at once that this rank left; a group made by
#: someone else is left to be destroyed at once, which is how its peers learn it.
_retired_groups: List[object] = []


def _drop_retired_groups() -> None:
    """At exit, while the interpreter still runs: a group left for its teardown can abort
    the process ("terminate called without an active exception")."""
    _retired_groups.clear()


atexit.register(_drop_retired_groups)  # registered first, so it runs after shutdown's handler


def release_before_shutdown(holder) -> None:
    """Have :func:`shutdown` call ``holder.release()`` before it destroys the process group:
    a handle kept past it would keep the group's connections open, and the other ranks would
    wait out their timeout instead of learning at once that this rank left."""
    _holders.add(holder)


def shutdown(linger_s: float = SHUTDOWN_LINGER_S) -> None:
    """Leave the job: record it in this rank's progress beacon and destroy the process group
    at once, without waiting for the other ranks.

    Ranks still waiting in a collective for this one then fail within seconds, with an error
    that says this rank left (:class:`mergecomp.distributed.watchdog.PeerLost`), instead of hanging until
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
        for holder in list(_holders):
            holder.release()
        if _collective_sockets:  # peers learn of the leave from the closed connections
            _retired_groups.append(dist.group.WORLD)
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
