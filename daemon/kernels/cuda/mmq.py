"""Tiled int8 matmul for prefill (T > 16): shared-memory tiles, dp4a, like llama.cpp's MMQ.

A block computes a tile of BM weight rows x BN tokens, stepping over K 128 values at a time:
  1. weight tile: each thread decodes chunks of the repacked rows with the GEMV's own per-type
     `load` (vecdot.py) and stores them in shared memory as int8 words plus, per 16 values, a
     scale and an offset (value = mul * q + off: Q4_0's -8d, Q4_1's m, Q4_K's -dmin*m, Q6_K's
     -32 d*sc ...);
  2. activation tile: q8_1 quants of BN tokens (quantize.py), with d and d * sum(q) per 16
     values;
  3. every thread accumulates a RM x RN register tile: mul * d * dp4a-sum + off * d * sum(q).
The offsets are dotted with the exact integer sums of the activation quants (the GEMV uses the
q8_1 block sums s for the 32-value types, as llama.cpp's mmvq does; both round the same float
product differently, well inside the tolerance against the float weights).

Experts: `group_by_expert` lists, on the device, the (token, slot) pairs of each expert (in pair
order, so results do not depend on timing), and one launch runs grid (row tiles, expert,
token tiles) over them; empty tiles exit at once. No host sync between router and experts.
Float weights (F32/F16/BF16) go through the GEMV kernels in tiles of 16 tokens instead.

Legend: T = tokens, A = experts per token, E = experts, P = T*A pairs, N = rows, K = values per
row (a multiple of 128), BM/BN = tile rows/tokens (64 each), BK = 128.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
from numba import cuda

from ...errors import UnsupportedError
from ..quants import MXFP4, Q4_0, Q4_1, Q4_K, Q5_0, Q5_1, Q5_K, Q6_K, Q8_0, block_size, type_name
from . import mmvq
from .ptx import SIMULATOR, bits_to_f32, device, dp4a, ldg_u32, ldg_v4
from .vecdot import FLOAT_ACT, VALUES, VECDOT
from .launch import launch

BK = 128
_G = BK // 16  # 16-value groups per K step
_PAD = 33  # words per shared row (32 + 1: conflict-free column reads)
_ONES = np.uint32(0x01010101)
_Z = np.float32(0.0)
_M8 = np.float32(-8.0)
_M16 = np.float32(-16.0)
_M32 = np.float32(-32.0)


# ---- per type: where a decoded chunk's two 16-value halves go, and their (mul, off) ----------
# (value index of the low half, of the high half, mul_lo, off_lo, mul_hi, off_hi); Q8_0 chunks
# are one 16-value half.

@device
def _geom_q8_0(w, c):
    return c << 4, 0, w[4], _Z, _Z, _Z


@device
def _geom_q4_0(w, c):
    return c << 5, (c << 5) + 16, w[8], _M8 * w[8], w[8], _M8 * w[8]


@device
def _geom_q5_0(w, c):
    return c << 5, (c << 5) + 16, w[8], _M16 * w[8], w[8], _M16 * w[8]


@device
def _geom_q4_1(w, c):
    return c << 5, (c << 5) + 16, w[8], w[9], w[8], w[9]


@device
def _geom_mxfp4(w, c):
    return c << 5, (c << 5) + 16, w[8], _Z, w[8], _Z


@device
def _geom_kq4(w, c):
    v = ((c >> 3) << 8) + (((c & 7) >> 1) << 6) + ((c & 1) << 4)
    return v, v + 32, w[8], -w[10], w[9], -w[11]


@device
def _geom_q6_k(w, c):
    cc = c & 7
    v = ((c >> 3) << 8) + ((cc >> 2) << 7) + (((cc >> 1) & 1) << 5) + ((cc & 1) << 4)
    return v, v + 64, w[8], _M32 * w[8], w[9], _M32 * w[9]


_GEOM = {Q8_0: _geom_q8_0, Q4_0: _geom_q4_0, Q4_1: _geom_q4_1, Q5_0: _geom_q5_0,
         Q5_1: _geom_q4_1, MXFP4: _geom_mxfp4, Q4_K: _geom_kq4, Q5_K: _geom_kq4,
         Q6_K: _geom_q6_k}
MMQ_TYPES = frozenset(_GEOM)


def _build(qtype: int, bm: int, bn: int, ids_mode: bool, has_bias: bool, host: bool = False):
    load = VECDOT[qtype][0]
    geom = _GEOM[qtype]
    qk = block_size(qtype)[0]
    cpr = BK // VALUES[qtype]  # chunks per row per K step
    two_halves = qtype != Q8_0
    rm = rn = 4
    tx_n = bn // rn
    nthreads = (bm // rm) * tx_n

    @cuda.jit
    def kernel(W, WH, aq, ads, ids, slot_of, pairs, starts, act_t, act_a, bias, out, n, k, stride,
               n_tok):
        # W uint8 [S, N, stride]; WH: the host tier [H, N, stride] (mmvq's module doc), read where
        # `host` and slot_of[e] = -2 - h; aq int8 [R, K]; ads float32 [R, K/32, 2]; ids int32 [T, A];
        # slot_of int32 [E]; pairs int32 [P], starts int32 [E+1] (group_by_expert);
        # bias float32 [E or 1, N]; out float32 [T, A, N].
        # grid: x = row tiles; dense: y = token tiles; experts: y = expert, z = token tiles.
        wq = cuda.shared.array((bm, _PAD), np.uint32)
        wm = cuda.shared.array((bm, _G), np.float32)
        wo = cuda.shared.array((bm, _G), np.float32)
        xq = cuda.shared.array((bn, _PAD), np.uint32)
        xd = cuda.shared.array((bn, _G), np.float32)
        xs = cuda.shared.array((bn, _G), np.float32)
        rowid = cuda.shared.array(bn, np.int32)  # activation row of each tile token (-1: none)
        outt = cuda.shared.array(bn, np.int32)  # its output token
        outa = cuda.shared.array(bn, np.int32)  # and expert slot index a

        tid = cuda.threadIdx.x
        row0 = cuda.blockIdx.x * bm
        slot = 0
        e = 0
        if ids_mode:
            e = cuda.blockIdx.y
            first = starts[e] + cuda.blockIdx.z * bn
            count = starts[e + 1] - first
            if count <= 0:
                return  # the whole block: no token of this expert in this tile
            slot = slot_of[e]
            if host and slot <= -2:  # a miss read in place from pinned host memory
                slot = -2 - slot
                W = WH
            if slot < 0:
                return  # not here: its outputs are left to whoever holds it
        else:
            first = cuda.blockIdx.y * bn
            count = n_tok - first
        for i in range(tid, bn, nthreads):
            if i < count:
                if ids_mode:
                    p = pairs[first + i]
                    na = ids.shape[1]
                    t = p // na
                    a = p - t * na
                    rowid[i] = t * act_t + a * act_a
                    outt[i] = t
                    outa[i] = a
                else:
                    rowid[i] = first + i
                    outt[i] = first + i
                    outa[i] = 0
            else:
                rowid[i] = -1
        acc = cuda.local.array((rm, rn), np.float32)
        for i in range(rm):
            for j in range(rn):
                acc[i, j] = _Z
        nb = k // qk
        ty = tid // tx_n
        tx = tid - ty * tx_n
        cuda.syncthreads()
        for kt in range(k // BK):
            # weight tile: bm rows x cpr chunks, decoded
            for i in range(tid, bm * cpr, nthreads):
                r = i // cpr
                c = kt * cpr + (i - r * cpr)
                row = min(row0 + r, n - 1)
                w = load(W, (slot * n + row) * stride, nb, c)
                vlo, vhi, mlo, olo, mhi, ohi = geom(w, c)
                vlo -= kt * BK
                wq[r, vlo >> 2] = w[0]
                wq[r, (vlo >> 2) + 1] = w[1]
                wq[r, (vlo >> 2) + 2] = w[2]
                wq[r, (vlo >> 2) + 3] = w[3]
                wm[r, vlo >> 4] = mlo
                wo[r, vlo >> 4] = olo
                if two_halves:
                    vhi -= kt * BK
                    wq[r, vhi >> 2] = w[4]
                    wq[r, (vhi >> 2) + 1] = w[5]
                    wq[r, (vhi >> 2) + 2] = w[6]
                    wq[r, (vhi >> 2) + 3] = w[7]
                    wm[r, vhi >> 4] = mhi
                    wo[r, vhi >> 4] = ohi
            # activation tile: bn tokens x 8 groups of 16 quants
            for i in range(tid, bn * _G, nthreads):
                tt = i // _G
                g = i - tt * _G
                ar = rowid[tt]
                if ar >= 0:
                    v = kt * BK + (g << 4)
                    q = ldg_v4(aq, ar * k + v)
                    d = bits_to_f32(ldg_u32(ads, (ar * (k >> 5) + (v >> 5)) << 3))
                    s = dp4a(_ONES, q[0], 0)
                    s = dp4a(_ONES, q[1], s)
                    s = dp4a(_ONES, q[2], s)
                    s = dp4a(_ONES, q[3], s)
                    xq[tt, g << 2] = q[0]
                    xq[tt, (g << 2) + 1] = q[1]
                    xq[tt, (g << 2) + 2] = q[2]
                    xq[tt, (g << 2) + 3] = q[3]
                    xd[tt, g] = d
                    xs[tt, g] = d * np.float32(s)
                else:
                    for u in range(4):
                        xq[tt, (g << 2) + u] = np.uint32(0)
                    xd[tt, g] = _Z
                    xs[tt, g] = _Z
            cuda.syncthreads()
            for g in range(_G):
                for i in range(rm):
                    r = ty + i * (bm // rm)
                    w0 = wq[r, g << 2]
                    w1 = wq[r, (g << 2) + 1]
                    w2 = wq[r, (g << 2) + 2]
                    w3 = wq[r, (g << 2) + 3]
                    m = wm[r, g]
                    o = wo[r, g]
                    for j in range(rn):
                        tt = tx + j * tx_n
                        s = dp4a(w0, xq[tt, g << 2], 0)
                        s = dp4a(w1, xq[tt, (g << 2) + 1], s)
                        s = dp4a(w2, xq[tt, (g << 2) + 2], s)
                        s = dp4a(w3, xq[tt, (g << 2) + 3], s)
                        acc[i, j] += m * xd[tt, g] * np.float32(s) + o * xs[tt, g]
            cuda.syncthreads()
        for i in range(rm):
            row = row0 + ty + i * (bm // rm)
            if row < n:
                for j in range(rn):
                    tt = tx + j * tx_n
                    if rowid[tt] >= 0:
                        v = acc[i, j]
                        if has_bias:
                            v += bias[e, row]
                        out[outt[tt], outa[tt], row] = v

    return kernel, nthreads


_GROUP_THREADS = 1024
_STAGED_IDS = 16384  # ids staged in shared memory as int16 (32 KB); more stay in global memory


@cuda.jit
def _group_kernel(ids, n_pairs, n_expert, pairs, starts):
    # ids int32 [P] (the [T, A] ids, flat) -> pairs int32 [P]: the pair indices grouped by
    # expert, increasing within a group; starts int32 [E+1]. One block. Thread (e, s) owns
    # expert e in segment s of the pairs: it counts them, and after a prefix over (e, s) in
    # pair order writes them, so the order never depends on timing (no atomics).
    staged = cuda.shared.array(_STAGED_IDS, np.int16)
    counts = cuda.shared.array(_GROUP_THREADS, np.int32)  # [segment, expert]
    totals = cuda.shared.array(_GROUP_THREADS, np.int32)  # [expert]
    tid = cuda.threadIdx.x
    nthreads = cuda.blockDim.x
    n_seg = max(1, nthreads // n_expert)
    seg_len = (n_pairs + n_seg - 1) // n_seg
    small = n_pairs <= _STAGED_IDS
    if small:
        for p in range(tid, n_pairs, nthreads):
            staged[p] = np.int16(ids[p])  # expert ids < 1024
    cuda.syncthreads()
    for ts in range(tid, n_seg * n_expert, nthreads):
        s = ts // n_expert
        e = ts - s * n_expert
        c = 0
        for p in range(s * seg_len, min(n_pairs, (s + 1) * seg_len)):
            if (staged[p] if small else ids[p]) == e:
                c += 1
        counts[ts] = c
    cuda.syncthreads()
    for e in range(tid, n_expert, nthreads):  # where each segment of e starts, relative to e
        total = 0
        for s in range(n_seg):
            c = counts[s * n_expert + e]
            counts[s * n_expert + e] = total
            total += c
        totals[e] = total
    cuda.syncthreads()
    if tid == 0:
        total = 0
        for e in range(n_expert):
            starts[e] = total
            total += totals[e]
        starts[n_expert] = total
    cuda.syncthreads()
    for ts in range(tid, n_seg * n_expert, nthreads):
        s = ts // n_expert
        e = ts - s * n_expert
        o = starts[e] + counts[ts]
        for p in range(s * seg_len, min(n_pairs, (s + 1) * seg_len)):
            if (staged[p] if small else ids[p]) == e:
                pairs[o] = p
                o += 1


class Groups(NamedTuple):
    """The pairs of each expert (group_by_expert), shared by a layer's gate, up and down."""
    pairs: object  # int32 [P]
    starts: object  # int32 [E+1]
    n_expert: int


