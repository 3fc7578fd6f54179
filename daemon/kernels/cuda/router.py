"""MoE router on the device: softmax and top-k per row, writing expert ids and weights to device
memory, so the expert kernels read them without a host sync.

Legend: T = tokens (rows), E = experts, A = experts used per token.

The same computation as daemon/model/moe.py's route (the CPU backend's router), per family:
- "softmax" (qwen3moe, qwen2moe, olmoe, Mixtral): probs = softmax(logits + bias) over E, ids = the A
  largest probs, weights = probs at ids;
- "softmax_weight" (gpt-oss): ids = the A largest logits, weights = softmax over those A logits;
then, if norm_topk, weights / max(sum(weights), 2^-14); if scale (expert_weights_scale) != 0,
weights * scale. Top-k order is largest first and ties keep the lower expert index first (the CPU's
stable argsort); a NaN score ranks below every number. With `given` ids (routing replay) the ids
are read from `ids` and only weighed.

One warp per row. The top-k is A rounds of a warp max over int64 rank keys (the value's order
key, then the lower index: a total order), a lane's experts' keys reduced as a tree first; so the
result is the same on every run and independent of the other rows; the softmax's max and sum are
warp butterflies in a fixed order. (Until 2026-12-02 a round scanned a lane's experts one by one
and took a (value, index) arg-max butterfly: 14.1 us a row at 512 experts, 7.8 at 128, H200.)

`route_fused` is the whole router of a decode step in one launch: a block per expert makes that
expert's logit of every row (the warps split the row, then the warps' sums in order), and the
last block to finish (a ticket from an atomic counter, after a fence) routes every row as
`route` does. Past FUSED_ROWS rows (a prefill) the same product runs in tiles of rows, two
experts a block (an x chunk read once for both), with no routing code (fewer registers), and
`route` follows. A logit's order depends only on the warps a block, a model constant (_warps:
8, or 4 past 256 experts), so a row's logits, ids and weights do not depend on how many rows
share the call.
"""

from __future__ import annotations

import math

import numpy as np
from numba import cuda

from ...errors import UnsupportedError
from ..quants import block_size, type_name
from .device import SIM, placeholder
from .layout import repacked_stride
from .ptx import order_key, warp_max, warp_sum
from .launch import launch
from .vecdot import FLOAT_ACT, VALUES, VECDOT

MAX_EXPERTS = 1024
_INDEX = 1024  # a rank key's index part: (order key) * _INDEX + (_INDEX - 1 - expert)
MAX_USED = 64
_WARP = 32
# rows of x a block of the fused router takes, and up to which it also routes; warps a block.
# The simulator runs each thread in Python: fewer of both there (its tests still cross tiles).
FUSED_ROWS = 4 if SIM else 16
_FUSED_WARPS = 1 if SIM else 8


