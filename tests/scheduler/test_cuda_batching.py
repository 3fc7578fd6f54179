"""The scheduler's continuous batching on the CUDA backend: 8 concurrent requests get exactly the
tokens each gets alone, as on the CPU (test_scheduler.py), and the same tokens from run to run.
GPU only (the simulator would take an hour); decode steps run as CUDA graphs there."""

from __future__ import annotations

import asyncio
import time

import pytest

from daemon.config import Settings
from daemon.engine import Engine
from daemon.scheduler import Scheduler
from ipc.protocol import Chunk, Done, Generate, SamplingOptions
from tests.fixtures.build import fixture_path
from tests.kernels.cuda.conftest import SKIP_REASON

GREEDY = SamplingOptions(temperature=0.0)
CASES = [("qwen3moe", "Q8_0"), ("gpt-oss", "MXFP4")]


def _gpu() -> str | None:
    if SKIP_REASON is not None:
        return SKIP_REASON
    from daemon.kernels.cuda.device import SIM

    return "numba's CUDA simulator: too slow for whole requests" if SIM else None


pytestmark = pytest.mark.skipif(_gpu() is not None, reason=str(_gpu()))


async def _sched(case, fixture_dir):
    path = str(fixture_path(*case, fixture_dir))
    s = Scheduler(Settings.load(env={}, device="cuda"),
                  factory=lambda p, **kw: Engine.load(p, **{"device": "cuda", **kw}),
                  default_model=lambda _progress: path)
    yield s, path
    await s.close()


@pytest.fixture(params=CASES, ids=[f"{a}-{w}" for a, w in CASES])
async def gpu_sched(request, fixture_dir):
    async for pair in _sched(request.param, fixture_dir):
        yield pair


# a hybrid (recurrent layers) cannot pad a step: its warm-up captures each batch size
WARM_CASES = [*CASES, ("qwen3next", "Q8_0")]


@pytest.fixture(params=WARM_CASES, ids=[f"{a}-{w}" for a, w in WARM_CASES])
async def warm_sched(request, fixture_dir):
    async for pair in _sched(request.param, fixture_dir):
        yield pair


async def _run(s: Scheduler, req) -> tuple[list[int], Done]:
    replies = []
    await s.generate(req, replies.append, time.perf_counter_ns())
    toks = [t for r in replies if isinstance(r, Chunk) for t in r.tokens]
    return toks, replies[-1]


async def test_eight_concurrent_requests_match_solo(gpu_sched):
    s, model = gpu_sched
    ps = [[(17 * i + 3) % 500 + 1, (31 * i + 7) % 500 + 1, 260 + i] for i in range(8)]
    lengths = [6 + 4 * i for i in range(8)]  # sequences leave the batch at different steps
    solo = [await _run(s, Generate(i + 1, model, tokens=p, max_tokens=n, options=GREEDY))
            for i, (p, n) in enumerate(zip(ps, lengths))]
    batcher = s.registry.find(model).batcher
    engine = s.registry.find(model).engine
    assert engine.model.backend.name.startswith("cuda")

    async def staggered(i, base):
        await asyncio.sleep(0.01 * (i % 3))  # some join while others are decoding
        return await _run(s, Generate(base + i, model, tokens=ps[i], max_tokens=lengths[i], options=GREEDY))

    for base in (100, 200):  # twice: deterministic from run to run
        together = await asyncio.gather(*(staggered(i, base) for i in range(8)))
        assert batcher.peak_batch > 1
        for (t1, d1), (t2, d2) in zip(solo, together):
            assert isinstance(d1, Done) and isinstance(d2, Done)
            assert t1 == t2
    assert engine.model.backend.graphs.replays > 0  # the decode steps ran as graphs


SEEDED = SamplingOptions(seed=5)  # the default options otherwise: top-k, top-p, min-p, repeat penalty


async def _solo_then_together(s, model, reqs):
    solo = [await _run(s, r) for r in reqs]
    together = await asyncio.gather(*(_run(s, Generate(1000 + r.id, model, tokens=r.tokens, max_tokens=r.max_tokens,
                                                      options=r.options, stop=r.stop)) for r in reqs))
    return solo, together


