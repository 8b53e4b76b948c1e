"""The collective layer.  Compressors and communicators never call torch.distributed.

A backend moves tuples of tensors between ranks and counts every byte it is handed, so
the benchmark's bytes-per-iteration come from what actually went to the network library,
not from an estimate.  Two counters:

``bytes_sent``
    the bytes of the tensors this rank handed to collectives (payloads, size headers,
    padding): what the compressors produced.
``wire_bytes``
    what this rank transmits for them under the standard algorithms: a ring allreduce
    sends 2(N−1)/N of its buffer, a ring allgather forwards N−1 blocks, an all-to-all
    sends every chunk but its own.  Derived from the handed bytes, so it is exact for
    those algorithms and a model for others (tree allreduce, NCCL's protocol choices).
    It is what makes allgather's cost growth with N visible next to allreduce.  Async operations return a :class:`Work` whose ``wait()`` gives
the result.
"""
from __future__ import annotations

import contextlib
import json
from typing import Any, Callable, Iterator, List, Optional, Sequence, Tuple

import torch

from .expect import Expect, shown
from .serialize import header_error

Tensors = Tuple[torch.Tensor, ...]

#: The most bytes one rank's value may take in :meth:`Backend.allgather_object` and
#: :meth:`Backend.broadcast_object`: a length from a peer beyond it is refused before
#: anything is allocated.  Plans, digests and timings take kilobytes.
JSON_LIMIT = 64 << 20
#: How deeply a peer's JSON value may nest (lists and objects inside each other): far beyond
#: anything mergecomp exchanges (a plan nests four deep), far below what would exhaust
#: Python's recursion in the code that reads, compares or prints it.
JSON_MAX_DEPTH = 32


class Work:
    """An operation in flight: ``wait()`` blocks until done and returns its result.

    ``explain(error)``, when given, turns what a handle's ``wait()`` raised into a clearer
    error (a :class:`mergecomp.distributed.watchdog.CollectiveError` naming the ranks behind), or
    returns None to let the original error through.
    """

    def __init__(self, handles: Sequence[Any] = (), finalize: Optional[Callable[[], Any]] = None,
                 explain: Optional[Callable[[BaseException], Optional[BaseException]]] = None):
        self._handles = list(handles)
        self._finalize = finalize
        self._explain = explain
        self._done = False
        self._result = None

    def wait(self):
        if not self._done:
            try:
                for handle in self._handles:
                    handle.wait()
            except Exception as error:
                clearer = self._explain(error) if self._explain is not None else None
                if clearer is None:
                    raise
                raise clearer from error
            self._result = self._finalize() if self._finalize is not None else None
            self._done = True
        return self._result

    def future(self) -> "torch.futures.Future":
        """A ``torch.futures.Future`` completed with :meth:`wait`'s result once the collective
        is done, for chaining (``.then``) instead of blocking.

        Handles that offer futures (torch.distributed's) complete it from their own
        callback; others (Horovod's) are waited for on a helper thread.  The chained
        callback runs on that thread: keep collectives out of it, or ranks could issue
        them in different orders.
        """
        if self._done or not self._handles:
            done = torch.futures.Future()
            done.set_result(self.wait())
            return done
        if all(hasattr(h, "get_future") for h in self._handles):
            return torch.futures.collect_all([h.get_future() for h in self._handles]).then(
                lambda _: self.wait())
        result = torch.futures.Future()

        def complete() -> None:
            try:
                result.set_result(self.wait())
            except BaseException as error:  # the waiter re-raises it from wait()/value()
                result.set_exception(error)

        import threading
        threading.Thread(target=complete, daemon=True, name="mergecomp-work-future").start()
        return result


class Completed(Work):
    """A Work whose result is already known."""

    def __init__(self, result):
        super().__init__()
        self._result = result
        self._done = True


