"""The native backend: fused CPU kernels (``native_kernels.c``), loaded through ctypes.

The torch and numpy paths of QSGD, TernGrad and 1-bit SGD make 6 to 12 passes over the
data (sign test, packing, random bits, product, offsets, rounding, conversion, clamp,
unpacking, scaling); the C kernels read the input once and write the output once
(``benchmarks/compressors.py`` compares the two).

The library is built with the package (``pip install`` compiles it as an optional
extension, ``mergecomp/kernels/_native_kernels*.so``).  Without a C compiler
the build is skipped and every op keeps its torch/numpy path, which gives the same bits
(tests compare the two); 1-bit SGD's two means, being sums, differ in the last bits.  Set
``MERGECOMP_NATIVE=0`` to use the torch/numpy paths on purpose.

DGC's momentum correction (:func:`dgc_accumulate`) is fused the same way: the new momentum,
the new velocity and the velocity's block peaks, which DGC's selection reads next, in one
pass instead of three; and the selection itself (:func:`select_at_least`) reads the blocks
those peaks let through once, where the torch path gathers them and makes three passes.

The kernels take fp32 (the sign kernels any 2-, 4- or 8-byte float) contiguous CPU
tensors; the ops of :mod:`mergecomp.kernels` check :func:`usable` and keep
their torch path for anything else (GPU tensors above all).  ctypes releases the GIL
during each call, so communicator threads can compress groups side by side.  Compressors
never call this module: they call the ops, which pick the backend.
"""
from __future__ import annotations

import contextlib
import ctypes
import importlib.util
import os
import threading
from typing import TYPE_CHECKING, Optional, Tuple

import torch

if TYPE_CHECKING:
    from .scratch import Scratch

#: Must equal ``mc_abi_version()`` in native_kernels.c: a stale build is not loaded.
ABI_VERSION = 5

_EXTENSION = "mergecomp.kernels._native_kernels"
_i64, _int, _u32, _ptr = ctypes.c_int64, ctypes.c_int, ctypes.c_uint32, ctypes.c_void_p
_SIGNATURES = {
    "mc_pack_signs": (_ptr, _i64, _int, _ptr),
    "mc_onebit_encode": (_ptr, _i64, _ptr, _ptr, _ptr),
    "mc_decode_bits": (_ptr, _i64, _ptr, _int, _ptr),
    "mc_bucket_peaks": (_ptr, _i64, _i64, _ptr),
    "mc_bucket_norms": (_ptr, _i64, _i64, _ptr),
    "mc_stochastic_codes": (_ptr, _i64, _i64, _ptr, _int, _u32, _int, _ptr),
    "mc_dequantize": (_ptr, _i64, _int, _i64, _ptr, _int, _ptr),
    "mc_dgc_accumulate": (_ptr, ctypes.c_float, _ptr, _ptr, _i64, ctypes.c_float, _int, _ptr, _ptr, _i64, _ptr),
    "mc_select_at_least": (_ptr, _i64, _i64, _ptr, ctypes.c_float, _ptr, _i64),
}
#: The kernels that return something (the others write their outputs and return nothing).
_RESULTS = {"mc_select_at_least": _i64}

_library: Optional[ctypes.CDLL] = None
_load_error: Optional[str] = None
_loaded = False


def _load() -> Tuple[Optional[ctypes.CDLL], Optional[str]]:
    if os.environ.get("MERGECOMP_NATIVE", "1").strip().lower() in ("0", "false", "no", "off"):
        return None, "disabled by MERGECOMP_NATIVE"
    spec = importlib.util.find_spec(_EXTENSION)
    if spec is None or not spec.origin:
        return None, ("not built: reinstall mergecomp where a C compiler is present "
                      "(pip install -e .) to compile mergecomp/kernels/native_kernels.c")
    try:
        library = ctypes.CDLL(spec.origin)
        version = library.mc_abi_version()
    except (OSError, AttributeError) as error:
        return None, f"cannot load {spec.origin}: {error}"
    if version != ABI_VERSION:
        return None, (f"{spec.origin} is a stale build (ABI {version}, expected {ABI_VERSION}): "
                      f"reinstall mergecomp to rebuild it")
    for name, argtypes in _SIGNATURES.items():
        function = getattr(library, name)
        function.argtypes = argtypes
        function.restype = _RESULTS.get(name)
    return library, None


def library() -> Optional[ctypes.CDLL]:
    """The loaded kernels, or None (see :func:`status` for why)."""
    global _library, _load_error, _loaded
    if not _loaded:
        _library, _load_error = _load()
        _loaded = True
    return _library


def status() -> str:
    """One line for logs and benchmark tables: which path the CPU quantisers take."""
    return "native C kernels" if library() is not None else f"torch/numpy kernels ({_load_error})"


_switch = threading.local()


