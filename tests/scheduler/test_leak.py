"""Issue 25, item 1: memory stays flat over load/unload cycles (a daemon runs for weeks).

Each cycle is a Load with keep_alive=0 (the model unloads at once) through the scheduler, on the
qwen3moe fixture. Before the fix, daemon.heap froze every object alive at a load, the previous
engine's reference cycles included, and unfroze them at the next close: that garbage never met a
full collection, and each cycle kept its expert cache's arena (+5 MB and +456 objects a cycle).

Measured after each unload: RSS, as a least-squares slope over the last 100 of 200 cycles; the
objects the collector tracks, frozen or not, after a collection of the young generations only (a
full one would free the very garbage that leaked). The cycles run in a child process with glibc's
malloc thresholds fixed at 1 MiB: by default glibc raises them as large buffers are freed, and then
each thread's arena keeps up to twice the largest freed buffer resident at its top; each load has
new threads, so RSS moved in steps of the fixture's arena (+-5 MB, a slope of +-150 KB a cycle)
with nothing alive. Fixed, RSS is what is alive. benchmarks/leak.py runs the same cycles through
the daemon and its client library, with glibc's defaults.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.fixtures.build import fixture_path

pytestmark = pytest.mark.usefixtures("warm_kernels")  # the child loads the compiled kernels

ROOT = Path(__file__).resolve().parents[2]
CYCLES = 200
TAIL = 100  # the slopes are taken over the last TAIL cycles
# One cycle's leaked arena was 5 MB before the fix. 20 KB a cycle is five pages: less than any
# buffer of an engine, and above the readings' drift once fixed (under 3 KB a cycle here).
RSS_SLOPE_BYTES = 20_000
# Every engine's objects are gone after its unload, so the count comes back to the same figure
# (readings differ by up to ~100, what the last old-generation collection left; as a slope over
# 100 cycles that is under 0.2). One object kept a cycle fails.
OBJECTS_SLOPE = 0.5
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": str(1 << 20), "MALLOC_TRIM_THRESHOLD_": str(1 << 20)}


@pytest.fixture(scope="module")
def model(fixture_dir) -> str:
    return str(fixture_path("qwen3moe", "Q8_0", fixture_dir))


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def tracked_objects() -> int:
    import gc

    gc.collect(1)  # the young generations: what is left there is alive or in the old one
    return len(gc.get_objects()) + gc.get_freeze_count()


async def cycles(model: str, n: int) -> tuple[list[int], list[int]]:
    """RSS and tracked objects after each of n Load(keep_alive=0) cycles (in the child)."""
    from daemon.scheduler import Scheduler
    from tests.scheduler.test_scheduler import Factory, settings

    s = Scheduler(settings(), factory=Factory())
    rss, objects = [], []
    try:
        for _ in range(n):
            m, _ = await s.load(model, keep_alive=0)
            await m.batcher.stopped  # unloaded: its compute thread has closed the engine
            rss.append(rss_bytes())
            objects.append(tracked_objects())
    finally:
        await s.close()
    assert s.registry.loads == n
    return rss, objects


CHILD = ("import asyncio, json, sys; from tests.scheduler.test_leak import cycles; "
         "print(json.dumps(asyncio.run(cycles(sys.argv[1], int(sys.argv[2])))))")


def slope(ys: list[int]) -> float:
    return float(np.polyfit(np.arange(len(ys)), np.asarray(ys, np.float64), 1)[0])


def test_load_unload_cycles_keep_memory_flat(model):
    out = subprocess.run([sys.executable, "-c", CHILD, model, str(CYCLES)], cwd=ROOT, capture_output=True,
                         text=True, env={**os.environ, **MALLOC_ENV}, timeout=600)
    assert out.returncode == 0, out.stderr[-4000:]
    rss, objects = json.loads(out.stdout.splitlines()[-1])
    rss_slope, objects_slope = slope(rss[-TAIL:]), slope(objects[-TAIL:])
    said = (f"over the last {TAIL} of {CYCLES} cycles: RSS {rss_slope / 1e3:+.1f} KB a cycle, "
            f"tracked objects {objects_slope:+.1f} a cycle")
    assert rss_slope < RSS_SLOPE_BYTES, said
    assert objects_slope < OBJECTS_SLOPE, said


async def test_an_unload_freezes_the_models_still_loaded_again(model, tmp_path):
    """The close gives every frozen object back (the closing engine's cycles must be freed); once
    that engine is gone, the models still loaded are frozen again instead of being walked by every
    full collection (0.37 s inside a decode step on the GPU machine) until the next load."""
    import gc
    import shutil

    from daemon.scheduler import Scheduler
    from tests.scheduler.test_scheduler import Factory, settings

    other = str(shutil.copyfile(model, tmp_path / "other.gguf"))
    s = Scheduler(settings(), factory=Factory())
    try:
        await s.load(model, keep_alive=-1)
        m, _ = await s.load(other, keep_alive=0)
        await m.batcher.stopped
        frozen = gc.get_freeze_count()
        assert [x.path for x in s.registry.models.values()] == [os.path.realpath(model)]
    finally:
        await s.close()
        gc.unfreeze()
    assert frozen > 10_000, f"{frozen} objects frozen with a model loaded"


async def test_an_unloaded_engine_in_a_reference_cycle_is_freed_at_its_unload(model):
    """A model whose engine is in a reference cycle (a backend's objects may be) gives its memory,
    VRAM included, back at its unload, not at the collector's next full collection."""
    import gc
    import weakref

    from daemon.scheduler import Scheduler
    from tests.scheduler.test_scheduler import Factory, settings

    engines = []

    def cyclic(path, **kw):
        engine = Factory()(path, **kw)
        engine.itself = engine
        engines.append(weakref.ref(engine))
        return engine
    s = Scheduler(settings(), factory=cyclic)
    gc.disable()  # only the daemon's own collections count
    try:
        m, _ = await s.load(model, keep_alive=0)
        await m.batcher.stopped
        alive = engines[0]() is not None
    finally:
        gc.enable()
        await s.close()
    assert not alive
