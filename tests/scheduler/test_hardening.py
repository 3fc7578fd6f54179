"""Issue 9 hardening of the scheduler on the qwen3moe fixture: one request, one broken model file or
one slow prompt never stops a model's compute thread, never hangs later requests, and fails only
the requests it concerns, each with a clear error.

Every wait is bounded (asyncio.timeout): before the fixes these tests hung, and a hang must fail.
"""

from __future__ import annotations

import asyncio
import shutil
import threading
import time

import gguf
import numpy as np
import pytest

from daemon.errors import ModelFileChanged
from daemon.sampling import Sampler
from daemon.scheduler import Scheduler, SchedulerError
from ipc.protocol import Chat, Done, Error, Generate, Message, SamplingOptions
from tests.fixtures.build import fixture_path
from tests.scheduler.test_scheduler import GREEDY, Factory, prompts, run, settings

pytestmark = pytest.mark.usefixtures("warm_kernels")  # compile outside the time limits

HANG = 60  # seconds: only a hang gets near this


@pytest.fixture(scope="module")
def model(fixture_dir) -> str:
    return str(fixture_path("qwen3moe", "Q8_0", fixture_dir))


@pytest.fixture(scope="module")
def nan_model(fixture_dir, tmp_path_factory) -> str:
    """The F32 fixture with NaN in its final norm: every logit it computes is NaN. (With Q8_0
    matrices the ggml numerics quantize the NaN activations to zeros: finite logits.)"""
    src = fixture_path("qwen3moe", "F32", fixture_dir)
    dst = tmp_path_factory.mktemp("nan") / "nan-logits.gguf"
    shutil.copyfile(src, dst)
    norm = next(t for t in gguf.GGUFReader(src).tensors if t.name == "output_norm.weight")
    assert norm.tensor_type == gguf.GGMLQuantizationType.F32
    with open(dst, "r+b") as f:
        f.seek(norm.data_offset)
        f.write(np.full(int(norm.n_elements), np.nan, np.float32).tobytes())
    return str(dst)


@pytest.fixture
async def sched():
    s = Scheduler(settings(), factory=Factory(), default_model=lambda _progress: "/nonexistent/demo.gguf")
    yield s
    await s.close()


async def still_serves(s: Scheduler, model: str, id: int = 900) -> None:
    """A later Generate and Stats for the model are answered."""
    async with asyncio.timeout(HANG):
        replies, toks, _ = await run(s, Generate(id, model, tokens=[1, 2], max_tokens=2, options=GREEDY))
        assert isinstance(replies[-1], Done) and len(toks) == 2
        stats = await s.stats(model)
    assert stats[s.registry.find(model).name]["scheduler"]["steps"] >= 1


# -- defect 1: one request kills a model's compute thread ---------------------------------------

async def test_extreme_sampling_options_leave_the_model_working(sched, model):
    opts = SamplingOptions(temperature=0.7, repeat_penalty=1e-300, seed=1)
    async with asyncio.timeout(HANG):
        replies, toks, _ = await run(sched, Generate(1, model, tokens=[1, 2, 3], max_tokens=4, options=opts))
    assert isinstance(replies[-1], Done) and len(toks) == 4
    await still_serves(sched, model)


async def test_an_exception_in_one_sequence_fails_only_that_one(sched, model, monkeypatch):
    """Sampling raising in the first token (batched prefill) and in a later decode step."""
    ps = prompts(3)
    solo = await run(sched, Generate(1, model, tokens=ps[2], max_tokens=8, options=GREEDY))
    real = Sampler.sample
    calls = {101: 0, 102: 0}

    def flaky(self, logits, history, mask=None):
        seed = self.options.seed
        if seed in calls:
            calls[seed] += 1
            if (seed, calls[seed]) in ((101, 1), (102, 3)):
                raise RuntimeError(f"boom {seed}")
        return real(self, logits, history, mask)

    monkeypatch.setattr(Sampler, "sample", flaky)
    batcher = sched.registry.find(model).batcher
    with batcher._cv:  # all three arrive at one step boundary: one prefill pass, shared steps
        tasks = [asyncio.create_task(run(sched, Generate(10 + i, model, tokens=p, max_tokens=8, options=o)))
                 for i, (p, o) in enumerate(zip(ps, (SamplingOptions(temperature=0, seed=101),
                                                     SamplingOptions(temperature=0, seed=102), GREEDY)))]
        await asyncio.sleep(0.05)
    async with asyncio.timeout(HANG):
        (r1, t1, _), (r2, t2, _), (r3, t3, _) = await asyncio.gather(*tasks)
    assert r1 == [Error(10, "internal", "RuntimeError: boom 101")]
    assert len(t2) == 2 and r2[-1] == Error(11, "internal", "RuntimeError: boom 102")
    assert isinstance(r3[-1], Done) and t3 == solo[1]
    await still_serves(sched, model)


