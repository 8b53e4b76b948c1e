"""The Triton backend: fused GPU kernels for CUDA tensors, chosen per call by the tensor.

Why: on a GPU the torch path of a compressor is a chain of small kernels (a sign test, a
shift per code position, an n-element temporary per step of the rounding), each a full
read and write of the data, and some steps wait for the host (rand-k's indices were drawn
by numpy on the CPU and copied over).  Each kernel here reads its input once and writes
its output once, on the tensor's device and the current stream.

======================  =================================================================
:mod:`.packing`         ``pack_bits``, ``unpack_bits``, ``decode_values``, ``pack_signs``,
                        ``signs_and_side_sums`` (1-bit SGD's encoder)
:mod:`.quantize`        ``quantize_packed`` (stochastic rounding with the counter hash's
                        bits, packed as made), ``dequantize_packed``
:mod:`.subsets`         ``random_subset`` (rand-k's indices, drawn on the device)
:mod:`.selection`       ``sample_magnitudes`` (DGC's threshold sample),
                        ``indices_at_least`` (ordered compaction)
:mod:`.scatter`         ``scatter`` (the sparse decode: set, add or subtract)
:mod:`.finite`          ``nonfinite_flag`` (any NaN or Inf, of a tensor or of some elements)
:mod:`.segments`        ``view_sums``, ``view_side_sums``, ``scale_views_`` (one program per
                        block of one parameter view: no per-element expansion)
======================  =================================================================

Every kernel gives the bits of the torch/CPU path it replaces (the tests compare them,
on the CPU under ``TRITON_INTERPRET=1`` and on a GPU), except where a sum's order differs
(1-bit SGD's side sums, the per-view sums).  The wire format does not change: a payload made on a GPU
decodes on a CPU and back.

When it runs: for a CUDA tensor when ``triton`` imports (``pip install mergecomp[gpu]``;
CUDA builds of torch ship it).  Nothing here is imported until a CUDA tensor arrives, and
nothing is compiled on a CPU-only install.  ``MERGECOMP_TRITON=0`` (or :func:`disabled`)
keeps the torch path, for comparisons.  ``MERGECOMP_TRITON=interpret`` also sends CPU
tensors through the kernels, which then run in Triton's interpreter: set
``TRITON_INTERPRET=1`` before ``triton`` is first imported (it decides, at import, how
kernels are built).  That is how the kernels are tested and rehearsed without a GPU.
"""
from __future__ import annotations

import contextlib
import os
import threading
from typing import Optional

import torch

_switch = threading.local()
_import_error: Optional[str] = None
_imported: Optional[bool] = None


def importable() -> bool:
    """Whether ``triton`` imports here (tried once, on the first call)."""
    global _imported, _import_error
    if _imported is None:
        try:
            import triton  # noqa: F401  (the import is the test)
            _imported = True
        except ImportError as error:  # a CPU-only install: the torch path serves
            _imported, _import_error = False, str(error)
    return _imported


def interpreting() -> bool:
    """Whether Triton's interpreter runs the kernels (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "yes", "on")


def _mode() -> str:
    mode = os.environ.get("MERGECOMP_TRITON", "1").strip().lower()
    if mode in ("0", "false", "no", "off"):
        return "off"
    if mode == "interpret":
        if not interpreting():
            raise RuntimeError("MERGECOMP_TRITON=interpret runs the Triton kernels on CPU tensors, which "
                               "needs Triton's interpreter: also set TRITON_INTERPRET=1, before triton is "
                               "imported (or unset MERGECOMP_TRITON)")
        return "interpret"
    if mode in ("1", "true", "yes", "on", ""):
        return "on"
    raise ValueError(f"MERGECOMP_TRITON={mode!r} is not a setting: use 1 (Triton kernels for CUDA "
                     f"tensors, the default), 0 (torch ops only) or interpret (CPU tensors too, under "
                     f"TRITON_INTERPRET=1)")


def usable(tensor: torch.Tensor) -> bool:
    """Whether the ops of :mod:`mergecomp.kernels` send ``tensor`` through a Triton kernel: a
    CUDA tensor (a CPU one under ``MERGECOMP_TRITON=interpret``), ``triton`` importable, and
    not switched off (``MERGECOMP_TRITON=0``, :func:`disabled` on this thread)."""
    return usable_on(tensor.device)


def usable_on(device) -> bool:
    """:func:`usable` for the tensors of ``device`` (a ``torch.device`` or its name)."""
    if getattr(_switch, "off", False):
        return False
    device = torch.device(device).type
    if device != "cuda" and device != "cpu":
        return False
    mode = _mode()
    if mode == "off" or (device == "cpu" and mode != "interpret"):
        return False
    return importable()


def status() -> str:
    """One line for logs and benchmark tables: which path CUDA tensors take."""
    if os.environ.get("MERGECOMP_TRITON", "1").strip().lower() in ("0", "false", "no", "off"):
        return "torch ops (Triton kernels switched off by MERGECOMP_TRITON=0)"
    if not importable():
        return f"torch ops (triton does not import: {_import_error}; pip install mergecomp[gpu])"
    import triton
    return f"Triton {triton.__version__} kernels" + (" (interpreted)" if interpreting() else "")


@contextlib.contextmanager
def disabled():
    """Run the block on the torch paths (this thread only): to compare the two."""
    before = getattr(_switch, "off", False)
    _switch.off = True
    try:
        yield
    finally:
        _switch.off = before