class Backend:
    """Base class of collective backends (torch.distributed, Horovod)."""

    name = "backend"

    def __init__(self):
        self.bytes_sent = 0
        self.wire_bytes = 0
        self.collectives = 0

    # -- identity ---------------------------------------------------------------------
    @property
    def rank(self) -> int:
        raise NotImplementedError

    @property
    def size(self) -> int:
        raise NotImplementedError

    # -- progress -----------------------------------------------------------------------
    def mark_step(self, step: int) -> None:
        """Record that this rank starts training step ``step`` (call it once per step, on
        every rank, before the step's first collective).  A backend that keeps progress
        beacons (torch.distributed) names the ranks that fell behind when a collective
        fails; this default keeps none."""

    def explained(self, op: str):
        """A context manager for a collective issued outside this backend (a framework's own:
        FSDP's all-gather) on a group this backend's ranks belong to: a timeout or a lost peer
        inside it becomes the same named error this backend's collectives raise.  Nothing is
        counted.  This default explains nothing."""
        return contextlib.nullcontext()

    def explained_work(self, work, op: str):
        """``work`` (an async handle of a collective issued outside this backend), whose
        ``wait()`` failures are explained as in :meth:`explained`.  This default returns it."""
        return work

    # -- accounting -------------------------------------------------------------------
    @staticmethod
    def _nbytes(tensors: Sequence[torch.Tensor]) -> int:
        return sum(t.numel() * t.element_size() for t in tensors)

    def _count_allreduce(self, tensors: Sequence[torch.Tensor]) -> None:
        handed = self._nbytes(tensors)
        self.collectives += 1
        self.bytes_sent += handed
        self.wire_bytes += handed * 2 * (self.size - 1) // self.size

    def _count_allgather(self, tensors: Sequence[torch.Tensor]) -> None:
        handed = self._nbytes(tensors)
        self.collectives += 1
        self.bytes_sent += handed
        self.wire_bytes += handed * (self.size - 1)

    def _count_alltoall(self, chunks: Sequence[torch.Tensor], extra: Sequence[torch.Tensor] = ()) -> None:
        """``chunks[r]`` goes to rank r (the own chunk stays local); ``extra`` goes to all."""
        handed = self._nbytes(chunks) + self._nbytes(extra)
        self.collectives += 1
        self.bytes_sent += handed
        self.wire_bytes += (self._nbytes(chunks) - self._nbytes([chunks[self.rank]])
                            + self._nbytes(extra) * (self.size - 1))

    @contextlib.contextmanager
    def uncounted(self) -> Iterator[None]:
        """Collectives issued inside this block are not counted: on exit the counters
        (``bytes_sent``, ``wire_bytes``, ``collectives``) are what they were on entry.

        For measurement traffic (probes, a scheduler's dummy collectives), which is no
        part of what training sends.  Wrap only the probe's own calls: a training
        collective issued inside the block, from this thread or another, would go
        uncounted too.
        """
        counters = (self.bytes_sent, self.wire_bytes, self.collectives)
        try:
            yield
        finally:
            self.bytes_sent, self.wire_bytes, self.collectives = counters

    # -- collectives ------------------------------------------------------------------
    def allreduce_async(self, tensors: Sequence[torch.Tensor]) -> Work:
        """Sum each tensor over all ranks, in place; ``wait()`` returns the tuple."""
        raise NotImplementedError

    def allgather_async(self, tensors: Sequence[torch.Tensor], same_shapes: bool,
                        bound: Optional[Sequence[torch.Size]] = None,
                        limit: Optional[int] = None) -> Work:
        """Gather a tuple of tensors from every rank; ``wait()`` returns one tuple per rank.

        With ``same_shapes`` every rank sends tensors of the local shapes; otherwise shapes
        may differ per rank (including empty tensors).  Then ``bound``, the largest shape
        of each part (the same on every rank), lets the shapes travel inside one
        fixed-size blob; without it a backend whose collectives need sizes up front
        exchanges the shapes first, a blocking collective: the caller waits for every rank.
        ``limit`` is the most bytes a rank's payload may take: shapes received from a peer
        that claim more raise :class:`~mergecomp.distributed.backends.serialize.HeaderError` before
        anything is allocated (see :func:`~mergecomp.distributed.backends.serialize.payload_limit`).

        Every tensor handed in must be on one device, the group's: the collective's
        buffers, headers included, are made there (NCCL takes CUDA tensors only).
        """
        raise NotImplementedError

    def alltoall(self, chunks: Sequence[torch.Tensor], limit: Optional[int] = None) -> List[torch.Tensor]:
        """Send 1-D uint8 ``chunks[r]`` to rank r; return the chunk received from each rank.

        ``limit`` is the most bytes a chunk from a peer may take (HeaderError beyond it,
        before the receive buffer is allocated)."""
        raise NotImplementedError

    def reduce_scatter(self, chunks: torch.Tensor) -> torch.Tensor:
        """Row r of the sum over ranks of ``chunks`` ((world, n), the same shape and dtype on
        every rank) for this rank r (blocking): FSDP's reduce-scatter.  Counted as an
        all-to-all (every row but this rank's own leaves it).  This default allreduces the
        whole and keeps the row: a backend with a reduce-scatter of its own sends less."""
        _check_rows(chunks, self.size, "reduce_scatter")
        (total,) = self.allreduce_async([chunks.clone()]).wait()
        return total[self.rank]

    def alltoall_fixed(self, chunks: torch.Tensor) -> torch.Tensor:
        """Row r of ``chunks`` ((world, n), the same shape and dtype on every rank) to rank r;
        returns (world, n), row s from rank s (blocking).  Every row has the same size on every
        rank, so no size travels first.  This default goes through :meth:`alltoall`."""
        _check_rows(chunks, self.size, "alltoall_fixed")
        rows = self.alltoall([row.reshape(-1).view(torch.uint8) for row in chunks], limit=chunks[0].nbytes)
        return torch.stack([row.view(chunks.dtype) for row in rows]).view_as(chunks)

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Overwrite ``tensor`` with rank ``src``'s, in place (blocking); returns it."""
        raise NotImplementedError

    # -- small values: JSON in byte tensors, never pickle ----------------------------------
    @property
    def json_device(self) -> torch.device:
        """Where the JSON bytes travel: the backend's device (NCCL takes CUDA tensors only)."""
        return torch.device(getattr(self, "device", None) or "cpu")

    def broadcast_object(self, obj: Any, src: int = 0, expect: Optional[Expect] = None) -> Any:
        """Rank ``src``'s ``obj`` on every rank.

        ``obj`` travels as JSON (UTF-8 bytes in a uint8 tensor, after an int64 length), so
        it must be made of dicts with string keys, lists, tuples (they come back as lists),
        strings, finite or non-finite floats, ints, booleans and None; anything else raises
        TypeError on every rank, after the same two collectives.  Nothing a peer sends is
        unpickled.  Uncounted: not part of what training sends.

        What arrives is checked before it is returned, on every rank alike (``src`` reads its
        own bytes back): bytes that are not this method's JSON, a value nested deeper than
        ``JSON_MAX_DEPTH``, or one not of the form ``expect``
        (:mod:`mergecomp.distributed.backends.expect`) raise
        :class:`~mergecomp.distributed.backends.serialize.HeaderError`
        naming rank ``src``.
        """
        payload = _encode(obj, "broadcast_object", self.rank) if self.rank == src else b""
        with self.uncounted():
            length = torch.tensor([len(payload)], dtype=torch.int64, device=self.json_device)
            self.broadcast(length, src=src)
            size = _checked_length(int(length.item()), src)
            data = (_bytes_tensor(payload, self.json_device) if self.rank == src else
                    torch.empty(size, dtype=torch.uint8, device=self.json_device))
            self.broadcast(data, src=src)
        return _decode(data, src, "broadcast_object", expect)

    def allgather_object(self, obj: Any, expect: Optional[Expect] = None) -> List[Any]:
        """Every rank's ``obj``, in rank order; JSON, and checked against ``expect``, as in
        :meth:`broadcast_object` (every rank reads every value, so every rank raises alike)."""
        payload = _encode(obj, "allgather_object", self.rank)
        data = _bytes_tensor(payload, self.json_device)
        with self.uncounted():
            gathered = self.allgather_async([data], same_shapes=False, limit=JSON_LIMIT).wait()
        return [_decode(parts[0], source, "allgather_object", expect)
                for source, parts in enumerate(gathered)]

    def barrier(self) -> None:
        raise NotImplementedError


