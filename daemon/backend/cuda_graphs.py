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
"""

from __future__ import annotations

import logging
from collections import OrderedDict

from numba import cuda

from ..kernels.cuda.launch import forget_stream

log = logging.getLogger("moed.device")


_driver = None


def _drv():
    global _driver
    if _driver is None:  # imported on first use: the simulator has no driver
        from cuda.bindings import driver

        _driver = driver
    return _driver


def _check(result):
    """cuda.bindings returns (CUresult, values...): raise a CUDA error on failure, else the values."""
    err, *rest = result if isinstance(result, tuple) else (result,)
    drv = _drv()
    if err != drv.CUresult.CUDA_SUCCESS:
        from numba.cuda.cudadrv.driver import CudaAPIError

        _, name = drv.cuGetErrorName(err)
        raise CudaAPIError(int(err), name.decode() if isinstance(name, bytes) else str(name))
    return rest[0] if len(rest) == 1 else tuple(rest)


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
            forget_stream(self.handle)
            _drv().cuStreamDestroy(self.handle)
        except Exception:  # noqa: BLE001  (interpreter shutdown)
            pass


class Graph:
    """An instantiated graph, the arrays it reads and writes, and the step output it leaves."""

    def __init__(self, graph, exe, keep: list, out):
        self._graph, self._exe = graph, exe
        self.keep = keep  # every allocation made while capturing
        self.out = out  # the step's output array (rewritten by each launch)
        self.nbytes = sum(int(getattr(m, "size", 0)) for m in keep)  # the VRAM they hold

    def launch(self, stream) -> None:
        _check(_drv().cuGraphLaunch(self._exe, stream.handle))

    def __del__(self):
        try:
            drv = _drv()
            drv.cuGraphExecDestroy(self._exe)
            drv.cuGraphDestroy(self._graph)
        except Exception:  # noqa: BLE001
            pass


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

    def __len__(self) -> int:
        return len(self._graphs)

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

    def clear(self) -> None:
        """Every graph is stale (an array they use was reallocated)."""
        self._graphs.clear()
        self._seen.clear()

    def capture(self, key, stream, compute) -> Graph:
        """Record compute() (which launches on `stream` and returns the step's output array) as a
        graph, keeping every allocation it makes alive. Nothing runs until the graph is launched."""
        drv = _drv()
        ctx = cuda.current_context()
        keep: list = []
        plain = ctx.memalloc

        def recording(size):
            mem = plain(size)
            keep.append(mem)
            return mem

        mode = drv.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_RELAXED
        with ctx.defer_cleanup():  # no frees while capturing
            ctx.memalloc = recording  # an instance attribute over the class's method
            try:
                _check(drv.cuStreamBeginCapture(stream.handle, mode))
                try:
                    out = compute()
                finally:
                    graph = drv.cuStreamEndCapture(stream.handle)
                graph = _check(graph)
            finally:
                del ctx.memalloc
        exe = _check(drv.cuGraphInstantiate(graph, 0))
        g = Graph(graph, exe, keep, out)
        self._graphs[key] = g
        self.captures += 1
        while len(self._graphs) > self.limit:
            self._graphs.popitem(last=False)
        return g
