"""The CUDA backend's sequence caches: a per-model pool of sequence slots in VRAM, one f16 array
pair per attention layer in the block-major layout of daemon/kernels/cuda/attention.py:

    k[ia]: f16 [NB, S, Hkv, B, Dh]    v[ia]: f16 [NB, S, Hkv, B, Dv]    (NB = Cr / B blocks)

and, for a hybrid family (qwen3next, qwen35moe), every Gated DeltaNet layer's f32 state in the
layout of daemon/kernels/cuda/gdn.py, all recurrent layers in one array of each kind:

    conv:  f32 [S, NR, Ch, Kc-1]    state: f32 [S, NR, Hv, Dvs, Dk]

`ia` is the attention layer's ordinal among the model's attention layers (every layer in a
non-hybrid model), `ir` a recurrent layer's among the recurrent ones; a sequence's layer cache
of model layer il carries it (DeviceKVLayer.layer, DeviceStateLayer.index).

A sequence (DeviceKVCache) owns one slot index, the same in every layer and in both kinds of
arrays, from creation until it is garbage-collected (the scheduler drops a finished sequence's
cache: the slot is free again). A decode step hands the kernels each row's slot, so one launch
reads every sequence of the step. Stale cells of a reused slot are never read: a sequence writes
cell j before any of its rows can see it. The recurrent states are read from the first row on,
so a sequence's slot is zeroed when it takes the slot (one memset of the slot's conv and state
slices, in the backend's stream order).

Growing cells does not move the pool. Each KV array's address range is reserved for Cr cells (the
largest n_ctx asked for) and VRAM is mapped for the first `cells` only (cuda_reserved.py): cells
double from FIRST_CELLS by mapping more, so the graphs that captured the arrays stay valid. Only
what changes the arrays' shapes moves them (copied on the device, on_grow told `moved`): more
sequences than slots (slots double), or a sequence longer than Cr.

Legend: L = attention layers, NR = recurrent layers, S = slots, Cr = cells reserved per slot,
B = attention.KV_BLOCK cells a block,
Hkv = key/value heads, Dh = key head size, Dv = value head size; Ch = conv channels, Kc = conv
kernel, Hv = the delta net's value heads, Dk / Dvs = its key / value head sizes.
"""

from __future__ import annotations

import sys
import threading
import weakref

import numpy as np
from numba import cuda

from ..errors import DeviceError
from ..kernels.cuda.attention import KV_BLOCK
from ..kernels.cuda.device import SIM, zero_fill
from .cache import SequenceCache
from .cuda_errors import CUDA_ERRORS
from .cuda_graphs import _check, _drv
from .cuda_reserved import ReservedArray

# cells mapped up front (fewer if n_ctx is smaller): the CPU cache's 256; under the simulator,
# which runs every device thread in Python, 16 so that tests cross a growth on few rows
FIRST_CELLS = 16 if SIM else 256
FIRST_SLOTS = 4
_THREADS = 256