def group_by_expert(ids, n_expert: int, out: Groups | None = None, stream=0) -> Groups:
    """Group the (token, slot) pairs of ids int32 [T, A] by expert, on the device. `out`:
    buffers from an earlier call to reuse (pairs of at least T*A, starts of n_expert + 1)."""
    t, a = ids.shape
    if out is None:
        out = Groups(cuda.device_array(max(t * a, 1), np.int32, stream=stream),
                     cuda.device_array(n_expert + 1, np.int32, stream=stream), n_expert)
    elif out.n_expert != n_expert or out.pairs.shape[0] < t * a:
        raise ValueError(f"group buffers for {out.n_expert} experts and {out.pairs.shape[0]} "
                         f"pairs cannot hold {n_expert} experts and {t * a} pairs")
    if not 0 < n_expert <= _GROUP_THREADS:
        raise UnsupportedError(f"grouping supports up to {_GROUP_THREADS} experts, got {n_expert}")
    launch(_group_kernel, 1, 32 if SIMULATOR else _GROUP_THREADS, stream,
        ids.reshape(t * a), t * a, n_expert, out.pairs, out.starts)
    return out


_KERNELS: dict[tuple, tuple] = {}


def _kernel(*key):
    if key not in _KERNELS:
        _KERNELS[key] = _build(*key)
    return _KERNELS[key]


