"""Give a replayed worker's freed heap memory back to the system, now and then.

Eight to thirty-two replayed workers share one host's memory.  Each grew by hundreds of
megabytes over an ``auto`` search although what it held alive grew little: the search
allocates and frees buffers of many sizes (its probes, then every plan it tries), and
glibc's malloc keeps memory freed between live blocks of its heap (and, once a large
block is freed, serves later blocks up to that size from the heap instead of their own
mappings).  ``malloc_trim(0)`` returns the free pages anywhere in the heap; called every
:data:`TRIM_EVERY_S` seconds from the replayed forward it costs milliseconds a minute and
nothing per allocation (fixing the mmap threshold instead would page-fault every large
buffer of every step).  Where the C library is not glibc it does nothing.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import time
from typing import Callable, Optional

#: Seconds between two trims of one worker's heap.
TRIM_EVERY_S = 30.0

_trim: Optional[Callable[[int], int]] = None
_looked = False


def release_free_heap() -> bool:
    """Return the heap's free pages to the system (glibc's ``malloc_trim(0)``); whether
    this C library has it."""
    global _trim, _looked
    if not _looked:
        _looked = True
        try:
            _trim = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
        except (OSError, AttributeError):
            _trim = None
    if _trim is None:
        return False
    _trim(0)
    return True


class HeapTrimmer:
    """Calls :func:`release_free_heap` from :meth:`maybe` at most once every ``every_s``
    seconds (the first call trims)."""

    def __init__(self, every_s: float = TRIM_EVERY_S, clock: Callable[[], float] = time.monotonic,
                 trim: Callable[[], bool] = release_free_heap):
        self.every_s, self._clock, self._trim = float(every_s), clock, trim
        self._last: Optional[float] = None
        self.trims = 0

    def maybe(self) -> None:
        now = self._clock()
        if self._last is None or now - self._last >= self.every_s:
            self._last = now
            self._trim()
            self.trims += 1
