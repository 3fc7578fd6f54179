"""CUDA streams and graphs for the CUDA backend: decode steps replayed without Python.

Launching a kernel through numba's dispatcher costs tens of microseconds of host time, and a
decode step of a 48-layer MoE launches about 1250 kernels: the host, not the GPU, sets the pace.
So a decode step of a given shape is run once eagerly (compiling what it needs), captured the
second time (its launches recorded into a CUDA graph, nothing computed), and from then on replayed:
one cuGraphLaunch per step, with the step's inputs (token ids, positions, KV slots) copied into
the device buffers the graph reads.

A captured graph holds the addresses of every array its kernels touch, so
- the arrays allocated while capturing (activations, scratch) are kept alive with the graph
  (`capture` records each allocation of the numba context while it runs);
- anything the backend reallocates (the KV pool when it grows, the attention scratch) makes its
  graphs stale: the backend clears them;
- the step must not read anything back to the host while capturing (the backend's router then
  returns no host ids, and the model only asks for graphs when nothing needs them).

Captures use a non-blocking stream (numba's own streams serialize against the legacy default
stream, which capturing forbids) in relaxed mode, so allocations may happen while capturing.

A step that must decide something on the host while it runs (which experts to copy into VRAM,
once the router has chosen them: cuda_expert_cache.py) is captured in segments: each host point
(`GraphCache.cutting(fn, sync)`, called by the backend's host_point while capturing) ends one
graph and begins the next, and a launch runs segment, host work, segment, ... The host work only
enqueues copies and events and writes the small buffers the next segment reads, so the kernels,
their arguments and their bits are those of the eager step.
"""

from __future__ import annotations

import logging
import time
from collections import Counter, OrderedDict

from numba import cuda

from ..kernels.cuda.driver import check as _check, drv as _drv  # noqa: F401  (the backend modules import these names)


log = logging.getLogger("moed.device")



def nonblocking_stream():
    """A numba stream made with CU_STREAM_NON_BLOCKING (destroyed with the returned owner)."""
    drv = _drv()
    cuda.current_context()  # the stream belongs to this thread's numba context (made if none yet)
    handle = _check(drv.cuStreamCreate(drv.CUstream_flags.CU_STREAM_NON_BLOCKING.value))
    stream = cuda.external_stream(int(handle))
    stream._moed_owner = _StreamOwner(handle)  # noqa: SLF001  (destroys the handle with the stream)
    return stream


class _StreamOwner:
    def __init__(self, handle):
        self.handle = handle

    def __del__(self):
        try:
            _drv().cuStreamDestroy(self.handle)
        except Exception:  # noqa: BLE001  (interpreter shutdown)
            pass


class HostClock:
    """Where a segmented replay's host time went: blocked on the GPU at host points that read what
    the segments before wrote (blocked_s), and everything else (busy_s: the host work between
    segments and their launches). A plain graph's launch counts as busy."""

    __slots__ = ("busy_s", "blocked_s", "marks")

    def __init__(self):
        self.busy_s = self.blocked_s = 0.0
        self.marks = None  # benchmarks: a list, and each one-segment launch adds its (start, end) timing events

    def gpu_ms(self) -> list[float]:
        """Each marked launch's GPU time, start to end (after the stream has passed them)."""
        from .cuda_transfer import Transfers

        return [Transfers.elapsed_ms(a, b) for a, b in self.marks or ()]


class Graph:
    """An instantiated step: its segments (one, unless captured with host points) and the host work
    between them, the arrays they read and write, and the step output they leave."""

    def __init__(self, items: list, keep: list, out):
        self._items = items  # in launch order: (graph, exe) of a segment, or (fn, sync) host work
        self.keep = keep  # every allocation made while capturing
        self.out = out  # the step's output array (rewritten by each launch)
        self.nbytes = sum(int(getattr(m, "size", 0)) for m in keep)  # the VRAM they hold
        self.segments = sum(not isinstance(b, bool) for _, b in items)

    def launch(self, stream, clock: HostClock) -> None:
        drv = _drv()
        handle = stream.handle
        now = time.perf_counter
        t = now()
        marked = clock.marks is not None and self.segments == 1  # the host works inside segmented ones
        if marked:
            from .cuda_transfer import Event

            clock.marks.append((Event(timing=True), Event(timing=True)))
            _check(drv.cuEventRecord(clock.marks[-1][0].handle, handle))
        for a, b in self._items:
            if isinstance(b, bool):  # host work: fn, sync
                if b:  # the host reads what the segments before wrote
                    t0 = now()
                    _check(drv.cuStreamSynchronize(handle))
                    t1 = now()
                    clock.busy_s += t0 - t
                    clock.blocked_s += t1 - t0
                    t = t1
                a()
            else:
                _check(drv.cuGraphLaunch(b, handle))
        if marked:
            _check(drv.cuEventRecord(clock.marks[-1][1].handle, handle))
        clock.busy_s += now() - t

    def __del__(self):
        try:
            drv = _drv()
            for graph, exe in self._items:
                if not isinstance(exe, bool):
                    drv.cuGraphExecDestroy(exe)
                    drv.cuGraphDestroy(graph)
        except Exception:  # noqa: BLE001
            pass


