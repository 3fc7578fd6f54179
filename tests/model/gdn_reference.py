"""A numpy reference of one Gated DeltaNet head group, as llama.cpp computes it
(docs/qwen3next.md, steps 4 and 8): the causal conv1d with its rolling state, the fused
token-by-token recurrence (ggml_compute_forward_gated_delta_net_one_chunk, what llama.cpp's
CPU runs for decode and prefill alike) and the chunked form (build_delta_net_chunking,
CS = 64). float32 throughout, numpy's own summation order: a reference for the math and for
the order effects between the two forms, not for ggml's bits.

Shapes (legend in docs/qwen3next.md): T tokens, H value heads (q/k already repeated to H),
Dk = Dv = S.
    q, k      [T, H, S]   l2-normed
    v         [T, H, S]
    g, beta   [T, H]      g = softplus(a + dt_bias) * ssm_a (<= 0), beta = sigmoid(b)
    M         [H, S, S]   recurrent state as llama.cpp stores it: M[h, j, i] = S_h[i, j],
                          i over keys, j over values
    conv_state [C, Kc-1]  the previous Kc-1 inputs per channel, oldest first
"""

from __future__ import annotations

import numpy as np

CHUNK = 64  # build_delta_net_chunking's CS for a scalar gate


def conv_step(x: np.ndarray, state: np.ndarray, w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Causal depthwise conv over x [T, C] with state [C, Kc-1] and weights w [C, Kc]
    (ggml_ssm_conv: sum over i = 0..Kc-1 of window[c, t+i] * w[c, i], in that order, no bias).
    Returns (out [T, C] before silu, new state [C, Kc-1])."""
    Kc = w.shape[1]
    window = np.concatenate([state, x.T], axis=1).astype(np.float32)  # [C, Kc-1+T]
    T = x.shape[0]
    out = np.zeros((T, x.shape[1]), np.float32)
    for i in range(Kc):  # ascending i, f32 accumulator as in the C loop
        out += window[:, i : i + T].T * w[:, i]
    return out, window[:, T:].copy()


def recurrent(q, k, v, g, beta, M):
    """The fused op's loop: per token, decay, delta rule, then read out with 1/sqrt(S) applied
    to the dot product. Returns (o [T, H, S], new M)."""
    M = M.astype(np.float32).copy()
    T, H, S = v.shape
    scale = np.float32(1.0 / np.sqrt(np.float32(S)))
    o = np.empty((T, H, S), np.float32)
    for t in range(T):
        M *= np.exp(g[t]).astype(np.float32)[:, None, None]
        delta = (v[t] - np.einsum("hji,hi->hj", M, k[t])) * beta[t][:, None]  # [H, S] over j
        M += delta[:, :, None] * k[t][:, None, :]
        o[t] = np.einsum("hji,hi->hj", M, q[t]) * scale
    return o, M


def chunked(q, k, v, g, beta, M, cs: int = CHUNK):
    """build_delta_net_chunking for a scalar gate, per head, in f32. Same arguments and
    results as `recurrent`."""
    T, H, S = v.shape
    pad = (-T) % cs
    f32 = np.float32

    def padded(x):
        return np.concatenate([x, np.zeros((pad,) + x.shape[1:], x.dtype)]).astype(f32)

    q = padded(q) * f32(1.0 / np.sqrt(f32(S)))  # q pre-scaled here, unlike the fused op
    k, v, g, beta = padded(k), padded(v), padded(g), padded(beta)
    o = np.empty_like(v)
    M = M.astype(f32).copy()
    eye = np.eye(cs, dtype=f32)
    lower_diag = np.tril(np.ones((cs, cs), bool))
    for h in range(H):
        St = M[h].T.copy()  # [Dk, Dv]: S_h
        for c0 in range(0, T + pad, cs):
            sl = slice(c0, c0 + cs)
            qc, kc, vc, bc = q[sl, h], k[sl, h], v[sl, h], beta[sl, h][:, None]
            kb, vb = kc * bc, vc * bc
            gc = np.cumsum(g[sl, h], dtype=f32)  # [cs]
            # ggml_tri(LOWER_DIAG) before exp: above the diagonal exp(0) = 1, zeroed below
            decay = np.exp(np.where(lower_diag, gc[:, None] - gc[None, :], 0)).astype(f32)
            A = np.tril((kb @ kc.T) * decay, -1)
            KQ = np.tril((qc @ kc.T) * decay)
            W = np.linalg.solve(eye + A, eye).astype(f32)  # (I + A)^-1, lower unit-triangular
            U = W @ vb
            Kcd = W @ (kb * np.exp(gc)[:, None])
            Vnew = U - Kcd @ St
            o[sl, h] = (qc * np.exp(gc)[:, None]) @ St + KQ @ Vnew
            St = St * np.exp(gc[-1]) + (kc * np.exp(gc[-1] - gc)[:, None]).T @ Vnew
        M[h] = St.T
    return o[:T], M


def random_inputs(T: int, H: int = 4, S: int = 32, seed: int = 0):
    """Inputs shaped like a real layer's: l2-normed q/k, beta in (0, 1), g = -softplus(.)*A."""
    r = np.random.default_rng(seed)
    q = r.standard_normal((T, H, S)).astype(np.float32)
    k = r.standard_normal((T, H, S)).astype(np.float32)
    q /= np.linalg.norm(q, axis=-1, keepdims=True)
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    v = r.standard_normal((T, H, S)).astype(np.float32)
    beta = (1 / (1 + np.exp(-r.standard_normal((T, H))))).astype(np.float32)
    a = r.standard_normal((T, H)) - 2.0
    g = (-np.log1p(np.exp(a)) * r.uniform(0.5, 4.0, H)).astype(np.float32)
    M = (0.1 * r.standard_normal((H, S, S))).astype(np.float32)
    return q, k, v, g, beta, M
