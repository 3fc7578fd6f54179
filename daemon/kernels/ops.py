"""Numba CPU kernels for the non-matmul ops: norms, RoPE, attention, activations.

Each kernel computes what ggml's CPU backend computes, in the same precision: float32 values,
with float64 ("ggml_float") accumulators where ggml uses them (norm sums, softmax sums).

Legend: T = tokens in the step, D = hidden size, H = query heads, Hkv = key/value heads,
Dh = head size, C = KV cache length (positions), F = FFN size.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit, prange


@njit(parallel=True, cache=True, fastmath=False)
def rms_norm(x, weight, eps):
    """x: [T, D] f32, weight: [D] f32 -> [T, D]; ggml_rms_norm then ggml_mul by the weight."""
    T, D = x.shape
    out = np.empty_like(x)
    for t in prange(T):
        acc = 0.0  # float64, as ggml_float
        for i in range(D):
            sq = np.float32(x[t, i] * x[t, i])
            acc += sq
        mean = np.float32(acc / D)
        scale = np.float32(1.0) / np.float32(math.sqrt(np.float32(mean + eps)))
        for i in range(D):
            out[t, i] = np.float32(x[t, i] * scale) * weight[i]
    return out


@njit(parallel=True, cache=True)
def rms_norm_heads(x, weight, eps):
    """Per-head RMSNorm (qwen3 q/k norm). x: [T, H, Dh], weight: [Dh] -> [T, H, Dh]."""
    T, H, Dh = x.shape
    out = np.empty_like(x)
    for th in prange(T * H):
        t = th // H
        h = th % H
        acc = 0.0
        for i in range(Dh):
            acc += np.float32(x[t, h, i] * x[t, h, i])
        mean = np.float32(acc / Dh)
        scale = np.float32(1.0) / np.float32(math.sqrt(np.float32(mean + eps)))
        for i in range(Dh):
            out[t, h, i] = np.float32(x[t, h, i] * scale) * weight[i]
    return out


def rope_cache(positions: np.ndarray, n_dims: int, freq_base: float, freq_scale: float,
               ext_factor: float, attn_factor: float, corr_dims: tuple[float, float]) -> np.ndarray:
    """cos/sin table as ggml_rope_cache_init builds it: [T, n_dims/2, 2] f32.

    theta is advanced by repeated float32 multiplication by theta_scale, as ggml does, so the angles
    (and their rounding) match its cache exactly.
    """
    return _rope_cache(positions.astype(np.float32), n_dims, np.float32(freq_base), np.float32(freq_scale),
                       np.float32(ext_factor), np.float32(attn_factor),
                       np.float32(corr_dims[0]), np.float32(corr_dims[1]))


@njit(cache=True)
def _rope_cache(positions, n_dims, freq_base, freq_scale, ext_factor, mscale0, corr0, corr1):
    T = positions.shape[0]
    half = n_dims // 2
    cache = np.empty((T, half, 2), dtype=np.float32)
    theta_scale = np.float32(freq_base ** np.float32(np.float32(-2.0) / np.float32(n_dims)))
    for t in range(T):
        theta_extrap = positions[t]
        for i in range(half):
            i0 = 2 * i
            theta_interp = np.float32(freq_scale * theta_extrap)
            theta = theta_interp
            mscale = mscale0
            if ext_factor != 0.0:
                y = np.float32((np.float32(i0 // 2) - corr0) / max(np.float32(0.001), np.float32(corr1 - corr0)))
                ramp = np.float32(1.0) - min(np.float32(1.0), max(np.float32(0.0), y))
                ramp_mix = np.float32(ramp * ext_factor)
                theta = np.float32(theta_interp * (np.float32(1.0) - ramp_mix) + np.float32(theta_extrap * ramp_mix))
                mscale = np.float32(mscale * np.float32(np.float32(1.0) + np.float32(0.1) * np.float32(math.log(np.float32(1.0) / freq_scale))))
            cache[t, i, 0] = np.float32(np.float32(math.cos(theta)) * mscale)
            cache[t, i, 1] = np.float32(np.float32(math.sin(theta)) * mscale)
            theta_extrap = np.float32(theta_extrap * theta_scale)
    return cache


@njit(parallel=True, cache=True)
def apply_rope(x, cache, n_dims, neox):
    """x: [T, H, Dh] f32, cache: [T, n_dims/2, 2] -> rotated copy.

    NORM rotates adjacent pairs (x[2i], x[2i+1]); NEOX rotates halves (x[i], x[i + n_dims/2]).
    Dimensions past n_dims pass through.
    """
    T, H, Dh = x.shape
    out = x.copy()
    half = n_dims // 2
    for th in prange(T * H):
        t = th // H
        h = th % H
        for i in range(half):
            c = cache[t, i, 0]
            s = cache[t, i, 1]
            if neox:
                a = i
                b = i + half
            else:
                a = 2 * i
                b = 2 * i + 1
            x0 = x[t, h, a]
            x1 = x[t, h, b]
            out[t, h, a] = np.float32(x0 * c) - np.float32(x1 * s)
            out[t, h, b] = np.float32(x0 * s) + np.float32(x1 * c)
    return out


def yarn_corr_dims(n_dims: int, n_ctx_orig: int, freq_base: float, beta_fast: float, beta_slow: float) -> tuple[float, float]:
    """ggml_rope_yarn_corr_dims: the dimension range over which YaRN ramps between interpolation
    and extrapolation."""
    def corr_dim(n_rot: float) -> float:
        f32 = np.float32
        return float(f32(n_dims) * f32(math.log(f32(n_ctx_orig) / f32(f32(n_rot) * f32(2.0 * math.pi))))
                     / f32(f32(2.0) * f32(math.log(f32(freq_base)))))
    start = math.floor(corr_dim(beta_fast))
    end = math.ceil(corr_dim(beta_slow))
    return float(max(0.0, start)), float(min(n_dims - 1, end))


@njit(parallel=True, cache=True)
def attention(q, k_cache, v_cache, positions, scale, window, sinks, round_weights_f16):
    """Causal multi-head attention of one sequence against its KV cache.

    q: [T, H, Dh] f32 (already rounded to f16 values in ggml numerics); k_cache: [C, Hkv, Dh],
    v_cache: [C, Hkv, Dv] (f16 values stored as f32); positions: [T] int64 (position of each
    query; cache rows 0..pos are visible); window: sliding window (0 = full): key j is visible
    from query position p iff p - j < window; sinks: [H] f32 extra softmax logit per head (empty
    = none); round_weights_f16: round the softmax weights to f16 before the V product, as ggml
    does when it multiplies them with the f16 V cache. -> [T, H, Dv]
    """
    T, H, Dh = q.shape
    Hkv = k_cache.shape[1]
    Dv = v_cache.shape[2]
    group = H // Hkv
    out = np.zeros((T, H, Dv), dtype=np.float32)
    has_sinks = sinks.shape[0] > 0
    for th in prange(T * H):
        t = th // H
        h = th % H
        kh = h // group
        p = positions[t]
        lo = 0
        if window > 0:
            lo = max(0, p - window + 1)
        n = p + 1 - lo
        w = np.empty(n, dtype=np.float32)
        mx = np.float32(-np.inf)
        for j in range(n):
            acc = np.float32(0.0)
            for d in range(Dh):
                acc += q[t, h, d] * k_cache[lo + j, kh, d]
            s = np.float32(acc * scale)
            w[j] = s
            if s > mx:
                mx = s
        if has_sinks and sinks[h] > mx:
            mx = sinks[h]
        total = 0.0
        for j in range(n):
            e = np.float32(math.exp(np.float32(w[j] - mx)))
            w[j] = e
            total += e
        if has_sinks:
            total += np.float32(math.exp(np.float32(sinks[h] - mx)))
        inv = np.float32(1.0 / total)
        for j in range(n):
            w[j] = np.float32(w[j] * inv)
        if round_weights_f16:
            w[:] = _round_f16(w)
        for j in range(n):
            wj = w[j]
            for d in range(Dv):
                out[t, h, d] += wj * v_cache[lo + j, kh, d]
    return out


@njit(cache=True)
def round_f16(x):
    """float32 -> nearest float16 value (ties to even), kept as float32; as numpy's astype."""
    ax = abs(x)
    if ax != ax:
        return x
    if ax >= np.float32(65520.0):
        return np.float32(np.inf) if x > 0 else np.float32(-np.inf)
    if ax < np.float32(6.103515625e-05):  # f16 subnormal: a fixed quantum of 2^-24
        q = np.float32(5.960464477539063e-08)
        return np.float32(np.rint(x / q) * q)
    bits = np.array([x]).view(np.uint32)[0]
    lsb = (bits >> np.uint32(13)) & np.uint32(1)
    bits = (bits + np.uint32(0xFFF) + lsb) & np.uint32(0xFFFFE000)
    return np.array([bits]).view(np.float32)[0]


