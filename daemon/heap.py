"""Keep a loaded model's Python objects out of the cyclic garbage collector's walks.

A loaded model with its libraries (numba, numpy, the tokenizer, the expert caches' entries) is about
a million tracked Python objects. Each full collection walked them all: 0.37 s on the GPU machine,
landing inside a decode step every few dozen steps (docs/benchmarks.md). `hold()` after a load moves
every object alive then into the collector's permanent generation (gc.freeze), after a full
collection: what is garbage then (the previous engine's reference cycles, given back at its close
and not yet collected) must not be frozen with it, or it is never freed (issue 25: +5 MB and +500
tracked objects a load/unload cycle on a tiny fixture, +13 MB on the demo, with no plateau). Objects made later, per request,
are collected as usual. `release()` at a close, or when an engine is dropped
unclosed, gives every frozen object back (gc.unfreeze), so that reference cycles among the engine's
objects, weights included, are freed once it is gone. A close cannot refreeze at once (the closing
engine is still referenced then): `settle()`, once the daemon's compute thread has dropped the
engine, collects and freezes the engines still loaded again, so they are not walked by every full
collection until the next load.

All three give the C heap's free pages back to the system (glibc's malloc_trim; nothing elsewhere):
an engine's buffers come from the malloc arenas of the threads that made them (each load has new
threads), and glibc keeps freed chunks resident. The top of a thread's arena stays as glibc's
thresholds decide, so RSS still moves by a few MB from one load to the next, within a bound.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import threading
from collections.abc import Callable

_lock = threading.Lock()


def _malloc_trim():
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or None).malloc_trim
    except (OSError, AttributeError):  # not glibc
        return None


_trim = _malloc_trim()
_held = [0]  # engines loaded: hold() without its release()


def hold() -> None:
    """After a load: collect (one pause at a load, so no garbage is frozen), then freeze."""
    with _lock:
        _held[0] += 1
        _freeze()


def release() -> None:
    """At a close: unfreeze, and give back what the close freed."""
    with _lock:
        _held[0] -= 1
        gc.unfreeze()
        trim()


def settle(dropped: Callable[[], object] | None = None) -> None:
    """A closed engine is dropped (`dropped`: a weak reference to it): freeze the engines still
    loaded again, after a collection, which frees the dropped one's cycles. With none loaded,
    collect only if the engine outlived its last reference (a cycle: its buffers, VRAM included,
    would wait for the collector's next full collection); give the freed pages back."""
    with _lock:
        if _held[0] > 0:
            _freeze()
            return
        if dropped is not None and dropped() is not None:
            gc.collect()
        trim()


def _freeze() -> None:
    gc.collect()
    trim()
    gc.freeze()


def trim() -> None:
    """Free pages of every malloc arena back to the system (glibc; a no-op elsewhere)."""
    if _trim is not None:
        _trim(0)
