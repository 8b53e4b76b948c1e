"""Bounded waiting: when a collective fails, say which ranks did not arrive and where they were.

A collective waits for every rank of the group.  When one rank stops taking part — it
crashed, was killed, left its training loop early, or is stuck in work of its own — the
others block until the process group's timeout (see :func:`mergecomp.distributed.launch.init_distributed`)
or until the network library notices that the rank's connections closed.  What the
network library then reports ("Timed out waiting 60000ms for recv", "Connection closed
by peer [10.0.0.7]:41234") names no rank and no step.

Each rank therefore keeps a small *progress beacon* in the process group's key-value
store (the one ``torch.distributed`` rendezvoused through, hosted by rank 0's process or
by torchrun's agent): one key per rank holding the last step it started, how many
collectives it had issued by then, whether it is running, has left the job
(:func:`mergecomp.distributed.launch.shutdown`, also run at interpreter exit) or has failed, and
when.  Writing it costs one small store request per step.  When a collective fails, the
backend reads every rank's beacon and raises :class:`CollectiveTimeout` or
:class:`PeerLost` naming the ranks that are behind, where they last were, and what to do.

Which step a rank is in comes from whoever drives the steps: the reducer calls
``backend.mark_step(step)`` once per step, before the step's first collective.
"""
from __future__ import annotations

import json
import os
import re
import socket
import time
from dataclasses import dataclass
from typing import Any, Dict, List, Optional

KEY_PREFIX = "mergecomp/progress"
TIMEOUT_VARIABLE = "MERGECOMP_TIMEOUT"

RUNNING, LEFT, FAILED, RAISED = "running", "left", "failed", "raised"

# What gloo (and the TCP store) say when a wait ran out of time, and when a peer went away.
_TIMEOUT = re.compile(r"timed? ?out|timeout", re.IGNORECASE)
_PEER_GONE = re.compile(r"connection (closed|reset)|closed by peer|broken pipe|"
                        r"connection refused|pair closure|peer .*(closed|gone)|"
                        r"was aborted|aborted", re.IGNORECASE)

#: The collective timeout init_distributed configured, for the messages (None: unknown).
configured_timeout_s: Optional[float] = None


class CollectiveError(RuntimeError):
    """A collective failed because some rank did not take part.

    ``op`` is the collective, ``step`` this rank's step (None when no step was marked),
    ``behind`` the ranks found not to have kept up, ``progress`` what every rank last
    reported (rank → :class:`Progress`, None for a rank that reported nothing; empty when
    the store could not be read).
    """

    def __init__(self, message: str, op: str = "", step: Optional[int] = None,
                 behind: Optional[List[int]] = None,
                 progress: Optional[Dict[int, Optional["Progress"]]] = None):
        super().__init__(message)
        self.op, self.step = op, step
        self.behind = list(behind or [])
        self.progress = dict(progress or {})


class CollectiveTimeout(CollectiveError):
    """A collective waited longer than the process group's timeout."""


class PeerLost(CollectiveError):
    """A peer's connection closed in the middle of a collective: it exited or crashed."""


@dataclass
class Progress:
    """What one rank last wrote into its beacon."""

    rank: int
    state: str                 # RUNNING, LEFT, FAILED, or RAISED (an uncaught exception)
    step: Optional[int]        # the last step it started (None: none marked yet)
    collectives: int           # collectives it had issued when it marked that step
    time: float                # its wall clock when it wrote this
    host: str = ""
    pid: int = 0
    note: str = ""             # why it failed; for RAISED, the exception

    def describe(self, now: float) -> str:
        where = "before its first step" if self.step is None else f"at step {self.step}"
        ago = f", {max(0.0, now - self.time):.0f}s ago" if self.time else ""
        origin = f" ({self.host}, pid {self.pid})" if self.host else ""
        if self.state == LEFT:
            what = (f"left the job {where}{ago}: its script ended or called "
                    f"mergecomp.distributed.launch.shutdown()")
        elif self.state == RAISED:
            what = (f"raised {self.note} {where}{ago}, which ended its script (its log has "
                    f"the traceback)")
        elif self.state == FAILED:
            what = f"failed {where}{ago}: {self.note}"
        else:
            what = f"last reported {where} (after {self.collectives} collectives){ago}"
        return f"rank {self.rank}{origin} {what}"


