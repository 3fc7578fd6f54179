"""A one-token step's experts in one compiled call (issue 28): for each (row, expert) pair, gate
and up, the GLU, the quantization of its output and down, as three parallel regions of one numba
function, where the separate ops take five dispatches and four regions (gate, up, GLU, quantize,
down) with Python between them.

Every value comes from the same row intrinsics (matmul_quant.py), GLU (ops.py) and quantizers
(matmul_activations.py) as the separate ops, in the same order: a one-token expert call's vec_dot
path, so the bits are llama.cpp's as before. Quantized weights with "ggml" numerics only; the
backend keeps the separate ops for the rest (float weights, "float32" numerics, prefill).

Legend: P = pairs (token, expert) of the step, T = activation rows, D = hidden size, F = expert
FFN size, E = experts in a stack, B = 32-value blocks of a row, S = 256-value super-blocks.
"""

from __future__ import annotations

import functools

import numba
import numpy as np
from numba import prange

from daemon.kernels import quants as Q
from daemon.kernels.matmul import _nchunks
from daemon.kernels.matmul_activations import Prepared
from daemon.kernels.matmul_types import VEC_DOT_TYPE
from daemon.kernels.ops import _swiglu_row, swiglu_oai_row
from daemon.kernels.row_dot import QUANTIZED, SOURCES, aux_of, dot_row, quantize_row

GLU_KINDS = {"silu": 0, "oai": 1}


def supports(gate_type: int, up_type: int, down_type: int) -> bool:
    """Whether these expert weight types have the fused call (quantized, gate and up alike)."""
    return gate_type == up_type and gate_type in QUANTIZED and down_type in QUANTIZED


@functools.cache
def ffn_kernel(gate_type: int, down_type: int, glu: int):
    """kernel(gate, up, down, slots, experts, tokens, xq, xd, xaux, gate_bias, up_bias, down_bias,
    has_bias, alpha, limit, gu, h, hq, hd, haux, out, nchunks) for one pair of weight types and
    GLU kind, compiled on first use and cached on disk (a closure over its types, like
    matmul_quant's kernels)."""
    spec = (int(gate_type), int(down_type), int(VEC_DOT_TYPE[down_type]), int(glu), SOURCES)

    @numba.njit(cache=True, parallel=True, error_model="numpy")
    def expert_ffn(gate, up, down, slots, experts, tokens, xq, xd, xaux, gate_bias, up_bias, down_bias,
                   has_bias, alpha, limit, gu, h, hq, hd, haux, out, nchunks):
        gk = spec[0]
        dk = spec[1]
        hv = spec[2]
        P = slots.shape[0]
        F = gate.shape[1]
        D = down.shape[1]
        total = 2 * P * F
        for c in prange(nchunks):  # gate and up: gu [2, P, F] (one row intrinsic for both)
            for i in range(c * total // nchunks, (c + 1) * total // nchunks):
                p = i // (2 * F)
                w = (i // F) % 2
                n = i % F
                v = dot_row(gk, gate if w == 0 else up, slots[p], n, xq, tokens[p], xd, xaux)
                if has_bias:
                    v = v + (gate_bias if w == 0 else up_bias)[experts[p], n]
                gu[w, p, n] = v
        for p in prange(P):  # the GLU, quantized for down: h [P, F] -> hq, hd, haux
            if spec[3] == 0:
                _swiglu_row(gu[0, p], gu[1, p], h[p], F - F % 8)
            else:  # gpt-oss
                swiglu_oai_row(gu[0, p], gu[1, p], h[p], alpha, limit)
            quantize_row(hv, h[p], hq[p], hd[p], haux[p])
        total = P * D
        for c in prange(nchunks):  # down: out [P, D]
            for i in range(c * total // nchunks, (c + 1) * total // nchunks):
                p = i // D
                n = i % D
                y = dot_row(dk, down, slots[p], n, hq, p, hd, haux)
                if has_bias:
                    y = y + down_bias[experts[p], n]
                out[p, n] = y

    return expert_ffn


_NO_BIAS = Q._readonly(np.zeros((1, 1), np.float32))


def expert_ffn(xp: Prepared, batch, layout, slots: np.ndarray, experts: np.ndarray, tokens: np.ndarray,
               kind: str, alpha: float, limit: float) -> np.ndarray:
    """down(glu(gate·x, up·x)) of each pair (slots [P] its experts' index in the stacks, experts
    [P] their ids, for the biases; tokens [P] its row of xp, prepared for the gate's type) -> [P, D],
    each as a one-token expert call computes it."""
    P, F, D = slots.shape[0], layout.n_ff, layout.n_embd
    vt = VEC_DOT_TYPE[layout.down_type]
    hq = np.empty((P, F), np.int8)
    if vt == Q.Q8_K:
        hd, haux = np.empty((P, F // 256), np.float32), np.empty((P, F // 16), np.int32)
    else:
        hd, haux = np.empty((P, F // 32), np.float32), np.empty((P, F // 32), np.float32)
    xaux = aux_of(xp)
    has_bias = batch.gate_bias is not None
    out = np.empty((P, D), np.float32)
    if P:
        ffn_kernel(layout.gate_type, layout.down_type, GLU_KINDS[kind])(
            Q._readonly(batch.gate), Q._readonly(batch.up), Q._readonly(batch.down),
            np.ascontiguousarray(slots, np.int64), np.ascontiguousarray(experts, np.int64),
            np.ascontiguousarray(tokens, np.int64), xp.qs, xp.d, xaux,
            *(_biases(batch) if has_bias else (_NO_BIAS,) * 3),
            has_bias, np.float32(alpha), np.float32(limit), np.empty((2, P, F), np.float32),
            np.empty((P, F), np.float32), hq, hd, haux, out, _nchunks(P * max(F, D)))
    return out


def _biases(batch) -> tuple:
    """The experts' biases [E, N] as float32, read-only (one specialization whatever their source)."""
    return tuple(Q._readonly(np.ascontiguousarray(b, np.float32))
                 for b in (batch.gate_bias, batch.up_bias, batch.down_bias))
