"""Prefill attention on the f16 tensor cores, flash-style: one pass over a tile's cells, no partials.

Legend: R = query rows of the call, H = query heads, Hkv = key/value heads, G = H / Hkv,
Dh = key/query head size, Dv = value head size, M = 16 * warps (query pairs a block), TQ = M // G
(rows a tile), NK = cells a step, NT = tiles of the call.

The cache is attention.py's (k_cache f16 [NB, S, Hkv, B, Dh], v_cache f16 [NB, S, Hkv, B, Dv]); the
rows' keys and values were appended first. A tile is up to TQ consecutive rows of one sequence
(`tiles` int32 [NT, 2]: first row, rows); block (tile, KV head) holds the tile's TQ * G (row, head)
pairs as the M rows of its `mma`s, so each key and value it reads serves all of them. It walks the
tile's visible cells NK at a time, from the step holding the first row's first visible cell to its
last row's position:
    S = Q K^T (m16n8k16: f16 in, float32 out), masked to each pair's cells lo..p (-inf);
    per pair: the step's max, m' = max(m, step max), l = l exp(m - m') + sum of exp(S - m'),
          O = O exp(m - m') + P V with P = exp(S - m') rounded to f16;
then out = O / l (the sink, gpt-oss, joins m and l first). Q is scaled by `scale` and rounded to
f16 as it enters shared memory (as llama.cpp's flash attention does); K and V are the cache's f16.

Bits: a pair's values depend on its own row's queries and cells only. A step none of its cells
are in leaves its state as it was (before its first visible cell: m = -inf, l = O = 0 stay so;
after its position: exp(0) = 1 and sums of zeros), steps start at multiples of NK, and an `mma`
computes each output from its own row and column. So a row's result does not depend on the other
rows of its tile, on how the call is tiled, or on the other sequences of the step (batch
invariance), and the same inputs give the same bits on every run. The bits differ from
attention.py's kernel (f32 queries and weights there): a sequence's rows take one kernel or the
other by its own row count (the backend's choice), so its result depends on itself alone.

Shared memory (uint32 words, two halves each, rows padded by 4 words so the fragment loads of a
warp hit 32 banks): Q [M, Dh/2 + 4], K [NK, Dh/2 + 4], V transposed [Dv, NK/2 + 4] (a word holds
two cells of one dim: the `mma`'s B fragment of P V). Up to 36 KiB at Dh = Dv = 128.
"""

from __future__ import annotations

import math

import numpy as np
from numba import cuda

from ...errors import UnsupportedError
from .attention import KV_BLOCK, _visible
from .device import SIM, placeholder
from .launch import launch
from .mmvq import MAX_COLS
from .ptx import ldg_v4, mma_f16, pack_f16x2, prmt, warp_max, warp_sum

NK = 32  # cells a step: two n8 tiles of S per k16 step of P V
WARPS = 1 if SIM else 4  # the simulator runs each thread in Python: one warp unless a test asks for more
MAX_HEAD = 128  # Dh and Dv: the O accumulators (Dv / 2 floats a lane) stay in registers
_NEG_INF = np.float32(-np.inf)
_PAD = 4


def supports(n_head: int, n_head_kv: int, head_dim: int, head_dim_v: int, warps: int = WARPS) -> bool:
    """The kernel serves these heads (else attention.py's kernel does)."""
    G = n_head // n_head_kv
    return (n_head % n_head_kv == 0 and G <= 16 * warps and head_dim % 16 == 0 and head_dim_v % 8 == 0
            and head_dim <= MAX_HEAD and head_dim_v <= MAX_HEAD)


def rows_per_tile(n_head: int, n_head_kv: int, warps: int = WARPS) -> int:
    return 16 * warps // (n_head // n_head_kv)


