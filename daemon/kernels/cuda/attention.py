"""Attention on the device over an f16 KV cache: append, then causal attention of query rows.

Legend: S = sequence slots of the cache, C = cells (positions) per slot, Hkv = key/value heads,
H = query heads, G = H/Hkv query heads per KV head, Dh = key/query head size, Dv = value head size,
R = query rows of the call, K = CHUNK cells, NCH = chunks per row (ceil(max cells / K)).

Device KV cache layout, per layer (a GPU cache object owns these arrays and hands out slots):
    k_cache: f16 [S, Hkv, C, Dh]    v_cache: f16 [S, Hkv, C, Dv]
A sequence owns one slot; its cell j holds position j (as the CPU cache's row index). Head-major,
so one KV head's keys of consecutive positions are contiguous.

A call attends R query rows, row r being (slots[r], positions[r]): the row sees cells lo..p of its
slot, p = positions[r], lo = max(0, p - window + 1) with a sliding window, else 0. A decode step is
R = B sequences with one row each; a prefill is the T rows of a sequence (same slot, consecutive
positions), appended to the cache first; both are the same kernels. GQA: query head h reads KV head
h // G. Attention sinks (gpt-oss) add exp(sink[h] - max) to the softmax denominator.

Split-K ("flash decoding") with fixed chunks of K cells aligned on absolute positions: block
(chunk c, KV head, row) computes, for the G query heads of its KV head, the chunk's max score, sum
of exps and exp-weighted sum of values; a second kernel combines the row's chunks in ascending
order. The chunking depends only on the row's own position and window, so a row's result does not
depend on the other rows of the call (batch invariance), there are no atomics, and the same inputs
give the same bits on every run. Scores and sums are float32; keys and values are read from f16.
"""

from __future__ import annotations

import math

import numpy as np
from numba import cuda

from ...errors import UnsupportedError
from .device import SIM

# cells per block, = threads per block: one thread per cell for the scores. The simulator runs each
# thread in Python, so there the same code runs with chunks of 32 (the tests use CHUNK, so they
# cross chunk boundaries either way).
CHUNK = 32 if SIM else 128
MAX_GROUP = 16  # query heads per KV head
MAX_QD = 4096  # G * Dh held in shared memory
_SCORES = MAX_GROUP * CHUNK  # shared [G, CHUNK] buffers (a plain global: shared sizes must be constants)
_NEG_INF = np.float32(-np.inf)


@cuda.jit(device=True, inline=True)
def _visible(p, window):
    """First visible cell of a query at position p."""
    return max(0, p - window + 1) if window > 0 else 0


@cuda.jit(device=True)
def _rows_reduce(buf, G, tid, take_max):
    """In place over G rows of CHUNK values in buf: row g's max (take_max) or sum ends in
    buf[g*CHUNK]. Fixed tree order; every thread must call it."""
    cuda.syncthreads()
    stride = CHUNK // 2
    while stride > 0:
        if tid < stride:
            for g in range(G):
                a = buf[g * CHUNK + tid]
                b = buf[g * CHUNK + tid + stride]
                buf[g * CHUNK + tid] = max(a, b) if take_max else a + b
        cuda.syncthreads()
        stride //= 2


