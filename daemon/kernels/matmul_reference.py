"""The "float32" reference numerics (numba): out[t, n] = W[n] . x[t] with each weight row converted to
float32 exactly (F32/F16/BF16 bits, or quants.dequant_row for block types, bit-identical to
gguf.quants) and dotted with x in float64; the float64 sum is rounded to float32 once.

Legend: T = activation rows, K = input features, N = weight rows.
"""

from __future__ import annotations

import numba
import numpy as np
from llvmlite import ir
from numba import prange, types
from numba.extending import intrinsic

from daemon.kernels import quants as Q
from daemon.kernels.quants import dequant_row, u32_as_f32
from daemon.kernels.simd_ir import I16

# ---- float weights: exact conversion, float64 dot


@intrinsic
def _half_to_f32(typingctx, h):
    """IEEE half bits (low 16 bits of an integer) -> float32 with LLVM's fpext (exact;
    vcvtph2ps on x86, vectorizable)."""
    if not isinstance(h, types.Integer):
        return None

    def codegen(context, builder, sig, args):
        v = args[0]
        if h.bitwidth > 16:
            v = builder.trunc(v, I16)
        elif h.bitwidth < 16:
            v = builder.zext(v, I16)
        return builder.fpext(builder.bitcast(v, ir.HalfType()), ir.FloatType())

    return types.float32(h), codegen


@numba.njit(cache=True)
def _row_to_f32(w, qt, fb):
    """One row of F32 (uint32 bits), F16 or BF16 (uint16 bits) -> float32 fb, exactly."""
    if qt == Q.F32:
        for k in range(w.shape[0]):
            fb[k] = u32_as_f32(w[k])
    elif qt == Q.BF16:
        for k in range(w.shape[0]):
            fb[k] = u32_as_f32(np.uint32(w[k]) << np.uint32(16))
    else:
        for k in range(w.shape[0]):
            fb[k] = _half_to_f32(w[k])


@numba.njit(cache=True, fastmath={"reassoc", "contract", "nsz"})
def _dot64(a, b):
    s = 0.0
    for k in range(a.shape[0]):
        s += np.float64(a[k]) * np.float64(b[k])
    return s


@numba.njit(cache=True, parallel=True)
def float_weights(w, qt, x, out, nchunks):
    """out [T, N] = x [T, K] @ W.T for w [N, K]: F32 (uint32 bits), F16 or BF16 (uint16 bits)."""
    N, K = w.shape
    T = x.shape[0]
    for c in prange(nchunks):
        fb = np.empty(K, np.float32)
        for n in range(c * N // nchunks, (c + 1) * N // nchunks):
            _row_to_f32(w[n], qt, fb)
            for t in range(T):
                out[t, n] = _dot64(fb, x[t])


# ---- block types: exact dequantization per row, float64 dot


@numba.njit(cache=True, parallel=True)
def block_weights(raw, qt, K, x, out, nchunks):
    """out [T, N] = x [T, K] @ W.T for raw uint8 [N, row_bytes] blocks of type qt."""
    N = raw.shape[0]
    T = x.shape[0]
    for c in prange(nchunks):
        buf = np.empty(K, np.float32)
        for n in range(c * N // nchunks, (c + 1) * N // nchunks):
            dequant_row(raw[n], qt, K, buf)
            for t in range(T):
                out[t, n] = _dot64(buf, x[t])
