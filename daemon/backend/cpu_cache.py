"""The CPU backend's sequence caches: float32 keys and values (holding f16 values in "ggml"
numerics, as llama.cpp's f16 KV cache), grown on demand up to n_ctx; and for a hybrid family's
Gated DeltaNet layers, float32 conv and recurrent states of a fixed size (zero for a new sequence).

All attention layers of one sequence live in one KVStore, and all its recurrent layers in one
StateStore, so that a step hands a kernel one array per sequence (a numba typed List built once
per step, not per layer); each layer's cache object owns its slice (`slot`).

Legend: L = layers of the kind, C = cells (positions) allocated, Hkv = key/value heads, Dh = key
head size, Dv = value head size, T = rows written; Ch = conv channels, Kc = conv kernel, Hv = value
heads, Dk / Dvs = the delta net's key / value head sizes.
"""

from __future__ import annotations

import sys

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


class StateStore:
    """conv [L, Ch, Kc-1] and ssm [L, Hv, Dvs, Dk] f32 of one sequence: each recurrent layer's
    previous Kc-1 conv inputs and its delta-rule state M (M[j] = column j of S), zero at first."""

    def __init__(self, n_layer: int, ssm):
        self.conv = np.zeros((n_layer, ssm.conv_channels, ssm.conv_kernel - 1), np.float32)
        self.ssm = np.zeros((n_layer, ssm.n_v_head, ssm.head_v, ssm.head_k), np.float32)


class StateLayer:
    """Layer `slot` of a sequence's StateStore: any number of positions in a fixed size."""

    capacity = sys.maxsize

    def __init__(self, store: StateStore, slot: int):
        self.store = store
        self.slot = slot

    def reserve(self, n: int) -> None:
        pass


class KVCache(SequenceCache):
    """A sequence: a KVLayer of one KVStore per attention layer, and (hybrid families: the layers
    `recurrent` marks, with dimensions `ssm`) a StateLayer of one StateStore per recurrent layer.
    k, v: the KV store's arrays [L, C, Hkv, Dh|Dv] (for inspection; replaced when it grows)."""

    def __init__(self, n_layer: int, n_head_kv: int, head_dim: int, head_dim_v: int, n_ctx: int,
                 ssm=None, recurrent: tuple[bool, ...] = ()):
        kinds = [bool(recurrent) and recurrent[il] for il in range(n_layer)]
        self.store = KVStore(kinds.count(False), n_head_kv, head_dim, head_dim_v, n_ctx)
        self.states = StateStore(kinds.count(True), ssm) if any(kinds) else None
        layers, n_attn, n_rec = [], 0, 0
        for rec in kinds:
            if rec:
                layers.append(StateLayer(self.states, n_rec))
                n_rec += 1
            else:
                layers.append(KVLayer(self.store, n_attn))
                n_attn += 1
        super().__init__(layers, n_ctx)

    @property
    def k(self) -> np.ndarray:
        return self.store.k

    @property
    def v(self) -> np.ndarray:
        return self.store.v
