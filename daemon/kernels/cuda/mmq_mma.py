"""The tiled prefill matmul on the int8 tensor cores (sm_80+): mmq.py's tiles, multiplied by
`mma.sync` instead of dp4a.

A block of WM x WN warps computes BM = WM * 16 * TM rows x BN = WN * 8 * TN tokens. Each K step
stages the same shared tiles as the dp4a kernel (mmq_stage.py; the next step's loads are issued
before this step multiplies, except in Q8_0's expert launches), with scale groups of SUB = 32
values (16 for Q6_K). Then, for each group, each warp loads its A fragments (16 rows x SUB k, one
word a register) and B fragments (SUB k x 8 tokens) straight from the tiles, multiplies them
exactly in int32 (ptx.mma_k32 / mma_k16), and scales each C value into its float accumulator:
acc += mul * d * isum + off * d * sum(q). One row's result depends only on its own row, its
token's quants and K, never on the tile's other tokens, so a prefill's bits do not depend on how
its tokens were batched.

Tile words a shared row: PAD = 36, so that the 32 lanes of a fragment load (row g, word t:
bank 4g + t) hit 32 banks.

Legend: WM/WN = warps along rows/tokens, TM/TN = 16-row/8-token mma tiles a warp, g = lane >> 2,
t = lane & 3, BK = 128, NG = BK / SUB.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
from numba import cuda

from ..quants import block_size
from .mmq_stage import BK, scale_group, stagers
from .vecdot import VALUES
from .ptx import mma_k16, mma_k32

_PAD = 36
_Z = np.float32(0.0)


class Shape(NamedTuple):
    """Warps along rows and tokens, and mma tiles a warp along each."""
    wm: int
    wn: int
    tm: int
    tn: int

    @property
    def rows(self) -> int:
        return self.wm * 16 * self.tm

    @property
    def tokens(self) -> int:
        return self.wn * 8 * self.tn

    @property
    def threads(self) -> int:
        return 32 * self.wm * self.wn


def build(qtype: int, shape: Shape, ids_mode: bool, has_bias: bool, host: bool = False):
    """-> (kernel, threads, BM, BN); the kernel takes mmq.py's dp4a kernel's arguments."""
    wm_, tm, tn = shape.wm, shape.tm, shape.tn
    bm, bn, nthreads = shape.rows, shape.tokens, shape.threads
    sub = scale_group(qtype)
    k32 = sub == 32
    ng = BK // sub
    wpg = sub // 4  # words a group
    st = stagers(qtype, bm, bn, nthreads, sub, ids_mode, host)
    block_tile, tile_tokens, groups_in_step = st.block_tile, st.tile_tokens, st.groups_in_step
    fetch_step, store_step, stage_step = st.fetch_step, st.store_step, st.stage_step
    w_chunks, w_raw, a_groups, a_raw = st.w_chunks, st.w_raw, st.a_groups, st.a_raw
    qk = block_size(qtype)[0]
    # the next K step's loads issued before this step multiplies: on an H200 (qwen3-30b-a3b's
    # shapes, 512 tokens) dense launches gained 5-40% and MXFP4's experts 9%, but Q8_0's experts
    # (twice the chunks a K step: 16 values each) lost 15-40%, so those load each step in turn
    prefetch = not ids_mode or VALUES[qtype] == 32

    @cuda.jit
    def kernel(W, WH, aq, ads, ids, slot_of, pairs, starts, act_t, act_a, bias, out, n, k, stride,
               n_tok):
        # the arguments of mmq.py's dp4a kernel (its comment gives their shapes)
        wq = cuda.shared.array((bm, _PAD), np.uint32)
        wmul = cuda.shared.array((bm, ng), np.float32)
        woff = cuda.shared.array((bm, ng), np.float32)
        xq = cuda.shared.array((bn, _PAD), np.uint32)
        xd = cuda.shared.array((bn, ng), np.float32)
        xs = cuda.shared.array((bn, ng), np.float32)
        rowid = cuda.shared.array(bn, np.int32)
        outt = cuda.shared.array(bn, np.int32)
        outa = cuda.shared.array(bn, np.int32)

        tid = cuda.threadIdx.x
        row0 = cuda.blockIdx.x * bm
        e, first, count, slot, from_host = block_tile(starts, slot_of, n_tok)
        if slot < 0:
            return
        if from_host:
            W = WH
        tile_tokens(ids, pairs, first, count, act_t, act_a, tid, rowid, outt, outa)
        warp = tid >> 5
        lane = tid & 31
        g = lane >> 2
        t = lane & 3
        r_base = (warp % wm_) * (16 * tm) + g  # this lane's first row in the tile (then + 8)
        c_base = (warp // wm_) * (8 * tn)
        acc = cuda.local.array((tm, tn, 4), np.float32)
        for i in range(tm):
            for j in range(tn):
                for u in range(4):
                    acc[i, j, u] = _Z
        af = cuda.local.array((tm, 4), np.uint32)  # A fragments of the group
        sc = cuda.local.array((tm, 4), np.float32)  # mul and off of rows r, r + 8
        wraw = cuda.local.array((w_chunks, w_raw), np.uint32)  # the next K step's loads
        araw = cuda.local.array((a_groups, a_raw), np.uint32)
        nb = k // qk
        nk = (k + BK - 1) // BK
        cuda.syncthreads()
        if prefetch:
            fetch_step(W, slot, n, stride, nb, row0, aq, ads, rowid, 0, k, tid, wraw, araw)
        for kt in range(nk):
            if prefetch:
                store_step(wraw, araw, rowid, kt, k, tid, wq, wmul, woff, xq, xd, xs)
            else:
                stage_step(W, slot, n, stride, nb, row0, aq, ads, rowid, kt, k, tid, wq, wmul, woff, xq, xd, xs)
            cuda.syncthreads()
            if prefetch and kt + 1 < nk:  # in flight while this step multiplies
                fetch_step(W, slot, n, stride, nb, row0, aq, ads, rowid, kt + 1, k, tid, wraw, araw)
            for q in range(groups_in_step(k, kt)):
                kw = q * wpg + t
                for i in range(tm):
                    r = r_base + 16 * i
                    af[i, 0] = wq[r, kw]
                    af[i, 1] = wq[r + 8, kw]
                    if k32:
                        af[i, 2] = wq[r, kw + 4]
                        af[i, 3] = wq[r + 8, kw + 4]
                    sc[i, 0] = wmul[r, q]
                    sc[i, 1] = wmul[r + 8, q]
                    sc[i, 2] = woff[r, q]
                    sc[i, 3] = woff[r + 8, q]
                for j in range(tn):
                    tok = c_base + 8 * j
                    b0 = xq[tok + g, kw]
                    tc = tok + 2 * t  # this lane's two C columns
                    d0 = xd[tc, q]
                    d1 = xd[tc + 1, q]
                    s0 = xs[tc, q]
                    s1 = xs[tc + 1, q]
                    if k32:
                        b1 = xq[tok + g, kw + 4]
                    for i in range(tm):
                        if k32:
                            c = mma_k32(af[i, 0], af[i, 1], af[i, 2], af[i, 3], b0, b1)
                        else:
                            c = mma_k16(af[i, 0], af[i, 1], b0)
                        acc[i, j, 0] += sc[i, 0] * d0 * np.float32(c[0]) + sc[i, 2] * s0
                        acc[i, j, 1] += sc[i, 0] * d1 * np.float32(c[1]) + sc[i, 2] * s1
                        acc[i, j, 2] += sc[i, 1] * d0 * np.float32(c[2]) + sc[i, 3] * s0
                        acc[i, j, 3] += sc[i, 1] * d1 * np.float32(c[3]) + sc[i, 3] * s1
            cuda.syncthreads()
        for i in range(tm):
            for u in range(4):
                row = row0 + r_base + 16 * i + 8 * (u >> 1)
                if row < n:
                    for j in range(tn):
                        tt = c_base + 8 * j + 2 * t + (u & 1)
                        if rowid[tt] >= 0:
                            v = acc[i, j, u]
                            if has_bias:
                                v += bias[e, row]
                            out[outt[tt], outa[tt], row] = v

    return kernel, nthreads, bm, bn