@pytest.mark.parametrize("options", [GREEDY, SEEDED], ids=["greedy", "seeded"])
async def test_sixteen_concurrent_requests_sampled_on_the_device_match_solo(gpu_sched, options):
    s, model = gpu_sched
    reqs = [Generate(i + 1, model, tokens=[(13 * i + 5) % 400 + 1, 300 + i], max_tokens=5 + (7 * i) % 11,
                     options=options) for i in range(16)]
    solo, together = await _solo_then_together(s, model, reqs)
    for (t1, d1), (t2, d2), r in zip(solo, together, reqs):
        assert t1 == t2 and isinstance(d2, Done) and d2.eval_count == len(t2) <= r.max_tokens
        assert d1.done_reason == d2.done_reason and (d2.done_reason == "stop") == (len(t2) < r.max_tokens)
    engine = s.registry.find(model).engine
    backend = engine.model.backend
    assert backend.samplers is not None and backend.graphs.replays > 0  # sampled in replayed graphs
    batcher = s.registry.find(model).batcher
    assert batcher.peak_batch > 8


async def test_greedy_on_the_device_is_the_engines_host_sampling(gpu_sched):
    s, model = gpu_sched
    with Engine.load(model, device="cuda") as engine:  # Engine.generate samples on the host
        texts = ["".join(engine.generate([7 + i, 300], 12, temperature=0)) for i in range(4)]
    for i, text in enumerate(texts):
        replies = []
        await s.generate(Generate(i + 1, model, tokens=[7 + i, 300], max_tokens=12, options=GREEDY), replies.append,
                         time.perf_counter_ns())
        assert "".join(r.text for r in replies if isinstance(r, Chunk)) == text


async def test_seeded_draws_advance_under_graph_replay_and_do_not_depend_on_the_batch(gpu_sched, fixture_dir):
    s, model = gpu_sched
    reqs = [Generate(50 + i, model, tokens=[9, 300 + i], max_tokens=24, options=SEEDED) for i in range(3)]
    first = [await _run(s, r) for r in reqs]
    again = await asyncio.gather(*(_run(s, Generate(r.id + 10, model, tokens=r.tokens, max_tokens=24, options=SEEDED))
                                   for r in reqs))
    assert [t for t, _ in first] == [t for t, _ in again]  # reproducible, alone or together
    assert s.registry.find(model).engine.model.backend.graphs.replays > 0
    other = await _run(s, Generate(70, model, tokens=[9, 300], max_tokens=24, options=SamplingOptions(seed=6)))
    assert other[0] != first[0][0]
    # without graphs every step runs eagerly: the same draws, so a replayed step advanced each RNG
    eager = Scheduler(Settings.load(env={}, device="cuda"),
                      factory=lambda p, **kw: Engine.load(p, **{"device": "cuda", "cuda_graphs": False, **kw}),
                      default_model=lambda _progress: model)
    try:
        plain = [await _run(eager, Generate(r.id + 20, model, tokens=r.tokens, max_tokens=24, options=SEEDED))
                 for r in reqs]
        assert eager.registry.find(model).engine.model.backend.graphs.replays == 0
    finally:
        await eager.close()
    assert [t for t, _ in plain] == [t for t, _ in first]


async def test_stop_strings_and_end_of_generation_end_exactly_on_the_device(gpu_sched):
    """The overlapped loop on the GPU: a sequence that ends at step N (a stop string, seen by the
    text thread; an end-of-generation id) has its row of step N+1 dropped: the same replies as
    alone, nothing after Done, and at most one extra row per such sequence."""
    s, model = gpu_sched
    ps = [[(29 * i + 11) % 400 + 1, 310 + i] for i in range(6)]
    free = []
    for i, p in enumerate(ps):
        replies = []
        await s.generate(Generate(i + 1, model, tokens=p, max_tokens=14, options=GREEDY), replies.append,
                         time.perf_counter_ns())
        free.append([r for r in replies if isinstance(r, Chunk)])
    stops = [(c[3].text + c[4].text).strip() or c[4].text for c in free if len(c) > 5]
    reqs = [Generate(20 + i, model, tokens=p, max_tokens=14, options=GREEDY, stop=[stop])
            for i, (p, stop) in enumerate(zip(ps, stops))]
    solo = [await _run(s, r) for r in reqs]
    batcher = s.registry.find(model).batcher
    before = batcher.step_tokens
    together = await asyncio.gather(*(_run(s, Generate(r.id + 100, model, tokens=r.tokens, max_tokens=14,
                                                      options=GREEDY, stop=r.stop)) for r in reqs))
    ended_early = 0
    for (t1, d1), (t2, d2) in zip(solo, together):
        assert t1 == t2 and isinstance(d2, Done) and d2.done_reason == d1.done_reason and d2.eval_count == d1.eval_count
        ended_early += d2.done_reason == "stop"
    assert ended_early >= 1
    decoded = sum(d.eval_count - 1 for _, d in together)  # a decode step's row per token after the first
    assert decoded <= batcher.step_tokens - before <= decoded + ended_early
    engine = s.registry.find(model).engine
    ends = {t[4] for t, d in solo if len(t) > 4}
    engine.tokenizer.eog_ids = frozenset(ends)  # an id each may reach becomes an end of generation
    plain = [Generate(200 + i, model, tokens=p, max_tokens=14, options=GREEDY) for i, p in enumerate(ps)]
    alone = [await _run(s, r) for r in plain]
    both = await asyncio.gather(*(_run(s, Generate(r.id + 100, model, tokens=r.tokens, max_tokens=14,
                                                  options=GREEDY)) for r in plain))
    for (t1, d1), (t2, d2) in zip(alone, both):
        assert t1 == t2 and not ends & set(t2) and d2.done_reason == d1.done_reason


