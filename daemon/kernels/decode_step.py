"""A step of the model as one compiled call (issue 28): rows of S sequences (a decode batch of one
row each, or prompts of several rows each), every layer, its attention and its FFN (routed experts
or dense), then the output norm and head, with no Python between the kernels. The per-op path
wakes the thread pool and crosses the interpreter dozens of times a layer. Here the whole step is
one parallel region of one iteration per thread: each thread does its share of a phase (weight
rows for all of a sequence's rows, attention items, GLU rows), and the threads meet at a spin
barrier (sync.py) before the next phase. The row-wise parts between the matmuls (norms, RoPE and
the KV write, top-k, the mix) go row by row over the threads; thread 0 alone groups the experts'
pairs and moves the last layer's rows.

Each value comes from the kernels the per-op path uses for the same rows, in its order: the row
tiles (row_dot.tiles_any, with the path llama.cpp picks for the op's row count), the quantizers,
ops.rms_norm, ops.norm_rope_qk, ops._attend, ops.route_top_k, the GLUs and ops.moe_mix; the
experts' rows grouped as backend/cpu_experts.py groups them, and the last layer's FFN and the head
on each sequence's last row only, as llama.cpp runs them. So the logits are the per-op path's bit
for bit, which the tests check, and that path's are llama.cpp's.

The step runs the model's layer plan (model/plan.py), the stage list the per-op path walks too:
each MIXER stage (here: attention) with its residual and FFN norm, each FFN stage with its mix,
residual and the next stage's input norm, then HEAD. The host side (backend/cpu_step.py) packs a
model into the arrays below once. A layer's weights are typed Lists indexed by layer, with each
one's type in `kinds`.

Legend: T = rows, S = sequences, D = hidden size, L = layers, G = stages, H / Hkv = query / key-value heads,
Dh / Dv = key / value head size, Nq = q projection rows (H*Dh), E = experts, A = experts per row,
P = pairs (row, expert) = T*A (T for a dense FFN), J = groups of pairs computed together (an expert's
rows, or a sequence's), F = FFN size, V = vocabulary, C = KV cells.
"""

from __future__ import annotations

import numba
import numpy as np
from numba import prange

from daemon.kernels import quants as Q
from daemon.kernels import simd_ir, sync
from daemon.kernels.matmul_activations import quantize_row_q8_0_1, quantize_row_q8_K, round_bf16
from daemon.kernels.matmul_quant import KQUANT_KINDS
from daemon.kernels.ops import (_attend, _swiglu_row, moe_mix, norm_rope_qk, rms_norm, round_f16, route_top_k,
                                swiglu_oai_row, to_f16_values)
from daemon.kernels.row_dot import SOURCES, is_kquant, tiles_any, which_path
from daemon.kernels.sync import STATE_SIZE, barrier, cycles
from daemon.model.plan import COL_KIND, COL_LAYER, COL_TRIM, HEAD, MIXER

# kinds[il, ...]: each weight's ggml type
K_Q, K_K, K_V, K_O, K_ROUTER, K_GATE, K_UP, K_DOWN = range(8)  # K_UP = K_GATE + 1 (gate/up phase)
# layer[il, ...]
L_MOE, L_KV_SLOT, L_WINDOW, L_MOE_INDEX, L_BIAS_QKV, L_BIAS_O, L_ROUTER_BIAS, L_EXPERT_BIAS = range(8)
# dims[...]
D_HEADS, D_KV_HEADS, D_HEAD, D_HEAD_V, D_ROPE_DIMS, D_NEOX, D_QK_NORM, D_USED, D_WEIGHT_SOFTMAX, \
    D_NORM_TOPK, D_GLU_OAI, D_GGML, D_OUT_KIND, D_NQ, D_NK, D_NV, D_FF, D_EXPERTS = range(18)  # last 5: every layer's
