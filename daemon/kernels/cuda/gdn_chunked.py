"""The gated delta rule in chunks, for prefill (issue 30 item 3; docs/qwen3next.md "The chunked
form"): gdn.gated_delta_net's inputs and results, to f32 rounding of another summation order
rather than its bits (the CPU keeps llama.cpp's token-by-token form; gdn.gated_delta_net sends
only sequences of at least MIN_ROWS rows here).

Legend: T = rows of the call, S = sequences, Hk / Hv = key / value heads, Dk / Dv = their sizes,
CH = rows a chunk, N = chunks of the call (each sequence's rows cut into chunks from its first
row; its last chunk may be partial), J = value rows of the state a carry block owns.

The math, per value head, for a chunk of rows t = 0..CH-1 from state M0 [Dv, Dk] (gdn.py's
recurrence: M *= e^g; u = (v - M k) beta; M += u k^T; o = M q / sqrt(Dv)), with q, k l2-normed,
G_t = g_0 + ... + g_t (within the chunk; g <= 0, so every e^(G_t - G_j), j <= t, is <= 1):
    A[t, j] = beta_t e^(G_t - G_j) k_t.k_j  (j < t; 0 else)
    P[t, j] = e^(G_t - G_j) q_t.k_j  (j <= t; 0 else)
    (I + A) W = diag(beta e^G) K,  (I + A) U' = diag(beta) V   (forward substitution: unit lower)
    U = U' - W M0^T                                             the chunk's u_t, as rows [CH, Dv]
    O = (diag(e^G) Q M0^T + P U) / sqrt(Dv)
    M = e^(G_last) M0 + U^T diag(e^(G_last - G)) K
Rows past a partial chunk's end are zeros with beta = g = 0: their u is 0 and they change
nothing (G_last is then the last real row's).

Kernels:
- intra: grid (N, Hv), a block per chunk of a head. The chunk's q and k into shared memory, their
  l2 norms (thread t sums row t), G (one thread, in row order), A and P (a thread per (t, j),
  dot products over keys in order; P stored transposed, for the carry's lanes over t), then W
  and U' by forward substitution (a thread per column, rows in order, reading back its own
  earlier rows). Writes W, U', Qg = diag(e^G) Q, Kd = diag(e^(G_last - G)) K, P and
  e^(G_last): what the carry needs, none of it state.
- carry: grid (Hv, S, Dv / J), a block per J value rows of a head's state, sequential over the
  sequence's chunks: M's rows in shared memory [J, Dk]; per chunk W and Qg staged in shared
  memory, then U = U' - W M^T and Qg M^T (a warp's lanes over the chunk's rows, each thread
  JW = J / (threads / CH) value rows in registers, keys in order: every shared read a bank a
  lane or a broadcast), O = that + P U (rows in order), and M = e^(G_last) M + Kd^T U (a thread
  per key with all J value rows in registers, rows in order). Each value row of M evolves alone
  given the chunk's quantities, so J rows a block split a head over Dv / J blocks.
Every sum is in a fixed order, no atomics: the same inputs give the same bits, and a sequence's
results do not depend on the other sequences of the call (its chunks start at its first row;
where the call puts them in the scratch changes nothing).

Sizes (Dk = Dv = 128): CH = 32. Intra keeps q and k [CH, Dk + 1] in shared memory, 33 KB, and
A [CH, CH + 1], 4 KB: under the 48 KB a block may declare statically (CH = 64 would need 66 KB
for q and k). Its work per chunk grows as CH^2 Dk while the carry's per row does not depend on
CH, and the substitution is CH rows long: 32 keeps the intra kernel cheap against the carry.
J = 16: Hv * Dv / J = 32 * 8 = 256 carry blocks of 4 warps for one sequence of qwen3-next-80b
(about two an SM of an H200), each with M's rows and the staged W and Qg in 43 KB of shared
memory; a thread holds 4 value rows x 2 products of its chunk row, and 16 value rows of its key
for the update. MIN_ROWS = 2 CH: with fewer rows a sequence has at most one whole chunk, and the
chunked form's two launches, scratch traffic and padded CH^2 products cost about what the
sequential kernel's short row chain does (a guess, to measure on the GPU). Scratch, from
`empty`: W, Qg, Kd [N, Hv, CH, Dk], U' [N, Hv, CH, Dv], P^T [N, Hv, CH, CH], e^G_last [N, Hv]: 68 KB a chunk and
head, about 4.25 copies of the output (a 4096-row call of qwen3-next-80b: 272 MB).
Under the simulator (every thread a Python thread) CH = 4, J = 4 and blocks of 16 threads.
"""

