"""The MoE ops of every backend against numpy: router top-k, the expert plan with grouped
expert linears (gate, up, GLU, down, biases), and the top-k mix; and batch invariance."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from daemon.backend import Step
from daemon.backend.cpu_cache import KVCache
from daemon.kernels import quants as Q
from daemon.storage.experts import ExpertLayout

from . import reference as R
from .conftest import simulated

E, A, D, F = 6, 3, 256, 256


@pytest.mark.parametrize("gating,norm,scale", [("softmax", True, 0.0), ("softmax", False, 2.5),
                                               ("softmax_weight", False, 0.0)])
def test_router(backend, gating, norm, scale):
    rng = np.random.default_rng(1)
    logits = rng.standard_normal((5, 16)).astype(np.float32) * 3
    ids, w = backend.router(logits, 4, gating, norm, scale)
    want_ids, want_w = R.route(logits, 4, gating, norm, scale)
    assert np.array_equal(backend.routed_ids(ids), want_ids)
    assert R.rel_err(backend.to_host(w), want_w) < 1e-6
    chosen = np.array([[0, 1, 2, 3]] * 5)  # routing replay: weigh these instead
    ids, w = backend.router(logits, 4, gating, norm, scale, chosen)
    assert np.array_equal(backend.routed_ids(ids), chosen)
    if gating == "softmax":
        ref = np.take_along_axis(R.softmax(logits.astype(np.float64)), chosen, 1)
        ref = ref / ref.sum(1, keepdims=True) if norm else ref * (scale or 1)
        assert R.rel_err(backend.to_host(w), ref) < 1e-6


@pytest.mark.parametrize("qt", [Q.F32, Q.Q8_0], ids=["F32", "Q8_0"])  # F32: one launch on a GPU
def test_route_of_a_router_weight(backend, qt):
    """backend.route: the router's logits (+ bias) as linear gives them, then router's top-k of
    those logits; for 3 rows and, past a GPU's fused rows, 7."""
    rng = np.random.default_rng(qt)
    host = R.qweight(qt, 16, 64, rng)
    w = backend.upload(host)
    bias = rng.standard_normal(16).astype(np.float32)
    for T in (3, 7):
        x = rng.standard_normal((T, 64)).astype(np.float32)
        logits, ids, weights = backend.route(x, w, bias, 4, "softmax_weight", False, 0.0)
        got = backend.to_host(logits)
        assert R.rel_err(got, x.astype(np.float64) @ R.dequant(host.raw, qt).T + bias) < R.tolerance(backend, qt)
        want_ids, want_w = R.route(got, 4, "softmax_weight", False, 0.0)
        assert np.array_equal(backend.routed_ids(ids), want_ids)
        assert R.rel_err(backend.to_host(weights), want_w) < 1e-6


class _Experts:
    """E experts' gate/up/down stacks, held at shuffled slots (as a cache would hold them).
    dim: D = F (256; 64 for the CUDA backend under the simulator, which runs a device thread in
    about a millisecond)."""

    def __init__(self, gate_type, down_type, rng, biases, dim=D):
        self.D = self.F = D = F = dim
        self.layout = ExpertLayout(E, D, F, gate_type, gate_type, down_type)
        self.gate = R.raw_weights(gate_type, (E, F), D, rng)  # [E, F, rb]
        self.up = R.raw_weights(gate_type, (E, F), D, rng)
        self.down = R.raw_weights(down_type, (E, D), F, rng)  # [E, D, rb]
        self.slots = {int(e): s for s, e in enumerate(rng.permutation(E))}
        order = np.argsort([self.slots[e] for e in range(E)])  # expert at each slot
        self.stacks = [np.ascontiguousarray(a[order]) for a in (self.gate, self.up, self.down)]
        self.bias = ([rng.standard_normal((E, n)).astype(np.float32) for n in (F, F, D)] if biases
                     else [None] * 3)

    def run(self, backend, x, ids, weights, step, glu="silu"):
        """The MoE block's ops as model code calls them (gate, up and GLU as one expert_glu, which
        a GPU fuses for its GEMV rows) -> [T, D]."""
        plan = backend.expert_plan(ids, self.slots, self.layout, step)
        xa = backend.prepare(x)
        lay, F = self.layout, self.F
        batch = SimpleNamespace(gate=self.stacks[0], up=self.stacks[1], gate_bias=self.bias[0], up_bias=self.bias[1])
        h = backend.expert_glu(xa, batch, lay, plan, glu, 1.702, 7.0)
        y = backend.expert_linear(h, self.stacks[2], lay.down_type, F, plan, self.bias[2], per_token=False)
        return backend.to_host(backend.moe_mix(y, plan, weights))

    def reference(self, x, ids, weights, glu="silu"):
        D, F = self.D, self.F
        g_w, u_w, d_w = (R.dequant(a, t) for a, t in ((self.gate, self.layout.gate_type),
                                                      (self.up, self.layout.up_type),
                                                      (self.down, self.layout.down_type)))
        bg, bu, bd = (np.zeros((E, n)) if b is None else b for b, n in zip(self.bias, (F, F, D)))
        out = np.zeros((len(x), D))
        for t in range(len(x)):
            for a, e in enumerate(ids[t]):
                g, u = g_w[e] @ x[t] + bg[e], u_w[e] @ x[t] + bu[e]
                h = R.silu(g) * u if glu == "silu" else R.swiglu_oai(g, u, 1.702, 7.0)
                out[t] += weights[t, a] * (d_w[e] @ h + bd[e])
        return out