async def test_a_first_burst_compiles_and_captures_nothing_the_load_did_not(warm_sched):
    """The load's warm-up leaves a burst of 1..16 prompts arriving together (prefilled in one pass,
    then decoded in padded steps, or a hybrid's unpadded ones) nothing to compile or capture: the
    first burst runs at the pace of the later ones."""
    from daemon.kernels.cuda import launch

    s, model = warm_sched
    await _run(s, Generate(1, model, tokens=[5, 6, 7], max_tokens=2, options=GREEDY))  # loads and warms
    backend = s.registry.find(model).engine.model.backend
    kernels, resolved = dict(launch.COUNTS), dict(launch.RESOLVED)
    captures, dropped = backend.graphs.captures, dict(backend.graphs.dropped)
    warm_keys = backend.graphs.keys()
    for n in (3, 7, 12, 16):
        reqs = [Generate(100 * n + i, model, tokens=[(11 * i + n) % 400 + 1] * (2 + i % 5), max_tokens=5,
                         options=GREEDY) for i in range(n)]
        await asyncio.gather(*(_run(s, r) for r in reqs))
    # a kernel compiled (or loaded from the disk cache) by the burst is named
    assert {n: c - resolved.get(n, 0) for n, c in launch.RESOLVED.items() if c != resolved.get(n, 0)} == {}
    assert launch.COUNTS == kernels
    # dropped graphs name their cause (the KV pool made again, evicted, ...), new keys their step
    # (seen on the H200: 19 captures against 16, alone too); the message names every key in full
    new = backend.graphs.keys() - warm_keys
    assert (backend.graphs.captures, dict(backend.graphs.dropped), new) == (captures, dropped, set()), (
        f"captures {captures} -> {backend.graphs.captures}, dropped {dropped} -> {dict(backend.graphs.dropped)}; "
        f"new keys {sorted(map(repr, new))}; warm keys {sorted(map(repr, warm_keys))}")


SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                          "n": {"type": "integer", "minimum": 0, "maximum": 999}},
          "required": ["name", "n"], "additionalProperties": False}


async def test_constrained_requests_beside_free_ones_on_the_device(gpu_sched):
    """Sequences with a grammar (masked in their sampler slots, their steps not overlapped) share
    steps with free ones: their output is valid against the schema; the free ones get their solo
    tokens."""
    import json

    # a test dependency (pyproject's test extra) that the GPU machine's image lacks
    jsonschema = pytest.importorskip("jsonschema", reason="jsonschema is not installed (the GPU machine has none)")
    s, model = gpu_sched
    free = [Generate(300 + i, model, tokens=[5 + i, 9, 13], max_tokens=24, options=GREEDY) for i in range(4)]
    solo = [await _run(s, r) for r in free]
    constrained = [Generate(400 + i, model, prompt=f"JSON {i}:", raw=True, max_tokens=200,
                            options=SamplingOptions(seed=i, temperature=1.0), format=json.dumps(SCHEMA))
                   for i in range(4)]
    results = await asyncio.gather(*(_run(s, r) for r in free + constrained))
    for (t1, _), (t2, _) in zip(solo, results[:4]):
        assert t1 == t2
    engine = s.registry.find(model).engine
    for toks, done in results[4:]:
        assert done.done_reason == "stop"
        jsonschema.validate(json.loads(engine.detokenize(toks)), SCHEMA)
