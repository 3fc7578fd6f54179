"""Sampling on the device: daemon.sampling.Sampler's semantics, two launches, one int32 a row back.

Legend: S = rows sampled in a launch, V = vocabulary, N = sampler slots (capacity), W = ring width
(the longest repeat window in use), T = threads per block (a power of 2, 1..1024), k = top_k,
chunk = logits a phase-1 block reads (a power of 2, <= 2048), C = ceil(V / chunk) chunks a row,
m = min(k, chunk) candidates a chunk.

Per-sequence state lives in device pools indexed by a sampler slot, not by batch row, so a captured
CUDA graph reads fixed addresses and a sequence's draws never depend on the other rows of its launch
(`SamplerSlots`: options, a xoroshiro128+ state, a ring of the last tokens of history, and phase
1's outputs by slot).

`sample_rows`, on the rows' logits, which it may overwrite. Phase 1 (`_chunks`, grid (C, S), 256
threads a block by default: a row is read by C blocks at once, not by one SM), block (c, row):
1. the repeat penalty of the ring tokens in its chunk, in float32 (float64 then rounded: the same
   bits), in two phases (every ring entry computes from the unmodified logit, barrier, write back)
   so duplicate tokens do not race; non-finite logits are left as they are, for the flag;
2. a coalesced read of the chunk: the non-finite flag, and the first index of its maximum;
3. for a row on the top-k path (temperature > 0, 0 < k < V, k <= sort_max, C * m <= the scratch:
   CAND_MAX): the chunk's best m (key, index) pairs by (key desc, index asc), in that order, by a
   bitonic top-k in shared memory (runs of U >= m sorted, then rounds that keep the best U of two
   runs): every one of the row's first k is among the chunks' candidates.
Keys are an order-preserving uint32 of each logit (-0.0 keyed as +0.0, as the CPU's comparisons
treat them). Phase 2 (`_finish`, grid S, a block a row, 1024 threads by default):
4. a flagged chunk: flag 1 (token 0) and nothing else happens to the slot;
5. the maximum over the chunks' (first index among equals): temperature <= 0 takes it (the CPU's
   np.argmax, bit for bit);
6. else the candidates:
   - on the top-k path, phase 1's C * m candidates: equal keys lie in index order among them, so
     the one-block sorted path below runs on them unchanged (positions order ties as indices do);
   - 0 < k < V and k <= sort_max (<= 1024; default top_k is 40), the one-block sorted path: a
     radix select (4 passes of 8 bits, shared histograms, the crossing bin found by a block scan)
     finds the k-th largest key; the keys above it and the lowest-indexed ties (a block scan in
     index order) are gathered into shared memory and bitonic-sorted by (key desc, index asc): the
     CPU's first k. top-p, min-p and the draw walk that list in float64.
   - otherwise (k == 0, k >= V, or k > sort_max) nothing is sorted, still one block over the row:
     the top-k bound (if any) by the same radix select; the top-p bound by a radix select on masses
     exp(l - max) summed per bin in fixed point (int64 atomics: the same sums in any order, so
     draws are reproducible); min-p is a bound on exp(l - max); the draw walks the kept set in
     index order (the same distribution).
   - a row under a grammar mask (`_apply_masks`, before phase 1): a top-k larger than its allowed
     tokens stops at them. Its MASKED logits weigh 0 in any draw, but as ties at the k-th key
     they would all fall in one histogram bin of the radix select, serialized atomics;
7. the draw: one uniform float64 from the slot's xoroshiro128+ state (advanced only here, when
   temperature > 0, as the CPU's generator is), the first candidate whose running weight passes it.
8. the token goes to tokens_out[row] and into the slot's ring (the history grows by it).
The tokens are those of the one-block kernel the two phases replaced (`sample_rows_single`, kept
for benchmarks/gpu_sample.py) at the same threads a (phase-2) block: the same candidates in the
same order, the same sums in the same order.

The launches never sync the host, so they can be captured in a CUDA graph; they allocate only the
first time a pool meets a vocabulary (phase 1's scratch, kept; a plain device_array, which a
capture keeps). Growing N or W reallocates the pools and bumps `SamplerSlots.generation` (a graph
holding the old addresses must be captured again).

What is not bit-identical to the CPU: the float64 sums (summation order) and, off the sorted path,
the top-p mass (fixed point, each mass floored to a multiple of 2**-scale_bits, V * 2**-44 ~ 9e-9
of the total at most at V = 151,936), so a top-p or min-p cut at an exact boundary, or a draw at a
cumulative boundary, may differ from the CPU's; the distribution is the same. Greedy is identical.
"""

from __future__ import annotations

import heapq
import math
import secrets

import numpy as np
from numba import cuda
from numba.cuda.random import xoroshiro128p_dtype, xoroshiro128p_uniform_float64

from .launch import launch
from .device import upload
from .ptx import SIMULATOR, bits_to_f32, device, order_key

MAX_THREADS = 1024  # also the most candidates the sorted path holds
_SCAN_SIZE = MAX_THREADS + 32  # a scan's buffer: a value a thread, then the warp totals
CHUNK = 2048  # logits a phase-1 block reads (default)
CHUNK_MAX = 2048  # its shared arrays
# threads a phase-1 block: ~62 registers a thread let an SM hold ~1024 threads, so 256 a block
# keeps 4 blocks (chunks) of a launch in flight a SM where 1024 would keep one
CHUNK_THREADS = 256
CAND_MAX = 16384  # phase-1 candidates a row keeps (C * min(k, chunk)); past it, the one-block path
_INT_MAX = 2**31 - 1
_FLT_MAX = float(np.finfo(np.float32).max)
_EXP_FLOOR = -745.2  # exp() of anything below is 0 in float64
MASKED = np.float32(-1e30)  # daemon.grammar.MASKED: finite, so the non-finite flag stays a model fault
_MASKED_KEY = 0xFFFFFFFF - int(MASKED.view(np.uint32))  # order_key(MASKED)
# params columns
P_TEMP, P_TOPK, P_TOPP, P_MINP, P_PENALTY, P_WINDOW = range(6)
N_PARAMS = 8

# 1024 threads a block fit only at <= 64 registers a thread: launch_bounds makes the compiler keep
# to that (the simulator's jit takes no such option)
_kernel = cuda.jit if SIMULATOR else cuda.jit(launch_bounds=MAX_THREADS)


# ---- device helpers -----------------------------------------------------------------------

@device
def _unkey(k):
    """The float32 of a key."""
    if k >= 0x80000000:
        return bits_to_f32(np.uint32(k - 0x80000000))
    return bits_to_f32(np.uint32(np.int64(0xFFFFFFFF) - k))


@device
def _fixed(x, mx, scale):
    """exp(x - mx) in fixed point (floor of mass * scale), int64; x <= mx."""
    d = np.float64(x) - mx
    if d < _EXP_FLOOR:
        return np.int64(0)
    return np.int64(math.exp(d) * scale)