def usable(tensor: torch.Tensor) -> bool:
    """Whether the kernels can take ``tensor``: a CPU tensor, with the library loaded (and
    not inside :func:`disabled` on this thread)."""
    return tensor.device.type == "cpu" and not getattr(_switch, "off", False) and library() is not None


@contextlib.contextmanager
def disabled():
    """Run the block on the torch/numpy paths (this thread only): to compare the two."""
    before = getattr(_switch, "off", False)
    _switch.off = True
    try:
        yield
    finally:
        _switch.off = before


def packed_nbytes(numel: int, bits: int) -> int:
    """⌈numel·bits/8⌉, as ``packing.packed_nbytes`` (not imported: packing imports this module)."""
    return (int(numel) * int(bits) + 7) // 8


def _address(tensor: torch.Tensor) -> int:
    return tensor.data_ptr()


def _flat_input(tensor: torch.Tensor, dtypes) -> torch.Tensor:
    if tensor.dtype not in dtypes:
        raise TypeError(f"native kernel expects {', '.join(map(str, dtypes))}, got {tensor.dtype}")
    return tensor.detach().reshape(-1).contiguous()


_SIGN_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def pack_signs(tensor: torch.Tensor) -> torch.Tensor:
    """⌈n/8⌉ new bytes: bit i (top bit first) is the IEEE sign bit of element i."""
    flat = _flat_input(tensor, _SIGN_DTYPES)
    out = torch.empty(packed_nbytes(flat.numel(), 1), dtype=torch.uint8)
    library().mc_pack_signs(_address(flat), flat.numel(), flat.element_size(), _address(out))
    return out


def onebit_encode(tensor: torch.Tensor) -> Tuple[torch.Tensor, float, float, int]:
    """(packed sign bits, Σx, Σ|x|, number of set sign bits) of an fp32 tensor, in one pass."""
    flat = _flat_input(tensor, (torch.float32,))
    out = torch.empty(packed_nbytes(flat.numel(), 1), dtype=torch.uint8)
    stats = (ctypes.c_double * 2)()
    negative = ctypes.c_int64()
    library().mc_onebit_encode(_address(flat), flat.numel(), _address(out), stats, ctypes.byref(negative))
    return out, stats[0], stats[1], negative.value


def _check_packed(packed: torch.Tensor, numel: int, bits: int) -> torch.Tensor:
    need = packed_nbytes(numel, bits)
    if packed.dtype != torch.uint8 or packed.numel() < need:
        raise ValueError(f"{numel} codes of {bits} bits need {need} packed uint8 bytes, got "
                         f"{packed.numel()} of {packed.dtype}: the payload was truncated or mismatched")
    return packed.reshape(-1).contiguous()


def decode_bits(packed: torch.Tensor, numel: int, values: torch.Tensor) -> torch.Tensor:
    """New flat tensor of ``values``' dtype: ``values[bit]`` for the first ``numel`` bits."""
    packed = _check_packed(packed, numel, 1)
    values = values.detach().to("cpu").contiguous()
    if values.numel() != 2 or values.element_size() not in (2, 4, 8):
        raise ValueError(f"decode_bits needs two values of a 2-, 4- or 8-byte dtype, got "
                         f"{values.numel()} of {values.dtype}")
    out = torch.empty(numel, dtype=values.dtype)
    library().mc_decode_bits(_address(packed), numel, _address(values), values.element_size(), _address(out))
    return out


def _check_buckets(numel: int, bucket_size: int, per_bucket: torch.Tensor, what: str) -> torch.Tensor:
    buckets = (numel + bucket_size - 1) // bucket_size
    per_bucket = per_bucket.detach().to(device="cpu", dtype=torch.float32).reshape(-1).contiguous()
    if per_bucket.numel() < buckets:
        raise ValueError(f"{numel} elements in buckets of {bucket_size} need {buckets} {what}, "
                         f"got {per_bucket.numel()}: the payload was truncated or mismatched")
    return per_bucket


