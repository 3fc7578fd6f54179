"""Scheduler on the qwen3moe fixture, without sockets: continuous batching gives each request the
tokens it gets alone (and what Engine gives in process), cancellation frees the KV cache within one
decode step, keep-alive, single-flight loads, load errors, the bounded queue."""

from __future__ import annotations

import asyncio
import gc
import threading
import time
import weakref

import pytest

from daemon.config import Settings
from daemon.engine import Engine
from daemon.scheduler import Scheduler, SchedulerError
from daemon.scheduler.batcher import Batcher
from ipc.protocol import Chat, Chunk, Done, Error, Generate, Message, Progress, SamplingOptions
from tests.fixtures.build import fixture_path

pytestmark = pytest.mark.usefixtures("warm_kernels")  # compile outside the time limits

GREEDY = SamplingOptions(temperature=0.0)


@pytest.fixture(scope="module")
def model(fixture_dir) -> str:
    return str(fixture_path("qwen3moe", "Q8_0", fixture_dir))


class Factory:
    """Engine.load with one numba thread (the fixtures are tiny; CI has 2 busy cores), counted."""

    def __init__(self, delay: float = 0.0):
        self.calls = 0
        self.delay = delay
        self.threads: set[str] = set()

    def __call__(self, path, **settings):
        self.calls += 1
        self.threads.add(threading.current_thread().name)
        time.sleep(self.delay)
        return Engine.load(path, **{"n_threads": 1, **settings})


def settings(**kw) -> Settings:
    return Settings.load(env={}, **kw)


@pytest.fixture
async def sched():
    s = Scheduler(settings(), factory=Factory(), default_model=lambda _progress: "/nonexistent/demo.gguf")
    yield s
    await s.close()


async def run(s: Scheduler, req, progress: bool = False) -> tuple[list, list[int], str]:
    """Replies (Progress ones only if `progress`: they are advisory), generated token ids, text."""
    replies = []
    await s.generate(req, replies.append, time.perf_counter_ns())
    replies = [r for r in replies if progress or not isinstance(r, Progress)]
    toks = [t for r in replies if isinstance(r, Chunk) for t in r.tokens]
    return replies, toks, "".join(r.text for r in replies if isinstance(r, Chunk))


def prompts(n: int) -> list[list[int]]:
    return [[(17 * i + 3) % 500 + 1, (31 * i + 7) % 500 + 1, 260 + i] for i in range(n)]


async def test_continuous_batching_matches_solo_and_engine(sched, model):
    ps = prompts(8)
    lengths = [5 + 3 * i for i in range(8)]  # sequences leave the batch at different steps
    solo = [await run(sched, Generate(i + 1, model, tokens=p, max_tokens=n, options=GREEDY))
            for i, (p, n) in enumerate(zip(ps, lengths))]
    batcher = sched.registry.find(model).batcher
    assert batcher.peak_batch == 1

    async def staggered(i):
        await asyncio.sleep(0.01 * (i % 3))  # some join while others are decoding
        return await run(sched, Generate(100 + i, model, tokens=ps[i], max_tokens=lengths[i], options=GREEDY))

    together = await asyncio.gather(*(staggered(i) for i in range(8)))
    assert batcher.peak_batch > 1
    for (r1, t1, x1), (r2, t2, x2), n in zip(solo, together, lengths):
        assert t1 == t2 and x1 == x2
        assert isinstance(r1[-1], Done) and isinstance(r2[-1], Done)
        assert r2[-1].eval_count == len(t2) <= n
    with Engine.load(model, n_threads=1) as engine:  # the daemon's tokens are the engine's
        for p, n, (replies, _, text) in zip(ps, lengths, solo):
            assert "".join(engine.generate(p, n, temperature=0)) == text
            assert engine.last_stats.eval_count == replies[-1].eval_count
            assert engine.last_stats.done_reason == replies[-1].done_reason


