"""Activations converted for the dot products: llama.cpp's CPU backend converts x to the weight type's
vec_dot_type (matmul_types.py) before any dot product; matmul.py's docstring has the conversions
(fp16/bf16 rounding, the x86 Q8_0/Q8_1 quantizers, Q8_K). A Prepared serves every weight of its
vec_dot_type, e.g. the gate and up projections of all experts of a layer. With "float32"
numerics nothing is converted.

Legend: T = activation rows, K = input features, B = 32-value blocks per row (K/32),
S = 256-value super-blocks per row (K/256).
"""

from __future__ import annotations

from dataclasses import dataclass

import numba
import numpy as np
from numba import prange

from daemon.errors import UnsupportedError
from daemon.kernels import quants as Q
from daemon.kernels.matmul_types import VEC_DOT_TYPE
from daemon.kernels.quants import f32_as_u32, round_f16, u32_as_f32

NUMERICS = ("ggml", "float32")

# ---- quantizers (numba)


@numba.njit(cache=True, inline="always")
def quantize_row_q8_0_1(x, qs, d, s):
    """One row: x f32 [K] -> qs int8 [K], d f32 [B] (fp16-rounded), s f32 [B] (Q8_1 sums)."""
    for b in range(x.shape[0] // 32):
        o = b * 32
        amax = np.float32(0.0)
        for j in range(32):
            a = abs(x[o + j])
            if a > amax:
                amax = a
        dd = amax / np.float32(127.0)
        idd = np.float32(127.0) / amax if amax != 0 else np.float32(0.0)
        isum = 0
        for j in range(32):
            q = np.int32(np.rint(x[o + j] * idd))
            qs[o + j] = q
            isum += q
        d[b] = round_f16(dd)
        s[b] = round_f16(dd * np.float32(isum))


@numba.njit(cache=True, inline="always")
def round_bf16(x):
    """One float32 as GGML_FP32_TO_BF16 then back (the scalar _round_bf16): nearest even, a NaN
    kept quiet."""
    u = f32_as_u32(x)
    if (u & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000):
        r = (u >> np.uint32(16)) | np.uint32(64)
    else:
        r = (u + (np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1)))) >> np.uint32(16)
    return u32_as_f32(np.uint32(r) << np.uint32(16))


