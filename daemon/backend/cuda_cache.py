"""The CUDA backend's KV cache: a per-model pool of sequence slots in VRAM, one f16 array pair per
layer in the slot layout of daemon/kernels/cuda/attention.py:

    k[il]: f16 [S, Hkv, C, Dh]    v[il]: f16 [S, Hkv, C, Dv]

A sequence (DeviceKVCache) owns one slot index, the same in every layer, from creation until it
is garbage-collected (the scheduler drops a finished sequence's cache: the slot is free again).
A decode step hands the attention kernel each row's slot, so one launch reads every sequence of
the step. Stale cells of a reused slot are never read: a sequence writes cell j before any of
its rows can see it.

The pool grows on demand: slots double when all are taken, cells double (from FIRST_CELLS) up
to the largest n_ctx asked for, as the CPU cache grows; growing copies the cells on the device.

Legend: L = layers, S = slots, C = cells (positions) per slot, Hkv = key/value heads, Dh = key
head size, Dv = value head size.
"""

from __future__ import annotations

import threading
import weakref

import numpy as np
from numba import cuda
from numba.cuda.cudadrv import driver

from ..errors import DeviceError
from ..kernels.cuda.device import SIM
from .cache import SequenceCache
from .cuda_errors import CUDA_ERRORS

# cells allocated up front (fewer if n_ctx is smaller): the CPU cache's 256; under the simulator,
# which runs every device thread in Python, 16 so that tests cross a growth on few rows
FIRST_CELLS = 16 if SIM else 256
FIRST_SLOTS = 4
_THREADS = 256


@cuda.jit
def _copy_cells(old, new):
    """new[s, h, c, d] = old[s, h, c, d] over old's shape (f16 [S, Hkv, C, D] each)."""
    i = cuda.grid(1)
    S, H, C, D = old.shape
    if i < S * H * C * D:
        d = i % D
        c = (i // D) % C
        h = (i // (D * C)) % H
        s = i // (D * C * H)
        new[s, h, c, d] = old[s, h, c, d]


class KVPool:
    """Every layer's KV arrays for S sequence slots of C cells. on_grow(delta_bytes) is told of
    each reallocation (the backend's VRAM tally)."""

    def __init__(self, n_layer: int, n_head_kv: int, head_dim: int, head_dim_v: int, slots: int = FIRST_SLOTS,
                 on_grow=None):
        self.shape = (n_layer, n_head_kv, head_dim, head_dim_v)
        self.on_grow = on_grow or (lambda _delta: None)
        self.k: list = []  # [L] device f16 [S, Hkv, C, Dh]
        self.v: list = []
        self.slots = 0
        self.cells = 0
        self.max_ctx = 0  # the largest n_ctx of a sequence so far: cells never grow past it
        self._free: list[int] = []
        self._lock = threading.Lock()  # slots come back from the garbage collector, any thread
        self._want_slots = max(1, slots)

    @property
    def nbytes(self) -> int:
        return sum(int(a.nbytes) for a in self.k) + sum(int(a.nbytes) for a in self.v)

    def acquire(self, n_ctx: int) -> int:
        """A free slot for a sequence of up to n_ctx positions."""
        self.max_ctx = max(self.max_ctx, n_ctx)
        with self._lock:
            if self._free:
                return self._free.pop()
        first = min(n_ctx, FIRST_CELLS)
        if not self.k:
            self._resize(self._want_slots, first)
        else:
            self._resize(2 * self.slots, max(self.cells, first))
        with self._lock:
            return self._free.pop()

    def release(self, slot: int) -> None:
        with self._lock:
            self._free.append(slot)

    def reserve(self, n: int) -> None:
        """Room for cells 0..n-1 in every slot (n <= max_ctx, checked by the sequence)."""
        if n > self.cells:
            self._resize(self.slots, min(self.max_ctx, max(n, 2 * self.cells)))

    def _resize(self, slots: int, cells: int) -> None:
        L, Hkv, Dh, Dv = self.shape
        before = self.nbytes
        old_k, old_v = self.k, self.v
        try:
            k = [_grown(old_k[il] if old_k else None, (slots, Hkv, cells, Dh)) for il in range(L)]
            v = [_grown(old_v[il] if old_v else None, (slots, Hkv, cells, Dv)) for il in range(L)]
        except CUDA_ERRORS as e:  # the pool stays as it was
            need = 2 * L * slots * Hkv * cells * (Dh + Dv)
            raise DeviceError(f"the KV cache cannot grow to {slots} sequences x {cells} positions "
                              f"({need / 2**20:,.0f} MiB, from {before / 2**20:,.0f} MiB): {e}") from e
        self.k, self.v = k, v
        with self._lock:
            self._free.extend(range(slots - 1, self.slots - 1, -1))  # new slots, lowest first out
        self.slots, self.cells = slots, cells
        cuda.synchronize()  # grown on the legacy stream: done before the backend's stream reads it
        self.on_grow(self.nbytes - before)


def _grown(old, shape):
    """A zeroed f16 array of `shape` holding `old` (a smaller one, or None) at its low indices.
    Zeroed on the device (a host array of zeros would be as large as the pool)."""
    new = cuda.device_array(shape, np.float16)
    driver.device_memset(new, 0, new.nbytes)
    if old is not None and old.size:
        n = old.size
        _copy_cells[(n + _THREADS - 1) // _THREADS, _THREADS](old, new)
    return new


class DeviceKVLayer:
    """Layer `layer` of a sequence in a KVPool (the pool's arrays hold its cells)."""

    def __init__(self, pool: KVPool, layer: int):
        self.pool = pool
        self.layer = layer

    @property
    def capacity(self) -> int:
        return self.pool.cells

    def reserve(self, n: int) -> None:
        self.pool.reserve(n)


class DeviceKVCache(SequenceCache):
    """A sequence in a KVPool: slot `slot` of every layer, given back when this object goes."""

    def __init__(self, pool: KVPool, n_ctx: int):
        self.pool = pool
        self.slot = pool.acquire(n_ctx)
        weakref.finalize(self, pool.release, self.slot)
        super().__init__([DeviceKVLayer(pool, il) for il in range(pool.shape[0])], n_ctx)
