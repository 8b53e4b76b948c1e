"""Per-step records of what compression did: bytes, density, time, dropped steps, residual.

    log = mergecomp.StepLog("runs/topk", tensorboard=True)   # CSV always, TensorBoard if asked
    optimizer.add_step_log(log)       # the wrapper; or state.add_step_log(log) for the DDP hook
    ...train...
    log.close()

A training curve says whether compression hurt; these rows say what it did on the way:
whether the bytes fell as far as the ratio promised, whether a step was dropped for a NaN,
whether error feedback holds back more and more (a residual norm that keeps growing is a
ratio too small for the learning rate).

The log listens through the entry point's listeners (``add_phase_listener`` and
``add_step_listener`` of the wrapper and of the DDP hook's state), so it adds no collective:
each rank measures its own exchange.  Rank 0 writes; on every other rank :meth:`attach`
attaches nothing, and with no log attached no step pays for any of it.  Columns:

- ``step``: the step's index (the wrapper's ``optimizer.steps``, the hook's ``state.steps``).
- ``skipped``: 1 when the step was dropped on every rank (a NaN/Inf gradient somewhere);
  ``skipped_total`` counts them since the start (a resumed run's included).
- ``bytes_sent``: bytes this rank handed to the collective backend in the step, counted there
  as the benchmarks count them (the step's small agreement collectives included);
  ``fp32_bytes``: the step's gradient at 4 bytes an element; ``compression_ratio``: the two
  divided.
- ``density``: coordinates sent / coordinates exchanged.  A sparsifier (top-k, DGC, GradDrop)
  counts the coordinates its payload carries; FP32 and 16-bit casts send every one.  Empty
  when a payload names no coordinates (quantisers and low-rank methods encode the whole
  gradient: their saving shows in the ratio) or is not at hand (the parameter server).
- ``compress_s``: seconds launching the groups (gathering the gradients, error feedback,
  compression, starting the collectives), summed over the step's groups.
- ``wait_s``: seconds blocked on the collectives after backward (a multi-round compressor's
  later rounds count in ``decode_s``); ``decode_s``: decoding, aggregating, averaging.
- ``ef_norm``: the L2 norm of what error feedback holds back after the step (residual
  memory: the residuals; DGC: the velocities); empty for a memory that holds nothing.
  Computed only on the steps written.
- ``drift``: how many steps of update the compressed exchange holds back, averaged over
  ranks (:mod:`mergecomp.runtime.drift`: the residuals against the update flowing in), as
  last measured in the row's steps (it is measured every few steps); empty before the first
  measurement, and for a compressor that holds nothing back.  TensorBoard also gets each
  group's (``mergecomp/drift/<group>``).
- ``density_scale``: how many times its configured density (or rank) the quality controller
  has the compressed groups send, weighted by their elements (1: the configured setting).
- ``noise``: for a compressor without error feedback whose error is noise (QSGD, TernGrad,
  unbiased rand-k, ATOMO), how large each rank's compression error is against its gradient,
  ‖C(g) − g‖ / ‖g‖ over ranks, as last measured (``drift`` is then empty: nothing is held
  back).  TensorBoard also gets each group's (``mergecomp/noise/<group>``).

``every=N`` writes one row per N steps, its bytes, density and seconds averaged over those
N steps (a long run's CSV stays small; the residual norm is read on written steps only).

A log is never worth a training run.  Writing fails (a full disk, a lost mount): the log
warns once, saying what failed, and stops; the step goes on exactly as on the other ranks.
A run that resumes into the same ``log_dir`` continues its ``steps.csv``: rows of steps
before the run's first step stay, rows of that step and later ones (the steps it takes again,
when it resumes from an earlier checkpoint than the log's last row) are replaced, so the file
stays one table in step order.  A run killed while writing a row can leave a partial last
line: :func:`read_rows` skips it, and the next run that writes into the folder removes it.
"""
from __future__ import annotations

import csv
import math
import os
import warnings
from typing import Any, Dict, List, Optional