def _tile() -> int:
    return 16 if SIMULATOR else 64  # the simulator runs each thread as a Python thread


def _check(w, qtype: int, k: int, act, stack: bool):
    if qtype not in MMQ_TYPES:
        raise UnsupportedError(f"no tiled GPU matmul for {type_name(qtype)}")
    if k % BK:
        raise UnsupportedError(f"tiled GPU matmul needs K a multiple of {BK}, got {k}")
    mmvq._check_weight(w, qtype, k, stack)
    return mmvq._check_act(act, qtype, k)


def mul_mat_q(w, qtype: int, k: int, act, out=None, bias=None, *, stream=0):
    """out[T, N] = act[T, K] . w[N, K]^T (+ bias[N]), tiled; for prefill (any T).
    w: uint8 [N, stride] repacked; act: Q8 (quant weights) or float32 [T, K] (float weights,
    which run on the GEMV kernels in tiles of 16 tokens)."""
    if qtype in FLOAT_ACT:
        return mmvq.mul_mat_vec(w, qtype, k, act, out, bias, stream=stream)
    aq, ads, t = _check(w, qtype, k, act, stack=False)
    n = w.shape[0]
    if out is None:
        out = cuda.device_array((t, n), np.float32, stream=stream)
    tile = _tile()
    kern, threads = _kernel(qtype, tile, tile, False, bias is not None)
    dummy_i2, dummy_i1 = mmvq._dummy("ids"), mmvq._dummy("slot")
    launch(kern, ((n + tile - 1) // tile, (t + tile - 1) // tile, 1), threads, stream,
        w.reshape(1, n, w.shape[1]), mmvq._dummy("w"), aq, ads, dummy_i2, dummy_i1, dummy_i1, dummy_i1, 0, 0,
        mmvq._dummy("bias") if bias is None else bias.reshape(1, n), out.reshape(t, 1, n), n, k,
        w.shape[1], t)
    return out


def mul_mat_q_ids(w, qtype: int, k: int, act, ids, slot_of, groups: Groups, out=None,
                  bias=None, act_per_pair=False, *, w_host=None, stream=0):
    """out[t, a, N] = act[row] . w[slot_of[ids[t, a]]]^T (+ bias[ids[t, a]]), tiled, for every
    pair; row = t, or t*A + a with act_per_pair. groups = group_by_expert(ids, E). w_host: a
    host tier, for slots -2 - h (mmvq's module doc). Float weights run on mmvq.mul_mat_vec_ids."""
    if qtype in FLOAT_ACT:
        return mmvq.mul_mat_vec_ids(w, qtype, k, act, ids, slot_of, out, bias, act_per_pair,
                                    w_host=w_host, stream=stream)
    aq, ads, rows = _check(w, qtype, k, act, stack=True)
    if w_host is not None:
        mmvq._check_weight(w_host, qtype, k, stack=True)
        if w_host.shape[1] != w.shape[1]:
            raise ValueError(f"the host tier's rows ({w_host.shape[1]}) are not the stack's ({w.shape[1]})")
    t, a = ids.shape
    if rows != (t * a if act_per_pair else t):
        raise ValueError(f"{'T*A' if act_per_pair else 'T'} activation rows expected for ids "
                         f"{ids.shape}, got {rows}")
    n = w.shape[1]
    if bias is not None and (bias.ndim != 2 or bias.shape[1] != n):
        raise ValueError(f"expert biases must be float32 [E, {n}], got {bias.shape}")
    if out is None:
        out = cuda.device_array((t, a, n), np.float32, stream=stream)
    tile = _tile()
    kern, threads = _kernel(qtype, tile, tile, True, bias is not None, w_host is not None)
    act_t, act_a = (a, 1) if act_per_pair else (1, 0)
    grid = ((n + tile - 1) // tile, groups.n_expert, (t + tile - 1) // tile)
    launch(kern, grid, threads, stream,
        w, mmvq._dummy("w") if w_host is None else w_host, aq, ads, ids, slot_of, groups.pairs, groups.starts,
        act_t, act_a,
        mmvq._dummy("bias") if bias is None else bias, out, n, k, w.shape[2], t)
    return out