@njit(cache=True)
def _round_f16(a):
    out = np.empty_like(a)
    for i in range(a.shape[0]):
        out[i] = round_f16(a[i])
    return out


@njit(cache=True)
def silu(x):
    return x / (np.float32(1.0) + np.exp(-x))


@njit(parallel=True, cache=True)
def swiglu(gate, up):
    """silu(gate) * up, elementwise; [T, F] -> [T, F] (ggml_swiglu_split)."""
    T, F = gate.shape
    out = np.empty_like(gate)
    for t in prange(T):
        for i in range(F):
            g = gate[t, i]
            out[t, i] = np.float32(g / np.float32(np.float32(1.0) + np.float32(math.exp(-g)))) * up[t, i]
    return out


@njit(parallel=True, cache=True)
def swiglu_oai(gate, up, alpha, limit):
    """gpt-oss clamped SwiGLU: x = min(g, limit); y = clamp(u, -limit, limit);
    out = x * sigmoid(alpha * x) * (y + 1). [T, F] -> [T, F]."""
    T, F = gate.shape
    out = np.empty_like(gate)
    for t in prange(T):
        for i in range(F):
            x = min(gate[t, i], limit)
            y = min(max(up[t, i], -limit), limit)
            glu = np.float32(x / np.float32(np.float32(1.0) + np.float32(math.exp(np.float32(-alpha * x)))))
            out[t, i] = np.float32(glu * np.float32(y + np.float32(1.0)))
    return out


@njit(cache=True)
def softmax_rows(x):
    """Row softmax like ggml_soft_max: float64 sum of float32 exps. [T, N] -> [T, N]."""
    T, N = x.shape
    out = np.empty_like(x)
    for t in range(T):
        mx = np.float32(-np.inf)
        for i in range(N):
            if x[t, i] > mx:
                mx = x[t, i]
        total = 0.0
        for i in range(N):
            e = np.float32(math.exp(np.float32(x[t, i] - mx)))
            out[t, i] = e
            total += e
        inv = np.float32(1.0 / total)
        for i in range(N):
            out[t, i] = np.float32(out[t, i] * inv)
    return out