def bucket_peaks(tensor: torch.Tensor, bucket_size: int) -> torch.Tensor:
    """max |x| of each bucket of ``bucket_size`` elements of an fp32 tensor, as fp32."""
    flat = _flat_input(tensor, (torch.float32,))
    out = torch.empty((flat.numel() + bucket_size - 1) // bucket_size, dtype=torch.float32)
    library().mc_bucket_peaks(_address(flat), flat.numel(), bucket_size, _address(out))
    return out


def bucket_norms(tensor: torch.Tensor, bucket_size: int) -> torch.Tensor:
    """‖bucket‖₂ of each bucket of an fp32 tensor (fp32 lanes, buckets whose squares
    overflow or vanish redone in double): within about an ulp of the torch path's norms."""
    flat = _flat_input(tensor, (torch.float32,))
    out = torch.empty((flat.numel() + bucket_size - 1) // bucket_size, dtype=torch.float32)
    library().mc_bucket_norms(_address(flat), flat.numel(), bucket_size, _address(out))
    return out


def stochastic_codes(tensor: torch.Tensor, bucket_size: int, factors: torch.Tensor, offset: int,
                     key: int, bits: int) -> torch.Tensor:
    """Packed ``bits``-bit codes min(⌊f_b·x + offset + ½ + r·2^-16⌋, 2·offset) of an fp32 tensor.

    r is the element's random lane of :func:`~mergecomp.kernels.quantize.random_int16`
    for ``key``: the same codes as ``quantize.stochastic_codes`` followed by ``pack_bits``.
    """
    flat = _flat_input(tensor, (torch.float32,))
    factors = _check_buckets(flat.numel(), bucket_size, factors, "factors")
    out = torch.empty(packed_nbytes(flat.numel(), bits), dtype=torch.uint8)
    library().mc_stochastic_codes(_address(flat), flat.numel(), bucket_size, _address(factors),
                                  offset, key, bits, _address(out))
    return out


def dequantize(packed: torch.Tensor, numel: int, bits: int, bucket_size: int, scales: torch.Tensor,
               offset: int) -> torch.Tensor:
    """New fp32 tensor: (c − offset)·scale_b for the first ``numel`` ``bits``-bit codes c."""
    packed = _check_packed(packed, numel, bits)
    scales = _check_buckets(numel, bucket_size, scales, "scales")
    out = torch.empty(numel, dtype=torch.float32)
    library().mc_dequantize(_address(packed), numel, bits, bucket_size, _address(scales), offset, _address(out))
    return out


def dgc_accumulate(gradient: torch.Tensor, momentum: torch.Tensor, velocity: torch.Tensor, factor: float,
                   nesterov: bool, new_momentum: torch.Tensor, new_velocity: torch.Tensor,
                   block: int, scale: float = 1.0) -> torch.Tensor:
    """DGC's momentum correction into ``new_momentum`` and ``new_velocity`` (contiguous fp32,
    written in place), returning the peak |new velocity| of each whole block of ``block``
    elements: u' = g + m·u, v' = v + u' (Nesterov: u' = m·(u + g), v' = v + u' + g) with
    g = ``gradient`` · ``scale`` (local clipping's factor; 1 leaves it as it is), the
    same bits as the torch ops of :class:`~mergecomp.memories.dgc.DGCMemory`."""
    g = _flat_input(gradient, (torch.float32,))
    u, v = _flat_input(momentum, (torch.float32,)), _flat_input(velocity, (torch.float32,))
    n = g.numel()
    for out in (new_momentum, new_velocity):
        if out.dtype != torch.float32 or not out.is_contiguous() or out.numel() != n:
            raise ValueError(f"dgc_accumulate writes {n} contiguous fp32 elements, got an output of "
                             f"{out.numel()} {out.dtype} (contiguous: {out.is_contiguous()})")
    if u.numel() != n or v.numel() != n:
        raise ValueError(f"dgc_accumulate needs momentum and velocity of {n} elements, got "
                         f"{u.numel()} and {v.numel()}")
    peaks = torch.empty(n // block, dtype=torch.float32, device=g.device)
    library().mc_dgc_accumulate(_address(g), float(scale), _address(u), _address(v), n, float(factor), int(bool(nesterov)),
                                _address(new_momentum), _address(new_velocity), block, _address(peaks))
    return peaks


def select_at_least(tensor: torch.Tensor, peaks: torch.Tensor, block: int, threshold: float,
                    scratch: "Scratch") -> torch.Tensor:
    """Ascending int64 indices i of a flat fp32 tensor with |x_i| ≥ ``threshold``, testing only
    the whole blocks of ``block`` elements whose peak (``peaks``, fp32, one per whole block)
    passes, and the tail: the indices of the torch path's gather, compare and compaction.

    The indices are written into ``scratch``'s buffer (grown, and the selection read again,
    when more pass than it holds) and returned as a new tensor of their own.
    """
    flat = _flat_input(tensor, (torch.float32,))
    n = flat.numel()
    whole = n // block if block > 0 else 0
    if peaks.dtype != torch.float32 or not peaks.is_contiguous() or peaks.numel() != whole:
        raise ValueError(f"select_at_least needs the fp32 peaks of the {whole} whole blocks of {block} "
                         f"elements, got {peaks.numel()} {peaks.dtype}")
    call = library().mc_select_at_least
    out = scratch.at_least("selected", max(whole, 4096), torch.int64, flat.device)
    count = call(_address(flat), n, block, _address(peaks), float(threshold), _address(out), out.numel())
    if count > out.numel():
        out = scratch.at_least("selected", count, torch.int64, flat.device)
        count = call(_address(flat), n, block, _address(peaks), float(threshold), _address(out), out.numel())
    return out[:count].clone()
