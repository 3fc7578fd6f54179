"""Experts streamed through the VRAM expert cache on a GPU (GPU only; the simulator cases are in
tests/backend/test_cuda_expert_cache.py): with hybrid compute off (MOE_OFFLOAD_MIN_BATCH=0) the
logits are the same bits as with every expert resident, whatever the VRAM cache size, the host
cache size, the routing mode, Post-Fetch on or off and block-on-miss, and whether decode steps run
eagerly or as graph segments (a cache holding a step's experts); with hybrid compute on they
stay within the CPU/GPU tolerance; a tiny VRAM cache and a tiny host cache together serve 8
concurrent requests, each getting its solo tokens. The fixtures include a Gated DeltaNet hybrid
(qwen3next: recurrent state beside the streamed experts). The same bit-identity on the demo MoE,
when it has been built."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

from daemon.config import Settings
from daemon.engine import Engine
from daemon.scheduler import Scheduler
from ipc.protocol import Chunk, Generate, SamplingOptions
from tests.fixtures.build import fixture_path
from tests.kernels.cuda.conftest import SKIP_REASON

CASES = [("qwen3moe", "Q8_0"), ("gpt-oss", "MXFP4"), ("qwen3next", "Q8_0")]  # qwen3next: a Gated DeltaNet hybrid
PROMPT = [11, 57, 203, 9, 88]
QUANT_TOL = 5e-2


def _gpu() -> str | None:
    if SKIP_REASON is not None:
        return SKIP_REASON
    from daemon.kernels.cuda.device import SIM

    return "numba's CUDA simulator: too slow for whole models (see test_cuda_expert_cache.py)" if SIM else None


pytestmark = pytest.mark.skipif(_gpu() is not None, reason=str(_gpu()))


def _slots_mb(path, slots: int) -> str:
    """MOE_GPU_CACHE_MB for `slots` experts per MoE layer of the model at path."""
    from daemon.backend.cuda_expert_cache import VRAMExpertCache
    from daemon.storage.gguf import GGUFFile
    from daemon.storage.store import expert_layouts

    with GGUFFile(path) as g:
        lays = expert_layouts(g)
    per = max(VRAMExpertCache._device_expert_bytes(lay) for lay in lays.values())
    return f"{(slots * per * len(lays) + 1023) / 2**20:.6f}"


def _logits(path, steps: int = 6, **settings) -> tuple[np.ndarray, dict | None]:
    """Prefill PROMPT and decode `steps` greedy tokens: every logits row [1 + steps, V], VRAM stats
    (with the backend's graph replays under "graph_replays")."""
    eng = Engine.load(path, device="cuda", **settings)
    try:
        m = eng.model
        cache = m.new_cache(64)
        rows = [np.asarray(m.forward(PROMPT, cache))[-1]]
        for _ in range(steps):
            rows.append(np.asarray(m.forward([int(np.argmax(rows[-1]))], cache))[-1])
        vram = eng.stats()["vram_cache"]
        if vram is not None:
            vram["graph_replays"] = m.backend.graphs.replays
        return np.stack(rows), vram
    finally:
        eng.close()


@pytest.fixture(scope="module", params=CASES, ids=[f"{a}-{w}" for a, w in CASES])
def model(request, fixture_dir):
    path = str(fixture_path(*request.param, fixture_dir))
    want, vram = _logits(path)
    assert vram is None  # every expert resident
    return path, want


MATRIX = [  # (VRAM slots per layer, host cache MB, routing, Post-Fetch, block on miss)
    # 3 or 4 slots of 8 hold a decode step's experts (2 a row, gpt-oss 4): graph segments, exact routing only
    (4, 0, "exact", True, True),
    (4, 0.05, "exact", False, True),
    (4, 0, "exact", True, False),
    (1, 0, "exact", True, True),
    (3, 0, "exact", True, True),
    (3, 0.05, "exact", True, True),
    (1, 0.05, "all", True, True),
    (3, 0, "all", False, True),
    (3, 0, "exact", True, False),
    (1, 0, "speculative", False, False),
]


def _streamed_bits_equal_resident(path, want, n_used, slots, host_mb, routing, postfetch, block) -> None:
    got, vram = _logits(path, gpu_cache_mb=_slots_mb(path, slots), expert_cache_limit_mb=host_mb, routing=routing,
                        postfetch_enable=postfetch, postfetch_block_on_miss=block, offload_min_batch="0")
    assert vram["misses"] > 0 and vram["loads"] > 0  # the cache really streamed
    assert vram["cpu_hybrid"] == 0 and vram["fallbacks"] == 0
    # decode steps replayed as graph segments exactly when a step's n_used experts fit and nothing but
    # the router reads the host (the first decode step runs eagerly, the second is captured)
    assert (vram["graph_replays"] > 0) == (slots >= n_used and routing == "exact")
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("slots,host_mb,routing,postfetch,block", MATRIX,
                         ids=[f"{s}slot-host{h}-{r}-pf{int(p)}-block{int(b)}" for s, h, r, p, b in MATRIX])
def test_hybrid_off_is_bit_identical_to_resident(model, slots, host_mb, routing, postfetch, block):
    path, want = model
    n_used = 4 if "gpt-oss" in path else 2  # experts a row (the fixtures')
    _streamed_bits_equal_resident(path, want, n_used, slots, host_mb, routing, postfetch, block)


def _prefill_logits(path, tokens, **settings) -> np.ndarray:
    with Engine.load(path, device="cuda", **settings) as eng:
        m = eng.model
        return np.asarray(m.forward(tokens, m.new_cache(len(tokens)), all_logits=True))


@pytest.mark.parametrize("slots", [1, 3])
def test_a_prompt_for_the_tiled_kernels_in_waves_is_bit_identical_to_resident(model, slots):
    """23 rows (the tiled kernels take more than 16) route to more experts than the slots hold:
    each wave's gate/up rows are kept at their pairs (they were once put at the first rows: NaN)."""
    path, _ = model
    tokens = list(range(5, 28))
    want = _prefill_logits(path, tokens)
    got = _prefill_logits(path, tokens, gpu_cache_mb=_slots_mb(path, slots), offload_min_batch="0")
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("slots", [2, 4])
def test_hybrid_on_in_graph_segments_is_within_tolerance(model, slots):
    """Every miss on the CPU, its pairs scattered in by the captured step (4 slots: segments; 2:
    eager for gpt-oss's 4 experts a row, segments for qwen3moe's 2)."""
    path, want = model
    got, vram = _logits(path, gpu_cache_mb=_slots_mb(path, slots), offload_min_batch="1000")
    assert vram["cpu_hybrid"] > 0 and vram["admitted"] > 0
    if slots == 4:
        assert vram["graph_replays"] > 0
    rel = np.linalg.norm(got - want, axis=-1) / np.linalg.norm(want, axis=-1)
    assert rel.max() < QUANT_TOL, rel


@pytest.mark.parametrize("min_batch", ["1000", "auto"])
def test_hybrid_on_is_within_tolerance(model, min_batch):
    path, want = model
    got, vram = _logits(path, gpu_cache_mb=_slots_mb(path, 2), offload_min_batch=min_batch)
    if min_batch == "1000":
        assert vram["cpu_hybrid"] > 0  # every miss on the CPU
    rel = np.linalg.norm(got - want, axis=-1) / np.linalg.norm(want, axis=-1)
    assert rel.max() < QUANT_TOL, rel


def test_force_cpu_is_within_tolerance(model):
    path, want = model
    got, vram = _logits(path, gpu_cache_mb=_slots_mb(path, 2), postfetch_force_cpu=True)
    assert vram["cpu_forced"] > 0 and vram["loads"] == 0
    rel = np.linalg.norm(got - want, axis=-1) / np.linalg.norm(want, axis=-1)
    assert rel.max() < QUANT_TOL, rel


@pytest.fixture(scope="module")
def demo():
    """The demo MoE (SmolLM2 made into 16 experts, 12 used; real routing on real weights) when it has
    been built (`moed demo-model`; tests never build it: it takes minutes), and its resident logits."""
    from daemon.demo import cache_dir

    path = cache_dir() / "smollm2-135m-moe-e16k12.gguf"
    if not path.exists():
        pytest.skip(f"no demo model at {path} (build it with `moed demo-model`)")
    want, vram = _logits(str(path))
    assert vram is None
    return str(path), want


DEMO_MATRIX = [  # as MATRIX; 12 slots hold a decode step's 12 experts (graph segments), fewer run in waves
    (12, 0, "exact", True, True),
    (12, 0.05, "exact", False, True),
    (8, 0, "exact", True, False),
    (4, 30, "all", True, True),
    (2, 0.05, "speculative", False, True),
]


@pytest.mark.parametrize("slots,host_mb,routing,postfetch,block", DEMO_MATRIX,
                         ids=[f"{s}slot-host{h}-{r}-pf{int(p)}-block{int(b)}" for s, h, r, p, b in DEMO_MATRIX])
def test_demo_moe_hybrid_off_is_bit_identical_to_resident(demo, slots, host_mb, routing, postfetch, block):
    path, want = demo
    _streamed_bits_equal_resident(path, want, 12, slots, host_mb, routing, postfetch, block)


async def _run(s: Scheduler, req) -> list[int]:
    replies = []
    await s.generate(req, replies.append, time.perf_counter_ns())
    return [t for r in replies if isinstance(r, Chunk) for t in r.tokens]


@pytest.mark.parametrize("arch", ["qwen3moe", "qwen3next"])
@pytest.mark.parametrize("slots", [1, 4])
async def test_tiny_caches_serve_eight_concurrent_requests(fixture_dir, slots, arch):
    """One VRAM slot per layer (or four: steps of one or two sequences run as graph segments, larger
    ones eagerly) and a host cache of about one expert: nothing deadlocks or stalls, every request
    completes with its solo tokens (qwen3next: each sequence's recurrent state its own in the batch)."""
    path = str(fixture_path(arch, "Q8_0", fixture_dir))
    settings = dict(device="cuda", gpu_cache_mb=_slots_mb(path, slots), expert_cache_limit_mb=0.02,
                    offload_min_batch="0")
    s = Scheduler(Settings.load(env={}, device="cuda"), factory=lambda p, **kw: Engine.load(p, **{**settings, **kw}),
                  default_model=lambda _progress: path)
    try:
        greedy = SamplingOptions(temperature=0.0)
        ps = [[(17 * i + 3) % 500 + 1, (31 * i + 7) % 500 + 1, 260 + i] for i in range(8)]
        lengths = [6 + 3 * i for i in range(8)]
        solo = [await _run(s, Generate(i + 1, path, tokens=p, max_tokens=n, options=greedy))
                for i, (p, n) in enumerate(zip(ps, lengths))]
        together = await asyncio.wait_for(asyncio.gather(*[
            _run(s, Generate(100 + i, path, tokens=p, max_tokens=n, options=greedy))
            for i, (p, n) in enumerate(zip(ps, lengths))]), timeout=300)
        assert together == solo
        assert all(0 < len(t) <= n for t, n in zip(together, lengths))  # each completed (EOS may come early)
        vram = s.registry.find(path).engine.stats()["vram_cache"]
        assert vram["evictions"] > 0
    finally:
        await s.close()
