"""The VRAM expert cache with MOE_GPU_CACHE_POLICY=lfru (experts/policies.py): the live cache
evicts as the policy's replay does, hit counts worked out by hand. Same tiny fixture and
simulator as test_cuda_expert_cache.py (its fixtures)."""

from __future__ import annotations

# first: it picks the GPU or the simulator as numba.cuda is imported
from tests.kernels.cuda.conftest import SKIP_REASON as CUDA_SKIP_REASON  # isort: skip

import numpy as np
import pytest

from daemon.config import Settings
from tests.backend.test_cuda_expert_cache import N_LAYERS, VRAM_EXPERT, gguf  # noqa: F401 (a fixture)

cuda_only = pytest.mark.skipif(CUDA_SKIP_REASON is not None, reason=str(CUDA_SKIP_REASON))


def test_setting_accepts_lfru():
    assert Settings.load(env={"MOE_GPU_CACHE_POLICY": "lfru"}).gpu_cache_policy == "lfru"


@cuda_only
@pytest.mark.parametrize("eviction, hits", [("lru", 2), ("lfru", 3)])
def test_lfru_keeps_the_frequent_expert(gguf, eviction, hits):  # noqa: F811
    from daemon.backend.cuda import CUDABackend
    from daemon.backend.cuda_expert_cache import VRAMExpertCache
    from daemon.backend.cuda_transfer import pinned_empty
    from daemon.backend.host_experts import host_expert_cache
    from daemon.experts.offload import OffloadPolicy

    host = host_expert_cache(gguf, Settings.load(env={}), lambda _m: None, allocate=pinned_empty)
    cache = VRAMExpertCache(host, CUDABackend(0), 2 * VRAM_EXPERT * N_LAYERS, OffloadPolicy(0), eviction=eviction)
    try:
        _steps(cache, eviction, hits)
    finally:
        cache.close()


def _steps(cache, eviction, hits):
    # two slots: 0 0 0 1 2 0 1. At {2} LRU evicts 0 (last used before 1), then misses 0 and 1: hits
    # at steps 2 and 3. lfru scores 0 (three uses) far above 1 (one) and evicts 1: 0 hits again.
    for ids in [[0], [0], [0], [1], [2], [0], [1]]:
        with cache.fetch(0, ids, routed=np.array([ids])):
            pass
    st = cache.stats()
    assert (st["requests"], st["hits"]) == (7, hits)
    assert st[f"{eviction}_replay_hit_rate"] == round(hits / 7, 6)
    assert st["belady_hit_rate"] == round(3 / 7, 6)