from .plan import is_compressed

COLUMNS = ("step", "skipped", "skipped_total", "bytes_sent", "fp32_bytes", "compression_ratio",
           "density", "compress_s", "wait_s", "decode_s", "ef_norm", "drift", "density_scale", "noise")
#: The columns that hold whole numbers (the others are floats; an empty cell is ``None``).
INTEGER_COLUMNS = ("step", "skipped", "skipped_total")
#: The CSV's name inside ``log_dir``.
CSV_NAME = "steps.csv"

#: What to install for the TensorBoard writer.
TENSORBOARD_INSTALL = "pip install tensorboard   (or: pip install 'mergecomp[tensorboard]')"


def tensorboard_writer():
    """torch's SummaryWriter class, or ImportError saying what to install."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as error:  # torch raises this when the tensorboard package is missing
        raise ImportError(f"StepLog(tensorboard=True) writes through torch.utils.tensorboard, which "
                          f"needs the tensorboard package ({error}); install it: {TENSORBOARD_INSTALL}, "
                          "or pass tensorboard=False for the CSV alone") from None
    return SummaryWriter


class _Detach:
    """What :meth:`StepLog.attach` returns: ``remove()`` stops the listening."""

    def __init__(self, handles: List[Any]):
        self._handles = handles

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []


class StepLog:
    """Write one row per step (or per ``every`` steps) to ``log_dir``: ``steps.csv`` and,
    with ``tensorboard=True``, TensorBoard event files (scalars under ``mergecomp/``).

    Args:
        log_dir: the folder (created if missing).
        csv: write ``steps.csv`` (default True; needs no extra package).
        tensorboard: write TensorBoard events (needs the ``tensorboard`` package; an
            ImportError saying how to install it otherwise, raised here, not mid-run).
        every: write one row per this many steps (≥ 1).

    ``stopped`` is None while the log writes; once a write failed, it says what failed.
    """

    def __init__(self, log_dir: str, *, csv: bool = True, tensorboard: bool = False, every: int = 1):
        if not isinstance(log_dir, (str, os.PathLike)) or not str(log_dir):
            raise ValueError(f"log_dir must be a folder path, got {log_dir!r}")
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(f"every must be a whole number of steps ≥ 1, got {every!r}")
        if not csv and not tensorboard:
            raise ValueError("StepLog(csv=False, tensorboard=False) would write nothing: keep csv=True "
                             "or pass tensorboard=True")
        self.log_dir = str(log_dir)
        self.every = every
        self._want_csv, self._want_tensorboard = csv, tensorboard
        self._writer_class = tensorboard_writer() if tensorboard else None  # fail before training
        self._csv_path = os.path.join(self.log_dir, CSV_NAME)
        self._csv_file = self._csv = self._tensorboard = None
        self._source = None
        self._drift_step = -1  # the step of the last drift reading written
        self._handles: List[Any] = []
        self._first_step: Optional[int] = None  # the first step this run logs (rank 0)
        self._last_row: Optional[int] = None  # the step of the last row this run wrote
        self.stopped: Optional[str] = None  # why the log stopped writing, once it did
        self._closed = False
        self._reset_window()

    # -- attaching ---------------------------------------------------------------------------
    def attach(self, source) -> _Detach:
        """Listen to ``source``: an entry point's step lifecycle, or an object holding one
        (``.lifecycle``; prefer ``optimizer.add_step_log(log)``, ``state.add_step_log(log)``,
        ``diloco.add_step_log(log)``).  Attaches nothing on ranks other than 0.  One source
        per log."""
        if self._source is not None:
            raise RuntimeError("this StepLog is attached already; make one StepLog per optimizer "
                               "or hook state (each in its own log_dir)")
        source = getattr(source, "lifecycle", source)
        self._source = source
        if source.rank != 0:
            return _Detach([])
        self._bytes_before = source.bytes_sent
        self._handles = [source.phase_listeners.add(self._on_phase), source.step_listeners.add(self._on_step)]
        self._guarded(f"opening the step log in {self.log_dir}", self._open)
        return _Detach(self._handles)

    def _open(self) -> None:
        """Make the folder, set aside a ``steps.csv`` of other columns, start TensorBoard's
        writer.  The CSV itself opens at the first row, when the run's first step is known."""
        os.makedirs(self.log_dir, exist_ok=True)
        if self._want_csv:
            self._set_aside_foreign_csv()
        if self._writer_class is not None:
            self._tensorboard = self._writer_class(log_dir=self.log_dir)

    def _set_aside_foreign_csv(self) -> None:
        """A ``steps.csv`` whose header is not :data:`COLUMNS` (another version's columns, or
        not a step log) cannot be continued as one table: rename it to the first free
        ``steps.csv.N`` and say so, rather than mixing tables or erasing it."""
        header = _first_line(self._csv_path)
        if header is None or header == ",".join(COLUMNS):
            return  # no file, an empty one, a partial header (a kill while writing it), or ours
        number = 1
        while os.path.exists(f"{self._csv_path}.{number}"):
            number += 1
        os.replace(self._csv_path, f"{self._csv_path}.{number}")
        warnings.warn(f"mergecomp.StepLog: {self._csv_path} has other columns ({header[:120]!r}), not a "
                      f"step log this version can continue; it was kept as {self._csv_path}.{number} "
                      "and a new steps.csv begun", RuntimeWarning, stacklevel=4)

    def _open_csv(self) -> None:
        """Continue ``steps.csv``: keep its header and its rows of steps before this run's first
        step, drop the rest (a partial last line, rows of the steps this run takes again), append."""
        kept = _kept_bytes(self._csv_path, self._first_step)
        if os.path.exists(self._csv_path) and os.path.getsize(self._csv_path) > kept:
            os.truncate(self._csv_path, kept)
        self._csv_file = open(self._csv_path, "a", newline="")
        self._csv = csv.writer(self._csv_file)
        if kept == 0:
            self._csv.writerow(COLUMNS)

    # -- failing -----------------------------------------------------------------------------
    def _guarded(self, doing: str, action, *args) -> None:
        """Run ``action``; if the disk refuses (OSError: full, gone, read-only), stop the log
        with one warning instead of ending the run.  The listeners run inside the step on
        rank 0 only, so an error here would leave rank 0 a step behind the others."""
        if self.stopped is not None:
            return
        try:
            action(*args)
        except OSError as error:
            self._stop(doing, error)

    def _stop(self, doing: str, error: OSError) -> None:
        for handle in self._handles:  # no step pays for a log that writes nothing
            handle.remove()
        self._handles = []
        self._close_quietly()
        kept = ("no rows were written" if self._last_row is None
                else f"its rows up to step {self._last_row} are kept")
        self.stopped = f"{doing} failed ({type(error).__name__}: {error})"
        warnings.warn(f"mergecomp.StepLog: {self.stopped}; the step log stops here ({kept}) and "
                      "training goes on. Free space or give another log_dir to log the next run.",
                      RuntimeWarning, stacklevel=2)

    def _close_quietly(self) -> None:
        """Close the files after a failure: what they still buffer is lost either way."""
        for closer in (getattr(self._csv_file, "close", None), getattr(self._tensorboard, "close", None)):
            if closer is not None:
                try:
                    closer()
                except OSError:
                    pass
        self._csv_file = self._csv = self._tensorboard = None

    # -- listening -----------------------------------------------------------------------------
    def _reset_window(self) -> None:
        self._steps = self._skipped = 0
        self._groups: List[Any] = []  # this step's groups, for their wait_seconds at its end
        self._decoded: Dict[int, float] = {}  # id(group) → seconds of its "finish"
        self._sums = {"fp32_bytes": 0.0, "sent": 0.0, "coordinates": 0.0, "compress_s": 0.0,
                      "wait_s": 0.0, "decode_s": 0.0}
        self._density_known = True

    def _on_phase(self, phase: str, group, seconds: float) -> None:
        if phase == "launch":
            self._groups.append(group)
            self._sums["compress_s"] += seconds
            self._sums["fp32_bytes"] += 4 * group.numel
            self._sums["coordinates"] += group.numel
            sent = self._coordinates_sent(group)
            if sent is None:
                self._density_known = False
            else:
                self._sums["sent"] += sent
        elif phase == "finish":
            self._decoded[id(group)] = seconds

    def _coordinates_sent(self, group) -> Optional[int]:
        """How many coordinates ``group``'s payload carries (None: it does not say)."""
        if not is_compressed(group.send):
            return group.numel  # a raw group: every coordinate, as FP32 or a 16-bit cast
        compressor = self._source.communicators()[0].compressor
        transmitted = getattr(compressor, "transmitted_indices", None)
        if transmitted is None:
            return group.numel if compressor.dense else None
        payload = getattr(group.handle, "payload", None)
        if payload is None:
            return None
        return int(transmitted(payload, group.handle.ctx).numel())

    def _on_step(self, step: int, outcome) -> None:
        if self._first_step is None:
            self._first_step = step
        self._steps += 1
        self._skipped += 0 if outcome.finite else 1
        for group in self._groups:
            self._sums["wait_s"] += getattr(group, "wait_seconds", 0.0)
            # groups without a "finish" of their own count their decoding alone
            self._sums["decode_s"] += self._decoded.get(id(group), getattr(group, "finish_seconds", 0.0))
        self._groups, self._decoded = [], {}
        if self._steps >= self.every and not self._closed:
            self._guarded(f"writing the row of step {step} to {self.log_dir}", self._write, step)
            self._reset_window()

    def _write(self, step: int) -> None:
        source, n, sums = self._source, self._steps, self._sums
        reading = source.drift
        fresh = reading is not None and reading.step > self._drift_step
        if fresh:
            self._drift_step = reading.step
        sent = (source.bytes_sent - self._bytes_before) / n
        self._bytes_before = source.bytes_sent
        fp32 = sums["fp32_bytes"] / n
        row: Dict[str, Any] = {
            "step": step, "skipped": self._skipped, "skipped_total": source.skipped_steps,
            "bytes_sent": sent, "fp32_bytes": fp32,
            "compression_ratio": fp32 / sent if sent else math.inf,
            "density": sums["sent"] / sums["coordinates"] if self._density_known and sums["coordinates"] else None,
            "compress_s": sums["compress_s"] / n, "wait_s": sums["wait_s"] / n,
            "decode_s": sums["decode_s"] / n, "ef_norm": self._error_norm(),
            "drift": reading.lag if fresh and reading.kind == "lag" else None,
            "density_scale": source.meter.density_scale() if source.meter is not None else None,
            "noise": reading.noise if fresh else None,
        }
        if self._want_csv:
            if self._csv is None:
                self._open_csv()
            self._csv.writerow(["" if row[c] is None else _cell(row[c]) for c in COLUMNS])
            self._csv_file.flush()  # a run that dies keeps its rows
        if self._tensorboard is not None:
            for column in COLUMNS[1:]:
                if row[column] is not None and math.isfinite(row[column]):
                    self._tensorboard.add_scalar(f"mergecomp/{column}", row[column], step)
            for group, value in (reading.groups.items() if fresh else ()):
                if math.isfinite(value):
                    self._tensorboard.add_scalar(f"mergecomp/{reading.column}/{group}", value, step)
            # the writer writes on a thread of its own: its flush waits for it and raises
            # what it met (a full disk), here rather than at some later row or at close()
            self._tensorboard.flush()
        self._last_row = step

    def _error_norm(self) -> Optional[float]:
        memories = {id(c.memory): c.memory for c in self._source.communicators()}
        norms = [m.error_norm() for m in memories.values() if hasattr(m, "error_norm")]
        norms = [x for x in norms if x is not None]
        return math.sqrt(sum(x * x for x in norms)) if norms else None

    # -- closing -------------------------------------------------------------------------------
    def close(self) -> None:
        """Flush and close the files (rows already written stay if a run dies first); later
        steps write no rows."""
        self._closed = True
        self._guarded(f"closing the step log in {self.log_dir}", self._close)

    def _close(self) -> None:
        if self._csv_file is not None:
            csv_file, self._csv_file, self._csv = self._csv_file, None, None
            csv_file.close()
        if self._tensorboard is not None:
            tensorboard, self._tensorboard = self._tensorboard, None
            tensorboard.close()

    def __enter__(self) -> "StepLog":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        kinds = [k for k, on in (("csv", self._want_csv), ("tensorboard", self._want_tensorboard)) if on]
        return f"StepLog({self.log_dir!r}, {'+'.join(kinds)}, every={self.every})"