def _check_rows(chunks: torch.Tensor, world: int, op: str) -> None:
    if chunks.dim() != 2 or chunks.shape[0] != world:
        raise ValueError(f"{op} takes one row per rank, a ({world}, n) tensor, got shape {tuple(chunks.shape)}")


def _encode(obj: Any, op: str, rank: int) -> bytes:
    """``["ok", obj]`` as JSON bytes, or ``["error", why]`` when ``obj`` is not JSON: the
    other ranks then raise too instead of waiting for a collective this rank skipped."""
    problem = _not_json(obj, "the value")
    if problem is None:
        return json.dumps(["ok", obj], separators=(",", ":")).encode()
    why = (f"{op}: rank {rank} passed a value that JSON cannot carry: {problem}; values exchanged between ranks travel as JSON, so "
           f"pass dicts with string keys, lists, strings, numbers, booleans or None (e.g. "
           f"plan.to_dict() for a Plan)")
    return json.dumps(["error", why]).encode()


def _not_json(value: Any, where: str) -> Optional[str]:
    """What in ``value`` JSON cannot carry faithfully (None: all of it can)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return None  # NaN and infinities too: Python's json writes and reads them
    if isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            problem = _not_json(item, f"{where}[{i}]")
            if problem:
                return problem
        return None
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                return (f"{where} has the key {key!r} of type {type(key).__name__}: JSON keys are "
                        f"strings (send a list of [key, value] pairs)")
            problem = _not_json(item, f"{where}[{key!r}]")
            if problem:
                return problem
        return None
    shown = repr(value).splitlines()[0][:80] if repr(value) else ""
    return f"{where} is of type {type(value).__name__} ({shown}), which is not JSON-serialisable"


def _bytes_tensor(payload: bytes, device: torch.device) -> torch.Tensor:
    return torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(device)


def _checked_length(size: int, source: int) -> int:
    if not 0 <= size <= JSON_LIMIT:
        raise header_error(source, f"it announces a {size}-byte JSON value; at most {JSON_LIMIT} "
                                   f"bytes are allowed")
    return size


def _decode(data: torch.Tensor, source: int, op: str, expect: Optional[Expect] = None) -> Any:
    """The value rank ``source`` sent; TypeError if it could not send one (its own
    :func:`_encode` said why); HeaderError for anything else than what :func:`_encode` writes,
    or a value not of the form ``expect``."""
    try:
        envelope = json.loads(data.cpu().numpy().tobytes().decode("utf-8"))
    except RecursionError:  # nested deeper than the JSON reader goes
        raise header_error(source, f"its {op} value nests deeper than {JSON_MAX_DEPTH} lists or "
                                   "objects") from None
    except ValueError:  # not UTF-8, not JSON, an integer of too many digits
        raise header_error(source, f"its {op} bytes are not a JSON value") from None
    if _nests_deeper(envelope, 1 + JSON_MAX_DEPTH):  # the envelope is one list more
        raise header_error(source, f"its {op} value nests deeper than {JSON_MAX_DEPTH} lists or objects")
    if not (isinstance(envelope, list) and len(envelope) == 2 and envelope[0] in ("ok", "error")):
        raise header_error(source, f"its {op} bytes are not a value this method sent: "
                                   f"{shown(envelope)} is no [\"ok\", value] or [\"error\", why]")
    tag, value = envelope
    if tag == "error":
        if not isinstance(value, str):
            raise header_error(source, f"its {op} error is {shown(value)}, not a message")
        raise TypeError(value)
    problem = expect.problem(value) if expect is not None else None
    if problem is not None:
        raise header_error(source, f"its {op} value is not {expect.what}: {problem}")
    return value


def _nests_deeper(value: Any, limit: int) -> bool:
    """Whether ``value``'s lists and dicts nest more than ``limit`` deep (a number or string:
    0), found without recursion, so a hostile value cannot exhaust the stack here."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else None
        if children is None:
            continue
        if depth > limit:
            return True
        stack.extend((child, depth + 1) for child in children)
    return False
