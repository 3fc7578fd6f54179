"""FFN elementwise ops on the device: GLU variants (with per-expert biases), the weighted MoE
combine, the shared expert's sigmoid gate, and a plain add.

Legend: T = tokens, A = experts used per token, P = (token, expert) pairs (T*A, token-major:
pair t*A + a is token t's a-th expert in top-k order), F = FFN size, D = hidden size, E = experts.

Semantics of daemon/kernels/ops.py and daemon/model/moe.py, in float32 (the CPU emulates ggml's
SIMD exp; the GPU uses expf, so values agree to a few ulp):
- silu:  silu(g) * u = g / (1 + exp(-g)) * u                                  (ops.swiglu)
- oai:   x = min(g, limit), y = clamp(u, -limit, limit), x / (1 + exp(-alpha*x)) * (y + 1)
                                                                              (ops.swiglu_oai)
  with gpt-oss's expert biases added to g and u first, by the pair's expert id;
- moe_mix: out[t] = ((y0*w0 + y1*w1) + y2*w2) + ..., y_a = the row of pair (t, a) (+ the down
  projection's bias of its expert), in top-k order                             (ops.moe_mix);
- sigmoid_gate: y * sigmoid(z) per row (qwen2moe's shared expert; the CPU computes silu(z)/z).
"""

from __future__ import annotations

import functools
import math

import numpy as np
from numba import cuda

from .device import placeholder, sigmoid
from .launch import launch

_THREADS = 128
_U = np.uint32


def _grid(n: int) -> int:
    return (n + _THREADS - 1) // _THREADS


@cuda.jit
def _glu(gate, up, oai, alpha, limit, gate_bias, up_bias, has_bias, ids, out):
    """gate, up, out: f32 [P, F]; gate_bias, up_bias: f32 [E, F] by ids[p] (read when has_bias)."""
    idx = cuda.grid(1)
    P, F = out.shape
    if idx >= P * F:
        return
    p = idx // F
    i = idx - p * F
    g = gate[p, i]
    u = up[p, i]
    if has_bias:
        e = ids[p]
        g += gate_bias[e, i]
        u += up_bias[e, i]
    if oai:
        x = min(g, limit)
        y = min(max(u, -limit), limit)
        out[p, i] = x / (np.float32(1.0) + math.exp(alpha * -x)) * (y + np.float32(1.0))
    else:
        out[p, i] = g / (np.float32(1.0) + math.exp(-g)) * u


@functools.cache
def _mix_kernel(A: int):
    """The MoE mix for A experts a token (a constant: the A loads unroll and are in flight together;
    with A a run-time bound they were waited for one after another). Indices are unsigned (no
    negative-index fix-ups)."""

    @cuda.jit
    def _moe_mix(y, weights, rows, has_rows, down_bias, ids, has_bias, out):
        """y: f32 [P, D]; weights: f32 [T, A]; rows: int32 [T, A] rows of y (else t*A + a);
        down_bias: f32 [E, D] by ids [T, A] (read when has_bias); out: f32 [T, D]."""
        idx = _U(cuda.grid(1))
        T = _U(out.shape[0])
        D = _U(out.shape[1])
        if idx >= T * D:
            return
        t = idx // D
        d = idx - t * D
        rs = cuda.local.array(A, np.uint32)
        for a in range(A):
            rs[a] = _U(rows[t, _U(a)]) if has_rows else t * _U(A) + _U(a)
        vs = cuda.local.array(A, np.float32)
        ws = cuda.local.array(A, np.float32)
        for a in range(A):
            vs[a] = y[rs[a], d]
            ws[a] = weights[t, _U(a)]
        if has_bias:
            for a in range(A):
                vs[a] += down_bias[_U(ids[t, _U(a)]), d]
        acc = vs[0] * ws[0]
        for a in range(1, A):
            acc += vs[a] * ws[a]
        out[t, d] = acc

    return _moe_mix


