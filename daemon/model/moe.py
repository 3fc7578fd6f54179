"""The one MoE block every family shares: route, fetch the chosen experts, apply, mix.

Legend: T = tokens, D = hidden size, E = experts, A = experts used per token, F = expert FFN size.
Follows llama.cpp's build_moe_ffn so results match it: expert outputs are scaled by their
weights and summed in top-k order, in float32. Every computation is an operation of the model's
backend; `step` says how the rows group into sequences (None: one sequence).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..backend import Backend, CPUBackend, Step
from ..storage.experts import ExpertProvider
from .family import Family
from .weights import QWeight


@dataclass(frozen=True)
class SharedExpert:
    gate: QWeight
    up: QWeight
    down: QWeight
    gate_inp: QWeight | None  # [1, D]: the gate's logit per row; None = always on
    gate_kind: str = "silu_div"  # sigmoid(z) as silu(z) / z (llama.cpp's qwen2moe); "sigmoid" (qwen3next)


@dataclass(frozen=True)
class MoE:
    layer: int
    router: QWeight  # [E, D]
    router_bias: np.ndarray | None  # [E]
    n_used: int  # A
    weights_scale: float  # 0 = none
    shared: SharedExpert | None


def route(moe: MoE, family: Family, x, backend: Backend | str, step: Step | None = None,
          chosen=None) -> tuple:
    """Exact router (Path B). x: [T, D] -> (ids [T, A] in top-k order, weights [T, A] f32), the
    backend's arrays (backend.routed_ids: the ids on the host). chosen: ids [T, A] to use instead
    of the router's top-k (routing replay); the router weighs them as it weighs its own choice.
    backend: a Backend, or a CPU numerics name."""
    if isinstance(backend, str):
        backend = CPUBackend(backend)
    _, ids, weights = backend.route(x, moe.router, moe.router_bias, moe.n_used, family.gating, family.norm_topk,
                                    moe.weights_scale, chosen, step)
    return ids, weights


def moe_forward(moe: MoE, family: Family, experts: ExpertProvider, x, backend: Backend,
                step: Step | None = None, trace=None, chosen: np.ndarray | None = None):
    """x: [T, D] (already normed) -> [T, D]. chosen: expert ids [T, A] replacing the router's
    top-k (route). trace(layer, ids [T, A]) observes the routing."""
    ids, weights = route(moe, family, x, backend, step, chosen)
    layout = experts.layout(moe.layer)
    xa = backend.prepare(x)  # converted once per weight type, shared by gate and up (and waves)
    if trace is None and getattr(experts, "routing_free", False):
        # every expert served where the kernels read it: the routing stays where it was computed
        split = getattr(experts, "split", None)  # hybrid compute: a share of the misses on the CPU
        with experts.fetch(moe.layer, None) as batch:
            plan = backend.expert_plan(ids, batch.rows, layout, step)
            shared = split(moe.layer, x, plan, (family.glu, family.glu_alpha, family.glu_limit)) if split else None
            y = _apply_experts(family, backend, layout, batch, plan if shared is None else shared[0], xa)  # [P, D]
            if shared is not None:
                shared[1](y)  # the CPU's pairs' outputs into y
        return _mix(moe, backend, y, plan, weights, x, step)
    ids = backend.routed_ids(ids)  # [T, A] on the host
    if trace is not None:
        trace(moe.layer, ids)
    waves = experts.waves(moe.layer, np.unique(ids).tolist())
    if len(waves) == 1:
        with experts.fetch(moe.layer, waves[0], routed=ids) as batch:
            plan = backend.expert_plan(ids, batch.rows, layout, step)
            y = _apply_experts(family, backend, layout, batch, plan, xa)  # [P, D]
    else:  # more experts than the cache holds at once: each wave read into slots, used, released
        plan = backend.expert_plan(ids, {e: 0 for e in np.unique(ids).tolist()}, layout, step)  # the mix's order
        parts, part_plans = [], []
        for wave in waves:
            with experts.fetch(moe.layer, wave, routed=ids) as batch:
                part_plans.append(backend.expert_plan(ids, batch.rows, layout, step, only=np.array(wave)))
                parts.append(_apply_experts(family, backend, layout, batch, part_plans[-1], xa))
        y = backend.join_parts(parts, part_plans)
    return _mix(moe, backend, y, plan, weights, x, step)


def _mix(moe: MoE, backend: Backend, y, plan, weights, x, step):
    """The experts' outputs y [P, D] weighed and summed per row, plus the shared expert -> [T, D]."""
    shared = None if moe.shared is None else shared_expert(moe.shared, x, backend, step)
    return backend.moe_mix(y, plan, weights, shared)


def _apply_experts(family: Family, backend: Backend, layout, batch, plan, xa):
    """Each planned (row, expert) pair: down(glu(gate·x, up·x)). xa: x [T, D] prepared -> [P, D]."""
    return backend.expert_ffn(xa, batch, layout, plan, family.glu, family.glu_alpha, family.glu_limit)


def dense_ffn(gate: QWeight, up: QWeight, down: QWeight, x, backend: Backend, step: Step | None = None,
              observe=None):
    """down(silu(gate·x) * up·x). x: [T, D] -> [T, D]. observe(x, h [T, F]) sees the activations."""
    xa = backend.prepare(x)
    g = backend.linear(xa, gate, step)
    u = backend.linear(xa, up, step)
    h = backend.glu(g, u, "silu")
    if observe is not None:
        observe(x, h)
    return backend.linear(h, down, step)


def shared_expert(sh: SharedExpert, x, backend: Backend, step: Step | None = None):
    y = dense_ffn(sh.gate, sh.up, sh.down, x, backend, step)
    if sh.gate_inp is not None:
        z = backend.linear(x, sh.gate_inp, step)  # [T, 1]
        y = backend.sigmoid_mul(y, z) if sh.gate_kind == "sigmoid" else backend.sigmoid_gate(y, z)
    return y