async def test_prompts_arriving_together_share_a_prefill_pass(sched, model):
    ps = prompts(6)
    solo = [await run(sched, Generate(i + 1, model, tokens=p + [7] * i, max_tokens=6, options=GREEDY))
            for i, p in enumerate(ps)]
    batcher = sched.registry.find(model).batcher
    before = batcher.prefill_passes
    with batcher._cv:  # hold the compute thread so that all six are queued before the next boundary
        tasks = [asyncio.create_task(run(sched, Generate(50 + i, model, tokens=p + [7] * i, max_tokens=6,
                                                          options=GREEDY))) for i, p in enumerate(ps)]
        await asyncio.sleep(0.05)
    together = await asyncio.gather(*tasks)
    assert batcher.prefill_passes - before == 1  # one pass for six prompts of 3 to 8 tokens
    assert [t for _, t, _ in together] == [t for _, t, _ in solo]
    assert all(isinstance(r[-1], Done) and r[-1].prompt_eval_count == 3 + i for i, (r, _, _) in enumerate(together))

    def broken(*a, **k):
        raise RuntimeError("batched prefill broke")

    engine = batcher.engine
    engine.model.forward_many = broken  # each prompt then gets its own prefill, and the right tokens
    try:
        again = await asyncio.gather(*(run(sched, Generate(80 + i, model, tokens=p + [7] * i, max_tokens=6,
                                                            options=GREEDY)) for i, p in enumerate(ps)))
    finally:
        del engine.model.forward_many
    assert [t for _, t, _ in again] == [t for _, t, _ in solo]


async def test_done_counts_and_durations(sched, model):
    replies, toks, _ = await run(sched, Generate(1, model, tokens=[5, 6, 7, 8], max_tokens=6, options=GREEDY))
    d = replies[-1]
    assert isinstance(d, Done) and d.done_reason == "length"
    assert d.prompt_eval_count == 4 and d.eval_count == 6 == len(toks)
    assert d.load_duration > 0  # this request waited for the load
    assert 0 < d.prompt_eval_duration and 0 < d.eval_duration
    assert d.total_duration >= d.load_duration + d.prompt_eval_duration + d.eval_duration
    replies, _, _ = await run(sched, Generate(2, model, tokens=[5, 6], max_tokens=0, options=GREEDY))
    assert replies == [Done(2, "length", 2, replies[-1].prompt_eval_duration, 0, replies[-1].eval_duration,
                            0, replies[-1].total_duration)]


async def test_text_prompt_stop_string_and_chat_without_template(sched, model):
    _, _, full = await run(sched, Generate(1, model, prompt="Hello world", max_tokens=12, options=GREEDY))
    with Engine.load(model, n_threads=1) as engine:
        assert full == "".join(engine.generate("Hello world", 12, temperature=0))
    stop = full[3:5]
    replies, _, cut = await run(sched, Generate(2, model, prompt="Hello world", max_tokens=12, options=GREEDY,
                                                stop=[stop]))
    assert cut == full[:full.index(stop)] and replies[-1].done_reason == "stop"
    # the fixture has no chat template: a chat is its messages' contents
    _, _, chat = await run(sched, Chat(3, [Message("user", "Hello world")], model, 12, GREEDY))
    assert chat == full


async def test_bad_requests_fail_alone(sched, model):
    replies, _, _ = await run(sched, Generate(1, model, tokens=[10**6], max_tokens=4))
    assert isinstance(replies[-1], Error) and replies[-1].code == "bad_request"
    replies, _, _ = await run(sched, Generate(2, model, tokens=[1] * 5000, max_tokens=4))
    assert replies[-1].code == "bad_request" and "context" in replies[-1].message
    replies, toks, _ = await run(sched, Generate(3, model, tokens=[1, 2], max_tokens=3, options=GREEDY))
    assert isinstance(replies[-1], Done) and len(toks) == 3


async def test_cancel_frees_kv_cache_within_one_step(sched, model):
    await run(sched, Generate(1, model, tokens=[1, 2], max_tokens=1))  # loaded
    batcher = sched.registry.find(model).batcher
    chunks = []
    task = asyncio.create_task(sched.generate(Generate(2, model, tokens=[3, 4], max_tokens=3000),
                                              chunks.append, time.perf_counter_ns()))
    other = asyncio.create_task(run(sched, Generate(3, model, tokens=[5, 6], max_tokens=40, options=GREEDY)))
    async with asyncio.timeout(30):
        while len(chunks) < 3:
            await asyncio.sleep(0.001)
    seq = next(s for s in batcher._active if s.id == 2)
    assert seq.cache is not None
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert seq.cancelled
    at_cancel = seq.eval_count
    async with asyncio.timeout(10):
        while seq.cache is not None or seq in batcher._active:
            await asyncio.sleep(0.001)
    assert seq.eval_count <= at_cancel + 1  # at most the step that was running
    replies, toks, _ = await other  # the other request goes on to its end
    solo = await run(sched, Generate(4, model, tokens=[5, 6], max_tokens=40, options=GREEDY))
    assert isinstance(replies[-1], Done) and toks == solo[1]
    assert sched.inflight == 0 and batcher.active == 0


