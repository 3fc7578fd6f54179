"""kernels/moe_decode.py: a one-token step's experts in one call give the bits of the separate
ops (gate, up, GLU, quantize, down: base.compose_expert_ffn), for every quantized family, with
and without biases, from slots in any order."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from daemon.backend import cpu_experts
from daemon.backend.base import compose_expert_ffn
from daemon.backend.cpu import CPUBackend
from daemon.kernels import moe_decode
from daemon.kernels import quants as Q
from daemon.storage.experts import ExpertLayout
from tests.backend import reference as R

E, A, D, F = 6, 3, 256, 512
CASES = [(Q.Q8_0, Q.Q8_0, "silu", False), (Q.Q4_K, Q.Q6_K, "silu", False), (Q.Q4_1, Q.Q5_K, "silu", False),
         (Q.MXFP4, Q.MXFP4, "oai", True), (Q.Q5_0, Q.Q4_1, "silu", True)]


@pytest.mark.parametrize("gate_type,down_type,glu,biases", CASES,
                         ids=[f"{Q.type_name(g)}-{Q.type_name(d)}-{k}" for g, d, k, _ in CASES])
def test_the_fused_call_gives_the_separate_ops_bits(gate_type, down_type, glu, biases):
    rng = np.random.default_rng(gate_type * 31 + down_type)
    layout = ExpertLayout(E, D, F, gate_type, gate_type, down_type)
    order = rng.permutation(E)  # the expert at each slot
    slots = {int(e): s for s, e in enumerate(order)}
    batch = SimpleNamespace(gate=R.raw_weights(gate_type, (E, F), D, rng), up=R.raw_weights(gate_type, (E, F), D, rng),
                            down=R.raw_weights(down_type, (E, D), F, rng), rows=slots,
                            gate_bias=None, up_bias=None, down_bias=None)
    if biases:
        batch.gate_bias, batch.up_bias, batch.down_bias = (rng.standard_normal((E, n)).astype(np.float32)
                                                           for n in (F, F, D))
    x = rng.standard_normal((1, D)).astype(np.float32)
    if gate_type not in R.QUANTIZABLE:  # random blocks hold large weights: keep the GLU in range
        x *= np.float32(0.02)
    ids = rng.permutation(E)[:A].reshape(1, A).astype(np.int64)
    cpu = CPUBackend()
    plan = cpu.expert_plan(ids, slots, layout, None)
    assert isinstance(plan, cpu_experts.PerTokenPlan) and cpu._fusable(batch, layout)
    fused = cpu.expert_ffn(cpu.prepare(x), batch, layout, plan, glu, 1.702, 7.0)
    separate = compose_expert_ffn(cpu, cpu.prepare(x), batch, layout, plan, glu, 1.702, 7.0)
    assert fused.shape == (A, D) and np.isfinite(separate).all()
    np.testing.assert_array_equal(fused, separate)


def test_float_weights_and_float32_numerics_keep_the_separate_ops():
    assert not moe_decode.supports(Q.F16, Q.F16, Q.Q8_0)
    assert not moe_decode.supports(Q.Q8_0, Q.Q4_0, Q.Q8_0)  # gate and up of different types
    batch = SimpleNamespace(gate=np.zeros((1, 32, 34), np.uint8), up=np.zeros((1, 32, 34), np.uint8),
                            down=np.zeros((1, 32, 34), np.uint8))
    layout = ExpertLayout(1, 32, 32, Q.Q8_0, Q.Q8_0, Q.Q8_0)
    assert CPUBackend()._fusable(batch, layout) and not CPUBackend("float32")._fusable(batch, layout)