@device
def _weight(x, mx, temp):
    """exp((x - mx) / temp) in float64, 0 where that underflows (x <= mx, temp > 0; no overflow
    for temp = 1e-300)."""
    d = np.float64(x) - mx
    if d < _EXP_FLOOR * temp:
        return 0.0
    return math.exp(d / temp)


if SIMULATOR:
    @device
    def _syncwarp():
        cuda.syncthreads()  # the simulator has no syncwarp; every thread calls this (_scan)
else:
    @device
    def _syncwarp():
        cuda.syncwarp()


@device
def _scan(v, buf, tid, nt):
    """Block scan of one value a thread in a fixed order (the same bits every run) -> (exclusive,
    inclusive, total); buf [>= nt + 32]. Hillis-Steele within each warp of 32 (warp barriers),
    then over the warp totals (in buf[nt:]): two block barriers, not two a step. A thread's
    inclusive is the next thread's exclusive bit for bit (a warp's last thread takes the scanned
    total), so the ranges [excl, incl) tile [0, total) in float64 too. Every thread must call it."""
    lane = tid & 31
    w = tid >> 5
    nw = (nt + 31) >> 5
    last = min(nt, (w + 1) * 32) - 1  # the warp's last thread
    buf[tid] = v
    _syncwarp()
    off = 1
    while off < 32 and off < nt:
        x = buf[tid - off] if lane >= off else v - v
        _syncwarp()
        if lane >= off:
            buf[tid] += x
        _syncwarp()
        off *= 2
    inw = buf[tid]
    prev = buf[tid - 1] if lane > 0 else v - v
    if tid == last:
        buf[nt + w] = inw
    cuda.syncthreads()
    off = 1  # warp 0 scans the nw totals (the others only meet the warp barriers)
    while off < nw:
        x = buf[nt + lane - off] if w == 0 and off <= lane and lane < nw else v - v
        _syncwarp()
        if w == 0 and off <= lane and lane < nw:
            buf[nt + lane] += x
        _syncwarp()
        off *= 2
    cuda.syncthreads()
    base = buf[nt + w - 1] if w > 0 else v - v
    incl = buf[nt + w] if tid == last else base + inw
    excl = base + prev if lane > 0 else base
    total = buf[nt + nw - 1]
    cuda.syncthreads()
    return excl, incl, total


@device
def _radix(logits, row, V, tid, nt, need, thr, rem, mx, scale, hist, sh_i, misc):
    """The key t at which the running weight of the descending order reaches `need`, and the
    weight `above` of the keys > t (so above < need <= above + weight of t's elements).
    scale == 0: every element weighs 1 (t is the need-th largest key). Else an element weighs
    _fixed(l, mx, scale), and only keys > thr count, plus rem elements of key thr (a top-k bound:
    its lowest-indexed ties). Four passes of 8 bits over shared int64 histograms hist [256];
    sh_i [>= nt]: scan space."""
    prefix = np.int64(0)
    above = np.int64(0)
    for p in range(4):
        shift = 24 - 8 * p
        for b in range(tid, 256, nt):
            hist[b] = 0
        cuda.syncthreads()
        for i in range(tid, V, nt):
            k = order_key(logits[row, i])
            if k > thr and (k >> (shift + 8)) == (prefix >> (shift + 8)):
                w = np.int64(1) if scale == 0 else _fixed(logits[row, i], mx, scale)
                if w > 0:
                    cuda.atomic.add(hist, (k >> shift) & 255, w)
        if tid == 0 and rem > 0 and (thr >> (shift + 8)) == (prefix >> (shift + 8)):
            w = np.int64(1) if scale == 0 else _fixed(_unkey(thr), mx, scale)
            cuda.atomic.add(hist, (thr >> shift) & 255, rem * w)
        cuda.syncthreads()
        b, above = _find_bin(hist, need, above, tid, nt, sh_i, misc)
        prefix = prefix | (b << shift)
    cuda.syncthreads()
    return prefix, above


@device
def _count_above(logits, row, n, key, tid, nt, sh_i):
    """How many of logits[row, :n] have a key above `key` (every thread). Every thread must call it."""
    c = np.int64(0)
    for i in range(tid, n, nt):
        if order_key(logits[row, i]) > key:
            c += 1
    excl, incl, total = _scan(c, sh_i, tid, nt)
    return total


@device
def _find_bin(hist, need, above, tid, nt, sh_i, misc):
    """The highest bin b of hist [256] at which above + the sum of hist[255..b] reaches need
    (bin 0 if none does) and -> (b, above + the sum of hist[255..b+1]). Each thread sums a
    contiguous run of bins (descending) and a block scan finds the run that crosses; only
    that thread walks its bins. Every thread must call it."""
    per = (256 + nt - 1) // nt
    top = 255 - tid * per  # this thread's bins: top down to bottom
    bottom = max(top - per + 1, 0)
    s = np.int64(0)
    for b in range(bottom, top + 1):
        s += hist[b]
    excl, incl, total = _scan(s, sh_i, tid, nt)
    if top >= 0 and above + excl < need and need <= above + incl:
        a = above + excl
        b = top
        while b > bottom and a + hist[b] < need:
            a += hist[b]
            b -= 1
        misc[0] = b
        misc[1] = a
    if tid == 0 and above + total < need:  # no bin reaches need: bin 0, as a walk from 255 ends
        misc[0] = 0
        misc[1] = above + total - hist[0]
    cuda.syncthreads()
    b = misc[0]
    a = misc[1]
    cuda.syncthreads()
    return b, a


@device
def _before(ka, ia, kb, ib):
    """(key a, index a) comes before (key b, index b): key desc, index asc."""
    return ka > kb or (ka == kb and ia < ib)


@device
def _cx(sh_k, sh_x, i, p, best_first):
    """Orders the shared pairs at i < p: the better (key desc, index asc) first when best_first,
    else last."""
    ka, ia, kb, ib = np.int64(sh_k[i]), sh_x[i], np.int64(sh_k[p]), sh_x[p]
    if best_first:
        swap = _before(kb, ib, ka, ia)
    else:
        swap = _before(ka, ia, kb, ib)
    if swap:
        sh_k[i], sh_k[p] = sh_k[p], sh_k[i]
        sh_x[i], sh_x[p] = sh_x[p], sh_x[i]


