"""Tiled int8 matmul for prefill (T > 16): shared-memory tiles, like llama.cpp's MMQ.

A block computes a tile of BM weight rows x BN tokens, stepping over K 128 values at a time:
  1. it stages a weight tile and an activation tile in shared memory (mmq_stage.py): int8 words
     and, per scale group, (mul, off) a row and (d, d * sum(q)) a token;
  2. it accumulates mul * d * isum + off * d * sum(q) over the groups, isum the group's exact
     int32 dot: on the tensor cores (mmq_mma.py, sm_80+, groups of 32 values, 16 for Q6_K), or
     before sm_80 with dp4a, a thread's RM x RN register tile, in groups of 16 (this file).
The offsets are dotted with the exact integer sums of the activation quants (the GEMV uses the
q8_1 block sums s for the 32-value types, as llama.cpp's mmvq does; both round the same float
product differently, well inside the tolerance against the float weights).

Experts: `grouping.group_by_expert` lists, on the device, the (token, slot) pairs of each expert
(in pair order, so results do not depend on timing), and one launch runs grid (row tiles, expert,
token tiles) over them; empty tiles exit at once. No host sync between router and experts.
The tensor-core launch takes 32-token tiles where an expert averages fewer than 48 pairs.
Float weights (F32/F16/BF16) go through the GEMV kernels in tiles of 16 tokens instead.

Legend: T = tokens, A = experts per token, E = experts, P = T*A pairs, N = rows, K = values per
row (a multiple of 32), BM/BN = tile rows/tokens, BK = 128 (a K step).
"""

from __future__ import annotations

import numpy as np
from numba import cuda

from ...errors import UnsupportedError
from ..quants import block_size, type_name
from . import mmq_mma, mmvq
from .launch import launch
from .mmq_mma import Shape
from .mmq_stage import BK, K_MULTIPLE, MMQ_TYPES, stagers
from .grouping import Groups
from .ptx import SIMULATOR, dp4a
from .vecdot import FLOAT_ACT

_G = BK // 16  # 16-value groups a K step
_PAD = 33  # words a shared row (32 + 1: conflict-free column reads)
_Z = np.float32(0.0)


