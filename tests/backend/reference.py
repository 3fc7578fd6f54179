"""Independent numpy (float64) references for the backend ops, and test data makers.
Weights are dequantized with gguf-py, never with moed's own code.

Legend: T = rows, D = hidden size, N = output rows, K = input length, H = query heads,
Hkv = key/value heads, Dh = key head size, Dv = value head size, E = experts, A = experts used.
"""

from __future__ import annotations

import math

import numpy as np
from gguf import GGMLQuantizationType
from gguf import quants as gq

from daemon.kernels import quants as Q
from daemon.model.hparams import HParams, Rope
from daemon.model.weights import QWeight
from tests.kernels.test_quants import random_blocks

QUANTIZABLE = (Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.MXFP4, Q.BF16, Q.F16, Q.F32)


def raw_weights(qt: int, shape: tuple[int, ...], k: int, rng) -> np.ndarray:
    """uint8 [*shape, row bytes]: quantized from floats where gguf-py can, else random blocks."""
    if qt in QUANTIZABLE:
        w = (rng.standard_normal(shape + (k,)) * 0.1).astype(np.float32)
        return np.ascontiguousarray(gq.quantize(w, GGMLQuantizationType(qt))).view(np.uint8).reshape(*shape, -1)
    return random_blocks(qt, shape, k, rng)


def qweight(qt: int, n: int, k: int, rng) -> QWeight:
    return QWeight(raw_weights(qt, (n,), k, rng), qt, k, n)


def dequant(raw: np.ndarray, qt: int) -> np.ndarray:
    """float64 values of raw uint8 [..., row bytes] -> [..., K]."""
    return gq.dequantize(raw, GGMLQuantizationType(qt)).astype(np.float64)


def rel_err(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))


def tolerance(backend, qt: int | None = None) -> float:
    """Relative error allowed for a product with weights of type qt (None: no matmul): float32
    numerics round nothing; ggml numerics quantize activations to 8 bits (or round them to
    f16/bf16) and round attention to f16."""
    if getattr(backend, "numerics", None) == "float32":
        return 1e-5
    if qt is None or qt == Q.F32:
        return 2e-3
    if qt in (Q.F16, Q.BF16):
        return 1e-2
    return 3e-2


def small_hparams(n_layer=2, n_head=4, n_head_kv=2, head_dim=8, head_dim_v=8, rope: Rope | None = None) -> HParams:
    return HParams(arch="llama", n_vocab=32, n_embd=16, n_layer=n_layer, n_head=n_head, n_head_kv=n_head_kv,
                   head_dim=head_dim, head_dim_v=head_dim_v, n_ctx_train=4096, rms_eps=1e-5,
                   rope=rope or Rope(n_dims=head_dim, freq_base=10000.0, neox=False))


# -- op references --------------------------------------------------------------------------


def rms_norm(x, w, eps):
    x = np.asarray(x, np.float64)
    return x / np.sqrt((x * x).mean(axis=-1, keepdims=True) + eps) * w


def silu(x):
    return x / (1 + np.exp(-x))


def swiglu_oai(g, u, alpha, limit):
    x = np.minimum(g, limit)
    return x / (1 + np.exp(-alpha * x)) * (np.clip(u, -limit, limit) + 1)


def softmax(x, axis=-1):
    e = np.exp(x - x.max(axis=axis, keepdims=True))
    return e / e.sum(axis=axis, keepdims=True)


def rope(x, pos, r: Rope):
    """ggml's rope (NORM: adjacent pairs, NEOX: halves) with YaRN's ramp. x [T, H, Dh]."""
    x = np.asarray(x, np.float64)
    half = r.n_dims // 2
    i = np.arange(half)
    theta_extrap = pos[:, None].astype(np.float64) * r.freq_base ** (-2.0 * i / r.n_dims)  # [T, half]
    theta_interp = r.freq_scale * theta_extrap
    mscale = r.attn_factor
    theta = theta_interp
    if r.ext_factor:
        lo, hi = r.corr_dims
        mix = (1 - np.clip((i - lo) / max(0.001, hi - lo), 0, 1)) * r.ext_factor
        theta = theta_interp * (1 - mix) + theta_extrap * mix
        mscale *= 1 + 0.1 * math.log(1 / r.freq_scale)
    c, s = (np.cos(theta) * mscale)[:, None, :], (np.sin(theta) * mscale)[:, None, :]
    out = x.copy()
    a, b = (slice(0, half), slice(half, r.n_dims)) if r.neox else (slice(0, r.n_dims, 2), slice(1, r.n_dims, 2))
    out[..., a] = x[..., a] * c - x[..., b] * s
    out[..., b] = x[..., a] * s + x[..., b] * c
    return out


def attention(q, k_all, v_all, pos, scale, window=0, sinks=None):
    """Causal attention of rows q [T, H, Dh] at positions pos [T] over one sequence's cells
    k_all [C, Hkv, Dh], v_all [C, Hkv, Dv] (cell j = position j). -> [T, H, Dv]"""
    T, H, _ = q.shape
    G = H // k_all.shape[1]
    out = np.zeros((T, H, v_all.shape[2]))
    for t in range(T):
        p = int(pos[t])
        lo = max(0, p - window + 1) if window else 0
        for h in range(H):
            s = k_all[lo:p + 1, h // G].astype(np.float64) @ q[t, h] * scale
            m = max(s.max(), sinks[h]) if sinks is not None else s.max()
            e = np.exp(s - m)
            total = e.sum() + (math.exp(sinks[h] - m) if sinks is not None else 0.0)
            out[t, h] = (e / total) @ v_all[lo:p + 1, h // G]
    return out


def route(logits, n_used, gating, norm_topk, scale):
    """-> ids [T, A], weights [T, A] as llama.cpp's build_moe_ffn."""
    logits = np.asarray(logits, np.float64)
    if gating == "softmax_weight":
        ids = np.argsort(-logits, axis=1, kind="stable")[:, :n_used]
        w = softmax(np.take_along_axis(logits, ids, 1))
    else:
        probs = softmax(logits)
        ids = np.argsort(-probs, axis=1, kind="stable")[:, :n_used]
        w = np.take_along_axis(probs, ids, 1)
    if norm_topk:
        w = w / w.sum(1, keepdims=True)
    if scale:
        w = w * scale
    return ids, w
