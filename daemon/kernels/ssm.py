"""Gated DeltaNet kernels on the CPU (numba), in llama.cpp's CPU order (docs/qwen3next.md).

Legend: T = rows of one call, S = sequences, C = conv channels, Kc = conv kernel width,
Hk / Hv = key / value heads, Dk / Dv = key / value head size, L = a sequence's recurrent layers.

ggml computes every op here in float32 with libm's expf/logf, so these kernels do too:
* the conv sums its Kc products from 0, each product rounded, then added (not fused: checked
  bit for bit against llama.cpp's `sumf += s * c` in ggml_compute_forward_ssm_conv_f32), then
  silu (ggml_vec_silu_f32: the SIMD exp on groups of 8);
* the delta rule is the fused op's token-by-token loop (ggml_compute_forward_gated_delta_net),
  with ggml_vec_dot_f32's AVX2 order for M·k and M·q, and FMA for the rank-1 update;
* the l2 norm is ggml_rms_norm with eps/Dk, then a scale by 1/sqrt(Dk).
The result of a row depends only on its sequence's earlier rows, never on the other sequences or
on how the sequence's rows were split into steps (the recurrence is the same loop either way).
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit, prange

from .matmul_float import float_rows
from .ops import expf, fma32, silu_f32, v_silu

_F32 = np.float32


@njit(cache=True, error_model="numpy")
def conv_silu(x, weight, offsets, convs, slot, out):
    """silu(causal depthwise conv) of each sequence's rows, its conv state first.

    x [T, C] f32: rows offsets[s]..offsets[s+1]-1 belong to sequence s; weight [C, Kc];
    convs[s] [L, C, Kc-1]: sequence s's conv states, layer `slot` used and replaced by the last
    Kc-1 inputs. out [T, C]."""
    T, C = x.shape
    Kc = weight.shape[1]
    nv = C - C % 8
    for s in range(len(offsets) - 1):
        r0, r1 = offsets[s], offsets[s + 1]
        state = convs[s][slot]  # [C, Kc-1]
        n = r1 - r0
        for c in prange(C):
            for t in range(n):
                acc = _F32(0.0)
                for i in range(Kc):
                    j = t + i  # index into [state | rows]
                    v = state[c, j] if j < Kc - 1 else x[r0 + j - (Kc - 1), c]
                    acc = _F32(acc + _F32(v * weight[c, i]))
                out[r0 + t, c] = acc
            # the new state: the last Kc-1 inputs of [state | rows]
            total = Kc - 1 + n
            for i in range(Kc - 1):
                j = total - (Kc - 1) + i
                state[c, i] = state[c, j] if j < Kc - 1 else x[r0 + j - (Kc - 1), c]
        for t in range(r0, r1):  # ggml_silu over each row of C: SIMD groups of 8, scalar tail
            for c in range(nv):
                out[t, c] = v_silu(out[t, c])
            for c in range(nv, C):
                out[t, c] = silu_f32(out[t, c])


@njit(cache=True, inline="always")
def _l2_normed(x, off, n, eps_n, inv_sqrt_n, dst):
    """dst[0, :] = ggml_scale(ggml_rms_norm(x[off:off+n], eps/n), 1/sqrt(n))."""
    acc = 0.0  # ggml_float
    for i in range(n):
        acc += _F32(x[off + i] * x[off + i])
    mean = _F32(acc / n)
    scale = _F32(1.0) / _F32(math.sqrt(_F32(mean + eps_n)))
    for i in range(n):
        dst[0, i] = _F32(_F32(x[off + i] * scale) * inv_sqrt_n)


@njit(cache=True, error_model="numpy", parallel=True)
def gated_delta_net(qkv, b, a, dt_bias, ssm_a, offsets, states, slot, Hk, tiled, eps, out):
    """The gated delta rule of each (sequence, value head), row after row.

    qkv [T, C] (conv output: q [Hk*Dk] | k [Hk*Dk] | v [Hv*Dv]); b, a [T, Hv]; dt_bias, ssm_a [Hv];
    states[s] [L, Hv, Dv, Dk] f32: layer `slot` is sequence s's state M (M[j] = column j of S),
    updated in place; tiled: value head h reads key head h % Hk, else h // (Hv/Hk). out [T, Hv, Dv]."""
    S = len(offsets) - 1
    Hv, Dv, Dk = out.shape[1], out.shape[2], states[0].shape[3]
    r = Hv // Hk
    eps_n = _F32(_F32(eps) / _F32(Dk))
    inv_sqrt_k = _F32(1.0) / _F32(math.sqrt(_F32(Dk)))
    scale = _F32(1.0) / _F32(math.sqrt(_F32(Dv)))
    kd = Hk * Dk
    for sh in prange(S * Hv):
        s, h = sh // Hv, sh % Hv
        kh = h % Hk if tiled else h // r
        M = states[s][slot, h]  # [Dv, Dk]
        Mb = M.view(np.uint32)  # float_rows(F32 = 0, vec_dot order, 1 row): ggml_vec_dot_f32 on AVX2
        qn = np.empty((1, Dk), np.float32)
        kn = np.empty((1, Dk), np.float32)
        delta = np.empty(Dv, np.float32)
        for t in range(offsets[s], offsets[s + 1]):
            row = qkv[t]
            _l2_normed(row, kh * Dk, Dk, eps_n, inv_sqrt_k, qn)
            _l2_normed(row, kd + kh * Dk, Dk, eps_n, inv_sqrt_k, kn)
            beta = _F32(1.0) / _F32(_F32(1.0) + expf(-b[t, h]))
            z = _F32(a[t, h] + dt_bias[h])
            sp = z if z > _F32(20.0) else _F32(math.log(_F32(_F32(1.0) + expf(z))))
            decay = expf(_F32(sp * ssm_a[h]))
            for j in range(Dv):
                for i in range(Dk):
                    M[j, i] = _F32(M[j, i] * decay)
            v0 = 2 * kd + h * Dv
            for j in range(Dv):
                delta[j] = _F32(_F32(row[v0 + j] - float_rows(0, 0, 1, Mb, j, kn, 0)[0]) * beta)
            for j in range(Dv):
                dj = delta[j]
                for i in range(Dk):
                    M[j, i] = fma32(kn[0, i], dj, M[j, i])
            for j in range(Dv):
                out[t, h, j] = _F32(float_rows(0, 0, 1, Mb, j, qn, 0)[0] * scale)