_MARGIN = 16  # graphs beyond a warm-up's, for the shapes first met in serving


class GraphCache:
    """Graphs by step key, least recently used dropped past `limit`. A key is captured on its
    second sighting (the first runs eagerly: kernels compile, one-time buffers are made)."""

    def __init__(self, limit: int = 32):
        self.limit = limit
        self._graphs: OrderedDict = OrderedDict()
        self._seen: set = set()
        self.failed: set = set()  # keys whose capture failed: always eager
        self.captures = 0
        self.replays = 0
        self.dropped: Counter = Counter()  # why graphs were dropped: clear(reason) and "evicted"
        self.clock = HostClock()  # the replays' host time
        self.cutting = None  # while a segmented capture runs: cut(fn, sync) ends a segment there

    def keep_at_least(self, n: int) -> None:
        """Room for n graphs besides the limit's margin: a warm-up's set is not evicted by itself
        (a hybrid's, each unpadded batch size at each context, is 48)."""
        self.limit = max(self.limit, n + _MARGIN)

    def __len__(self) -> int:
        return len(self._graphs)

    def keys(self) -> set:
        """The keys of the graphs held."""
        return set(self._graphs)

    @property
    def nbytes(self) -> int:
        """VRAM held by the graphs' own arrays (activations and scratch of their steps)."""
        return sum(g.nbytes for g in self._graphs.values())

    def get(self, key) -> Graph | None:
        g = self._graphs.get(key)
        if g is not None:
            self._graphs.move_to_end(key)
        return g

    def first_sighting(self, key) -> bool:
        if key in self._seen:
            return False
        self._seen.add(key)
        return True

    def clear(self, reason: str = "") -> None:
        """Every graph is stale (an array they use was reallocated, named by `reason`)."""
        self.dropped[reason or "cleared"] += len(self._graphs)
        self._graphs.clear()
        self._seen.clear()

    def capture(self, key, stream, compute, segmented: bool = False) -> Graph:
        """Record compute() (which launches on `stream` and returns the step's output array) as a
        graph, keeping every allocation it makes alive. Nothing runs until the graph is launched.
        segmented: compute's host points (self.cutting) split it into segments."""
        drv = _drv()
        ctx = cuda.current_context()
        keep: list = []
        plain = ctx.memalloc
        mode = drv.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_RELAXED
        items: list = []  # (graph, None) per segment until instantiated, (fn, sync) per host point
        open_ = [False]

        def recording(size):
            mem = plain(size)
            keep.append(mem)
            return mem

        def begin():
            _check(drv.cuStreamBeginCapture(stream.handle, mode))
            open_[0] = True

        def end():
            open_[0] = False
            graph = _check(drv.cuStreamEndCapture(stream.handle))
            if _check(drv.cuGraphGetNodes(graph, 0))[1] == 0:  # nothing since the last host point
                drv.cuGraphDestroy(graph)
            else:
                items.append((graph, None))

        def cut(fn, sync):
            end()
            items.append((fn, sync))
            begin()

        try:
            with ctx.defer_cleanup():  # no frees while capturing
                ctx.memalloc = recording  # an instance attribute over the class's method
                self.cutting = cut if segmented else None
                try:
                    begin()
                    out = compute()
                    end()
                finally:
                    self.cutting = None
                    if open_[0]:  # compute raised: the capture is abandoned
                        err, graph = drv.cuStreamEndCapture(stream.handle)
                        if err == drv.CUresult.CUDA_SUCCESS and graph is not None:
                            drv.cuGraphDestroy(graph)
                    del ctx.memalloc
            for i, (a, b) in enumerate(items):
                if b is None:
                    items[i] = (a, _check(drv.cuGraphInstantiate(a, 0)))
        except BaseException:
            for a, b in items:
                if not isinstance(b, bool):
                    if b is not None:
                        drv.cuGraphExecDestroy(b)
                    drv.cuGraphDestroy(a)
            raise
        g = Graph(items, keep, out)
        self._graphs[key] = g
        self.captures += 1
        while len(self._graphs) > self.limit:
            self._graphs.popitem(last=False)
            self.dropped["evicted"] += 1
        return g