@cuda.jit
def _attn_partial(q, k_cache, v_cache, slots, positions, scale, window, part_m, part_l, part_o):
    """One chunk of one row against one KV head. Grid (NCH, Hkv, R), CHUNK threads.

    q: f32 [R, H, Dh]; caches as the module doc; slots, positions: int32 [R];
    part_m, part_l: f32 [R, H, NCH] (chunk max score, sum of exp); part_o: f32 [R, H, NCH, Dv]."""
    c = cuda.blockIdx.x
    kh = cuda.blockIdx.y
    r = cuda.blockIdx.z
    tid = cuda.threadIdx.x
    p = positions[r]
    lo = _visible(p, window)
    j0 = c * CHUNK
    if j0 > p or j0 + CHUNK <= lo:  # the whole block: no visible cell in this chunk
        return
    slot = slots[r]
    H, Dh = q.shape[1], q.shape[2]
    Dv = v_cache.shape[3]
    G = H // k_cache.shape[1]
    q_sh = cuda.shared.array(MAX_QD, np.float32)  # [G, Dh] scaled queries
    s_sh = cuda.shared.array(_SCORES, np.float32)  # [G, CHUNK] scores, then exps
    red = cuda.shared.array(_SCORES, np.float32)
    for e in range(tid, G * Dh, CHUNK):
        g = e // Dh
        q_sh[e] = q[r, kh * G + g, e - g * Dh] * scale
    cuda.syncthreads()
    j = j0 + tid
    valid = j >= lo and j <= p
    for g in range(G):
        s = _NEG_INF
        if valid:
            s = np.float32(0.0)
            for d in range(Dh):
                s += q_sh[g * Dh + d] * np.float32(k_cache[slot, kh, j, d])
        s_sh[g * CHUNK + tid] = s
        red[g * CHUNK + tid] = s
    _rows_reduce(red, G, tid, True)
    for g in range(G):
        e = np.float32(0.0)
        if valid:
            e = math.exp(s_sh[g * CHUNK + tid] - red[g * CHUNK])
        s_sh[g * CHUNK + tid] = e
    cuda.syncthreads()
    if tid < G:
        part_m[r, kh * G + tid, c] = red[tid * CHUNK]
    cuda.syncthreads()
    for g in range(G):
        red[g * CHUNK + tid] = s_sh[g * CHUNK + tid]
    _rows_reduce(red, G, tid, False)
    if tid < G:
        part_l[r, kh * G + tid, c] = red[tid * CHUNK]
    a = max(lo, j0) - j0  # visible cells of the chunk: a..b
    b = min(p, j0 + CHUNK - 1) - j0
    for d in range(tid, Dv, CHUNK):
        for g in range(G):
            acc = np.float32(0.0)
            for jj in range(a, b + 1):
                acc += s_sh[g * CHUNK + jj] * np.float32(v_cache[slot, kh, j0 + jj, d])
            part_o[r, kh * G + g, c, d] = acc


@cuda.jit
def _attn_combine(part_m, part_l, part_o, positions, window, sinks, has_sinks, out):
    """The row's chunks in ascending order -> out f32 [R, H, Dv]. Grid (H, R)."""
    h = cuda.blockIdx.x
    r = cuda.blockIdx.y
    p = positions[r]
    c0 = _visible(p, window) // CHUNK
    c1 = p // CHUNK
    m = _NEG_INF
    for c in range(c0, c1 + 1):
        m = max(m, part_m[r, h, c])
    if has_sinks:
        m = max(m, sinks[h])
    total = np.float32(0.0)
    for c in range(c0, c1 + 1):
        total += part_l[r, h, c] * math.exp(part_m[r, h, c] - m)
    if has_sinks:
        total += math.exp(sinks[h] - m)
    inv = np.float32(1.0) / total
    for d in range(cuda.threadIdx.x, out.shape[2], cuda.blockDim.x):
        acc = np.float32(0.0)
        for c in range(c0, c1 + 1):
            acc += part_o[r, h, c, d] * math.exp(part_m[r, h, c] - m)
        out[r, h, d] = acc * inv


@cuda.jit
def _kv_append(k_new, v_new, slots, positions, k_cache, v_cache):
    """k_cache[slots[r], h, positions[r]] = f16(k_new[r, h]), and v alike.
    k_new: f32 [R, Hkv, Dh]; v_new: f32 [R, Hkv, Dv]. One thread per (row, head, dim)."""
    idx = cuda.grid(1)
    R, Hkv, Dh = k_new.shape
    Dv = v_new.shape[2]
    D = max(Dh, Dv)
    if idx >= R * Hkv * D:
        return
    r = idx // (Hkv * D)
    rem = idx - r * Hkv * D
    h = rem // D
    d = rem - h * D
    slot = slots[r]
    p = positions[r]
    if d < Dh:
        k_cache[slot, h, p, d] = np.float16(k_new[r, h, d])
    if d < Dv:
        v_cache[slot, h, p, d] = np.float16(v_new[r, h, d])