def _cell(value: Any) -> str:
    """A CSV cell: integers as they are, floats to 6 significant digits."""
    if isinstance(value, float) and not value.is_integer():
        return f"{value:.6g}"
    return str(int(value)) if isinstance(value, float) and math.isfinite(value) else str(value)


def read_rows(log_dir: str) -> List[Dict[str, Any]]:
    """The rows of ``log_dir``'s ``steps.csv``, numbers parsed (whole numbers as ``int``, an
    empty cell as ``None``).  A line that is not a whole row is skipped: the partial last line
    a run killed while writing leaves.  ValueError for a file with other columns."""
    path = os.path.join(os.fspath(log_dir), CSV_NAME)
    with open(path, "rb") as f:
        lines = f.read().split(b"\n")
    header = lines[0].decode("utf-8", "replace").rstrip("\r")
    if len(lines) == 1 and ",".join(COLUMNS).startswith(header):
        return []  # an empty file, or a header cut short
    if header != ",".join(COLUMNS):
        raise ValueError(f"{path} is not a step log: its columns are {header[:200]!r}, a step log's "
                         f"are {','.join(COLUMNS)}")
    rows = []
    for line in lines[1:-1]:  # the last piece follows the last newline: empty, or a partial row
        row = _parse_row(line)
        if row is not None:
            rows.append(row)
    return rows


