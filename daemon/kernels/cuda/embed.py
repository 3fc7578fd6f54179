"""Token embedding on the device: get_rows of the embedding matrix, dequantized to float32.

Legend: V = vocabulary (rows), D = hidden size (values per row), T = tokens, RB = bytes per row.

The matrix stays in its GGUF encoding on the device as raw bytes, uint8 [V, RB] (ggml blocks, see
daemon/kernels/quants.py). Each thread produces one value: it finds the value's block and applies
the formula of quants.dequant_row in the same float32 operations (e.g. Q4_K: (d*sc)*q - dmin*m), so
results equal the CPU's dequantization up to the GPU contracting a multiply and an add into one
FMA (one rounding fewer, at most 1 ulp apart).
"""

from __future__ import annotations

import numpy as np
from numba import cuda

from ...errors import UnsupportedError
from .. import quants as Q
from .device import bits_to_f32, f16_at
from .launch import launch

_THREADS = 128


@cuda.jit(device=True, inline=True)
def _u8_as_i8(q):
    return q - ((q >> 7) << 8)


@cuda.jit(device=True, inline=True)
def _nibble(row, o, j):
    """Value j (0..31) of a 32-value block whose 16 code bytes start at o: low nibbles hold values
    0..15, high nibbles 16..31."""
    q = np.int32(row[o + (j & 15)])
    return (q & 15) if j < 16 else (q >> 4)


@cuda.jit(device=True, inline=True)
def _qh_bit(row, o, j):
    """Bit j of the little-endian uint32 at byte offset o (Q5_0/Q5_1 high bits)."""
    return (np.int32(row[o + (j >> 3)]) >> (j & 7)) & 1


@cuda.jit(device=True, inline=True)
def _e8m0_half(e):
    """ggml_e8m0_to_fp32_half: 2**(e-128); e = 0, 1 are the denormals 2**-128, 2**-127."""
    if e < 2:
        return bits_to_f32(np.int32(0x00200000) << e)
    return bits_to_f32((e - 1) << 23)


@cuda.jit(device=True, inline=True)
def _mxfp4_value(nib):
    """kvalues_mxfp4[nib] (e2m1 doubled): 0 1 2 3 4 6 8 12, bit 3 the sign."""
    m = nib & 7
    mag = m if m < 4 else (2 + (m & 1)) << ((m >> 1) - 1)
    return -mag if nib & 8 else mag


@cuda.jit(device=True, inline=True)
def _scale_min_k4(row, o, j):
    """get_scale_min_k4: 6-bit scale and min of sub-block j from the 12 bytes at row[o:]."""
    if j < 4:
        sc = np.int32(row[o + j]) & 63
        m = np.int32(row[o + j + 4]) & 63
    else:
        sc = (np.int32(row[o + j + 4]) & 0xF) | ((np.int32(row[o + j - 4]) >> 6) << 4)
        m = (np.int32(row[o + j + 4]) >> 4) | ((np.int32(row[o + j]) >> 6) << 4)
    return sc, m


