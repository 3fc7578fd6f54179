"""MOE_DEVICE: parsing, the auto fallbacks with their one log line, explicit cuda's errors, the VRAM
estimate, and an engine loaded on the CUDA backend (the simulator when there is no GPU: loading
runs no kernel, so this stays fast)."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from daemon.backend import CPUBackend
from daemon.backend import select as sel
from daemon.config import Settings
from daemon.errors import ConfigError, DeviceError
from daemon.model.family import family_for
from daemon.storage.gguf import GGUFFile
from tests.fixtures.build import fixture_path

from .conftest import CUDA_SKIP_REASON

needs_cuda = pytest.mark.skipif(CUDA_SKIP_REASON is not None, reason=str(CUDA_SKIP_REASON))
SMALL = dict(n_layer=1, n_embd=64, n_head=4, n_head_kv=2, head_dim=16, n_ff=64, n_ff_exp=64, n_ff_shexp=64,
             n_expert=4, n_expert_used=2)


@pytest.fixture(scope="module")
def small_moe(fixture_dir):
    return fixture_path("qwen3moe", "Q8_0", fixture_dir, **SMALL)


@pytest.mark.parametrize("value,want", [("auto", ("auto", None)), ("cpu", ("cpu", None)), ("cuda", ("cuda", 0)),
                                        ("cuda:3", ("cuda", 3)), ("CUDA:1", ("cuda", 1))])
def test_parse_device(value, want):
    assert sel.parse_device(value) == want


@pytest.mark.parametrize("value", ["gpu", "cuda:", "cuda:x", "cuda:-1", "rocm"])
def test_bad_device_setting_is_a_config_error(value):
    with pytest.raises(ConfigError, match="MOE_DEVICE"):
        Settings.load(env={"MOE_DEVICE": value})
    assert Settings.load(env={"MOE_DEVICE": "cuda:2"}).device == "cuda:2"


def test_cpu_is_cpu_without_probing(small_moe, monkeypatch, caplog):
    monkeypatch.setattr(sel, "cuda_unusable", lambda *a: pytest.fail("probed the GPU"))
    with GGUFFile(small_moe) as g, caplog.at_level(logging.INFO, "moed.device"):
        backend = sel.select_backend(Settings.load(env={}, device="cpu", numerics="float32"), g)
    assert isinstance(backend, CPUBackend) and backend.numerics == "float32"
    assert caplog.messages == ["device: cpu (MOE_DEVICE=cpu)"]


def test_auto_without_a_gpu_is_the_cpu_with_one_line(small_moe, monkeypatch, caplog):
    monkeypatch.setattr(sel, "cuda_unusable", lambda index, allow_simulator: "the CUDA driver reports no GPU")
    with GGUFFile(small_moe) as g, caplog.at_level(logging.INFO, "moed.device"):
        backend = sel.select_backend(Settings.load(env={}, device="auto"), g)
    assert isinstance(backend, CPUBackend)
    assert caplog.messages == ["device: cpu (MOE_DEVICE=auto: the CUDA driver reports no GPU)"]


def test_explicit_cuda_without_a_gpu_is_a_device_error(small_moe, monkeypatch):
    monkeypatch.setattr(sel, "cuda_unusable", lambda index, allow_simulator: f"there is no GPU {index}")
    with GGUFFile(small_moe) as g, pytest.raises(DeviceError, match="MOE_DEVICE=cuda:2: there is no GPU 2"):
        sel.select_backend(Settings.load(env={}, device="cuda:2"), g)


def test_a_model_that_does_not_fit_says_its_sizes(small_moe, monkeypatch, caplog):
    monkeypatch.setattr(sel, "cuda_unusable", lambda index, allow_simulator: None)
    monkeypatch.setattr(sel, "_free_memory", lambda index: (2**20, 80 * 2**30, "Tiny GPU"))
    with GGUFFile(small_moe) as g:
        with caplog.at_level(logging.INFO, "moed.device"):
            assert isinstance(sel.select_backend(Settings.load(env={}, device="auto", n_ctx=64), g), CPUBackend)
        (line,) = caplog.messages
        assert line.startswith("device: cpu (MOE_DEVICE=auto: the model needs about ")
        assert "weights" in line and "experts" in line and "per sequence of 64 positions" in line
        assert "cuda:0 (Tiny GPU) has 1 MiB free of 81,920 MiB" in line
        with pytest.raises(DeviceError, match="the model needs about .* has 1 MiB free"):
            sel.select_backend(Settings.load(env={}, device="cuda", n_ctx=64), g)


def test_no_numba_cuda_is_said(monkeypatch):
    monkeypatch.setattr(sel.importlib.util, "find_spec", lambda name: None)
    assert "numba-cuda is not installed" in sel.cuda_unusable(0, allow_simulator=True)


def test_vram_estimate_counts_what_the_backend_stores(small_moe):
    """Matrices repacked (rows rounded up to 16 bytes), vectors as float32, experts apart, KV as
    f16 keys and values of one sequence; checked against a count made here from the tensors."""
    with GGUFFile(small_moe) as g:
        hp = family_for(g.architecture).read_hparams(g)
        est = sel.estimate_vram(g, hp, 100)
        weights = experts = 0
        for ti in g.tensors.values():
            if len(ti.ne) == 1:
                size = 4 * ti.ne[0]
            else:
                rows = int(np.prod(ti.ne[1:]))
                size = rows * ((ti.nbytes // rows + 15) // 16 * 16)
            if "_exps." in ti.name:
                experts += size
            else:
                weights += size
    assert (est.weights, est.experts) == (weights, experts) and experts > 0
    assert est.kv_per_sequence == 1 * 2 * 2 * 16 * 2 * 100  # layers x Hkv x (k, v) x Dh x f16 x positions
    assert est.total == est.weights + est.experts + est.kv_per_sequence + est.scratch



def test_vram_estimate_of_a_hybrid_counts_kv_and_recurrent_states(fixture_dir):
    """qwen3next: f16 KV only in its one attention layer, and per recurrent layer the f32 conv
    state [C, Kc-1] and delta-rule state [Hv, Dv, Dk] the CUDA pool stores."""
    from tests.fixtures.build import fixture_config, fixture_path

    c = fixture_config("qwen3next")
    with GGUFFile(fixture_path("qwen3next", "Q8_0", fixture_dir)) as g:
        hp = family_for(g.architecture).read_hparams(g)
        est = sel.estimate_vram(g, hp, 100)
    Dk, Hk, Hv, Kc = c.ssm_state_size, c.ssm_group_count, c.ssm_time_step_rank, c.ssm_conv_kernel
    C = 2 * Hk * Dk + Hv * Dk
    kv = 1 * c.n_head_kv * 2 * c.head_dim * 2 * 100  # one attention layer, f16 k and v
    states = 3 * 4 * (C * (Kc - 1) + Hv * Dk * Dk)  # three delta-net layers, f32
    assert est.kv_per_sequence == kv + states

@needs_cuda
def test_engine_on_cuda_reports_device_and_vram(small_moe, caplog):
    from daemon.engine import Engine

    with caplog.at_level(logging.INFO, "moed.device"):
        engine = Engine.load(small_moe, device="cuda", n_ctx=64)
    with engine:
        assert any(m.startswith("device: cuda:0 (") for m in caplog.messages)
        stats = engine.stats()
        backend = engine.model.backend
        assert stats["device"] == "cuda:0" and stats["cache"] is None  # every expert in VRAM
        assert stats["vram_bytes"] == backend.vram_bytes() > 0
        assert stats["graphs"] == {"held": 0, "bytes": 0, "captures": 0, "replays": 0, "eager_shapes": 0}  # nothing run yet
        est = backend.estimate
        assert backend.bytes["experts"] == est.experts and backend.bytes["weights"] <= est.weights


def test_engine_on_cpu_reports_the_cpu(small_moe):
    from daemon.engine import Engine

    with Engine.load(small_moe, device="cpu") as engine:
        stats = engine.stats()
    assert stats["device"] == "cpu" and stats["vram_bytes"] == 0 and stats["graphs"] is None
