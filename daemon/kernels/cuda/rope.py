"""RoPE on the device: NORM and NEOX rotations, linear scaling and YaRN, from positions in device memory.

Legend: T = tokens, H = query heads, Hkv = key/value heads, Dh = head size, P = n_dims/2 rotated
pairs per head.

Two steps, as the CPU path: `rope_cache` builds the cos/sin table of the step's positions once
([T, P, 2], shared by q and k of every layer), then `apply_rope_qk` rotates q and k in place in one
launch per layer. The angle of pair i at position p is p * theta_scale^i / freq_factors[i]
(theta_scale = base^(-2/n_dims)), taken with powf as llama.cpp's CUDA rope does (the CPU multiplies
theta_scale in repeatedly: both are float32 roundings of the same angle). YaRN mixes the
interpolated and extrapolated angles with ggml's ramp over the pair index and scales cos/sin by
mscale = attn_factor * (1 + 0.1*ln(1/freq_scale)), as ggml's rope_yarn.

NORM rotates adjacent pairs (x[2i], x[2i+1]); NEOX rotates halves (x[i], x[i + P]). Dimensions past
n_dims are left as they are.
"""

from __future__ import annotations

import math

import numpy as np
from numba import cuda

from .attention import KV_BLOCK
from .device import block_sum, placeholder
from .launch import launch

_THREADS = 128
MAX_HEAD = 1024  # values of one head norm_rope_qk holds (a thread each)
_U = np.uint32


@cuda.jit
def _rope_cache(positions, theta_scale, freq_scale, ext_factor, mscale, corr0, corr1, ff, has_ff, cache):
    """positions: int32 [T]; ff: f32 [P] (freq_factors, read when has_ff); cache: f32 [T, P, 2]."""
    idx = cuda.grid(1)
    P = cache.shape[1]
    if idx >= cache.shape[0] * P:
        return
    t = idx // P
    i = idx - t * P
    theta_extrap = np.float32(positions[t]) * math.pow(theta_scale, np.float32(i))
    if has_ff:
        theta_extrap = theta_extrap / ff[i]
    theta_interp = freq_scale * theta_extrap
    theta = theta_interp
    if ext_factor != np.float32(0.0):
        y = (np.float32(i) - corr0) / max(np.float32(0.001), corr1 - corr0)
        ramp_mix = (np.float32(1.0) - min(np.float32(1.0), max(np.float32(0.0), y))) * ext_factor
        theta = theta_interp * (np.float32(1.0) - ramp_mix) + theta_extrap * ramp_mix
    cache[t, i, 0] = math.cos(theta) * mscale
    cache[t, i, 1] = math.sin(theta) * mscale


@cuda.jit(device=True, inline=True)
def _pair(i, P, neox):
    """The two dimensions pair i rotates: halves (NEOX) or neighbours (NORM)."""
    if neox:
        return i, i + P
    return 2 * i, 2 * i + 1


@cuda.jit(device=True, inline=True)
def _rotate(x, t, h, i, P, neox, c, s):
    a, b = _pair(i, P, neox)
    x0 = x[t, h, a]
    x1 = x[t, h, b]
    x[t, h, a] = x0 * c - x1 * s
    x[t, h, b] = x0 * s + x1 * c


@cuda.jit
def _apply_rope_qk(q, k, cache, neox):
    """In place. q: f32 [T, H, Dh]; k: f32 [T, Hkv, Dh]; cache: f32 [T, P, 2]. One thread per
    (token, head of q then of k, pair)."""
    idx = cuda.grid(1)
    T, H = q.shape[0], q.shape[1]
    Hk = k.shape[1]
    P = cache.shape[1]
    per_token = (H + Hk) * P
    if idx >= T * per_token:
        return
    t = idx // per_token
    rem = idx - t * per_token
    h = rem // P
    i = rem - h * P
    c = cache[t, i, 0]
    s = cache[t, i, 1]
    if h < H:
        _rotate(q, t, h, i, P, neox, c, s)
    else:
        _rotate(k, t, h - H, i, P, neox, c, s)