async def test_queue_full_is_busy_at_once(model):
    s = Scheduler(settings(queue_size=2, max_batch=1), factory=Factory())
    try:
        sink = []
        tasks = [asyncio.create_task(s.generate(Generate(i, model, tokens=[1, 2], max_tokens=3000), sink.append,
                                                time.perf_counter_ns())) for i in (1, 2)]
        await asyncio.sleep(0)
        with pytest.raises(SchedulerError) as e:
            async with asyncio.timeout(60):  # only a hang guard: a queue that waited for room would end here
                await s.generate(Generate(3, model, tokens=[1], max_tokens=1), sink.append, 0)
        assert e.value.code == "busy"
        # at once: the two that hold the queue are still running (up to 3000 tokens each), none ended yet
        assert not any(t.done() for t in tasks) and not [r for r in sink if not isinstance(r, Chunk)]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        assert s.inflight == 0
        _, toks, _ = await run(s, Generate(4, model, tokens=[1], max_tokens=2))
        assert len(toks) == 2
    finally:
        await s.close()


async def test_concurrent_loads_load_once_on_the_compute_thread(model):
    factory = Factory(delay=0.3)
    s = Scheduler(settings(), factory=factory)
    try:
        results = await asyncio.gather(s.load(model), s.load(model), *(
            run(s, Generate(i, model, tokens=[1, 2], max_tokens=2)) for i in range(3)))
        assert factory.calls == 1 and s.registry.loads == 1
        assert all(name.startswith("moed-compute") for name in factory.threads)
        (m1, ns1), (m2, ns2) = results[:2]
        assert m1 is m2 and ns1 > 0 and ns2 > 0
        assert all(isinstance(r[0][-1], Done) for r in results[2:])
        _, ns3 = await s.load(model)
        assert ns3 == 0 and factory.calls == 1
    finally:
        await s.close()


