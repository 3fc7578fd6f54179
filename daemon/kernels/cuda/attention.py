"""Attention on the device over an f16 KV cache: append, then causal attention of query rows.

Legend: S = sequence slots of the cache, C = cells (positions) per slot, NB = C / KV_BLOCK blocks
of cells, B = KV_BLOCK cells a block, Hkv = key/value heads,
H = query heads, G = H/Hkv query heads per KV head, Dh = key/query head size, Dv = value head size,
R = query rows of the call, K = CHUNK cells, NCH = chunks per row (ceil(max cells / K)).

Device KV cache layout, per layer (a GPU cache object owns these arrays and hands out slots):
    k_cache: f16 [NB, S, Hkv, B, Dh]    v_cache: f16 [NB, S, Hkv, B, Dv]
A sequence owns one slot; its cell j (block j // B, row j % B) holds position j (as the CPU
cache's row index). Blocks outermost, so the cache grows by appending blocks at the end of its
memory: its address never changes (the pool reserves the range, cuda_reserved.py) and captured
graphs stay valid. Within a block, one (slot, head)'s B cells are contiguous, so a chunk's keys
are read in runs of B * Dh halves (a cell-major layout, B = 1, put consecutive cells of a head
S * Hkv cells apart).

A call attends R query rows, row r being (slots[r], positions[r]): the row sees cells lo..p of its
slot, p = positions[r], lo = max(0, p - window + 1) with a sliding window, else 0. A decode step is
R = B sequences with one row each; a prefill is the T rows of a sequence (same slot, consecutive
positions), appended to the cache first; both are the same kernels. GQA: query head h reads KV head
h // G. Attention sinks (gpt-oss) add exp(sink[h] - max) to the softmax denominator.

Split-K ("flash decoding") with fixed chunks of K cells aligned on absolute positions: block
(chunk c, KV head, row) computes, for the G query heads of its KV head, the chunk's max score, sum
of exps and exp-weighted sum of values, and the last block of a (row tile, head group) to finish
(a ticket from an atomic counter, after a fence) combines the row's chunks in ascending order: one
launch a call (the separate combine kernel, the same arithmetic, stays as the tests' reference).
A prefill (all rows in one slot) gives a block a tile of rows instead of one, so each key
and value is read once per tile; a row's arithmetic is the same either way.

Loads: a thread reads its cell's keys with 128-bit loads into registers before using them, in
groups of 32 words (one array of 64 or 128 words, for Dh 128 or 256, was indexed in a loop the
compiler did not unroll, so it lived in local memory: benchmarks/kernel_resources.py). For
the values, a thread owns two dims of a group of cells (one 32-bit load a cell, a warp's loads one
run of a cell's values, 8 cells in flight); each group sums its cells in ascending order and the
groups' sums are added in group order. A one-row tile of one or two heads whose group has at most
_V_HOIST cells (gpt-oss's decode: Dv 64, 32 cells) loads its values together with its keys. Max
and sum of exps are warp butterflies, then the warps in order. A decode step's grid is small (one
chunk per 128 cells), so blocks then take fewer of a KV head's query heads (down to one:
`_FEW_BLOCKS`); each (row, head) pair's sums run in the same order whatever the grouping. Measured on the H200 (gpt-oss-20b heads: 64 q, 8 kv, Dh 64; one row over 128
cells): 8.1 us a layer in a decode step, 18.9 with a thread per value dim walking every cell.
The chunking depends only on the row's own position and window, so a row's result does not
depend on the other rows of the call (batch invariance), there are no atomics, and the same inputs
give the same bits on every run. Scores and sums are float32; keys and values are read from f16.
"""

from __future__ import annotations

import math

import numpy as np
from numba import cuda

from ...errors import UnsupportedError
from .device import SIM, placeholder, upload, zero_fill
from .ptx import f16_to_f32, ldg_u32, ldg_v4, warp_max, warp_sum
from .launch import launch
from .quantize import QK8_1, q8_1_quant, store_q8_1

