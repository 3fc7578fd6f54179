"""The one MoE block every family shares: route, fetch the chosen experts, apply, mix.

Legend: T = tokens, D = hidden size, E = experts, A = experts used per token, F = expert FFN size.
Follows llama.cpp's build_moe_ffn so results match it: expert outputs are scaled by their
weights and summed in top-k order, in float32.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..kernels import ops
from ..kernels import quants as Q
from ..kernels.matmul import linear, linear_grouped, linear_prepared, linear_selected, prepare
from ..storage.experts import ExpertProvider
from .family import Family
from .weights import QWeight


@dataclass(frozen=True)
class SharedExpert:
    gate: QWeight
    up: QWeight
    down: QWeight
    gate_inp: QWeight | None  # sigmoid gate (qwen2moe); None = always on


@dataclass(frozen=True)
class MoE:
    layer: int
    router: QWeight  # [E, D]
    router_bias: np.ndarray | None  # [E]
    n_used: int  # A
    weights_scale: float  # 0 = none
    shared: SharedExpert | None


def route(moe: MoE, family: Family, x: np.ndarray, numerics: str, solo: bool = False,
          groups: np.ndarray | None = None, chosen: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Exact router (Path B). x: [T, D] -> (ids [T, A] int64 in top-k order, weights [T, A] f32).
    chosen: ids [T, A] to use instead of the router's top-k (routing replay); the router weighs
    them as it weighs its own choice."""
    logits = linear(x, moe.router.raw, moe.router.ggml_type, moe.router.n_in, numerics, solo=solo,
                    groups=groups)  # [T, E]
    if moe.router_bias is not None:
        logits = logits + moe.router_bias
    if family.gating == "softmax_weight":
        ids = _top_k(logits, moe.n_used) if chosen is None else chosen
        weights = ops.softmax_rows(np.take_along_axis(logits, ids, axis=1))
    else:
        probs = ops.softmax_rows(logits)
        ids = _top_k(probs, moe.n_used) if chosen is None else chosen
        weights = np.take_along_axis(probs, ids, axis=1)
    if family.norm_topk:
        total = weights.astype(np.float64).sum(axis=1, keepdims=True).astype(np.float32)
        weights = weights / np.maximum(total, np.float32(6.103515625e-5))
    if moe.weights_scale:
        weights = weights * np.float32(moe.weights_scale)
    return ids, weights.astype(np.float32)


def _top_k(scores: np.ndarray, k: int) -> np.ndarray:
    """Indices of the k largest per row, largest first; ties keep the lower index first."""
    return np.argsort(-scores, axis=1, kind="stable")[:, :k]


def moe_forward(moe: MoE, family: Family, experts: ExpertProvider, x: np.ndarray, numerics: str,
                trace=None, solo: bool = False, groups: np.ndarray | None = None,
                chosen: np.ndarray | None = None) -> np.ndarray:
    """x: [T, D] (already normed) -> [T, D]. solo: the rows are independent one-token steps of
    different sequences (a decode batch), each computed exactly as it would be alone. groups: row
    offsets of several sequences' prompts (a batched prefill), each computed as it would be alone.
    chosen: expert ids [T, A] replacing the router's top-k (route)."""
    ids, weights = route(moe, family, x, numerics, solo, groups, chosen)
    if trace is not None:
        trace(moe.layer, ids)
    layout = experts.layout(moe.layer)
    with experts.fetch(moe.layer, np.unique(ids).tolist()) as batch:
        if x.shape[0] == 1:
            y, slot_rows = _apply_experts_per_token(layout, family, batch, ids, x, numerics)
        else:  # each expert's weights read once for all its tokens; solo keeps rows independent
            y, slot_rows = _apply_experts_grouped(layout, family, batch, ids, x, numerics, solo, groups)
    out = ops.moe_mix(y, slot_rows, np.ascontiguousarray(weights, dtype=np.float32))
    if moe.shared is not None:
        out = out + shared_expert(moe.shared, x, numerics, solo, groups)
    return out


