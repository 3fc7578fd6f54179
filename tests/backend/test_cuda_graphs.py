"""Decode steps replayed as CUDA graphs (daemon/backend/cuda_graphs.py) give the same bits as the
same steps run eagerly: one sequence and a batch, across a KV pool growth (which keeps the
graphs: the pool's arrays do not move), on fixture models of a few families and weight types. Captures need a GPU (the simulator
has no graphs); which steps get a graph, and which share one, is tested under the simulator too."""

from __future__ import annotations

import numpy as np
import pytest

from daemon.model.transformer import Transformer
from daemon.storage.gguf import GGUFFile
from tests.fixtures.build import fixture_path

from .conftest import CUDA_SKIP_REASON
from .test_cuda_model import KQUANT, SMALL

pytestmark = pytest.mark.skipif(CUDA_SKIP_REASON is not None, reason=str(CUDA_SKIP_REASON))

CASES = [("qwen3moe", "Q8_0", SMALL), ("gpt-oss", "MXFP4", SMALL), ("llama-moe", "Q6_K", KQUANT),
         ("llama", "Q4_K", KQUANT)]


def _gpu_only():
    from daemon.kernels.cuda.device import SIM

    if SIM:
        pytest.skip("numba's CUDA simulator has no graphs")


def _decode(model, prompts, steps: int, n_ctx: int):
    """Prefill each prompt (alone), then `steps` greedy decode steps of them all together and of
    the first alone. -> every logits array, in order."""
    caches = [model.new_cache(n_ctx) for _ in prompts]
    out = [model.forward(p, c) for p, c in zip(prompts, caches)]
    solo = model.new_cache(n_ctx)
    out.append(model.forward(prompts[0], solo))
    tokens = np.array([int(np.argmax(o[-1])) for o in out[:len(prompts)]])
    one = np.array([int(np.argmax(out[-1][-1]))])
    for _ in range(steps):
        out.append(model.forward_batch(tokens, caches))
        out.append(model.forward(one, solo))
        tokens = out[-2].argmax(axis=1)
        one = np.array([int(np.argmax(out[-1][-1]))])
    return out


@pytest.mark.parametrize("arch,wtype,over", CASES, ids=[f"{a}-{w}" for a, w, _ in CASES])
def test_graph_replay_is_bit_identical_to_eager(arch, wtype, over, fixture_dir):
    _gpu_only()
    from daemon.backend.cuda import CUDABackend

    path = fixture_path(arch, wtype, fixture_dir, **over)
    runs = {}
    for graphs in (False, True):
        with GGUFFile(path) as g:
            b = CUDABackend(0, max_slots=4, graphs=graphs)
            model = Transformer(g, experts=b.resident_experts(g), backend=b)
            # 300 positions: past the pool's first 256 cells, so it grows mid-decode
            runs[graphs] = _decode(model, [np.arange(3, 20), np.array([7]), np.array([9, 1, 4])], 290, 320)
            if graphs:
                assert b.graphs.captures >= 4 and b.graphs.replays > 500, (b.graphs.captures, b.graphs.replays)
                # the pool's growth past 256 cells mapped memory and moved nothing: no graph was dropped
                assert b.graphs.captures == len(b.graphs)
    assert len(runs[False]) == len(runs[True])
    for i, (a, b) in enumerate(zip(runs[False], runs[True])):
        assert np.array_equal(a, b), f"logits {i} differ: max {np.max(np.abs(a - b))}"


def test_hooks_keep_steps_eager(fixture_dir):
    """A routing trace needs the router's ids on the host each layer: no graph is made."""
    _gpu_only()
    from daemon.backend.cuda import CUDABackend

    with GGUFFile(fixture_path("qwen3moe", "Q8_0", fixture_dir, **SMALL)) as g:
        b = CUDABackend(0)
        model = Transformer(g, experts=b.resident_experts(g), backend=b)
        seen = []
        model.trace = lambda layer, ids: seen.append(np.array(ids))
        c = model.new_cache(16)
        model.forward([1, 2], c)
        for t in range(4):
            model.forward([t], c)
        assert b.graphs.captures == 0 and len(seen) == 5 * len(model.moe_layers)
        assert all(s.min() >= 0 and s.max() < model.hp.n_expert for s in seen)