@njit(cache=True, error_model="numpy")
def gated_rms_norm(x, weight, z, eps):
    """rms_norm(x [T, H, D]) per head * weight [D] * silu(z [T, H*D]) -> [T, H*D]: ggml_rms_norm,
    ggml_mul, then ggml_mul by ggml_silu(z) (rows of D: SIMD groups of 8, scalar tail)."""
    T, H, D = x.shape
    out = np.empty((T, H * D), np.float32)
    nv = D - D % 8
    for t in range(T):
        for h in range(H):
            acc = 0.0
            for i in range(D):
                acc += _F32(x[t, h, i] * x[t, h, i])
            mean = _F32(acc / D)
            sc = _F32(1.0) / _F32(math.sqrt(_F32(mean + eps)))
            o = h * D
            for i in range(D):
                g = z[t, o + i]
                sg = v_silu(g) if i < nv else silu_f32(g)
                out[t, o + i] = _F32(_F32(_F32(x[t, h, i] * sc) * weight[i]) * sg)
    return out


@njit(cache=True, error_model="numpy")
def sigmoid_mul(y, z):
    """y [T, N] * (1 / (1 + expf(-z))), z [T, N] or [T, 1] (ggml_sigmoid, then ggml_mul)."""
    T, N = y.shape
    out = np.empty_like(y)
    wide = z.shape[1] == N
    for t in range(T):
        for n in range(N):
            zv = z[t, n] if wide else z[t, 0]
            out[t, n] = _F32(y[t, n] * _F32(_F32(1.0) / _F32(_F32(1.0) + expf(-zv))))
    return out
