"""ggml quant block formats: sizes, bit-exact dequantization, and the numba block helpers that
the fused matmuls in `matmul.py` reuse.

Legend: N = rows (output features), K = values per row (ggml ne[0]), B = blocks per row,
QK = values per block (32, or 256 for the K-quants), row_bytes = B * block bytes.

A weight row is a 1-D uint8 view of `row_bytes` bytes holding B consecutive ggml blocks
(ggml-common.h layouts, little-endian):

    Q4_0  [d:f16][qs:16]                  v = d * ((q & 15) - 8); q[j] low nibble -> j, high -> j+16
    Q4_1  [d:f16][m:f16][qs:16]           v = d * q + m
    Q5_0  [d:f16][qh:4][qs:16]            v = d * ((nibble | bit_j(qh) << 4) - 16)
    Q5_1  [d:f16][m:f16][qh:4][qs:16]     v = d * (nibble | bit_j(qh) << 4) + m
    Q8_0  [d:f16][qs:int8 x32]            v = qs * d
    MXFP4 [e:e8m0][qs:16]                 v = e8m0_half(e) * kvalues[nibble]
    Q4_K  [d:f16][dmin:f16][scales:12][qs:128]          8 sub-blocks of 32, 6-bit scale/min
    Q5_K  [d:f16][dmin:f16][scales:12][qh:32][qs:128]   as Q4_K plus a 5th bit
    Q6_K  [ql:128][qh:64][scales:int8 x16][d:f16]       16 sub-blocks of 16

`dequantize` reproduces `gguf.quants.dequantize` bit for bit: the same float32 operations in
the same order (e.g. Q4_K: (d*sc)*q - dmin*m, no fused multiply-add; numba does not contract
without fastmath).
"""

from __future__ import annotations

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as _GT

from daemon.errors import UnsupportedError

# ggml type ids (ints, as stored in GGUF tensor infos).
F32 = int(_GT.F32)
F16 = int(_GT.F16)
BF16 = int(_GT.BF16)
Q4_0 = int(_GT.Q4_0)
Q4_1 = int(_GT.Q4_1)
Q5_0 = int(_GT.Q5_0)
Q5_1 = int(_GT.Q5_1)
Q8_0 = int(_GT.Q8_0)
Q8_1 = int(_GT.Q8_1)
Q4_K = int(_GT.Q4_K)
Q5_K = int(_GT.Q5_K)
Q6_K = int(_GT.Q6_K)
Q8_K = int(_GT.Q8_K)
MXFP4 = int(_GT.MXFP4)

SUPPORTED_TYPES: frozenset[int] = frozenset(
    {F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K, MXFP4}
)
# Types whose rows are plain floats (no blocks).
FLOAT_TYPES: frozenset[int] = frozenset({F32, F16, BF16})
# Block types with 32 values per block ("family A" in matmul.py) and the K-quants (256).
BLOCK32_TYPES: frozenset[int] = frozenset({Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, MXFP4})
KQUANT_TYPES: frozenset[int] = frozenset({Q4_K, Q5_K, Q6_K})

QK_K = 256


def type_name(ggml_type: int) -> str:
    try:
        return _GT(ggml_type).name
    except ValueError:
        return f"ggml type {ggml_type}"


def block_size(ggml_type: int) -> tuple[int, int]:
    """(values per block, bytes per block) of a supported type."""
    try:
        return _BLOCK_SIZES[ggml_type]
    except (KeyError, TypeError):
        raise UnsupportedError(f"unsupported quant type {type_name(ggml_type)}") from None


_BLOCK_SIZES = {int(t): GGML_QUANT_SIZES[_GT(t)] for t in SUPPORTED_TYPES}  # hot path: no enum lookups


