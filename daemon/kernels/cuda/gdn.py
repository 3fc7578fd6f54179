"""Gated DeltaNet on the device (qwen3next, qwen35moe; docs/qwen3next.md "Gated DeltaNet"):
the causal conv with its rolling state, the fused gated delta rule, the gated RMSNorm, and the
small elementwise ops of the hybrid families (sigmoid gate, head split).

Legend: T = rows of the call, S = sequences, C = conv channels (2*Hk*Dk + Hv*Dv), Kc = conv
kernel width, Hk / Hv = key / value heads, Dk / Dv = their sizes, NR = recurrent layers of the
model, SL = sequence slots of the state pool, D = a normed head's size, P = parts of a head.

State layout (a GPU cache object owns these arrays and hands out slots, cuda_cache.py):
    conv:  f32 [SL, NR, C, Kc-1]      the previous Kc-1 inputs of every channel, oldest first
    state: f32 [SL, NR, Hv, Dv, Dk]   M = S^T per value head: row j over values, keys contiguous
A call's rows are grouped by sequence: sequence s has rows offsets[s]..offsets[s+1]-1 (a decode
step: row s alone, no offsets array), and its state is slot slots[first row] of layer `layer`.

Kernels:
- conv_silu: not recurrent, so parallel over rows: a block per row, a thread per channel
  (coalesced), its window from the rows before it in its sequence (found by a search of
  offsets) or from the conv state where the window reaches before the sequence's first row.
  out = silu(sum_{i=0}^{Kc-1} in[t+i] * w[c, i]) summed from 0 in ascending i (_conv_row, as
  the fused decode). A second launch, after every output has read the old state (stream
  order), writes each sequence's last Kc-1 inputs back, a thread per (channel, sequence)
  (partly old state when the sequence has fewer rows than Kc-1).
- gated_delta_net: grid (Hv, S, Dv / rows per block). A group of LW lanes (LW = Dk rounded up to
  a power of two, at most 32: one warp for the real Dk = 128) owns one value row j of M, each
  lane holding Dk/LW keys of it in registers (loaded coalesced: lanes over consecutive keys)
  for the whole call; the dot products over keys are lane-group butterflies (ptx.warp_sum). Per
  row: the group l2-norms q and k of its key head itself (rms_norm with eps/Dk, then times
  1/sqrt(Dk), as ggml's build_gdn_l2_norm), beta = sigmoid(b), decay = exp(softplus(a +
  dt_bias) * ssm_a), then M_j *= decay; delta = (v_j - M_j.k) * beta; M_j += k * delta;
  o_j = (M_j.q) * 1/sqrt(Dv). The next row's inputs are loaded before the current row is
  computed, so a prefill's sequential chain waits on memory once, not once per row. The state
  is written back once at the end. A decode step of one sequence with Hv = 32, Dv = 128 is 1024
  blocks of 4 warps, each reading 2 KiB of state: the 2 MiB of a layer is read and written once,
  spread over the whole GPU. Prefill is sequential over a sequence's rows, parallel over heads,
  sequences and value rows. Given the sequences' row counts, those of gdn_chunked.MIN_ROWS rows
  or more take the chunked form instead (gdn_chunked.py: the same rule within f32 rounding,
  sequential over chunks of rows, not rows); this kernel skips them (`below`).
- gated_rms_norm: one block per (head, row): rms_norm over D (mean of squares, 1/sqrt(mean +
  eps)), times weight, times silu(z), rounded in that order (ggml: rms_norm, mul, mul).
- decode_step: the three above for a decode step (one row a sequence) in one launch, with the
  delta rule's grid: each block computes the conv of its key head's q and k channels and of its
  value rows' v channels itself (a few MACs each) from the conv state; the last block of the key
  head to finish (a ticket) moves the q/k windows on, each value row's group its own v window,
  and the last block of each value head norms the head's outputs. The same device functions in
  the same order as the three kernels, so the same bits (tests/kernels/cuda/test_ops_gdn.py).
- sigmoid_mul: y * 1/(1 + exp(-z)), z per element or one per row.
- split_heads: a copy of [T, H, P, d] into P arrays [T, H, d] (one output buffer [P, T, H, d]).

Numerics: float32 throughout, expf/logf of the device (the CPU's silu is ggml's SIMD exp, its
sums of squares double, its dot products SIMD-ordered): the GPU agrees to f32 rounding, not bit
for bit. Every reduction is a fixed butterfly order: the same inputs give the same bits on every
run, and a sequence's results do not depend on the other sequences of the call.
"""

