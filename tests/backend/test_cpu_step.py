"""backend/cpu_step.py + kernels/decode_step.py: a step as one compiled call (a decode batch, one
prompt, prompts together) gives the per-op path's logits bit for bit (that path is the one compared
with llama.cpp), for every family and weight type it covers; an unlimited expert cache's misses are
read where the step stops and the step resumes; what it does not cover keeps the per-op path."""

from __future__ import annotations

import numpy as np
import pytest

from daemon.backend import CPUBackend, cpu_step
from daemon.model.transformer import Transformer
from daemon.storage.cache import ExpertCache
from daemon.storage.gguf import GGUFFile
from daemon.storage.store import ExpertStore, expert_layouts
from tests.fixtures.build import fixture_path

# (arch, weight type): every family of the shared decoder, every weight type the step computes
# (the fixtures give some roles other types: F32 routers, F16 attention in gpt-oss)
CASES = [("qwen3moe", "Q8_0"), ("gpt-oss", "MXFP4"), ("llama", "Q4_1"), ("olmoe", "Q4_K"),
         ("llama-moe", "Q6_K"), ("qwen3moe", "Q5_K"), ("llama", "Q5_0"), ("qwen3moe", "Q5_1"),
         ("llama", "Q4_0"), ("llama", "F32"), ("llama", "BF16")]


def _models(path, experts=None, compiled_step="wait"):
    """The same file as the per-op path (fuse_decode off: the separate ops) and as the compiled step
    (its first decode step waits for its compile unless told otherwise)."""
    g = GGUFFile(path)
    ref = Transformer(g, backend=CPUBackend())
    ref.backend.fuse_decode = False
    new = Transformer(g, backend=CPUBackend(), experts=experts)
    new.backend.compiled_step = compiled_step
    return g, ref, new


def _decode_both(ref, new, n_seq: int, steps: int, seed: int = 0):
    """n_seq sequences of different prompt lengths, decoded `steps` steps by both models; -> the
    pairs of logits [S, V] of each step."""
    rng = np.random.default_rng(seed)
    V = ref.hp.n_vocab
    caches = {m: [m.new_cache(32) for _ in range(n_seq)] for m in (ref, new)}
    prompts = [rng.integers(0, V, 2 + s).tolist() for s in range(n_seq)]
    for m in (ref, new):
        for p, c in zip(prompts, caches[m]):
            m.forward(p, c)
    out = []
    for _ in range(steps):
        tokens = rng.integers(0, V, n_seq)
        out.append((ref.forward_batch(tokens, caches[ref]), new.forward_batch(tokens, caches[new])))
    return out


def _prefill_both(ref, new, seed: int = 0):
    """Prompts through both models -> the pairs of logits: one of 40 rows (an expert gets 8 rows or
    more: llama.cpp's tiled K-quant kernel), three together (9, 3 and 1 rows: each its own op),
    one with every row's logits (no trimmed last layer), then a decode step over the three."""
    rng = np.random.default_rng(seed)
    V = ref.hp.n_vocab
    caches = {m: [m.new_cache(64) for _ in range(3)] for m in (ref, new)}
    long, batch, every = rng.integers(0, V, 40), [rng.integers(0, V, n) for n in (9, 3, 1)], rng.integers(0, V, 5)
    tokens = rng.integers(0, V, 3)
    program = None
    out = []
    for run in (lambda m: m.forward(long, caches[m][0]),
                lambda m: m.forward_many(batch, caches[m]),
                lambda m: m.forward(every, caches[m][1], all_logits=True),
                lambda m: m.forward_batch(tokens, caches[m])):
        cycles = 0 if program is None else program.clock.sum()
        out.append((run(ref), run(new)))
        program = new.backend._programs[new]
        assert isinstance(program, cpu_step.StepProgram) and program.clock.sum() > cycles  # the step served
    return out


@pytest.mark.parametrize("arch,wtype", CASES, ids=[f"{a}-{w}" for a, w in CASES])
def test_prompts_through_the_compiled_step_give_the_per_op_bits(fixture_dir, arch, wtype):
    g, ref, new = _models(fixture_path(arch, wtype, fixture_dir))
    with g:
        for a, b in _prefill_both(ref, new):
            assert np.isfinite(a).all()
            assert b.shape == a.shape
            np.testing.assert_array_equal(b, a)