def row_bytes(ggml_type: int, k: int) -> int:
    """Bytes of one row of k values; UnsupportedError for a type we lack or a ragged k."""
    qk, nbytes = block_size(ggml_type)
    if k <= 0 or k % qk != 0:
        raise UnsupportedError(
            f"{type_name(ggml_type)} rows need a positive multiple of {qk} values, got {k}"
        )
    return (k // qk) * nbytes


def values_per_row(ggml_type: int, nbytes: int) -> int:
    """K for a row of nbytes bytes (inverse of row_bytes)."""
    qk, bb = block_size(ggml_type)
    if nbytes <= 0 or nbytes % bb != 0:
        raise UnsupportedError(
            f"{type_name(ggml_type)} rows need a positive multiple of {bb} bytes, got {nbytes}"
        )
    return (nbytes // bb) * qk


# --------------------------------------------------------------------------------------------
# scalar helpers (numba)

# ggml_e8m0_to_fp32_half: 0.5 * 2**(e-127), with e < 2 as the denormals 2**-128, 2**-127.
_E8M0_HALF = np.where(
    np.arange(256) < 2,
    np.uint32(0x00200000) << np.arange(256, dtype=np.uint32).clip(0, 1),
    (np.arange(256, dtype=np.uint32).clip(1, 255) - np.uint32(1)) << np.uint32(23),
).astype(np.uint32).view(np.float32)

# kvalues_mxfp4: e2m1 values doubled.
_KV_MXFP4 = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], dtype=np.int8)

_TWO112 = np.float32(2.0**112)


@intrinsic
def u32_as_f32(typingctx, u):
    """Reinterpret the low 32 bits of an integer as float32."""
    if not isinstance(u, types.Integer):
        return None

    def codegen(context, builder, sig, args):
        v = args[0]
        if u.bitwidth > 32:
            v = builder.trunc(v, ir.IntType(32))
        elif u.bitwidth < 32:
            v = builder.zext(v, ir.IntType(32))
        return builder.bitcast(v, ir.FloatType())

    return types.float32(u), codegen


@intrinsic
def f32_as_u32(typingctx, f):
    """Reinterpret a float32 as uint32."""
    if f != types.float32:
        return None

    def codegen(context, builder, sig, args):
        return builder.bitcast(args[0], ir.IntType(32))

    return types.uint32(f), codegen


@numba.njit(cache=True, inline="always")
def f16_to_f32(h):
    """IEEE half bits -> float32, exact (GGML_FP16_TO_FP32), branch-free: exponent and mantissa
    are placed in a float32 and scaled by 2**112 (exact, subnormals included); then sign, and
    the all-ones exponent for inf/nan."""
    h = np.uint32(h)
    v = u32_as_f32((h & np.uint32(0x7FFF)) << np.uint32(13)) * _TWO112
    u = f32_as_u32(v) | ((h & np.uint32(0x8000)) << np.uint32(16))
    if (h & np.uint32(0x7C00)) == np.uint32(0x7C00):
        u = u | np.uint32(0x7F800000)
    return u32_as_f32(u)


@numba.njit(cache=True, inline="always")
def rd_f16(row, o):
    """fp16 at byte offset o of a uint8 row, as float32."""
    return f16_to_f32(np.uint32(row[o]) | (np.uint32(row[o + 1]) << np.uint32(8)))


@numba.njit(cache=True)
def f32_to_f16_bits(x):
    """float32 -> fp16 bits, round to nearest even (GGML_FP32_TO_FP16 with F16C, and numpy)."""
    b = np.int64(f32_as_u32(np.float32(x)))
    sign = (b >> 16) & 0x8000
    e = (b >> 23) & 0xFF
    m = b & 0x7FFFFF
    if e == 255:
        return sign | 0x7C00 | (0x200 if m != 0 else 0)
    E = e - 127
    if E > 15:
        return sign | 0x7C00
    if E >= -14:
        hm = m >> 13
        rem = m & 0x1FFF
        h = ((E + 15) << 10) | hm
        if rem > 0x1000 or (rem == 0x1000 and (hm & 1) != 0):
            h += 1  # a carry into the exponent is right, up to inf
        return sign | h
    if E < -25:
        return sign
    M = m | 0x800000
    shift = -E - 1
    hm = M >> shift
    rem = M & ((np.int64(1) << shift) - 1)
    half = np.int64(1) << (shift - 1)
    if rem > half or (rem == half and (hm & 1) != 0):
        hm += 1
    return sign | hm