from __future__ import annotations

import functools
import math

import numpy as np
from numba import cuda

from .device import block_sum, placeholder, sigmoid
from .launch import launch
from .ptx import warp_sum

_F32 = np.float32
_THREADS = 128  # elementwise kernels; and the conv's channels per block
_GDN_THREADS = 128  # threads of a delta-net block (4 warps): 128 / LW value rows each
_MAX_THREADS = 1024
_HELD = 8  # values of a normed head each thread holds: heads up to 8192 values
_NO_LIMIT = 2**31 - 1  # gdn's `below` when no sequence takes the chunked form


def _grid(n: int) -> int:
    return (n + _THREADS - 1) // _THREADS


def lanes(dk: int) -> int:
    """Lanes that share one value row of the state: Dk rounded up to a power of two, <= 32."""
    lw = 1
    while lw < dk and lw < 32:
        lw *= 2
    return lw


# -- conv ------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def _conv_row(KC: int):
    """silu(win . ws[:KC-1] + cur * ws[KC-1]), summed in ascending order: one row of a channel's
    conv (win: the KC-1 inputs before it, oldest first). Shared by the conv and the fused decode."""

    @cuda.jit(device=True, inline=True)
    def conv_row(win, ws, cur):
        acc = np.float32(0.0)
        for i in range(KC - 1):
            acc += win[i] * ws[i]
        acc += cur * ws[KC - 1]
        return acc / (np.float32(1.0) + math.exp(-acc))

    return conv_row


@functools.lru_cache(maxsize=None)
def _conv_kernel(KC: int):
    """The conv kernel for kernel width KC (a constant: the window lives in registers)."""
    KS = max(KC - 1, 1)  # local arrays need a positive size; only KC-1 entries are used
    conv_row = _conv_row(KC)

    @cuda.jit
    def conv(x, w, conv_state, layer, slots, offsets, has_offsets, out):
        """x, out: f32 [T, C]; w: f32 [C, KC]; conv_state: f32 [SL, NR, C, KC-1] (read only);
        slots: int32 [T]; offsets: int32 [S+1] (read when has_offsets, else row t is sequence t).
        Grid (T, ceil(C / threads)): one row a block, channels over its threads."""
        t = cuda.blockIdx.x
        c = cuda.blockIdx.y * cuda.blockDim.x + cuda.threadIdx.x
        if c >= x.shape[1]:
            return
        r0 = t  # the first row of t's sequence: a search of offsets (the same for the whole block)
        if has_offsets:
            lo = 0
            hi = offsets.shape[0] - 1
            while hi - lo > 1:
                mid = (lo + hi) // 2
                if offsets[mid] <= t:
                    lo = mid
                else:
                    hi = mid
            r0 = offsets[lo]
        slot = slots[r0]
        win = cuda.local.array(KS, np.float32)  # the KC-1 inputs before row t, oldest first
        ws = cuda.local.array(KC, np.float32)
        for i in range(KC - 1):
            p = t - (KC - 1) + i
            win[i] = x[p, c] if p >= r0 else conv_state[slot, layer, c, p - r0 + KC - 1]
        for i in range(KC):
            ws[i] = w[c, i]
        out[t, c] = conv_row(win, ws, x[t, c])

    return conv


@functools.lru_cache(maxsize=None)
def _conv_state_kernel(KC: int):
    """The conv state's update for kernel width KC, after the conv kernel has read it."""
    KS = max(KC - 1, 1)

    @cuda.jit
    def conv_state_update(x, conv_state, layer, slots, offsets, has_offsets):
        """Each sequence's window moved on by its rows: the last KC-1 inputs, taking old state
        where it has fewer rows. Arrays as the conv kernel's. Grid (ceil(C / threads), S)."""
        c = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
        s = cuda.blockIdx.y
        if c >= x.shape[1]:
            return
        r0 = s
        r1 = s + 1
        if has_offsets:
            r0 = offsets[s]
            r1 = offsets[s + 1]
        slot = slots[r0]
        old = cuda.local.array(KS, np.float32)
        for i in range(KC - 1):
            old[i] = conv_state[slot, layer, c, i]
        for i in range(KC - 1):
            p = r1 - (KC - 1) + i
            conv_state[slot, layer, c, i] = x[p, c] if p >= r0 else old[p - r0 + KC - 1]

    return conv_state_update


