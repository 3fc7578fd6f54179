"""qwen3next and qwen35moe (Gated DeltaNet hybrids) on the CUDA backend, whole model, against the
CPU backend on the tiny fixtures: a batched prefill of prompts of different lengths and decode
steps teacher-forced with the CPU's greedy tokens (logits within tolerance, the same greedy token
or a near-tie, routing differences only at near-ties: test_cuda_model's checks), each sequence
the same bits alone as in the batch, a sequence in a reused slot the same bits as in a fresh one
(its recurrent state zeroed), and decode steps replayed as CUDA graphs the same bits as eager
ones across a pool growth (the graphs hold the states' addresses).

GPU only: under numba's simulator one tiny case of these takes minutes (the kernels and the
backend ops are tested there by tests/kernels/cuda/test_ops_gdn.py and
tests/backend/test_cuda_hybrid_cache.py)."""

from __future__ import annotations

import gc

import numpy as np
import pytest

from daemon.backend import CPUBackend
from daemon.model.transformer import Transformer
from daemon.storage.gguf import GGUFFile
from tests.fixtures.build import fixture_path

from .conftest import CUDA_SKIP_REASON
from .test_cuda_model import FLOAT_TOL, QUANT_TOL, _flips, _record_routes, _rel, _same_pick

pytestmark = pytest.mark.skipif(CUDA_SKIP_REASON is not None, reason=str(CUDA_SKIP_REASON))

CASES = [("qwen3next", "F32"), ("qwen3next", "Q8_0"), ("qwen3next", "Q4_K"), ("qwen35moe", "F16"),
         ("qwen35moe", "Q8_0")]
PROMPTS = [np.arange(3, 20), np.array([7]), np.array([9, 1, 4])]  # 17 rows: the tiled matmul


def _gpu_only():
    from daemon.kernels.cuda.device import SIM

    if SIM:
        pytest.skip("a whole hybrid model under numba's CUDA simulator takes minutes: GPU only")


@pytest.fixture(scope="module", params=CASES, ids=[f"{a}-{w}" for a, w in CASES])
def models(request, fixture_dir):
    _gpu_only()
    from daemon.backend.cuda import CUDABackend

    arch, wtype = request.param
    g = GGUFFile(fixture_path(arch, wtype, fixture_dir))
    b = CUDABackend(0)
    gpu = Transformer(g, experts=b.resident_experts(g), backend=b)
    cpu = Transformer(g, backend=CPUBackend("ggml"))
    yield cpu, gpu, FLOAT_TOL if wtype in ("F32", "F16") else QUANT_TOL
    g.close()


def test_logits_match_the_cpu_and_sequences_are_batch_invariant(models):
    cpu, gpu, tol = models
    graphs, gpu.backend.use_graphs = gpu.backend.use_graphs, False  # the routes are read back each step
    cpu_calls, gpu_calls = [], []
    _record_routes(cpu.backend, cpu_calls)
    _record_routes(gpu.backend, gpu_calls)
    try:
        cc, gc_ = [cpu.new_cache(64) for _ in PROMPTS], [gpu.new_cache(64) for _ in PROMPTS]
        steps, flipped = [], set()
        offsets = np.cumsum([0] + [len(p) for p in PROMPTS])
        want, got = cpu.forward_many(PROMPTS, cc), gpu.forward_many(PROMPTS, gc_)
        tokens = []
        for i in range(6):
            flipped |= _flips(cpu_calls, gpu_calls, offsets, tol)
            steps.append((want, got, set(flipped)))
            tokens.append(want.argmax(axis=1))
            cpu_calls.clear()
            gpu_calls.clear()
            want, got = cpu.forward_batch(tokens[-1], cc), gpu.forward_batch(tokens[-1], gc_)
            offsets = np.arange(len(PROMPTS) + 1)
        flipped |= _flips(cpu_calls, gpu_calls, offsets, tol)
        steps.append((want, got, set(flipped)))
    finally:
        del cpu.backend.route, gpu.backend.route
        gpu.backend.use_graphs = graphs
    for i, (want, got, flips) in enumerate(steps):
        kept = [s for s in range(len(PROMPTS)) if s not in flips]
        assert kept, "every sequence was routed differently"
        assert np.all(_rel(got[kept], want[kept]) < tol), (i, kept, _rel(got, want))
        assert all(_same_pick(got[s], want[s], tol) for s in kept), i

    for s in range(len(PROMPTS)):  # each sequence by itself: its rows of the batched steps, bit for bit
        c = gpu.new_cache(64)
        alone = [gpu.forward(PROMPTS[s], c)[-1]] + [gpu.forward([int(t[s])], c)[-1] for t in tokens]
        for i, row in enumerate(alone):
            assert np.array_equal(row, steps[i][1][s]), (s, i)


def test_a_reused_slot_computes_as_a_fresh_one(models):
    """A sequence runs and goes; the next one takes its slot (holding that state) and gets the
    same bits as the first did from a fresh slot."""
    _, gpu, _ = models
    prompt = np.array([5, 8, 13, 2])

    def run():
        c = gpu.new_cache(32)
        out = [gpu.forward(prompt, c)[-1]]
        for _ in range(3):
            out.append(gpu.forward([int(np.argmax(out[-1]))], c)[-1])
        return c.slot, out

    gc.collect()  # earlier tests' caches give their slots back now, not between the two runs
    slot, first = run()
    gc.collect()
    slot2, again = run()
    assert slot2 == slot
    assert all(np.array_equal(a, b) for a, b in zip(first, again))


def test_graph_replay_is_bit_identical_to_eager(fixture_dir):
    """Decode steps of three sequences together and one alone, replayed as CUDA graphs: the same
    bits as eager steps, across a KV pool growth past 256 cells."""
    _gpu_only()
    from daemon.backend.cuda import CUDABackend

    from .test_cuda_graphs import _decode

    path = fixture_path("qwen3next", "Q8_0", fixture_dir)
    runs = {}
    for graphs in (False, True):
        with GGUFFile(path) as g:
            b = CUDABackend(0, max_slots=4, graphs=graphs)
            model = Transformer(g, experts=b.resident_experts(g), backend=b)
            runs[graphs] = _decode(model, PROMPTS, 270, 300)
            if graphs:
                assert b.graphs.captures >= 4 and b.graphs.replays > 400, (b.graphs.captures, b.graphs.replays)
    assert len(runs[False]) == len(runs[True])
    for i, (a, b) in enumerate(zip(runs[False], runs[True])):
        assert np.array_equal(a, b), f"logits {i} differ: max {np.max(np.abs(a - b))}"
