"""Host-to-device expert copies: pinned host memory, a fetch stream, events.

Copies are driver calls from page-locked memory: numba's own `copy_to_device` spends ~150 us of
host time per call (7-34 GB/s for 1-5 MB experts), cuMemcpyHtoDAsync 5-11 us (47-53 GB/s, 86-97%
of the pinned peak; benchmarks/gpu_h2d.py). A layer's scattered expert slices go as one
cuMemcpyBatchAsync (CUDA 12.8+ drivers; else one call each): on the H100, 12 copies of 1.7 MB ran
at 50.5 GB/s as one batch against 42 GB/s issued one by one. `copy_many` batches copies between
any two unified addresses the same way (the host tier's promotions: mapped host rows into VRAM
slots). They run on a fetch stream of their
own, so the compute stream goes on while they fly; an `Event` recorded after a copy lets the
compute stream wait for exactly that copy (cuStreamWaitEvent), and the host ask whether it is
done (cuEventQuery) without waiting.

Under numba's simulator (CI) there is no driver: copies are synchronous and every event is done.

Legend: n = bytes.
"""

from __future__ import annotations

import ctypes
import logging
import weakref

import numpy as np
from numba import cuda

from ..kernels.cuda.device import SIM
from .cuda_graphs import _check, _drv  # the driver (imported on first use) and its error check

log = logging.getLogger("moed.device")

_pinned_warned = False
_pinned_live = [0]  # page-locked bytes whose buffers are alive (benchmarks/leak.py)


def pinned_bytes() -> int:
    """Page-locked host bytes made by pinned_empty and not yet dropped (numba may hold a dropped
    buffer in its deallocation queue a while longer)."""
    return _pinned_live[0]


def _unpinned(n: int) -> None:
    _pinned_live[0] -= n


def pinned_empty(shape, dtype=np.uint8) -> np.ndarray:
    """An uninitialised host array in page-locked memory (copies need no staging), or ordinary
    memory when that fails (copies stay correct, at pageable speed; logged once)."""
    global _pinned_warned
    if SIM:
        return np.empty(shape, dtype)
    try:
        arr = cuda.pinned_array(shape, dtype)
        owner = arr.base if arr.base is not None else arr  # numba's buffer: views keep it, not arr
        try:
            weakref.finalize(owner, _unpinned, arr.nbytes)
            _pinned_live[0] += arr.nbytes
        except TypeError:  # an owner without weak references: not counted
            pass
        return arr
    except Exception as e:  # noqa: BLE001  (out of lockable memory: serve from pageable memory)
        if not _pinned_warned:
            _pinned_warned = True
            log.warning("page-locked host memory for %s bytes failed (%s): expert copies run from pageable "
                        "memory, several times slower", int(np.prod(shape)) * np.dtype(dtype).itemsize, e)
        return np.empty(shape, dtype)


class _Loc(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _CopyAttributes(ctypes.Structure):  # CUmemcpyAttributes
    _fields_ = [("src_access_order", ctypes.c_int), ("src_loc_hint", _Loc), ("dst_loc_hint", _Loc),
                ("flags", ctypes.c_uint)]


_STREAM_ORDER = 1  # CU_MEMCPY_SRC_ACCESS_ORDER_STREAM: the source is read in stream order (as cuMemcpyHtoDAsync)
_batch_copy = None  # libcuda's cuMemcpyBatchAsync_v2 (ctypes), False when the driver has none


def _batch_fn():
    global _batch_copy
    if _batch_copy is None:
        try:
            f = ctypes.CDLL("libcuda.so.1").cuMemcpyBatchAsync_v2
        except (OSError, AttributeError):
            _batch_copy = False
        else:
            f.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_size_t, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t,
                                                  ctypes.c_void_p]
            f.restype = ctypes.c_int
            f.attrs = _CopyAttributes(_STREAM_ORDER, _Loc(0, 0), _Loc(0, 0), 0)  # one entry for every copy
            f.first = (ctypes.c_size_t * 1)(0)
            _batch_copy = f
    return _batch_copy