@device
def _bitonic(sh_k, sh_x, P, tid, nt, upto):
    """The phases of size 2..upto (powers of 2, upto <= P) of a bitonic sort of P shared (key,
    index) pairs: runs of upto in order, run r best first when r is even, else last (upto = P:
    sorted, best first). A thread takes pairs q = tid, tid + nt, ... of each stage. Every thread
    must call it."""
    size = 2
    while size <= upto:
        stride = size // 2
        while stride > 0:
            for q in range(tid, P // 2, nt):
                i = ((q & ~(stride - 1)) << 1) | (q & (stride - 1))  # pair (i, i + stride)
                _cx(sh_k, sh_x, i, i + stride, (i & size) == 0)
            cuda.syncthreads()
            stride //= 2
        size *= 2


@device
def _best_sorted(sh_k, sh_x, P, U, tid, nt):
    """The best U (a power of 2 <= P) of P shared pairs into [0, U), best first: a bitonic top-k.
    Runs of U are sorted (alternate directions), then each round pairs runs 2r (best first) and
    2r + 1 (best last): the better of their i-th entries, over i, is a bitonic run holding the
    best U of both, merged into order in place of run 2r. Each round halves the runs, so the
    work is ~1/3 of sorting all P when U << P. Every thread must call it."""
    _bitonic(sh_k, sh_x, P, tid, nt, U)
    half = U // 2
    sp = U  # the live runs start at multiples of sp
    while sp < P:
        R2 = P // (2 * sp)  # pairs of runs this round
        for q in range(tid, R2 * U, nt):
            r = q // U
            a = 2 * r * sp + (q - r * U)
            b = a + sp
            if _before(np.int64(sh_k[b]), sh_x[b], np.int64(sh_k[a]), sh_x[a]):
                sh_k[a] = sh_k[b]
                sh_x[a] = sh_x[b]
        cuda.syncthreads()
        sp *= 2
        stride = half
        while stride > 0:
            for q in range(tid, R2 * half, nt):
                r = q // half
                j = q - r * half
                i = r * sp + (((j & ~(stride - 1)) << 1) | (j & (stride - 1)))
                _cx(sh_k, sh_x, i, i + stride, (r & 1) == 0)
            cuda.syncthreads()
            stride //= 2


@device
def _block_best(k, i, sh_k, sh_x, tid, nt):
    """(key, index) of the block's best pair (key desc, index asc), in every thread; sh_k, sh_x
    [>= nt]. Every thread must call it."""
    sh_k[tid] = np.uint32(k)
    sh_x[tid] = i
    cuda.syncthreads()
    s = nt // 2
    while s > 0:
        if tid < s:
            ok = np.int64(sh_k[tid + s])
            oi = sh_x[tid + s]
            if _before(ok, oi, np.int64(sh_k[tid]), sh_x[tid]):
                sh_k[tid] = np.uint32(ok)
                sh_x[tid] = oi
        cuda.syncthreads()
        s //= 2
    k = np.int64(sh_k[0])
    i = sh_x[0]
    cuda.syncthreads()
    return k, i


# ---- the kernels: phase 1 (many blocks a row), phase 2 (one block a row) ---------------------

@device
def _multi_chunk(topk, V, sort_max, chunk, C, cap):
    """Whether a row's top-k goes through the phase-1 candidates (C * min(k, chunk) of them fit
    the scratch) rather than the one-block path over the whole row."""
    return topk > 0 and topk < V and topk <= sort_max and C * min(topk, chunk) <= cap


@device
def _take(x, i, n, lo, flag, bk, bi, sh_k, sh_x):
    """Phase 1's look at entry i of its chunk (x: its logit; i >= n: padding, key 0, sorts last):
    -> (flag, best key, its index) updated (a thread's i rise: the first of equal keys stays);
    the key and index into shared memory."""
    kk = np.int64(0)
    if i < n:
        if math.isnan(x) or math.isinf(x):
            flag = 1
        else:
            kk = order_key(x)
        if kk > bk:
            bk = kk
            bi = lo + i
    sh_k[i] = np.uint32(kk)
    sh_x[i] = lo + i if i < n else _INT_MAX
    return flag, bk, bi


@_kernel
def _chunks(logits, slots, params, ring, ringpos, scratch, best, bad, cand_v, cand_i, chunk, sort_max):
    """Phase 1, block (c, row) on logits [row, c*chunk : (c+1)*chunk): the repeat penalty of the
    ring tokens in that range (in place), the non-finite flag -> bad[slot, c], the first index
    of the maximum -> best[slot, c], and, for a top-k row (_multi_chunk), the chunk's first
    m = min(k, chunk) of the order (key desc, index asc) -> cand_v/cand_i[slot, c*m : (c+1)*m]
    (values as the float32 of their key, -inf / -1 past the chunk's end).
    best, bad: int32 [N, C]; cand_v: f32 [N, cap]; cand_i: int32 [N, cap]. Grid (C, S)."""
    c = cuda.blockIdx.x
    row = cuda.blockIdx.y
    tid = cuda.threadIdx.x
    nt = cuda.blockDim.x
    C = cuda.gridDim.x
    V = logits.shape[1]
    slot = slots[row]
    sh_k = cuda.shared.array(CHUNK_MAX, np.uint32)
    sh_x = cuda.shared.array(CHUNK_MAX, np.int32)
    rk = cuda.shared.array(MAX_THREADS, np.uint32)  # the block's best (sh_k/sh_x hold the chunk)
    ri = cuda.shared.array(MAX_THREADS, np.int32)
    if slot < 0:
        return
    lo = c * chunk
    hi = min(lo + chunk, V)
    n = hi - lo

    # repeat penalty of the ring tokens in [lo, hi): every entry reads the unmodified logit,
    # barrier, writes (duplicates write the same value); non-finite values are left for the flag
    wn = np.int32(params[slot, P_WINDOW])
    filled = ringpos[slot, 1]
    if wn > 0 and filled > 0:
        pen = params[slot, P_PENALTY]
        for j in range(tid, filled, nt):
            t = ring[slot, j]
            if t >= lo and t < hi:
                x = logits[row, t]
                v = np.float64(x)
                r = v
                if v > 0:
                    r = _FLT_MAX if pen == 0 else v / pen
                elif v < 0:
                    r = v * pen
                if math.isnan(x) or math.isinf(x):
                    scratch[slot, j] = x
                else:
                    scratch[slot, j] = np.float32(min(max(r, -_FLT_MAX), _FLT_MAX))
        cuda.syncthreads()
        for j in range(tid, filled, nt):
            t = ring[slot, j]
            if t >= lo and t < hi:
                logits[row, t] = scratch[slot, j]
        cuda.syncthreads()

    P = 1
    while P < n:
        P *= 2
    flag = 0
    bk = np.int64(0)
    bi = _INT_MAX
    for i in range(tid, P, 4 * nt):  # coalesced, four loads in flight a thread (unguarded)
        j1 = i + nt
        j2 = j1 + nt
        j3 = j2 + nt
        x0 = logits[row, lo + min(i, n - 1)]
        x1 = logits[row, lo + min(j1, n - 1)]
        x2 = logits[row, lo + min(j2, n - 1)]
        x3 = logits[row, lo + min(j3, n - 1)]
        flag, bk, bi = _take(x0, i, n, lo, flag, bk, bi, sh_k, sh_x)
        if j1 < P:
            flag, bk, bi = _take(x1, j1, n, lo, flag, bk, bi, sh_k, sh_x)
        if j2 < P:
            flag, bk, bi = _take(x2, j2, n, lo, flag, bk, bi, sh_k, sh_x)
        if j3 < P:
            flag, bk, bi = _take(x3, j3, n, lo, flag, bk, bi, sh_k, sh_x)
    if cuda.syncthreads_or(flag):
        if tid == 0:
            bad[slot, c] = 1
        return
    bk, bi = _block_best(bk, bi, rk, ri, tid, nt)
    if tid == 0:
        bad[slot, c] = 0
        best[slot, c] = bi

    topk = np.int64(params[slot, P_TOPK])
    if params[slot, P_TEMP] > 0 and _multi_chunk(topk, V, sort_max, chunk, C, cand_v.shape[1]):
        m = min(topk, chunk)
        U = 1
        while U < m and U < P:
            U *= 2
        _best_sorted(sh_k, sh_x, P, U, tid, nt)
        for j in range(tid, m, nt):
            if j < n:
                cand_v[slot, c * m + j] = _unkey(np.int64(sh_k[j]))
                cand_i[slot, c * m + j] = sh_x[j]
            else:
                cand_v[slot, c * m + j] = -np.inf
                cand_i[slot, c * m + j] = -1


@_kernel
def _finish(logits, slots, params, rng, ring, ringpos, best, bad, cand_v, cand_i, masked, tokens, flags, chunk,
            sort_max, scale):
    """Phase 2, one block a row, after _chunks: the flag, the maximum (greedy), else the
    candidates (phase 1's for a top-k row, else the one-block paths over the penalized row),
    top-p, min-p, temperature and the draw; the token into tokens[row] and the slot's ring.
    Grid S, block T."""
    row = cuda.blockIdx.x
    tid = cuda.threadIdx.x
    nt = cuda.blockDim.x
    V = logits.shape[1]
    C = best.shape[1]
    slot = slots[row]
    sh_i = cuda.shared.array(_SCAN_SIZE, np.int64)  # int scans
    sh_f = cuda.shared.array(_SCAN_SIZE, np.float64)  # float scans
    sh_k = cuda.shared.array(MAX_THREADS, np.uint32)  # sorted candidates: keys
    sh_x = cuda.shared.array(MAX_THREADS, np.int32)  # sorted candidates: indices
    hist = cuda.shared.array(256, np.int64)
    misc = cuda.shared.array(4, np.int64)
    u_sh = cuda.shared.array(1, np.float64)
    if slot < 0:  # the whole block leaves: no barrier is skipped by some threads only
        if tid == 0:
            tokens[row] = 0
            flags[row] = 0
        return

    flag = 0
    bk = np.int64(0)
    bi = _INT_MAX
    for c in range(tid, C, nt):
        if bad[slot, c] != 0:
            flag = 1
        else:
            i = best[slot, c]
            kk = order_key(logits[row, i])
            if kk > bk:  # chunks rise with c: the first of equal keys stays
                bk = kk
                bi = i
    if cuda.syncthreads_or(flag):
        if tid == 0:
            tokens[row] = 0
            flags[row] = 1
        return
    bk, token = _block_best(bk, bi, sh_k, sh_x, tid, nt)
    token = np.int64(token)
    mx = np.float64(logits[row, token])

    temp = params[slot, P_TEMP]
    if temp > 0:
        topk = np.int64(params[slot, P_TOPK])
        topp = params[slot, P_TOPP]
        minp = params[slot, P_MINP]
        if tid == 0:
            u_sh[0] = xoroshiro128p_uniform_float64(rng, slot)
            misc[2] = -1  # the drawn token
            misc[3] = 0  # candidates gathered / the cut
        cuda.syncthreads()
        u = u_sh[0]
        multi = _multi_chunk(topk, V, sort_max, chunk, C, cand_v.shape[1])  # phase 1's choice, kept
        nc = C * min(topk, chunk)  # phase 1's candidates a row, when multi
        lowest = np.int64(0)  # keys at or below it are no candidates
        if masked[slot] != 0 and topk > 0 and topk < V:
            # a grammar's row: ~V MASKED logits tie, and a top-k reaching them would send them all
            # to one histogram bin (serialized atomics: ~0.4 ms a step at V = 201k). They weigh 0
            # in any draw, so the top-k stops at the allowed tokens: the same distribution
            if multi:
                allowed = _count_above(cand_v, slot, nc, _MASKED_KEY, tid, nt, sh_i)
            else:
                allowed = _count_above(logits, row, V, _MASKED_KEY, tid, nt, sh_i)
            if allowed > 0:
                lowest = np.int64(_MASKED_KEY)
                topk = min(topk, allowed)
        if multi:
            # phase 1's candidates in chunk order: equal keys lie in index order, so positions
            # order ties as indices do, and the one-block sorted path runs on them unchanged
            thr, above = _radix(cand_v, slot, nc, tid, nt, topk, lowest, np.int64(0), mx, 0.0,
                                hist, sh_i, misc)
            cc = (nc + nt - 1) // nt
            lo = min(tid * cc, nc)
            hi = min(lo + cc, nc)
            pos = _sorted_path(cand_v, slot, tid, nt, lo, hi, thr, topk - above, topk, topp, minp, temp,
                               u, sh_i, sh_f, sh_k, sh_x, misc)
            token = np.int64(cand_i[slot, pos])
        else:
            thr = lowest  # no top-k bound: every key above it is a candidate
            rem = np.int64(0)
            if topk > 0 and topk < V:
                thr, above = _radix(logits, row, V, tid, nt, topk, lowest, np.int64(0), mx, 0.0,
                                    hist, sh_i, misc)
                rem = topk - above  # ties of key thr to take, lowest index first
            cw = (V + nt - 1) // nt  # contiguous index ranges, for scans in index order
            lo = min(tid * cw, V)
            hi = min(lo + cw, V)
            if topk > 0 and topk < V and topk <= sort_max:
                token = _sorted_path(logits, row, tid, nt, lo, hi, thr, rem, topk, topp, minp, temp, u,
                                     sh_i, sh_f, sh_k, sh_x, misc)
            else:
                token = _unsorted_path(logits, row, tid, nt, V, lo, hi, thr, rem, mx, topp, minp, temp, u,
                                       scale, sh_i, sh_f, hist, misc)

    if tid == 0:
        tokens[row] = token
        flags[row] = 0
        wn = np.int32(params[slot, P_WINDOW])
        if wn > 0:
            filled = ringpos[slot, 1]
            pos = ringpos[slot, 0]
            ring[slot, pos] = token
            ringpos[slot, 0] = (pos + 1) % wn
            ringpos[slot, 1] = min(filled + 1, wn)


# ---- the one-block kernel (before phase 1 and 2; benchmarks compare) -------------------------

@_kernel
def _sample_rows_single(logits, slots, params, rng, ring, ringpos, scratch, tokens, flags, sort_max, scale):
    """logits: f32 [S, V] (overwritten); slots: int32 [S] (< 0: a padding row, left alone);
    params: f64 [N, 8]; rng: xoroshiro128p [N]; ring: int32 [N, W]; ringpos: int32 [N, 2] (next
    write, filled); scratch: f32 [N, W]; tokens, flags: int32 [>= S]. Grid S, block T."""
    row = cuda.blockIdx.x
    tid = cuda.threadIdx.x
    nt = cuda.blockDim.x
    V = logits.shape[1]
    slot = slots[row]
    sh_i = cuda.shared.array(_SCAN_SIZE, np.int64)  # int scans
    sh_f = cuda.shared.array(_SCAN_SIZE, np.float64)  # float scans
    sh_v = cuda.shared.array(MAX_THREADS, np.float32)  # argmax values
    sh_k = cuda.shared.array(MAX_THREADS, np.uint32)  # sorted candidates: keys
    sh_x = cuda.shared.array(MAX_THREADS, np.int32)  # sorted candidates: indices
    hist = cuda.shared.array(256, np.int64)
    misc = cuda.shared.array(4, np.int64)
    u_sh = cuda.shared.array(1, np.float64)
    if slot < 0:  # the whole block leaves: no barrier is skipped by some threads only
        if tid == 0:
            tokens[row] = 0
            flags[row] = 0
        return

    bad = 0
    for i in range(tid, V, nt):
        x = logits[row, i]
        if math.isnan(x) or math.isinf(x):
            bad = 1
    if cuda.syncthreads_or(bad):
        if tid == 0:
            tokens[row] = 0
            flags[row] = 1
        return

    # repeat penalty over the ring (the last tokens of history)
    wn = np.int32(params[slot, P_WINDOW])
    filled = ringpos[slot, 1]
    if wn > 0 and filled > 0:
        pen = params[slot, P_PENALTY]  # the penalty rounded to float32, held as float64
        for j in range(tid, filled, nt):
            t = ring[slot, j]
            if t >= 0 and t < V:
                v = np.float64(logits[row, t])
                r = v
                if v > 0:
                    r = _FLT_MAX if pen == 0 else v / pen
                elif v < 0:
                    r = v * pen
                scratch[slot, j] = np.float32(min(max(r, -_FLT_MAX), _FLT_MAX))
        cuda.syncthreads()
        for j in range(tid, filled, nt):
            t = ring[slot, j]
            if t >= 0 and t < V:
                logits[row, t] = scratch[slot, j]
        cuda.syncthreads()

    # the maximum, first index among equals (the greedy token; max is every mass's reference)
    bv = np.float32(-np.inf)
    bi = _INT_MAX
    for i in range(tid, V, nt):
        x = logits[row, i]
        if x > bv:
            bv = x
            bi = i
    sh_v[tid] = bv
    sh_i[tid] = bi
    cuda.syncthreads()
    s = nt // 2
    while s > 0:
        if tid < s:
            ov = sh_v[tid + s]
            oi = sh_i[tid + s]
            if ov > sh_v[tid] or (ov == sh_v[tid] and oi < sh_i[tid]):
                sh_v[tid] = ov
                sh_i[tid] = oi
        cuda.syncthreads()
        s //= 2
    mx = np.float64(sh_v[0])
    token = sh_i[0]
    cuda.syncthreads()

    temp = params[slot, P_TEMP]
    if temp > 0:
        topk = np.int64(params[slot, P_TOPK])
        topp = params[slot, P_TOPP]
        minp = params[slot, P_MINP]
        if tid == 0:
            u_sh[0] = xoroshiro128p_uniform_float64(rng, slot)
            misc[2] = -1  # the drawn token
            misc[3] = 0  # candidates gathered / the cut
        cuda.syncthreads()
        u = u_sh[0]
        thr = np.int64(0)  # no top-k bound: every key (> 0) is a candidate
        rem = np.int64(0)
        if topk > 0 and topk < V:
            thr, above = _radix(logits, row, V, tid, nt, topk, np.int64(0), np.int64(0), mx, 0.0, hist, sh_i, misc)
            rem = topk - above  # ties of key thr to take, lowest index first
        chunk = (V + nt - 1) // nt  # contiguous index ranges, for scans in index order
        lo = min(tid * chunk, V)
        hi = min(lo + chunk, V)
        if topk > 0 and topk < V and topk <= sort_max:
            token = _sorted_path(logits, row, tid, nt, lo, hi, thr, rem, topk, topp, minp, temp, u,
                                 sh_i, sh_f, sh_k, sh_x, misc)
        else:
            token = _unsorted_path(logits, row, tid, nt, V, lo, hi, thr, rem, mx, topp, minp, temp, u,
                                   scale, sh_i, sh_f, hist, misc)

    if tid == 0:
        tokens[row] = token
        flags[row] = 0
        if wn > 0:
            pos = ringpos[slot, 0]
            ring[slot, pos] = token
            ringpos[slot, 0] = (pos + 1) % wn
            ringpos[slot, 1] = min(filled + 1, wn)


@device
def _tie_base(logits, row, tid, nt, lo, hi, t, sh_i):
    """How many elements of key t lie before this thread's range [lo, hi) (index order)."""
    n = np.int64(0)
    for i in range(lo, hi):
        if order_key(logits[row, i]) == t:
            n += 1
    excl, incl, total = _scan(n, sh_i, tid, nt)
    return excl


@device
def _sorted_path(logits, row, tid, nt, lo, hi, thr, rem, k, topp, minp, temp, u, sh_i, sh_f, sh_k, sh_x, misc):
    """top-k (k <= 1024) gathered and sorted in shared memory, then top-p, min-p and the draw over
    that list, best first, as the CPU does. -> the token (every thread)."""
    base = _tie_base(logits, row, tid, nt, lo, hi, thr, sh_i)
    for i in range(lo, hi):
        kk = order_key(logits[row, i])
        take = kk > thr
        if kk == thr:
            take = base < rem
            base += 1
        if take:
            at = cuda.atomic.add(misc, 3, 1)
            sh_k[at] = np.uint32(kk)
            sh_x[at] = i
    P = 1
    while P < k:
        P *= 2
    for i in range(k + tid, P, nt):  # padding sorts last
        sh_k[i] = 0
        sh_x[i] = _INT_MAX
    cuda.syncthreads()
    _bitonic(sh_k, sh_x, P, tid, nt, P)

    # probabilities at temperature 1 over the k candidates (unnormalized: exp(cand - cand0))
    c0 = np.float64(logits[row, sh_x[0]])
    cchunk = (k + nt - 1) // nt
    clo = min(tid * cchunk, k)
    chi = min(clo + cchunk, k)
    local = 0.0
    for i in range(clo, chi):
        e = math.exp(np.float64(logits[row, sh_x[i]]) - c0)
        local += e
    excl, incl, total = _scan(local, sh_f, tid, nt)
    if tid == 0:
        misc[3] = k
    cuda.syncthreads()
    if topp < 1.0:  # keep up to the first i whose cumulative probability reaches top_p
        run = excl
        for i in range(clo, chi):
            run += math.exp(np.float64(logits[row, sh_x[i]]) - c0)
            if run / total >= topp:
                cuda.atomic.min(misc, 3, i + 1)
                break
    if minp > 0:  # probs[i] >= min_p * probs[0]: a prefix (probs fall along the order)
        p0 = 1.0 / total
        for i in range(clo, chi):
            if math.exp(np.float64(logits[row, sh_x[i]]) - c0) / total < minp * p0:
                cuda.atomic.min(misc, 3, i)
                break
    cuda.syncthreads()
    n = misc[3]
    chi = min(chi, n)
    clo = min(clo, chi)
    local = 0.0
    for i in range(clo, chi):
        local += _weight(logits[row, sh_x[i]], c0, temp)
    excl, incl, total = _scan(local, sh_f, tid, nt)
    target = u * total
    if excl <= target and target < incl:  # the ranges' [excl, incl) tile [0, total)
        run = excl
        pick = chi - 1
        for i in range(clo, chi):
            run += _weight(logits[row, sh_x[i]], c0, temp)
            if run > target:
                pick = i
                break
        misc[2] = pick
    cuda.syncthreads()
    pick = misc[2]
    if pick < 0:  # u * total rounded up to total
        pick = n - 1
    token = np.int64(sh_x[pick])
    cuda.syncthreads()
    return token


@device
def _unsorted_path(logits, row, tid, nt, V, lo, hi, thr, rem, mx, topp, minp, temp, u, scale, sh_i, sh_f, hist, misc):
    """No sort: the candidates are keys > t plus the j lowest-indexed of key t, bounded by top-k
    (thr, rem) and top-p (a radix select on fixed-point masses), and min-p (a mass bound); the
    draw walks them in index order. -> the token (every thread)."""
    t = thr
    j = rem
    if topp < 1.0:
        # total mass of the top-k candidates (all keys when thr == 0): the first pass's histogram
        tot = np.int64(0)
        for i in range(tid, V, nt):
            if order_key(logits[row, i]) > thr:
                tot += _fixed(logits[row, i], mx, scale)
        excl, incl, total = _scan(tot, sh_i, tid, nt)
        if rem > 0:
            total += rem * _fixed(_unkey(thr), mx, scale)
        want = topp * np.float64(total)
        need = np.int64(want)
        if np.float64(need) < want:
            need += 1
        need = max(np.int64(1), min(need, total))
        t, above = _radix(logits, row, V, tid, nt, need, thr, rem, mx, scale, hist, sh_i, misc)
        e = max(np.int64(1), _fixed(_unkey(t), mx, scale))  # > 0: t's bin held mass
        j = (need - above + e - 1) // e
    base0 = _tie_base(logits, row, tid, nt, lo, hi, t, sh_i)
    base = base0
    local = 0.0
    last = np.int64(-1)
    for i in range(lo, hi):
        x = logits[row, i]
        kk = order_key(x)
        take = kk > t
        if kk == t:
            take = base < j
            base += 1
        if take and minp > 0:
            take = math.exp(np.float64(x) - mx) >= minp
        if take:
            local += _weight(x, mx, temp)
            last = i
    excl, incl, total = _scan(local, sh_f, tid, nt)
    if tid == 0:
        misc[3] = -1
    cuda.syncthreads()
    cuda.atomic.max(misc, 3, last)
    target = u * total
    if excl <= target and target < incl:
        base = base0
        run = excl
        pick = last
        for i in range(lo, hi):
            x = logits[row, i]
            kk = order_key(x)
            take = kk > t
            if kk == t:
                take = base < j
                base += 1
            if take and minp > 0:
                take = math.exp(np.float64(x) - mx) >= minp
            if take:
                run += _weight(x, mx, temp)
                if run > target:
                    pick = i
                    break
        misc[2] = pick
    cuda.syncthreads()
    token = misc[2]
    if token < 0:  # u * total rounded up to total: the last candidate
        token = misc[3]
    cuda.syncthreads()
    return token


# ---- host side ----------------------------------------------------------------------------

def _splitmix64(x: int) -> tuple[int, int]:
    """One splitmix64 step: (next state, output), in Python ints mod 2**64."""
    m = (1 << 64) - 1
    x = (x + 0x9E3779B97F4A7C15) & m
    z = x
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & m
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & m
    return x, z ^ (z >> 31)


def xoroshiro_state(seed: int) -> np.ndarray:
    """A xoroshiro128+ state [1] from a 64-bit seed: two splitmix64 outputs (as its authors
    advise; never all zero)."""
    x, s0 = _splitmix64(seed)
    _, s1 = _splitmix64(x)
    st = np.zeros(1, xoroshiro128p_dtype)
    st[0]["s0"], st[0]["s1"] = s0, s1
    return st


def _h2d(dst: int, src: int, nbytes: int, stream) -> None:
    """cuMemcpyHtoDAsync on `stream` (a numba stream or 0)."""
    from cuda.bindings import driver

    handle = int(stream.handle) if stream else 0
    err, = driver.cuMemcpyHtoDAsync(dst, src, nbytes, handle)
    if err != driver.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"cuMemcpyHtoDAsync: {err}")