@pytest.mark.parametrize("arch,wtype", CASES, ids=[f"{a}-{w}" for a, w in CASES])
@pytest.mark.parametrize("n_seq", [1, 3])
def test_the_compiled_step_gives_the_per_op_bits(fixture_dir, arch, wtype, n_seq):
    g, ref, new = _models(fixture_path(arch, wtype, fixture_dir))
    with g:
        for a, b in _decode_both(ref, new, n_seq, steps=3):
            assert np.isfinite(a).all()
            np.testing.assert_array_equal(b, a)
        program = new.backend._programs[new]
        assert isinstance(program, cpu_step.StepProgram)  # it ran, not the fallback
        assert program.clock.any()


def test_compiled_in_the_background_the_per_op_path_serves_until_it_is_ready(fixture_dir):
    """The first decode step compiles the per-op kernels and starts nothing; the second starts the
    step's compile on its own thread; once that is done the step serves, with the same bits, and
    the arguments it gets match what was compiled (no compile in the serving thread)."""
    from daemon.kernels import decode_step as K

    g, ref, new = _models(fixture_path("qwen3moe", "Q8_0", fixture_dir), compiled_step="background")
    with g:
        caches = {m: m.new_cache(16) for m in (ref, new)}
        for m in (ref, new):
            m.forward([1, 2, 3], caches[m])

        def step(token):
            np.testing.assert_array_equal(new.forward_batch([token], [caches[new]]),
                                          ref.forward_batch([token], [caches[ref]]))
            return new.backend._programs[new]

        program = step(4)
        assert program._compiled is None and not program.clock.any()  # the per-op path served
        program = step(5)
        program._compiled.result(timeout=600)
        overloads = len(K.decode_step.overloads)
        step(6)
        assert program.clock.any()  # the compiled step served
        cycles = program.clock.sum()
        np.testing.assert_array_equal(new.forward([7, 8, 9], caches[new]), ref.forward([7, 8, 9], caches[ref]))
        assert program.clock.sum() > cycles  # and then the prompts too
        assert len(K.decode_step.overloads) == overloads


def test_an_unlimited_cache_is_read_where_the_step_stops(fixture_dir):
    """Cold: each expert the router picks that is not in memory yet ends the compiled call at its
    layer; it is read and the step resumes, with the bits of the resident per-op path."""
    path = fixture_path("qwen3moe", "Q8_0", fixture_dir)
    with GGUFFile(path) as g0:
        store = ExpertStore.from_gguf(g0, expert_layouts(g0))
    with ExpertCache(store, 0.0) as cache:
        g, ref, new = _models(path, experts=cache)
        with g:
            for a, b in _decode_both(ref, new, 2, steps=4, seed=3):
                np.testing.assert_array_equal(b, a)
            program = new.backend._programs[new]
            assert isinstance(program, cpu_step.StepProgram)
            st = cache.stats()["total"]
            assert st["misses"] > 0 and st["requests"] == st["hits"] + st["misses"]


def test_what_the_step_does_not_cover_keeps_the_per_op_path(fixture_dir):
    cases = {("qwen2moe", "Q8_0", "ggml"): "shared experts",
             ("qwen3moe", "Q8_0", "float32"): "float32 numerics",
             ("qwen3next", "Q8_0", "ggml"): "own builder"}
    for (arch, wtype, numerics), why in cases.items():
        with GGUFFile(fixture_path(arch, wtype, fixture_dir)) as g:
            model = Transformer(g, backend=CPUBackend(numerics))
            model.forward_batch([1], [model.new_cache(4)])
            reason = model.backend._programs[model]
            assert isinstance(reason, str) and why in reason


def _bounded(g, limit_mb: float) -> ExpertCache:
    return ExpertCache(ExpertStore.from_gguf(g, expert_layouts(g)), limit_mb)