def _parse_row(line: bytes) -> Optional[Dict[str, Any]]:
    """One CSV line as a row, or None if it is not a whole one."""
    cells = line.decode("utf-8", "replace").rstrip("\r").split(",")
    if len(cells) != len(COLUMNS):
        return None
    row: Dict[str, Any] = {}
    try:
        for column, cell in zip(COLUMNS, cells):
            row[column] = None if cell == "" else int(cell) if column in INTEGER_COLUMNS else float(cell)
    except ValueError:
        return None
    return row


def _first_line(path: str) -> Optional[str]:
    """The first whole line of ``path`` (no line end), or None if it has none or is missing."""
    try:
        with open(path, "rb") as f:
            head = f.read(4096)
    except FileNotFoundError:
        return None
    if b"\n" not in head:  # a header cut short by a kill is no other table
        text = head.decode("utf-8", "replace")
        return None if ",".join(COLUMNS).startswith(text) else text
    return head.split(b"\n", 1)[0].decode("utf-8", "replace").rstrip("\r")


def _kept_bytes(path: str, first_step: Optional[int]) -> int:
    """How many leading bytes of the step log at ``path`` a run starting at ``first_step``
    keeps: the header and every whole row of an earlier step, up to the first row of a later
    one (rows are in step order) or a partial last line.  0: no file, or no whole header."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        return 0
    lines = data.split(b"\n")
    if len(lines) == 1:
        return 0
    kept = len(lines[0]) + 1
    for line in lines[1:-1]:
        row = _parse_row(line)
        if row is not None and first_step is not None and row["step"] >= first_step:
            break
        kept += len(line) + 1  # a line that is no row stays as it was; readers skip it
    return kept
