"""The CUDA backend's weights and its few kernels of its own: weights in VRAM, repacked once at
upload (daemon/kernels/cuda/layout.py), the embedding rows read back out of the repacked table,
and a row gather.

One copy of each matrix lives on the device, in the matmuls' repacked layout. The embedding
kernel (kernels/cuda/embed.py) reads raw GGUF rows, so `embedding_rows` first gathers the T rows a
step needs out of the repacked table, undoing the repack byte for byte (a repack only moves
bytes): a tied output (output = token_embd) then needs no second copy of the table.

Legend: V = rows of the table (vocabulary), N = output rows, K = values per row, RB = raw ggml row
bytes, stride = repacked row bytes, T = tokens (rows gathered), E = experts, S = stack slots.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from numba import cuda

from ..kernels.cuda.device import upload
from ..kernels.cuda.launch import launch
from ..kernels.cuda.layout import FIELDS, FLOAT_TYPES, GPU_TYPES, repack, repack_device
from ..kernels.quants import block_size, row_bytes
from . import cuda_upload
from .cuda_upload import device_matrix

_THREADS = 256


@dataclass(frozen=True, eq=False)
class DeviceWeight:
    """A matrix in VRAM: packed uint8 [N, stride], the repacked rows of a QWeight. A member of an
    upload group is rows row0.. of the group's one matrix (its packed is a view)."""
    packed: object  # device uint8 [N, stride]
    ggml_type: int
    n_in: int  # K
    n_out: int  # N
    group: WeightGroup | None = None
    row0: int = 0

    @property
    def nbytes(self) -> int:
        return int(self.packed.nbytes)


@dataclass(eq=False)
class WeightGroup:
    """Matrices stored as one (an upload group): `whole` holds the rows of `members` in order."""
    whole: DeviceWeight
    members: list = field(default_factory=list)


def upload_matrix(raw: np.ndarray, ggml_type: int, stream=None) -> object:
    """Raw ggml rows uint8 [..., RB] -> device uint8 [..., stride], repacked on the device (the
    bytes layout.repack makes on the host). stream None: the default stream, synchronized
    before returning (the caller's other streams may read the result at once)."""
    raw = np.ascontiguousarray(raw)
    if raw.dtype != np.uint8 or raw.ndim == 0:
        raise TypeError("raw must be a uint8 array of rows")
    rb = raw.shape[-1]
    if (not cuda_upload.REPACK_ON_DEVICE or ggml_type not in GPU_TYPES or rb % block_size(ggml_type)[1]
            or raw.size == 0):  # the simulator (slow threads), repack's clear error, an empty matrix
        return upload(repack(raw, ggml_type), stream)
    rows = raw.reshape(-1, rb)  # [R, RB]
    s = 0 if stream is None else stream  # 0: the legacy default stream (numba's dispatcher launches there)
    out = device_matrix(rows.shape[0], rb, ggml_type, s)
    repack_device(cuda.to_device(rows, stream=s), out, ggml_type, s)
    if stream is None:
        cuda.default_stream().synchronize()
    return out.reshape(raw.shape[:-1] + (out.shape[1],))


def byte_map(ggml_type: int) -> np.ndarray:
    """int32 [3, bb]: for each byte q of a raw block, (plane start in blocks, field size, index
    in the field), so that byte q of block b sits at plane*nb + b*size + index of the repacked
    row (layout.py's plane order). Float types: one plane of the row's own bytes."""
    _, bb = block_size(ggml_type)
    out = np.zeros((3, bb), np.int32)
    if ggml_type in FLOAT_TYPES:
        out[1] = bb
        out[2] = np.arange(bb)
        return out
    at = 0
    for off, n in FIELDS[ggml_type]:
        out[0, off:off + n] = at
        out[1, off:off + n] = n
        out[2, off:off + n] = np.arange(n)
        at += n
    return out


@cuda.jit
def _gather_unpacked(packed, tokens, bmap, nb, bb, raw):
    """raw[t] = the raw ggml row tokens[t] of the repacked table. packed: uint8 [V, stride];
    tokens: int32 [T]; bmap: int32 [3, bb] (byte_map); raw: uint8 [T, RB]. One thread per byte."""
    i = cuda.grid(1)
    rb = raw.shape[1]
    if i < raw.shape[0] * rb:
        t = i // rb
        p = i - t * rb
        b = p // bb
        q = p - b * bb
        raw[t, p] = packed[tokens[t], bmap[0, q] * nb + b * bmap[1, q] + bmap[2, q]]


def embedding_rows(table: DeviceWeight, tokens, bmap, stream=0) -> object:
    """The raw rows of `tokens` (device int32 [T]) of a repacked table -> device uint8 [T, RB]."""
    qk, bb = block_size(table.ggml_type)
    rb = row_bytes(table.ggml_type, table.n_in)
    T = tokens.shape[0]
    raw = cuda.device_array((T, rb), np.uint8)
    n = T * rb
    if n:
        launch(_gather_unpacked, (n + _THREADS - 1) // _THREADS, _THREADS, stream, table.packed, tokens, bmap, rb // bb, bb, raw)
    return raw


@cuda.jit
def _take_rows(x, rows, out):
    """out[r] = x[rows[r]]. x: f32 [T, N]; rows: int32 [R]; out: f32 [R, N]."""
    i = cuda.grid(1)
    R, N = out.shape
    if i < R * N:
        r = i // N
        out[r, i - r * N] = x[rows[r], i - r * N]


def take_rows(x, rows, stream=0) -> object:
    """x [T, N] (device f32) -> x[rows] [R, N]; rows: device int32 [R]."""
    R, N = rows.shape[0], x.shape[1]
    out = cuda.device_array((R, N), np.float32)
    if R * N:
        launch(_take_rows, (R * N + _THREADS - 1) // _THREADS, _THREADS, stream, x, rows, out)
    return out


@cuda.jit
def _put_rows(src, rows, out):
    """out[rows[r]] = src[rows[r]]. src, out: f32 [T, N]; rows: int32 [R]."""
    i = cuda.grid(1)
    R, N = rows.shape[0], out.shape[1]
    if i < R * N:
        r = rows[i // N]
        out[r, i % N] = src[r, i % N]


def put_rows(src, rows, out, stream=0) -> None:
    """out[rows] = src[rows] (device f32 [T, N] each; rows device int32 [R])."""
    n = rows.shape[0] * out.shape[1]
    if n:
        launch(_put_rows, (n + _THREADS - 1) // _THREADS, _THREADS, stream, src, rows, out)


@cuda.jit
def _scatter_rows(src, rows, out):
    i = cuda.grid(1)
    n = out.shape[1]
    if i < rows.shape[0] * n:
        r = i // n
        c = i - r * n
        t = rows[r]
        if t >= 0:
            out[t, c] = src[r, c]


def scatter_rows(src, rows, out, stream=0) -> None:
    """out[rows[i]] = src[i] for rows[i] >= 0 (device f32 src [R, N], out [T, N]; rows device int32 [R])."""
    n = rows.shape[0] * out.shape[1]
    if n:
        launch(_scatter_rows, (n + _THREADS - 1) // _THREADS, _THREADS, stream, src, rows, out)