async def test_load_errors_reach_the_requester(sched, model, tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\xff" * 64)
    with pytest.raises(SchedulerError) as e:
        await sched.load(str(bad))
    assert e.value.code == "model_error"
    with pytest.raises(SchedulerError) as e:
        await sched.load(str(tmp_path / "missing.gguf"))
    assert e.value.code == "not_found"
    with pytest.raises(SchedulerError) as e:
        await run(sched, Generate(1, str(bad), tokens=[1], max_tokens=1))
    assert e.value.code == "model_error"
    with pytest.raises(SchedulerError) as e:
        await sched.load(model, {"numerix": "ggml"})
    assert e.value.code == "bad_request"
    with pytest.raises(SchedulerError) as e:
        await sched.load(model, {"queue_size": 3})
    assert e.value.code == "bad_request"
    assert sched.registry.models == {} and sched.inflight == 0 and sched.registry.loads == 2  # the bad file twice
    await sched.load(model, {"n_ctx": 512})
    with pytest.raises(SchedulerError) as e:  # a bad value never unloads the model that is there
        await sched.load(model, {"n_ctx": "lots"})
    assert e.value.code == "bad_request" and sched.registry.find(model).settings == {"n_ctx": 512}
    _, toks, _ = await run(sched, Generate(2, model, tokens=[1], max_tokens=2))
    assert len(toks) == 2


async def test_default_model_failure_is_a_model_error(sched):
    with pytest.raises(SchedulerError) as e:
        await run(sched, Generate(1, None, tokens=[1], max_tokens=1))
    assert e.value.code == "not_found"


async def test_keep_alive(model):
    s = Scheduler(settings(keep_alive=300), factory=Factory())
    try:
        await run(s, Generate(1, model, tokens=[1], max_tokens=1, keep_alive=0))
        async with asyncio.timeout(10):  # 0: unloaded as soon as it is idle
            while s.registry.models or s.registry._closing:
                await asyncio.sleep(0.005)
        await s.load(model, keep_alive=0.3)
        assert s.ps() and s.ps()[0]["expires_at"] is not None
        await asyncio.sleep(0.1)
        _, ns = await s.load(model, keep_alive=0.3)  # used again: the clock restarts
        assert ns == 0
        async with asyncio.timeout(10):
            while s.registry.models:
                await asyncio.sleep(0.01)
        await s.load(model, keep_alive=-1)
        info = s.ps()[0]
        assert info["expires_at"] is None and info["arch"] == "qwen3moe" and info["size_bytes"] > 0
        await s.unload(model)
        assert s.ps() == []
        with pytest.raises(SchedulerError) as e:
            await s.unload(model)
        assert e.value.code == "not_found"
    finally:
        await s.close()


async def test_a_load_nobody_waits_for_any_more_still_expires(model):
    s = Scheduler(settings(), factory=Factory(delay=0.3))
    try:
        task = asyncio.create_task(run(s, Generate(1, model, tokens=[1], max_tokens=1, keep_alive=0)))
        await asyncio.sleep(0.05)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        assert s.inflight == 0
        assert model in s.registry.models  # still loading
        async with asyncio.timeout(10):  # loaded with no user and keep_alive 0: unloaded
            while s.registry.models:
                await asyncio.sleep(0.01)
    finally:
        await s.close()


async def test_stats_include_the_expert_cache_and_the_batcher(sched, model):
    await run(sched, Generate(1, model, tokens=[1, 2, 3], max_tokens=4))
    stats = await sched.stats()
    assert list(stats) == [model]
    s = stats[model]
    assert s["cache"]["layers"] and s["scheduler"]["steps"] >= 3 and s["scheduler"]["prefills"] == 1
    assert (await sched.stats(model)).keys() == stats.keys()
    with pytest.raises(SchedulerError):
        await sched.stats("/nope.gguf")


async def test_unload_ends_running_streams_with_an_error(sched, model):
    await sched.load(model)
    replies = []
    task = asyncio.create_task(sched.generate(Generate(1, model, tokens=[1, 2], max_tokens=3000), replies.append,
                                              time.perf_counter_ns()))
    async with asyncio.timeout(30):
        while not replies:
            await asyncio.sleep(0.001)
    await sched.unload(model)
    async with asyncio.timeout(10):
        await task
    assert isinstance(replies[-1], Error) and replies[-1].code == "model_error"


async def test_batcher_jobs_run_on_its_thread_and_stop():
    b = Batcher("t", 4)
    assert await b.call(lambda _: threading.current_thread().name) == "moed-compute:t"
    with pytest.raises(ZeroDivisionError):
        await b.call(lambda _: 1 / 0)
    await asyncio.wait_for(b.stop(), 5)
    with pytest.raises(RuntimeError):
        await b.call(lambda _: 1)


async def test_model_none_is_the_default_model_built_once(model):
    calls = []

    def default(progress):
        calls.append(threading.current_thread().name)
        progress("build", 50.0, "half way")  # reaches every request that waits for the build
        time.sleep(0.2)
        return model

    s = Scheduler(settings(), factory=Factory(), default_model=default)
    try:
        results = await asyncio.gather(*(run(s, Generate(i, None, tokens=[1, 2], max_tokens=2), progress=True)
                                         for i in range(3)))
        assert all(isinstance(r[0][-1], Done) for r in results)
        for i, (replies, _, _) in enumerate(results):
            assert Progress(i, "build", 50.0, "half way") in replies
        assert calls == ["moed-default-model"]  # one build, on its own thread
        assert [m["path"] for m in s.ps()] == [model]
    finally:
        await s.close()


def test_one_mapping_from_exceptions_to_wire_errors():
    from daemon.errors import (ConfigError, GGUFError, ModelFileChanged, MoedError, RequestError,
                               wire_error)
    from daemon.scheduler.sequence import error_reply

    assert issubclass(SchedulerError, MoedError)
    assert SchedulerError("busy", "full").code == "busy"
    cases = [(SchedulerError("forbidden", "no"), ("forbidden", "no")),
             (RequestError("bad"), ("bad_request", "bad")), (ConfigError("typo"), ("bad_request", "typo")),
             (GGUFError("broken"), ("model_error", "broken")), (ModelFileChanged("moved"), ("model_error", "moved")),
             (MoedError("other"), ("model_error", "other")), (KeyError("k"), ("internal", "KeyError: 'k'"))]
    for exc, want in cases:
        assert wire_error(exc) == want
        assert error_reply(7, exc) == Error(7, *want)



class Gate:
    """A factory that reports a step of its load, then waits until the test lets it go on."""

    def __init__(self):
        self.go = threading.Event()

    def __call__(self, path, progress, **settings):
        progress("reading the file")
        assert self.go.wait(30)
        return Engine.load(path, progress=progress, **{"n_threads": 1, **settings})


async def until(predicate, timeout=30.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.01)


async def test_a_load_reports_its_progress_to_every_request_that_waits(model):
    gate = Gate()
    s = Scheduler(settings(), factory=gate)
    try:
        replies, loads = [], []
        gen = asyncio.create_task(s.generate(Generate(1, model, tokens=[1], max_tokens=1), replies.append, 0))
        reading = Progress(1, "load", 25.0, "reading the file")
        await until(lambda: reading in replies)  # the compute thread is still inside the load
        assert all(isinstance(r, Progress) for r in replies)
        load = asyncio.create_task(s.load(model, progress=lambda *r: loads.append(r)))
        await until(lambda: loads)  # a late waiter gets the latest report at once
        assert loads == [("load", 25.0, "reading the file")]
        gate.go.set()
        await asyncio.gather(gen, load)
        assert isinstance(replies[-1], Done) and isinstance(replies[-2], Chunk)
        progress = [r for r in replies if isinstance(r, Progress)]
        assert progress[-1].phase == "load" and progress[-1].percent == 100.0 and replies[len(progress)] == replies[-2]
        assert loads[-1][:2] == ("load", 100.0)
    finally:
        await s.close()


def test_compile_is_reported_only_when_the_warm_up_is_slow():
    from daemon.progress import COMPILING
    from daemon.scheduler.models import load_engine

    class SlowEngine:
        def tokenize(self, text, add_special):
            return [1]

        def forward(self, ids):
            time.sleep(self.delay)

        def reset_stats(self):
            pass

    for delay, want in ((0.0, []), (0.3, [("compile", None, COMPILING)])):
        engine, reports = SlowEngine(), []
        engine.delay = delay

        def factory(path, progress):
            progress("reading")
            return engine

        load_engine(factory, "m.gguf", {}, lambda *r: reports.append(r), compile_notice=0.1)
        assert [r for r in reports if r[0] == "compile"] == want
        assert reports[:2] == [("load", 0.0, ""), ("load", 25.0, "reading")] and ("load", 100.0, "") in reports


@pytest.fixture(scope="module")
def hybrid_model(fixture_dir) -> str:
    return str(fixture_path("qwen3next", "Q8_0", fixture_dir))


async def test_hybrid_model_batches_like_solo_and_cancel_frees_its_state(sched, hybrid_model):
    """qwen3next (Gated DeltaNet layers: a conv and a recurrent state per sequence): sequences that
    join and leave a running batch get their solo tokens, and a cancelled sequence's state goes
    with its cache."""
    ps = prompts(5)
    lengths = [4 + 3 * i for i in range(5)]
    solo = [await run(sched, Generate(i + 1, hybrid_model, tokens=p, max_tokens=n, options=GREEDY))
            for i, (p, n) in enumerate(zip(ps, lengths))]

    async def staggered(i):
        await asyncio.sleep(0.01 * (i % 3))
        return await run(sched, Generate(100 + i, hybrid_model, tokens=ps[i], max_tokens=lengths[i],
                                         options=GREEDY))

    together = await asyncio.gather(*(staggered(i) for i in range(5)))
    batcher = sched.registry.find(hybrid_model).batcher
    assert batcher.peak_batch > 1
    assert [t for _, t, _ in together] == [t for _, t, _ in solo]

    chunks = []
    task = asyncio.create_task(sched.generate(Generate(200, hybrid_model, tokens=[3, 4], max_tokens=3000),
                                              chunks.append, time.perf_counter_ns()))
    async with asyncio.timeout(30):
        while len(chunks) < 3:
            await asyncio.sleep(0.001)
    seq = next(s for s in batcher._active if s.id == 200)
    states = weakref.ref(seq.cache.states)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    async with asyncio.timeout(10):
        while seq.cache is not None or seq in batcher._active:
            await asyncio.sleep(0.001)
    gc.collect()
    assert states() is None
    assert sched.inflight == 0 and batcher.active == 0
