"""Issue 25, item 1: a closed ExpertCache gives its memory back at once, without waiting for a
full collection (daemon.heap froze such garbage with the next model, and it was never freed)."""

from __future__ import annotations

import gc
import weakref

from daemon.storage.cache import ExpertCache
from tests.storage.test_cache import m, make, settled  # noqa: F401 - fixtures


def test_close_frees_the_arenas_without_a_collection(m, make):  # noqa: F811
    """The I/O workers, cancelled at close, kept their frames (the last read's views of the
    arenas) in a reference cycle through their CancelledError."""
    c = make(3)
    c.prefetch(0, [1, 2])  # read on the I/O thread
    settled(c, 0)
    with c.fetch(0, [1, 2]) as b:
        m.check(b, 0, [1, 2])
    del b
    arenas = [weakref.ref(a) for lc in c._layers.values() if lc.arena is not None for a in lc.arena]
    assert arenas
    gc.disable()
    try:
        c.close()
        alive = sum(r() is not None for r in arenas)
    finally:
        gc.enable()
    assert alive == 0, f"{alive} of {len(arenas)} arenas outlive the close"


def test_a_closed_cache_is_not_in_a_reference_cycle(m):  # noqa: F811
    """Dropped after its close, the cache and its I/O thread's objects go by reference counting."""
    c = ExpertCache(m.store, 0.0, io_depth=3, demand_reads="io")
    with c.fetch(0, [1, 2]) as b:
        m.check(b, 0, [1, 2])
    del b
    gone = weakref.ref(c)
    gc.disable()
    try:
        c.close()
        del c
        alive = gone() is not None
    finally:
        gc.enable()
    assert not alive
