"""Weight layout on the GPU: ggml rows repacked at upload into aligned planes.

ggml blocks interleave scales and quants (Q8_0 = [d:2][qs:32], 34 bytes), so a block's quants are
only 2-byte aligned (1-byte for MXFP4's 17 bytes, 2 for Q6_K's 210) and a GEMV could not read them
with 128-bit loads. llama.cpp reads such rows with 16- or 8-bit loads; we instead repack each row
once, when it is uploaded, into "planes": the same field of all B blocks of the row stored
together, quants first. Every quant chunk of 16 bytes is then 16-byte aligned (one
ld.global.nc.v4.u32) and the scales are naturally aligned. The bytes are the same, only moved,
plus zero padding of the row to a multiple of 16 (none when K is a multiple of 256), so VRAM use
does not grow. Why not read as llama.cpp does: the 128-bit loads were measured at 2.91 TB/s
against 2.38 TB/s with 32-bit loads (DESIGN.md), and the repack costs one pass over the bytes at
upload, on the host (`repack`) or on the device after a raw copy (`repack_device`).

Legend: N = rows, K = values per row, B = blocks per row (K / 32, or K / 256 for K-quants),
stride = repacked bytes per row (raw row bytes rounded up to 16).

Planes of one repacked row, in order (byte offset of each plane = B * bytes of the planes before):

    Q8_0   qs[B*32]  d[B*2]
    Q4_0   qs[B*16]  d[B*2]
    Q4_1   qs[B*16]  dm[B*4]                       (d, m as two f16)
    Q5_0   qs[B*16]  qh[B*4]  d[B*2]
    Q5_1   qs[B*16]  qh[B*4]  dm[B*4]
    MXFP4  qs[B*16]  e[B]
    Q4_K   qs[B*128] scales[B*12] dm[B*4]          (d, dmin)
    Q5_K   qs[B*128] qh[B*32] scales[B*12] dm[B*4]
    Q6_K   ql[B*128] qh[B*64] scales[B*16] d[B*2]
    F32 / F16 / BF16: the raw row (values are already aligned), padded to 16 bytes.

Each field keeps its ggml byte order (e.g. Q4_0 qs[j]: low nibble = value j, high = value j+16).
"""

from __future__ import annotations

import numpy as np
from numba import cuda

from ...errors import UnsupportedError
from ..quants import (BF16, F16, F32, MXFP4, Q4_0, Q4_1, Q4_K, Q5_0, Q5_1, Q5_K, Q6_K, Q8_0,
                      block_size, type_name)
from .device import upload
from .launch import launch

# ggml block fields in plane order: (offset in the block, bytes).
FIELDS: dict[int, tuple[tuple[int, int], ...]] = {
    Q8_0: ((2, 32), (0, 2)),
    Q4_0: ((2, 16), (0, 2)),
    Q4_1: ((4, 16), (0, 4)),
    Q5_0: ((6, 16), (2, 4), (0, 2)),
    Q5_1: ((8, 16), (4, 4), (0, 4)),
    MXFP4: ((1, 16), (0, 1)),
    Q4_K: ((16, 128), (4, 12), (0, 4)),
    Q5_K: ((48, 128), (16, 32), (4, 12), (0, 4)),
    Q6_K: ((0, 128), (128, 64), (192, 16), (208, 2)),
}
QUANT_TYPES = frozenset(FIELDS)
FLOAT_TYPES = frozenset({F32, F16, BF16})
GPU_TYPES = QUANT_TYPES | FLOAT_TYPES


def _check(ggml_type: int) -> None:
    if ggml_type not in GPU_TYPES:
        raise UnsupportedError(f"no GPU layout for {type_name(ggml_type)}")