@cuda.jit(device=True)
def dequant_value(row, qt, v):
    """Value v of a row of ggml blocks (uint8 [RB]) of block type qt, as float32."""
    if qt == Q.Q8_0:
        o = (v >> 5) * 34
        return np.float32(_u8_as_i8(np.int32(row[o + 2 + (v & 31)]))) * f16_at(row, o)
    if qt == Q.Q4_0:
        o = (v >> 5) * 18
        return f16_at(row, o) * np.float32(_nibble(row, o + 2, v & 31) - 8)
    if qt == Q.Q4_1:
        o = (v >> 5) * 20
        return f16_at(row, o) * np.float32(_nibble(row, o + 4, v & 31)) + f16_at(row, o + 2)
    if qt == Q.Q5_0:
        o = (v >> 5) * 22
        j = v & 31
        q = _nibble(row, o + 6, j) | (_qh_bit(row, o + 2, j) << 4)
        return f16_at(row, o) * np.float32(q - 16)
    if qt == Q.Q5_1:
        o = (v >> 5) * 24
        j = v & 31
        q = _nibble(row, o + 8, j) | (_qh_bit(row, o + 4, j) << 4)
        return f16_at(row, o) * np.float32(q) + f16_at(row, o + 2)
    if qt == Q.MXFP4:
        o = (v >> 5) * 17
        return _e8m0_half(np.int32(row[o])) * np.float32(_mxfp4_value(_nibble(row, o + 1, v & 31)))
    if qt == Q.Q4_K or qt == Q.Q5_K:
        o = (v >> 8) * (144 if qt == Q.Q4_K else 176)
        w = v & 255
        c = w >> 6  # 64-value chunk: sub-blocks 2c (low nibbles) and 2c+1 (high nibbles)
        sub = 2 * c + ((w >> 5) & 1)
        l = w & 31
        sc, m = _scale_min_k4(row, o + 4, sub)
        q = np.int32(row[o + (16 if qt == Q.Q4_K else 48) + c * 32 + l])
        q = (q & 15) if sub == 2 * c else (q >> 4)
        if qt == Q.Q5_K:
            q |= ((np.int32(row[o + 16 + l]) >> sub) & 1) << 4
        return (f16_at(row, o) * np.float32(sc)) * np.float32(q) - f16_at(row, o + 2) * np.float32(m)
    # Q6_K
    o = (v >> 8) * 210
    w = v & 255
    half = w >> 7
    r = w & 127
    grp = r >> 5
    l = r & 31
    ql = np.int32(row[o + half * 64 + (grp & 1) * 32 + l])
    ql = (ql & 15) if grp < 2 else (ql >> 4)
    qh = (np.int32(row[o + 128 + half * 32 + l]) >> (2 * grp)) & 3
    s = np.float32(_u8_as_i8(np.int32(row[o + 192 + (w >> 4)])))
    return (f16_at(row, o + 208) * s) * np.float32((ql | (qh << 4)) - 32)


@cuda.jit
def _embed_blocks(raw, qt, tokens, out):
    """raw: uint8 [V, RB]; tokens: int32 [T]; out: f32 [T, D]. Grid (ceil(D/threads), T)."""
    v = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    t = cuda.blockIdx.y
    if v < out.shape[1]:
        out[t, v] = dequant_value(raw[tokens[t]], qt, v)


@cuda.jit
def _embed_float(w, tokens, out):
    """w: f32 or f16 [V, D]."""
    v = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    t = cuda.blockIdx.y
    if v < out.shape[1]:
        out[t, v] = np.float32(w[tokens[t], v])


@cuda.jit
def _embed_bf16(w, tokens, out):
    """w: bf16 bits, uint16 [V, D]."""
    v = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    t = cuda.blockIdx.y
    if v < out.shape[1]:
        out[t, v] = bits_to_f32(np.int32(w[tokens[t], v]) << 16)


def embed(raw, ggml_type: int, tokens, out, stream=0) -> None:
    """out[t] = dequantized row tokens[t] of the embedding matrix.

    raw: device uint8 [V, RB], the GGUF bytes of the matrix; tokens: device int32 [T], each in
    0..V-1 (checked by the caller); out: device f32 [T, D]."""
    T, D = out.shape
    if T == 0:
        return
    if Q.row_bytes(ggml_type, D) != raw.shape[1]:
        raise ValueError(f"{Q.type_name(ggml_type)} rows of {D} values are not {raw.shape[1]} bytes")
    grid = ((D + _THREADS - 1) // _THREADS, T)
    if ggml_type == Q.F32:
        launch(_embed_float, grid, _THREADS, stream, raw.view(np.float32), tokens, out)
    elif ggml_type == Q.F16:
        launch(_embed_float, grid, _THREADS, stream, raw.view(np.float16), tokens, out)
    elif ggml_type == Q.BF16:
        launch(_embed_bf16, grid, _THREADS, stream, raw.view(np.uint16), tokens, out)
    elif ggml_type in Q.SUPPORTED_TYPES:
        launch(_embed_blocks, grid, _THREADS, stream, raw, np.int32(ggml_type), tokens, out)
    else:
        raise UnsupportedError(f"no device embedding for {Q.type_name(ggml_type)}")
