"""The CPU backend: numba CPU kernels (daemon/kernels), numpy arrays, f32 KV caches.

numerics "ggml" follows llama.cpp's CPU backend bit for bit: the matmuls quantize activations as
it does, and the KV cache, the queries and the attention weights are rounded to f16 as its f16 KV
cache and f16 mul_mats do. "float32" rounds nothing beyond float32.

A Step maps onto the kernels' row flags: `solo` when every sequence has one row (a decode batch:
each row computed as a one-row call), `groups` (the step's offsets) when several sequences have
several rows (a batched prefill: each computed as a call on its rows alone).

Legend: T = rows, S = sequences, D = hidden size, K = input length, N = output length, H = query
heads, Hkv = key/value heads, Dh = key head size, Dv = value head size, A = experts per row,
P = T*A pairs.
"""

from __future__ import annotations

import logging
import os
import weakref

import numba
import numpy as np
from numba.typed import List

from ..kernels import decode_linears, moe_decode, ops, ssm as ssm_k
from ..kernels.matmul import Prepared, linear_prepared, prepare
from ..kernels.quants import dequantize
from . import cpu_experts, cpu_step
from .base import compose_delta_net, compose_expert_ffn, compose_expert_glu, compose_route
from .cpu_cache import KVCache
from .step import Step

log = logging.getLogger(__name__)

NUMERICS = ("ggml", "float32")
_NO_NORM = np.ones(1, np.float32)  # rope_qk without q/k norms (never read)
_NO_CHOICE = np.zeros((0, 0), np.int64)  # router: the top-k, no replayed ids


class Activations:
    """x [T, K] with its conversions for each weight type, made on first use."""

    def __init__(self, x: np.ndarray, numerics: str):
        self.x = x
        self.numerics = numerics
        self._prepared: dict = {}  # ggml type -> Prepared
        self._gathered: dict = {}  # ggml type -> (the plan, Prepared rows in its order)

    def get(self, ggml_type: int) -> Prepared:
        xp = self._prepared.get(ggml_type)
        if xp is None:
            xp = self._prepared[ggml_type] = prepare(self.x, ggml_type, self.numerics)
        return xp

    def gathered(self, ggml_type: int, plan) -> Prepared:
        """get(ggml_type) gathered by plan.tokens (converted once per row, then gathered once)."""
        hit = self._gathered.get(ggml_type)
        if hit is not None and hit[0] is plan:  # the plan itself, not its id: ids are reused
            return hit[1]
        xp = self.get(ggml_type).rows(plan.tokens)
        self._gathered[ggml_type] = (plan, xp)
        return xp


_ONE_SEQUENCE = {"solo": False, "groups": None}


def _row_flags(step: Step | None) -> dict:
    """The kernels' solo/groups flags for a step's rows (once per step)."""
    if step is None or step.S == 1:
        return _ONE_SEQUENCE
    flags = step.memo.get("rows")
    if flags is None:
        flags = step.memo["rows"] = ({"solo": True, "groups": None} if step.one_row_each
                                     else {"solo": False, "groups": step.offsets})
    return flags


