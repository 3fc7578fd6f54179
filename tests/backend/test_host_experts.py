"""The experts' host tier (daemon/backend/host_experts.py) and how each backend builds its expert
provider on it."""

from __future__ import annotations

from daemon.backend import CPUBackend
from daemon.config import Settings
from daemon.storage.cache import ExpertCache
from daemon.storage.gguf import GGUFFile
from tests.fixtures.build import fixture_path


def test_demand_reads_auto_follows_the_thread_count(monkeypatch):
    from daemon.backend.host_experts import demand_reads

    monkeypatch.setattr("numba.get_num_threads", lambda: 2)
    assert demand_reads(Settings.load({}, io_depth=8)) == "io"
    monkeypatch.setattr("numba.get_num_threads", lambda: 16)
    assert demand_reads(Settings.load({}, io_depth=8)) == "compute"
    assert demand_reads(Settings.load({"MOE_DEMAND_READS": "io"})) == "io"


def test_the_cpu_streams_its_experts_from_the_host_cache(fixture_dir):
    said = []
    with GGUFFile(fixture_path("qwen3moe", "Q8_0", fixture_dir)) as g:
        experts, closer = CPUBackend().expert_provider(g, Settings.load({}, expert_cache_limit_mb=1.0), said.append)
        try:
            assert isinstance(experts, ExpertCache) and closer is experts
            assert experts.limit_bytes == 2**20
            assert said == ["streaming experts from the gguf (1 MB, lru)"]  # the limit and the eviction policy
        finally:
            experts.close()


def test_a_model_without_experts_has_no_provider(fixture_dir):
    with GGUFFile(fixture_path("llama", "Q8_0", fixture_dir)) as g:
        assert CPUBackend().expert_provider(g, Settings.load({}), lambda _m: None) == (None, None)
