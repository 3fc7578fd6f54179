"""The host tier (daemon/backend/cuda_host_tier.py): every expert in mapped host memory, a few in
VRAM slots, read where the device slot map says, the slots following use. The whole model gives
the logits of every expert in VRAM, bit for bit, after a promotion; a decode step needs no routing
on the host.

Runs on a GPU, or under numba's simulator (CI), where a mapped array is plain host memory.
"""

from __future__ import annotations

# first: it picks the GPU or the simulator as numba.cuda is imported
from tests.kernels.cuda.conftest import SKIP_REASON as CUDA_SKIP_REASON  # isort: skip

import numpy as np
import pytest

from daemon.model.transformer import Transformer
from daemon.storage.gguf import GGUFFile
from tests.fixtures.build import fixture_path

pytestmark = pytest.mark.skipif(CUDA_SKIP_REASON is not None, reason=str(CUDA_SKIP_REASON))

SMALL = dict(n_embd=32, n_head=4, n_head_kv=2, head_dim=8, n_ff=32, n_ff_exp=32, n_ff_shexp=32, n_expert=4,
             n_expert_used=2, n_layer=2)
CASES = [("qwen3moe", "Q8_0", SMALL), ("gpt-oss", "MXFP4", dict(SMALL, n_head=8))]  # gpt-oss: expert biases


def _logits(model) -> np.ndarray:
    """A prefill of two tokens, then a decode step: every row's logits, flat."""
    c = model.new_cache(8)
    out = [model.forward([1, 5], c, all_logits=True), model.forward([7], c)]
    return np.concatenate([np.asarray(o).reshape(-1) for o in out])


@pytest.fixture(scope="module", params=CASES, ids=lambda c: f"{c[0]}-{c[1]}")
def case(request, fixture_dir):
    from daemon.backend.cuda import CUDABackend

    arch, wtype, dims = request.param
    g = GGUFFile(fixture_path(arch, wtype, fixture_dir, **dims))
    backend = CUDABackend(0)
    want = _logits(Transformer(g, experts=backend.resident_experts(g), backend=backend))
    yield g, want
    g.close()


def test_a_promoted_expert_serves_from_its_slot_with_the_resident_logits(case):
    """One slot a layer (expert 0 at load); counts that favour expert 3 move it in: the victim is
    unpublished, the copy made, then the slot published, over three passes once each copy is done. The kernels cover all-VRAM and all-host (tests/kernels/cuda)."""
    from daemon.backend.cuda import CUDABackend
    from daemon.backend.cuda_experts import DeviceExperts
    from daemon.backend.cuda_host_tier import HostTierExperts

    g, want = case
    backend = CUDABackend(0)
    tier = HostTierExperts(DeviceExperts.from_gguf(g, stream=backend.stream, mapped=True), 1, backend.stream,
                           max_moves=1, period=1)
    model = Transformer(g, experts=tier, backend=backend)
    assert model.device_fed  # no routing on the host: a decode step can be one graph
    layers = model.moe_layers
    assert [tier.held(il) for il in layers] == [[0]] * len(layers)
    for lay in tier._layers:
        lay.rows.usage.copy_to_device(np.array([0, 1, 0, 9], np.int32))  # as if counted by steps
    for _ in range(20):  # read the counts; start the move; publish it (three passes once copies are done)
        tier.begin_pass()
        tier.launched()
        backend.stream.synchronize()
        tier._xfer.fetch.synchronize()
        if tier.promotions == len(layers):
            break
    assert [tier.held(il) for il in layers] == [[3]] * len(layers) and tier.promotions == len(layers)
    st = tier.stats()  # the counts read once: 10 pairs a layer of experts 1 and 3, neither in the slot then
    assert st["pairs"] == 10 * len(layers) and st["requests"] == 2 * len(layers) and st["hit_rate"] == 0.0
    assert st["belady_hit_rate"] == st["opt_bypass_hit_rate"] == 0.0  # one step: every request a cold miss
    assert st["read_in_place_bytes"] == st["pairs"] * tier._layers[0].expert_bytes
    assert st["promoted_bytes"] == len(layers) * tier._layers[0].expert_bytes
    for lay in tier._layers:
        assert lay.rows.device.copy_to_host().tolist() == [-2, -3, -4, 0]
        for st in lay.stacks:
            np.testing.assert_array_equal(st.vram.copy_to_host()[0], np.asarray(st.host.copy_to_host())[3])
    np.testing.assert_array_equal(_logits(model), want)
    per_layer = tier.vram_bytes // len(layers)
    assert tier.host_bytes == 4 * per_layer * len(layers)  # every expert in the host tier