def _warps(n_expert: int) -> int:
    """Warps a block of the router's product (they split a row: the sums' order) for a model's
    expert count: 4 past 256 experts, so a decode step's block per expert fits one wave (512
    blocks at the routing tail's 122 registers)."""
    return _FUSED_WARPS if n_expert <= 256 else max(1, _FUSED_WARPS // 2)


# experts a block of the product makes past FUSED_ROWS rows: a prefill's tiles read each x chunk
# for 2 (H200, 512 experts, 4096 rows: 3.09 ms at 1, 2.29 at 2, 3.63 at 4); a decode step's
# launch keeps a block per expert (5.9 us at 512 experts against 9.0 at 4 a block)
_TILED_EXPERTS = 2
_NEG_INF = np.float32(-np.inf)


def _make_route_row(PER: int):
    """The routing of one row by one warp, for up to 32*PER experts (PER a compile-time constant:
    loops over a lane's experts unroll and its values stay in registers). Every warp of the block
    calls it (it holds a block barrier); `live` is False in a warp with no row."""

    @cuda.jit(device=True)
    def route_row(t, lane, live, logits, bias, has_bias, softmax_first, norm_topk, scale, given, ids, weights,
                  sel, s0):
        """Row t of logits f32 [T, E] -> ids int32 [t, :A] (or read from there when given), weights
        f32 [t, :A]. sel: shared f32, the warp's A chosen scores at sel[s0:s0 + A]; lane l holds
        experts l + 32k in registers (k < PER, loaded together), and their rank keys."""
        E = logits.shape[1]
        A = ids.shape[1]
        vals = cuda.local.array(PER, np.float32)
        if live:
            m = _NEG_INF
            for k in range(PER):
                e = lane + k * _WARP
                v = _NEG_INF
                if e < E:
                    v = logits[t, e]
                    if has_bias:
                        v += bias[e]
                    m = max(m, v)
                vals[k] = v
            if softmax_first:  # probs over all experts
                m = warp_max(m, _WARP)
                s = np.float32(0.0)
                for k in range(PER):
                    if lane + k * _WARP < E:
                        x = math.exp(vals[k] - m)
                        vals[k] = x
                        s += x
                inv = np.float32(1.0) / warp_sum(s, _WARP)
                for k in range(PER):
                    vals[k] *= inv
            # a rank key per expert: the value's order key (NaN as -inf: chosen only when nothing
            # else is left), then the lower index; -1 once chosen or past E
            keys = cuda.local.array(PER, np.int64)
            for k in range(PER):
                e = lane + k * _WARP
                kk = np.int64(-1)
                if e < E:
                    v = vals[k]
                    if v != v:
                        v = _NEG_INF
                    kk = order_key(v) * np.int64(_INDEX) + np.int64(_INDEX - 1 - e)
                keys[k] = kk
            best = cuda.local.array(PER, np.int64)
            for a in range(A):
                if given:
                    win = ids[t, a]
                else:
                    for k in range(PER):
                        best[k] = keys[k]
                    # a tree over the lane's keys, log2(PER) steps (constant strides: the loops unroll)
                    if PER >= 32:
                        for k in range(16):
                            best[k] = max(best[k], best[k + 16])
                    if PER >= 16:
                        for k in range(8):
                            best[k] = max(best[k], best[k + 8])
                    if PER >= 8:
                        for k in range(4):
                            best[k] = max(best[k], best[k + 4])
                    if PER >= 4:
                        for k in range(2):
                            best[k] = max(best[k], best[k + 2])
                    if PER >= 2:
                        best[0] = max(best[0], best[1])
                    top = warp_max(best[0], _WARP)
                    win = np.int32(_INDEX - 1 - top % np.int64(_INDEX))
                    if lane == 0:
                        ids[t, a] = win
                for k in range(PER):  # constant indices keep vals and keys in registers
                    if lane + k * _WARP == win:
                        sel[s0 + a] = vals[k]
                        keys[k] = np.int64(-1)
        cuda.syncthreads()
        if live and lane == 0:
            if not softmax_first:  # softmax over the selected logits
                mx = _NEG_INF
                for a in range(A):
                    mx = max(mx, sel[s0 + a])
                s = np.float32(0.0)
                for a in range(A):
                    sel[s0 + a] = math.exp(sel[s0 + a] - mx)
                    s += sel[s0 + a]
                for a in range(A):
                    sel[s0 + a] = sel[s0 + a] / s
            div = np.float32(1.0)
            if norm_topk:
                s = np.float32(0.0)
                for a in range(A):
                    s += sel[s0 + a]
                div = max(s, np.float32(6.103515625e-5))
            for a in range(A):
                w = sel[s0 + a]
                if norm_topk:
                    w = w / div
                if scale != np.float32(0.0):
                    w = w * scale
                weights[t, a] = w

    return route_row


def _make_route(PER: int):
    route_row = _make_route_row(PER)

    @cuda.jit
    def route_kernel(logits, bias, has_bias, softmax_first, norm_topk, scale, given, ids, weights):
        """Grid T blocks of one warp: block t routes row t (route_row)."""
        sel = cuda.shared.array(MAX_USED, np.float32)
        route_row(cuda.blockIdx.x, cuda.threadIdx.x, True, logits, bias, has_bias, softmax_first, norm_topk, scale,
                  given, ids, weights, sel, 0)

    return route_kernel


def _make_fused(qtype: int, PER: int, WARPS: int, EB: int, ROUTE: bool, NC: int = FUSED_ROWS):
    """The router's matrix-vector product for EB experts and NC rows a block and, with ROUTE (a
    launch of at most NC rows), the routing of every row by the last block to finish, in one
    launch. The sums' order depends on WARPS alone (module doc): for one WARPS, every variant gives
    the same bits. NC is a compile-time constant: a one-row step's block does not walk 15 empty
    columns (their compares and branches were most of its instructions, Nsight Compute on the
    H200)."""
    load, dot = VECDOT[qtype]
    per_chunk = VALUES[qtype]
    qk = block_size(qtype)[0]
    THREADS = WARPS * _WARP
    ACC = EB * NC  # array sizes: constants made outside the kernel
    PARTS = WARPS * EB * NC
    SEL = WARPS * MAX_USED
    route_row = _make_route_row(PER)

    @cuda.jit
    def router_fused(W, x, stride, k, bias, has_bias, softmax_first, norm_topk, scale, given, logits, ids, weights,
                     done):
        """Grid (ceil(E / EB), ceil(T / NC)) of WARPS warps: block (b, y) makes
        logits[y*NC : y*NC + NC, b*EB : b*EB + EB] = x . W[e] (+ bias[e]), its threads striding
        over the rows' chunks (an x chunk serves EB experts; the same order whatever T). With
        ROUTE (one y), the block that finishes last (a ticket from `done`, int32 [1], which it
        sets back to 0) routes the rows, a warp a row (route_row).
        W: uint8 [E, stride] (repacked float rows, layout.py); x: f32 [T, K]."""
        E = logits.shape[1]
        e0 = cuda.blockIdx.x * EB
        neb = min(EB, E - e0)
        t0 = cuda.blockIdx.y * NC
        T = logits.shape[0]
        ncl = min(NC, T - t0)
        tid = cuda.threadIdx.x
        warp = tid // _WARP
        lane = tid - warp * _WARP
        acc = cuda.local.array(ACC, np.float32)  # [EB, NC]
        for i in range(ACC):
            acc[i] = np.float32(0.0)
        nb = k // qk
        c = tid
        while c < k // per_chunk:
            for b in range(EB):
                if b < neb:
                    w = load(W, (e0 + b) * stride, nb, c)
                    for j in range(NC):
                        if j < ncl:
                            acc[b * NC + j] += dot(w, x, x, t0 + j, k, c)
            c += THREADS
        part = cuda.shared.array(PARTS, np.float32)  # [WARPS, EB, NC]
        for b in range(EB):
            for j in range(NC):
                if b < neb and j < ncl:  # the same in every thread of the block: the shuffles stay convergent
                    v = warp_sum(acc[b * NC + j], _WARP)
                    if lane == 0:
                        part[(warp * EB + b) * NC + j] = v
        cuda.syncthreads()
        b = tid // NC
        j = tid - b * NC
        if b < neb and j < ncl:
            v = part[b * NC + j]
            for w in range(1, WARPS):
                v += part[(w * EB + b) * NC + j]
            if has_bias:
                v += bias[e0 + b]
            logits[t0 + j, e0 + b] = v
        if ROUTE:
            cuda.threadfence()  # the logits are visible to the last block before its ticket is taken
            last = cuda.shared.array(1, np.int32)
            cuda.syncthreads()
            if tid == 0:
                ticket = cuda.atomic.add(done, 0, 1)
                last[0] = ticket == cuda.gridDim.x - 1
            cuda.syncthreads()
            if last[0] != 0:
                sel = cuda.shared.array(SEL, np.float32)  # [WARPS, MAX_USED]
                for r0 in range(0, T, WARPS):
                    route_row(r0 + warp, lane, r0 + warp < T, logits, bias, False, softmax_first, norm_topk, scale,
                              given, ids, weights, sel, warp * MAX_USED)
                if tid == 0:
                    done[0] = 0

    return router_fused


_ROUTE = {}
_FUSED = {}


def _per_lane(n_expert: int) -> int:
    per = 1
    while per * _WARP < n_expert:
        per *= 2
    return per


def _fused_cols(rows: int) -> int:
    """Columns of a fused launch of `rows` rows: the least power of two holding them."""
    nc = 1
    while nc < rows:
        nc *= 2
    return nc


def _route_kernel(n_expert: int):
    per = _per_lane(n_expert)
    kern = _ROUTE.get(per)
    if kern is None:
        kern = _ROUTE[per] = _make_route(per)
    return kern


def _check_route(T: int, E: int, ids, weights, gating: str) -> int:
    """-> A, after the checks every routing call shares."""
    A = ids.shape[1]
    if gating not in ("softmax", "softmax_weight"):
        raise ValueError(f"route: unknown gating {gating!r}")
    if ids.shape != (T, A) or weights.shape != (T, A) or not 0 < A <= min(E, MAX_USED) or E > MAX_EXPERTS:
        raise ValueError(f"route: {E} experts, ids {ids.shape}, weights {weights.shape} "
                         f"(at most {MAX_EXPERTS} experts, {MAX_USED} used)")
    return A


def route_fused(w, qtype: int, x, bias, gating: str, norm_topk: bool, scale: float, logits, ids, weights, done,
                given: bool = False, stream=0) -> None:
    """The exact router in one launch for up to FUSED_ROWS rows: logits = x . w^T (+ bias), then
    the top-k routing of each row (`route`); for more rows, that product and then `route`. The
    product's sums run in an order that does not depend on the number of rows, so a row's logits,
    ids and weights are the same bits however many rows share the call.

    w: device uint8 [E, stride], a float router (F32, F16 or BF16) repacked (layout.repack);
    x: device f32 [T, K]; bias: device f32 [E] or None; logits: device f32 [T, E] (written);
    ids, weights: as `route`; done: device int32 [1], zero, owned by the caller's stream (the
    fused launch's ticket counter, back to zero after each launch)."""
    if qtype not in FLOAT_ACT:
        raise UnsupportedError(f"route_fused: a {type_name(qtype)} router (F32, F16 or BF16 only)")
    T, K = x.shape
    E = w.shape[0]
    _check_route(T, E, ids, weights, gating)
    if logits.shape != (T, E) or tuple(w.shape) != (E, repacked_stride(qtype, K)) or (bias is not None and bias.shape != (E,)):
        raise ValueError(f"route_fused: w {w.shape}, x {x.shape}, logits {logits.shape}")
    if not T:
        return
    fused = T <= FUSED_ROWS
    eb = 1 if fused else _TILED_EXPERTS
    nc = _fused_cols(T) if fused else FUSED_ROWS
    warps = _warps(E)
    key = (qtype, _per_lane(E), warps, eb, fused, nc)
    kern = _FUSED.get(key)
    if kern is None:
        kern = _FUSED[key] = _make_fused(*key)
    launch(kern, (-(-E // eb), -(-T // nc)), warps * _WARP, stream, w, x, w.shape[1], K,
           placeholder(np.float32) if bias is None else bias, bias is not None, gating == "softmax",
           bool(norm_topk), np.float32(scale), bool(given), logits, ids, weights, done)
    if not fused:
        route(logits, gating, norm_topk, scale, ids, weights, given=given, stream=stream)


def route(logits, gating: str, norm_topk: bool, scale: float, ids, weights, bias=None, given: bool = False,
          stream=0) -> None:
    """Top-k routing of each row of logits (see the module doc).

    logits: device f32 [T, E]; ids: device int32 [T, A] (written; read instead when given, for
    routing replay); weights: device f32 [T, A] (written); bias: device f32 [E]
    (ffn_gate_inp.bias) or None; gating: "softmax" or "softmax_weight"; scale: expert_weights_scale
    (0 = none)."""
    T, E = logits.shape
    _check_route(T, E, ids, weights, gating)
    if T:
        launch(_route_kernel(E), T, _WARP, stream, logits, placeholder(np.float32) if bias is None else bias, bias is not None,
                                    gating == "softmax", bool(norm_topk), np.float32(scale), bool(given), ids, weights)


@cuda.jit
def _count_kernel(ids, usage):
    # ids int32 [P] (a step's [T, A], flat) -> usage[ids[p]] += 1 (order-free: integer atomics)
    p = cuda.grid(1)
    if p < ids.shape[0]:
        e = ids[p]
        if 0 <= e < usage.shape[0]:
            cuda.atomic.add(usage, e, 1)


@cuda.jit
def _count_cold_kernel(ids, usage, slot_of, cold):
    # _count_kernel, and cold[0] = 1 where a pair's expert is in no tier (slot_of[e] == -1)
    p = cuda.grid(1)
    if p < ids.shape[0]:
        e = ids[p]
        if 0 <= e < usage.shape[0]:
            cuda.atomic.add(usage, e, 1)
            if slot_of[e] == -1:
                cold[0] = 1


def count_experts(ids, usage, stream=0, slot_of=None, cold=None) -> None:
    """usage int32 [E] += how many (token, expert) pairs of ids int32 [T, A] route to each expert,
    on the device (no host sync: it can live in a captured step). With slot_of int32 [E] and
    cold int32 [1]: cold[0] = 1 if a pair routes to an expert the map has in no tier (-1)."""
    flat = ids.reshape(ids.shape[0] * ids.shape[1])
    if not flat.shape[0]:
        return
    grid = (flat.shape[0] + 127) // 128
    if cold is None:
        launch(_count_kernel, grid, 128, stream, flat, usage)
    else:
        launch(_count_cold_kernel, grid, 128, stream, flat, usage, slot_of, cold)


@cuda.jit
def _replay_kernel(table, positions, out):
    # table int32 [L, N, A], positions int32 [T] -> out [L, T, A] = table[:, positions % N, :]
    i = cuda.grid(1)
    L, N, A = table.shape
    T = positions.shape[0]
    if i < L * T * A:
        a = i % A
        t = (i // A) % T
        layer = i // (A * T)
        out[layer, t, a] = table[layer, positions[t] % N, a]


def replay_routes(table, positions, out, stream=0) -> None:
    """out int32 [L, T, A] <- the routing replay's ids of each MoE layer at each row's position:
    table[:, positions % N] (table int32 [L, N, A] on the device). Read from the step's positions
    on the device, so a captured step replays the trace at each launch's positions."""
    L, N, A = table.shape
    T = positions.shape[0]
    if out.shape != (L, T, A):
        raise ValueError(f"replay_routes: table {table.shape}, positions {positions.shape}, out {out.shape}")
    if L * T * A:
        launch(_replay_kernel, (L * T * A + 127) // 128, 128, stream, table, positions, out)