from __future__ import annotations

import functools
import math

import numpy as np
from numba import cuda

from .device import SIM, sigmoid
from .gdn import _gdn_config, _rows_of, check_rule
from .launch import launch

_F32 = np.float32
CHUNK = 4 if SIM else 32  # rows a chunk (CH)
MIN_ROWS = 2 * CHUNK  # gdn.gated_delta_net: the sequences of a call with this many rows come here
_ROWS = 4 if SIM else 16  # value rows of the state a carry block owns (J)
_INTRA_THREADS = 16 if SIM else 128
_CARRY_THREADS = 16 if SIM else 128


def n_chunks(rows, chunk: int = CHUNK, min_rows: int = 0) -> int:
    """Chunks of the sequences with `rows` rows (a host int array [S]) that have >= min_rows."""
    rows = np.asarray(rows)
    rows = rows[rows >= max(min_rows, 1)]
    return int(((rows + chunk - 1) // chunk).sum())


@functools.lru_cache(maxsize=None)
def _seq_fns(CH: int):
    """Device functions over a call's sequences (offsets) for chunk size CH."""

    @cuda.jit(device=True, inline=True)
    def seq_rows(offsets, has_offsets, s):
        """(first row, past the last row) of sequence s."""
        if has_offsets:
            return offsets[s], offsets[s + 1]
        return s, s + 1

    @cuda.jit(device=True, inline=True)
    def chunks_before(offsets, has_offsets, s, min_rows):
        """Chunks of the sequences before s that take this form (their place in the scratch)."""
        n = 0
        for s2 in range(s):
            r0, r1 = seq_rows(offsets, has_offsets, s2)
            if r1 - r0 >= min_rows:
                n += (r1 - r0 + CH - 1) // CH
        return n

    @cuda.jit(device=True, inline=True)
    def chunk_rows(offsets, has_offsets, n_seq, min_rows, n):
        """(first row, rows) of chunk n of the call; (0, 0) past the last chunk."""
        base = 0
        for s in range(n_seq):
            r0, r1 = seq_rows(offsets, has_offsets, s)
            if r1 - r0 >= min_rows:
                nch = (r1 - r0 + CH - 1) // CH
                if n < base + nch:
                    t0 = r0 + (n - base) * CH
                    return t0, min(CH, r1 - t0)
                base += nch
        return 0, 0

    return seq_rows, chunks_before, chunk_rows


@functools.lru_cache(maxsize=None)
def _intra_kernel(DK: int, DV: int, CH: int, NT: int):
    """The intra-chunk kernel for key / value sizes DK, DV, CH rows a chunk, NT threads a block
    (constants: shared array sizes)."""
    DKP = DK + 1  # padded rows: thread t reading row t hits bank (t + i) % 32
    CHP = CH + 1
    _, _, chunk_rows = _seq_fns(CH)

    @cuda.jit
    def intra(qkv, b, a, dt_bias, ssm_a, offsets, has_offsets, n_seq, min_rows, n_k_head, tiled, eps_k, k_scale,
              w_out, u_out, q_out, k_out, p_out, g_out):
        """qkv: f32 [T, C]; b, a: f32 [T, Hv]; dt_bias, ssm_a: f32 [Hv]; offsets: int32 [S+1];
        w_out, q_out, k_out: f32 [N, Hv, CH, DK] (W, Qg, Kd); u_out: f32 [N, Hv, CH, DV] (U');
        p_out: f32 [N, Hv, CH, CH] (P^T: row j, column t); g_out: f32 [N, Hv] (e^G_last).
        Grid (N, Hv)."""
        n = cuda.blockIdx.x
        h = cuda.blockIdx.y
        tid = cuda.threadIdx.x
        t0, nr = chunk_rows(offsets, has_offsets, n_seq, min_rows, n)
        if nr == 0:
            return
        Hv = b.shape[1]
        kh = h % n_k_head if tiled else h // (Hv // n_k_head)
        Kd = n_k_head * DK
        q0 = kh * DK
        k0 = Kd + kh * DK
        v0 = 2 * Kd + h * DV
        qs = cuda.shared.array((CH, DKP), np.float32)
        ks = cuda.shared.array((CH, DKP), np.float32)
        am = cuda.shared.array((CH, CHP), np.float32)  # A
        bs = cuda.shared.array(CH, np.float32)  # beta
        gs = cuda.shared.array(CH, np.float32)  # g, then G
        eg = cuda.shared.array(CH, np.float32)  # e^G
        ed = cuda.shared.array(CH, np.float32)  # e^(G_last - G)
        qn = cuda.shared.array(CH, np.float32)  # 1 / rms of q, of k
        kn = cuda.shared.array(CH, np.float32)
        for idx in range(tid, CH * DK, NT):
            t = idx // DK
            i = idx - t * DK
            qv = np.float32(0.0)
            kv = np.float32(0.0)
            if t < nr:
                qv = qkv[t0 + t, q0 + i]
                kv = qkv[t0 + t, k0 + i]
            qs[t, i] = qv
            ks[t, i] = kv
        for t in range(tid, CH, NT):
            bt = np.float32(0.0)
            gt = np.float32(0.0)
            if t < nr:
                bt = sigmoid(b[t0 + t, h])
                x = a[t0 + t, h] + dt_bias[h]
                if x <= np.float32(20.0):
                    x = math.log(np.float32(1.0) + math.exp(x))
                gt = x * ssm_a[h]
            bs[t] = bt
            gs[t] = gt
        cuda.syncthreads()
        for t in range(tid, CH, NT):  # the l2 norms as gdn._delta_row's (rms_norm(eps/DK), then 1/sqrt(DK))
            sq = np.float32(0.0)
            sk = np.float32(0.0)
            for i in range(DK):
                sq += qs[t, i] * qs[t, i]
                sk += ks[t, i] * ks[t, i]
            qn[t] = np.float32(1.0) / math.sqrt(sq / np.float32(DK) + eps_k)
            kn[t] = np.float32(1.0) / math.sqrt(sk / np.float32(DK) + eps_k)
        if tid == 0:
            acc = np.float32(0.0)
            for t in range(CH):
                acc += gs[t]
                gs[t] = acc
            for t in range(CH):
                eg[t] = math.exp(gs[t])
                ed[t] = math.exp(acc - gs[t])
            g_out[n, h] = math.exp(acc)
        cuda.syncthreads()
        for idx in range(tid, CH * DK, NT):
            t = idx // DK
            i = idx - t * DK
            qv = (qs[t, i] * qn[t]) * k_scale
            kv = (ks[t, i] * kn[t]) * k_scale
            qs[t, i] = qv
            ks[t, i] = kv
            q_out[n, h, t, i] = qv * eg[t]
            k_out[n, h, t, i] = kv * ed[t]
        cuda.syncthreads()
        for idx in range(tid, CH * CH, NT):  # lanes over t: ks[t] a bank each, ks[j] broadcast
            j = idx // CH
            t = idx - j * CH
            pv = np.float32(0.0)
            av = np.float32(0.0)
            if j <= t:
                kk = np.float32(0.0)
                qk = np.float32(0.0)
                for i in range(DK):
                    kj = ks[j, i]
                    kk += ks[t, i] * kj
                    qk += qs[t, i] * kj
                d = math.exp(gs[t] - gs[j])
                pv = d * qk
                if j < t:
                    av = (bs[t] * d) * kk
            am[t, j] = av
            p_out[n, h, j, t] = pv
        cuda.syncthreads()
        # forward substitution, a column a thread: row t of the solution from rows j < t of its own
        for col in range(tid, DK, NT):
            for t in range(CH):
                x = (bs[t] * eg[t]) * ks[t, col]
                for j in range(t):
                    x -= am[t, j] * w_out[n, h, j, col]
                w_out[n, h, t, col] = x
        for col in range(tid, DV, NT):
            for t in range(CH):
                x = np.float32(0.0)
                if t < nr:
                    x = bs[t] * qkv[t0 + t, v0 + col]
                for j in range(t):
                    x -= am[t, j] * u_out[n, h, j, col]
                u_out[n, h, t, col] = x

    return intra


@functools.lru_cache(maxsize=None)
def _carry_kernel(DK: int, CH: int, J: int, NT: int):
    """The state-carrying kernel for key size DK, CH rows a chunk, J value rows and NT threads a
    block (constants: the shared tiles and each thread's registers)."""
    DKP = DK + 1
    JP = J + 1  # us's padded rows: lane t writing row t hits bank (17 t + j) % 32
    G = NT // CH  # thread tid: chunk row tid % CH of group tid // CH, ...
    JW = J // G  # ... which holds JW value rows of (W M^T), (Qg M^T) and O
    KP = (DK + NT - 1) // NT  # keys a thread moves on: tid + NT*p, all J value rows of each
    KJ = KP * J
    if G * CH != NT or JW * G != J:
        raise ValueError(f"carry: {NT} threads are not groups of {CH} rows sharing {J} value rows")
    seq_rows, chunks_before, _ = _seq_fns(CH)

    @cuda.jit
    def carry(w_in, u_in, q_in, k_in, p_in, g_in, state, layer, slots, offsets, has_offsets, min_rows, o_scale, out):
        """The intra kernel's outputs (w_in ... g_in; p_in as P^T); state: f32 [SL, NR, Hv, Dv,
        DK]; slots: int32 [T]; offsets: int32 [S+1]; o_scale: 1/sqrt(Dv); out: f32 [T, Hv, Dv].
        Grid (Hv, S, ceil(Dv / J))."""
        h = cuda.blockIdx.x
        s = cuda.blockIdx.y
        j0 = cuda.blockIdx.z * J
        tid = cuda.threadIdx.x
        tr = tid % CH  # lanes over rows: row tr of the staged tiles, a bank each (padded rows)
        jg = (tid // CH) * JW  # first of the thread's value rows (the same for a warp: broadcasts)
        r0, r1 = seq_rows(offsets, has_offsets, s)
        if r1 - r0 < min_rows:
            return
        n0 = chunks_before(offsets, has_offsets, s, min_rows)
        nch = (r1 - r0 + CH - 1) // CH
        slot = slots[r0]
        Dv = out.shape[2]
        ms = cuda.shared.array((J, DKP), np.float32)  # rows j0.. of M (spare rows past Dv: zeros)
        ws = cuda.shared.array((CH, DKP), np.float32)  # the chunk's W and Qg
        qs = cuda.shared.array((CH, DKP), np.float32)
        us = cuda.shared.array((CH, JP), np.float32)  # the chunk's U, these rows' columns
        for idx in range(tid, J * DK, NT):
            jl = idx // DK
            i = idx - jl * DK
            ms[jl, i] = state[slot, layer, h, j0 + jl, i] if j0 + jl < Dv else np.float32(0.0)
        au = cuda.local.array(JW, np.float32)  # (W M^T)[tr, j], then nothing
        ao = cuda.local.array(JW, np.float32)  # (Qg M^T)[tr, j], then O[tr, j]
        acc = cuda.local.array(KJ, np.float32)  # (Kd^T U)[i, j]
        for c in range(nch):
            n = n0 + c
            t0 = r0 + c * CH
            nr = min(CH, r1 - t0)
            for idx in range(tid, CH * DK, NT):
                t = idx // DK
                i = idx - t * DK
                ws[t, i] = w_in[n, h, t, i]
                qs[t, i] = q_in[n, h, t, i]
            cuda.syncthreads()
            for r in range(JW):
                au[r] = np.float32(0.0)
                ao[r] = np.float32(0.0)
            for i in range(DK):
                wv = ws[tr, i]
                qv = qs[tr, i]
                for r in range(JW):
                    m = ms[jg + r, i]
                    au[r] += wv * m
                    ao[r] += qv * m
            for r in range(JW):
                j = j0 + jg + r
                us[tr, jg + r] = (u_in[n, h, tr, j] if j < Dv else np.float32(0.0)) - au[r]
            cuda.syncthreads()
            for t2 in range(CH):  # O = Qg M^T + P U, P zero above the diagonal
                pv = p_in[n, h, t2, tr]
                for r in range(JW):
                    ao[r] += pv * us[t2, jg + r]
            if tr < nr:
                for r in range(JW):
                    j = j0 + jg + r
                    if j < Dv:
                        out[t0 + tr, h, j] = ao[r] * o_scale
            for q in range(KJ):
                acc[q] = np.float32(0.0)
            for t in range(CH):
                for p in range(KP):
                    i = tid + NT * p
                    kv = k_in[n, h, t, i] if i < DK else np.float32(0.0)
                    for jl in range(J):
                        acc[p * J + jl] += kv * us[t, jl]
            gl = g_in[n, h]
            for p in range(KP):
                i = tid + NT * p
                if i < DK:
                    for jl in range(J):
                        ms[jl, i] = gl * ms[jl, i] + acc[p * J + jl]
            cuda.syncthreads()
        for idx in range(tid, J * DK, NT):
            jl = idx // DK
            i = idx - jl * DK
            if j0 + jl < Dv:
                state[slot, layer, h, j0 + jl, i] = ms[jl, i]

    return carry


def gated_delta_net(qkv, b, a, dt_bias, ssm_a, state, layer: int, slots, offsets, n_seq: int, n_k_head: int,
                    head_k: int, tiled: bool, eps: float, out, stream=0, *, min_rows: int = 0,
                    chunks: int | None = None, chunk: int = CHUNK, empty=None) -> None:
    """gdn.gated_delta_net's rule in chunks (same arguments, same results to f32 rounding), for
    the sequences of at least min_rows rows: the others' outputs and states are left alone.

    chunks: how many chunks those sequences make (n_chunks of their row counts), when the caller
    knows (else a bound: scratch for every sequence); chunk: rows a chunk (a power of two, at
    most 32 for Dk = 128: the intra kernel's shared tiles); empty(shape, dtype): makes the
    scratch (default cuda.device_array)."""
    T, Hv, Dv, Dk = check_rule(qkv, b, a, dt_bias, ssm_a, state, slots, n_k_head, head_k, out,
                               "gated_delta_net (chunked)")
    offsets, has = _rows_of(slots, offsets, n_seq, T)
    N = (T + n_seq * (chunk - 1)) // chunk if chunks is None else int(chunks)  # ceil(n / chunk) summed <= this
    if not T or not N:
        return
    empty = empty or cuda.device_array
    _, _, eps_k, k_scale, o_scale = _gdn_config(Dk, Dv, float(eps))
    w, q, k = (empty((N, Hv, chunk, Dk), _F32) for _ in range(3))
    u = empty((N, Hv, chunk, Dv), _F32)
    p = empty((N, Hv, chunk, chunk), _F32)
    g = empty((N, Hv), _F32)
    min_rows = max(int(min_rows), 1)
    launch(_intra_kernel(Dk, Dv, chunk, _INTRA_THREADS), (N, Hv), _INTRA_THREADS, stream, qkv, b, a, dt_bias, ssm_a,
           offsets, has, int(n_seq), min_rows, int(n_k_head), bool(tiled), eps_k, k_scale, w, u, q, k, p, g)
    threads = max(_CARRY_THREADS, chunk)  # whole groups of a chunk's rows
    rows = max(_ROWS, threads // chunk)
    launch(_carry_kernel(Dk, chunk, rows, threads), (Hv, n_seq, -(-Dv // rows)), threads, stream, w, u, q, k, p, g,
           state, int(layer), slots, offsets, has, min_rows, o_scale, out)


__all__ = ["CHUNK", "MIN_ROWS", "gated_delta_net", "n_chunks"]