def test_the_slot_budget_sets_the_slots(fixture_dir):
    from daemon.backend.cuda import CUDABackend
    from daemon.backend.cuda_host_tier import HostTierExperts

    g = GGUFFile(fixture_path("qwen3moe", "Q8_0", fixture_dir, **SMALL))
    backend = CUDABackend(0)
    said = []
    full = HostTierExperts.from_gguf(g, backend, 1 << 40, said.append)
    assert full.slots >= 4 and said and "host tier" in said[0]
    per_expert = full.vram_bytes // (4 * 2)  # 4 experts in 2 layers
    two = HostTierExperts.from_gguf(g, backend, 2 * 2 * per_expert + per_expert // 2)
    assert two.slots == 2 and two.vram_bytes == 2 * 2 * per_expert
    g.close()


def test_a_failed_promotion_fails_nothing(fixture_dir, caplog):
    """A copy into a slot that raises a CUDA error: the victim stays unpublished (read from the
    host tier), the newcomer too, one warning; a later move fills the empty slot."""
    from daemon.backend.cuda import CUDABackend
    from daemon.backend.cuda_errors import CUDA_ERRORS
    from daemon.backend.cuda_experts import DeviceExperts
    from daemon.backend.cuda_host_tier import HostTierExperts

    g = GGUFFile(fixture_path("qwen3moe", "Q8_0", fixture_dir, **SMALL))
    backend = CUDABackend(0)
    tier = HostTierExperts(DeviceExperts.from_gguf(g, stream=backend.stream, mapped=True), 1, backend.stream,
                           max_moves=1, period=1)
    n = len(tier._layers)

    def use_expert_3():
        for lay in tier._layers:
            lay.rows.usage.copy_to_device(np.array([0, 1, 0, 9], np.int32))

    def passes():
        for _ in range(20):
            tier.begin_pass()
            tier.launched()
            backend.stream.synchronize()
            tier._xfer.fetch.synchronize()

    def fail():
        raise CUDA_ERRORS[0](700, "injected")

    tier._xfer.fault = fail  # the batched copy into the slots raises
    use_expert_3()
    with caplog.at_level("WARNING", logger="moed.device"):
        passes()
    tier._xfer.fault = None
    assert tier.failed_moves >= n and tier.promotions == 0
    assert caplog.text.count("copying experts into VRAM slots failed") == 1
    for lay in tier._layers:
        assert lay.rows.device.copy_to_host().tolist() == [-2, -3, -4, -5]  # every expert from the host tier
        assert lay.holder.tolist() == [-1]
    use_expert_3()
    passes()
    assert tier.promotions == n and all(tier.held(lay.il) == [3] for lay in tier._layers)
    g.close()


def test_replayed_routing_stays_on_the_device(case, tmp_path):
    """MOE_ROUTING_REPLAY's ids are gathered on the device at each step's positions (Backend.
    replay_routes): the host tier still needs no routing on the host (a decode step is one graph,
    on a GPU), and its logits are those of every expert in VRAM under the same replay."""
    import json

    from daemon.backend.cuda import CUDABackend
    from daemon.backend.cuda_experts import DeviceExperts
    from daemon.backend.cuda_host_tier import HostTierExperts
    from daemon.kernels.cuda.device import SIM
    from daemon.routing.replay_routing import RoutingReplay

    g, unreplayed = case
    if g.architecture != "qwen3moe":
        pytest.skip("one family is enough: the gather does not depend on it (and the simulator is slow)")
    trace = tmp_path / "t.jsonl"  # 3 tokens (positions wrap), 2 layers, ids of 4 experts
    rows = [[[3, 2], [0, 3]], [[1, 0], [2, 1]], [[2, 3], [3, 0]]]
    trace.write_text("".join(json.dumps({"tok": n, "layers": r}) + "\n" for n, r in enumerate(rows, 1)))

    def run(model):
        RoutingReplay.load(trace, model).attach(model)
        c = model.new_cache(16)
        out = [model.forward([1, 5], c, all_logits=True)]
        token = int(np.argmax(out[-1][-1]))
        for _ in range(2):  # positions 2 and 3: the second wraps to the trace's first token
            out.append(model.forward([token], c))
            token = int(np.argmax(out[-1][-1]))
        return np.concatenate([np.asarray(o).reshape(-1) for o in out])

    backend = CUDABackend(0)
    want = run(Transformer(g, experts=backend.resident_experts(g), backend=backend))
    backend = CUDABackend(0)
    tier = HostTierExperts(DeviceExperts.from_gguf(g, stream=backend.stream, mapped=True), 1, backend.stream)
    model = Transformer(g, experts=tier, backend=backend)
    got = run(model)
    assert model.device_fed
    np.testing.assert_array_equal(got, want)
    assert not np.array_equal(got[:unreplayed.size], unreplayed)  # the trace's experts, not the router's
    if not SIM:
        assert backend.graphs.replays > 0


def test_a_failed_in_place_read_fails_the_step_and_the_model_goes_on(case, monkeypatch, request):
    """An expert kernel reading the host tier that hits a CUDA error (injected at its launch): the
    step fails with a DeviceError naming the device and the op; the next step on a fresh sequence
    gives the logits of every expert in VRAM."""
    from daemon.backend import cuda as cuda_backend
    from daemon.backend.cuda import CUDABackend
    from daemon.kernels.cuda.device import SIM

    if SIM and "gpt-oss" in request.node.name:  # the failure path is the same for both families
        pytest.skip("a minute in the simulator, where CI runs near its time limit: qwen3moe covers it there")
    from daemon.backend.cuda_errors import CUDA_ERRORS
    from daemon.backend.cuda_experts import DeviceExperts
    from daemon.backend.cuda_host_tier import HostTierExperts
    from daemon.errors import DeviceError

    g, want = case
    backend = CUDABackend(0)
    tier = HostTierExperts(DeviceExperts.from_gguf(g, stream=backend.stream, mapped=True), 1, backend.stream)
    model = Transformer(g, experts=tier, backend=backend)
    calls = []

    def failing(*_a, **_k):
        calls.append(1)
        raise CUDA_ERRORS[0](700, "injected: an in-place read failed")

    with monkeypatch.context() as m:
        m.setattr(cuda_backend.mmvq, "mul_mat_vec_glu_ids", failing)
        m.setattr(cuda_backend.mmvq, "mul_mat_vec_ids", failing)
        m.setattr(cuda_backend.mmq, "mul_mat_q_ids", failing)
        with pytest.raises(DeviceError, match=r"expert_glu failed: .*injected"):
            model.forward([1, 5], model.new_cache(8))
    assert calls
    np.testing.assert_array_equal(_logits(model), want)
