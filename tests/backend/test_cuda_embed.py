"""Embeddings (issue 29: /api/embed, /v1/embeddings) of a model loaded on the GPU: the final hidden
states of Transformer.hidden_states run on the CUDA backend in graphs of their own, never the
step that ends in logits.
- Each text's embedding is the CPU's within the GPU/CPU tolerance (test_cuda_model's), for every
  family and with the VRAM expert cache holding fewer experts than the model has.
- An embedding taken between decode steps changes none of their bits, and the same text embeds to
  the same bits each time (the second run replays the hidden-state graph the first captured).

GPU only: under numba's simulator even one layer's hidden states take over a minute (the step's
kernels are tested there one by one, and the hidden-state step's semantics on the CPU by
tests/test_engine_embed.py)."""

from __future__ import annotations

import numpy as np
import pytest

from daemon.backend import CPUBackend
from daemon.model.transformer import Transformer
from daemon.storage.gguf import GGUFFile
from tests.fixtures.build import fixture_path

from .conftest import CUDA_SKIP_REASON
from .test_cuda_model import QUANT_TOL, SMALL, _rel

pytestmark = pytest.mark.skipif(CUDA_SKIP_REASON is not None, reason=str(CUDA_SKIP_REASON))

TEXTS = ["Hello world", "The quick brown fox jumps over the lazy dog."]
CASES = [("qwen3moe", "Q8_0"), ("gpt-oss", "MXFP4"), ("qwen3next", "Q8_0"), ("llama", "Q8_0")]


def _simulated() -> bool:
    from daemon.kernels.cuda.device import SIM

    return SIM


def _gpu_only():
    if _simulated():
        pytest.skip("a whole model under numba's CUDA simulator takes minutes: GPU only")


def test_hidden_states_match_the_cpus(fixture_dir):
    """One layer, three tokens: the post-norm hidden states [T, D] within the tolerance, on the host."""
    _gpu_only()
    from daemon.backend.cuda import CUDABackend

    g = GGUFFile(fixture_path("qwen3moe", "Q8_0", fixture_dir, **dict(SMALL, n_layer=1)))
    try:
        b = CUDABackend(0)
        gpu = Transformer(g, experts=b.resident_experts(g), backend=b)
        cpu = Transformer(g, backend=CPUBackend("ggml"))
        tokens = [5, 9, 13]
        want = cpu.hidden_states(tokens, cpu.new_cache(8))
        got = gpu.hidden_states(tokens, gpu.new_cache(8))
        assert isinstance(got, np.ndarray) and got.shape == want.shape == (3, SMALL["n_embd"])
        assert (_rel(got, want) < QUANT_TOL).all(), _rel(got, want)
    finally:
        g.close()


def _embed(path, **settings) -> np.ndarray:
    from daemon.engine import Engine

    with Engine.load(path, **settings) as engine:
        return engine.embed(TEXTS)[0]


@pytest.mark.parametrize("case", CASES, ids=[f"{a}-{w}" for a, w in CASES])
def test_embeddings_on_the_gpu_are_the_cpus(case, fixture_dir):
    _gpu_only()
    from tests.scheduler.test_cuda_offload import _slots_mb

    path = str(fixture_path(*case, fixture_dir))
    want = _embed(path, device="cpu", n_threads=1)
    resident = _embed(path, device="cuda")
    assert resident.shape == want.shape and resident.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(resident, axis=1), 1.0, atol=1e-5)
    assert (_rel(resident, want) < QUANT_TOL).all(), _rel(resident, want)
    if case[0] != "llama":  # an MoE: the VRAM expert cache (2 slots a layer) holds the same bits as
        # resident experts when the hybrid compute is off
        cached = _embed(path, device="cuda", gpu_cache_mb=_slots_mb(path, 2), offload_min_batch="0")
        assert np.array_equal(cached, resident)


def test_an_embedding_between_decode_steps_changes_nothing(fixture_dir):
    """Greedy decode (graph-replayed) with an embedding taken between its steps gives the same logits
    bits as without one; and the same text embeds to the same bits twice."""
    _gpu_only()
    from daemon.engine import Engine

    with Engine.load(str(fixture_path("qwen3moe", "Q8_0", fixture_dir)), device="cuda") as engine:
        m = engine.model

        def decode(between) -> np.ndarray:
            cache = m.new_cache(64)
            rows = [np.asarray(m.forward([11, 57, 203, 9], cache))[-1]]
            for _ in range(6):
                between()
                rows.append(np.asarray(m.forward([int(np.argmax(rows[-1]))], cache))[-1])
            return np.stack(rows)

        plain = decode(lambda: None)
        seen = []
        mixed = decode(lambda: seen.append(engine.embed(TEXTS[:1])[0]))
        assert np.array_equal(plain, mixed)
        assert m.backend.graphs.replays > 0
        assert all(np.array_equal(seen[0], s) for s in seen[1:])