@cuda.jit
def _norm_rope_qk(q, k, wq, wk, has_norm, eps, cache, neox, v, slots, positions, k_cache, v_cache, append):
    """In place: each head of q [T, H, Dh] and k [T, Hkv, Dh] RMS-normed with wq / wk [Dh] (when
    has_norm), then rotated by cache [T, P, 2]. Grid (H + Hkv, T), a thread per value of the head
    (Dh <= threads): every global load (the value, its norm weight, its pair's cos and sin, the
    step's slot and position, the value it appends) is issued first, so the launch waits on memory
    once; the normed values go through shared memory for the rotation. With append, a k head's
    block also stores its rotated keys, as f16, and the head's values v [T, Hkv, Dv] in cell
    positions[t] of slot slots[t] of k_cache / v_cache (attention.kv_append's layout and
    conversion, from the same float32 values). Indices are unsigned (no negative-index fix-ups)."""
    h = _U(cuda.blockIdx.x)
    t = _U(cuda.blockIdx.y)
    i = _U(cuda.threadIdx.x)
    H = _U(q.shape[1])
    is_k = h >= H
    hk = h - H if is_k else _U(0)
    Dh = _U(q.shape[2])
    P = _U(cache.shape[1])
    Dv = _U(v.shape[2])
    store = append and is_k
    ix = min(i, Dh - _U(1))
    xv = k[t, hk, ix] if is_k else q[t, h, ix]
    wv = np.float32(1.0)
    if has_norm:
        wv = wk[ix] if is_k else wq[ix]
    c = np.float32(0.0)
    sn = np.float32(0.0)
    if P > _U(0):
        ip = min(i, P - _U(1))
        c = cache[t, ip, _U(0)]
        sn = cache[t, ip, _U(1)]
    slot = _U(0)
    pos = _U(0)
    vv = np.float32(0.0)
    if store:
        slot = _U(slots[t])
        pos = _U(positions[t])
        vv = v[t, hk, min(i, Dv - _U(1))]
    vals = cuda.shared.array(MAX_HEAD, np.float32)
    red = cuda.shared.array(32, np.float32)
    live = i < Dh
    if not live:
        xv = np.float32(0.0)
    if has_norm:
        total = block_sum(xv * xv, red, cuda.threadIdx.x, cuda.blockDim.x)
        scale = np.float32(1.0) / math.sqrt(total / np.float32(q.shape[2]) + eps)
        xv = (xv * scale) * wv
    if live:
        vals[i] = xv
    cuda.syncthreads()
    b = pos // _U(KV_BLOCK)
    cell = pos % _U(KV_BLOCK)
    if i >= _U(2) * P and live:  # past n_dims: not rotated
        if is_k:
            k[t, hk, i] = xv
        else:
            q[t, h, i] = xv
        if store:
            k_cache[b, slot, hk, cell, i] = np.float16(xv)
    if i < P:
        a = i if neox else _U(2) * i  # _pair's dimensions, unsigned
        b2 = i + P if neox else _U(2) * i + _U(1)
        x0 = vals[a]
        x1 = vals[b2]
        y0 = x0 * c - x1 * sn
        y1 = x0 * sn + x1 * c
        if is_k:
            k[t, hk, a] = y0
            k[t, hk, b2] = y1
        else:
            q[t, h, a] = y0
            q[t, h, b2] = y1
        if store:
            k_cache[b, slot, hk, cell, a] = np.float16(y0)
            k_cache[b, slot, hk, cell, b2] = np.float16(y1)
    if store and i < Dv:
        v_cache[b, slot, hk, cell, i] = np.float16(vv)


