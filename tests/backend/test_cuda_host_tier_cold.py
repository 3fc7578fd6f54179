"""Cold misses of a host tier smaller than the model (daemon/backend/cuda_host_tier.py): experts in
no tier are read from the file when a step needs them. A decode step that routes to one is flagged
on the device and runs again blocking; a prefill blocks, in waves when a layer needs more experts
than the host rows hold. Either way the logits, and seeded samples, are those of every expert in
VRAM, bit for bit; a read that fails fails the step, and the model goes on.

Runs on a GPU, or under numba's simulator (CI), where a mapped array is plain host memory.
"""

from __future__ import annotations

# first: it picks the GPU or the simulator as numba.cuda is imported
from tests.kernels.cuda.conftest import SKIP_REASON as CUDA_SKIP_REASON  # isort: skip

import numpy as np
import pytest

from daemon.model.transformer import Transformer
from daemon.storage.gguf import GGUFFile
from ipc.protocol import SamplingOptions
from tests.fixtures.build import fixture_path

pytestmark = pytest.mark.skipif(CUDA_SKIP_REASON is not None, reason=str(CUDA_SKIP_REASON))

# 4 experts, 2 a token, one MoE layer (the simulator is slow)
SMALL = dict(n_embd=32, n_head=4, n_head_kv=2, head_dim=8, n_ff=32, n_ff_exp=32, n_ff_shexp=32, n_expert=4,
             n_expert_used=2, n_layer=1)
SEEDED = SamplingOptions(temperature=0.9, top_k=0, top_p=1.0, min_p=0.0, seed=11, repeat_penalty=1.0)


@pytest.fixture(scope="module")
def gguf(fixture_dir):
    g = GGUFFile(fixture_path("qwen3moe", "Q8_0", fixture_dir, **SMALL))
    yield g
    g.close()


def _tier(g, rows: int, slots: int = 1):
    from daemon.backend.cuda import CUDABackend
    from daemon.backend.cuda_experts import DeviceExperts
    from daemon.backend.cuda_host_tier import HostTierExperts, expert_sources

    backend = CUDABackend(0)
    host = DeviceExperts.from_gguf(g, stream=backend.stream, mapped=True, rows=rows)
    tier = HostTierExperts(host, slots, backend.stream, gguf=g, sources=expert_sources(g))
    return tier, Transformer(g, experts=tier, backend=backend)


def _chill(tier) -> None:
    """Every host row emptied (their experts cold unless VRAM holds them), as if other steps had
    taken the rows: the next step needs an expert in no tier."""
    from daemon.backend.cuda_transfer import Transfers

    for lay in tier._layers:
        lay.row_holder[:] = -1
        lay.row_of[:] = -1
        lay.map[lay.map < 0] = -1
        Transfers.upload_into(lay.rows.device, lay.map, tier.stream)


def _run(model, chill=None) -> np.ndarray:
    """A prefill of two tokens, then two decode steps (greedy), each after chill(): every
    row's logits, flat."""
    c = model.new_cache(16)
    out = [model.forward([1, 5], c, all_logits=True)]
    for _ in range(2):
        if chill is not None:
            chill()
        out.append(model.forward([int(np.argmax(out[-1][-1]))], c))
    return np.concatenate([np.asarray(o).reshape(-1) for o in out])


@pytest.fixture(scope="module")
def want(gguf):
    from daemon.backend.cuda import CUDABackend

    backend = CUDABackend(0)
    return _run(Transformer(gguf, experts=backend.resident_experts(gguf), backend=backend))


def test_cold_experts_are_read_when_a_step_needs_them(gguf, want):
    """One host row (fewer than a token's experts: a blocking layer runs in waves), one VRAM slot:
    each decode step is flagged, then runs again (blocking at last); blocking throughout (routing on the
    host, every cold expert read first: block-on-miss) gives the same logits."""
    tier, model = _tier(gguf, 1)
    assert tier.cold_possible and tier.host_rows == 1
    assert model.device_fed  # a decode step still needs no routing on the host
    np.testing.assert_array_equal(_run(model, chill=lambda: _chill(tier)), want)
    st = tier.stats()
    assert st["cold_steps"] >= 2  # each decode step flagged at least once, then run again
    assert st["cold_loads"] >= 2 and st["host_rows_per_layer"] == 1
    assert tier.routing_free  # the blocking run is over
    assert tier._cold.copy_to_host().tolist() == [0]  # and left no flag behind for the next step
    tier.reset_stats()
    with tier.blocking():
        np.testing.assert_array_equal(_run(model, chill=lambda: _chill(tier)), want)
    assert tier.cold_steps == 0 and tier.cold_loads > 0


def test_a_rerun_step_samples_once(gguf):
    """Seeded sampling on the device: a step run again for a cold miss samples once (the sampler
    runs after the flag is read), so the tokens are the resident model's. Two host rows hold a
    token's experts: the flagged run's counts name the cold ones, and the second run (a graph
    again, not blocking) finds them."""
    from daemon.backend.cuda import CUDABackend

    def sample(model, chill=None):
        B = model.backend
        slots = B.sampler_slots()
        c = model.new_cache(16)
        sid = slots.assign(SEEDED, [1, 5], 16)
        try:
            out, _ = model.prefill_sampled([[1, 5]], [c], [sid])
            toks = [int(np.asarray(B.readback((out,)).wait()[0])[0])]
            if chill is not None:
                chill()
            out, _ = model.decode_sampled([toks[-1]], [c], [sid])
            toks.append(int(np.asarray(B.readback((out,)).wait()[0])[0]))
            return toks
        finally:
            slots.release(sid)

    backend = CUDABackend(0)
    ref = sample(Transformer(gguf, experts=backend.resident_experts(gguf), backend=backend))
    tier, model = _tier(gguf, 2)
    assert sample(model, chill=lambda: _chill(tier)) == ref
    assert tier.cold_steps == 1 and tier.blocked_steps == 1  # the prefill blocked; the decode step did not


def test_a_failed_read_fails_the_step_and_the_model_goes_on(gguf, want, monkeypatch):
    """The file cannot be read while a cold expert is needed: the step fails with the storage
    error, and the tier goes on (the rows it was writing are empty, their experts cold)."""
    from daemon.errors import StorageError

    tier, model = _tier(gguf, 2)
    with monkeypatch.context() as m:
        def failing(*_a, **_k):
            raise StorageError(f"{gguf.path}: cannot read tensor: injected I/O error")

        m.setattr(gguf, "read_into", failing)
        _chill(tier)
        with pytest.raises(StorageError, match="injected"):
            model.forward([1, 5], model.new_cache(8))
    assert tier.routing_free
    got = np.asarray(model.forward([1, 5], model.new_cache(8), all_logits=True)).reshape(-1)
    np.testing.assert_array_equal(got, want[:got.size])  # the prefill's rows


def test_the_host_budget_sets_the_rows(gguf):
    from daemon.backend.cuda import CUDABackend
    from daemon.backend.cuda_host_tier import HostTierExperts, expert_sources

    backend = CUDABackend(0)
    per_expert = sum(s.n * s.rb for s in expert_sources(gguf)[next(iter(expert_sources(gguf)))])
    said = []
    tier = HostTierExperts.from_gguf(gguf, backend, 0, said.append, host_budget_bytes=3 * per_expert)
    assert tier.host_rows == 3 and tier.cold_possible and tier.slots == 0
    assert "3 experts a layer" in said[0]
    full = HostTierExperts.from_gguf(gguf, backend, 0)
    assert full.host_rows == 4 and not full.cold_possible