def _build(qtype: int, bm: int, bn: int, ids_mode: bool, has_bias: bool, host: bool = False):
    """The dp4a kernel (GPUs before sm_80): a thread's RM x RN register tile, per 16 values."""
    rm = rn = 4
    tx_n = bn // rn
    nthreads = (bm // rm) * tx_n
    st = stagers(qtype, bm, bn, nthreads, 16, ids_mode, host)
    block_tile, tile_tokens, groups_in_step = st.block_tile, st.tile_tokens, st.groups_in_step
    fetch_step, store_step = st.fetch_step, st.store_step
    w_chunks, w_raw, a_groups, a_raw = st.w_chunks, st.w_raw, st.a_groups, st.a_raw
    qk = block_size(qtype)[0]

    @cuda.jit
    def kernel(W, WH, aq, ads, ids, slot_of, pairs, starts, act_t, act_a, bias, out, n, k, stride,
               n_tok):
        # W uint8 [S, N, stride]; WH: the host tier [H, N, stride] (mmvq's module doc), read where
        # `host` and slot_of[e] = -2 - h; aq int8 [R, K]; ads float32 [R, K/32, 2]; ids int32 [T, A];
        # slot_of int32 [E]; pairs int32 [P], starts int32 [E+1] (grouping.py);
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
        e, first, count, slot, from_host = block_tile(starts, slot_of, n_tok)
        if slot < 0:
            return  # the whole block: no token here, or the expert is not held
        if from_host:
            W = WH
        tile_tokens(ids, pairs, first, count, act_t, act_a, tid, rowid, outt, outa)
        acc = cuda.local.array((rm, rn), np.float32)
        for i in range(rm):
            for j in range(rn):
                acc[i, j] = _Z
        wraw = cuda.local.array((w_chunks, w_raw), np.uint32)  # the next K step's loads
        araw = cuda.local.array((a_groups, a_raw), np.uint32)
        nb = k // qk
        nk = (k + BK - 1) // BK
        ty = tid // tx_n
        tx = tid - ty * tx_n
        cuda.syncthreads()
        fetch_step(W, slot, n, stride, nb, row0, aq, ads, rowid, 0, k, tid, wraw, araw)
        for kt in range(nk):
            store_step(wraw, araw, rowid, kt, k, tid, wq, wm, wo, xq, xd, xs)
            cuda.syncthreads()
            if kt + 1 < nk:  # in flight while this step multiplies
                fetch_step(W, slot, n, stride, nb, row0, aq, ads, rowid, kt + 1, k, tid, wraw, araw)
            for g in range(groups_in_step(k, kt)):
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

    return kernel, nthreads, bm, bn


# None: the tensor cores where the GPU has them (sm_80+; the simulator's twins always); a test or
# benchmark may set True or False
USE_MMA: bool | None = None
# tensor-core tiles: 64 rows x 64 tokens (4 warps of 32 x 32), and 64 x 32 (4 warps of 16 x 32)
# for experts of few pairs each; on an H200 the wide shape gave gpt-oss-20b's prefill 7-9% over
# 8 warps of 16 x 32 (docs/benchmarks.md). The simulator's threads are Python threads: two small
# tiles of two warps, one with two row tiles a warp.
MMA_WIDE = Shape(1, 2, 2, 1) if SIMULATOR else Shape(2, 2, 2, 4)
MMA_NARROW = Shape(2, 1, 1, 2) if SIMULATOR else Shape(4, 1, 1, 4)
_NARROW_BELOW = 48  # pairs an expert on average

_KERNELS: dict[tuple, tuple] = {}
_HAS_MMA: list[bool] = []


def _mma() -> bool:
    if USE_MMA is not None:
        return USE_MMA
    if not _HAS_MMA:
        _HAS_MMA.append(SIMULATOR or cuda.get_current_device().compute_capability >= (8, 0))
    return _HAS_MMA[0]


def _kernel(qtype: int, ids_mode: bool, has_bias: bool, host: bool = False, narrow: bool = False):
    """-> (kernel, threads, BM, BN) for this launch, built once."""
    if _mma():
        key = (qtype, MMA_NARROW if narrow else MMA_WIDE, ids_mode, has_bias, host)
        build = mmq_mma.build
    else:
        tile = 16 if SIMULATOR else 64  # the simulator runs each thread as a Python thread
        key = (qtype, tile, tile, ids_mode, has_bias, host)
        build = _build
    if key not in _KERNELS:
        _KERNELS[key] = build(*key)
    return _KERNELS[key]


def _check(w, qtype: int, k: int, act, stack: bool):
    if qtype not in MMQ_TYPES:
        raise UnsupportedError(f"no tiled GPU matmul for {type_name(qtype)}")
    if k % K_MULTIPLE:
        raise UnsupportedError(f"tiled GPU matmul needs K a multiple of {K_MULTIPLE}, got {k}")
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
    kern, threads, bm, bn = _kernel(qtype, False, bias is not None)
    dummy_i2, dummy_i1 = mmvq._dummy("ids"), mmvq._dummy("slot")
    launch(kern, ((n + bm - 1) // bm, (t + bn - 1) // bn, 1), threads, stream,
        w.reshape(1, n, w.shape[1]), mmvq._dummy("w"), aq, ads, dummy_i2, dummy_i1, dummy_i1, dummy_i1, 0, 0,
        mmvq._dummy("bias") if bias is None else bias.reshape(1, n), out.reshape(t, 1, n), n, k,
        w.shape[1], t)
    return out


def mul_mat_q_ids(w, qtype: int, k: int, act, ids, slot_of, groups: Groups, out=None,
                  bias=None, act_per_pair=False, *, w_host=None, stream=0):
    """out[t, a, N] = act[row] . w[slot_of[ids[t, a]]]^T (+ bias[ids[t, a]]), tiled, for every
    pair; row = t, or t*A + a with act_per_pair. groups = grouping.group_by_expert(ids, E). w_host: a
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
    narrow = t * a < _NARROW_BELOW * groups.n_expert
    kern, threads, bm, bn = _kernel(qtype, True, bias is not None, w_host is not None, narrow)
    act_t, act_a = (a, 1) if act_per_pair else (1, 0)
    # token tiles: enough for an expert that every pair chose
    grid = ((n + bm - 1) // bm, groups.n_expert, (t + bn - 1) // bn)
    launch(kern, grid, threads, stream,
        w, mmvq._dummy("w") if w_host is None else w_host, aq, ads, ids, slot_of, groups.pairs, groups.starts,
        act_t, act_a,
        mmvq._dummy("bias") if bias is None else bias, out, n, k, w.shape[2], t)
    return out