def new_kv_cache(n_slots: int, n_head_kv: int, n_cells: int, head_dim: int, head_dim_v: int):
    """One layer's device cache: (k f16 [S, Hkv, C, Dh], v f16 [S, Hkv, C, Dv]), zeroed."""
    k = cuda.to_device(np.zeros((n_slots, n_head_kv, n_cells, head_dim), np.float16))
    v = cuda.to_device(np.zeros((n_slots, n_head_kv, n_cells, head_dim_v), np.float16))
    return k, v


class AttentionWork:
    """Scratch of the chunk partials for calls of up to max_rows rows of H heads over up to
    max_cells cells: part_m, part_l f32 [rows, H, NCH], part_o f32 [rows, H, NCH, Dv].
    Shared by every layer (the calls run in stream order)."""

    def __init__(self, max_rows: int, n_head: int, max_cells: int, head_dim_v: int):
        self.max_rows = max_rows
        self.max_chunks = -(-max_cells // CHUNK)
        shape = (max_rows, n_head, self.max_chunks)
        self.part_m = cuda.device_array(shape, np.float32)
        self.part_l = cuda.device_array(shape, np.float32)
        self.part_o = cuda.device_array(shape + (head_dim_v,), np.float32)


def kv_append(k_new, v_new, slots, positions, k_cache, v_cache, stream=0) -> None:
    """Write rows into the cache: row r at cell positions[r] of slot slots[r], converted to f16.

    k_new: device f32 [R, Hkv, Dh]; v_new: f32 [R, Hkv, Dv]; slots, positions: device int32 [R]
    (each position < C: the cache object reserves cells before the step)."""
    R, Hkv, Dh = k_new.shape
    Dv = v_new.shape[2]
    if (v_new.shape[:2] != (R, Hkv) or k_cache.shape[1] != Hkv or k_cache.shape[3] != Dh
            or v_cache.shape[3] != Dv or slots.shape != (R,) or positions.shape != (R,)):
        raise ValueError(f"kv_append: k {k_new.shape}, v {v_new.shape}, caches {k_cache.shape} {v_cache.shape}")
    n = R * Hkv * max(Dh, Dv)
    if n:
        _kv_append[(n + 127) // 128, 128, stream](k_new, v_new, slots, positions, k_cache, v_cache)


def attention(q, k_cache, v_cache, slots, positions, scale: float, window: int, sinks, out, work: AttentionWork,
              max_cells: int, stream=0) -> None:
    """Causal attention of R query rows against their slots' cells (see the module doc).

    q: device f32 [R, H, Dh]; slots, positions: device int32 [R]; sinks: device f32 [H] or None;
    out: device f32 [R, H, Dv]; max_cells: an upper bound of positions[r] + 1 over the rows (the
    grid's chunk count; blocks past a row's cells exit at once, so a capacity works too, e.g. for a
    captured graph). The rows' cells must have been appended first (kv_append)."""
    R, H, Dh = q.shape
    Hkv = k_cache.shape[1]
    Dv = v_cache.shape[3]
    if H % Hkv or k_cache.shape[3] != Dh or out.shape != (R, H, Dv) or slots.shape != (R,):
        raise ValueError(f"attention: q {q.shape}, caches {k_cache.shape} {v_cache.shape}, out {out.shape}")
    G = H // Hkv
    if G > MAX_GROUP or G * Dh > MAX_QD:
        raise UnsupportedError(f"attention: {G} query heads of {Dh} per KV head exceed the kernel's "
                               f"{MAX_GROUP} heads / {MAX_QD} values")
    nch = -(-max_cells // CHUNK)
    if R > work.max_rows or nch > work.max_chunks or work.part_o.shape[1:] != (H, work.max_chunks, Dv):
        raise ValueError(f"attention: {R} rows x {nch} chunks exceed the work area {work.part_o.shape}")
    if R == 0:
        return
    has_sinks = sinks is not None
    _attn_partial[(nch, Hkv, R), CHUNK, stream](q, k_cache, v_cache, slots, positions, np.float32(scale),
                                                np.int32(window), work.part_m, work.part_l, work.part_o)
    threads = 32
    while threads < min(Dv, 128):
        threads *= 2
    _attn_combine[(H, R), threads, stream](work.part_m, work.part_l, work.part_o, positions, np.int32(window),
                                       sinks if has_sinks else work.part_l.reshape(work.part_l.size),
                                       has_sinks, out)