@cuda.jit
def _apply_masks(logits, slots, masked, masks):
    """Grid (ceil(V / threads), S): thread t of row r sets logit t to MASKED where the row's slot
    has a grammar mask (masked[slot] != 0) and bit t % 32 of its word t // 32 is unset: a token
    a thread, so the writes are coalesced (a word a thread, 32 strided writes each, took 0.4 ms a
    step at V = 201k). Rows of other slots, and padding rows, return at once."""
    r = cuda.blockIdx.y
    t = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    slot = slots[r]
    if slot < 0 or masked[slot] == 0 or t >= logits.shape[1]:
        return
    if (masks[slot, t >> 5] >> (t & 31)) & 1 == 0:
        logits[r, t] = MASKED


class SamplerSlots:
    """Device pools of per-sequence sampling state, indexed by slot:
    params f64 [N, 8] (temperature, top_k, top_p, min_p, penalty as float32, window, -, -),
    rng xoroshiro128p [N], ring int32 [N, W] (the last `window` tokens of history, a ring),
    ringpos int32 [N, 2] (next write, filled), scratch f32 [N, W] (the penalty's two phases).

    assign(), set_history() and release() run between steps (they copy on the given stream, from
    pageable host memory); growing N or W reallocates every pool (existing slots keep their state;
    no step may be in flight) and bumps `generation`. `stream`: the one the sampler's launches and
    copies are queued on (None: pools made on the legacy stream, complete when made)."""

    def __init__(self, capacity: int = 16, width: int = 64, stream=None):
        capacity = max(1, capacity)
        self.stream = stream
        self.generation = 0
        self._free = list(range(capacity))
        self._window: dict[int, int] = {}  # slot -> its repeat window (0: no penalty)
        self.masks = None  # int32 [N, ceil(V / 32)]: each slot's grammar mask, made at the first set_mask
        self.masked = None  # int32 [N]: 1 where the slot's mask applies
        self._masked_slots: set[int] = set()
        self._alloc(capacity, max(1, width))

    @property
    def capacity(self) -> int:
        return self.params.shape[0]

    @property
    def width(self) -> int:
        return self.ring.shape[1]

    def _alloc(self, n: int, w: int) -> None:
        old = None
        if hasattr(self, "params"):
            cuda.synchronize()  # the draws that advanced these states ran on another stream
            old = [a.copy_to_host() for a in (self.params, self.rng, self.ring, self.ringpos)]
        params = np.zeros((n, N_PARAMS), np.float64)
        rng = np.zeros(n, xoroshiro128p_dtype)
        ring = np.zeros((n, w), np.int32)
        ringpos = np.zeros((n, 2), np.int32)
        if old is not None:
            n0, w0 = old[2].shape
            params[:n0], rng[:n0], ring[:n0, :w0], ringpos[:n0] = old[0], old[1], old[2], old[3]
        self.params, self.rng, self.ring, self.ringpos = (upload(a, self.stream) for a in (params, rng, ring, ringpos))
        self.scratch = cuda.device_array((n, w), np.float32)
        self._unmasked = upload(np.zeros(n, np.int32), self.stream)  # mask_flags before any mask
        if self.masks is not None:  # the masks grow with N (a grown pool's graphs are captured again)
            masks, masked = np.zeros((n, self.masks.shape[1]), np.int32), np.zeros(n, np.int32)
            n0 = self.masks.shape[0]
            masks[:n0], masked[:n0] = self.masks.copy_to_host(), self.masked.copy_to_host()
            self.masks, self.masked = upload(masks, self.stream), upload(masked, self.stream)
            self._staging = cuda.pinned_array(masks.shape, np.int32)
        key = getattr(self, "_chunk_key", None)
        self._chunk_key = None
        if key is not None:  # phase 1's scratch at the new N now, not in a launch (maybe captured)
            self.chunk_scratch(*key[1:], bump=False)

    def chunk_scratch(self, C: int, cap: int, bump: bool = True):
        """Phase 1's outputs, by slot: (best, bad int32 [N, C], cand_v f32 [N, cap], cand_i int32
        [N, cap]). Made on the first launch and kept (growing N makes them again at once); another
        C or cap makes them again and bumps `generation` (a graph holding the old ones must be
        captured again)."""
        n = self.capacity
        key = (n, C, cap)
        if self._chunk_key != key:
            if self._chunk_key is not None and bump:
                self.generation += 1
            self._chunk_key = key
            self._chunk = (cuda.device_array((n, C), np.int32), cuda.device_array((n, C), np.int32),
                           cuda.device_array((n, cap), np.float32), cuda.device_array((n, cap), np.int32))
        return self._chunk

    def assign(self, options, history: list[int], max_history: int, stream=0) -> int:
        """A slot for a sequence with these options (ipc.protocol.SamplingOptions), whose history
        so far is `history` and never exceeds max_history tokens. -> the slot."""
        o = options
        window = min(o.repeat_last_n, max_history) if o.repeat_penalty != 1.0 else 0
        if not self._free or window > self.width:
            n = self.capacity * 2 if not self._free else self.capacity
            w = max(self.width, window) if window <= self.width else max(window, 2 * self.width)
            self._free += list(range(self.capacity, n))
            heapq.heapify(self._free)
            self._alloc(n, w)
            self.generation += 1
        slot = heapq.heappop(self._free)
        with np.errstate(over="ignore", under="ignore"):
            penalty = float(np.float32(o.repeat_penalty))  # 0 or inf where it rounds so
        params = np.zeros((1, N_PARAMS), np.float64)
        top_k = min(o.top_k, _INT_MAX)  # >= V is "all" anyway; the kernel reads it as an integer
        params[0, :6] = (o.temperature, top_k, o.top_p, o.min_p, penalty, window)
        seed = secrets.randbits(64) if o.seed is None else o.seed
        self._window[slot] = window
        self.params[slot:slot + 1].copy_to_device(params, stream=stream)
        self.rng[slot:slot + 1].copy_to_device(xoroshiro_state(seed), stream=stream)
        self.set_history(slot, history, stream)
        return slot

    def set_history(self, slot: int, history: list[int], stream=0) -> None:
        """Replaces the slot's ring by the tail of `history` (for a sequence whose tokens were not
        all sampled here: sample_rows appends only the tokens it draws)."""
        window = self._window[slot]
        tail = history[-window:] if window else []
        ring = np.zeros((1, self.width), np.int32)
        ring[0, :len(tail)] = tail
        pos = np.array([[len(tail) % window if window else 0, len(tail)]], np.int32)
        self.ring[slot:slot + 1].copy_to_device(ring, stream=stream)
        self.ringpos[slot:slot + 1].copy_to_device(pos, stream=stream)

    def set_mask(self, slot: int, mask: np.ndarray | None, stream=0) -> None:
        """The tokens the slot may draw next (int32 [ceil(V / 32)], daemon.grammar's layout), or
        None: any. Between steps, as assign. The first mask makes the pools (bumping `generation`:
        graphs captured before hold no mask kernel)."""
        if mask is None:
            if slot in self._masked_slots:
                self._masked_slots.discard(slot)
                self.masked[slot:slot + 1].copy_to_device(np.zeros(1, np.int32), stream=stream)
            return
        mask = np.asarray(mask, np.int32).reshape(-1)
        self.mask_row(slot, mask.shape[0])[:] = mask
        self.push_mask(slot, stream)

    def mask_flags(self):
        """int32 [N]: 1 where the slot's grammar mask applies (all 0 before the first mask)."""
        return self._unmasked if self.masked is None else self.masked

    def mask_row(self, slot: int, words: int) -> np.ndarray:
        """The slot's mask in page-locked host memory (int32 [words]), to fill before push_mask.
        The first call (or another vocabulary) makes the pools and bumps `generation`."""
        if self.masks is None or self.masks.shape[1] != words:
            if self.masks is not None:
                cuda.synchronize()
            self.masks = upload(np.zeros((self.capacity, words), np.int32), self.stream)
            self.masked = upload(np.zeros(self.capacity, np.int32), self.stream)
            # pinned: the copy is queued behind the step in flight instead of waiting for it. A row
            # is rewritten only after the step that read it has returned its tokens.
            self._staging = cuda.pinned_array(self.masks.shape, np.int32)
            self._masked_slots.clear()
            self.generation += 1
        return self._staging[slot]

    def push_mask(self, slot: int, stream=0) -> None:
        """mask_row(slot) to the device, queued on `stream`; the slot's mask applies from then on."""
        row = self._staging[slot]
        if SIMULATOR:
            self.masks[slot:slot + 1].copy_to_device(row.reshape(1, -1), stream=stream)
        else:  # one driver call: numba's slicing and copy cost ~100 us of Python a step
            _h2d(int(self.masks.device_ctypes_pointer.value) + slot * row.nbytes, row.ctypes.data, row.nbytes,
                 stream)
        if slot not in self._masked_slots:
            self._masked_slots.add(slot)
            self.masked[slot:slot + 1].copy_to_device(np.ones(1, np.int32), stream=stream)

    def release(self, slot: int) -> None:
        if not 0 <= slot < self.capacity or slot in self._free:
            raise ValueError(f"SamplerSlots.release: slot {slot} is not assigned")
        self.set_mask(slot, None, self.stream or 0)
        self._window.pop(slot, None)
        heapq.heappush(self._free, slot)