def _ids(rng, T):
    return np.stack([rng.permutation(E)[:A] for _ in range(T)]).astype(np.int64)


TYPES = [(Q.Q8_0, Q.Q8_0), (Q.Q4_K, Q.Q6_K), (Q.MXFP4, Q.MXFP4), (Q.F16, Q.F16)]


@pytest.mark.parametrize("gate_type,down_type", TYPES, ids=[f"{Q.type_name(a)}-{Q.type_name(b)}" for a, b in TYPES])
@pytest.mark.parametrize("counts", [(1,), (5,), (1, 1, 1, 1), (3, 9), (2, 17)],
                         ids=["one", "prefill", "decode", "batched", "mixed"])
def test_experts_and_mix(backend, gate_type, down_type, counts):
    """mixed: a batched prefill whose sequences take different kernels on a GPU (17 rows tiled)."""
    rng = np.random.default_rng(sum(counts) + gate_type)
    ex = _Experts(gate_type, down_type, rng, biases=gate_type == Q.MXFP4, dim=64 if simulated(backend) else D)
    glu = "oai" if gate_type == Q.MXFP4 else "silu"
    T = sum(counts)
    x = rng.standard_normal((T, ex.D)).astype(np.float32)
    if gate_type not in R.QUANTIZABLE:  # random blocks hold large weights: keep the GLU in range
        x *= np.float32(0.02)
    ids = _ids(rng, T)
    weights = rng.uniform(0.1, 1, (T, A)).astype(np.float32)
    step = Step.append([np.zeros(n, np.int64) for n in counts], [KVCache(1, 1, 4, 4, 32) for _ in counts], True)
    got = ex.run(backend, x, ids, weights, step, glu)
    tol = max(R.tolerance(backend, gate_type), R.tolerance(backend, down_type))
    assert R.rel_err(got, ex.reference(x, ids, weights, glu)) < 2 * tol  # two products in a row


@pytest.mark.parametrize("gate_type,down_type", [(Q.Q4_K, Q.Q6_K), (Q.Q8_0, Q.Q8_0), (Q.MXFP4, Q.MXFP4)],
                         ids=["Q4_K-Q6_K", "Q8_0", "MXFP4"])
def test_experts_compute_each_sequence_as_alone(backend, gate_type, down_type):
    """Batched prefill (rows 9, 2, 8) and decode steps of 3 and 9 sequences: every sequence's
    rows bit-identical to a step holding that sequence alone (K-quant experts change kernels at 8
    rows per expert; on a GPU, a segment of 8+ rows reads an expert once for two of its pairs)."""
    rng = np.random.default_rng(3)
    ex = _Experts(gate_type, down_type, rng, biases=False)
    for counts in ((9, 2, 8), (1, 1, 1), (1,) * 9):
        T = sum(counts)
        x = rng.standard_normal((T, D)).astype(np.float32)
        ids = np.tile(np.arange(A), (T, 1))  # every row on the same experts: most rows per expert
        weights = rng.uniform(0.1, 1, (T, A)).astype(np.float32)
        caches = [KVCache(1, 1, 4, 4, 32) for _ in counts]
        step = Step.append([np.zeros(n, np.int64) for n in counts], caches, True)
        together = ex.run(backend, x, ids, weights, step)
        for s, c in enumerate(caches):
            r0, r1 = step.offsets[s], step.offsets[s + 1]
            alone = ex.run(backend, x[r0:r1], ids[r0:r1], weights[r0:r1],
                           Step.append([np.zeros(r1 - r0, np.int64)], [c], True))
            assert np.array_equal(together[r0:r1], alone), (counts, s)