class Beacon:
    """One rank's progress record in a torch.distributed store, and its view of the others'.

    Every write is best-effort: a store that cannot be reached (its host, rank 0, has
    exited) is not an error of its own — the collectives report it — so after the first
    failure the beacon stops writing.
    """

    def __init__(self, store, rank: int, world_size: int, prefix: str = KEY_PREFIX):
        self.store, self.rank, self.world_size, self.prefix = store, rank, world_size, prefix
        self.step: Optional[int] = None
        self.collectives = 0
        self.state = RUNNING
        self.note = ""
        self.unreachable: Optional[str] = None
        self._host, self._pid = socket.gethostname(), os.getpid()
        self._write()

    def key(self, rank: int) -> str:
        return f"{self.prefix}/{rank}"

    # -- this rank ------------------------------------------------------------------------
    def mark(self, step: int, collectives: int = 0) -> None:
        """Record that this rank starts ``step`` having issued ``collectives`` collectives."""
        self.step, self.collectives = step, collectives
        self._write()

    def fail(self, note: str) -> None:
        """Record that this rank failed (the first line of ``note`` is kept)."""
        if self.state != FAILED:
            self.state, self.note = FAILED, note.strip().splitlines()[0][:300] if note.strip() else ""
            self._write()

    def raised(self, error: BaseException) -> None:
        """Record that an exception ends this rank's script, e.g. ``ValueError('bad batch')``
        (kept unless the rank already failed or left: then ``error`` came after that)."""
        if self.state == RUNNING:
            self.state, self.note = RAISED, describe_exception(error)
            self._write()

    def leave(self) -> None:
        """Record that this rank leaves the job (a failed rank stays failed) and count it."""
        if self.state == RUNNING:
            self.state = LEFT
            self._write()
        if self.unreachable is None:
            try:
                self.store.add(f"{self.prefix}/left", 1)
            except Exception as error:  # the store's host is gone: nothing left to tell
                self.unreachable = f"{type(error).__name__}: {error}"

    def left_count(self) -> Optional[int]:
        """How many ranks have left (None when the store cannot be reached)."""
        try:
            return int(self.store.add(f"{self.prefix}/left", 0))
        except Exception:
            return None

    def _write(self) -> None:
        if self.unreachable is not None:
            return
        record = {"state": self.state, "step": self.step, "collectives": self.collectives,
                  "time": time.time(), "host": self._host, "pid": self._pid, "note": self.note}
        try:
            self.store.set(self.key(self.rank), json.dumps(record))
        except Exception as error:
            self.unreachable = f"{type(error).__name__}: {error}"

    # -- every rank -----------------------------------------------------------------------
    def read(self) -> Dict[int, Optional[Progress]]:
        """Every rank's last record (None for a rank that wrote none).  Raises what the
        store raises when it cannot be reached."""
        keys = [self.key(r) for r in range(self.world_size)]
        if self.store.check(keys):
            values = self.store.multi_get(keys)
        else:  # some rank never wrote: read the others one by one, without blocking
            values = [self.store.get(k) if self.store.check([k]) else None for k in keys]
        return {r: None if raw is None else _parse(r, raw) for r, raw in enumerate(values)}


def describe_exception(error: BaseException, limit: int = 300) -> str:
    """``ValueError('bad batch')``: the type and the first line of the message, short."""
    lines = str(error).strip().splitlines()
    text = f"{type(error).__name__}({lines[0] if lines else ''!r})"
    return text if len(text) <= limit else text[:limit - 4] + "...)"