class CPUBackend:
    name = "cpu"
    fuse_decode = True  # one-row steps through the fused calls (False: the separate ops, for A/B benchmarks)
    # a step (decode or prefill) as one compiled call where the model allows (cpu_step.py): "background"
    # (compiled on a thread of its own, the per-op path serving until then), "wait" (the first step waits)
    # or "off"
    compiled_step = "background"

    def __init__(self, numerics: str = "ggml"):
        if numerics not in NUMERICS:
            raise ValueError(f"numerics must be one of {NUMERICS}, got {numerics!r}")
        self.numerics = numerics
        self.governor = None  # a cpu_threads.ThreadGovernor: each step's thread count (None: as set)
        self.threads = None  # each step's thread count without a governor (None: the first step's thread's)
        self._programs = weakref.WeakKeyDictionary()  # model -> cpu_step.StepProgram, or why it has none

    def __repr__(self) -> str:
        return f"CPUBackend({self.numerics!r})"

    # -- weights and state ---------------------------------------------------------------------

    def upload(self, weight):
        return weight  # already in host memory

    def upload_group(self, weights):
        return [self.upload(w) for w in weights]

    def expert_provider(self, gguf, settings, say, progress=None):
        """The streaming expert cache: the CPU computes from its host slots."""
        from .host_experts import host_expert_cache

        cache = host_expert_cache(gguf, settings, say)
        return cache, cache

    def new_cache(self, hp, n_ctx: int) -> KVCache:
        return KVCache(hp.n_layer, hp.n_head_kv, hp.head_dim, hp.head_dim_v, n_ctx, hp.ssm, hp.recurrent)

    def to_host(self, x: np.ndarray) -> np.ndarray:
        return x

    # -- dense ---------------------------------------------------------------------------------

    def run_step(self, step: Step, compute, static: bool = False, segmented: bool = False):
        self._set_threads()
        return compute()

    def _set_threads(self) -> None:
        """The calling thread's numba count for the next step (numba's count is per thread: set
        where the step runs): the governor's, else `threads`; less one core while the compiled
        step compiles, since its thread keeps a core busy and the pool's spinning threads would
        stall beside it (the governor counts that thread as ours, not as a competitor)."""
        if self.threads is None:
            self.threads = numba.get_num_threads()  # as the first step's thread finds it
        n = self.governor.threads() if self.governor is not None else self.threads
        if cpu_step.compiling():
            n = max(1, min(n, len(os.sched_getaffinity(0)) - 1))
        if numba.get_num_threads() != n:
            numba.set_num_threads(n)

    def run_compiled(self, model, step: Step) -> np.ndarray | None:
        """A step (a decode batch, or prompts) as one compiled call (cpu_step.py) -> its logits; None
        where the model has no compiled step, or not for this step (compiling in the background,
        more experts than a layer's slots may be chosen...), and the per-op path serves it."""
        if not (self.compiled_step != "off" and self.fuse_decode):
            return None
        program = self._programs.get(model)
        if program is None:
            program = self._programs[model] = cpu_step.StepProgram.build(model)
        if isinstance(program, str):
            return None
        self._set_threads()
        logits = program.run(step, self._rope_table(step, model.hp.rope), self._step_stores(step),
                             wait=self.compiled_step == "wait")
        if logits is None and program.lost:  # not again for this model
            self._programs[model] = program.lost
            log.warning("the compiled step cannot serve this model (%s): op by op from now on", program.lost)
        return logits

    def host_point(self, fn, sync: bool = True) -> None:
        fn()

    def replay_routes(self, table: np.ndarray, step) -> np.ndarray:
        return table[:, step.positions % table.shape[1]].astype(np.int64)  # [L_moe, T, A]

    def embed(self, table, tokens: np.ndarray, step: Step | None = None) -> np.ndarray:
        return dequantize(table.raw[tokens], table.ggml_type, table.n_in)  # [T, D]

    def prepare(self, x: np.ndarray) -> Activations:
        return Activations(x, self.numerics)

    def linear(self, x, w, step: Step | None = None, bias: np.ndarray | None = None) -> np.ndarray:
        acts = x if isinstance(x, Activations) else Activations(x, self.numerics)
        y = linear_prepared(acts.get(w.ggml_type), w.raw, w.ggml_type, w.n_in, **_row_flags(step))  # [T, N]
        if bias is not None:
            y += bias
        return y

    # -- experts -------------------------------------------------------------------------------

    def linears(self, x, ws, step: Step | None = None, biases=None) -> list[np.ndarray]:
        acts = x if isinstance(x, Activations) else Activations(x, self.numerics)
        biases = biases or [None] * len(ws)
        if acts.x.shape[0] == 1 and self.fuse_decode and self.numerics == "ggml" and decode_linears.supports(
                [w.ggml_type for w in ws], [w.n_in for w in ws]):  # one row: one parallel region for all
            ys = decode_linears.linears(acts.get(ws[0].ggml_type), [w.raw for w in ws], ws[0].ggml_type)
            for y, b in zip(ys, biases):
                if b is not None:
                    y += b
            return ys
        return [self.linear(acts, w, step, b) for w, b in zip(ws, biases)]

    def expert_plan(self, ids, slots, layout, step, only=None):
        return cpu_experts.plan(ids, slots, layout, step, only)

    def expert_linear(self, x, stack, ggml_type, k, plan, bias=None, per_token=True) -> np.ndarray:
        acts = x if isinstance(x, Activations) else Activations(x, self.numerics)
        gather = per_token and isinstance(plan, cpu_experts.GroupedPlan)
        xp = acts.gathered(ggml_type, plan) if gather else acts.get(ggml_type)
        y = cpu_experts.expert_linear(xp, stack, ggml_type, k, plan, per_token)  # [P, N]
        if bias is not None:
            y += bias[plan.experts]
        return y

    def expert_glu(self, x, batch, layout, plan, kind, alpha=0.0, limit=0.0) -> np.ndarray:
        return compose_expert_glu(self, x, batch, layout, plan, kind, alpha, limit)

    def expert_ffn(self, x, batch, layout, plan, kind, alpha=0.0, limit=0.0) -> np.ndarray:
        if isinstance(plan, cpu_experts.PerTokenPlan) and self._fusable(batch, layout):  # a one-token step
            acts = x if isinstance(x, Activations) else Activations(x, self.numerics)
            return moe_decode.expert_ffn(acts.get(layout.gate_type), batch, layout, plan.slots, plan.experts,
                                         plan.tokens, kind, alpha, limit)
        return compose_expert_ffn(self, x, batch, layout, plan, kind, alpha, limit)

    def _fusable(self, batch, layout) -> bool:
        return (self.fuse_decode and self.numerics == "ggml"
                and moe_decode.supports(layout.gate_type, layout.up_type, layout.down_type)
                and all(s.flags.c_contiguous for s in (batch.gate, batch.up, batch.down)))

    def moe_mix(self, y, plan, weights, shared=None):
        out = ops.moe_mix(y, plan.slot_rows, np.ascontiguousarray(weights, dtype=np.float32))
        return out if shared is None else self.add(out, shared)

    def router(self, logits, n_used, gating, norm_topk, scale, chosen=None):
        chosen = _NO_CHOICE if chosen is None else np.ascontiguousarray(chosen, np.int64)  # replay: weigh these
        return ops.route_top_k(np.ascontiguousarray(logits, np.float32), n_used, gating == "softmax_weight",
                               norm_topk, float(scale), chosen)

    def route(self, x, weight, bias, n_used, gating, norm_topk, scale, chosen=None, step=None):
        return compose_route(self, x, weight, bias, n_used, gating, norm_topk, scale, chosen, step)

    def routed_ids(self, ids: np.ndarray) -> np.ndarray:
        return ids

    # -- elementwise and attention -------------------------------------------------------------

    def rms_norm(self, x, weight, eps) -> np.ndarray:
        return ops.rms_norm(x, weight, np.float32(eps))

    def rms_norm_heads(self, x, weight, eps) -> np.ndarray:
        return ops.rms_norm_heads(x, weight, np.float32(eps))

    def rope(self, x, step: Step, rope) -> np.ndarray:
        return ops.apply_rope(x, self._rope_table(step, rope), rope.n_dims, rope.neox)

    def rope_qk(self, q, k, step: Step, rope, q_norm=None, k_norm=None, eps=0.0):
        has_norm = q_norm is not None
        return ops.norm_rope_qk(q, k, q_norm if has_norm else _NO_NORM, k_norm if has_norm else _NO_NORM, has_norm,
                                np.float32(eps), self._rope_table(step, rope), rope.n_dims, rope.neox)

    @staticmethod
    def _rope_table(step: Step, rope) -> np.ndarray:
        table = step.memo.get("rope")
        if table is None:  # [T, n_dims/2, 2], once per step
            table = step.memo["rope"] = ops.rope_cache(step.positions, rope.n_dims, rope.freq_base, rope.freq_scale,
                                                       rope.ext_factor, rope.attn_factor, rope.corr_dims)
        return table

    def attention(self, layer, q, k, v, step: Step, scale, window, sinks, rope=None, q_norm=None, k_norm=None,
                  eps=0.0, into=None) -> np.ndarray:
        out = self._attention(layer, q, k, v, step, scale, window, sinks, rope, q_norm, k_norm, eps)
        return out if into is None else out.reshape(out.shape[0], -1)

    def _attention(self, layer, q, k, v, step: Step, scale, window, sinks, rope, q_norm, k_norm, eps) -> np.ndarray:
        if rope is not None:
            q, k = self.rope_qk(q, k, step, rope, q_norm, k_norm, eps)
        ggml = self.numerics == "ggml"
        if ggml:  # f16 KV cache; q converted to f16 for the K·q product
            q, k, v = (np.ascontiguousarray(t) for t in (q, k, v))
            for t in (q, k, v):
                ops.to_f16_values(t)
        sinks = sinks if sinks is not None else np.empty(0, np.float32)
        scale = np.float32(scale)
        if step.one_row_each and step.S > 1:  # one new cell per sequence, all sequences in one call
            k_all, v_all = self._step_stores(step)
            return ops.attention_decode(q, k, v, k_all, v_all, step.caches[0].layers[layer].slot, step.positions,
                                        scale, window, sinks, ggml)
        T, H, Dv = q.shape[0], q.shape[1], v.shape[2]
        out = np.empty((T, H, Dv), np.float32)
        for s, cache in enumerate(step.caches):  # each sequence's rows against its own cells
            r0, r1 = int(step.offsets[s]), int(step.offsets[s + 1])
            lc = cache.layers[layer]
            start, end = cache.n_past, cache.n_past + r1 - r0
            lc.write(start, k[r0:r1], v[r0:r1])
            out[r0:r1] = ops.attention(q[r0:r1], lc.keys(end), lc.values(end), step.positions[r0:r1], scale,
                                       window, sinks, ggml)
        return out

    @staticmethod
    def _step_stores(step: Step) -> tuple[List, List]:
        """The KV stores of the step's sequences ([L, C, Hkv, Dh|Dv] each) as numba Lists, built
        once per step: the decode kernel writes and reads layer `slot` of each."""
        stores = step.memo.get("kv")
        if stores is None:
            caches = [c.store for c in step.caches]
            stores = step.memo["kv"] = (List([c.k for c in caches]), List([c.v for c in caches]))
        return stores

    def glu(self, gate, up, kind, alpha=0.0, limit=0.0) -> np.ndarray:
        if kind == "oai":
            return ops.swiglu_oai(gate, up, np.float32(alpha), np.float32(limit))
        return ops.swiglu(gate, up)

    def sigmoid_gate(self, y, z) -> np.ndarray:
        with np.errstate(invalid="ignore", divide="ignore"):  # llama.cpp: silu(z) / z = sigmoid(z)
            return y * (ops.silu(np.ascontiguousarray(z)) / z)

    def sigmoid_mul(self, y, z) -> np.ndarray:
        return ssm_k.sigmoid_mul(np.ascontiguousarray(y), np.ascontiguousarray(z))

    def split_heads(self, x, n_head, parts) -> list[np.ndarray]:
        x = x.reshape(x.shape[0], n_head, parts, -1)  # [T, H, parts, d]
        return [np.ascontiguousarray(x[:, :, i]) for i in range(parts)]

    # -- Gated DeltaNet ----------------------------------------------------------------------------

    def conv_silu(self, layer, x, weight, step: Step) -> np.ndarray:
        convs, _ = self._step_states(step)
        out = np.empty(x.shape, np.float32)
        ssm_k.conv_silu(np.ascontiguousarray(x), weight, step.offsets, convs, step.caches[0].layers[layer].slot, out)
        return out

    def gated_delta_net(self, layer, qkv, b, a, dt_bias, ssm_a, step: Step, ssm, eps) -> np.ndarray:
        _, states = self._step_states(step)
        out = np.empty((qkv.shape[0], ssm.n_v_head, ssm.head_v), np.float32)  # [T, Hv, Dv]
        ssm_k.gated_delta_net(qkv, np.ascontiguousarray(b), np.ascontiguousarray(a), dt_bias, ssm_a, step.offsets,
                              states, step.caches[0].layers[layer].slot, ssm.n_k_head, ssm.tiled, np.float32(eps),
                              out)
        return out

    def gated_rms_norm(self, x, weight, z, eps) -> np.ndarray:
        return ssm_k.gated_rms_norm(x, weight, np.ascontiguousarray(z), np.float32(eps))

    def delta_net(self, layer, x, conv_weight, b, a, dt_bias, ssm_a, norm, z, step: Step, ssm, eps) -> np.ndarray:
        return compose_delta_net(self, layer, x, conv_weight, b, a, dt_bias, ssm_a, norm, z, step, ssm, eps)

    @staticmethod
    def _step_states(step: Step) -> tuple[List, List]:
        """The conv and recurrent stores of the step's sequences ([L, ...] each) as numba Lists,
        built once per step."""
        states = step.memo.get("states")
        if states is None:
            stores = [c.states for c in step.caches]
            states = step.memo["states"] = (List([s.conv for s in stores]), List([s.ssm for s in stores]))
        return states

    def add(self, a, b) -> np.ndarray:
        return a + b

    def add_rms_norm(self, x, delta, weight, eps) -> tuple[np.ndarray, np.ndarray]:
        x = x + delta
        return x, self.rms_norm(x, weight, eps)

    def join_parts(self, parts, plans) -> np.ndarray:
        y = np.empty((sum(p.shape[0] for p in parts), parts[0].shape[1]), np.float32)  # [P, N]
        for part, plan in zip(parts, plans):
            y[plan.pairs] = part
        return y

    def take_rows(self, x, rows) -> np.ndarray:
        return np.ascontiguousarray(x[rows])