def _rows_of(slots, offsets, n_seq: int, T: int):
    """(offsets, has_offsets) for a launch: offsets None = one row per sequence."""
    if offsets is None:
        if n_seq != T:
            raise ValueError(f"{n_seq} sequences of one row each need {n_seq} rows, got {T}")
        return placeholder(np.int32), False
    if offsets.shape != (n_seq + 1,):
        raise ValueError(f"offsets {offsets.shape} for {n_seq} sequences")
    return offsets, True


def conv_silu(x, weight, conv_state, layer: int, slots, offsets, n_seq: int, out, stream=0) -> None:
    """out = silu(causal depthwise conv of each sequence's rows of x, after its conv state), and
    the state moved on by the sequence's rows.

    x, out: device f32 [T, C]; weight: f32 [C, Kc]; conv_state: f32 [SL, NR, C, Kc-1] (layer
    `layer` of slot slots[first row] per sequence, updated in place); slots: int32 [T];
    offsets: int32 [n_seq + 1] row offsets of the sequences, or None when each has one row.
    out must not be x (a row's window reads the rows before it)."""
    T, C = x.shape
    KC = weight.shape[1]
    if weight.shape[0] != C or out.shape != (T, C) or conv_state.shape[2:] != (C, KC - 1) or slots.shape[0] != T:
        raise ValueError(f"conv_silu: x {x.shape}, weight {weight.shape}, state {conv_state.shape}, "
                         f"out {out.shape}, slots {slots.shape}")
    offsets, has = _rows_of(slots, offsets, n_seq, T)
    if T and C:  # the state moves on once every output has read it: the next launch, in stream order
        launch(_conv_kernel(KC), (T, _grid(C)), _THREADS, stream, x, weight, conv_state, int(layer), slots, offsets,
               has, out)
        if KC > 1:
            launch(_conv_state_kernel(KC), (_grid(C), n_seq), _THREADS, stream, x, conv_state, int(layer), slots,
                   offsets, has)


# -- the gated delta rule --------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def _delta_row(DK: int):
    """One row of the gated delta rule for one value row j of M, by a group of LW lanes (each
    holding R keys: qs, ks, m): the l2 norms of q and k (ggml_rms_norm(x, eps/DK), then times
    1/sqrt(DK)), beta = sigmoid(b), decay = exp(softplus(a + dt_bias) * ssm_a), M_j *= decay,
    delta = (v_j - M_j.k) * beta, M_j += k * delta -> M_j.q (qs, ks normed in place, m updated).
    Shared by the delta-net kernel and the fused decode."""
    LW = lanes(DK)
    R = (DK + LW - 1) // LW

    @cuda.jit(device=True, inline=True)
    def delta_row(qs, ks, vj, bt, at, m, dtb, sa, eps_k, k_scale):
        sq = np.float32(0.0)
        sk = np.float32(0.0)
        for u in range(R):
            sq += qs[u] * qs[u]
            sk += ks[u] * ks[u]
        sq = warp_sum(sq, LW)
        sk = warp_sum(sk, LW)
        q_norm = np.float32(1.0) / math.sqrt(sq / np.float32(DK) + eps_k)
        k_norm = np.float32(1.0) / math.sqrt(sk / np.float32(DK) + eps_k)
        beta = sigmoid(bt)
        x = at + dtb
        if x <= np.float32(20.0):
            x = math.log(np.float32(1.0) + math.exp(x))
        decay = math.exp(x * sa)
        dot = np.float32(0.0)
        for u in range(R):
            qs[u] = (qs[u] * q_norm) * k_scale
            ks[u] = (ks[u] * k_norm) * k_scale
            m[u] *= decay
            dot += m[u] * ks[u]
        dot = warp_sum(dot, LW)
        delta = (vj - dot) * beta
        dot = np.float32(0.0)
        for u in range(R):
            m[u] += ks[u] * delta
            dot += m[u] * qs[u]
        return warp_sum(dot, LW)

    return delta_row


