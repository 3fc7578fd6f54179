"""Keep a loaded model's Python objects out of the cyclic garbage collector's walks.

A loaded model with its libraries (numba, numpy, the tokenizer, the expert caches' entries) is about
a million tracked Python objects. Each full collection walked them all: 0.37 s on the GPU machine,
landing inside a decode step every few dozen steps (docs/benchmarks.md). `hold()` after a load moves
every object alive then into the collector's permanent generation (gc.freeze); objects made later,
per request, are collected as usual. `release()` at a close, or when an engine is dropped
unclosed, gives every frozen object back (gc.unfreeze), so that reference cycles among the engine's
objects, weights included, are freed once it is gone. The engines still loaded are then walked
again until the next load freezes them (a close cannot refreeze at once: the closing engine is
still referenced then).
"""

from __future__ import annotations

import gc
import threading

_lock = threading.Lock()


def hold() -> None:
    with _lock:
        gc.freeze()


def release() -> None:
    with _lock:
        gc.unfreeze()