def sample_rows(logits, slots, pool: SamplerSlots, tokens_out, flags_out, stream=0,
                threads: int = MAX_THREADS, sort_max: int = MAX_THREADS, chunk: int = CHUNK,
                chunk_threads: int = CHUNK_THREADS) -> None:
    """Samples row r of logits (device f32 [S, V], overwritten) for slot slots[r] (device int32
    [S]; < 0: a padding row, token 0, no state touched; a slot at most once a launch) into
    tokens_out[r] and flags_out[r] (device int32 [>= S]; flag 1: non-finite logits, token 0).
    Two launches (phase 1: grid (ceil(V / chunk), S); phase 2: grid S), no host sync, and no
    allocation after the first launch of a pool at this V: capturable. threads: per phase-2
    block, a power of 2 in 1..1024; sort_max: the largest top_k sorted in shared memory (<= 1024);
    chunk: logits per phase-1 block, a power of 2 in 2..2048; chunk_threads: per phase-1 block
    (at most threads and chunk / 2)."""
    S, V = logits.shape
    _check(logits, slots, tokens_out, flags_out, threads, sort_max)
    if chunk < 2 or chunk > CHUNK_MAX or chunk & (chunk - 1):
        raise ValueError(f"sample_rows: chunk {chunk} (a power of 2 in 2..{CHUNK_MAX})")
    if chunk_threads < 1 or chunk_threads > MAX_THREADS or chunk_threads & (chunk_threads - 1):
        raise ValueError(f"sample_rows: chunk_threads {chunk_threads} (a power of 2 in 1..1024)")
    if S == 0:
        return
    C = -(-V // chunk)
    cap = max(1, min(C * min(sort_max, chunk), CAND_MAX))  # candidates a row: min(k, chunk) a chunk
    best, bad, cand_v, cand_i = pool.chunk_scratch(C, cap)
    if pool.masks is not None:  # a grammar's mask, for the rows whose slot has one
        launch(_apply_masks, (-(-V // 256), S), 256, stream, logits, slots, pool.masked, pool.masks)
    P = 1
    while P < min(chunk, V):
        P *= 2
    launch(_chunks, (best.shape[1], S), max(1, min(chunk_threads, threads, P // 2)), stream, logits, slots, pool.params,
           pool.ring, pool.ringpos, pool.scratch, best, bad, cand_v, cand_i, chunk, sort_max)
    launch(_finish, S, threads, stream, logits, slots, pool.params, pool.rng, pool.ring, pool.ringpos,
           best, bad, cand_v, cand_i, pool.mask_flags(), tokens_out, flags_out, chunk, sort_max, _scale(V))


def sample_rows_single(logits, slots, pool: SamplerSlots, tokens_out, flags_out, stream=0,
                       threads: int = 256, sort_max: int = MAX_THREADS) -> None:
    """sample_rows with the one-block kernel (one launch, grid S; the kernel before phase 1 and
    2, kept for benchmarks/gpu_sample.py to compare). The same tokens."""
    S, V = logits.shape
    _check(logits, slots, tokens_out, flags_out, threads, sort_max)
    if S == 0:
        return
    launch(_sample_rows_single, S, threads, stream, logits, slots, pool.params, pool.rng, pool.ring,
           pool.ringpos, pool.scratch, tokens_out, flags_out, sort_max, _scale(V))


def _scale(V: int) -> float:
    return float(2.0 ** (62 - int(V).bit_length()))  # V masses <= 1 sum below 2**63


def _check(logits, slots, tokens_out, flags_out, threads, sort_max) -> None:
    S, V = logits.shape
    if logits.dtype != np.float32 or slots.shape != (S,) or slots.dtype != np.int32:
        raise ValueError(f"sample_rows: logits {logits.shape} {logits.dtype}, slots {slots.shape} {slots.dtype}")
    if tokens_out.shape[0] < S or flags_out.shape[0] < S or tokens_out.dtype != np.int32 or flags_out.dtype != np.int32:
        raise ValueError("sample_rows: tokens_out and flags_out must be int32 [>= S]")
    if threads < 1 or threads > MAX_THREADS or threads & (threads - 1) or not 0 <= sort_max <= MAX_THREADS:
        raise ValueError(f"sample_rows: threads {threads} (a power of 2 in 1..1024), sort_max {sort_max}")


def sample(logits, slots, pool: SamplerSlots, stream=0, threads: int = 256,
           sort_max: int = MAX_THREADS, chunk: int = CHUNK, single: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """sample_rows (or sample_rows_single) with fresh outputs, synchronized: -> (tokens, flags),
    host int32 [S]. logits: host or device f32 [S, V] (a device array is overwritten); slots:
    host ints."""
    if not hasattr(logits, "copy_to_host"):  # a host array
        logits = cuda.to_device(np.ascontiguousarray(logits, np.float32), stream=stream)
    S = logits.shape[0]
    slots_d = cuda.to_device(np.asarray(slots, np.int32).reshape(S), stream=stream)
    tokens = cuda.device_array(S, np.int32, stream=stream)
    flags = cuda.device_array(S, np.int32, stream=stream)
    if single:
        sample_rows_single(logits, slots_d, pool, tokens, flags, stream, threads, sort_max)
    else:
        sample_rows(logits, slots_d, pool, tokens, flags, stream, threads, sort_max, chunk)
    return tokens.copy_to_host(stream=stream), flags.copy_to_host(stream=stream)