@cuda.jit
def _sigmoid_gate(y, z, accumulate, out):
    """out (+)= y * sigmoid(z). y, out: f32 [T, N]; z: f32 [T, 1]."""
    idx = cuda.grid(1)
    T, N = y.shape
    if idx >= T * N:
        return
    t = idx // N
    v = y[t, idx - t * N] * sigmoid(z[t, 0])
    if accumulate:
        v += out[t, idx - t * N]
    out[t, idx - t * N] = v


@cuda.jit
def _add(a, b, out):
    """f32 [T, N] each."""
    idx = cuda.grid(1)
    T, N = out.shape
    if idx < T * N:
        t = idx // N
        out[t, idx - t * N] = a[t, idx - t * N] + b[t, idx - t * N]


def glu(gate, up, out, kind: str = "silu", alpha: float = 0.0, limit: float = 0.0, gate_bias=None, up_bias=None,
        ids=None, stream=0) -> None:
    """out = GLU(gate, up) (see the module doc). gate, up, out: device f32 [P, F] (out may be gate);
    kind: "silu" or "oai"; gate_bias, up_bias: device f32 [E, F] (both or neither) added by each
    row's expert ids [P] int32 (the router's [T, A] ids, flattened)."""
    P, F = out.shape
    if gate.shape != (P, F) or up.shape != (P, F) or kind not in ("silu", "oai"):
        raise ValueError(f"glu: gate {gate.shape}, up {up.shape}, out {out.shape}, kind {kind!r}")
    has_bias = gate_bias is not None
    if has_bias and (up_bias is None or ids is None or ids.shape != (P,) or gate_bias.shape[1] != F):
        raise ValueError("glu: biases need both gate_bias and up_bias [E, F] and ids [P]")
    if P * F:
        launch(_glu, _grid(P * F), _THREADS, stream, gate, up, kind == "oai", np.float32(alpha), np.float32(limit),
                                             gate_bias if has_bias else gate, up_bias if has_bias else up, has_bias,
                                             ids if has_bias else placeholder(np.int32), out)


def moe_mix(y, weights, out, rows=None, down_bias=None, ids=None, stream=0) -> None:
    """out[t] = sum over a, in top-k order, of (y[row(t, a)] + down_bias[ids[t, a]]) * weights[t, a].

    y: device f32 [P, D]; weights: f32 [T, A]; out: f32 [T, D]; rows: int32 [T, A] rows of y
    (None: t*A + a); down_bias: f32 [E, D] with ids int32 [T, A], or None."""
    T, D = out.shape
    has_bias = down_bias is not None
    if weights.shape[0] != T or weights.shape[1] < 1 or y.shape[1] != D or (rows is not None and rows.shape != weights.shape) \
            or (has_bias and (ids is None or ids.shape != weights.shape)):
        raise ValueError(f"moe_mix: y {y.shape}, weights {weights.shape}, out {out.shape}")
    if T * D:
        dummy = placeholder(np.int32, 2)
        launch(_mix_kernel(weights.shape[1]), _grid(T * D), _THREADS, stream, y, weights, dummy if rows is None else rows, rows is not None,
                                                 down_bias if has_bias else y, dummy if ids is None else ids,
                                                 has_bias, out)


def sigmoid_gate(y, z, out, accumulate: bool = False, stream=0) -> None:
    """out = y * sigmoid(z), or out += it (accumulate: the shared expert added to the MoE output).
    y, out: device f32 [T, N]; z: f32 [T, 1] (the gate's logit per token)."""
    T, N = y.shape
    if out.shape != (T, N) or z.shape != (T, 1):
        raise ValueError(f"sigmoid_gate: y {y.shape}, z {z.shape}, out {out.shape}")
    if T * N:
        launch(_sigmoid_gate, _grid(T * N), _THREADS, stream, y, z, bool(accumulate), out)


def add(a, b, out, stream=0) -> None:
    """out = a + b elementwise (device f32 [T, N] arrays; out may be a or b)."""
    if a.shape != b.shape or out.shape != a.shape or a.ndim != 2:
        raise ValueError(f"add: {a.shape} + {b.shape} -> {out.shape}")
    n = out.size
    if n:
        launch(_add, _grid(n), _THREADS, stream, a, b, out)