def _no_batch() -> None:
    global _batch_copy
    _batch_copy = False


class Event:
    """A CUDA event (disabled timing unless asked), recorded again and again; None handle under
    the simulator."""

    __slots__ = ("handle",)

    def __init__(self, timing: bool = False):
        if SIM:
            self.handle = None
            return
        drv = _drv()
        flags = drv.CUevent_flags.CU_EVENT_DEFAULT if timing else drv.CUevent_flags.CU_EVENT_DISABLE_TIMING
        self.handle = _check(drv.cuEventCreate(flags.value))

    def __del__(self):
        if getattr(self, "handle", None) is not None:
            try:
                _drv().cuEventDestroy(self.handle)
            except Exception:  # noqa: BLE001  (interpreter shutdown)
                pass


class Transfers:
    """Copies on the fetch stream (the compute stream itself when not `dedicated`). `fault`, when
    set (tests), is called before each copy and may raise to inject a copy failure."""

    def __init__(self, compute_stream, dedicated: bool = True):
        from .cuda_graphs import nonblocking_stream

        self.compute = compute_stream
        self.dedicated = dedicated and not SIM
        self.fetch = nonblocking_stream() if self.dedicated else compute_stream
        self.fault = None

    def h2d(self, dst, src: np.ndarray, offset: int = 0) -> None:
        """Bytes offset.. of dst (a flat uint8 device array) <- src (a C-contiguous host array), on
        the fetch stream. src must stay as it is until an event recorded after this is done."""
        if self.fault is not None:
            self.fault()
        n = int(src.nbytes)
        if offset + n > int(dst.nbytes):
            raise ValueError(f"a copy of {n} bytes at {offset} into {int(dst.nbytes)}")
        if SIM:
            dst[offset:offset + n].copy_to_device(src.reshape(-1).view(np.uint8))
        else:
            _check(_drv().cuMemcpyHtoDAsync(int(dst.gpu_data.device_pointer) + offset, src.ctypes.data, n,
                                            int(self.fetch.handle)))

    def h2d_many(self, dst, copies: list) -> None:
        """h2d of every (offset, src) in copies, as one driver call where the driver has it; the
        copies may run in any order among themselves (their ranges of dst must not overlap)."""
        if len(copies) < 2 or SIM or not _batch_fn():
            for offset, src in copies:
                self.h2d(dst, src, offset)
            return
        table = np.empty((3, len(copies)), np.uint64)  # destinations, sources, sizes
        base, end = int(dst.gpu_data.device_pointer), int(dst.nbytes)
        for i, (offset, src) in enumerate(copies):
            if self.fault is not None:
                self.fault()
            size = int(src.nbytes)
            if offset + size > end:
                raise ValueError(f"a copy of {size} bytes at {offset} into {end}")
            table[0, i], table[1, i], table[2, i] = base + offset, src.ctypes.data, size
        if not self._batch(table):
            for offset, src in copies:
                self.h2d(dst, src, offset)

    def copy_many(self, copies: list) -> None:
        """dst <- src for every (dst, src) in copies: C-contiguous arrays of equal size in VRAM or
        in mapped host memory (unified addresses), on the fetch stream, as one driver call where
        the driver has it, else one cuMemcpyAsync each; in any order among themselves."""
        for dst, src in copies:
            if self.fault is not None:
                self.fault()
            if int(dst.nbytes) != int(src.nbytes):
                raise ValueError(f"a copy of {int(src.nbytes)} bytes into {int(dst.nbytes)}")
        if SIM:
            for dst, src in copies:
                dst.copy_to_device(src)
            return
        table = np.array([[int(d.gpu_data.device_pointer) for d, _ in copies],
                          [int(s.gpu_data.device_pointer) for _, s in copies],
                          [int(d.nbytes) for d, _ in copies]], np.uint64)
        if len(copies) > 1 and self._batch(table):
            return
        drv = _drv()
        for d, s, n in table.T.tolist():
            _check(drv.cuMemcpyAsync(d, s, n, int(self.fetch.handle)))

    def _batch(self, table: np.ndarray) -> bool:
        """The copies of table [3, n] (destination and source addresses, sizes) as one
        cuMemcpyBatchAsync on the fetch stream; False if the driver has none (nothing issued)."""
        f = _batch_fn()
        if not f:
            return False
        table = np.ascontiguousarray(table)
        err = f(table[0].ctypes.data, table[1].ctypes.data, table[2].ctypes.data, table.shape[1],
                ctypes.addressof(f.attrs), ctypes.addressof(f.first), 1, int(self.fetch.handle))
        if err == _drv().CUresult.CUDA_ERROR_NOT_SUPPORTED:  # a driver that names the call but lacks it
            _no_batch()
            return False
        if err:
            _check((_drv().CUresult(err),))
        return True

    @staticmethod
    def upload_into(dst, src: np.ndarray, stream) -> None:
        """The first src.nbytes bytes of a C-contiguous device array <- src, on `stream`. From ordinary
        memory (small arrays) the driver stages src before returning: it may change at once; from
        page-locked memory the copy reads src when it runs (and may be captured into a graph)."""
        src = np.ascontiguousarray(src)
        if SIM:
            flat = dst.reshape(-1) if dst.ndim > 1 else dst
            flat[:src.size].copy_to_device(src.reshape(-1), stream=stream)
            return
        _check(_drv().cuMemcpyHtoDAsync(int(dst.gpu_data.device_pointer), src.ctypes.data, int(src.nbytes),
                                        int(stream.handle)))

    @staticmethod
    def d2h(dst: np.ndarray, src, stream) -> None:
        """dst (a C-contiguous host array, page-locked when the stream is being captured) <- the
        first dst.nbytes bytes of a C-contiguous device array, in `stream`'s order."""
        if SIM:
            flat = src.reshape(-1) if src.ndim > 1 else src
            dst.reshape(-1)[:] = flat[:dst.size].copy_to_host(stream=stream)
            return
        _check(_drv().cuMemcpyDtoHAsync(dst.ctypes.data, int(src.gpu_data.device_pointer), int(dst.nbytes),
                                        int(stream.handle)))

    def record(self, event: Event, stream, external: bool = False) -> Event:
        """external: the stream is being captured and the event is one the host (or another
        stream) reads: recorded at each launch of the graph (CU_EVENT_RECORD_EXTERNAL)."""
        if event.handle is not None:
            drv = _drv()
            if external:
                _check(drv.cuEventRecordWithFlags(event.handle, int(stream.handle),
                                                  drv.CUevent_record_flags.CU_EVENT_RECORD_EXTERNAL.value))
            else:
                _check(drv.cuEventRecord(event.handle, int(stream.handle)))
        return event

    def wait(self, stream, event: Event, external: bool = False) -> None:
        """`stream` waits for `event` (its most recent record), not for the stream that recorded it.
        external: the stream is being captured and the event is recorded outside the graph: each
        launch waits on its record then (CU_EVENT_WAIT_EXTERNAL)."""
        if event.handle is not None:
            drv = _drv()
            flags = drv.CUevent_wait_flags.CU_EVENT_WAIT_EXTERNAL.value if external else 0
            _check(drv.cuStreamWaitEvent(int(stream.handle), event.handle, flags))

    def done(self, event: Event) -> bool:
        """Whether everything before the event's last record has run (never waits)."""
        if event.handle is None:
            return True
        drv = _drv()
        err = drv.cuEventQuery(event.handle)[0]
        if err == drv.CUresult.CUDA_SUCCESS:
            return True
        if err == drv.CUresult.CUDA_ERROR_NOT_READY:
            return False
        _check((err,))
        return False

    def synchronize(self, event: Event) -> None:
        if event.handle is not None:
            _check(_drv().cuEventSynchronize(event.handle))

    @staticmethod
    def elapsed_ms(start: Event, end: Event) -> float:
        """Milliseconds between two timing events, both done."""
        if start.handle is None or end.handle is None:
            return 0.0
        return float(_check(_drv().cuEventElapsedTime(start.handle, end.handle)))