@numba.njit(cache=True)
def round_f16(x):
    """x rounded to fp16 (nearest even) and back, as float32."""
    return f16_to_f32(f32_to_f16_bits(x))


@numba.njit(cache=True, inline="always")
def _scale_min_k4(sc, o, j):
    """get_scale_min_k4: 6-bit scale and min of sub-block j from the 12 bytes at sc[o:]."""
    if j < 4:
        d = np.int32(sc[o + j]) & 63
        m = np.int32(sc[o + j + 4]) & 63
    else:
        d = (np.int32(sc[o + j + 4]) & 0xF) | ((np.int32(sc[o + j - 4]) >> 6) << 4)
        m = (np.int32(sc[o + j + 4]) >> 4) | ((np.int32(sc[o + j]) >> 6) << 4)
    return d, m


# --------------------------------------------------------------------------------------------
# per-row dequantization (float32, bit-exact with gguf.quants)


@numba.njit(cache=True)
def dequant_row(row, qt, K, out):
    """Dequantize one row (uint8 [row_bytes]) of a block type into out (float32 [K])."""
    if qt == 8:  # Q8_0
        for b in range(K // 32):
            o = b * 34
            d = rd_f16(row, o)
            for j in range(32):
                out[b * 32 + j] = np.float32(np.int8(row[o + 2 + j])) * d
    elif qt == 2:  # Q4_0
        for b in range(K // 32):
            o = b * 18
            d = rd_f16(row, o)
            for j in range(16):
                q = np.int32(row[o + 2 + j])
                out[b * 32 + j] = d * np.float32((q & 15) - 8)
                out[b * 32 + 16 + j] = d * np.float32((q >> 4) - 8)
    elif qt == 3:  # Q4_1
        for b in range(K // 32):
            o = b * 20
            d = rd_f16(row, o)
            m = rd_f16(row, o + 2)
            for j in range(16):
                q = np.int32(row[o + 4 + j])
                out[b * 32 + j] = d * np.float32(q & 15) + m
                out[b * 32 + 16 + j] = d * np.float32(q >> 4) + m
    elif qt == 6:  # Q5_0
        for b in range(K // 32):
            o = b * 22
            d = rd_f16(row, o)
            qh = (np.int64(row[o + 2]) | (np.int64(row[o + 3]) << 8)
                  | (np.int64(row[o + 4]) << 16) | (np.int64(row[o + 5]) << 24))
            for j in range(16):
                q = np.int64(row[o + 6 + j])
                lo = (q & 15) | (((qh >> j) & 1) << 4)
                hi = (q >> 4) | (((qh >> (j + 16)) & 1) << 4)
                out[b * 32 + j] = d * np.float32(lo - 16)
                out[b * 32 + 16 + j] = d * np.float32(hi - 16)
    elif qt == 7:  # Q5_1
        for b in range(K // 32):
            o = b * 24
            d = rd_f16(row, o)
            m = rd_f16(row, o + 2)
            qh = (np.int64(row[o + 4]) | (np.int64(row[o + 5]) << 8)
                  | (np.int64(row[o + 6]) << 16) | (np.int64(row[o + 7]) << 24))
            for j in range(16):
                q = np.int64(row[o + 8 + j])
                lo = (q & 15) | (((qh >> j) & 1) << 4)
                hi = (q >> 4) | (((qh >> (j + 16)) & 1) << 4)
                out[b * 32 + j] = d * np.float32(lo) + m
                out[b * 32 + 16 + j] = d * np.float32(hi) + m
    elif qt == 39:  # MXFP4
        for b in range(K // 32):
            o = b * 17
            d = _E8M0_HALF[row[o]]
            for j in range(16):
                q = np.int32(row[o + 1 + j])
                out[b * 32 + j] = d * np.float32(_KV_MXFP4[q & 15])
                out[b * 32 + 16 + j] = d * np.float32(_KV_MXFP4[q >> 4])
    elif qt == 12 or qt == 13:  # Q4_K, Q5_K
        bb = 144 if qt == 12 else 176
        qso = 16 if qt == 12 else 48
        for b in range(K // 256):
            o = b * bb
            d = rd_f16(row, o)
            dmin = rd_f16(row, o + 2)
            for c in range(4):  # 64-value chunks: sub-blocks 2c (low nibbles), 2c+1 (high)
                sc0, m0 = _scale_min_k4(row, o + 4, 2 * c)
                sc1, m1 = _scale_min_k4(row, o + 4, 2 * c + 1)
                d0 = d * np.float32(sc0)
                dm0 = dmin * np.float32(m0)
                d1 = d * np.float32(sc1)
                dm1 = dmin * np.float32(m1)
                base = b * 256 + c * 64
                for l in range(32):
                    q = np.int32(row[o + qso + c * 32 + l])
                    lo = q & 15
                    hi = q >> 4
                    if qt == 13:
                        h = np.int32(row[o + 16 + l])
                        lo |= ((h >> (2 * c)) & 1) << 4
                        hi |= ((h >> (2 * c + 1)) & 1) << 4
                    out[base + l] = d0 * np.float32(lo) - dm0
                    out[base + 32 + l] = d1 * np.float32(hi) - dm1
    elif qt == 14:  # Q6_K
        for b in range(K // 256):
            o = b * 210
            d = rd_f16(row, o + 208)
            for v in range(256):
                half = v >> 7  # which 128-value half
                r = v & 127
                grp = r >> 5  # 0..3 within the half
                l = r & 31
                ql = np.int32(row[o + half * 64 + (grp & 1) * 32 + l])
                ql = (ql & 15) if grp < 2 else (ql >> 4)
                qh = (np.int32(row[o + 128 + half * 32 + l]) >> (2 * grp)) & 3
                q = (ql | (qh << 4)) - 32
                s = np.float32(np.int8(row[o + 192 + (v >> 4)]))
                out[b * 256 + v] = (d * s) * np.float32(q)


@numba.njit(cache=True, parallel=True)
def _dequant_rows(raw, qt, K, out):
    for r in numba.prange(raw.shape[0]):
        dequant_row(raw[r], qt, K, out[r])


def _readonly(a: np.ndarray) -> np.ndarray:
    """A read-only view, so numba compiles one specialization for mmapped and in-memory data."""
    if a.flags.writeable:
        a = a.view()
        a.flags.writeable = False
    return a


def dequantize(raw: np.ndarray, ggml_type: int, n_values: int | None = None) -> np.ndarray:
    """Dequantize rows of ggml blocks to float32.

    raw: uint8 [..., row_bytes] (any leading dims, e.g. [N, rb] or [E, N, rb], or one row [rb]).
    n_values: optional K (values per row); when given it must agree with raw.shape[-1].
    Returns float32 [..., K], a new array, equal bit for bit to gguf.quants.dequantize.
    """
    raw = np.asarray(raw)
    if raw.dtype != np.uint8:
        raise TypeError(f"raw must be uint8, got {raw.dtype}")
    if raw.ndim == 0:
        raise ValueError("raw must have at least one dimension")
    K = values_per_row(ggml_type, raw.shape[-1])
    if n_values is not None and n_values != K:
        raise ValueError(
            f"{type_name(ggml_type)}: {raw.shape[-1]} bytes per row hold {K} values, not {n_values}"
        )
    lead = raw.shape[:-1]
    if ggml_type == F32:
        return np.ascontiguousarray(raw).view(np.float32).astype(np.float32)
    if ggml_type == F16:
        return np.ascontiguousarray(raw).view(np.float16).astype(np.float32)
    if ggml_type == BF16:
        u = np.ascontiguousarray(raw).view(np.uint16).astype(np.uint32) << np.uint32(16)
        return u.view(np.float32)
    rows = np.ascontiguousarray(raw.reshape(-1, raw.shape[-1]))
    out = np.empty((rows.shape[0], K), dtype=np.float32)
    if rows.shape[0]:
        _dequant_rows(_readonly(rows), int(ggml_type), K, out)
    return out.reshape(lead + (K,))