async def test_prepare_failing_fails_that_request(sched, model):
    await sched.load(model)
    engine = sched.registry.find(model).engine
    real = engine.model.new_cache
    failures = [MemoryError("no room for the KV cache")]

    def new_cache(n):
        if failures:
            raise failures.pop()
        return real(n)

    engine.model.new_cache = new_cache
    try:
        async with asyncio.timeout(HANG):
            replies, _, _ = await run(sched, Generate(1, model, tokens=[1, 2], max_tokens=2))
        assert replies == [Error(1, "internal", "MemoryError: no room for the KV cache")]
        await still_serves(sched, model)
    finally:
        del engine.model.new_cache


async def test_a_compute_thread_that_ends_is_noticed_and_the_model_reloads(sched, model):
    await sched.load(model)
    batcher = sched.registry.find(model).batcher

    def die():
        raise SystemExit("the loop itself broke")

    batcher._launch = die  # not a step's error: the thread ends
    async with asyncio.timeout(HANG):
        replies, _, _ = await run(sched, Generate(1, model, tokens=[1, 2], max_tokens=4))
        await batcher.stopped
    assert isinstance(replies[-1], Error) and replies[-1].code == "internal"
    assert "compute thread" in replies[-1].message and "the loop itself broke" in replies[-1].message
    assert sched.ps() == []  # not listed as loaded any more
    await still_serves(sched, model)
    assert sched.registry.loads == 2 and sched.registry.find(model).batcher is not batcher


async def test_nan_logits_fail_the_request_and_the_model_goes_on(sched, nan_model):
    for i, options in enumerate((None, SamplingOptions(seed=3), GREEDY)):
        async with asyncio.timeout(HANG):
            replies, _, _ = await run(sched, Generate(i, nan_model, tokens=[1, 2, 3], max_tokens=4, options=options))
        assert replies == [Error(i, "model_error", "the model produced non-finite values")]
    async with asyncio.timeout(HANG):
        stats = await sched.stats(nan_model)
    assert stats[nan_model]["scheduler"]["prefills"] == 0


async def test_a_non_finite_row_fails_only_its_sequence(sched, model):
    ps = prompts(2)
    solo = await run(sched, Generate(1, model, tokens=ps[0], max_tokens=6, options=GREEDY))
    batcher = sched.registry.find(model).batcher
    model_ = batcher.engine.model
    real = model_.forward_batch

    def poisoned(tokens, caches):
        out = np.array(real(tokens, caches))
        victim = next((s.cache for s in batcher._active if s.id == 3), None)
        for b, cache in enumerate(caches):
            if cache is victim:
                out[b, 7] = np.inf
        return out

    model_.forward_batch = poisoned
    try:
        async with asyncio.timeout(HANG):
            (r2, t2, _), (r3, t3, _) = await asyncio.gather(
                run(sched, Generate(2, model, tokens=ps[0], max_tokens=6, options=GREEDY)),
                run(sched, Generate(3, model, tokens=ps[1], max_tokens=6, options=GREEDY)))
    finally:
        del model_.forward_batch
    assert isinstance(r2[-1], Done) and t2 == solo[1]
    assert len(t3) == 1 and r3[-1] == Error(3, "model_error", "the model produced non-finite values")


# -- the model file changed on disk: fail the step's requests, unload the model ------------------

