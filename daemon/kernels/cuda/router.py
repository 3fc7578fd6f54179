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

One warp per row. The top-k is A rounds of a warp argmax over (value, index) pairs (a total
order: larger value, then lower index), so the result is the same on every run and independent
of the other rows; the softmax's max and sum are warp butterflies in a fixed order.
"""

from __future__ import annotations

import math

import numpy as np
from numba import cuda

from .device import placeholder
from .ptx import warp_argmax, warp_max, warp_sum
from .launch import launch

MAX_EXPERTS = 1024  # 32 per lane: a lane's taken flags fit one register
MAX_USED = 64
_WARP = 32
_NEG_INF = np.float32(-np.inf)


def _make_route(PER: int):
    """The router kernel for up to 32*PER experts (PER a compile-time constant: loops over a
    lane's experts unroll and its values stay in registers)."""

    @cuda.jit
    def route_kernel(logits, bias, has_bias, softmax_first, norm_topk, scale, given, ids, weights):
        """logits: f32 [T, E]; bias: f32 [E] (read when has_bias); ids: int32 [T, A] (out, or in when
        given); weights: f32 [T, A] out. Grid T blocks of one warp; lane l holds experts l + 32k in
        registers (k < PER, loaded together), and their taken flags as the bits of one register."""
        t = cuda.blockIdx.x
        lane = cuda.threadIdx.x
        E = logits.shape[1]
        A = ids.shape[1]
        vals = cuda.local.array(PER, np.float32)
        sel = cuda.shared.array(MAX_USED, np.float32)
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
        taken = np.uint32(0)
        for a in range(A):
            if given:
                win = ids[t, a]
            else:
                bv = _NEG_INF
                bi = E  # none yet
                for k in range(PER):  # ascending: a tie keeps the lower index
                    e = lane + k * _WARP
                    if e < E and (taken >> np.uint32(k)) & np.uint32(1) == 0:
                        v = vals[k]
                        if v != v:
                            v = _NEG_INF  # NaN ranks with -inf, chosen only when nothing else is left
                        if bi == E or v > bv:
                            bv = v
                            bi = e
                bv, bi = warp_argmax(bv, bi, E)
                win = bi
                if lane == 0:
                    ids[t, a] = win
            mine = win % _WARP == lane
            if mine:
                k_win = win // _WARP
                taken |= np.uint32(1) << np.uint32(k_win)
                for k in range(PER):  # a constant index keeps vals in registers
                    if k == k_win:
                        sel[a] = vals[k]
        cuda.syncthreads()
        if lane == 0:
            if not softmax_first:  # softmax over the selected logits
                mx = _NEG_INF
                for a in range(A):
                    mx = max(mx, sel[a])
                s = np.float32(0.0)
                for a in range(A):
                    sel[a] = math.exp(sel[a] - mx)
                    s += sel[a]
                for a in range(A):
                    sel[a] = sel[a] / s
            div = np.float32(1.0)
            if norm_topk:
                s = np.float32(0.0)
                for a in range(A):
                    s += sel[a]
                div = max(s, np.float32(6.103515625e-5))
            for a in range(A):
                w = sel[a]
                if norm_topk:
                    w = w / div
                if scale != np.float32(0.0):
                    w = w * scale
                weights[t, a] = w

    return route_kernel


_ROUTE = {}


def _route_kernel(n_expert: int):
    per = 1
    while per * _WARP < n_expert:
        per *= 2
    kern = _ROUTE.get(per)
    if kern is None:
        kern = _ROUTE[per] = _make_route(per)
    return kern


def route(logits, gating: str, norm_topk: bool, scale: float, ids, weights, bias=None, given: bool = False,
          stream=0) -> None:
    """Top-k routing of each row of logits (see the module doc).

    logits: device f32 [T, E]; ids: device int32 [T, A] (written; read instead when given, for
    routing replay); weights: device f32 [T, A] (written); bias: device f32 [E]
    (ffn_gate_inp.bias) or None; gating: "softmax" or "softmax_weight"; scale: expert_weights_scale
    (0 = none)."""
    T, E = logits.shape
    A = ids.shape[1]
    if gating not in ("softmax", "softmax_weight"):
        raise ValueError(f"route: unknown gating {gating!r}")
    if ids.shape != (T, A) or weights.shape != (T, A) or not 0 < A <= min(E, MAX_USED) or E > MAX_EXPERTS:
        raise ValueError(f"route: logits {logits.shape}, ids {ids.shape}, weights {weights.shape} "
                         f"(at most {MAX_EXPERTS} experts, {MAX_USED} used)")
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