def test_graph_keys_cover_decode_steps_only(fixture_dir):
    """Which steps may be replayed, and which share a graph (runs under the simulator too: no
    capture is made). A decode step's key rounds its attention cells up to a power of two (at least
    one chunk, at most the pool's cells); a prefill has no key; a new sighting runs eagerly."""
    from daemon.backend import Step
    from daemon.backend.cuda import CUDABackend
    from daemon.kernels.cuda.attention import CHUNK

    b = CUDABackend(0, max_slots=2)
    with GGUFFile(fixture_path("qwen3moe", "Q8_0", fixture_dir, **SMALL)) as g:
        model = Transformer(g, experts=b.resident_experts(g), backend=b)
        c1, c2 = model.new_cache(4 * CHUNK), model.new_cache(4 * CHUNK)
        c1.reserve(3 * CHUNK)
        c2.reserve(3 * CHUNK)
        pool = c1.pool

        def decode(*past):
            for c, n in zip((c1, c2), past):
                c.n_past = n
            return Step.append([np.array([1])] * len(past), [c1, c2][:len(past)], True)

        assert b._graph_key(Step.append([np.array([1, 2])], [c1], True)) is None  # a prefill
        k5, k9 = b._graph_key(decode(5)), b._graph_key(decode(9))
        assert k5 == (1, True, CHUNK, id(pool), False, None) and k9 == k5  # both inside the first chunk; not sampled
        assert b._graph_key(decode(CHUNK + 3))[2] == min(2 * CHUNK, pool.cells)
        assert b._graph_key(decode(5, 7))[0] == 2  # two sequences: another graph
        sampled = decode(5)
        sampled.samplers = np.zeros(1, np.int32)
        assert b._graph_key(sampled) == k5[:4] + (True, None)  # sampled on the device: another graph
        split = decode(5)
        split.variant = "cpu"  # e.g. the host tier's CPU share on: post, wait and take in the graph
        assert b._graph_key(split) == k5[:5] + ("cpu",)
        assert b.graphs.first_sighting(k5) and not b.graphs.first_sighting(k5)
        b.graphs.clear()  # e.g. the KV pool grew: every shape is new again
        assert b.graphs.first_sighting(k5) and b.graphs.get(k5) is None


def test_a_graph_outlives_the_row_index_a_longer_prefill_outgrows(fixture_dir):
    """A captured decode step reads the backend's row index array (0..T-1); a later, longer prefill
    makes a larger one. The old one must stay allocated: freed, its memory went to other arrays
    and a replay gathered embedding rows at garbage indices (an illegal address on an H200 in
    gpu_decode.py --kernels). Freed memory is reused here on purpose before the replay."""
    _gpu_only()
    from numba import cuda

    from daemon.backend.cuda import CUDABackend

    path = fixture_path("qwen3moe", "Q8_0", fixture_dir, **SMALL)
    runs = {}
    for graphs in (False, True):
        with GGUFFile(path) as g:
            b = CUDABackend(0, max_slots=2, graphs=graphs)
            model = Transformer(g, experts=b.resident_experts(g), backend=b)
            solo = model.new_cache(64)
            out = [model.forward([3, 1, 4], solo)]
            for t in range(3):  # eager, captured, replayed
                out.append(model.forward([t + 5], solo))
            out.append(model.forward(np.arange(1, 41) % model.hp.n_vocab, model.new_cache(64)))  # 40 rows
            cuda.current_context().deallocations.clear()  # frees what was released now
            filler = [cuda.to_device(np.full(n, 0x3FFFFFFF, np.int32)) for n in (1, 2, 3, 4, 6, 8) for _ in range(8)]
            for t in range(3):
                out.append(model.forward([t + 9], solo))
            del filler
            if graphs:
                assert b.graphs.replays >= 4
            runs[graphs] = out
    for i, (a, b) in enumerate(zip(runs[False], runs[True])):
        assert np.array_equal(a, b), f"logits {i} differ"