def _apply_experts_grouped(layout, family, batch, ids, x, numerics, solo=False, groups=None):
    """Every needed expert applied to the tokens routed to it, one kernel call per projection for
    the whole layer. solo: each token computed as a one-token call would (decode batches); groups:
    row offsets of sequences computed as separate calls would (batched prefills).
    ids: [T, A]; x: [T, D] -> (y [P, D] expert outputs, slot_rows [T, A]: the row of y of each
    (token, slot)), P = T*A"""
    (T, A), D = ids.shape, x.shape[1]
    flat = ids.reshape(-1)  # [P] pairs (token, slot), token-major
    key = flat
    if groups is not None and not solo and _path_depends_on_rows(layout):
        # a K-quant expert's path depends on how many of one sequence's tokens it gets:
        # one group per (expert, sequence), as separate prefills would have
        seq = np.repeat(np.arange(len(groups) - 1), np.diff(groups) * A)  # [P]
        key = flat * (len(groups) - 1) + seq
    order = np.argsort(key, kind="stable")  # [P] pairs grouped by expert (and sequence), tokens ascending
    by_expert = flat[order]
    _, starts = np.unique(key[order], return_index=True)
    offs = np.append(starts, T * A)  # [J+1] each group's pairs
    rows = np.array([batch.rows[int(e)] for e in by_expert[starts]], dtype=np.int64)  # [J] rows of the stacks
    tok = order // A  # [P] the token of each pair
    xg = prepare(x, layout.gate_type, numerics).rows(tok)  # converted once per token, then gathered
    g = linear_grouped(xg, batch.gate, rows, offs, layout.gate_type, D, solo)  # [P, F]
    if layout.up_type != layout.gate_type:
        xg = prepare(x, layout.up_type, numerics).rows(tok)
    u = linear_grouped(xg, batch.up, rows, offs, layout.up_type, D, solo)
    if batch.gate_bias is not None:
        g += batch.gate_bias[by_expert]
        u += batch.up_bias[by_expert]
    hp = prepare(_glu(family, g, u), layout.down_type, numerics)
    y = linear_grouped(hp, batch.down, rows, offs, layout.down_type, layout.n_ff, solo)  # [P, D]
    if batch.down_bias is not None:
        y += batch.down_bias[by_expert]
    slot_rows = np.empty(T * A, dtype=np.int64)
    slot_rows[order] = np.arange(T * A)
    return y, slot_rows.reshape(T, A)


def _apply_experts_per_token(layout, family, batch, ids, x, numerics):
    """Decode steps: each token through its own A experts, in two kernel calls (gate/up, then
    down) for the whole batch; every (token, expert) row is computed exactly as a one-token expert
    call computes it. ids: [T, A] expert ids in top-k order; x: [T, D] -> (y [T*A, D], slot_rows)"""
    (T, A), D, F = ids.shape, x.shape[1], layout.n_ff
    flat = ids.reshape(-1)  # [T*A]
    idx = np.array([batch.rows[int(e)] for e in flat], dtype=np.int64)  # [T*A] rows of the stacks
    xrow = np.repeat(np.arange(T, dtype=np.int64), A)  # [T*A] the token of each pair
    xp = prepare(x, layout.gate_type, numerics)
    g = linear_selected(xp, batch.gate, idx, xrow, layout.gate_type, D)  # [T*A, F]
    if layout.up_type != layout.gate_type:
        xp = prepare(x, layout.up_type, numerics)
    u = linear_selected(xp, batch.up, idx, xrow, layout.up_type, D)
    if batch.gate_bias is not None:
        g += batch.gate_bias[flat]
        u += batch.up_bias[flat]
    hp = prepare(_glu(family, g, u), layout.down_type, numerics)
    y = linear_selected(hp, batch.down, idx, np.arange(T * A, dtype=np.int64), layout.down_type, F)  # [T*A, D]
    if batch.down_bias is not None:
        y += batch.down_bias[flat]
    return y, np.arange(T * A, dtype=np.int64).reshape(T, A)


def _path_depends_on_rows(layout) -> bool:
    """Whether an expert call's kernel path depends on its row count (K-quants: llama.cpp's tiled
    kernel from 8 rows); the other expert kernels compute each row alike."""
    return any(t in Q.KQUANT_TYPES for t in (layout.gate_type, layout.up_type, layout.down_type))


def _glu(family: Family, g: np.ndarray, u: np.ndarray) -> np.ndarray:
    if family.glu == "oai":
        return ops.swiglu_oai(g, u, np.float32(family.glu_alpha), np.float32(family.glu_limit))
    return ops.swiglu(g, u)


def dense_ffn(gate: QWeight, up: QWeight, down: QWeight, x: np.ndarray, numerics: str,
              observe=None, solo: bool = False, groups: np.ndarray | None = None) -> np.ndarray:
    """down(silu(gate·x) * up·x). x: [T, D] -> [T, D]. observe(x, h [T, F]) sees the activations."""
    rows = {"solo": solo, "groups": groups}
    if gate.ggml_type == up.ggml_type:
        xp = prepare(x, gate.ggml_type, numerics)
        g = linear_prepared(xp, gate.raw, gate.ggml_type, gate.n_in, **rows)
        u = linear_prepared(xp, up.raw, up.ggml_type, up.n_in, **rows)
    else:
        g = linear(x, gate.raw, gate.ggml_type, gate.n_in, numerics, **rows)
        u = linear(x, up.raw, up.ggml_type, up.n_in, numerics, **rows)
    h = ops.swiglu(g, u)
    if observe is not None:
        observe(x, h)
    return linear(h, down.raw, down.ggml_type, down.n_in, numerics, **rows)


def shared_expert(sh: SharedExpert, x: np.ndarray, numerics: str, solo: bool = False,
                  groups: np.ndarray | None = None) -> np.ndarray:
    y = dense_ffn(sh.gate, sh.up, sh.down, x, numerics, solo=solo, groups=groups)
    if sh.gate_inp is not None:
        z = linear(x, sh.gate_inp.raw, sh.gate_inp.ggml_type, sh.gate_inp.n_in, numerics, solo=solo,
                   groups=groups)  # [T, 1]
        with np.errstate(invalid="ignore", divide="ignore"):  # llama.cpp: silu(z) / z = sigmoid(z)
            y = y * (ops.silu(np.ascontiguousarray(z)) / z)
    return y
