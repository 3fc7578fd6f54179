"""A decode step of S sequences (one new row each) as one compiled call (issue 28): every layer,
its attention and its FFN (routed experts or dense), then the output norm and head, with no Python
between the kernels. The per-op path wakes the thread pool and crosses the interpreter dozens of
times a layer. Here the whole step is one parallel region of one iteration per thread: each
thread does its share of a phase (a span of weight rows, attention items, GLU rows), and the
threads meet at a spin barrier (sync.py) before the next phase. Thread 0 does the serial parts
between phases: norms, RoPE and the KV write, top-k and the mix.

Each value comes from the kernels a one-row call of the per-op path uses, in its order: the row
intrinsics (row_dot.rows_any), the quantizers, ops.rms_norm, ops.norm_rope_qk, ops._attend,
ops.route_top_k and the GLUs. So the logits are the per-op path's bit for bit, which the tests
check, and that path's are llama.cpp's.

The host side (backend/cpu_step.py) packs a model into the arrays below once. A layer's weights
are typed Lists indexed by layer, with each one's type in `kinds`.

Legend: S = sequences (rows), D = hidden size, L = layers, H / Hkv = query / key-value heads,
Dh / Dv = key / value head size, Nq = q projection rows (H*Dh), E = experts, A = experts per row,
P = pairs (row, expert) = S*A (S for a dense FFN), F = FFN size, V = vocabulary, C = KV cells.
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
                                swiglu_oai_row, to_f16_values, write_kv)
from daemon.kernels.row_dot import SOURCES, rows_any
from daemon.kernels.sync import STATE_SIZE, barrier, cycles

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
DONE, VOID = -1, -2  # decode_step's results besides a layer to resume at
# clock[...]: thread 0's time stamp counter cycles in each phase, its barrier's wait included
PHASES = ("input", "q/k/v", "RoPE, KV write", "attention", "quantize o", "o proj", "residual, norm", "router",
          "top-k", "gate/up", "GLU", "down", "mix, norm", "head")
PH_INPUT, PH_QKV, PH_ROPE_KV, PH_ATTENTION, PH_PREP_O, PH_O_PROJ, PH_RESIDUAL, PH_ROUTER, PH_TOP_K, PH_GATE_UP, \
    PH_GLU, PH_DOWN, PH_MIX, PH_HEAD = range(14)
CLOCK_SIZE = len(PHASES) + 1  # the last: the previous mark


FORM_Q8_0, FORM_Q8_K, FORM_F16, FORM_BF16 = 1, 2, 4, 8  # activation forms a weight type reads


@numba.njit(cache=True)
def _form(kind):
    """The activation form weights of this type read (bit mask; 0: F32, x itself)."""
    if kind == Q.Q4_K or kind == Q.Q5_K or kind == Q.Q6_K:
        return FORM_Q8_K
    if kind == Q.F32:
        return 0
    if kind == Q.F16:
        return FORM_F16
    if kind == Q.BF16:
        return FORM_BF16
    return FORM_Q8_0


@numba.njit(cache=True)
def _prepare_row(x, t, forms, acts):
    """Row t of x [S, K] in the forms (a mask of FORM_*) the next weights read:
    acts = (xh, xb, q32, d32, s32, qk, dk, bk), see row_dot.rows_any."""
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
def _prepare_rows(x, forms, acts):
    for t in range(x.shape[0]):
        _prepare_row(x, t, forms, acts)


@numba.njit(cache=True)
def _acts(S, K):
    """Scratch for rows of K values in every form (see _prepare_rows)."""
    return (np.empty((S, K), np.float32), np.empty((S, K), np.float32),
            np.empty((S, K), np.int8), np.empty((S, max(1, K // 32)), np.float32),
            np.empty((S, max(1, K // 32)), np.float32), np.empty((S, K), np.int8),
            np.empty((S, max(1, K // 256)), np.float32), np.empty((S, max(1, K // 16)), np.int32))


@numba.njit(cache=True)
def _rows(kind, w, e, n0, n1, x, acts, t, out):
    """out[n0:n1] = rows n0..n1-1 of matrix e of w against activation row t (row_dot.rows_any)."""
    xh, xb, q32, d32, s32, qk, dk, bk = acts
    rows_any(kind, w, e, n0, n1, x, xh, xb, q32, d32, s32, qk, dk, bk, t, out)


@numba.njit(cache=True)
def _span(c, nch, total):
    """Chunk c of nch over total flat outputs -> [start, end)."""
    return c * total // nch, (c + 1) * total // nch

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
def _ffn_input(x, h, norm, eps, kd, ly, acts_d, ids, wts):
    """h = the FFN's input (x normed), in the forms the router, gate and up read; a dense FFN's
    one 'expert' per row (id 0, weight 1: y * 1 is y, bit for bit)."""
    h[:, :] = rms_norm(x, norm, eps)
    _prepare_rows(h, _form(kd[K_GATE]) | _form(kd[K_UP]) | (_form(kd[K_ROUTER]) if ly[L_MOE] else 0), acts_d)
    if not ly[L_MOE]:
        ids[:, 0] = 0
        wts[:, 0] = 1.0


@numba.njit(cache=True)
def _qkv_to_cache(il, qf, kf, vf, qr, kstores, vstores, positions, rope, dims, eps, ly, bq, bk, bv, q_norm, k_norm):
    """The projections' biases and norms, RoPE, the f16 rounding of ggml numerics: the queries into
    qr [S, H, Dh], each row's key and value into its sequence's cell."""
    S = qf.shape[0]
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
    q, k = norm_rope_qk(q2.reshape(S, H, Dh), k2.reshape(S, Hkv, Dh), q_norm[il], k_norm[il], qkm == QK_HEAD, eps,
                        rope, dims[D_ROPE_DIMS], dims[D_NEOX] != 0)
    v = v2.reshape(S, Hkv, Dv)
    if dims[D_GGML]:  # the f16 KV cache; q rounded for the f16 K·q product
        to_f16_values(q)
        to_f16_values(k)
        to_f16_values(v)
    qr[:, :, :] = q
    write_kv(kstores, vstores, ly[L_KV_SLOT], positions, k, v)


# What the step's functions link from other files (numba's cache watches only this one): they keep
# it in their closures, so an edit to any of them compiles the step again.
STAMP = (SOURCES, simd_ir.source_stamp(sync.__file__), tuple(KQUANT_KINDS))


def _worker_kernel():
    """worker, a closure over STAMP."""
    spec = STAMP

    @numba.njit(cache=True, error_model="numpy")
    def worker(tid, nth, state, clock, status, start, x, h, rope, positions, kstores, vstores, dims, scalars, kinds, layer,
               attn_norm, ffn_norm, out_norm, wq, wk, wv, wo, bq, bk, bv, bo, q_norm, k_norm, sinks, router,
               router_bias, gate, up, down, gate_bias, up_bias, down_bias, slot_of, out_w, logits, routes, qf, kf,
               vf, qr, att, a, rl, ids, wts, gu, hh, yo, acts_d, acts_o, acts_f, w, acc):
        """Thread tid of nth: its share of each phase, the serial parts on thread 0, a barrier
        between phases. -> False when the barrier failed (the step is void)."""
        if len(spec) == 0:
            return False
        S, D = x.shape
        H, Hkv, Dh, Dv = dims[D_HEADS], dims[D_KV_HEADS], dims[D_HEAD], dims[D_HEAD_V]
        G = H // Hkv
        A = dims[D_USED]
        ggml = dims[D_GGML] != 0
        eps = scalars[F_EPS]
        L = kinds.shape[0]
        first = max(start, 0)
        only = np.int64(0)  # a stack's one matrix (a literal 0 would compile rows_any once more)
        if tid == 0:
            clock[CLOCK_SIZE - 1] = cycles()
            if start < 0:
                h[:, :] = rms_norm(x, attn_norm[0], eps)
                kd = kinds[0]
                _prepare_rows(h, _form(kd[K_Q]) | _form(kd[K_K]) | _form(kd[K_V]), acts_d)
            else:
                _ffn_input(x, h, ffn_norm[first], eps, kinds[first], layer[first], acts_d, ids, wts)
        if not _meet(state, nth, tid, clock, PH_INPUT):
            return False
        for il in range(first, L):
            kd = kinds[il]
            ly = layer[il]
            if il != start:
                # -- attention: q, k and v [S, N] (one phase), then norms, RoPE and the KV write (thread 0)
                Wq, Wk, Wv = wq[il], wk[il], wv[il]
                Nq, Nk, Nv = Wq.shape[1], Wk.shape[1], Wv.shape[1]
                Nt = Nq + Nk + Nv
                i, end = _span(tid, nth, S * Nt)
                while i < end:  # flat over (row, q|k|v rows): spans within one matrix each
                    t, n = i // Nt, i % Nt
                    if n < Nq:
                        stop = min(Nq, n + end - i)
                        _rows(kd[K_Q], Wq, only, n, stop, h, acts_d, t, qf[t])
                    elif n < Nq + Nk:
                        stop = min(Nq + Nk, n + end - i)
                        _rows(kd[K_K], Wk, only, n - Nq, stop - Nq, h, acts_d, t, kf[t])
                    else:
                        stop = min(Nt, n + end - i)
                        _rows(kd[K_V], Wv, only, n - Nq - Nk, stop - Nq - Nk, h, acts_d, t, vf[t])
                    i += stop - n
                if not _meet(state, nth, tid, clock, PH_QKV):
                    return False
                if tid == 0:
                    _qkv_to_cache(il, qf, kf, vf, qr, kstores, vstores, positions, rope,
                                  dims, eps, ly, bq, bk, bv, q_norm, k_norm)
                    att[:, :, :] = 0.0
                if not _meet(state, nth, tid, clock, PH_ROPE_KV):
                    return False
                slot = ly[L_KV_SLOT]
                sk = sinks[il]
                for item in range(tid, S * Hkv, nth):  # (row, KV head): its G query heads
                    s = item // Hkv
                    g = item % Hkv
                    _attend(qr[s], kstores[s][slot], vstores[s][slot], positions[s], ly[L_WINDOW], g, g + 1,
                            scalars[F_ATTN_SCALE], sk, ggml, False, w, acc, att[s])
                if not _meet(state, nth, tid, clock, PH_ATTENTION):
                    return False
                ao = att.reshape(S, H * Dv)
                if tid == 0:
                    _prepare_rows(ao, _form(kd[K_O]), acts_o)
                if not _meet(state, nth, tid, clock, PH_PREP_O):
                    return False
                # -- the output projection, then (thread 0) the residual and the FFN's norm
                Wo = wo[il]
                i, end = _span(tid, nth, S * D)
                while i < end:
                    t, n = i // D, i % D
                    stop = min(D, n + end - i)
                    _rows(kd[K_O], Wo, only, n, stop, ao, acts_o, t, a[t])
                    i += stop - n
                if not _meet(state, nth, tid, clock, PH_O_PROJ):
                    return False
                if tid == 0:
                    if ly[L_BIAS_O]:
                        _add_bias(a, bo[il])
                    _add(x, a)
                    _ffn_input(x, h, ffn_norm[il], eps, kd, ly, acts_d, ids, wts)
                if not _meet(state, nth, tid, clock, PH_RESIDUAL):
                    return False
            # -- the FFN: pairs (row, expert), or (row, the dense FFN) of weight 1
            if ly[L_MOE]:
                Wr = router[il]
                E = Wr.shape[1]
                i, end = _span(tid, nth, S * E)
                while i < end:
                    t, n = i // E, i % E
                    stop = min(E, n + end - i)
                    _rows(kd[K_ROUTER], Wr, only, n, stop, h, acts_d, t, rl[t])
                    i += stop - n
                if not _meet(state, nth, tid, clock, PH_ROUTER):
                    return False
                if tid == 0:
                    if ly[L_ROUTER_BIAS]:
                        _add_bias(rl, router_bias[il])
                    chosen, weights = route_top_k(rl, A, dims[D_WEIGHT_SOFTMAX] != 0, dims[D_NORM_TOPK] != 0,
                                                  scalars[F_ROUTE_SCALE], np.empty((0, 0), np.int64))
                    ids[:, :A] = chosen
                    wts[:, :A] = weights
                    routes[ly[L_MOE_INDEX]] = chosen
                    if _missing(slot_of[ly[L_MOE_INDEX]], chosen):
                        status[0] = il
                if not _meet(state, nth, tid, clock, PH_TOP_K):
                    return False
                if status[0] >= 0:  # an expert to read first: the host resumes here
                    return True
                per = A
                so = slot_of[ly[L_MOE_INDEX]]
            else:
                per = 1
                so = slot_of[slot_of.shape[0] - 1]  # the dense FFN's row: [0, ...]
            P = S * per
            Wg, Wu, Wd = gate[il], up[il], down[il]
            F = Wg.shape[1]
            has_b = ly[L_EXPERT_BIAS] != 0
            gb, ub, db = gate_bias[il], up_bias[il], down_bias[il]
            i, end = _span(tid, nth, 2 * P * F)
            while i < end:  # gate and up: flat over (pair, gate|up, rows)
                p, which, n = i // (2 * F), (i // F) % 2, i % F
                stop = min(F, n + end - i)
                e = ids[p // per, p % per]
                out = gu[which, p]
                _rows(kd[K_GATE + which], Wg if which == 0 else Wu, so[e], n, stop, h, acts_d, p // per, out)
                if has_b:
                    b = gb if which == 0 else ub
                    for j in range(n, stop):
                        out[j] = out[j] + b[e, j]
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
            i, end = _span(tid, nth, P * D)
            while i < end:  # down: flat over (pair, rows)
                p, n = i // D, i % D
                stop = min(D, n + end - i)
                e = ids[p // per, p % per]
                _rows(kd[K_DOWN], Wd, so[e], n, stop, hh, acts_f, p, yo[p])
                if has_b:
                    for j in range(n, stop):
                        yo[p, j] = yo[p, j] + db[e, j]
                i += stop - n
            if not _meet(state, nth, tid, clock, PH_DOWN):
                return False
            if tid == 0:  # the mix and the residual, then the next layer's norm (the output norm after the last)
                _add(x, moe_mix(yo, np.arange(P).reshape(S, per), wts))  # row s's pairs: s*per ..
                h[:, :] = rms_norm(x, attn_norm[il + 1] if il + 1 < L else out_norm, eps)
                if il + 1 < L:
                    nk = kinds[il + 1]
                    _prepare_rows(h, _form(nk[K_Q]) | _form(nk[K_K]) | _form(nk[K_V]), acts_d)
                else:
                    _prepare_rows(h, _form(dims[D_OUT_KIND]), acts_d)
            if not _meet(state, nth, tid, clock, PH_MIX):
                return False
        # -- the head
        V = out_w.shape[1]
        i, end = _span(tid, nth, S * V)
        while i < end:
            t, n = i // V, i % V
            stop = min(V, n + end - i)
            _rows(dims[D_OUT_KIND], out_w, only, n, stop, h, acts_d, t, logits[t])
            i += stop - n
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
    def decode_step(x, rope, positions, kstores, vstores, dims, scalars, kinds, layer, attn_norm, ffn_norm,
                    out_norm, wq, wk, wv, wo, bq, bk, bv, bo, q_norm, k_norm, sinks, router, router_bias,
                    gate, up, down, gate_bias, up_bias, down_bias, slot_of, out_w, logits, routes, start, nth, clock):
        """x [S, D] the embedded rows (the residual stream, updated in place) -> logits [S, V].
        rope [S, n_rot/2, 2] the rows' table; positions [S]; kstores / vstores: each sequence's
        KV store [La, C, Hkv, Dh|Dv] (the row's cell written here); slot_of [Lm + 1, E] each
        expert's matrix in its layer's stacks gate / up [E', F, .] and down [E', D, .] (-1: not
        in memory; the last row, zeros, serves dense FFNs); routes [Lm, S, A] receives each MoE
        layer's choice. One parallel region of one iteration per thread (sync.py): nth, numba's
        thread count (its get_num_threads, which a cached function cannot call); clock [CLOCK_SIZE]
        accumulates thread 0's cycles per phase (PHASES).
        -> -1 once the logits are written; a layer, when an expert it chose is not in memory
        (the host reads it, then calls again with start = that layer: the step resumes at its
        FFN, the attention's effects kept); -2 when the threads could not meet (the step is
        void: run it again another way)."""
        if len(spec) == 0:
            return VOID
        S, D = x.shape
        H, Hkv, Dv = dims[D_HEADS], dims[D_KV_HEADS], dims[D_HEAD_V]
        A = max(1, dims[D_USED])
        nq, nk, nv, nf, ne = dims[D_NQ], dims[D_NK], dims[D_NV], dims[D_FF], dims[D_EXPERTS]
        C = 1
        for s in range(S):
            C = max(C, positions[s] + 1)
        state = np.zeros(STATE_SIZE, np.int64)
        status = np.empty(1, np.int64)
        status[0] = DONE
        failed = np.zeros(nth, np.int64)
        h = np.empty((S, D), np.float32)
        qf, kf, vf = np.empty((S, nq), np.float32), np.empty((S, nk), np.float32), np.empty((S, nv), np.float32)
        qr = np.empty((S, H, dims[D_HEAD]), np.float32)
        att = np.empty((S, H, Dv), np.float32)
        a = np.empty((S, D), np.float32)
        rl = np.empty((S, ne), np.float32)
        ids = np.empty((S, A), np.int64)
        wts = np.empty((S, A), np.float32)
        gu = np.empty((2, S * A, nf), np.float32)
        hh = np.empty((S * A, nf), np.float32)
        yo = np.empty((S * A, D), np.float32)
        acts_d, acts_o, acts_f = _acts(S, D), _acts(S, H * Dv), _acts(S * A, nf)
        G = H // Hkv
        for tid in prange(nth):  # one iteration per thread (numba's OpenMP layer: a static schedule)
            w = np.empty((G, C + 8), np.float32)  # this thread's attention scratch
            acc = np.empty((G, 32, Dv), np.float32)
            if not worker(np.int64(tid), nth, state, clock, status, start, x, h, rope, positions, kstores, vstores, dims, scalars,
                          kinds, layer, attn_norm, ffn_norm, out_norm, wq, wk, wv, wo, bq, bk, bv, bo, q_norm, k_norm,
                          sinks, router, router_bias, gate, up, down, gate_bias, up_bias, down_bias, slot_of, out_w,
                          logits, routes, qf, kf, vf, qr, att, a, rl, ids, wts, gu, hh, yo, acts_d, acts_o, acts_f,
                          w, acc):
                failed[tid] = 1
        if failed.sum():
            return VOID
        return status[0]

    return decode_step


decode_step = _step_kernel()