@pytest.mark.parametrize("where", ["decode", "prefill"])
async def test_model_file_changed_fails_the_step_and_unloads(sched, model, where):
    await sched.load(model)
    m = sched.registry.find(model)
    engine = m.engine
    closed = []
    real_close = engine.close
    engine.close = lambda: (closed.append(threading.current_thread().name), real_close())
    message = "model file changed on disk: test"

    def changed(*_a, **_k):
        raise ModelFileChanged(message)

    if where == "decode":  # after the prefill, which gives each request its first token
        engine.model.forward_batch = changed
    else:
        engine.model.forward_many = engine.model.forward = changed
    with m.batcher._cv:  # both join at one step boundary
        tasks = [asyncio.create_task(run(sched, Generate(i, model, tokens=p, max_tokens=20, options=GREEDY)))
                 for i, p in enumerate(prompts(2))]
        await asyncio.sleep(0.05)
    async with asyncio.timeout(HANG):
        results = await asyncio.gather(*tasks)
        await m.batcher.stopped
    for i, (replies, toks, _) in enumerate(results):
        assert replies[-1] == Error(i, "model_error", message)
        assert len(toks) == (1 if where == "decode" else 0)  # the prefill's token, then the failed step
    assert closed and closed[0].startswith("moed-compute")  # its engine was closed
    assert sched.registry.find(model) is None and sched.ps() == []
    await still_serves(sched, model)  # loaded afresh
    assert sched.registry.loads == 2


# -- defect 3 / 8: template and tokenizer work happen off the compute thread --------------------

class SlowTokenizer:
    """Wraps engine.tokenize: the text "slow" blocks until released; records the threads used."""

    def __init__(self, engine):
        self.engine = engine
        self.real = engine.tokenize
        self.entered = threading.Event()
        self.gate = threading.Event()
        self.threads: list[str] = []
        self.texts: list[str] = []
        engine.tokenize = self

    def __call__(self, text, *a, **k):
        self.threads.append(threading.current_thread().name)
        self.texts.append(text)
        if text == "slow":
            self.entered.set()
            self.gate.wait(HANG)
        return self.real(text, *a, **k)

    async def wait_entered(self) -> None:
        assert await asyncio.to_thread(self.entered.wait, HANG)

    def restore(self) -> None:
        self.gate.set()
        del self.engine.tokenize


async def test_a_slow_prompt_does_not_hold_up_another_request(sched, model):
    await sched.load(model)
    slow_tok = SlowTokenizer(sched.registry.find(model).engine)
    try:
        slow = asyncio.create_task(run(sched, Generate(1, model, prompt="slow", raw=True, max_tokens=2)))
        await slow_tok.wait_entered()
        async with asyncio.timeout(20):  # the compute thread is free: this one goes through
            replies, toks, _ = await run(sched, Generate(2, model, prompt="fast", raw=True, max_tokens=3,
                                                         options=GREEDY))
        assert isinstance(replies[-1], Done) and len(toks) == 3 and not slow.done()
    finally:
        slow_tok.restore()
    async with asyncio.timeout(HANG):
        replies, _, _ = await slow
    assert isinstance(replies[-1], Done)
    assert slow_tok.threads and not any(t.startswith("moed-compute") for t in slow_tok.threads)


async def test_cancel_while_the_prompt_is_prepared(sched, model):
    await sched.load(model)
    batcher = sched.registry.find(model).batcher
    prefills = batcher.prefills
    slow_tok = SlowTokenizer(batcher.engine)
    replies = []
    try:
        task = asyncio.create_task(sched.generate(Generate(1, model, prompt="slow", raw=True, max_tokens=2),
                                                  replies.append, time.perf_counter_ns()))
        await slow_tok.wait_entered()
        task.cancel()
        async with asyncio.timeout(5):
            with pytest.raises(asyncio.CancelledError):
                await task
        assert sched.inflight == 0 and replies == []
    finally:
        slow_tok.restore()
    await asyncio.sleep(0.3)  # the tokenizer returns now: nothing may reach the batch
    assert batcher.prefills == prefills and batcher.active == 0 and replies == []
    await still_serves(sched, model)