# cells per block, = threads per block: one thread per cell for the scores. The simulator runs each
# thread in Python, so there the same code runs with chunks of 32 (the tests use CHUNK, so they
# cross chunk boundaries either way).
CHUNK = 32 if SIM else 128
MAX_PAIRS = 32  # (query row, head) pairs of one KV head per block: G * rows per tile
MAX_QD = 4096  # pairs * Dh queries held in shared memory (>= MAX_PAIRS * CHUNK: reused for reductions)
_SCORES = MAX_PAIRS * CHUNK  # shared [pairs, CHUNK] scores (a plain global: shared sizes must be constants)
_WARP_PARTS = MAX_PAIRS * (CHUNK // 32)  # shared [warps, pairs]: each warp's max, then sum
_V_LOADS = 32  # value words a thread may have in flight after the softmax (more in one array spills)
_V_HOIST = 32  # cells of values a thread may load with its keys (module doc)
_FEW_BLOCKS = 256  # a grid below this spreads a KV head's query heads over blocks
_NEG_INF = np.float32(-np.inf)
_U = np.uint32  # unsigned index arithmetic: a signed index costs each access a negative-index fix-up
# cells a block of the cache holds (a divisor of CHUNK); the simulator's CHUNK holds 4 as on a GPU
KV_BLOCK = 8 if SIM else 32


@cuda.jit(device=True, inline=True)
def _visible(p, window):
    """First visible cell of a query at position p."""
    return max(0, p - window + 1) if window > 0 else 0


@cuda.jit(device=True, inline=True)
def _sees(p, lo, j0):
    """A row with visible cells lo..p has one in the chunk starting at cell j0."""
    return j0 <= p and j0 + CHUNK > lo


def _make_partial(G: int, HB: int, RT: int, DH: int, FUSE: bool, DV: int, Q8: bool = False):
    """The chunk kernel for G query heads per KV head, HB of them per block (HB divides G), tiles
    of RT query rows of one slot, key and value head sizes DH and DV, compiled with all as
    constants: the NP = HB*RT accumulators and a cell's DH keys stay in registers, and the loads
    are unrolled so they are in flight together. Each pair's arithmetic does not depend on HB or
    RT (sums over d and over cells in ascending order), so a row's result is the same however the
    call groups it.
    FUSE: the last block of each (tile, head group) to finish combines its pairs' chunks (the
    combine kernel's arithmetic, `_combine_one`), so a call is one launch.
    Q8 (with FUSE, DV a multiple of 32): the combine also writes its rows' q8_1 blocks (the o
    projection's input: no quantize launch). A warp's 32 values of a combine round are one block
    (one pair, 32 aligned dims), and a block's bits do not depend on the order of its max and sum."""
    if Q8 and (not FUSE or DV % QK8_1):
        raise UnsupportedError(f"attention: q8_1 output needs the fused combine and Dv a multiple of 32, not {DV}")
    NP = HB * RT
    NP2 = 2 * NP  # value sums a thread holds: two dims of each pair
    KW = DH // 2  # uint32 words of one cell's keys (two halves each)
    # the keys in groups of up to 32 words, each its own register array: one array of more words
    # is indexed in a loop the compiler does not unroll, so it lived in local memory (DH 128)
    KG = min(KW, 32)
    NG = KW // KG  # groups: 1, 2 or 4 (DH 256)
    KG1, KG2 = (KG if NG > 1 else 4), (KG if NG > 2 else 4)  # sizes of groups 1 and 2-3 (4: unused)
    if NG * KG != KW or NG > 4:
        raise UnsupportedError(f"attention: head size {DH} (the kernel holds up to 256 key values a cell)")
    # values: a thread owns a pair of dims (one 32-bit load a cell) in a group of PER_GRP cells
    N_DP = DV // 2
    N_GRP = CHUNK // N_DP
    if N_GRP == 0:
        raise UnsupportedError(f"attention: value head size {DV} above {2 * CHUNK}")
    PER_GRP = (CHUNK + N_GRP - 1) // N_GRP
    # A one-row tile of one or two heads (decode's small grids) loads its values with its keys,
    # before the softmax: its group's cells are then one round trip to memory, not PER_GRP /
    # VU (below) of them one after another. The sums' order is the same either way, so the bits
    # are. Measured in graph-replayed decode steps on the H200 (docs/benchmarks.md, issue 30,
    # eleventh step): gpt-oss (32 cells a group, 2 heads) 10.2 us a layer against 12.1; qwen3's
    # 64 cells (two register arrays) 17.8 against 16.1, and 8 heads at 16 rows slower for both.
    HOIST = RT == 1 and HB <= 2 and PER_GRP <= _V_HOIST
    VH = PER_GRP if HOIST else 4  # 4: a placeholder, unused
    # Otherwise the values are loaded in rounds after the softmax, VU words a round: a block of
    # few pairs (decode's one-row tiles) has the registers for more of them in flight, so fewer
    # rounds one after another. The order of the sums does not change with VU.
    # VU is a power of two (up to KV_BLOCK): a round starts at a cell aligned to VU, so its cells
    # lie in one block of the cache, consecutive values rows DV apart, and each load's address is
    # the round's plus a constant (the per-cell 64-bit index arithmetic was 40% of a one-row
    # tile's instructions, Nsight Compute on the H200).
    VU = min(KV_BLOCK, 1 << (max(8, _V_LOADS // NP).bit_length() - 1))

    @cuda.jit(device=True, inline=True)
    def load_keys(k_cache, base, kw):
        for w in range(0, KG, 4):
            w0, w1, w2, w3 = ldg_v4(k_cache, base + 4 * w)
            kw[w] = w0
            kw[w + 1] = w1
            kw[w + 2] = w2
            kw[w + 3] = w3

    @cuda.jit(device=True, inline=True)
    def dot_keys(kw, q_sh, d0, acc):
        # pairs outside, words inside: the inner loop unrolls whatever NP, so kw stays in
        # registers; each pair's sum runs over the words in the same order either way
        for i in range(NP):
            s = acc[i]
            for w in range(KG):
                s += q_sh[i * DH + d0 + 2 * w] * f16_to_f32(kw[w] & 0xFFFF)
                s += q_sh[i * DH + d0 + 2 * w + 1] * f16_to_f32(kw[w] >> 16)
            acc[i] = s

    # a group's first cell starts a block of the cache (gpt-oss: 32 cells a group and a block):
    # each cell's address is then the group's plus a constant
    ALIGNED = PER_GRP % KV_BLOCK == 0

    @cuda.jit(device=True, inline=True)
    def load_values(v_cache, j0, g_start, a, b, v_block, v_head, dp, vw):
        u_first = np.int32(a - g_start)  # the group's visible cells: g_start + u_first..u_last
        u_last = np.int32(b - g_start)
        at = 2 * (((j0 + g_start) // KV_BLOCK) * v_block + v_head + 2 * dp)
        for u in range(VH):
            if u >= u_first and u <= u_last:
                if ALIGNED:
                    vw[u] = ldg_u32(v_cache, at + 2 * ((u // KV_BLOCK) * v_block + (u % KV_BLOCK) * DV))
                else:
                    jc = j0 + g_start + u
                    jb = jc // KV_BLOCK
                    vw[u] = ldg_u32(v_cache, 2 * (jb * v_block + v_head + (jc - jb * KV_BLOCK) * DV + 2 * dp))

    @cuda.jit(device=True, inline=True)
    def add_values(vw, g_start, a, b, s_sh, o):
        # pairs outside, cells inside (as dot_keys): the inner loop unrolls whatever NP, so vw
        # stays in registers; each pair's sum runs over the cells in ascending order
        u_first = np.int32(a - g_start)
        u_last = np.int32(b - g_start)
        s_at = _U(g_start)
        for i in range(NP):
            lo_s = o[2 * i]
            hi_s = o[2 * i + 1]
            for u in range(VH):
                if u >= u_first and u <= u_last:
                    pw = s_sh[s_at + _U(i * CHUNK + u)]
                    lo_s += pw * f16_to_f32(vw[u] & 0xFFFF)
                    hi_s += pw * f16_to_f32(vw[u] >> 16)
            o[2 * i] = lo_s
            o[2 * i + 1] = hi_s

    @cuda.jit
    def partial(q, k_cache, v_cache, slots, positions, scale, window, part_m, part_l, part_o, sinks, has_sinks,
                out, done, qs, ds):
        """One chunk of a tile of rows against HB heads of one KV head. Grid (NCH, H/HB,
        ceil(R/RT)), CHUNK threads. q: f32 [R, H, DH]; caches as the module doc; slots, positions:
        int32 [R] (the rows of a tile share slots[first row]); part_m, part_l: f32 [R, H, NCH]
        (chunk max score, sum of exps); part_o: f32 [R, H, NCH, Dv]. Pair i of the tile is row
        i // HB, head h0 + i % HB, h0 = blockIdx.y * HB. With FUSE: sinks f32 [H] (read when
        has_sinks), out f32 [R, H, Dv], done int32 [>= grid y * z] ticket counters, zero between
        launches (the last block of a (tile, group) sets its own back). With Q8: qs int8
        [R, H*Dv], ds f32 [R, H*Dv/32, 2], out's q8_1 blocks (quantize.py's layout)."""
        c = cuda.blockIdx.x
        h0 = cuda.blockIdx.y * HB
        kh = h0 // G
        r0 = cuda.blockIdx.z * RT
        tid = cuda.threadIdx.x
        R = q.shape[0]
        NS, Hkv = k_cache.shape[1], k_cache.shape[2]
        j0 = c * CHUNK
        pos = cuda.local.array(RT, np.int32)  # per row: last and first visible cell
        los = cuda.local.array(RT, np.int32)
        a = CHUNK  # cells a..b of the chunk are visible to some row
        b = -1
        for i in range(RT):
            p = np.int32(-1)
            lo = np.int32(0)
            if r0 + i < R:
                p = positions[r0 + i]
                lo = _visible(p, window)
            pos[i] = p
            los[i] = lo
            if _sees(p, lo, j0):
                a = min(a, max(lo, j0) - j0)
                b = max(b, min(p, j0 + CHUNK - 1) - j0)
        if b >= 0:  # else no visible cell in this chunk: the block only takes its ticket
            slot = slots[r0]
            j = j0 + tid
            # this thread's cell's keys, loaded together before any use (16 bytes a load)
            kw = cuda.local.array(KG, np.uint32)
            kw1 = cuda.local.array(KG1, np.uint32)
            kw2 = cuda.local.array(KG2, np.uint32)
            kw3 = cuda.local.array(KG2, np.uint32)
            if tid >= a and tid <= b:
                jb = j // KV_BLOCK
                base = (((jb * NS + slot) * Hkv + kh) * KV_BLOCK + j - jb * KV_BLOCK) * (2 * DH)
                load_keys(k_cache, base, kw)
                if NG > 1:
                    load_keys(k_cache, base + 4 * KG, kw1)
                if NG > 2:
                    load_keys(k_cache, base + 8 * KG, kw2)
                    load_keys(k_cache, base + 12 * KG, kw3)
            v_block = NS * Hkv * KV_BLOCK * DV  # values a block of the cache holds
            v_head = (slot * Hkv + kh) * KV_BLOCK * DV  # where this head's cells start within a block
            grp = tid // N_DP
            dp = tid - grp * N_DP
            g_start = grp * PER_GRP
            vw = cuda.local.array(VH, np.uint32)
            if HOIST and grp < N_GRP:
                load_values(v_cache, j0, g_start, a, b, v_block, v_head, dp, vw)
            q_sh = cuda.shared.array(MAX_QD, np.float32)  # [NP, DH] scaled queries, then reductions
            s_sh = cuda.shared.array(_SCORES, np.float32)  # [NP, CHUNK] scores, then exps
            for e in range(tid, NP * DH, CHUNK):
                i = e // DH
                row = i // HB
                x = np.float32(0.0)
                if r0 + row < R:
                    x = q[r0 + row, h0 + i - row * HB, e - i * DH] * scale
                q_sh[e] = x
            cuda.syncthreads()
            acc = cuda.local.array(NP, np.float32)
            for i in range(NP):
                acc[i] = np.float32(0.0)
            if tid >= a and tid <= b:  # the same order as one loop over every word
                dot_keys(kw, q_sh, 0, acc)
                if NG > 1:
                    dot_keys(kw1, q_sh, 2 * KG, acc)
                if NG > 2:
                    dot_keys(kw2, q_sh, 4 * KG, acc)
                    dot_keys(kw3, q_sh, 6 * KG, acc)
            for i in range(NP):
                row = i // HB
                s_sh[i * CHUNK + tid] = acc[i] if j >= los[row] and j <= pos[row] else _NEG_INF
            # each pair's max, then its sum of exps: warp butterflies, then the warps in ascending order
            warp = tid // 32
            lane = tid - warp * 32
            w_sh = cuda.shared.array(_WARP_PARTS, np.float32)  # [warps, NP]
            for i in range(NP):
                v = warp_max(s_sh[i * CHUNK + tid], 32)
                if lane == 0:
                    w_sh[warp * NP + i] = v
            cuda.syncthreads()
            m_own = _NEG_INF  # thread i < NP: pair i's max
            if tid < NP:
                m_own = w_sh[tid]
                for w in range(1, CHUNK // 32):
                    m_own = max(m_own, w_sh[w * NP + tid])
            for i in range(NP):
                m = w_sh[i]
                for w in range(1, CHUNK // 32):
                    m = max(m, w_sh[w * NP + i])
                row = i // HB
                e = np.float32(0.0)
                if j >= los[row] and j <= pos[row]:
                    e = math.exp(s_sh[i * CHUNK + tid] - m)
                s_sh[i * CHUNK + tid] = e
            cuda.syncthreads()  # every max read: w_sh takes the sums
            if tid < NP and _sees(pos[tid // HB], los[tid // HB], j0):
                part_m[r0 + tid // HB, h0 + tid % HB, c] = m_own
            for i in range(NP):
                v = warp_sum(s_sh[i * CHUNK + tid], 32)
                if lane == 0:
                    w_sh[warp * NP + i] = v
            cuda.syncthreads()
            if tid < NP and _sees(pos[tid // HB], los[tid // HB], j0):
                total = w_sh[tid]
                for w in range(1, CHUNK // 32):
                    total += w_sh[w * NP + tid]
                part_l[r0 + tid // HB, h0 + tid % HB, c] = total
            # values: each group sums its cells in ascending order; the groups' sums are added in
            # group order
            o = cuda.local.array(NP2, np.float32)
            for i in range(NP2):
                o[i] = np.float32(0.0)
            if HOIST:
                if grp < N_GRP:
                    add_values(vw, g_start, a, b, s_sh, o)
            else:
                g0 = max(a, g_start)
                g1 = min(b, g_start + PER_GRP - 1)
                if grp >= N_GRP:
                    g1 = -1
                words = cuda.local.array(VU, np.uint32)
                # bytes to this thread's two dims of the chunk's first cell (j0 is a whole block)
                v_at = 2 * ((j0 // KV_BLOCK) * v_block + v_head + 2 * dp)
                jj = g0 - g0 % VU  # a round: cells jj.. of the chunk, in one block of the cache
                while jj <= g1:
                    v_round = v_at + 2 * ((jj // KV_BLOCK) * v_block + (jj % KV_BLOCK) * DV)
                    u_first = np.int32(g0 - jj)  # the round's cells u in u_first..u_last are the group's
                    u_last = np.int32(g1 - jj)
                    for u in range(VU):  # loads in flight together
                        if u >= u_first and u <= u_last:
                            words[u] = ldg_u32(v_cache, v_round + 2 * u * DV)
                    s_at = _U(jj)
                    for u in range(VU):
                        if u >= u_first and u <= u_last:
                            lo_v = f16_to_f32(words[u] & 0xFFFF)
                            hi_v = f16_to_f32(words[u] >> 16)
                            for i in range(NP):
                                pw = s_sh[s_at + _U(i * CHUNK + u)]
                                o[2 * i] += pw * lo_v
                                o[2 * i + 1] += pw * hi_v
                    jj += VU
            o_sh = q_sh  # [NP, DV]; the queries are no longer read
            for g in range(N_GRP):
                if grp == g:
                    for i in range(NP):
                        at = i * DV + 2 * dp
                        if g == 0:
                            o_sh[at] = o[2 * i]
                            o_sh[at + 1] = o[2 * i + 1]
                        else:
                            o_sh[at] += o[2 * i]
                            o_sh[at + 1] += o[2 * i + 1]
                cuda.syncthreads()
            for e in range(tid, NP * DV, CHUNK):
                i = e // DV
                if _sees(pos[i // HB], los[i // HB], j0):
                    part_o[r0 + i // HB, h0 + i % HB, c, e - i * DV] = o_sh[e]
        if FUSE:
            cuda.threadfence()  # the parts are visible to the last block before its ticket is taken
            last = cuda.shared.array(1, np.int32)
            cuda.syncthreads()
            at = cuda.blockIdx.z * cuda.gridDim.y + cuda.blockIdx.y
            if tid == 0:
                last[0] = cuda.atomic.add(done, at, 1) == cuda.gridDim.x - 1
            cuda.syncthreads()
            if last[0] != 0:
                for e in range(tid, NP * DV, CHUNK):
                    i = e // DV
                    row = i // HB
                    if r0 + row < R:  # the same for a warp's 32 lanes (DV is a multiple of 32)
                        h = h0 + i - row * HB
                        d = e - i * DV
                        v = _combine_one(part_m, part_l, part_o, r0 + row, h, d, pos[row], window, sinks,
                                         has_sinks, out)
                        if Q8:
                            amax = warp_max(abs(v), 32)
                            qv = q8_1_quant(v, amax, True)
                            store_q8_1(qv, amax, warp_sum(qv, 32), True, qs, ds, _U(r0 + row), _U(h * DV + d))
                if tid == 0:
                    done[at] = 0

    return partial


_PARTIAL = {}


def _partial_kernel(G: int, HB: int, RT: int, DH: int, fuse: bool, DV: int, q8: bool = False):
    key = (G, HB, RT, DH, fuse, DV, q8)
    kern = _PARTIAL.get(key)
    if kern is None:
        kern = _PARTIAL[key] = _make_partial(*key)
    return kern


_COMBINE_LOADS = 8  # chunks whose partials a combining thread loads together


@cuda.jit(device=True, inline=True)
def _combine_one(part_m, part_l, part_o, r, h, d, p, window, sinks, has_sinks, out):
    """out[r, h, d] (also returned) from the chunks of row r (at position p) in ascending order.
    The partials of _COMBINE_LOADS chunks are loaded together (indices clamped to the last chunk):
    two round trips to memory for a row of up to that many chunks, not three a chunk one after
    another. The sums run over the chunks in the same order either way."""
    c0 = _U(_visible(p, window) // CHUNK)
    c1 = _U(p // CHUNK)
    r = _U(r)  # unsigned indices (no negative-index fix-ups), hoisted out of the unrolled loads
    h = _U(h)
    d = _U(d)
    m = sinks[h] if has_sinks else _NEG_INF
    ms = cuda.local.array(_COMBINE_LOADS, np.float32)
    ls = cuda.local.array(_COMBINE_LOADS, np.float32)
    os = cuda.local.array(_COMBINE_LOADS, np.float32)
    c = c0
    while c <= c1:
        for u in range(_COMBINE_LOADS):
            ms[u] = part_m[r, h, min(c + _U(u), c1)]
        for u in range(_COMBINE_LOADS):
            m = max(m, ms[u])  # max is exact and a clamped repeat changes none
        c += _U(_COMBINE_LOADS)
    total = np.float32(0.0)
    acc = np.float32(0.0)
    c = c0
    while c <= c1:
        for u in range(_COMBINE_LOADS):
            cu = min(c + _U(u), c1)
            ms[u] = part_m[r, h, cu]
            ls[u] = part_l[r, h, cu]
            os[u] = part_o[r, h, cu, d]
        for u in range(_COMBINE_LOADS):
            if c + _U(u) <= c1:
                e = math.exp(ms[u] - m)
                total += ls[u] * e
                acc += os[u] * e
        c += _U(_COMBINE_LOADS)
    if has_sinks:
        total += math.exp(sinks[h] - m)
    y = acc * (np.float32(1.0) / total)
    out[r, h, d] = y
    return y


@cuda.jit
def _attn_combine(part_m, part_l, part_o, positions, window, sinks, has_sinks, out):
    """The row's chunks in ascending order -> out f32 [R, H, Dv]. Grid (H, R)."""
    h = cuda.blockIdx.x
    r = cuda.blockIdx.y
    for d in range(cuda.threadIdx.x, out.shape[2], cuda.blockDim.x):
        _combine_one(part_m, part_l, part_o, r, h, d, positions[r], window, sinks, has_sinks, out)


@cuda.jit
def _kv_append(k_new, v_new, slots, positions, k_cache, v_cache):
    """k_cache[block, slots[r], h, row] = f16(k_new[r, h]) for cell positions[r], and v alike.
    k_new: f32 [R, Hkv, Dh]; v_new: f32 [R, Hkv, Dv]. One thread per (row, head, dim)."""
    idx = cuda.grid(1)
    R, Hkv, Dh = k_new.shape
    Dv = v_new.shape[2]
    D = max(Dh, Dv)
    if idx >= R * Hkv * D:
        return
    r = idx // (Hkv * D)
    rem = idx - r * Hkv * D
    h = rem // D
    d = rem - h * D
    slot = slots[r]
    p = positions[r]
    b = p // KV_BLOCK
    i = p - b * KV_BLOCK
    if d < Dh:
        k_cache[b, slot, h, i, d] = np.float16(k_new[r, h, d])
    if d < Dv:
        v_cache[b, slot, h, i, d] = np.float16(v_new[r, h, d])


def new_kv_cache(n_slots: int, n_head_kv: int, n_cells: int, head_dim: int, head_dim_v: int):
    """One layer's device cache: (k f16 [NB, S, Hkv, B, Dh], v f16 [NB, S, Hkv, B, Dv]), zeroed;
    n_cells rounded up to whole blocks."""
    nb = -(-n_cells // KV_BLOCK)
    k = upload(np.zeros((nb, n_slots, n_head_kv, KV_BLOCK, head_dim), np.float16))
    v = upload(np.zeros((nb, n_slots, n_head_kv, KV_BLOCK, head_dim_v), np.float16))
    return k, v


class AttentionWork:
    """Scratch of the chunk partials for calls of up to max_rows rows of H heads over up to
    max_cells cells: part_m, part_l f32 [rows, H, NCH], part_o f32 [rows, H, NCH, Dv]; done int32
    [rows * H], the fused launch's ticket counters (zero between launches). Shared by every layer
    (the calls run in stream order)."""

    def __init__(self, max_rows: int, n_head: int, max_cells: int, head_dim_v: int, stream=0):
        self.max_rows = max_rows
        self.max_chunks = -(-max_cells // CHUNK)
        shape = (max_rows, n_head, self.max_chunks)
        self.part_m = cuda.device_array(shape, np.float32)
        self.part_l = cuda.device_array(shape, np.float32)
        self.part_o = cuda.device_array(shape + (head_dim_v,), np.float32)
        self.done = cuda.device_array(max(1, max_rows * n_head), np.int32)
        zero_fill(self.done, stream)  # in stream order (a graph being captured records it: a no-op when replayed)


def kv_append(k_new, v_new, slots, positions, k_cache, v_cache, stream=0) -> None:
    """Write rows into the cache: row r at cell positions[r] of slot slots[r], converted to f16.

    k_new: device f32 [R, Hkv, Dh]; v_new: f32 [R, Hkv, Dv]; slots, positions: device int32 [R]
    (each position < C: the cache object reserves cells before the step)."""
    R, Hkv, Dh = k_new.shape
    Dv = v_new.shape[2]
    if (v_new.shape[:2] != (R, Hkv) or k_cache.shape[2:] != (Hkv, KV_BLOCK, Dh)
            or v_cache.shape[2:] != (Hkv, KV_BLOCK, Dv) or slots.shape != (R,) or positions.shape != (R,)):
        raise ValueError(f"kv_append: k {k_new.shape}, v {v_new.shape}, caches {k_cache.shape} {v_cache.shape}")
    n = R * Hkv * max(Dh, Dv)
    if n:
        launch(_kv_append, (n + 127) // 128, 128, stream, k_new, v_new, slots, positions, k_cache, v_cache)


def attention(q, k_cache, v_cache, slots, positions, scale: float, window: int, sinks, out, work: AttentionWork,
              max_cells: int, one_slot: bool = False, tile_rows: int | None = None, fused: bool = True,
              q8=None, stream=0) -> None:
    """Causal attention of R query rows against their slots' cells (see the module doc).

    q: device f32 [R, H, Dh]; slots, positions: device int32 [R]; sinks: device f32 [H] or None;
    out: device f32 [R, H, Dv]; max_cells: an upper bound of positions[r] + 1 over the rows (the
    grid's chunk count; blocks past a row's cells exit at once, so a capacity works too, e.g. for a
    captured graph). The rows' cells must have been appended first (kv_append).

    one_slot: every row belongs to slots[0] (a prefill of one sequence): blocks then take tiles of
    rows (tile_rows, default as many as fit MAX_PAIRS and MAX_QD) and read each key and value once
    per tile. Each row's arithmetic is the same as in a one-row tile, so its result does not depend
    on the tiling.

    fused: one launch (the last chunk block of a tile's heads combines them); False: the chunk
    kernel, then a combine kernel (the same arithmetic, so the same bits: the tests' reference).
    q8: (qs int8 [R, H*Dv], ds f32 [R, H*Dv/32, 2]) to fill with out's q8_1 blocks as well, as
    quantize_q8_1 would (fused only; Dv a multiple of 32)."""
    R, H, Dh = q.shape
    Hkv = k_cache.shape[2]
    Dv = v_cache.shape[4]
    if (H % Hkv or k_cache.shape[3:] != (KV_BLOCK, Dh) or v_cache.shape[3] != KV_BLOCK or out.shape != (R, H, Dv)
            or slots.shape != (R,)):
        raise ValueError(f"attention: q {q.shape}, caches {k_cache.shape} {v_cache.shape}, out {out.shape}")
    G = H // Hkv
    Dq = max(Dh, Dv)  # a pair's queries, then its values' sums, share one shared row
    if G > MAX_PAIRS or G * Dq > MAX_QD or Dh % 8 or Dv % 2 or Dv > 2 * CHUNK:
        raise UnsupportedError(f"attention: {G} query heads of {Dh}/{Dv} per KV head exceed the kernel's "
                               f"{MAX_PAIRS} heads / {MAX_QD} values, {Dh} is not a multiple of 8, or {Dv} "
                               f"is odd or above {2 * CHUNK}")
    rt = 1
    if one_slot:
        rt = max(1, min(MAX_PAIRS // G, MAX_QD // (G * Dq), R))
        if tile_rows is not None:
            rt = max(1, min(rt, tile_rows))
    nch = -(-max_cells // CHUNK)
    if R > work.max_rows or nch > work.max_chunks or work.part_o.shape[1:] != (H, work.max_chunks, Dv):
        raise ValueError(f"attention: {R} rows x {nch} chunks exceed the work area {work.part_o.shape}")
    if R == 0:
        return
    has_sinks = sinks is not None
    tiles = -(-R // rt)
    hb = G  # heads per block: fewer while the grid is small (a decode step), so more SMs work
    while hb % 2 == 0 and nch * (H // hb) * tiles < _FEW_BLOCKS:
        hb //= 2
    sinks_arg = sinks if has_sinks else placeholder(np.float32)
    if q8 is None:
        qs, ds = placeholder(np.int8, 2), placeholder(np.float32, 3)
    else:
        qs, ds = q8
        if qs.shape != (R, H * Dv) or ds.shape != (R, H * Dv // QK8_1, 2):
            raise ValueError(f"attention: q8_1 blocks {qs.shape} {ds.shape} for out {out.shape}")
    launch(_partial_kernel(G, hb, rt, Dh, fused, Dv, q8 is not None), (nch, H // hb, tiles), CHUNK, stream,
        q, k_cache, v_cache, slots, positions, np.float32(scale), np.int32(window), work.part_m, work.part_l,
        work.part_o, sinks_arg, has_sinks, out, work.done, qs, ds)
    if fused:
        return
    threads = 32
    while threads < min(Dv, 128):
        threads *= 2
    launch(_attn_combine, (H, R), threads, stream, work.part_m, work.part_l, work.part_o, positions, np.int32(window),
           sinks_arg, has_sinks, out)
