"""A device KV cache for the attention tests: random f16 cells everywhere (so a kernel that reads
a cell outside a row's visible ones gives a wrong result), then the rows' keys and values
appended with kv_append. Legend: C = cells, S = slots, Hkv = KV heads, Dh / Dv = head sizes."""

from __future__ import annotations

import numpy as np
from numba import cuda

from daemon.kernels.cuda.attention import KV_BLOCK, kv_append


def blocks(cells: np.ndarray) -> np.ndarray:
    """[C, S, Hkv, D] per cell -> the device layout [C / B, S, Hkv, B, D]."""
    c, s, h, d = cells.shape
    return np.ascontiguousarray(cells.reshape(c // KV_BLOCK, KV_BLOCK, s, h, d).transpose(0, 2, 3, 1, 4))


def filled_cache(rng, shape: tuple[int, int, int, int, int], slots, positions):
    """shape (C, S, Hkv, Dh, Dv); row r appended at cell positions[r] of slot slots[r]. -> host
    cell values kc [C, S, Hkv, Dh] and vc, device caches, device slots and positions (int32)."""
    C, S, HKV, DH, DV = shape
    kc = rng.standard_normal((C, S, HKV, DH)).astype(np.float16)
    vc = rng.standard_normal((C, S, HKV, DV)).astype(np.float16)
    R = len(slots)
    k_new = rng.standard_normal((R, HKV, DH)).astype(np.float32)
    v_new = rng.standard_normal((R, HKV, DV)).astype(np.float32)
    dk, dv = cuda.to_device(blocks(kc)), cuda.to_device(blocks(vc))
    ds, dp = cuda.to_device(np.array(slots, np.int32)), cuda.to_device(np.array(positions, np.int32))
    kv_append(cuda.to_device(k_new), cuda.to_device(v_new), ds, dp, dk, dv)
    for r, (s, p) in enumerate(zip(slots, positions)):
        kc[p, s] = k_new[r].astype(np.float16)
        vc[p, s] = v_new[r].astype(np.float16)
    return kc, vc, dk, dv, ds, dp