async def test_prompt_size_is_capped_before_tokenizing(model):
    s = Scheduler(settings(max_prompt_bytes=100), factory=Factory())
    try:
        await s.load(model)
        tok = SlowTokenizer(s.registry.find(model).engine)
        too_big = [
            Generate(1, model, prompt="x" * 101, raw=True, max_tokens=1),
            Generate(2, model, prompt="é" * 51, max_tokens=1),  # 51 characters, 102 bytes
            Chat(3, [Message("user", "x" * 60), Message("user", "y" * 60)], model, 1),
            Chat(4, [Message("user", "ü" * 60)], model, 1),
        ]
        for req in too_big:
            async with asyncio.timeout(HANG):
                replies, _, _ = await run(s, req)
            assert len(replies) == 1 and replies[0].code == "bad_request", replies
            assert "MOED_MAX_PROMPT_BYTES" in replies[0].message and "100" in replies[0].message
        assert tok.texts == []  # refused before the tokenizer saw them
        async with asyncio.timeout(HANG):
            replies, _, _ = await run(s, Generate(5, model, prompt="é" * 50, raw=True, max_tokens=1))
        assert isinstance(replies[-1], Done)
        tok.restore()
    finally:
        await s.close()


async def test_a_runaway_template_fails_its_request_and_holds_up_nothing(model):
    """A slow chat template: ends at MOED_TEMPLATE_TIMEOUT with model_error, off the compute
    thread (another request decodes meanwhile), and the model goes on."""
    s = Scheduler(settings(template_timeout=0.5), factory=Factory())
    try:
        await s.load(model)
        engine = s.registry.find(model).engine
        metadata = engine.gguf.metadata
        metadata["tokenizer.chat_template"] = (  # within the loop limit, but ~10 s of rendering
            "{% for i in range(90000) %}{% for j in range(10) %}{{ (i ~ j) | length }}{% endfor %}{% endfor %}")
        other_done, render = threading.Event(), engine.apply_chat_template

        def render_after_the_other(*a, **k):  # on the compute thread this would wait for itself: a hang
            assert other_done.wait(HANG)
            return render(*a, **k)

        engine.apply_chat_template = render_after_the_other
        chat = asyncio.create_task(run(s, Chat(1, [Message("user", "hi")], model, 2)))
        async with asyncio.timeout(HANG):
            other = await run(s, Generate(2, model, tokens=[1, 2], max_tokens=3, options=GREEDY))
            assert isinstance(other[0][-1], Done) and not chat.done()  # it decoded while the chat waited
            other_done.set()
            replies, _, _ = await chat
        del engine.apply_chat_template
        assert len(replies) == 1 and replies[0].code == "model_error", replies
        assert "time budget of 0.5 s" in replies[0].message, replies  # the daemon's, not the engine's 5 s
        del metadata["tokenizer.chat_template"]
        await still_serves(s, model)
    finally:
        await s.close()


# -- defect 7: errors that escaped the documented tree ------------------------------------------

async def test_a_model_path_with_nul_is_a_bad_request(sched, model):
    await sched.load(model)
    bad = model + "\0x"
    calls = [lambda: sched.load(bad), lambda: run(sched, Generate(1, bad, tokens=[1], max_tokens=1)),
             lambda: sched.stats(bad), lambda: sched.unload(bad), lambda: sched.load("\0")]
    for call in calls:
        with pytest.raises(SchedulerError) as e:
            await call()
        assert e.value.code == "bad_request" and "NUL" in str(e.value)
    assert sched.inflight == 0
    await still_serves(sched, model)


@pytest.mark.parametrize("bad", [{"expert_cache_limit_mb": float("nan")}, {"expert_cache_limit_mb": "inf"},
                                 {"n_ctx": "12\0"}, {"expert_trace_output": "/tmp/a\0b"}])
async def test_bad_load_settings_are_bad_requests(sched, model, bad):
    with pytest.raises(SchedulerError) as e:
        await sched.load(model, bad)
    assert e.value.code == "bad_request"
    assert sched.registry.models == {}