def _make(G: int, DH: int, DV: int, NW: int):
    M = 16 * NW
    THREADS = 32 * NW
    QROW = DH // 2 + _PAD  # words a row of Q / K in shared memory
    VROW = NK // 2 + _PAD
    KS = DH // 16  # k16 steps of Q K^T
    NKT = NK // 8  # n8 tiles of S
    NDT = DV // 8  # n8 tiles of O
    KV = NK // 16  # k16 steps of P V
    DH8, DV8 = DH // 8, DV // 8  # 16-byte loads a cell
    Q_WORDS, K_WORDS, V_WORDS = M * QROW, NK * QROW, DV * VROW  # array sizes must be plain constants
    O_N, S_N = 4 * NDT, 4 * NKT

    @cuda.jit(device=True, inline=True)
    def pair_cells(m, r0, nr, positions, window):
        """Pair m of the tile -> (its row's position, first visible cell); (-1, 0): a padding pair."""
        i = m // G
        p = np.int32(-1)
        lo = np.int32(0)
        if i < nr:
            p = positions[r0 + i]
            lo = _visible(p, window)
        return p, lo

    @cuda.jit(device=True, inline=True)
    def store(o, at, m, r0, nr, kh, run, total, sinks, has_sinks, out):
        """Pair m's outputs (o[4 nd + at], o[4 nd + at + 1]: at 0 for a lane's pair A, 2 for B)."""
        i = m // G
        if i < nr:
            t = cuda.threadIdx.x & 3
            h = kh * G + m - i * G
            f = np.float32(1.0)
            if has_sinks:
                top = max(run, sinks[h])
                f = math.exp(run - top)
                total = total * f + math.exp(sinks[h] - top)
            inv = np.float32(1.0) / total
            for nd in range(NDT):
                d = 8 * nd + 2 * t
                out[r0 + i, h, d] = o[4 * nd + at] * f * inv
                out[r0 + i, h, d + 1] = o[4 * nd + at + 1] * f * inv

    @cuda.jit
    def flash(q, k_cache, v_cache, slots, positions, tiles, scale, window, sinks, has_sinks, out):
        """Grid (NT, Hkv), 32 * NW threads. q: f32 [R, H, DH]; slots, positions: int32 [R];
        tiles: int32 [NT, 2]; sinks: f32 [H] (read when has_sinks); out: f32 [R, H, DV]."""
        r0 = tiles[cuda.blockIdx.x, 0]
        nr = tiles[cuda.blockIdx.x, 1]
        kh = cuda.blockIdx.y
        tid = cuda.threadIdx.x
        warp = tid // 32
        lane = tid - 32 * warp
        g = lane >> 2
        t = lane & 3
        NS, Hkv = k_cache.shape[1], k_cache.shape[2]
        slot = slots[r0]
        jlo = positions[r0]  # the tile's visible cells: jlo..pmax
        pmax = np.int32(-1)
        for i in range(nr):
            p = positions[r0 + i]
            jlo = min(jlo, _visible(p, window))
            pmax = max(pmax, p)

        q_sh = cuda.shared.array(Q_WORDS, np.uint32)
        k_sh = cuda.shared.array(K_WORDS, np.uint32)
        vt_sh = cuda.shared.array(V_WORDS, np.uint32)
        for e in range(tid, M * (DH // 2), THREADS):
            m = e // (DH // 2)
            w = e - m * (DH // 2)
            i = m // G
            x0 = np.float32(0.0)
            x1 = np.float32(0.0)
            if i < nr:
                h = kh * G + m - i * G
                x0 = q[r0 + i, h, 2 * w] * scale
                x1 = q[r0 + i, h, 2 * w + 1] * scale
            q_sh[m * QROW + w] = pack_f16x2(x0, x1)

        mA = 16 * warp + g  # this lane's two pairs: rows g and g + 8 of its warp's 16
        mB = mA + 8
        pA, loA = pair_cells(mA, r0, nr, positions, window)
        pB, loB = pair_cells(mB, r0, nr, positions, window)
        runA = _NEG_INF  # running max, sum of exps
        runB = _NEG_INF
        lA = np.float32(0.0)
        lB = np.float32(0.0)
        o = cuda.local.array(O_N, np.float32)  # O fragments: [NDT] x (c0, c1: pair A; c2, c3: pair B)
        for u in range(O_N):
            o[u] = np.float32(0.0)
        s = cuda.local.array(S_N, np.float32)  # S fragments, then P

        c0 = (jlo // NK) * NK
        while c0 <= pmax:
            cuda.syncthreads()  # the step before has read k_sh and vt_sh
            for e in range(tid, NK * DH8, THREADS):  # K [NK, DH]: a 16-byte load each
                cell = e // DH8
                part = e - cell * DH8
                j = c0 + cell
                w0 = w1 = w2 = w3 = np.uint32(0)
                if j >= jlo and j <= pmax:
                    jb = j // KV_BLOCK
                    base = (((jb * NS + slot) * Hkv + kh) * KV_BLOCK + j - jb * KV_BLOCK) * (2 * DH) + 16 * part
                    w0, w1, w2, w3 = ldg_v4(k_cache, base)
                at = cell * QROW + 4 * part
                k_sh[at] = w0
                k_sh[at + 1] = w1
                k_sh[at + 2] = w2
                k_sh[at + 3] = w3
            for e in range(tid, (NK // 2) * DV8, THREADS):  # V transposed: cells 2c, 2c + 1 x 8 dims
                cp = e % (NK // 2)
                part = e // (NK // 2)
                j = c0 + 2 * cp
                a0 = a1 = a2 = a3 = np.uint32(0)
                b0 = b1 = b2 = b3 = np.uint32(0)
                jb = j // KV_BLOCK  # j, j + 1 share a block (j is even)
                base = (((jb * NS + slot) * Hkv + kh) * KV_BLOCK + j - jb * KV_BLOCK) * (2 * DV) + 16 * part
                if j >= jlo and j <= pmax:
                    a0, a1, a2, a3 = ldg_v4(v_cache, base)
                if j + 1 >= jlo and j + 1 <= pmax:
                    b0, b1, b2, b3 = ldg_v4(v_cache, base + 2 * DV)
                at = 8 * part * VROW + cp
                vt_sh[at] = prmt(a0, b0, 0x5410)
                vt_sh[at + VROW] = prmt(a0, b0, 0x7632)
                vt_sh[at + 2 * VROW] = prmt(a1, b1, 0x5410)
                vt_sh[at + 3 * VROW] = prmt(a1, b1, 0x7632)
                vt_sh[at + 4 * VROW] = prmt(a2, b2, 0x5410)
                vt_sh[at + 5 * VROW] = prmt(a2, b2, 0x7632)
                vt_sh[at + 6 * VROW] = prmt(a3, b3, 0x5410)
                vt_sh[at + 7 * VROW] = prmt(a3, b3, 0x7632)
            cuda.syncthreads()

            for u in range(S_N):
                s[u] = np.float32(0.0)
            for ks in range(KS):  # S = Q K^T
                qa = mA * QROW + 8 * ks + t
                qb = mB * QROW + 8 * ks + t
                x0, x1, x2, x3 = q_sh[qa], q_sh[qb], q_sh[qa + 4], q_sh[qb + 4]
                for n in range(NKT):
                    kb = (8 * n + g) * QROW + 8 * ks + t
                    d0, d1, d2, d3 = mma_f16(x0, x1, x2, x3, k_sh[kb], k_sh[kb + 4],
                                             s[4 * n], s[4 * n + 1], s[4 * n + 2], s[4 * n + 3])
                    s[4 * n] = d0
                    s[4 * n + 1] = d1
                    s[4 * n + 2] = d2
                    s[4 * n + 3] = d3
            mxA = _NEG_INF
            mxB = _NEG_INF
            for n in range(NKT):
                for u in range(2):
                    j = c0 + 8 * n + 2 * t + u
                    if j < loA or j > pA:
                        s[4 * n + u] = _NEG_INF
                    if j < loB or j > pB:
                        s[4 * n + 2 + u] = _NEG_INF
                    mxA = max(mxA, s[4 * n + u])
                    mxB = max(mxB, s[4 * n + 2 + u])
            mxA = max(runA, warp_max(mxA, 4))  # the pair's lanes are a quad
            mxB = max(runB, warp_max(mxB, 4))
            baseA = mxA if mxA != _NEG_INF else np.float32(0.0)  # no cell yet: every exp is 0
            baseB = mxB if mxB != _NEG_INF else np.float32(0.0)
            fA = math.exp(runA - baseA)
            fB = math.exp(runB - baseB)
            sumA = np.float32(0.0)
            sumB = np.float32(0.0)
            for n in range(NKT):
                for u in range(2):
                    eA = math.exp(s[4 * n + u] - baseA)
                    eB = math.exp(s[4 * n + 2 + u] - baseB)
                    s[4 * n + u] = eA
                    s[4 * n + 2 + u] = eB
                    sumA += eA
                    sumB += eB
            lA = lA * fA + warp_sum(sumA, 4)
            lB = lB * fB + warp_sum(sumB, 4)
            runA = mxA
            runB = mxB
            for nd in range(NDT):
                o[4 * nd] *= fA
                o[4 * nd + 1] *= fA
                o[4 * nd + 2] *= fB
                o[4 * nd + 3] *= fB
            for kk in range(KV):  # O += P V: P's fragments are S's, two n8 tiles a k16 step
                x0 = pack_f16x2(s[8 * kk], s[8 * kk + 1])
                x1 = pack_f16x2(s[8 * kk + 2], s[8 * kk + 3])
                x2 = pack_f16x2(s[8 * kk + 4], s[8 * kk + 5])
                x3 = pack_f16x2(s[8 * kk + 6], s[8 * kk + 7])
                for nd in range(NDT):
                    vb = (8 * nd + g) * VROW + 8 * kk + t
                    d0, d1, d2, d3 = mma_f16(x0, x1, x2, x3, vt_sh[vb], vt_sh[vb + 4],
                                             o[4 * nd], o[4 * nd + 1], o[4 * nd + 2], o[4 * nd + 3])
                    o[4 * nd] = d0
                    o[4 * nd + 1] = d1
                    o[4 * nd + 2] = d2
                    o[4 * nd + 3] = d3
            c0 += NK

        store(o, 0, mA, r0, nr, kh, runA, lA, sinks, has_sinks, out)
        store(o, 2, mB, r0, nr, kh, runB, lB, sinks, has_sinks, out)

    return flash


_KERNELS: dict = {}


def _kernel(G: int, DH: int, DV: int, warps: int):
    key = (G, DH, DV, warps)
    kern = _KERNELS.get(key)
    if kern is None:
        kern = _KERNELS[key] = _make(*key)
    return kern


def suits(rows: int, cells: int) -> bool:
    """A sequence of `rows` new rows whose last sees `cells` cells takes this kernel: a prompt
    (more rows than the GEMV takes: a prefill) of at least a quarter of its cells. A few rows
    after a long cached prefix stay on attention.py's split-K kernel: here a tile walks its
    cells alone, and a few tiles would leave most of the GPU idle. It depends only on the
    sequence itself, so its result does too."""
    return rows > MAX_COLS and 4 * rows >= cells


def tiles_of(offsets: np.ndarray, rows_per_tile: int, take) -> np.ndarray:
    """int32 [NT, 2] (first row, rows): each sequence offsets[s]..offsets[s+1] with take[s] true,
    cut into tiles of up to rows_per_tile rows."""
    out = []
    for a, b, yes in zip(offsets[:-1].tolist(), offsets[1:].tolist(), take):
        if yes:
            out += [(r, min(rows_per_tile, b - r)) for r in range(a, b, rows_per_tile)]
    return np.array(out, np.int32).reshape(-1, 2)


def attention_flash(q, k_cache, v_cache, slots, positions, tiles, scale: float, window: int, sinks, out,
                    warps: int = WARPS, stream=0) -> None:
    """Causal attention of the rows `tiles` names (see the module doc); other rows of out are
    left as they are.

    q: device f32 [R, H, Dh]; slots, positions: device int32 [R]; tiles: device int32 [NT, 2]
    (from tiles_of with rows_per_tile(H, Hkv, warps)); sinks: device f32 [H] or None; out: device
    f32 [R, H, Dv]."""
    R, H, Dh = q.shape
    Hkv = k_cache.shape[2]
    Dv = v_cache.shape[4]
    if (k_cache.shape[3:] != (KV_BLOCK, Dh) or v_cache.shape[2:4] != (Hkv, KV_BLOCK) or out.shape != (R, H, Dv)
            or slots.shape != (R,) or positions.shape != (R,) or tiles.ndim != 2 or tiles.shape[1] != 2):
        raise ValueError(f"attention_flash: q {q.shape}, caches {k_cache.shape} {v_cache.shape}, out {out.shape}, "
                         f"tiles {tiles.shape}")
    if not supports(H, Hkv, Dh, Dv, warps):
        raise UnsupportedError(f"attention_flash: {H} query heads over {Hkv} KV heads of {Dh}/{Dv} values")
    if tiles.shape[0] == 0:
        return
    has_sinks = sinks is not None
    launch(_kernel(H // Hkv, Dh, Dv, warps), (tiles.shape[0], Hkv), 32 * warps, stream,
           q, k_cache, v_cache, slots, positions, tiles, np.float32(scale), np.int32(window),
           sinks if has_sinks else placeholder(np.float32), has_sinks, out)
