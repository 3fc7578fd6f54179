"""MoE router on the device: softmax and top-k per row, writing expert ids and weights to device
memory, so the expert kernels read them without a host sync.

Legend: T = tokens (rows), E = experts, A = experts used per token.

The same computation as daemon/model/moe.py's route (the CPU backend's router), per family:
- "softmax" (qwen3moe, qwen2moe, olmoe, Mixtral): probs = softmax(logits + bias) over E, ids = the A
  largest probs, weights = probs at ids;
- "softmax_weight" (gpt-oss): ids = the A largest logits, weights = softmax over those A logits;
then, if norm_topk, weights / max(sum(weights), 2^-14); if scale (expert_weights_scale) != 0,
weights * scale. Top-k order is largest first and ties keep the lower expert index first (the CPU's
stable argsort); a NaN score ranks below every number. With `given` ids (routing replay) the ids
are read from `ids` and only weighed.

One block per row. The top-k is A rounds of a block argmax over (value, index) pairs in a fixed
tree order, so the result is the same on every run and independent of the other rows.
"""

from __future__ import annotations

import math

import numpy as np
from numba import cuda

from .device import SIM, block_max, block_sum, placeholder

MAX_EXPERTS = 1024
MAX_USED = 64
_BLOCK = 128  # shared per-thread slots (the most threads a launch uses)
_THREADS = 32 if SIM else 128  # threads per row (the simulator runs each in Python)
_NEG_INF = np.float32(-np.inf)


@cuda.jit
def _route(logits, bias, has_bias, softmax_first, norm_topk, scale, given, ids, weights):
    """logits: f32 [T, E]; bias: f32 [E] (read when has_bias); ids: int32 [T, A] (out, or in when
    given); weights: f32 [T, A] out. Grid T blocks."""
    t = cuda.blockIdx.x
    tid = cuda.threadIdx.x
    nt = cuda.blockDim.x
    E = logits.shape[1]
    A = ids.shape[1]
    vals = cuda.shared.array(MAX_EXPERTS, np.float32)
    taken = cuda.shared.array(MAX_EXPERTS, np.int32)
    best_v = cuda.shared.array(_BLOCK, np.float32)
    best_i = cuda.shared.array(_BLOCK, np.int32)
    sel = cuda.shared.array(MAX_USED, np.float32)
    m = _NEG_INF
    for e in range(tid, E, nt):
        v = logits[t, e]
        if has_bias:
            v += bias[e]
        vals[e] = v
        taken[e] = 0
        m = max(m, v)
    if softmax_first:  # probs over all experts
        best_v[tid] = m
        m = block_max(best_v, tid, nt)
        s = np.float32(0.0)
        for e in range(tid, E, nt):
            x = math.exp(vals[e] - m)
            vals[e] = x
            s += x
        best_v[tid] = s
        inv = np.float32(1.0) / block_sum(best_v, tid, nt)
        for e in range(tid, E, nt):
            vals[e] *= inv
    cuda.syncthreads()
    for a in range(A):
        if given:
            win = ids[t, a]
        else:
            bv = _NEG_INF
            bi = E  # none yet
            for e in range(tid, E, nt):  # ascending: a tie keeps the lower index
                v = vals[e]
                if taken[e] == 0 and (bi == E or v > bv):
                    if v == v or bi == E:  # NaN only while nothing else is found
                        bv = v if v == v else _NEG_INF
                        bi = e
            best_v[tid] = bv
            best_i[tid] = bi
            cuda.syncthreads()
            stride = nt // 2
            while stride > 0:
                if tid < stride:
                    ov = best_v[tid + stride]
                    oi = best_i[tid + stride]
                    mi = best_i[tid]
                    if oi < E and (mi == E or ov > best_v[tid] or (ov == best_v[tid] and oi < mi)):
                        best_v[tid] = ov
                        best_i[tid] = oi
                cuda.syncthreads()
                stride //= 2
            win = best_i[0]
        if tid == 0:
            if not given:
                ids[t, a] = win
            taken[win] = 1
            sel[a] = vals[win]
        cuda.syncthreads()
    if tid == 0:
        if not softmax_first:  # softmax over the selected logits
            mx = _NEG_INF
            for a in range(A):
                mx = max(mx, sel[a])
            s = np.float32(0.0)
            for a in range(A):
                sel[a] = math.exp(sel[a] - mx)
                s += sel[a]
            for a in range(A):
                sel[a] = sel[a] / s
        div = np.float32(1.0)
        if norm_topk:
            s = np.float32(0.0)
            for a in range(A):
                s += sel[a]
            div = max(s, np.float32(6.103515625e-5))
        for a in range(A):
            w = sel[a]
            if norm_topk:
                w = w / div
            if scale != np.float32(0.0):
                w = w * scale
            weights[t, a] = w


def route(logits, gating: str, norm_topk: bool, scale: float, ids, weights, bias=None, given: bool = False,
          stream=0) -> None:
    """Top-k routing of each row of logits (see the module doc).

    logits: device f32 [T, E]; ids: device int32 [T, A] (written; read instead when given, for
    routing replay); weights: device f32 [T, A] (written); bias: device f32 [E]
    (ffn_gate_inp.bias) or None; gating: "softmax" or "softmax_weight"; scale: expert_weights_scale
    (0 = none)."""
    T, E = logits.shape
    A = ids.shape[1]
    if gating not in ("softmax", "softmax_weight"):
        raise ValueError(f"route: unknown gating {gating!r}")
    if ids.shape != (T, A) or weights.shape != (T, A) or not 0 < A <= min(E, MAX_USED) or E > MAX_EXPERTS:
        raise ValueError(f"route: logits {logits.shape}, ids {ids.shape}, weights {weights.shape} "
                         f"(at most {MAX_EXPERTS} experts, {MAX_USED} used)")
    if T:
        _route[T, _THREADS, stream](logits, placeholder(np.float32) if bias is None else bias, bias is not None,
                                    gating == "softmax", bool(norm_topk), np.float32(scale), bool(given), ids, weights)
