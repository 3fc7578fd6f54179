"""Hybrid compute beside the host tier (daemon/backend/cuda_cpu_share.py): a CPU worker computes
some of a decode step's missed experts from its own copy while the GPU reads the rest in place.
Its logits stay within tolerance of every expert in VRAM; with no share (n = 0) they are the same
bits; a job that fails fails its step, and the model goes on.

Runs on a GPU, or under numba's simulator (CI), where the worker's job is served inline at the wait.
"""

from __future__ import annotations

# first: it picks the GPU or the simulator as numba.cuda is imported
from tests.kernels.cuda.conftest import SKIP_REASON as CUDA_SKIP_REASON  # isort: skip

import numpy as np
import pytest

from daemon.errors import DeviceError
from daemon.kernels.cuda.device import SIM
from daemon.model.transformer import Transformer
from daemon.storage.gguf import GGUFFile
from tests.fixtures.build import fixture_path

pytestmark = pytest.mark.skipif(CUDA_SKIP_REASON is not None, reason=str(CUDA_SKIP_REASON))

# 4 experts, 2 a token, one MoE layer (the simulator is slow)
SMALL = dict(n_embd=32, n_head=4, n_head_kv=2, head_dim=8, n_ff=32, n_ff_exp=32, n_ff_shexp=32, n_expert=4,
             n_expert_used=2, n_layer=1)


@pytest.fixture(scope="module")
def gguf(fixture_dir):
    g = GGUFFile(fixture_path("qwen3moe", "Q8_0", fixture_dir, **SMALL))
    yield g
    g.close()


def _model(g, count: str, budget_experts: int = 3, slots: int = 1):
    """A host tier with `slots` VRAM slots a layer and a CPU copy of budget_experts experts a layer."""
    from daemon.backend.cuda import CUDABackend
    from daemon.backend.cuda_host_tier import HostTierExperts, expert_sources

    backend = CUDABackend(0)
    sources = expert_sources(g)
    per_expert = sum(s.n * s.rb for s in sources[next(iter(sources))])  # in the file
    per_slot = sum(s.n * -(-s.rb // 16) * 16 for s in sources[next(iter(sources))])  # rows padded to 16 bytes
    said = []
    tier = HostTierExperts.from_gguf(g, backend, slots * per_slot, said.append,
                                     cpu_budget_bytes=budget_experts * per_expert, cpu_count=count)
    return tier, Transformer(g, experts=tier, backend=backend), said


def _decode(model, steps: int = 3) -> np.ndarray:
    """A prefill of two tokens, then greedy decode steps: every row's logits, flat."""
    c = model.new_cache(16)
    out = [model.forward([1, 5], c, all_logits=True)]
    for _ in range(steps):
        out.append(model.forward([int(np.argmax(out[-1][-1]))], c))
    return np.concatenate([np.asarray(o).reshape(-1) for o in out])


@pytest.fixture(scope="module")
def want(gguf):
    from daemon.backend.cuda import CUDABackend

    backend = CUDABackend(0)
    return _decode(Transformer(gguf, experts=backend.resident_experts(gguf), backend=backend))


def test_the_cpu_computes_its_share_within_tolerance(gguf, want):
    tier, model, said = _model(gguf, "2")
    assert tier.share is not None and tier.share.tuner.n == 2 and tier.slots == 1
    assert any("hybrid compute" in s for s in said)
    got = _decode(model)
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-2 * float(np.abs(want).max()))
    st = tier.stats()
    assert st["cpu_jobs"] == 4 and st["cpu_pairs"] >= 1  # each step (of at most 16 rows) posted its layer
    assert model.device_fed  # the step still needs no routing on the host

# minutes each in the simulator, where CI runs near its time limit: these two run on a GPU
# (benchmarks/gpu_tests.sh); the share's tolerance and its failure stay in CI
_GPU_ONLY = pytest.mark.skipif(SIM, reason="a minute or more in the simulator: run on a GPU")


@_GPU_ONLY
def test_the_cpu_takes_only_misses_it_holds(gguf):
    """The device's split, read back: pairs of the VRAM expert, or of experts the CPU has no copy
    of, stay on the GPU; at most n of the rest go to the CPU."""
    tier, model, _ = _model(gguf, "1", budget_experts=1)  # the CPU holds expert 1 only
    share = tier.share
    _decode(model, steps=4)
    P = int(share._job[2] * share._job[3])
    mask, ids = share._mask[:P], share._ids[:P]
    assert set(ids[mask == 1].tolist()) <= {1}
    assert share.pairs >= 1  # routing picks expert 1 in these steps (else the test proves nothing)
    held = tier.held(next(iter(tier._batches)))
    assert not set(ids[mask == 1].tolist()) & set(held)


@_GPU_ONLY
def test_no_share_keeps_the_bits(gguf, want):
    tier, model, _ = _model(gguf, "0")
    np.testing.assert_array_equal(_decode(model), want)
    assert tier.stats()["cpu_jobs"] == 0


def test_a_failed_job_fails_its_step_and_the_model_goes_on(gguf, want, monkeypatch):
    tier, model, _ = _model(gguf, "2")
    c = model.new_cache(16)
    logits = model.forward([1, 5], c, all_logits=True)
    with monkeypatch.context() as m:
        def failing(*_a, **_k):
            raise RuntimeError("injected CPU fault")

        m.setattr(tier.share, "_serve", failing)
        with pytest.raises(DeviceError, match="injected CPU fault"):
            model.forward([int(np.argmax(logits[-1]))], c)
    got = _decode(model)
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-2 * float(np.abs(want).max()))
