"""Device arrays whose address range is reserved for their largest size, with memory mapped only
for the rows in use: growing maps more, and the array (its address, shape and strides) never
changes, so the CUDA graphs that captured it stay valid (the KV pool: cuda_cache.py).

    ReservedArray(shape, dtype): array [N, ...] over a range reserved for all N rows;
    rows 0..mapped_rows-1 are backed by VRAM (zeroed when mapped), the rest must not be touched.

Through CUDA's virtual memory management: cuMemAddressReserve once, then per growth one
cuMemCreate of the new part (a multiple of the allocation granularity, 2 MiB on Hopper), cuMemMap
at the end of what is mapped and cuMemSetAccess. The physical handles are released at once (the
mapping holds them) and freed when unmapped. Where the device has no virtual memory management, and
under the simulator, the whole array is allocated up front instead.
"""

from __future__ import annotations

import logging
import weakref

import numpy as np
from numba import cuda

from ..kernels.cuda.device import SIM, zero_fill
from .cuda_graphs import _check, _drv

log = logging.getLogger("moed.device")


class ReservedArray:
    """A device array [N, ...] whose rows past mapped_rows have an address but no memory yet."""

    def __init__(self, shape: tuple[int, ...], dtype):
        self.shape = tuple(int(n) for n in shape)
        self.dtype = np.dtype(dtype)
        self.row_bytes = int(np.prod(self.shape[1:], dtype=np.int64)) * self.dtype.itemsize
        self.mapped_rows = 0
        self._vm = _VirtualRange.make(self.shape[0] * self.row_bytes) if self.row_bytes and self.shape[0] else None
        if self._vm is None:  # the simulator, or no virtual memory management: all of it now
            self.array = cuda.device_array(self.shape, self.dtype)
            zero_fill(self.array)
        else:
            desc = {"shape": self.shape, "strides": None, "typestr": self.dtype.str,
                    "data": (self._vm.base, False), "version": 3}
            self.array = cuda.from_cuda_array_interface(desc, owner=self._vm, sync=False)

    @property
    def nbytes(self) -> int:
        """The VRAM it holds: what is mapped (under the simulator, as if mapped row by row), or all
        of it where the device cannot map."""
        if self._vm is not None:
            return self._vm.mapped
        return self.mapped_rows * self.row_bytes if SIM else int(self.array.nbytes)

    def grow(self, rows: int) -> None:
        """Rows 0..rows-1 (at most N) backed by zeroed VRAM (mapped_rows may end past rows: whole
        granules are mapped)."""
        rows = min(int(rows), self.shape[0])
        if rows <= self.mapped_rows:
            return
        if self._vm is None:
            self.mapped_rows = rows
            return
        self._vm.map_to(rows * self.row_bytes)
        self.mapped_rows = min(self.shape[0], self._vm.mapped // self.row_bytes)


class _VirtualRange:
    """A reserved address range, mapped from its start; unmapped and freed with its last owner."""

    _granularity: dict[int, int] = {}  # device ordinal -> bytes
    _unsupported: set[int] = set()

    @classmethod
    def make(cls, nbytes: int) -> _VirtualRange | None:
        if SIM:
            return None
        dev = cuda.get_current_device().id
        if dev in cls._unsupported:
            return None
        drv = _drv()
        if dev not in cls._granularity:
            attr = drv.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED
            if not _check(drv.cuDeviceGetAttribute(attr, dev)):
                log.warning("device %d has no virtual memory management: the KV cache is allocated whole", dev)
                cls._unsupported.add(dev)
                return None
            flag = drv.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_RECOMMENDED
            cls._granularity[dev] = int(_check(drv.cuMemGetAllocationGranularity(_props(dev), flag)))
        return cls(dev, nbytes, cls._granularity[dev])

    def __init__(self, dev: int, nbytes: int, granularity: int):
        drv = _drv()
        self.dev = dev
        self.granularity = granularity
        self.size = -(-nbytes // granularity) * granularity
        self.base = int(_check(drv.cuMemAddressReserve(self.size, granularity, 0, 0)))
        self._pieces: list[tuple[int, int]] = []  # (address, bytes) of each mapping, in order
        # freed through numba's queue of pending frees, as its own allocations are: never while a
        # graph is being captured (numba defers the queue then), whichever thread collects this
        ctx = cuda.current_context()
        weakref.finalize(self, ctx.deallocations.add_item, _release,
                         (_check(drv.cuCtxGetCurrent()), self.base, self.size, self._pieces))

    @property
    def mapped(self) -> int:
        return sum(n for _, n in self._pieces)

    def map_to(self, nbytes: int) -> None:
        """Map [mapped, nbytes) rounded up to the granularity (the range's end at most), zeroed."""
        start = self.mapped
        end = min(self.size, -(-nbytes // self.granularity) * self.granularity)
        if end <= start:
            return
        drv = _drv()
        n, at = end - start, self.base + start
        handle = _check(drv.cuMemCreate(n, _props(self.dev), 0))
        try:
            _check(drv.cuMemMap(at, n, 0, handle, 0))
        finally:
            _check(drv.cuMemRelease(handle))  # the mapping keeps the memory until it is unmapped
        try:
            _check(drv.cuMemSetAccess(at, n, [_access(self.dev)], 1))
            _check(drv.cuMemsetD8(at, 0, n))
            _check(drv.cuCtxSynchronize())  # zeroed before any stream reads it
        except BaseException:
            drv.cuMemUnmap(at, n)
            raise
        self._pieces.append((at, n))


def _release(what) -> None:
    """Unmap and free a range (its memory goes back) once the device is done with it, in the
    context it was made in. `what`: (context handle, base, size, mapped pieces)."""
    ctx, base, size, pieces = what
    try:
        drv = _drv()
        drv.cuCtxPushCurrent(ctx)
        try:
            (err,) = drv.cuCtxSynchronize()
            if err != drv.CUresult.CUDA_SUCCESS:  # the device may still read it: kept (leaked)
                return
            for at, n in pieces:
                drv.cuMemUnmap(at, n)
            drv.cuMemAddressFree(base, size)
        finally:
            drv.cuCtxPopCurrent()
    except Exception:  # noqa: BLE001 - the context is gone (interpreter shutdown): so is the memory
        pass


def _props(dev: int):
    drv = _drv()
    prop = drv.CUmemAllocationProp()
    prop.type = drv.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    prop.location.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    prop.location.id = dev
    return prop


def _access(dev: int):
    drv = _drv()
    desc = drv.CUmemAccessDesc()
    desc.location.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    desc.location.id = dev
    desc.flags = drv.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
    return desc