def repacked_stride(ggml_type: int, k: int) -> int:
    """Bytes of one repacked row of k values (the raw row bytes rounded up to 16)."""
    _check(ggml_type)
    qk, bb = block_size(ggml_type)
    if k <= 0 or k % qk:
        raise UnsupportedError(f"{type_name(ggml_type)} rows need a positive multiple of {qk} "
                               f"values, got {k}")
    if ggml_type in FLOAT_TYPES and (k * bb) % 16:
        raise UnsupportedError(f"{type_name(ggml_type)} rows on the GPU need 16-byte rows "
                               f"(K a multiple of {16 // bb}), got K={k}")
    return -(-(k // qk) * bb // 16) * 16


def plane_offsets(ggml_type: int, k: int) -> tuple[int, ...]:
    """Byte offset of each plane within a repacked row (FIELDS order)."""
    qk, _ = block_size(ggml_type)
    nb = k // qk
    offs, at = [], 0
    for _, size in FIELDS[ggml_type]:
        offs.append(at)
        at += nb * size
    return tuple(offs)


def repack(raw: np.ndarray, ggml_type: int) -> np.ndarray:
    """Raw ggml rows -> repacked rows (host, numpy).

    raw: uint8 [..., row_bytes] (e.g. [N, rb] or an expert stack [S, N, rb]).
    Returns uint8 [..., stride], C-contiguous, a new array."""
    raw = np.asarray(raw)
    if raw.dtype != np.uint8 or raw.ndim == 0:
        raise TypeError("raw must be a uint8 array of rows")
    qk, bb = block_size(ggml_type)
    rb = raw.shape[-1]
    if rb % bb:
        raise UnsupportedError(f"{type_name(ggml_type)} rows need a multiple of {bb} bytes, "
                               f"got {rb}")
    k = rb // bb * qk
    stride = repacked_stride(ggml_type, k)
    lead = raw.shape[:-1]
    rows = raw.reshape(-1, rb)
    out = np.zeros((rows.shape[0], stride), dtype=np.uint8)
    if ggml_type in FLOAT_TYPES:
        out[:, :rb] = rows
    else:
        blocks = rows.reshape(rows.shape[0], rb // bb, bb)  # [R, B, bb]
        at = 0
        for off, size in FIELDS[ggml_type]:
            n = blocks.shape[1] * size
            out[:, at:at + n] = blocks[:, :, off:off + size].reshape(rows.shape[0], n)
            at += n
    return out.reshape(lead + (stride,))


def unpack(packed: np.ndarray, ggml_type: int, k: int) -> np.ndarray:
    """Repacked rows -> raw ggml rows (the inverse of `repack`, for tests and downloads)."""
    packed = np.asarray(packed)
    qk, bb = block_size(ggml_type)
    nb = k // qk
    lead = packed.shape[:-1]
    rows = packed.reshape(-1, packed.shape[-1])
    if ggml_type in FLOAT_TYPES:
        return np.ascontiguousarray(rows[:, :nb * bb]).reshape(lead + (nb * bb,))
    blocks = np.empty((rows.shape[0], nb, bb), dtype=np.uint8)
    at = 0
    for off, size in FIELDS[ggml_type]:
        blocks[:, :, off:off + size] = rows[:, at:at + nb * size].reshape(-1, nb, size)
        at += nb * size
    return blocks.reshape(lead + (nb * bb,))


def _byte_map(ggml_type: int, nb: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """For each byte p of a raw block: (plane start / nb, field size, index in the field), so
    that its repacked offset is plane[p] * nb + b * size[p] + j[p] (int32 [bb] each)."""
    _, bb = block_size(ggml_type)
    plane = np.zeros(bb, np.int32)
    size = np.zeros(bb, np.int32)
    j = np.zeros(bb, np.int32)
    at = 0
    for off, n in FIELDS[ggml_type]:
        plane[off:off + n] = at
        size[off:off + n] = n
        j[off:off + n] = np.arange(n)
        at += n
    return plane, size, j


@cuda.jit(cache=True)  # no closure, no intrinsics: numba's disk cache serves it to the next process
def _repack_kernel(src, dst, plane, size, j, nb, bb):
    # src: uint8 [R, rb] raw rows; dst: uint8 [R, stride]; one thread per raw byte.
    i = cuda.grid(1)
    rb = nb * bb
    if i < src.shape[0] * rb:
        r = i // rb
        p = i - r * rb
        b = p // bb
        q = p - b * bb
        dst[r, plane[q] * nb + b * size[q] + j[q]] = src[r, p]


def repack_device(raw, out, ggml_type: int, stream=0) -> None:
    """Repack rows already on the device: raw uint8 [R, rb] -> out uint8 [R, stride].

    For experts streamed to the GPU as raw bytes. `out` must be zeroed where it pads rows
    (stride > rb), e.g. allocated with cuda.device_array and memset once."""
    qk, bb = block_size(ggml_type)
    rows, rb = raw.shape
    if out.shape != (rows, repacked_stride(ggml_type, rb // bb * qk)):
        raise ValueError(f"out must be [{rows}, stride], got {out.shape}")
    if ggml_type in FLOAT_TYPES:  # already aligned (repacked_stride checked rb % 16 == 0)
        out.copy_to_device(raw, stream=stream)
        return
    n = rows * rb
    if n:
        launch(_repack_kernel, (n + 255) // 256, 256, stream, raw, out, *_maps(ggml_type, rb // bb), rb // bb, bb)


_MAPS: dict[tuple[int, int], tuple] = {}  # (type, blocks per row) -> _byte_map on the device


def _maps(ggml_type: int, nb: int) -> tuple:
    """_byte_map on the device, made once per (type, blocks per row)."""
    key = (ggml_type, nb)
    maps = _MAPS.get(key)
    if maps is None:
        maps = _MAPS[key] = tuple(upload(a) for a in _byte_map(ggml_type, nb))
    return maps


@cuda.jit
def _repack_slots_kernel(src, dst, slots, plane, size, j, nb, bb):
    # src: uint8 [n, R, rb] raw rows of n experts; dst: uint8 [S, R, stride]; slots: int32 [n],
    # expert i's slot in dst. One thread per raw byte.
    i = cuda.grid(1)
    rows = src.shape[1]
    rb = nb * bb
    if i < src.shape[0] * rows * rb:
        r = i // rb
        p = i - r * rb
        e = r // rows
        r -= e * rows
        b = p // bb
        q = p - b * bb
        dst[slots[e], r, plane[q] * nb + b * size[q] + j[q]] = src[e, r, p]


@cuda.jit
def _copy_slots_kernel(src, dst, slots):
    # float rows: src uint8 [n, R, rb] -> dst[slots[e], r, :rb] (already aligned). One thread a byte.
    i = cuda.grid(1)
    rows, rb = src.shape[1], src.shape[2]
    if i < src.shape[0] * rows * rb:
        r = i // rb
        p = i - r * rb
        e = r // rows
        dst[slots[e], r - e * rows, p] = src[e, r - e * rows, p]


def repack_into_slots(raw, stack, slots, ggml_type: int, stream=0) -> None:
    """Repack n experts' raw rows already on the device into their slots of a stack, in one launch:
    raw uint8 [n, R, rb] -> stack[slots[i]] uint8 [R, stride] (slots: device int32 [n]). The
    stack's padding bytes (stride > rb) are left as they are (zeroed when it was made)."""
    qk, bb = block_size(ggml_type)
    n, rows, rb = raw.shape
    if stack.shape[1:] != (rows, repacked_stride(ggml_type, rb // bb * qk)):
        raise ValueError(f"stack must be [S, {rows}, stride], got {stack.shape}")
    total = n * rows * rb
    if not total:
        return
    if ggml_type in FLOAT_TYPES:
        launch(_copy_slots_kernel, (total + 255) // 256, 256, stream, raw, stack, slots)
        return
    launch(_repack_slots_kernel, (total + 255) // 256, 256, stream, raw, stack, slots, *_maps(ggml_type, rb // bb),
           rb // bb, bb)
