"""The CPU backend's KV cache: float32 keys and values (holding f16 values in "ggml" numerics, as
llama.cpp's f16 KV cache), grown on demand up to n_ctx.

All layers of one sequence live in one KVStore, so that a decode step hands the attention kernel
one array per sequence (a numba typed List built once per step, not per layer); each layer's
KVLayer owns the writes to and reads of its slice.

Legend: L = layers, C = cells (positions) allocated, Hkv = key/value heads, Dh = key head size,
Dv = value head size, T = rows written.
"""

from __future__ import annotations

import numpy as np

from .cache import SequenceCache

FIRST_CELLS = 256  # cells allocated up front (fewer if n_ctx is smaller); doubled when full


class KVStore:
    """k [L, C, Hkv, Dh], v [L, C, Hkv, Dv] f32 of one sequence; C grows up to n_ctx."""

    def __init__(self, n_layer: int, n_head_kv: int, head_dim: int, head_dim_v: int, n_ctx: int):
        self.n_ctx = n_ctx
        cap = min(n_ctx, FIRST_CELLS)
        self.k = np.zeros((n_layer, cap, n_head_kv, head_dim), np.float32)
        self.v = np.zeros((n_layer, cap, n_head_kv, head_dim_v), np.float32)

    @property
    def capacity(self) -> int:
        return self.k.shape[1]

    def reserve(self, n: int) -> None:
        """Room for n cells (n <= n_ctx): at least doubled when it grows, contents kept."""
        cap = self.capacity
        if n <= cap:
            return
        new = min(self.n_ctx, max(n, 2 * cap))
        for name in ("k", "v"):
            a = getattr(self, name)
            grown = np.zeros((a.shape[0], new, *a.shape[2:]), np.float32)
            grown[:, :cap] = a
            setattr(self, name, grown)


class KVLayer:
    """Layer `slot` of a sequence's KVStore."""

    def __init__(self, store: KVStore, slot: int):
        self.store = store
        self.slot = slot

    @property
    def capacity(self) -> int:
        return self.store.capacity

    def reserve(self, n: int) -> None:
        self.store.reserve(n)

    def write(self, start: int, k: np.ndarray, v: np.ndarray) -> None:
        """Store k [T, Hkv, Dh], v [T, Hkv, Dv] at cells start..start+T-1."""
        end = start + k.shape[0]
        self.store.k[self.slot, start:end] = k
        self.store.v[self.slot, start:end] = v

    def keys(self, end: int) -> np.ndarray:
        """Cells 0..end-1: [end, Hkv, Dh], a view."""
        return self.store.k[self.slot, :end]

    def values(self, end: int) -> np.ndarray:
        """Cells 0..end-1: [end, Hkv, Dv], a view."""
        return self.store.v[self.slot, :end]


class KVCache(SequenceCache):
    """A sequence whose every layer is a KVLayer of one KVStore. k, v: the store's arrays
    [L, C, Hkv, Dh|Dv] (for inspection; they are replaced when the store grows)."""

    def __init__(self, n_layer: int, n_head_kv: int, head_dim: int, head_dim_v: int, n_ctx: int):
        self.store = KVStore(n_layer, n_head_kv, head_dim, head_dim_v, n_ctx)
        super().__init__([KVLayer(self.store, il) for il in range(n_layer)], n_ctx)

    @property
    def k(self) -> np.ndarray:
        return self.store.k

    @property
    def v(self) -> np.ndarray:
        return self.store.v