def _parse(rank: int, raw) -> Optional[Progress]:
    try:
        data = json.loads(bytes(raw).decode())
        return Progress(rank, data["state"], data["step"], int(data["collectives"]),
                        float(data["time"]), data.get("host", ""), int(data.get("pid", 0)),
                        data.get("note", ""))
    except (ValueError, KeyError, TypeError):
        return None


# ----------------------------------------------------------------------------- explaining

def classify(error: BaseException) -> Optional[type]:
    """CollectiveTimeout or PeerLost for what a network library raised, None for others."""
    if not isinstance(error, RuntimeError) or isinstance(error, CollectiveError):
        return None
    text = str(error)
    if _TIMEOUT.search(text):
        return CollectiveTimeout
    if _PEER_GONE.search(text):
        return PeerLost
    return None


def explain(error: BaseException, op: str, beacon: Optional[Beacon], rank: int, world_size: int,
            collectives: int) -> Optional[CollectiveError]:
    """The :class:`CollectiveError` that says what ``error`` (raised by collective ``op``,
    this rank's ``collectives``-th) means, or None when it is not a timeout or a lost peer.

    Reads every rank's beacon (a few store requests) and marks this rank failed in its own.
    """
    kind = classify(error)
    if kind is None:
        return None
    step = beacon.step if beacon is not None else None
    within = (f", collective {collectives - beacon.collectives} of step {step}"
              if beacon is not None and step is not None else f", its collective #{collectives}")
    where = f"{op} (rank {rank} of {world_size}{within})"
    timeout = configured_timeout_s if configured_timeout_s is not None else _timeout_in(error)
    if kind is CollectiveTimeout:
        waited = f" after {timeout:g}s" if timeout is not None else ""
        head = f"{where} timed out{waited}: not every rank took part."
    else:
        head = (f"{where} lost a peer: a rank's connection closed in the middle of the "
                f"collective, so that rank exited or crashed.")
    progress: Dict[int, Optional[Progress]] = {}
    unreadable = None
    if beacon is not None:
        beacon.fail(f"{kind.__name__} in {op}" + (f" at step {step}" if step is not None else ""))
        try:
            progress = beacon.read()
        except Exception as read_error:
            unreadable = f"{type(read_error).__name__}: {str(read_error).splitlines()[0]}"
    behind = _behind(progress, rank, step) if progress else []
    lines = [head]
    if beacon is None:
        lines.append("This backend keeps no progress record, so the ranks behind cannot be named.")
    elif unreadable is not None:
        lines.append(f"The ranks' progress could not be read: the store that holds it (hosted by "
                     f"rank 0's process, or torchrun's agent) is unreachable ({unreadable}); "
                     f"rank 0 has probably exited — its log says why.")
    else:
        now = time.time()
        others = [r for r in range(world_size) if r != rank]
        if behind:
            lines.append(f"Ranks behind: {behind}.")
        for r in others:
            record = progress.get(r)
            lines.append("  " + (record.describe(now) if record is not None else
                                 f"rank {r} never reported progress: it has not built its "
                                 f"backend yet, or it is stuck (or died) before that"))
    lines.append(_advice(kind, progress, behind, rank, step, timeout))
    lines.append(f"({type(error).__name__} from the network library: "
                 f"{str(error).strip().splitlines()[0] if str(error).strip() else '-'})")
    return kind("\n".join(lines), op=op, step=step, behind=behind, progress=progress)


def _is_consequence(record: Progress) -> bool:
    """A rank that failed because a collective failed on it too (not the cause)."""
    return record.state == FAILED and record.note.startswith(
        (CollectiveTimeout.__name__, PeerLost.__name__))


