"""What both tiled prefill matmuls (mmq.py's dp4a kernel, mmq_mma.py's tensor-core kernel) share:
which tokens a block takes, and one K step's weight and activation tiles in shared memory.

A tile stores its int8 quants as words (4 consecutive k, low byte first), row-major over k, and
per scale group of SUB values (16 or 32) a (mul, off) per weight row and a (d, d * sum(q)) per
token, so that row . token = sum over groups of mul * d * isum + off * d * sum(q), isum being
the exact int32 dot of the group's quants:
  - weights: each thread decodes chunks of the repacked rows with the GEMV's own per-type `load`
    (vecdot.py); value = mul * q + off (Q4_0's -8d, Q4_1's m, Q4_K's -dmin*m, Q6_K's -32 d*sc ...);
  - activations: q8_1 quants (quantize.py), d per 32 values; sum(q) exact, from dp4a.
A K step is staged in two halves: fetch_step issues its global loads into registers (raw words),
store_step decodes them into the shared tiles; a kernel that fetches step kt + 1 before it
multiplies step kt has those loads in flight while the tensor cores (or dp4a) work. stage_step
does both a chunk at a time (fewer registers live), for launches that do not prefetch.

Legend: BK = 128 values a K step (the last may hold fewer: K is a multiple of 32, e.g. gpt-oss's 2880), BM/BN = tile rows/tokens, SUB = values a scale group,
NG = BK / SUB groups, PAD = shared words a tile row (32 + padding against bank conflicts).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
from numba import cuda

from ..quants import MXFP4, Q4_0, Q4_1, Q4_K, Q5_0, Q5_1, Q5_K, Q6_K, Q8_0
from .ptx import bits_to_f32, device, dp4a, ldg_u32, ldg_v4
from .vecdot import FETCH, VALUES, VECDOT

BK = 128
K_MULTIPLE = 32  # K must be a multiple of this; a last K step of fewer than BK values stages only those
ONES = np.uint32(0x01010101)
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


def scale_group(qtype: int) -> int:
    """The most values that share one (mul, off): 16 for Q6_K, 32 for the other types."""
    return 16 if qtype == Q6_K else 32


class Stagers(NamedTuple):
    """A tile shape's device functions, and the sizes of the register arrays that carry one K
    step's loads from fetch_step to store_step (allocated by the kernel: wraw uint32 [w_chunks,
    w_raw], araw uint32 [a_groups, a_raw])."""
    block_tile: object
    tile_tokens: object
    fetch_step: object
    store_step: object
    stage_step: object
    groups_in_step: object
    w_chunks: int
    w_raw: int
    a_groups: int
    a_raw: int


def stagers(qtype: int, bm: int, bn: int, nthreads: int, sub: int, ids_mode: bool,
            host: bool) -> Stagers:
    """The device functions for tiles of bm rows x bn tokens staged by nthreads threads, with
    scale groups of `sub` values (16, or 32 where the type's groups are that wide). ids_mode:
    the experts' launch (grid y = expert, z = token tiles), else dense (grid y = token tiles);
    host: slots -2 - h are read from the host tier."""
    fetch, decode, n_raw = FETCH[qtype]
    load = VECDOT[qtype][0]
    geom = _GEOM[qtype]
    per_chunk = VALUES[qtype]
    cpr = BK // per_chunk  # chunks a row a K step
    two_halves = qtype != Q8_0
    shift = 4 if sub == 16 else 5
    ng = BK // sub
    parts = sub // 16
    w_chunks = -(-bm * cpr // nthreads)  # chunks a thread stages a K step
    a_groups = -(-bn * ng // nthreads)  # activation groups a thread stages a K step

    @device
    def block_tile(starts, slot_of, n_tok):
        # -> (expert, first token or pair, count, slot, from the host tier); slot < 0: nothing here
        if ids_mode:
            e = cuda.blockIdx.y
            first = starts[e] + cuda.blockIdx.z * bn
            count = starts[e + 1] - first
            slot = slot_of[e]
            from_host = False
            if host and slot <= -2:  # a miss read in place from pinned host memory
                slot = -2 - slot
                from_host = True
            if count <= 0:
                slot = -1  # no token of this expert in this tile
            return e, first, count, slot, from_host
        first = cuda.blockIdx.y * bn
        return 0, first, n_tok - first, 0, False

    @device
    def tile_tokens(ids, pairs, first, count, act_t, act_a, tid, rowid, outt, outa):
        # rowid/outt/outa int32 [BN]: each tile token's activation row (-1: none), output token, slot
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

    @device
    def groups_in_step(k, kt):
        """Scale groups of K step kt (NG, or fewer in a last, partial step)."""
        return min(ng, (k - kt * BK) // sub)

    @device
    def weight_chunk(i, kt, k):
        """-> (tile row, chunk of the row, staged?) of the tile's chunk i of K step kt (a partial
        last step stages only its chunks)."""
        r = i // cpr
        cr = i - r * cpr
        return r, cr, i < bm * cpr and cr < min(cpr, (k - kt * BK) // per_chunk)

    @device
    def act_group(i, kt, k):
        """-> (tile token, scale group, staged?) of the tile's activation group i of step kt."""
        tt = i // ng
        g = i - tt * ng
        return tt, g, i < bn * ng and g < groups_in_step(k, kt)

    @device
    def fetch_weight_chunk(W, slot, n, stride, nb, row0, kt, k, i, raw, s):
        # the tile's chunk i of K step kt, raw, into raw[s, :]; rows past n repeat the last one
        r, cr, ok = weight_chunk(i, kt, k)
        if ok:
            fetch(W, (slot * n + min(row0 + r, n - 1)) * stride, nb, kt * cpr + cr, raw, s)

    @device
    def put_chunk(w, r, c, kt, wq, wmul, woff):
        # decoded chunk c of tile row r -> wq uint32 [BM, PAD]; wmul/woff float32 [BM, NG]; the
        # words of a partial step's missing groups are left as they were (never read)
        vlo, vhi, mlo, olo, mhi, ohi = geom(w, c)
        vlo -= kt * BK
        wq[r, vlo >> 2] = w[0]
        wq[r, (vlo >> 2) + 1] = w[1]
        wq[r, (vlo >> 2) + 2] = w[2]
        wq[r, (vlo >> 2) + 3] = w[3]
        wmul[r, vlo >> shift] = mlo  # a 32-value group's two halves write the same value
        woff[r, vlo >> shift] = olo
        if two_halves:
            vhi -= kt * BK
            wq[r, vhi >> 2] = w[4]
            wq[r, (vhi >> 2) + 1] = w[5]
            wq[r, (vhi >> 2) + 2] = w[6]
            wq[r, (vhi >> 2) + 3] = w[7]
            wmul[r, vhi >> shift] = mhi
            woff[r, vhi >> shift] = ohi

    @device
    def fetch_act_group(aq, ads, k, kt, i, rowid, raw, s):
        # aq int8 [R, K]; ads float32 [R, K/32, 2] (d first) -> raw[s, :]: d's bits, then the
        # quant words of the tile's group i of step kt
        tt, g, ok = act_group(i, kt, k)
        if ok:
            ar = rowid[tt]
            if ar >= 0:
                v = kt * BK + g * sub
                raw[s, 0] = ldg_u32(ads, (ar * (k >> 5) + (v >> 5)) << 3)
                for h in range(parts):
                    q = ldg_v4(aq, ar * k + v + 16 * h)
                    raw[s, 1 + 4 * h] = q[0]
                    raw[s, 2 + 4 * h] = q[1]
                    raw[s, 3 + 4 * h] = q[2]
                    raw[s, 4 + 4 * h] = q[3]

    @device
    def store_act_group(raw, s, i, kt, k, rowid, xq, xd, xs):
        # raw[s] (group i) -> xq uint32 [BN, PAD]; xd/xs float32 [BN, NG]; tokens past the
        # tile's count are zeros
        tt, g, ok = act_group(i, kt, k)
        if ok:
            w0 = g * (sub >> 2)
            if rowid[tt] >= 0:
                d = bits_to_f32(raw[s, 0])
                total = 0
                for u in range(sub >> 2):
                    q = raw[s, 1 + u]
                    total = dp4a(ONES, q, total)
                    xq[tt, w0 + u] = q
                xd[tt, g] = d
                xs[tt, g] = d * np.float32(total)
            else:
                for u in range(sub >> 2):
                    xq[tt, w0 + u] = np.uint32(0)
                xd[tt, g] = _Z
                xs[tt, g] = _Z

    @device
    def fetch_step(W, slot, n, stride, nb, row0, aq, ads, rowid, kt, k, tid, wraw, araw):
        """Issue every load of this thread's part of K step kt into wraw/araw (registers)."""
        for s in range(w_chunks):
            fetch_weight_chunk(W, slot, n, stride, nb, row0, kt, k, tid + s * nthreads, wraw, s)
        for s in range(a_groups):
            fetch_act_group(aq, ads, k, kt, tid + s * nthreads, rowid, araw, s)

    @device
    def store_step(wraw, araw, rowid, kt, k, tid, wq, wmul, woff, xq, xd, xs):
        """Decode fetch_step's registers into the shared tiles."""
        for s in range(w_chunks):
            r, cr, ok = weight_chunk(tid + s * nthreads, kt, k)
            if ok:
                c = kt * cpr + cr
                put_chunk(decode(wraw, s, c), r, c, kt, wq, wmul, woff)
        for s in range(a_groups):
            store_act_group(araw, s, tid + s * nthreads, kt, k, rowid, xq, xd, xs)

    @device
    def stage_step(W, slot, n, stride, nb, row0, aq, ads, rowid, kt, k, tid, wq, wmul, woff, xq, xd, xs):
        """K step kt straight into the shared tiles, each chunk and group stored as soon as it is
        loaded, in loops the compiler keeps rolled: few registers live (Q8_0's expert launch at
        64 x 32: 79, against 128 with fetch_step and store_step; the activations read through the
        raw array alone took 121), so more blocks fit an SM."""
        for i in range(tid, bm * cpr, nthreads):
            r, cr, ok = weight_chunk(i, kt, k)
            if ok:
                c = kt * cpr + cr
                put_chunk(load(W, (slot * n + min(row0 + r, n - 1)) * stride, nb, c), r, c, kt, wq, wmul, woff)
        valid = groups_in_step(k, kt)
        for i in range(tid, bn * ng, nthreads):
            tt = i // ng
            g = i - tt * ng
            if g >= valid:
                continue
            ar = rowid[tt]
            w0 = g * (sub >> 2)
            if ar >= 0:
                v = kt * BK + g * sub
                d = bits_to_f32(ldg_u32(ads, (ar * (k >> 5) + (v >> 5)) << 3))
                total = 0
                for h in range(parts):
                    q = ldg_v4(aq, ar * k + v + 16 * h)
                    total = dp4a(ONES, q[0], total)
                    total = dp4a(ONES, q[1], total)
                    total = dp4a(ONES, q[2], total)
                    total = dp4a(ONES, q[3], total)
                    xq[tt, w0 + 4 * h] = q[0]
                    xq[tt, w0 + 4 * h + 1] = q[1]
                    xq[tt, w0 + 4 * h + 2] = q[2]
                    xq[tt, w0 + 4 * h + 3] = q[3]
                xd[tt, g] = d
                xs[tt, g] = d * np.float32(total)
            else:
                for u in range(sub >> 2):
                    xq[tt, w0 + u] = np.uint32(0)
                xd[tt, g] = _Z
                xs[tt, g] = _Z

    return Stagers(block_tile, tile_tokens, fetch_step, store_step, stage_step, groups_in_step,
                   w_chunks, n_raw, a_groups, 1 + (sub >> 2))