@cuda.jit
def _copy_prefix(old, new):
    """new[a, b, c, d, e] = old[a, b, c, d, e] over old's shape (f16 5-d arrays)."""
    i = cuda.grid(1)
    A, B, C, D, E = old.shape
    if i < A * B * C * D * E:
        e = i % E
        d = (i // E) % D
        c = (i // (E * D)) % C
        b = (i // (E * D * C)) % B
        a = i // (E * D * C * B)
        new[a, b, c, d, e] = old[a, b, c, d, e]


class KVPool:
    """Every attention layer's KV arrays for S sequence slots, and (ssm given, the layers
    `recurrent` marks) every recurrent layer's conv and delta-rule states for the same slots.
    on_grow(delta_bytes, moved) is told of each growth (the backend's VRAM tally), moved when the
    arrays were made again (graphs holding them are stale)."""

    def __init__(self, n_layer: int, n_head_kv: int, head_dim: int, head_dim_v: int, slots: int = FIRST_SLOTS,
                 on_grow=None, ssm=None, recurrent: tuple[bool, ...] = ()):
        # per model layer: True = a recurrent layer (kinds are all False for a non-hybrid model)
        self.kinds = tuple(bool(recurrent) and bool(recurrent[il]) for il in range(n_layer))
        self.ssm = ssm if any(self.kinds) else None
        self.n_recurrent = self.kinds.count(True)
        self.shape = (self.kinds.count(False), n_head_kv, head_dim, head_dim_v)  # attention layers
        self.on_grow = on_grow or (lambda _delta, _moved: None)
        self._k: list[ReservedArray] = []  # [L], each [NB, S, Hkv, B, Dh]
        self._v: list[ReservedArray] = []
        self.k: list = []  # [L] their device arrays
        self.v: list = []
        self.conv = None  # hybrid: device f32 [S, NR, Ch, Kc-1]
        self.state = None  # hybrid: device f32 [S, NR, Hv, Dvs, Dk]
        self.tickets = None  # hybrid: device int32 [S, Hk + Hv], zero between launches (gdn.decode_step)
        self.slots = 0
        self.cells = 0  # cells every slot has room for (mapped)
        self.reserved_cells = 0  # Cr
        self.max_ctx = 0  # the largest n_ctx of a sequence so far: cells never grow past it
        self._free: list[int] = []
        self._lock = threading.Lock()  # slots come back from the garbage collector, any thread
        self._want_slots = max(1, slots)

    @property
    def nbytes(self) -> int:
        """The VRAM it holds (mapped cells, not the reserved range)."""
        states = 0 if self.conv is None else int(self.conv.nbytes) + int(self.state.nbytes)
        return sum(a.nbytes for a in self._k) + sum(a.nbytes for a in self._v) + states

    def state_shapes(self, slots: int) -> tuple[tuple, tuple]:
        """The conv and delta-rule state arrays' shapes for `slots` slots (hybrid pools)."""
        m = self.ssm
        return ((slots, self.n_recurrent, m.conv_channels, m.conv_kernel - 1),
                (slots, self.n_recurrent, m.n_v_head, m.head_v, m.head_k))

    def acquire(self, n_ctx: int) -> int:
        """A free slot for a sequence of up to n_ctx positions (its recurrent states, if any, hold
        what its previous owner left: clear_states)."""
        self.max_ctx = max(self.max_ctx, n_ctx)
        with self._lock:
            if self._free:
                return self._free.pop()
        if not self.slots:
            self._remake(self._want_slots, self.max_ctx, min(n_ctx, FIRST_CELLS))
        else:
            self._remake(2 * self.slots, max(self.reserved_cells, self.max_ctx), self.cells)
        with self._lock:
            return self._free.pop()

    def release(self, slot: int) -> None:
        with self._lock:
            self._free.append(slot)

    def reserve(self, n: int) -> None:
        """Room for cells 0..n-1 in every slot (n <= max_ctx, checked by the sequence)."""
        if n > self.reserved_cells:  # a longer sequence than the range was reserved for
            self._remake(self.slots, self.max_ctx, max(n, self.cells))
        elif n > self.cells:
            self._map(min(self.reserved_cells, max(n, 2 * self.cells)))

    def clear_states(self, slot: int, stream=0) -> None:
        """Zero slot `slot`'s conv and delta-rule states (a sequence taking the slot starts from
        zero), in `stream`'s order (0: done on return)."""
        if self.conv is not None:
            for a in (self.conv, self.state):
                _zero_slot(a, slot, stream)

    def _map(self, cells: int) -> None:
        """Cells 0..cells-1 of every slot backed by VRAM; nothing moves."""
        before = self.nbytes
        try:
            for a in (*self._k, *self._v):
                a.grow(-(-cells // KV_BLOCK))
        except CUDA_ERRORS as e:  # what was mapped stays: a later reserve maps the rest
            raise self._no_room(self.slots, cells, before, e) from e
        finally:
            self.cells = self._mapped_cells(self._k, self._v, cells)
            self.on_grow(self.nbytes - before, False)

    def _mapped_cells(self, k, v, cells: int) -> int:
        """Cells every slot of every array has VRAM for (at most the reserved ones)."""
        if not k:
            return cells
        return min(self.reserved_cells, min(a.mapped_rows for a in (*k, *v)) * KV_BLOCK)

    def _remake(self, slots: int, reserved: int, cells: int) -> None:
        """The arrays made again for `slots` slots over `reserved` cells, `cells` of them mapped,
        holding what the old ones held."""
        L, Hkv, Dh, Dv = self.shape
        before = self.nbytes
        conv, state = self.conv, self.state
        cuda.synchronize()  # the old arrays are copied on the legacy stream: the backend's writes first
        try:
            nb = -(-reserved // KV_BLOCK)
            k = [self._remade(self._k[il] if self._k else None, (nb, slots, Hkv, KV_BLOCK, Dh), cells)
                 for il in range(L)]
            v = [self._remade(self._v[il] if self._v else None, (nb, slots, Hkv, KV_BLOCK, Dv), cells)
                 for il in range(L)]
            tickets = self.tickets
            if self.ssm is not None and slots != self.slots:
                conv_shape, state_shape = self.state_shapes(slots)
                conv, state = _grown_slots(conv, conv_shape), _grown_slots(state, state_shape)
                tickets = cuda.device_array((slots, self.ssm.n_k_head + self.ssm.n_v_head), np.int32)
                zero_fill(tickets)
        except CUDA_ERRORS as e:  # the pool stays as it was
            raise self._no_room(slots, cells, before, e) from e
        self._k, self._v = k, v
        self.k, self.v = [a.array for a in k], [a.array for a in v]
        self.conv, self.state, self.tickets = conv, state, tickets
        with self._lock:
            self._free.extend(range(slots - 1, self.slots - 1, -1))  # new slots, lowest first out
        self.slots, self.reserved_cells = slots, reserved
        self.cells = self._mapped_cells(k, v, cells)
        cuda.synchronize()  # copied on the legacy stream: done before the backend's stream reads it
        self.on_grow(self.nbytes - before, True)

    def _remade(self, old: ReservedArray | None, shape: tuple, cells: int) -> ReservedArray:
        new = ReservedArray(shape, np.float16)
        new.grow(-(-cells // KV_BLOCK))
        if old is not None and self.cells:
            src = old.array[:-(-min(self.cells, cells) // KV_BLOCK)]
            n = src.size
            _copy_prefix[(n + _THREADS - 1) // _THREADS, _THREADS](src, new.array)
        return new

    def _no_room(self, slots: int, cells: int, before: int, e: Exception) -> DeviceError:
        L, Hkv, Dh, Dv = self.shape
        need = 2 * L * slots * Hkv * cells * (Dh + Dv)
        if self.ssm is not None:
            need += 4 * sum(int(np.prod(shape)) for shape in self.state_shapes(slots))
        return DeviceError(f"the KV cache cannot grow to {slots} sequences x {cells} positions "
                           f"({need / 2**20:,.0f} MiB, from {before / 2**20:,.0f} MiB): {e}")


def _grown_slots(old, shape):
    """A zeroed f32 array of `shape` [S, ...] holding `old` [S_old, ...] (or None) in its first
    slots: a contiguous prefix, one device-to-device copy."""
    new = cuda.device_array(shape, np.float32)
    zero_fill(new)
    if old is not None and old.nbytes:
        new[:old.shape[0]].copy_to_device(old)
    return new


def _zero_slot(a, slot: int, stream=0) -> None:
    """a[slot] = 0 (a: a C-contiguous device array [S, ...]) in stream order; stream 0: done on return."""
    n = int(a.strides[0])
    if not n:
        return
    if SIM:
        a[slot].copy_to_device(np.zeros(a.shape[1:], a.dtype))
    elif stream:
        _check(_drv().cuMemsetD8Async(int(a.gpu_data.device_pointer) + slot * n, 0, n, int(stream.handle)))
    else:
        _check(_drv().cuMemsetD8(int(a.gpu_data.device_pointer) + slot * n, 0, n))
        cuda.synchronize()


class DeviceKVLayer:
    """Attention layer `layer` (its ordinal among the model's attention layers: the index into the
    pool's k and v) of a sequence in a KVPool (the pool's arrays hold its cells)."""

    def __init__(self, pool: KVPool, layer: int):
        self.pool = pool
        self.layer = layer

    @property
    def capacity(self) -> int:
        return self.pool.cells

    def reserve(self, n: int) -> None:
        self.pool.reserve(n)


class DeviceStateLayer:
    """Recurrent layer `index` (its ordinal among the model's recurrent layers: the index into the
    pool's conv and state arrays' second axis) of a sequence in a KVPool: any number of positions
    in a fixed size."""

    capacity = sys.maxsize

    def __init__(self, pool: KVPool, index: int):
        self.pool = pool
        self.index = index

    def reserve(self, n: int) -> None:
        pass


class DeviceKVCache(SequenceCache):
    """A sequence in a KVPool: slot `slot` of every layer, given back when this object goes.
    layers[il]: a DeviceKVLayer for an attention layer, a DeviceStateLayer for a recurrent one
    (its states zeroed on the way in, in `stream`'s order)."""

    def __init__(self, pool: KVPool, n_ctx: int, stream=0):
        self.pool = pool
        self.slot = pool.acquire(n_ctx)
        weakref.finalize(self, pool.release, self.slot)
        if pool.ssm is None:
            layers = [DeviceKVLayer(pool, il) for il in range(pool.shape[0])]
        else:
            pool.clear_states(self.slot, stream)
            layers, n_attn, n_rec = [], 0, 0
            for rec in pool.kinds:
                if rec:
                    layers.append(DeviceStateLayer(pool, n_rec))
                    n_rec += 1
                else:
                    layers.append(DeviceKVLayer(pool, n_attn))
                    n_attn += 1
        super().__init__(layers, n_ctx)