def _behind(progress: Dict[int, Optional[Progress]], rank: int, step: Optional[int]) -> List[int]:
    """Ranks that left, failed first, never reported, or are at an earlier step."""
    behind = []
    for r, record in sorted(progress.items()):
        if r == rank:
            continue
        earlier = step is not None and record is not None and (record.step is None
                                                                or record.step < step)
        if record is None or record.state == LEFT or earlier:
            behind.append(r)
        elif record.state in (FAILED, RAISED) and not _is_consequence(record):
            behind.append(r)
    return behind


def _advice(kind, progress, behind, rank, step, timeout) -> str:
    records = {r: p for r, p in progress.items() if p is not None and r != rank}
    left = [r for r in behind if r in records and records[r].state == LEFT]
    raised = [r for r in behind if r in records and records[r].state == RAISED]
    failed = [r for r in behind if r in records and records[r].state == FAILED
              and not _is_consequence(records[r])]
    silent = [r for r in behind if r not in records]
    lagging = [r for r in behind if r not in left + raised + failed + silent]
    advice = []
    if left:
        advice.append(f"Ranks {left} left while this rank was still training: every rank must "
                      f"run the same number of steps (the same number of batches: shard the "
                      f"data evenly, e.g. DistributedSampler with drop_last=True).")
    if raised:
        advice.append(f"Ranks {raised} raised an exception that ended their script: the "
                      f"traceback in their log is the cause; this rank's failure follows from it.")
    if failed:
        advice.append(f"Ranks {failed} failed first: their logs give the cause; this rank's "
                      f"failure follows from theirs.")
    if silent:
        advice.append(f"Ranks {silent} never reported progress: they did not reach their "
                      f"training loop (stuck or crashed while starting: see their logs).")
    if lagging:
        advice.append(f"Ranks {lagging} are still at an earlier step: slow or stuck (work done on "
                      f"one rank only, such as evaluation or checkpointing, a data loader that "
                      f"blocks, an exception caught and ignored) or killed (see their logs).")
    if not progress:
        advice.append("Look for the first failure in the other ranks' logs: this one follows "
                      "from it.")
    if not behind and progress:
        where = f"step {step}" if step is not None else "the same step"
        advice.append(f"No rank is behind: every rank reported {where}, so they did not meet "
                      f"in this collective because one is much slower, was killed within the "
                      f"step, or issues different collectives (a different communicator, "
                      f"compressor or plan on some rank: build the same configuration everywhere).")
    if kind is CollectiveTimeout:
        current = f" (now {timeout:g}s)" if timeout is not None else ""
        advice.append(f"If a rank is legitimately slow, raise the timeout{current}: "
                      f"{TIMEOUT_VARIABLE}=<seconds> in the environment, or "
                      f"mergecomp.distributed.launch.init_distributed(timeout_s=...).")
    return "What to do: " + " ".join(advice)


def _timeout_in(error: BaseException) -> Optional[float]:
    found = re.search(r"(\d+)\s*ms", str(error))
    return int(found.group(1)) / 1000.0 if found else None


# ----------------------------------------------------------------------------- beacons

_beacons: Dict[Any, Beacon] = {}


def beacon_for(group=None) -> Optional[Beacon]:
    """This process's beacon for ``group`` (None: the default group), created on first use.

    None when the group's store cannot be found (a torch.distributed without the
    internals this reads); the backend then reports failures without naming ranks.
    """
    import torch.distributed as dist
    try:
        from torch.distributed import distributed_c10d as c10d
        pg = group if group is not None else c10d._get_default_group()
        store = c10d._get_process_group_store(pg)
    except Exception:
        return None
    key = id(store)  # a re-created process group has a new store, hence a new beacon
    if key not in _beacons:
        _beacons[key] = Beacon(store, dist.get_rank(group), dist.get_world_size(group))
    return _beacons[key]


def beacons() -> List[Beacon]:
    """The beacons this process created (what :func:`mergecomp.distributed.launch.shutdown` marks)."""
    return list(_beacons.values())


def forget_beacons() -> None:
    """Drop every beacon: the process group they belong to is destroyed."""
    _beacons.clear()