def norm_rope_qk(q, k, cache, neox: bool, q_norm=None, k_norm=None, eps: float = 0.0, append=None, stream=0) -> None:
    """q [T, H, Dh] and k [T, Hkv, Dh] (device f32, in place): each head RMS-normed with q_norm /
    k_norm [Dh] (both or neither), then rotated by the table of rope_cache, in one launch.

    append: (v [T, Hkv, Dv], slots, positions int32 [T], k_cache, v_cache) to also store the
    rotated k and v in the cache as attention.kv_append does (the same bits), or None."""
    T, H, Dh = q.shape
    P = cache.shape[1]
    if (k.shape[0] != T or k.shape[2] != Dh or cache.shape[0] != T or 2 * P > Dh or Dh > MAX_HEAD
            or (q_norm is None) != (k_norm is None)):
        raise ValueError(f"norm_rope_qk: q {q.shape}, k {k.shape}, cache {cache.shape}")
    if append is not None:
        v, slots, positions, k_cache, v_cache = append
        Hkv, Dv = k.shape[1], v.shape[2]
        if (v.shape[:2] != (T, Hkv) or Dv > MAX_HEAD or k_cache.shape[2:] != (Hkv, KV_BLOCK, Dh)
                or v_cache.shape[2:] != (Hkv, KV_BLOCK, Dv) or slots.shape != (T,) or positions.shape != (T,)):
            raise ValueError(f"norm_rope_qk: v {v.shape}, caches {k_cache.shape} {v_cache.shape}")
    if T == 0:
        return
    threads = 32
    while threads < max(Dh, v.shape[2] if append is not None else 0):  # a thread per value
        threads *= 2
    has_norm = q_norm is not None
    w = placeholder(np.float32)
    if append is None:
        i32, h16 = placeholder(np.int32), placeholder(np.float16, 5)
        v, slots, positions, k_cache, v_cache = placeholder(np.float32, 3), i32, i32, h16, h16
    launch(_norm_rope_qk, (H + k.shape[1], T), threads, stream, q, k, q_norm if has_norm else w,
           k_norm if has_norm else w, has_norm, np.float32(eps), cache, bool(neox), v, slots, positions, k_cache,
           v_cache, append is not None)


def rope_mscale(freq_scale: float, ext_factor: float, attn_factor: float) -> np.float32:
    """ggml rope_yarn's cos/sin scale: attn_factor, times 1 + 0.1*ln(1/freq_scale) under YaRN."""
    f32 = np.float32
    if ext_factor == 0.0:
        return f32(attn_factor)
    return f32(f32(attn_factor) * (f32(1.0) + f32(0.1) * f32(math.log(f32(1.0) / f32(freq_scale)))))


def rope_cache(positions, n_dims: int, freq_base: float, freq_scale: float, ext_factor: float,
               attn_factor: float, corr_dims: tuple[float, float], cache, freq_factors=None, stream=0) -> None:
    """cache[t, i] = (cos, sin) * mscale of pair i at positions[t].

    positions: device int32 [T]; cache: device f32 [T, n_dims/2, 2]; freq_factors: device f32
    [n_dims/2] (`rope_freqs.weight`) or None. The other arguments are hparams.Rope's fields."""
    T, P = positions.shape[0], n_dims // 2
    if n_dims % 2 or cache.shape != (T, P, 2):
        raise ValueError(f"rope_cache: {T} positions, n_dims {n_dims}, cache {cache.shape}")
    if freq_factors is not None and freq_factors.shape != (P,):
        raise ValueError(f"rope_cache: freq_factors {freq_factors.shape}, expected ({P},)")
    if T == 0:
        return
    f32 = np.float32
    theta_scale = f32(f32(freq_base) ** f32(f32(-2.0) / f32(n_dims)))
    ff = placeholder(np.float32) if freq_factors is None else freq_factors
    n = T * P
    launch(_rope_cache, (n + _THREADS - 1) // _THREADS, _THREADS, stream,
        positions, theta_scale, f32(freq_scale), f32(ext_factor), rope_mscale(freq_scale, ext_factor, attn_factor),
        f32(corr_dims[0]), f32(corr_dims[1]), ff, freq_factors is not None, cache)


def apply_rope_qk(q, k, cache, neox: bool, stream=0) -> None:
    """Rotate q [T, H, Dh] and k [T, Hkv, Dh] (device f32, in place) by the table of rope_cache."""
    T, H, Dh = q.shape
    P = cache.shape[1]
    if k.shape[0] != T or k.shape[2] != Dh or cache.shape[0] != T or 2 * P > Dh:
        raise ValueError(f"apply_rope_qk: q {q.shape}, k {k.shape}, cache {cache.shape}")
    n = T * (H + k.shape[1]) * P
    if n:
        launch(_apply_rope_qk, (n + _THREADS - 1) // _THREADS, _THREADS, stream, q, k, cache, bool(neox))