@functools.lru_cache(maxsize=None)
def _gdn_kernel(DK: int):
    """The delta-net kernel for key size DK (a constant: each lane's keys live in registers)."""
    LW = lanes(DK)
    R = (DK + LW - 1) // LW  # keys per lane
    delta_row = _delta_row(DK)

    @cuda.jit(device=True, inline=True)
    def load_row(qkv, b, a, t, h, q0, k0, v0, lane, qs, ks):
        """Row t's q and k of this lane (qs, ks), and its v_j, b and a."""
        for u in range(R):
            i = lane + u * LW
            qv = np.float32(0.0)
            kv = np.float32(0.0)
            if i < DK:
                qv = qkv[t, q0 + i]
                kv = qkv[t, k0 + i]
            qs[u] = qv
            ks[u] = kv
        return qkv[t, v0], b[t, h], a[t, h]

    @cuda.jit
    def gdn(qkv, b, a, dt_bias, ssm_a, state, layer, slots, offsets, has_offsets, below, n_k_head, tiled, eps_k,
            k_scale, o_scale, out):
        """qkv: f32 [T, C]; b, a: f32 [T, Hv]; dt_bias, ssm_a: f32 [Hv]; state: f32 [SL, NR, Hv,
        Dv, DK]; slots: int32 [T]; offsets: int32 [S+1] (read when has_offsets); below: sequences
        of this many rows or more are left alone (the chunked form's); eps_k: eps/DK; k_scale:
        1/sqrt(DK); o_scale: 1/sqrt(Dv); out: f32 [T, Hv, Dv].
        Grid (Hv, S, ceil(Dv / (threads / LW))); lanes tid % LW of group tid // LW hold row j."""
        h = cuda.blockIdx.x
        s = cuda.blockIdx.y
        tid = cuda.threadIdx.x
        lane = tid % LW
        j = cuda.blockIdx.z * (cuda.blockDim.x // LW) + tid // LW
        Hv = out.shape[1]
        Dv = out.shape[2]
        live = j < Dv
        jj = j if live else Dv - 1  # a spare group computes row Dv-1 and writes nothing: every lane
        #                             of the block takes part in the butterflies
        kh = h % n_k_head if tiled else h // (Hv // n_k_head)
        Kd = n_k_head * DK
        q0 = kh * DK
        k0 = Kd + kh * DK
        v0 = 2 * Kd + h * Dv + jj
        r0 = s
        r1 = s + 1
        if has_offsets:
            r0 = offsets[s]
            r1 = offsets[s + 1]
        if r1 - r0 >= below:
            return
        slot = slots[r0]

        m = cuda.local.array(R, np.float32)  # this lane's keys of row j of M
        for u in range(R):
            i = lane + u * LW
            m[u] = state[slot, layer, h, jj, i] if i < DK else np.float32(0.0)
        dtb = dt_bias[h]
        sa = ssm_a[h]
        qs = cuda.local.array(R, np.float32)
        ks = cuda.local.array(R, np.float32)
        nq = cuda.local.array(R, np.float32)  # the next row's inputs, loaded ahead
        nk = cuda.local.array(R, np.float32)
        nv, nb, na = load_row(qkv, b, a, r0, h, q0, k0, v0, lane, nq, nk)
        for t in range(r0, r1):
            for u in range(R):
                qs[u] = nq[u]
                ks[u] = nk[u]
            vj = nv
            bt = nb
            at = na
            if t + 1 < r1:
                nv, nb, na = load_row(qkv, b, a, t + 1, h, q0, k0, v0, lane, nq, nk)
            o = delta_row(qs, ks, vj, bt, at, m, dtb, sa, eps_k, k_scale)
            if live and lane == 0:
                out[t, h, j] = o * o_scale
        if live:
            for u in range(R):
                i = lane + u * LW
                if i < DK:
                    state[slot, layer, h, j, i] = m[u]

    return gdn


def check_rule(qkv, b, a, dt_bias, ssm_a, state, slots, n_k_head: int, head_k: int, out, what: str):
    """-> (T, Hv, Dv, Dk) of a delta rule's call, after its shape checks (gated_delta_net's arguments)."""
    T, C = qkv.shape
    _, _, Hv, Dv, Dk = state.shape
    if (Dk != head_k or C != 2 * n_k_head * Dk + Hv * Dv or Hv % n_k_head or b.shape != (T, Hv)
            or a.shape != (T, Hv) or dt_bias.shape != (Hv,) or ssm_a.shape != (Hv,) or out.shape != (T, Hv, Dv)
            or slots.shape[0] != T):
        raise ValueError(f"{what}: qkv {qkv.shape}, b {b.shape}, a {a.shape}, state {state.shape}, "
                         f"Hk {n_k_head}, Dk {head_k}, out {out.shape}")
    return T, Hv, Dv, Dk


def gated_delta_net(qkv, b, a, dt_bias, ssm_a, state, layer: int, slots, offsets, n_seq: int, n_k_head: int,
                    head_k: int, tiled: bool, eps: float, out, stream=0, rows=None, empty=None) -> None:
    """The gated delta rule over each sequence's rows (see the module doc).

    qkv: device f32 [T, C] (q [Hk*Dk] | k [Hk*Dk] | v [Hv*Dv], head-major); b, a: f32 [T, Hv];
    dt_bias, ssm_a: f32 [Hv]; state: f32 [SL, NR, Hv, Dv, Dk], layer `layer` of slot slots[first
    row] per sequence, updated in place; slots: int32 [T]; offsets: int32 [n_seq + 1] or None
    (one row per sequence); tiled: value head h reads key head h % Hk (else h // (Hv/Hk));
    eps: the RMS eps of the l2 norms. out: f32 [T, Hv, Dv].

    rows: the sequences' row counts on the host (int [n_seq]) when the caller has them: those of
    at least gdn_chunked.MIN_ROWS rows then take the chunked form (gdn_chunked.py, its scratch
    from empty(shape, dtype)), the others this kernel; a sequence's form depends on its own rows
    only. None: every sequence this kernel."""
    T, Hv, Dv, Dk = check_rule(qkv, b, a, dt_bias, ssm_a, state, slots, n_k_head, head_k, out, "gated_delta_net")
    offs, has = _rows_of(slots, offsets, n_seq, T)
    if not T:
        return
    below = _NO_LIMIT
    if rows is not None and has:
        from . import gdn_chunked  # it imports this module

        long = np.asarray(rows) >= gdn_chunked.MIN_ROWS
        if long.any():
            below = gdn_chunked.MIN_ROWS
            gdn_chunked.gated_delta_net(qkv, b, a, dt_bias, ssm_a, state, layer, slots, offsets, n_seq, n_k_head,
                                        head_k, tiled, eps, out, stream, min_rows=below,
                                        chunks=gdn_chunked.n_chunks(rows, min_rows=below), empty=empty)
            if long.all():
                return
    threads, blocks, eps_k, k_scale, o_scale = _gdn_config(Dk, Dv, float(eps))
    launch(_gdn_kernel(Dk), (Hv, n_seq, blocks), threads, stream, qkv, b, a, dt_bias, ssm_a, state, int(layer), slots,
           offs, has, below, int(n_k_head), bool(tiled), eps_k, k_scale, o_scale, out)


@functools.lru_cache(maxsize=None)
def _decode_kernel(DK: int, KC: int):
    """The fused decode of a delta-net layer for key size DK and conv width KC (constants)."""
    LW = lanes(DK)
    R = (DK + LW - 1) // LW
    KS = max(KC - 1, 1)
    conv_row = _conv_row(KC)
    delta_row = _delta_row(DK)

    @cuda.jit(device=True, inline=True)
    def conv_channel(x, w, conv_state, slot, layer, t, c):
        """Channel c's conv output at row t (conv_row over its window in the state)."""
        win = cuda.local.array(KS, np.float32)
        ws = cuda.local.array(KC, np.float32)
        for i in range(KC - 1):
            win[i] = conv_state[slot, layer, c, i]
        for i in range(KC):
            ws[i] = w[c, i]
        return conv_row(win, ws, x[t, c])

    @cuda.jit(device=True, inline=True)
    def move_window(x, conv_state, slot, layer, t, c):
        """Channel c's window moved on by row t (the oldest input out, x[t, c] in)."""
        for i in range(KC - 2):
            conv_state[slot, layer, c, i] = conv_state[slot, layer, c, i + 1]
        if KC > 1:
            conv_state[slot, layer, c, KC - 2] = x[t, c]

    @cuda.jit
    def decode(x, w, conv_state, b, a, dt_bias, ssm_a, state, layer, slots, n_k_head, tiled, eps_k, k_scale, o_scale,
               norm_w, z, norm_eps, norm_threads, o, out, tickets):
        """Row s of sequence s (a decode step): x, z: f32 [S, C], [S, Hv*Dv]; w: f32 [C, KC];
        conv_state, state, b, a, dt_bias, ssm_a, slots as conv_silu and gated_delta_net; norm_w
        f32 [Dv]; o: f32 [S, Hv, Dv] (the rule's outputs, read back by the norm); out: f32
        [S, Hv*Dv]; tickets: int32 [SL, Hk + Hv], zero between launches. Grid (Hv, S, Dv / rows
        a block) as gated_delta_net's."""
        h = cuda.blockIdx.x
        t = cuda.blockIdx.y
        tid = cuda.threadIdx.x
        lane = tid % LW
        j = cuda.blockIdx.z * (cuda.blockDim.x // LW) + tid // LW
        Hv = o.shape[1]
        Dv = o.shape[2]
        live = j < Dv
        jj = j if live else Dv - 1  # a spare group computes row Dv-1 and writes nothing
        kh = h % n_k_head if tiled else h // (Hv // n_k_head)
        Kd = n_k_head * DK
        q0 = kh * DK
        k0 = Kd + kh * DK
        cv = 2 * Kd + h * Dv + jj
        slot = slots[t]
        # the conv of this lane's q and k channels and of row jj's v channel: every block of the
        # key head computes its q and k (a few MACs a channel) rather than wait for one that does
        qs = cuda.local.array(R, np.float32)
        ks = cuda.local.array(R, np.float32)
        m = cuda.local.array(R, np.float32)
        for u in range(R):
            i = lane + u * LW
            qv = np.float32(0.0)
            kv = np.float32(0.0)
            mv = np.float32(0.0)
            if i < DK:
                qv = conv_channel(x, w, conv_state, slot, layer, t, q0 + i)
                kv = conv_channel(x, w, conv_state, slot, layer, t, k0 + i)
                mv = state[slot, layer, h, jj, i]
            qs[u] = qv
            ks[u] = kv
            m[u] = mv
        vj = conv_channel(x, w, conv_state, slot, layer, t, cv)
        ov = delta_row(qs, ks, vj, b[t, h], a[t, h], m, dt_bias[h], ssm_a[h], eps_k, k_scale)
        if live:
            if lane == 0:
                o[t, h, j] = ov * o_scale
                move_window(x, conv_state, slot, layer, t, cv)  # only this group reads channel cv
            for u in range(R):
                i = lane + u * LW
                if i < DK:
                    state[slot, layer, h, j, i] = m[u]
        # tickets: the last block of the key head to have read the q and k windows moves them on;
        # the last of the value head's blocks norms its outputs
        cuda.threadfence()
        flags = cuda.shared.array(2, np.int32)
        cuda.syncthreads()
        if tid == 0:
            n_qk = (Hv // n_k_head) * cuda.gridDim.z
            flags[0] = cuda.atomic.add(tickets, (slot, kh), 1) == n_qk - 1
            flags[1] = cuda.atomic.add(tickets, (slot, n_k_head + h), 1) == cuda.gridDim.z - 1
        cuda.syncthreads()
        if flags[0] != 0:
            if tid < LW:
                for u in range(R):
                    i = lane + u * LW
                    if i < DK:
                        move_window(x, conv_state, slot, layer, t, q0 + i)
                        move_window(x, conv_state, slot, layer, t, k0 + i)
            if tid == 0:
                tickets[slot, kh] = 0
        if flags[1] != 0:
            buf = cuda.shared.array(32, np.float32)
            _gated_norm_head(o, norm_w, z, norm_eps, out, t, h, norm_threads, buf)
            if tid == 0:
                tickets[slot, n_k_head + h] = 0

    return decode


def fused_decode_fits(head_k: int, head_v: int) -> bool:
    """decode_step's gated norm fits one block of the delta-net launch."""
    threads = _gdn_config(head_k, head_v, 0.0)[0]
    return head_v <= _MAX_THREADS * _HELD and _norm_threads(head_v) <= threads


def decode_step(x, conv_weight, conv_state, b, a, dt_bias, ssm_a, state, layer: int, slots, n_k_head: int,
                head_k: int, tiled: bool, eps: float, norm_weight, z, o, out, tickets, stream=0) -> None:
    """A decode step of a delta-net layer in one launch: conv_silu, gated_delta_net and
    gated_rms_norm of one row per sequence, the same bits as the three launches (their shared
    device functions, in their order).

    x: device f32 [S, C] (the qkv projection, before the conv); z, out: f32 [S, Hv*Dv]; o: f32
    [S, Hv, Dv] (scratch: the rule's outputs); tickets: int32 [SL, Hk + Hv], zero (and zero again
    after the launch); the rest as conv_silu and gated_delta_net (eps: the l2 norms' and the
    gated norm's RMS eps)."""
    S, C = x.shape
    _, _, Hv, Dv, Dk = state.shape
    KC = conv_weight.shape[1]
    if (Dk != head_k or C != 2 * n_k_head * Dk + Hv * Dv or Hv % n_k_head or conv_weight.shape[0] != C
            or conv_state.shape[2:] != (C, KC - 1) or b.shape != (S, Hv) or a.shape != (S, Hv)
            or o.shape != (S, Hv, Dv) or out.shape != (S, Hv * Dv) or z.shape != (S, Hv * Dv)
            or norm_weight.shape != (Dv,) or slots.shape != (S,) or tickets.shape[1:] != (n_k_head + Hv,)
            or not fused_decode_fits(Dk, Dv)):
        raise ValueError(f"decode_step: x {x.shape}, state {state.shape}, conv {conv_state.shape}, o {o.shape}, "
                         f"out {out.shape}, tickets {tickets.shape}")
    if not S:
        return
    threads, blocks, eps_k, k_scale, o_scale = _gdn_config(Dk, Dv, float(eps))
    launch(_decode_kernel(Dk, KC), (Hv, S, blocks), threads, stream, x, conv_weight, conv_state, b, a, dt_bias, ssm_a,
           state, int(layer), slots, int(n_k_head), bool(tiled), eps_k, k_scale, o_scale, norm_weight, z, _F32(eps),
           _norm_threads(Dv), o, out, tickets)


@functools.lru_cache(maxsize=64)
def _gdn_config(Dk: int, Dv: int, eps: float):
    """(threads, blocks per head, eps/Dk, 1/sqrt(Dk), 1/sqrt(Dv)) of a delta-net launch, each
    rounded in f32 as ggml does (worked out once: a decode step launches this every layer)."""
    lw = lanes(Dk)
    threads = min(_GDN_THREADS, -(-(Dv * lw) // 32) * 32)  # a multiple of 32 (whole warps)
    blocks = -(-Dv // (threads // lw))
    return (threads, blocks, _F32(_F32(eps) / _F32(Dk)), _F32(_F32(1.0) / np.sqrt(_F32(Dk))),
            _F32(_F32(1.0) / np.sqrt(_F32(Dv))))


# -- gated RMSNorm, sigmoid gate, head split -------------------------------------------------


@cuda.jit(device=True, inline=True)
def _gated_norm_head(x, w, z, eps, out, t, h, nt, buf):
    """Head h of row t: out = rms_norm(x[t, h]) * w * silu(z). Threads tid < nt hold values
    tid + u*nt; every thread of the block calls it (a block sum), those past nt hold none."""
    tid = cuda.threadIdx.x
    D = x.shape[2]
    xs = cuda.local.array(_HELD, np.float32)
    acc = np.float32(0.0)
    for u in range(_HELD):
        i = tid + u * nt
        v = x[t, h, i] if i < D and tid < nt else np.float32(0.0)
        xs[u] = v
        acc += v * v
    total = block_sum(acc, buf, tid, nt)
    scale = np.float32(1.0) / math.sqrt(total / np.float32(D) + eps)
    for u in range(_HELD):
        i = tid + u * nt
        if i < D and tid < nt:
            g = z[t, h * D + i]
            out[t, h * D + i] = ((xs[u] * scale) * w[i]) * (g / (np.float32(1.0) + math.exp(-g)))


@cuda.jit
def _gated_rms_norm(x, w, z, eps, out):
    """x: f32 [T, H, D]; w: f32 [D]; z, out: f32 [T, H*D]. Grid (H, T) blocks."""
    buf = cuda.shared.array(32, np.float32)
    _gated_norm_head(x, w, z, eps, out, cuda.blockIdx.y, cuda.blockIdx.x, cuda.blockDim.x, buf)


def _norm_threads(n: int) -> int:
    t = 32
    while t * _HELD < n and t < _MAX_THREADS:
        t *= 2
    if t * _HELD < n:
        raise ValueError(f"gated_rms_norm: heads of {n} values exceed {_MAX_THREADS * _HELD}")
    return t


def gated_rms_norm(x, weight, z, eps: float, out, stream=0) -> None:
    """out = rms_norm(x) * weight * silu(z) per head. x: device f32 [T, H, D]; weight: [D];
    z, out: f32 [T, H*D] (out may be z, or x's buffer)."""
    T, H, D = x.shape
    if weight.shape != (D,) or z.shape != (T, H * D) or out.shape != (T, H * D):
        raise ValueError(f"gated_rms_norm: x {x.shape}, weight {weight.shape}, z {z.shape}, out {out.shape}")
    if T * H * D:
        launch(_gated_rms_norm, (H, T), _norm_threads(D), stream, x, weight, z, _F32(eps), out)


@cuda.jit
def _sigmoid_mul(y, z, per_row, out):
    """out = y * sigmoid(z). y, out: f32 [T, N]; z: f32 [T, N], or [T, 1] (per_row)."""
    idx = cuda.grid(1)
    T, N = y.shape
    if idx >= T * N:
        return
    t = idx // N
    n = idx - t * N
    g = z[t, 0] if per_row else z[t, n]
    out[t, n] = y[t, n] * sigmoid(g)


def sigmoid_mul(y, z, out, stream=0) -> None:
    """out = y * (1 / (1 + exp(-z))). y, out: device f32 [T, N]; z: [T, N] or [T, 1] (broadcast
    over the row)."""
    T, N = y.shape
    if out.shape != (T, N) or z.shape not in ((T, N), (T, 1)):
        raise ValueError(f"sigmoid_mul: y {y.shape}, z {z.shape}, out {out.shape}")
    if T * N:
        launch(_sigmoid_mul, _grid(T * N), _THREADS, stream, y, z, z.shape[1] == 1 and N != 1, out)


@cuda.jit
def _split_heads(x, out):
    """x: f32 [T, H*P*d]; out: f32 [P, T, H, d]: out[p, t, h, i] = x[t, (h*P + p)*d + i]."""
    idx = cuda.grid(1)
    P, T, H, d = out.shape
    row = H * P * d
    if idx >= T * row:
        return
    t = idx // row
    r = idx - t * row
    h = r // (P * d)
    p = (r // d) % P
    out[p, t, h, r % d] = x[t, r]


def split_heads(x, out, stream=0) -> None:
    """out[p] = piece p of every head of x. x: device f32 [T, H*P*d]; out: f32 [P, T, H, d]."""
    P, T, H, d = out.shape
    if x.shape != (T, H * P * d):
        raise ValueError(f"split_heads: x {x.shape}, out {out.shape}")
    if x.size:
        launch(_split_heads, _grid(x.size), _THREADS, stream, x, out)


__all__ = ["conv_silu", "decode_step", "gated_delta_net", "gated_rms_norm", "sigmoid_mul", "split_heads", "lanes"]
