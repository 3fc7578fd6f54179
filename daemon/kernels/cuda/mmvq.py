"""Matrix x few-vectors products on the GPU (1-16 tokens), dense and over selected experts.

llama.cpp's mul_mat_vec_q in shape: a group of `lpr` lanes (a warp, or a part of one for short
rows) owns one output row; its lanes stride over the row's 16-byte quant chunks (one coalesced
128-bit load each, layout.py), take int8 dp4a dot products against q8_1 activations
(quantize.py) or float dots for F32/F16/BF16 (vecdot.py), and reduce by warp shuffles. With T
columns each chunk is decoded once and dotted with all T activation rows.

The expert variant (`mul_mat_vec_ids`) is one launch for every (token, selected expert) pair of
a layer: grid.y runs over the T*A pairs and each block reads its expert id from `ids` on the
device, then the expert's slot in the stack from `slot_of`, so the router's output feeds it with
no host sync (and the launch can live in a CUDA graph). Given the pairs grouped by expert
(grouping.py), a block takes a run of up to `Tuning.group_cols` pairs of one expert instead, its
weights read once for all of them as the dense kernel's columns: a batch of 16 reads each shared
expert once, not once a token. A pair's result is the same bits either way (each column keeps its
own sums in the same order). `mul_mat_vec_glu[_ids]` fuses gate, up,
optional biases and the GLU (SwiGLU, or gpt-oss's clamped swiglu_oai) in one pass over both
weights; its output, quantized, feeds the down projection.

Legend: T = tokens (dense: up to 16 per pass over the weights, more run as tiles of 16; mmq.py
is the prefill path for quantized weights), A = experts per token, E = experts in the layer,
S = slots of an expert stack, N = output rows, K = values per row, stride = repacked row bytes.
Shapes:
    w        uint8   [N, stride] (dense) or [S, N, stride] (experts), repacked (layout.repack)
    act      Q8 (qs int8 [R, K], ds float32 [R, K/32, 2]) for quant weights (quantize.py), or
             float32 [R, K] for F32/F16/BF16 weights; R = T, or T*A for the down projection
    ids      int32   [T, A]   expert ids (the router's top-k)
    pairs, starts  int32 [P], [E+1]: the pairs grouped by expert (grouping.py), P = T*A
    slot_of  int32   [E]      expert id -> slot in the stack (>= 0); with a host tier, -2 - h: row h
                              of the host stack; -1: not here (its outputs not written)
    w_host   uint8   [H, N, stride]: the host tier, pinned host memory mapped into the device's
             address space (zero-copy: the kernel reads it over PCIe), repacked as w
    bias     float32 [N] (dense) or [E, N] (experts, indexed by expert id)
    out      float32 [T, N] (dense) or [T, A, N] (experts)
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np
from numba import cuda

from ...errors import UnsupportedError
from .. import quants as Q
from ..quants import block_size, type_name
from .layout import GPU_TYPES, repacked_stride
from .ptx import SIMULATOR, device, warp_sum
from .vecdot import FLOAT_ACT, VALUES, VECDOT
from .device import upload
from .launch import launch

MAX_COLS = 16
GLU_NONE, GLU_SWIGLU, GLU_SWIGLU_OAI = 0, 1, 2
_GLU = {"swiglu": GLU_SWIGLU, "swiglu_oai": GLU_SWIGLU_OAI}
_F1 = np.float32(1.0)
_EXP_CAP = np.float32(80.0)


class Q8(NamedTuple):
    """q8_1 activations on the device (quantize.quantize_q8_1)."""
    qs: object  # int8 [R, K]
    ds: object  # float32 [R, K/32, 2]


def _glu(g, u, kind, alpha, limit):
    # exp's argument capped at 80 (float32 exp overflows past 88): x / (1 + e^80) is ~1e-33 x,
    # where the uncapped form gives -0
    if kind == GLU_SWIGLU:
        return g / (_F1 + math.exp(min(-g, _EXP_CAP))) * u
    x = min(g, limit)
    y = min(max(u, -limit), limit)
    return x / (_F1 + math.exp(min(alpha * -x, _EXP_CAP))) * (y + _F1)


_glu_dev = device(_glu)


def _build(qtype: int, ncols: int, lpr: int, warps: int, ids_mode: bool, has_bias: bool,
           glu: int, unroll: int, host: bool = False, min_blocks: int = 0, grouped: bool = False):
    """The kernel for one combination (closure constants are compile-time constants)."""
    load, dot = VECDOT[qtype]
    per_chunk = VALUES[qtype]
    qk = block_size(qtype)[0]
    rows_per_block = warps * 32 // lpr
    two = glu != GLU_NONE
    nc = ncols

    # A lane's chunks' dots with every column's activation row, added to the column's sum one
    # chunk at a time. Columns past the tile's last token repeat the last one (their rows, not
    # written): no branch, so ptxas can issue every column's loads before the dp4a's.
    @cuda.jit(device=True, inline=True)
    def add1(acc, w, A0, A1, col_row, arow, last, k, c):
        for j in range(nc):
            r = col_row[j] if grouped else arow + min(j, last)
            acc[j] += dot(w, A0, A1, r, k, c)

    @cuda.jit(device=True, inline=True)
    def add2(acc, w, wb, A0, A1, col_row, arow, last, k, c):
        for j in range(nc):
            r = col_row[j] if grouped else arow + min(j, last)
            acc[j] += dot(w, A0, A1, r, k, c)
            acc[j] += dot(wb, A0, A1, r, k, c + lpr)

    @cuda.jit(device=True, inline=True)
    def add4(acc, w, wb, wc, wd, A0, A1, col_row, arow, last, k, c):
        for j in range(nc):
            r = col_row[j] if grouped else arow + min(j, last)
            acc[j] += dot(w, A0, A1, r, k, c)
            acc[j] += dot(wb, A0, A1, r, k, c + lpr)
            acc[j] += dot(wc, A0, A1, r, k, c + 2 * lpr)
            acc[j] += dot(wd, A0, A1, r, k, c + 3 * lpr)

    def kernel(W, W2, WH, WH2, A0, A1, ids, slot_of, pairs, starts, act_t, act_a, bias, bias2,
               out, n, k, stride, n_tok, alpha, limit):
        # W, W2: uint8 [S, N, stride]; WH, WH2: the host tier [H, N, stride] (read when `host`
        # and slot_of says so; placeholders otherwise); A0, A1: activations (see module doc);
        # ids int32 [T, A]; slot_of int32 [E]; pairs int32 [P], starts int32 [E+1] (grouped:
        # grouping.py); bias, bias2 float32 [E or 1, N]; out float32 [T, A, N].
        # grid: x = groups of rows_per_block rows; y = (token, expert) pair (ids), the run of up
        # to nc pairs of one expert starting at pairs[y] (grouped: blocks inside a run exit), or
        # the tile of nc tokens starting at y * nc (dense, n_tok tokens in all).
        tid = cuda.threadIdx.x
        row = cuda.blockIdx.x * rows_per_block + tid // lpr
        lane = tid % lpr
        a = 0
        e = 0
        slot = 0
        # grouped: column j's token, its expert slot in top-k order and its activation row (the
        # run's last pair repeated past its end)
        col_t = cuda.local.array(nc, np.int32)
        col_a = cuda.local.array(nc, np.int32)
        col_row = cuda.local.array(nc, np.int32)
        if grouped:
            # three rounds of loads (pairs, then the first pair's expert, then its run and slot),
            # each round's loads independent of each other
            y = cuda.blockIdx.y
            n_ids = ids.shape[1]
            n_pairs = ids.shape[0] * n_ids
            run = cuda.local.array(nc, np.int32)  # the pairs from pairs[y] on
            for j in range(nc):
                run[j] = pairs[min(y + j, n_pairs - 1)]
            filled = starts[starts.shape[0] - 1]
            p = run[0]
            t = 0
            arow = 0
            e = ids[p // n_ids, p % n_ids] if y < filled else 0
            first = starts[e]
            ncl = min(nc, starts[e + 1] - y) if y < filled and (y - first) % nc == 0 else 0
            slot = slot_of[e] if ncl > 0 else -1
            for j in range(nc):
                at = min(j, max(ncl, 1) - 1)
                p = run[0]
                for i in range(1, nc):  # constant indices only: run stays in registers
                    if i == at:
                        p = run[i]
                col_t[j] = p // n_ids
                col_a[j] = p % n_ids
                col_row[j] = col_t[j] * act_t + col_a[j] * act_a
        elif ids_mode:
            p = cuda.blockIdx.y
            t = p // ids.shape[1]
            a = p - t * ids.shape[1]
            e = ids[t, a]
            slot = slot_of[e] if 0 <= e < slot_of.shape[0] else -1
            arow = t * act_t + a * act_a
            ncl = 1
        else:
            t = cuda.blockIdx.y * nc
            arow = t
            ncl = min(nc, n_tok - t)
        if host and slot <= -2:  # a miss read in place from pinned host memory
            slot = -2 - slot
            W = WH
            W2 = WH2
        last = ncl - 1
        live = row < n and slot >= 0
        base = (slot * n + row) * stride
        acc = cuda.local.array(nc, np.float32)
        acc2 = cuda.local.array(nc, np.float32)
        for j in range(nc):
            acc[j] = np.float32(0.0)
            acc2[j] = np.float32(0.0)
        if live:
            nb = k // qk
            nch = k // per_chunk
            c = lane
            # a lane's chunks c, c + lpr, ... in rounds of `unroll`, then of 2 and 1 for the
            # rest: each round's loads in flight together. Its sums add one chunk at a time in
            # ascending order whatever the rounds, so `unroll` is a launch shape, not a change
            # of bits (a row's result is the same at any unroll and any column count).
            if unroll >= 4:
                while c + 3 * lpr < nch:
                    w = load(W, base, nb, c)
                    wb = load(W, base, nb, c + lpr)
                    wc = load(W, base, nb, c + 2 * lpr)
                    wd = load(W, base, nb, c + 3 * lpr)
                    if two:
                        w2 = load(W2, base, nb, c)
                        w2b = load(W2, base, nb, c + lpr)
                        w2c = load(W2, base, nb, c + 2 * lpr)
                        w2d = load(W2, base, nb, c + 3 * lpr)
                    add4(acc, w, wb, wc, wd, A0, A1, col_row, arow, last, k, c)
                    if two:
                        add4(acc2, w2, w2b, w2c, w2d, A0, A1, col_row, arow, last, k, c)
                    c += 4 * lpr
            if unroll >= 2:
                while c + lpr < nch:
                    w = load(W, base, nb, c)
                    wb = load(W, base, nb, c + lpr)
                    if two:
                        w2 = load(W2, base, nb, c)
                        w2b = load(W2, base, nb, c + lpr)
                    add2(acc, w, wb, A0, A1, col_row, arow, last, k, c)
                    if two:
                        add2(acc2, w2, w2b, A0, A1, col_row, arow, last, k, c)
                    c += 2 * lpr
            while c < nch:
                w = load(W, base, nb, c)
                if two:
                    w2 = load(W2, base, nb, c)
                add1(acc, w, A0, A1, col_row, arow, last, k, c)
                if two:
                    add1(acc2, w2, A0, A1, col_row, arow, last, k, c)
                c += lpr
        for j in range(nc):  # every lane takes part in the shuffles
            acc[j] = warp_sum(acc[j], lpr)
            if two:
                acc2[j] = warp_sum(acc2[j], lpr)
        if lane == 0 and row < n:
            for j in range(nc):
                if j < ncl:
                    v = acc[j]
                    if has_bias:
                        v += bias[e, row]
                    if two:
                        u = acc2[j]
                        if has_bias:
                            u += bias2[e, row]
                        v = _glu_dev(v, u, glu, alpha, limit)
                    if slot < 0:  # an expert not held here is left to whoever holds it
                        pass
                    elif grouped:
                        out[col_t[j], col_a[j], row] = v
                    else:
                        out[t + j, a, row] = v

    # named for profilers: mmvq_<type>_<ids|grouped|dense>[_glu]_c<cols>_l<lanes per row>
    mode = "grouped" if grouped else "ids" if ids_mode else "dense"
    kernel.__name__ = kernel.__qualname__ = (f"mmvq_{type_name(qtype)}_{mode}"
                                             f"{'_glu' if two else ''}{'_host' if host else ''}_c{ncols}_l{lpr}")
    if SIMULATOR or not min_blocks:  # _prepare passes 0 for one column
        return cuda.jit(kernel)
    # at its default occupancy target ptxas sinks each column's loads to their dot products
    # (docs/benchmarks.md, Issue 30 tenth step); fewer blocks an SM let it hoist them
    return cuda.jit(kernel, launch_bounds=(warps * 32, min_blocks))


_KERNELS: dict[tuple, object] = {}
_DUMMIES: dict[str, object] = {}


def _kernel(*key):
    k = _KERNELS.get(key)
    if k is None:
        k = _KERNELS[key] = _build(*key)
    return k


def _dummy(kind: str):
    """Placeholders for unused arguments (one small device array each, made once)."""
    if kind not in _DUMMIES:
        host = {"ids": np.zeros((1, 1), np.int32), "slot": np.zeros(1, np.int32),
                "bias": np.zeros((1, 1), np.float32), "w": np.zeros((1, 1, 16), np.uint8)}[kind]
        _DUMMIES[kind] = upload(host)
    return _DUMMIES[kind]


def choose_lpr(k: int) -> int:
    """Lanes per row: the most (a power of two, 4..32) that still give each lane >= 96 values.
    Measured on the H100 at 1 token (benchmarks/gpu_matmul.py, Q8_0/Q4_K/MXFP4): K = 768 rows
    were fastest with 8 lanes (Q8_0 8.6 vs 13.1 µs with 32), K = 2048 with 16, K = 4096 with
    32: too many lanes leave each with one or two loads in flight, too few leave rows serial."""
    lpr = 32
    while lpr > 4 and k // lpr < 96:
        lpr //= 2
    return lpr


def _check_weight(w, qtype: int, k: int, stack: bool):
    if qtype not in GPU_TYPES:
        raise UnsupportedError(f"no GPU matmul for {type_name(qtype)}")
    if w.ndim != (3 if stack else 2) or w.dtype != np.uint8:
        raise ValueError(f"weights must be uint8 [{'S, ' if stack else ''}N, stride], got "
                         f"{w.dtype} {w.shape}")
    if tuple(w.shape)[-1] != repacked_stride(qtype, k):
        raise ValueError(f"{type_name(qtype)} rows of {k} values are {repacked_stride(qtype, k)} "
                         f"bytes repacked, got {tuple(w.shape)[-1]} (weights must go through "
                         f"layout.repack)")


def _check_act(act, qtype: int, k: int):
    """-> (A0, A1, rows)"""
    if qtype in FLOAT_ACT:
        if isinstance(act, Q8) or act.dtype != np.float32 or act.ndim != 2 or act.shape[1] != k:
            raise ValueError(f"{type_name(qtype)} weights take float32 [R, {k}] activations")
        return act, act, act.shape[0]
    if not isinstance(act, Q8) or act.qs.shape[1] != k:
        raise ValueError(f"{type_name(qtype)} weights take q8_1 activations (Q8) of {k} values")
    return act.qs, act.ds, act.qs.shape[0]


def _bias(b, n: int, stack: bool):
    if b is None:
        return None
    if stack:
        if b.ndim != 2 or b.shape[1] != n:
            raise ValueError(f"expert biases must be float32 [E, {n}], got {b.shape}")
        return b
    if b.shape != (n,):
        raise ValueError(f"a dense bias must be float32 [{n}], got {b.shape}")
    return b.reshape(1, n)


class Tuning(NamedTuple):
    """Launch shape: lanes per output row (None: choose_lpr), warps per block, and how many
    chunks each lane has in flight (1, 2 or 4; None: `launch_unroll`). unroll is a shape only: the
    sums' order does not change with it. On the H100, 2 or 8 warps measured no better than these
    defaults at the best lane count. min_blocks: the blocks an SM that a multi-column kernel is
    compiled for (CUDA launch bounds; 0: ptxas's own target). group_cols: the columns of a
    grouped expert launch (pairs of one expert a block)."""
    lpr: int | None = None
    warps: int = 4
    unroll: int | None = None
    min_blocks: int = 1
    group_cols: int = 2


DEFAULT = Tuning()

# One-token GEMVs on the H200 (gpu_matmul.py --decode; docs/benchmarks.md, issue 30, fifteenth
# step), us a launch at unroll 1 / 2 / 4: qwen3-30b-a3b's experts, gate+up Q8_0 11.2 / 12.3 / 11.1,
# Q4_K 9.6 / 10.8 / 12.2, down Q4_K 7.6 / 8.7 / 8.7, gpt-oss-20b's MXFP4 gate+up 18.4 / 20.3 /
# 20.6: a block a pair keeps one chunk a lane in flight. One dense column, Q8_0 [5120, 2048]
# 7.6 / 7.0 / 6.6 and [5120, 2880] 11.8 / 9.9 / 9.7: four (other types' dense rows not measured).
_DENSE_ONE_COLUMN_UNROLL = {Q.Q8_0: 4}


def launch_unroll(qtype: int, ncols: int, experts: bool) -> int:
    """The chunks a lane has in flight where the Tuning leaves it open."""
    if experts and ncols == 1:
        return 1
    if ncols == 1:
        return _DENSE_ONE_COLUMN_UNROLL.get(qtype, 2)
    return 2


# The grouped expert launches' shapes, by (type, fused gate+up), where they measured faster than a
# block a pair at 16 tokens on the H200 (gpu_matmul.py --grouped; docs/benchmarks.md, issue 30,
# twelfth step): MXFP4 gate+up 181.8 against 227.9 us and down 117.6 against 130.7 (gpt-oss-20b's
# layer), Q8_0 gate+up 81.7 against 103.1 (qwen3-30b-a3b's); Q8_0's down, Q4_K and 4 columns
# measured slower. With a pair's sums one chunk at a time (fifteenth step) Q8_0's gate+up took
# 113.3 us at no launch bounds and unroll 2, 84.6 at 4 blocks an SM and unroll 1 (101.0 a block
# a pair; sixteenth step). A pair gives the same bits grouped or not, at any shape.
_GROUPED = {(Q.MXFP4, True): (4, 2, 1), (Q.MXFP4, False): (4, 2, 1), (Q.Q8_0, True): (4, 2, 1)}  # min_blocks, cols, unroll


def expert_tuning(qtype: int, glu: bool, grouped: bool) -> Tuning | None:
    """The expert launch's Tuning; None for a grouped launch where grouping does not pay."""
    if not grouped:
        return DEFAULT
    shape = _GROUPED.get((qtype, glu))
    if shape is None:
        return None
    return Tuning(min_blocks=shape[0], group_cols=shape[1], unroll=shape[2])


def _prepare(w, w2, qtype, k, act, ids, slot_of, act_t, act_a, bias, bias2, out, ncols, grid_y,
             n_tok, glu, alpha, limit, tuning, wh=None, wh2=None, groups=None):
    """-> (kernel, grid, block, args): everything a launch needs, so that a backend can launch
    the compiled kernel itself (e.g. through cuda.core, or into a CUDA graph)."""
    a0, a1, _ = _check_act(act, qtype, k)
    n = tuple(w.shape)[-2]
    lpr = tuning.lpr or choose_lpr(k)
    warps = 1 if SIMULATOR else tuning.warps  # simulated threads are Python threads
    unroll = tuning.unroll or launch_unroll(qtype, ncols, ids is not None)
    kern = _kernel(qtype, ncols, lpr, warps, ids is not None, bias is not None, glu,
                   unroll, wh is not None, tuning.min_blocks if ncols > 1 else 0,
                   groups is not None)
    rows_per_block = warps * 32 // lpr
    grid = ((n + rows_per_block - 1) // rows_per_block, grid_y)
    if wh is None:
        wh = wh2 = _dummy("w")
    args = (w, w if w2 is None else w2, wh, wh if wh2 is None else wh2, a0, a1,
            _dummy("ids") if ids is None else ids, _dummy("slot") if slot_of is None else slot_of,
            _dummy("slot") if groups is None else groups.pairs,
            _dummy("slot") if groups is None else groups.starts, act_t, act_a,
            _dummy("bias") if bias is None else bias, _dummy("bias") if bias2 is None else bias2,
            out, n, k, tuple(w.shape)[-1], n_tok, np.float32(alpha), np.float32(limit))
    return kern, grid, warps * 32, args


def _launch(*spec, stream=0, prepare_only=False):
    kern, grid, block, args = _prepare(*spec)
    if prepare_only:
        return kern, grid, block, args
    launch(kern, grid, block, stream, *args)
    return None


def _dense(w, w2, qtype, k, act, out, bias, bias2, glu, alpha, limit, tuning, stream,
           prepare_only=False):
    _check_weight(w, qtype, k, stack=False)
    if w2 is not None:
        _check_weight(w2, qtype, k, stack=False)
    _, _, t = _check_act(act, qtype, k)
    if t < 1:
        raise ValueError("no tokens")
    n = w.shape[0]
    if out is None:
        out = cuda.device_array((t, n), np.float32, stream=stream)
    ncols = min(t, MAX_COLS)
    prep = _launch(w, w2, qtype, k, act, None, None, 0, 0, _bias(bias, n, False),
                   _bias(bias2, n, False), out.reshape(t, 1, n), ncols, -(-t // ncols), t, glu,
                   alpha, limit, tuning, stream=stream, prepare_only=prepare_only)
    return prep or out


def _experts(w, w2, qtype, k, act, ids, slot_of, out, bias, bias2, act_per_pair, glu, alpha,
             limit, tuning, stream, prepare_only=False, wh=None, wh2=None, groups=None):
    for stack in (w, w2, wh, wh2):
        if stack is not None:
            _check_weight(stack, qtype, k, stack=True)
    hosts = [s for s in (wh, wh2) if s is not None]
    if hosts and (len(hosts) != (1 if w2 is None else 2) or wh is None
                  or any(s.shape[1] != w.shape[1] for s in hosts)):
        raise ValueError("a host tier needs a stack for each weight, with the same rows")
    _, _, rows = _check_act(act, qtype, k)
    t, a = ids.shape
    if rows != (t * a if act_per_pair else t):
        raise ValueError(f"{'T*A' if act_per_pair else 'T'} activation rows expected for ids "
                         f"{ids.shape}, got {rows}")
    n = w.shape[1]
    if out is None:
        out = cuda.device_array((t, a, n), np.float32, stream=stream)
    act_t, act_a = (a, 1) if act_per_pair else (1, 0)
    ncols = 1
    if groups is not None:
        if groups.n_expert != slot_of.shape[0] or groups.pairs.shape[0] < t * a:
            raise ValueError(f"groups of {groups.n_expert} experts and {groups.pairs.shape[0]} pairs "
                             f"do not fit {slot_of.shape[0]} experts and ids {ids.shape}")
        ncols = min(t, tuning.group_cols)
    prep = _launch(w, w2, qtype, k, act, ids, slot_of, act_t, act_a, _bias(bias, n, True),
                   _bias(bias2, n, True), out, ncols, t * a, t, glu, alpha, limit, tuning, wh, wh2,
                   groups, stream=stream, prepare_only=prepare_only)
    return prep or out


def mul_mat_vec(w, qtype: int, k: int, act, out=None, bias=None, *, tuning=DEFAULT, stream=0,
                prepare_only=False):
    """out[T, N] = act[T, K] . w[N, K]^T (+ bias[N]) in one launch. Meant for T <= 16 (one pass
    over the weights); larger T runs as tiles of 16 tokens (the float-weight prefill path).
    Every launcher here takes prepare_only=True: then it launches nothing and returns
    (kernel, grid, block, args) for a launch of the caller's own (graph capture, cuda.core)."""
    return _dense(w, None, qtype, k, act, out, bias, None, GLU_NONE, 0.0, 0.0, tuning, stream,
                  prepare_only)


def mul_mat_vec_glu(w_gate, w_up, qtype: int, k: int, act, glu: str = "swiglu", bias_gate=None,
                    bias_up=None, *, alpha=1.702, limit=7.0, out=None, tuning=DEFAULT, stream=0,
                    prepare_only=False):
    """out[T, F] = glu(act . gate^T (+ bias_gate), act . up^T (+ bias_up)): gate and up read in
    one pass, the activation shared. glu: "swiglu" (silu(g) * u) or "swiglu_oai" (gpt-oss:
    x = min(g, limit), y = clamp(u, -limit, limit), x * sigmoid(alpha x) * (y + 1))."""
    return _dense(w_gate, w_up, qtype, k, act, out, bias_gate, bias_up, _glu_kind(glu), alpha,
                  limit, tuning, stream, prepare_only)


def mul_mat_vec_ids(w, qtype: int, k: int, act, ids, slot_of, out=None, bias=None,
                    act_per_pair=False, *, w_host=None, groups=None, tuning=DEFAULT, stream=0,
                    prepare_only=False):
    """out[t, a, N] = act[row] . w[slot_of[ids[t, a]]]^T (+ bias[ids[t, a]]) for every pair, in
    one launch. row = t (gate/up: the token's activation) or t*A + a with act_per_pair (down:
    each pair's own GLU output). w_host: a host tier (module doc), for slots -2 - h.
    groups (grouping.group_by_expert(ids, E)): each expert's weights read once for runs of up
    to tuning.group_cols of its pairs (every pair's result the same bits either way)."""
    return _experts(w, None, qtype, k, act, ids, slot_of, out, bias, None, act_per_pair,
                    GLU_NONE, 0.0, 0.0, tuning, stream, prepare_only, w_host, None, groups)


def mul_mat_vec_glu_ids(w_gate, w_up, qtype: int, k: int, act, ids, slot_of, glu="swiglu",
                        bias_gate=None, bias_up=None, *, alpha=1.702, limit=7.0, out=None,
                        host_gate=None, host_up=None, groups=None, tuning=DEFAULT, stream=0,
                        prepare_only=False):
    """out[t, a, F] = glu(gate_e . act[t] (+ bias), up_e . act[t] (+ bias)) with e = ids[t, a],
    for all pairs in one launch (see mul_mat_vec_glu for glu). host_gate, host_up: a host tier.
    groups: as for mul_mat_vec_ids."""
    return _experts(w_gate, w_up, qtype, k, act, ids, slot_of, out, bias_gate, bias_up, False,
                    _glu_kind(glu), alpha, limit, tuning, stream, prepare_only, host_gate, host_up,
                    groups)


def _glu_kind(glu: str) -> int:
    if glu not in _GLU:
        raise ValueError(f"unknown glu {glu!r} (swiglu, swiglu_oai)")
    return _GLU[glu]