N_DIMS = 18
# scalars[...]
F_EPS, F_ATTN_SCALE, F_ROUTE_SCALE, F_GLU_ALPHA, F_GLU_LIMIT = range(5)
QK_NONE, QK_HEAD, QK_FULL = 0, 1, 2
DONE, VOID = -1, -2  # decode_step's results besides a stage to resume at
# clock[...]: thread 0's time stamp counter cycles in each phase, its barrier's wait included
PHASES = ("input", "q/k/v", "RoPE, KV write", "attention", "quantize o", "o proj", "residual, norm", "router",
          "top-k", "grouping", "gate/up", "GLU", "down", "mix, norm", "head")
PH_INPUT, PH_QKV, PH_ROPE_KV, PH_ATTENTION, PH_PREP_O, PH_O_PROJ, PH_RESIDUAL, PH_ROUTER, PH_TOP_K, PH_GROUP, \
    PH_GATE_UP, PH_GLU, PH_DOWN, PH_MIX, PH_HEAD = range(15)
CLOCK_SIZE = len(PHASES) + 1  # the last: the previous mark


FORM_Q8_0, FORM_Q8_K, FORM_F16, FORM_BF16, FORM_F32 = 1, 2, 4, 8, 16  # activation forms a weight type reads


@numba.njit(cache=True)
def _form(kind):
    """The activation form weights of this type read (bit mask; FORM_F32: x itself)."""
    if is_kquant(kind):
        return FORM_Q8_K
    if kind == Q.F32:
        return FORM_F32
    if kind == Q.F16:
        return FORM_F16
    if kind == Q.BF16:
        return FORM_BF16
    return FORM_Q8_0


@numba.njit(cache=True)
def _prepare_row(x, t, forms, acts):
    """Row t of x [T, K] in the forms (a mask of FORM_*) the next weights read:
    acts = (xh, xb, q32, d32, s32, qk, dk, bk), see row_dot.tiles_any."""
    xh, xb, q32, d32, s32, qk, dk, bk = acts
    if forms & FORM_Q8_0:
        quantize_row_q8_0_1(x[t], q32[t], d32[t], s32[t])
    if forms & FORM_Q8_K:
        quantize_row_q8_K(x[t], qk[t], dk[t], bk[t])
    if forms & FORM_F16:
        for i in range(x.shape[1]):
            xh[t, i] = round_f16(x[t, i])
    if forms & FORM_BF16:
        for i in range(x.shape[1]):
            xb[t, i] = round_bf16(x[t, i])


@numba.njit(cache=True)
def _copy_row(dst, p, src, t):
    """dst[p] = src[t], as a plain loop (a slice assignment checks for overlap and may copy through
    a temporary: microseconds a row, which add up over a prompt's pairs)."""
    for i in range(src.shape[1]):
        dst[p, i] = src[t, i]


@numba.njit(cache=True)
def _gather_row(forms, x, acts, t, xg, actg, p):
    """Row t of x and its prepared forms (acts) -> row p of xg and actg (an expert's rows together)."""
    xh, xb, q32, d32, s32, qk, dk, bk = acts
    gh, gb, g32, gd32, gs32, gk, gdk, gbk = actg
    if forms & FORM_Q8_0:
        _copy_row(g32, p, q32, t)
        _copy_row(gd32, p, d32, t)
        _copy_row(gs32, p, s32, t)
    if forms & FORM_Q8_K:
        _copy_row(gk, p, qk, t)
        _copy_row(gdk, p, dk, t)
        _copy_row(gbk, p, bk, t)
    if forms & FORM_F16:
        _copy_row(gh, p, xh, t)
    if forms & FORM_BF16:
        _copy_row(gb, p, xb, t)
    if forms & FORM_F32:
        _copy_row(xg, p, x, t)