@numba.njit(cache=True, inline="always")
def quantize_row_q8_K(x, qs, d, bsums):
    """One row: x f32 [K] -> qs int8 [K], d f32 [S], bsums int32 [K/16]."""
    for sb in range(x.shape[0] // 256):
        o = sb * 256
        amax = np.float32(0.0)
        mx = np.float32(0.0)
        for j in range(256):
            v = x[o + j]
            if abs(v) > amax:
                amax = abs(v)
                mx = v
        if amax == 0:
            d[sb] = 0
            for j in range(256):
                qs[o + j] = 0
            for g in range(16):
                bsums[sb * 16 + g] = 0
            continue
        iscale = np.float32(-127.0) / mx
        for g in range(16):
            acc = 0
            for j in range(16):
                q = np.int32(np.rint(iscale * x[o + g * 16 + j]))
                if q > 127:
                    q = 127
                qs[o + g * 16 + j] = q
                acc += q
            bsums[sb * 16 + g] = acc
        d[sb] = np.float32(1.0) / iscale


@numba.njit(cache=True, parallel=True)
def _quantize_q8_0_1_parallel(x, qs, d, s):
    """x f32 [T, K] -> qs int8 [T, K], d f32 [T, B] (fp16-rounded), s f32 [T, B] (Q8_1 sums)."""
    for t in prange(x.shape[0]):
        quantize_row_q8_0_1(x[t], qs[t], d[t], s[t])


@numba.njit(cache=True)
def _quantize_q8_0_1_serial(x, qs, d, s):
    for t in range(x.shape[0]):
        quantize_row_q8_0_1(x[t], qs[t], d[t], s[t])


@numba.njit(cache=True, parallel=True)
def _quantize_q8_K_parallel(x, qs, d, bsums):
    """x f32 [T, K] -> qs int8 [T, K], d f32 [T, S], bsums int32 [T, K/16]."""
    for t in prange(x.shape[0]):
        quantize_row_q8_K(x[t], qs[t], d[t], bsums[t])


@numba.njit(cache=True)
def _quantize_q8_K_serial(x, qs, d, bsums):
    for t in range(x.shape[0]):
        quantize_row_q8_K(x[t], qs[t], d[t], bsums[t])


PARALLEL_FROM = 1 << 14  # values: below, waking the threads costs more than quantizing (a decode row)


def _quantize_q8_0_1(x, qs, d, s) -> None:
    (_quantize_q8_0_1_parallel if x.size >= PARALLEL_FROM else _quantize_q8_0_1_serial)(x, qs, d, s)


def _quantize_q8_K(x, qs, d, bsums) -> None:
    (_quantize_q8_K_parallel if x.size >= PARALLEL_FROM else _quantize_q8_K_serial)(x, qs, d, bsums)


def _round_f16(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16).astype(np.float32)


def _round_bf16(x: np.ndarray) -> np.ndarray:
    """GGML_FP32_TO_BF16 then back to float32."""
    n = x.view(np.uint32)
    nan = (n & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000)
    r = (n.astype(np.uint64) + (np.uint64(0x7FFF) + ((n >> np.uint32(16)) & np.uint32(1)))) >> np.uint64(16)
    r = np.where(nan, (n >> np.uint32(16)) | np.uint32(64), r).astype(np.uint32)
    return (r << np.uint32(16)).view(np.float32)


# ---- the prepared activations


@dataclass(frozen=True)
class Prepared:
    """Activations converted once for every weight of one vec_dot_type.

    numerics: "ggml" or "float32"; vec_dot_type: ggml type id the activations were converted to
    (for "float32" numerics: F32, x untouched). x: float32 [T, K] (for F16/BF16, the rounded
    values; None when quantized). For Q8_0/Q8_1: qs int8 [T, K], d f32 [T, B], s f32 [T, B]
    (Q8_1 only). For Q8_K: qs int8 [T, K], d f32 [T, S], bsums int32 [T, K/16].
    """

    numerics: str
    vec_dot_type: int
    x: np.ndarray | None
    qs: np.ndarray | None = None
    d: np.ndarray | None = None
    s: np.ndarray | None = None
    bsums: np.ndarray | None = None

    @property
    def T(self) -> int:
        return (self.x if self.qs is None else self.qs).shape[0]

    def rows(self, idx: np.ndarray) -> Prepared:
        """These activations gathered by row: row i of the result is row idx[i] (conversion is
        per row, so this equals preparing x[idx])."""
        return Prepared(self.numerics, self.vec_dot_type,
                        *(None if a is None else a[idx] for a in (self.x, self.qs, self.d, self.s, self.bsums)))

    @property
    def K(self) -> int:
        return (self.x if self.qs is None else self.qs).shape[1]


def _check_x(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x)
    if x.ndim != 2:
        raise ValueError(f"x must be 2-D [T, K], got shape {x.shape}")
    if x.dtype != np.float32:
        raise TypeError(f"x must be float32, got {x.dtype}")
    return np.ascontiguousarray(x)


def prepare(x: np.ndarray, ggml_type: int, numerics: str = "ggml") -> Prepared:
    """Convert activations x [T, K] for weights of ggml_type (and any type sharing its
    vec_dot_type), e.g. once for the gate and up projections of all experts of a layer."""
    if numerics not in NUMERICS:
        raise ValueError(f"numerics must be one of {NUMERICS}, got {numerics!r}")
    if ggml_type not in Q.SUPPORTED_TYPES:
        raise UnsupportedError(f"unsupported quant type {Q.type_name(ggml_type)}")
    x = _check_x(x)
    T, K = x.shape
    Q.row_bytes(ggml_type, K)  # K must be whole blocks
    if numerics == "float32":
        return Prepared("float32", Q.F32, x)
    vt = VEC_DOT_TYPE[ggml_type]
    if vt == Q.F32:
        return Prepared("ggml", vt, x)
    if vt == Q.F16:
        return Prepared("ggml", vt, _round_f16(x))
    if vt == Q.BF16:
        return Prepared("ggml", vt, _round_bf16(x))
    qs = np.empty((T, K), np.int8)
    if vt == Q.Q8_K:
        d = np.empty((T, K // 256), np.float32)
        bsums = np.empty((T, K // 16), np.int32)
        if T:
            _quantize_q8_K(x, qs, d, bsums)
        return Prepared("ggml", vt, None, qs=qs, d=d, bsums=bsums)
    d = np.empty((T, K // 32), np.float32)
    s = np.empty((T, K // 32), np.float32)
    if T:
        _quantize_q8_0_1(x, qs, d, s)
    if vt == Q.Q8_1:
        return Prepared("ggml", vt, None, qs=qs, d=d, s=s)
    return Prepared("ggml", vt, None, qs=qs, d=d)
