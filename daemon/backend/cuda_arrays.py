"""Op output arrays for the CUDA backend, cheap to make: buffers reused in stream order.

`cuda.device_array` costs ~40 us of host time (a cuMemAlloc, numba's layout object, context
checks) and slicing one as much; an eager step of a 48-layer MoE makes ~1000 of them, more host
time than its ~820 launches. Here:
- `OpArrays.empty` hands out buffers from per-size free lists, cuMemAlloc'd once. A buffer goes
  back to its list when the last array or view over it is dropped (numba's own reference count
  on the allocation, as for its arrays). Every op of a backend runs in order on the backend's one
  stream, so a buffer dropped by one op can be written by the next at once: the kernels that
  read it were queued before, and run before.
- `OpArray` is numba's DeviceNDArray made without its constructor's work: the layout object
  that numba's own methods use is made only when one of them needs it, and row slices and
  reshapes of C-contiguous arrays are computed directly.

While a graph is captured every array it uses must stay the graph's, so `plain` mode allocates
the usual way (cuda_graphs records those allocations and keeps them with the graph).

GPU only: numba's driver classes do not exist under its simulator (the backend then allocates as
usual). Buffers are held for the life of the backend (`held` bytes, reported with its VRAM); `trim()`
frees those not in use (the backend does after an eager step that left more than 256 MiB).
"""

from __future__ import annotations

import functools
import math
import weakref

import numpy as np
from numba import cuda
from numba.cuda.cudadrv import driver as _driver
from numba.cuda.cudadrv import dummyarray
from numba.cuda.cudadrv.devicearray import DeviceNDArray

_ALIGN = 256


class OpArray(DeviceNDArray):
    """A DeviceNDArray whose numba layout object is made on first use."""

    def __init__(self, shape, strides, dtype, stream=0, gpu_data=None):  # noqa: D107  (numba's signature)
        if isinstance(shape, int):
            shape = (shape,)
        if isinstance(strides, int):
            strides = (strides,)
        self.shape = shape = tuple(int(n) for n in shape)
        self.strides = tuple(int(s) for s in strides)
        self.dtype = dtype = np.dtype(dtype)
        self.ndim = len(shape)
        self.size = math.prod(shape)
        if self.strides == _c_strides(shape, dtype.itemsize):
            self.alloc_size = self.size * dtype.itemsize
        else:  # a view's extent, as numba counts it
            self.alloc_size = _driver.memory_size_from_info(shape, self.strides, dtype.itemsize)
        self.gpu_data = gpu_data
        self.stream = stream

    @functools.cached_property
    def _dummy(self):
        return dummyarray.Array.from_desc(0, self.shape, self.strides, self.dtype.itemsize)

    def _c_contiguous(self) -> bool:
        return self.strides == _c_strides(self.shape, self.dtype.itemsize)

    def __getitem__(self, item):
        """Rows r0:r1 of a C-contiguous array directly; anything else as numba does."""
        if isinstance(item, slice) and item.step in (None, 1) and self.ndim and self._c_contiguous():
            r0, r1, _ = item.indices(self.shape[0])
            r1 = max(r0, r1)
            row = self.strides[0]
            if r1 > r0 and self.size:
                data = self.gpu_data.view(r0 * row, r1 * row)
            else:
                data = self.gpu_data.view(0, 0)
            return OpArray((r1 - r0, *self.shape[1:]), self.strides, self.dtype, self.stream, data)
        return super().__getitem__(item)

    def reshape(self, *newshape, **kws):
        if len(newshape) == 1 and isinstance(newshape[0], (tuple, list)):
            newshape = newshape[0]
        if not kws and self._c_contiguous():
            newshape = _resolve_shape(tuple(newshape), self.size)
            return OpArray(newshape, _c_strides(newshape, self.dtype.itemsize), self.dtype, self.stream,
                           self.gpu_data)
        return super().reshape(*newshape, **kws)


def _c_strides(shape, itemsize) -> tuple:
    strides = []
    step = itemsize
    for n in reversed(shape):
        strides.append(step)
        step *= n
    return tuple(reversed(strides))