@numba.njit(cache=True)
def _acts(T, K):
    """Scratch for rows of K values in every form (see _prepare_row)."""
    return (np.empty((T, K), np.float32), np.empty((T, K), np.float32),
            np.empty((T, K), np.int8), np.empty((T, max(1, K // 32)), np.float32),
            np.empty((T, max(1, K // 32)), np.float32), np.empty((T, K), np.int8),
            np.empty((T, max(1, K // 256)), np.float32), np.empty((T, max(1, K // 16)), np.int32))


@numba.njit(cache=True)
def _tiles(kind, path, w, e, n0, n1, x, acts, t0, t1, out):
    """out[t0:t1, n0:n1] = activation rows t0..t1-1 against rows n0..n1-1 of matrix e of w, as one
    op of those rows computes them (row_dot.tiles_any)."""
    xh, xb, q32, d32, s32, qk, dk, bk = acts
    tiles_any(kind, path, w, e, n0, n1, x, xh, xb, q32, d32, s32, qk, dk, bk, t0, t1, out)


@numba.njit(cache=True)
def _span(c, nch, total):
    """Chunk c of nch over total flat outputs -> [start, end)."""
    return c * total // nch, (c + 1) * total // nch


@numba.njit(cache=True)
def _linear_share(tid, nth, kind, w, x, acts, groups, out):
    """This thread's share of out [T, N] = x [T, K] @ w[0].T, each sequence's rows (groups [G+1],
    row offsets) computed as an op of its own: items (sequence, weight rows)."""
    _linear_part(tid, nth, kind, w, x, acts, groups, out, 0, w.shape[1])


@numba.njit(cache=True)
def _linear_part(tid, nth, kind, w, x, acts, groups, out, c0, Nt):
    """_linear_share of one matrix whose rows are items c0 .. c0+N-1 of Nt per sequence (matrices
    side by side: one span of items over them all)."""
    N, K = w.shape[1], x.shape[1]
    G = groups.shape[0] - 1
    only = np.int64(0)  # a stack's one matrix (a literal 0 would compile tiles_any once more)
    i, end = _span(tid, nth, G * Nt)
    while i < end:
        g, c = i // Nt, i % Nt
        stop = min(Nt, c + end - i)
        if c < c0 + N and stop > c0:  # the span's part in this matrix
            t0, t1 = groups[g], groups[g + 1]
            _tiles(kind, which_path(kind, t1 - t0, N, K, False), w, only, max(c, c0) - c0, min(stop, c0 + N) - c0, x,
                   acts, t0, t1, out)
        i += stop - c


@numba.njit(cache=True)
def _add_bias(y, b):
    """y [T, N] += b [N] (the per-op path's `y += bias`)."""
    for t in range(y.shape[0]):
        for n in range(y.shape[1]):
            y[t, n] = y[t, n] + b[n]


@numba.njit(cache=True)
def _add(x, a):
    for t in range(x.shape[0]):
        for n in range(x.shape[1]):
            x[t, n] = x[t, n] + a[t, n]


@numba.njit(cache=True)
def _missing(slot_of, ids):
    """Whether a chosen expert is not in memory."""
    for t in range(ids.shape[0]):
        for a in range(ids.shape[1]):
            if slot_of[ids[t, a]] < 0:
                return True
    return False


@numba.njit(cache=True)
def _meet(state, nth, tid, clock, phase):
    """The barrier at the end of a phase; thread 0 adds the phase's cycles to clock[phase]."""
    ok = barrier(state, nth)
    if tid == 0:
        now = cycles()
        clock[phase] += now - clock[CLOCK_SIZE - 1]
        clock[CLOCK_SIZE - 1] = now
    return ok


@numba.njit(cache=True)
def _residual(x, a, t, ly, bo):
    """x[t] += the attention's output a[t] (with the o bias first, as the per-op path adds it)."""
    if ly[L_BIAS_O]:
        _add_bias(a[t:t + 1], bo)
    _add(x[t:t + 1], a[t:t + 1])


@numba.njit(cache=True)
def _ffn_input(x, h, t, norm, eps, kd, ly, acts_d, wts):
    """Row t of h [T, D] = the FFN's input (row t of x normed), in the forms the router, gate and up
    read; a dense FFN's one 'expert' per row has weight 1 (y * 1 is y, bit for bit)."""
    h[t] = rms_norm(x[t:t + 1], norm, eps)[0]
    _prepare_row(h, t, _form(kd[K_GATE]) | _form(kd[K_UP]) | (_form(kd[K_ROUTER]) if ly[L_MOE] else 0), acts_d)
    if not ly[L_MOE]:
        wts[t, 0] = 1.0


@numba.njit(cache=True)
def _qkv_to_cache(il, qf, kf, vf, qr, kstores, vstores, seq_of, positions, rope, dims, eps, ly, bq, bk, bv, q_norm,
                  k_norm):
    """The projections' biases and norms, RoPE, the f16 rounding of ggml numerics: the queries into
    qr [T, H, Dh], each row's key and value into its sequence's cell."""
    T = qf.shape[0]
    q2, k2, v2 = np.ascontiguousarray(qf), np.ascontiguousarray(kf), np.ascontiguousarray(vf)
    if ly[L_BIAS_QKV]:
        _add_bias(q2, bq[il])
        _add_bias(k2, bk[il])
        _add_bias(v2, bv[il])
    qkm = dims[D_QK_NORM]
    if qkm == QK_FULL:
        q2 = rms_norm(q2, q_norm[il], eps)
        k2 = rms_norm(k2, k_norm[il], eps)
    H, Hkv, Dh, Dv = dims[D_HEADS], dims[D_KV_HEADS], dims[D_HEAD], dims[D_HEAD_V]
    q, k = norm_rope_qk(q2.reshape(T, H, Dh), k2.reshape(T, Hkv, Dh), q_norm[il], k_norm[il], qkm == QK_HEAD, eps,
                        rope, dims[D_ROPE_DIMS], dims[D_NEOX] != 0)
    v = v2.reshape(T, Hkv, Dv)
    if dims[D_GGML]:  # the f16 KV cache; q rounded for the f16 K·q product
        to_f16_values(q)
        to_f16_values(k)
        to_f16_values(v)
    qr[:, :, :] = q
    slot = ly[L_KV_SLOT]
    for t in range(T):
        kstores[seq_of[t]][slot, positions[t]] = k[t]
        vstores[seq_of[t]][slot, positions[t]] = v[t]


@numba.njit(cache=True)
def _group_pairs(ids, A, seq, S, by_seq, forms, h, acts_d, hg, acts_g, pexp, slot_rows, offs, counts):
    """The pairs (row, expert) of ids [R, A] grouped as cpu_experts.plan groups them: by expert (and
    by sequence where by_seq: a K-quant kernel's path depends on one sequence's row count), rows
    ascending (a counting sort: stable); each pair's activation row gathered into hg / acts_g in
    that order. -> J, with offs [J+1] each group's pairs, pexp [P] each pair's expert, slot_rows
    [P] the place of pair t*A + a. counts: scratch of E*S + 1 or more (keys: expert, or expert and
    sequence where by_seq)."""
    R = ids.shape[0]
    P = R * A
    nkey = (counts.shape[0] - 1) // S * (S if by_seq else 1)
    counts[:nkey] = 0
    for p in range(P):
        t = p // A
        counts[ids[t, p % A] * S + seq[t] if by_seq else ids[t, p % A]] += 1
    J = 0
    at = 0
    for k in range(nkey):  # each key's first place; the groups in key order
        c = counts[k]
        if c:
            offs[J] = at
            J += 1
        counts[k] = at
        at += c
    offs[J] = P
    for p in range(P):
        t = p // A
        e = ids[t, p % A]
        k = e * S + seq[t] if by_seq else e
        q = counts[k]
        counts[k] = q + 1
        pexp[q] = e
        slot_rows[p] = q
        _gather_row(forms, h, acts_d, t, hg, acts_g, q)
    return J


# What the step's functions link from other files (numba's cache watches only this one): they keep
# it in their closures, so an edit to any of them compiles the step again.
STAMP = (SOURCES, simd_ir.source_stamp(sync.__file__), tuple(KQUANT_KINDS))


def _worker_kernel():
    """worker, a closure over STAMP."""
    spec = STAMP

    @numba.njit(cache=True, error_model="numpy")
    def worker(tid, nth, state, clock, status, stages, start, x, h, rope, positions, seq_of, groups, ones, trim, kstores,
               vstores, dims, scalars, kinds, layer, attn_norm, ffn_norm, out_norm, wq, wk, wv, wo, bq, bk, bv, bo,
               q_norm, k_norm, sinks, router, router_bias, gate, up, down, gate_bias, up_bias, down_bias, slot_of,
               out_w, logits, routes, qf, kf, vf, qr, att, a, rl, ids, wts, gu, hh, yo, hg, acts_d, acts_g, acts_o,
               acts_f, pexp, slot_rows, offs, counts, nj, w, acc):
        """Thread tid of nth: its share of each phase (rows, or weight rows), a barrier between
        phases. -> False when the barrier failed (the step is void)."""
        if len(spec) == 0:
            return False
        T, D = x.shape
        S = groups.shape[0] - 1
        H, Hkv, Dv = dims[D_HEADS], dims[D_KV_HEADS], dims[D_HEAD_V]
        A = dims[D_USED]
        ggml = dims[D_GGML] != 0
        eps = scalars[F_EPS]
        first = max(start, 0)
        kept = False  # whether a MIXER stage trimmed the rows: each sequence's last, the first S of x
        for si in range(first):
            kept = kept or (trim != 0 and stages[si, COL_TRIM] != 0)
        if tid == 0:
            clock[CLOCK_SIZE - 1] = cycles()
        if start < 0:  # the first stage's input
            il = stages[0, COL_LAYER]
            kd = kinds[il]
            for t in range(tid, T, nth):
                h[t] = rms_norm(x[t:t + 1], attn_norm[il], eps)[0]
                _prepare_row(h, t, _form(kd[K_Q]) | _form(kd[K_K]) | _form(kd[K_V]), acts_d)
        else:  # resumed at FFN stage `start`
            il = stages[start, COL_LAYER]
            for t in range(tid, S if kept else T, nth):
                _ffn_input(x, h, t, ffn_norm[il], eps, kinds[il], layer[il], acts_d, wts)
        if not _meet(state, nth, tid, clock, PH_INPUT):
            return False
        for si in range(first, stages.shape[0]):
            kind = stages[si, COL_KIND]
            if kind == HEAD:  # on the rows kept
                _linear_share(tid, nth, dims[D_OUT_KIND], out_w, h, acts_d, ones if kept else groups, logits)
                break
            il = stages[si, COL_LAYER]
            kd = kinds[il]
            ly = layer[il]
            if kind == MIXER:
                trims = trim != 0 and stages[si, COL_TRIM] != 0
                # -- attention: q, k and v [T, N] (one phase), then each row's norms, RoPE and KV write
                Nq, Nk = qf.shape[1], kf.shape[1]
                Nt = Nq + Nk + vf.shape[1]  # one span over the three matrices' rows
                _linear_part(tid, nth, kd[K_Q], wq[il], h, acts_d, groups, qf, 0, Nt)
                _linear_part(tid, nth, kd[K_K], wk[il], h, acts_d, groups, kf, Nq, Nt)
                _linear_part(tid, nth, kd[K_V], wv[il], h, acts_d, groups, vf, Nq + Nk, Nt)
                if not _meet(state, nth, tid, clock, PH_QKV):
                    return False
                for t in range(tid, T, nth):  # rows apart: each one's own numbers
                    _qkv_to_cache(il, qf[t:t + 1], kf[t:t + 1], vf[t:t + 1], qr[t:t + 1], kstores, vstores,
                                  seq_of[t:t + 1], positions[t:t + 1], rope[t:t + 1], dims, eps, ly, bq, bk, bv,
                                  q_norm, k_norm)
                    att[t] = 0.0
                if not _meet(state, nth, tid, clock, PH_ROPE_KV):
                    return False
                slot = ly[L_KV_SLOT]
                sk = sinks[il]
                for item in range(tid, T * Hkv, nth):  # (row, KV head): its G query heads
                    t = item // Hkv
                    g = item % Hkv
                    s = seq_of[t]
                    many = groups[s + 1] - groups[s] >= 2  # llama.cpp's kernels of an op of several rows
                    _attend(qr[t], kstores[s][slot], vstores[s][slot], positions[t], ly[L_WINDOW], g, g + 1,
                            scalars[F_ATTN_SCALE], sk, ggml, many, w, acc, att[t])
                if not _meet(state, nth, tid, clock, PH_ATTENTION):
                    return False
                ao = att.reshape(T, H * Dv)
                for t in range(tid, T, nth):
                    _prepare_row(ao, t, _form(kd[K_O]), acts_o)
                if not _meet(state, nth, tid, clock, PH_PREP_O):
                    return False
                # -- the output projection, then each row's residual and FFN norm
                _linear_share(tid, nth, kd[K_O], wo[il], ao, acts_o, groups, a)
                if not _meet(state, nth, tid, clock, PH_O_PROJ):
                    return False
                if not trims:
                    for t in range(tid, T, nth):
                        _residual(x, a, t, ly, bo[il])
                        _ffn_input(x, h, t, ffn_norm[il], eps, kd, ly, acts_d, wts)
                elif tid == 0:  # each sequence's last row to the front (rows only move forward)
                    for s in range(S):
                        r = groups[s + 1] - 1
                        _residual(x, a, r, ly, bo[il])
                        x[s] = x[r]
                    for s in range(S):
                        _ffn_input(x, h, s, ffn_norm[il], eps, kd, ly, acts_d, wts)
                kept = kept or trims
                if not _meet(state, nth, tid, clock, PH_RESIDUAL):
                    return False
                continue
            # -- FFN: pairs (row, expert) grouped as the per-op path groups them, or the dense FFN's
            # (row, 0) of weight 1 grouped by sequence
            R = S if kept else T  # the rows the FFN runs on
            rows = ones if kept else groups  # and how they group into sequences
            moe = ly[L_MOE] != 0
            if moe:
                _linear_share(tid, nth, kd[K_ROUTER], router[il], h, acts_d, rows, rl[:R])
                if not _meet(state, nth, tid, clock, PH_ROUTER):
                    return False
                mi = ly[L_MOE_INDEX]
                for t in range(tid, R, nth):  # each row's top-k (one row: thread 0's, and no meeting after)
                    logit = rl[t:t + 1]
                    if ly[L_ROUTER_BIAS]:
                        _add_bias(logit, router_bias[il])
                    chosen, weights = route_top_k(logit, A, dims[D_WEIGHT_SOFTMAX] != 0, dims[D_NORM_TOPK] != 0,
                                                  scalars[F_ROUTE_SCALE], np.empty((0, 0), np.int64))
                    for k in range(A):
                        ids[t, k] = chosen[0, k]
                        wts[t, k] = weights[0, k]
                        routes[mi, t, k] = chosen[0, k]
                    if _missing(slot_of[mi], chosen):
                        status[0] = si  # (every thread that finds one writes the same)
                if R > 1 and not _meet(state, nth, tid, clock, PH_TOP_K):
                    return False
                if tid == 0:
                    for t in range(R, T):  # rows the last layer skips: counted once, as row 0
                        routes[mi, t] = routes[mi, 0]
                    if status[0] < 0:
                        by_seq = is_kquant(kd[K_GATE]) or is_kquant(kd[K_UP]) or is_kquant(kd[K_DOWN])
                        nj[0] = _group_pairs(ids[:R, :A], A, seq_of if not kept else ones, S, by_seq,
                                             _form(kd[K_GATE]) | _form(kd[K_UP]), h, acts_d, hg, acts_g, pexp,
                                             slot_rows, offs, counts)
                if not _meet(state, nth, tid, clock, PH_GROUP):
                    return False
                if status[0] >= 0:  # an expert to read first: the host resumes here
                    return True
                per = A
                so = slot_of[ly[L_MOE_INDEX]]
                J = nj[0]
                jo, xg, ag = offs, hg, acts_g
            else:
                per = 1
                so = slot_of[slot_of.shape[0] - 1]  # the dense FFN's row: [0, ...]
                J = S
                jo, xg, ag = rows, h, acts_d  # pair t is row t, of "expert" 0
            P = R * per
            Wg, Wu, Wd = gate[il], up[il], down[il]
            F = Wg.shape[1]
            has_b = ly[L_EXPERT_BIAS] != 0
            gb, ub, db = gate_bias[il], up_bias[il], down_bias[il]
            i, end = _span(tid, nth, 2 * J * F)
            while i < end:  # gate and up: flat over (group, gate|up, rows)
                j, which, n = i // (2 * F), (i // F) % 2, i % F
                stop = min(F, n + end - i)
                t0, t1 = jo[j], jo[j + 1]
                e = pexp[t0] if moe else 0
                kind = kd[K_GATE + which]
                out = gu[which]
                _tiles(kind, which_path(kind, t1 - t0, F, D, moe), Wg if which == 0 else Wu, so[e], n, stop, xg, ag,
                       t0, t1, out)
                if has_b:
                    b = gb if which == 0 else ub
                    for t in range(t0, t1):
                        for k in range(n, stop):
                            out[t, k] = out[t, k] + b[e, k]
                i += stop - n
            if not _meet(state, nth, tid, clock, PH_GATE_UP):
                return False
            down_form = _form(kd[K_DOWN])
            for p in range(tid, P, nth):  # the GLU, quantized for down
                if dims[D_GLU_OAI] != 0:
                    swiglu_oai_row(gu[0, p], gu[1, p], hh[p], scalars[F_GLU_ALPHA], scalars[F_GLU_LIMIT])
                else:
                    _swiglu_row(gu[0, p], gu[1, p], hh[p], F - F % 8)
                _prepare_row(hh, p, down_form, acts_f)
            if not _meet(state, nth, tid, clock, PH_GLU):
                return False
            i, end = _span(tid, nth, J * D)
            while i < end:  # down: flat over (group, rows)
                j, n = i // D, i % D
                stop = min(D, n + end - i)
                t0, t1 = jo[j], jo[j + 1]
                e = pexp[t0] if moe else 0
                _tiles(kd[K_DOWN], which_path(kd[K_DOWN], t1 - t0, D, F, moe), Wd, so[e], n, stop, hh, acts_f, t0,
                       t1, yo)
                if has_b:
                    for t in range(t0, t1):
                        for k in range(n, stop):
                            yo[t, k] = yo[t, k] + db[e, k]
                i += stop - n
            if not _meet(state, nth, tid, clock, PH_DOWN):
                return False
            # the mix and the residual, then the next stage's input norm (the output norm before HEAD),
            # row by row
            nl = stages[si + 1, COL_LAYER]
            norm = attn_norm[nl] if nl >= 0 else out_norm
            nk = kinds[max(nl, 0)]
            forms = _form(nk[K_Q]) | _form(nk[K_K]) | _form(nk[K_V]) if nl >= 0 else _form(dims[D_OUT_KIND])
            for t in range(tid, R, nth):
                if not moe:
                    slot_rows[t] = t
                _add(x[t:t + 1], moe_mix(yo, slot_rows[t * per:(t + 1) * per].reshape(1, per), wts[t:t + 1, :per]))
                h[t] = rms_norm(x[t:t + 1], norm, eps)[0]
                _prepare_row(h, t, forms, acts_d)
            if not _meet(state, nth, tid, clock, PH_MIX):
                return False
        if tid == 0:  # its own share only: the region's end waits for the rest
            clock[PH_HEAD] += cycles() - clock[CLOCK_SIZE - 1]
        return True

    return worker


worker = _worker_kernel()


def _step_kernel():
    """decode_step, a closure over STAMP only: `worker` is a global here, since a dispatcher in a
    closure would make numba's cache key differ in every process (it is pickled with an id)."""
    spec = STAMP

    @numba.njit(cache=True, parallel=True)
    def decode_step(stages, x, rope, positions, seq_of, groups, trim, kstores, vstores, dims, scalars, kinds, layer,
                    attn_norm, ffn_norm, out_norm, wq, wk, wv, wo, bq, bk, bv, bo, q_norm, k_norm, sinks, router,
                    router_bias, gate, up, down, gate_bias, up_bias, down_bias, slot_of, out_w, logits, routes, start,
                    nth, clock):
        """The stages of the model's plan (model/plan.py: int64 [G, 3]) over x [T, D], the embedded
        rows (the residual stream, updated in place) -> logits [T, V], or [S, V] of each sequence's
        last row (trim 1: from the MIXER stage that may trim on, as llama.cpp, the rows are those
        only; trim 0 keeps every row). rope [T, n_rot/2, 2] the rows' table; positions [T]; seq_of [T] each row's
        sequence; groups [S+1] each sequence's rows (offsets); kstores / vstores: each sequence's
        KV store [La, C, Hkv, Dh|Dv] (the rows' cells written here); slot_of [Lm + 1, E] each
        expert's matrix in its layer's stacks gate / up [E', F, .] and down [E', D, .] (-1: not
        in memory; the last row, zeros, serves dense FFNs); routes [Lm, T, A] receives each MoE
        layer's choice. One parallel region of one iteration per thread (sync.py): nth, numba's
        thread count (its get_num_threads, which a cached function cannot call); clock [CLOCK_SIZE]
        accumulates thread 0's cycles per phase (PHASES).
        -> -1 once the logits are written; an FFN stage, when an expert its layer chose is not in
        memory (the host reads it, then calls again with start = that stage: the step resumes
        there, the earlier stages' effects kept); -2 when the threads could not meet (the step is
        void: run it again another way)."""
        if len(spec) == 0:
            return VOID
        T, D = x.shape
        S = groups.shape[0] - 1
        H, Hkv, Dv = dims[D_HEADS], dims[D_KV_HEADS], dims[D_HEAD_V]
        A = max(1, dims[D_USED])
        nq, nk, nv, nf, ne = dims[D_NQ], dims[D_NK], dims[D_NV], dims[D_FF], dims[D_EXPERTS]
        C = 1
        for t in range(T):
            C = max(C, positions[t] + 1)
        state = np.zeros(STATE_SIZE, np.int64)
        status = np.empty(1, np.int64)
        status[0] = DONE
        failed = np.zeros(nth, np.int64)
        ones = np.arange(S + 1)  # one row per sequence (the last layer's FFN and the head, trimmed)
        P = T * A
        h = np.empty((T, D), np.float32)
        qf, kf, vf = np.empty((T, nq), np.float32), np.empty((T, nk), np.float32), np.empty((T, nv), np.float32)
        qr = np.empty((T, H, dims[D_HEAD]), np.float32)
        att = np.empty((T, H, Dv), np.float32)
        a = np.empty((T, D), np.float32)
        rl = np.empty((T, ne), np.float32)
        ids = np.empty((T, A), np.int64)
        wts = np.empty((T, A), np.float32)
        gu = np.empty((2, P, nf), np.float32)
        hh = np.empty((P, nf), np.float32)
        yo = np.empty((P, D), np.float32)
        hg = np.empty((P, D), np.float32)  # the pairs' rows gathered by group (F32 experts)
        acts_d, acts_g, acts_o, acts_f = _acts(T, D), _acts(P, D), _acts(T, H * Dv), _acts(P, nf)
        pexp, slot_rows = np.empty(P, np.int64), np.empty(P, np.int64)
        offs, nj = np.empty(P + 1, np.int64), np.zeros(1, np.int64)
        counts = np.empty(ne * S + 1, np.int64)  # the grouping's keys: (expert, sequence)
        G = H // Hkv
        for tid in prange(nth):  # one iteration per thread (numba's OpenMP layer: a static schedule)
            w = np.empty((G, C + 8), np.float32)  # this thread's attention scratch
            acc = np.empty((G, 32, Dv), np.float32)
            if not worker(np.int64(tid), nth, state, clock, status, stages, start, x, h, rope, positions, seq_of, groups,
                          ones, trim, kstores, vstores, dims, scalars, kinds, layer, attn_norm, ffn_norm, out_norm,
                          wq, wk, wv, wo, bq, bk, bv, bo, q_norm, k_norm, sinks, router, router_bias, gate, up, down,
                          gate_bias, up_bias, down_bias, slot_of, out_w, logits, routes, qf, kf, vf, qr, att, a, rl,
                          ids, wts, gu, hh, yo, hg, acts_d, acts_g, acts_o, acts_f, pexp, slot_rows, offs, counts,
                          nj, w, acc):
                failed[tid] = 1
        if failed.sum():
            return VOID
        return status[0]

    return decode_step


decode_step = _step_kernel()