def test_a_bounded_cache_is_read_where_the_step_stops_and_keeps_the_per_op_books(fixture_dir):
    """Five slots of eight experts per layer: decode steps of two rows (two experts each: four at
    most per layer) run compiled, stopping where a chosen expert is not in its slots; the prompts
    (more rows than slots) take the per-op path. Same bits as the resident per-op path, and the
    cache's books (hits, misses, reads, evictions per layer) the same as a per-op run over the same
    bounded cache keeps: what the step counts and touches is what the per-op fetches would."""
    path = fixture_path("qwen3moe", "Q8_0", fixture_dir)
    with GGUFFile(path) as g0, _bounded(g0, 4.0) as mine, _bounded(g0, 4.0) as theirs:
        assert {mine.slots(il) for il in expert_layouts(g0)} == {5}
        g, ref, new = _models(path, experts=mine)
        with g:
            per_op = Transformer(g, backend=CPUBackend(), experts=theirs)
            per_op.backend.compiled_step = "off"
            rng = np.random.default_rng(5)
            V = ref.hp.n_vocab
            caches = {m: [m.new_cache(32) for _ in range(2)] for m in (ref, new, per_op)}
            for n, c in zip((3, 6), range(2)):
                prompt = rng.integers(0, V, n)
                for m in (ref, new, per_op):
                    m.forward(prompt, caches[m][c])
            program = new.backend._programs[new]
            assert isinstance(program, cpu_step.StepProgram) and not program.clock.any()  # prompts: per-op
            for _ in range(6):
                tokens = rng.integers(0, V, 2)
                cycles = program.clock.sum()
                a = ref.forward_batch(tokens, caches[ref])
                np.testing.assert_array_equal(new.forward_batch(tokens, caches[new]), a)
                np.testing.assert_array_equal(per_op.forward_batch(tokens, caches[per_op]), a)
                assert program.clock.sum() > cycles  # the compiled step served
            books, theirs_books = mine.stats()["layers"], theirs.stats()["layers"]
            assert sum(b["evictions"] for b in books.values()) > 0  # the slots were too few: experts moved
            for il in books:
                for key in ("requests", "hits", "misses", "loads", "evictions", "unique_requested", "cached"):
                    assert books[il][key] == theirs_books[il][key], (il, key)


def test_an_eviction_the_step_did_not_make_voids_it(fixture_dir):
    """While the step runs, another fetch takes slots of the last MoE layer, whose map the step
    already holds (here: when the step stops to read the first layer). Unless the step stops at the
    last layer too (and maps it again), its result is dropped and the per-op path gives the step's
    logits; the step after an undisturbed one runs compiled again."""
    path = fixture_path("qwen3moe", "Q8_0", fixture_dir)
    with GGUFFile(path) as g0, _bounded(g0, 4.0) as cache:
        g, ref, new = _models(path, experts=cache)
        with g:
            caches = {m: m.new_cache(64) for m in (ref, new)}
            for m in (ref, new):
                m.forward([1, 2, 3], caches[m])
            np.testing.assert_array_equal(new.forward_batch([4], [caches[new]]), ref.forward_batch([4], [caches[ref]]))
            program = new.backend._programs[new]
            first, last = program.moe_layers[0], program.moe_layers[-1]
            fetch, run = program._fetch, program.run
            fetched, results = [], []

            def fetch_and_meddle(il, held):
                ok = fetch(il, held)
                fetched.append(il)
                if il == first:  # every expert the last layer's slots do not hold: more than its free slots
                    cached = set(cache.in_place(last).rows)
                    evicted = cache.moves([last])[0, 1]
                    with cache.fetch(last, [e for e in range(8) if e not in cached]):
                        fetched.append(("evicted", cache.moves([last])[0, 1] - evicted))
                return ok

            program._fetch = fetch_and_meddle
            program.run = lambda *a, **k: results.append(run(*a, **k)) or results[-1]
            voided = 0
            for token in range(5, 45):
                fetched.clear()
                np.testing.assert_array_equal(new.forward_batch([token], [caches[new]]),
                                              ref.forward_batch([token], [caches[ref]]))
                meddled = [f[1] for f in fetched if isinstance(f, tuple)]
                if meddled and meddled[0] > 0 and fetched[-1] != last:  # evicted, and not mapped again
                    assert results[-1] is None
                    voided += 1
                elif not meddled:
                    assert results[-1] is not None
            assert voided > 0
            program._fetch = fetch
            np.testing.assert_array_equal(new.forward_batch([45], [caches[new]]), ref.forward_batch([45], [caches[ref]]))
            assert results[-1] is not None


def test_threads_that_cannot_meet_void_the_step_and_the_per_op_path_serves_it(fixture_dir):
    """More threads than numba runs at once: a thread waits at a barrier for one that starts only
    after it; the barrier gives up (sync.WAIT_LIMIT) instead of hanging, the step is void, the
    backend's per-op path gives the logits, and the model keeps that path from then on."""
    import numba

    g, ref, new = _models(fixture_path("qwen3moe", "Q8_0", fixture_dir))
    with g:
        caches = [m.new_cache(8) for m in (ref, new)]
        ref.forward([1, 2], caches[0])
        new.forward([1, 2], caches[1])
        program = new.backend._programs[new] = cpu_step.StepProgram.build(new)
        run = program.run
        program.run = lambda *a, **k: run(*a, **k, threads=numba.get_num_threads() + 1)
        np.testing.assert_array_equal(new.forward_batch([3], [caches[1]]), ref.forward_batch([3], [caches[0]]))
        assert "did not all run at once" in new.backend._programs[new]
        np.testing.assert_array_equal(new.forward_batch([4], [caches[1]]), ref.forward_batch([4], [caches[0]]))
