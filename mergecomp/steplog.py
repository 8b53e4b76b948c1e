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

``every=N`` writes one row per N steps, its bytes, density and seconds averaged over those
N steps (a long run's CSV stays small; the residual norm is read on written steps only).
"""
from __future__ import annotations

import csv
import math
import os
from typing import Any, Dict, List, Optional

from .plan import is_compressed

COLUMNS = ("step", "skipped", "skipped_total", "bytes_sent", "fp32_bytes", "compression_ratio",
           "density", "compress_s", "wait_s", "decode_s", "ef_norm")

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
        self._csv_file = self._csv = self._tensorboard = None
        self._source = None
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
        self._open()
        self._bytes_before = source.bytes_sent
        return _Detach([source.phase_listeners.add(self._on_phase), source.step_listeners.add(self._on_step)])

    def _open(self) -> None:
        os.makedirs(self.log_dir, exist_ok=True)
        if self._want_csv:
            path = os.path.join(self.log_dir, "steps.csv")
            self._csv_file = open(path, "w", newline="")
            self._csv = csv.writer(self._csv_file)
            self._csv.writerow(COLUMNS)
        if self._writer_class is not None:
            self._tensorboard = self._writer_class(log_dir=self.log_dir)

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
        self._steps += 1
        self._skipped += 0 if outcome.finite else 1
        for group in self._groups:
            self._sums["wait_s"] += getattr(group, "wait_seconds", 0.0)
            # groups without a "finish" of their own count their decoding alone
            self._sums["decode_s"] += self._decoded.get(id(group), getattr(group, "finish_seconds", 0.0))
        self._groups, self._decoded = [], {}
        if self._steps >= self.every:
            self._write(step)
            self._reset_window()

    def _write(self, step: int) -> None:
        source, n, sums = self._source, self._steps, self._sums
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
        }
        if self._csv is not None:
            self._csv.writerow(["" if row[c] is None else _cell(row[c]) for c in COLUMNS])
            self._csv_file.flush()  # a run that dies keeps its rows
        if self._tensorboard is not None:
            for column in COLUMNS[1:]:
                if row[column] is not None and math.isfinite(row[column]):
                    self._tensorboard.add_scalar(f"mergecomp/{column}", row[column], step)

    def _error_norm(self) -> Optional[float]:
        memories = {id(c.memory): c.memory for c in self._source.communicators()}
        norms = [m.error_norm() for m in memories.values() if hasattr(m, "error_norm")]
        norms = [x for x in norms if x is not None]
        return math.sqrt(sum(x * x for x in norms)) if norms else None

    # -- closing -------------------------------------------------------------------------------
    def close(self) -> None:
        """Flush and close the files (rows already written stay if a run dies first)."""
        if self._csv_file is not None:
            self._csv_file.close()
            self._csv_file = self._csv = None
        if self._tensorboard is not None:
            self._tensorboard.close()
            self._tensorboard = None

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