def _resolve_shape(shape: tuple, size: int) -> tuple:
    """A reshape's target with one -1 filled in; a wrong element count raises as numpy does."""
    if -1 in shape:
        known = math.prod(n for n in shape if n != -1)
        shape = tuple(size // known if n == -1 and known else n for n in shape)
    if math.prod(shape) != size:
        raise ValueError(f"cannot reshape an array of size {size} into shape {shape}")
    return shape


class OpArrays:
    """Output arrays of one stream's ops (see the module doc)."""

    def __init__(self):
        self._ctx = cuda.current_context()
        self._free: dict[int, list[int]] = {}  # buffer bytes -> free device pointers
        self._live: dict[int, object] = {}  # device pointer -> its AutoFreePointer (views count on it)
        self._held = [0]  # bytes of every buffer made, in use or free (shared with the finalizers)
        self._closed = [False]
        self.plain = False  # allocate the usual way (while capturing a graph)

    @property
    def held(self) -> int:
        return self._held[0]

    def empty(self, shape, dtype=np.float32) -> DeviceNDArray:
        """An uninitialised C-contiguous device array."""
        if self.plain:
            return cuda.device_array(shape, dtype)
        if isinstance(shape, int):
            shape = (shape,)
        dtype = np.dtype(dtype)
        nbytes = math.prod(shape) * dtype.itemsize
        if nbytes == 0:
            return cuda.device_array(shape, dtype)
        size = _bucket(nbytes)
        free = self._free.get(size)
        ptr = free.pop() if free else self._alloc(size)
        # the finalizer holds the lists, not self: dropping the pool frees it at once
        release = functools.partial(_release, self._ctx, self._free, self._live, self._held, self._closed, size, ptr)
        mem = _driver.AutoFreePointer(weakref.proxy(self._ctx), _driver.binding.CUdeviceptr(ptr), size,
                                      finalizer=release)
        self._live[ptr] = mem
        return OpArray(shape, _c_strides(shape, dtype.itemsize), dtype, 0, mem.own())

    def _alloc(self, size: int) -> int:
        try:
            ptr = _driver.driver.cuMemAlloc(size)
        except _driver.CudaAPIError:  # out of memory: give the unused buffers back and retry once
            self.trim()
            ptr = _driver.driver.cuMemAlloc(size)
        self._held[0] += size
        return int(ptr)

    def trim(self) -> None:
        """Free every buffer not in use. The frees go through numba's deallocation queue, which
        holds them while a graph is captured (a free there would break the capture) and frees
        after the work queued on them (cuMemFree waits for it)."""
        for size, ptrs in self._free.items():
            for ptr in ptrs:
                _free_later(self._ctx, size, ptr)
                self._held[0] -= size
            ptrs.clear()
        self._ctx.deallocations.clear()

    def __del__(self):
        try:
            self._closed[0] = True  # buffers still in use are freed when they are dropped
            self.trim()
        except Exception:  # noqa: BLE001  (interpreter shutdown, context gone)
            pass


def _release(ctx, free, live, held, closed, size: int, ptr: int) -> None:
    """An allocation's last reference is gone: its buffer goes back to the free list (or, once the
    pool is closed, to numba's deallocation queue)."""
    live.pop(ptr, None)
    if closed[0]:
        held[0] -= size
        _free_later(ctx, size, ptr)
    else:
        free.setdefault(size, []).append(ptr)


def _free_later(ctx, size: int, ptr: int) -> None:
    ctx.deallocations.add_item(_driver.driver.cuMemFree, _driver.binding.CUdeviceptr(ptr), size)


def _bucket(nbytes: int) -> int:
    """Buffer sizes: multiples of 256 B up to 64 KiB, then powers of two (few sizes, at most
    half of a buffer unused)."""
    if nbytes <= 1 << 16:
        return -(-nbytes // _ALIGN) * _ALIGN
    return 1 << (nbytes - 1).bit_length()
