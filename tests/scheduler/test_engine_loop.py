"""One generation loop: Engine.generate/chat drive a Sequence alone, so in-process generation and
the daemon's scheduler share prompt checks, templates, stop strings and finish reasons."""

from __future__ import annotations

import time

import pytest

from daemon.engine import Engine
from daemon.errors import ModelError, RequestError
from daemon.scheduler import Scheduler
from daemon.scheduler.sequence import Sequence
from ipc.protocol import Chat, Chunk, Done, Generate, Message, SamplingOptions
from tests.fixtures.build import fixture_path
from tests.scheduler.test_scheduler import settings

pytestmark = pytest.mark.usefixtures("warm_kernels")

N_CTX = 24  # small: a context fills within a few tokens


@pytest.fixture(scope="module")
def model(fixture_dir) -> str:
    return str(fixture_path("qwen3moe", "Q8_0", fixture_dir))


def load(path, **kw) -> Engine:
    return Engine.load(path, n_threads=1, n_ctx=N_CTX, **kw)


@pytest.fixture(scope="module")
def engine(model):
    with load(model) as e:
        yield e


def test_generate_drives_a_sequence(engine, monkeypatch):
    calls = []

    def spy(fn, note):
        return lambda *a, **k: (calls.append(note(*a)), fn(*a, **k))[1]

    for name in ("prepare", "prefill", "take"):  # take: each token sampled (the prefill's, then each step's)
        monkeypatch.setattr(Sequence, name, spy(getattr(Sequence, name), lambda *a, _n=name: _n))
    monkeypatch.setattr(engine.model, "forward", spy(engine.model.forward, lambda ids, *a: len(ids)))
    text = "".join(engine.generate([1, 2, 3], 4, temperature=0))
    assert calls[:4] == ["prepare", "prefill", 3, "take"] and calls.count("take") == 4
    assert calls.count(1) == 3  # as in the daemon, the last token is never fed to the model
    assert text and engine.last_stats.eval_count == 4


def test_chat_without_template_is_its_contents(engine):
    # as the daemon's Chat: the fixture has no template, so a chat is its messages' contents
    one = "".join(engine.chat([{"role": "user", "content": "Hello world"}], 8, temperature=0))
    assert one == "".join(engine.generate("Hello world", 8, temperature=0))
    two = "".join(engine.chat([{"role": "system", "content": "Be"}, {"role": "user", "content": "brief"}], 8,
                              temperature=0))
    assert two == "".join(engine.generate("Be\n\nbrief", 8, temperature=0))


@pytest.mark.parametrize("messages", [[], [{"role": "user"}], [{"role": "user", "content": 3}], "hi"])
def test_bad_chat_messages_are_request_errors(engine, messages):
    with pytest.raises(RequestError):
        engine.chat(messages, 4)


def test_a_failure_mid_way_raises_and_the_hooks_run(engine, monkeypatch):
    after = []
    monkeypatch.setattr(engine, "_after_generation", lambda: after.append(1))
    real = engine.model.forward

    def forward(ids, cache, **kw):  # the prompt evaluates, the first decode step fails
        if len(ids) == 1:
            raise ModelError("the model produced non-finite values")
        return real(ids, cache, **kw)

    monkeypatch.setattr(engine.model, "forward", forward)
    pieces = engine.generate([1, 2, 3], 4, temperature=0)
    with pytest.raises(ModelError, match="non-finite"):
        list(pieces)
    assert after == [1] and engine.last_stats.eval_count == 1 and engine.last_stats.done_reason == ""


CASES = [
    Generate(1, tokens=[1, 2, 3], max_tokens=0),  # the prompt only
    Generate(2, tokens=[1, 2, 3], max_tokens=100),  # the context fills
    Generate(3, tokens=[4, 5], max_tokens=6),
    Generate(4, prompt="Hello world", raw=True, max_tokens=6, stop=["\x00"]),
    Chat(5, [Message("user", "Hello"), Message("user", "world")], max_tokens=6),
]


async def test_engine_and_daemon_agree(model, engine):
    s = Scheduler(settings(), factory=lambda path, **kw: load(path, **kw))
    try:
        for req in CASES:
            req.model, req.options = model, SamplingOptions(temperature=0.0)
            replies = []
            await s.generate(req, replies.append, time.perf_counter_ns())
            done = replies[-1]
            assert isinstance(done, Done), done
            text = "".join(r.text for r in replies if isinstance(r, Chunk))
            if isinstance(req, Chat):
                pieces = engine.chat([{"role": m.role, "content": m.content} for m in req.messages],
                                     req.max_tokens, stop=req.stop, temperature=0)
            else:
                pieces = engine.generate(req.prompt if req.tokens is None else req.tokens, req.max_tokens,
                                         stop=req.stop, temperature=0)
            assert "".join(pieces) == text
            st = engine.last_stats
            assert (st.done_reason, st.eval_count, st.prompt_eval_count) == \
                   (done.done_reason, done.eval_count, done.prompt_eval_count)
    finally:
        await s.close()


def test_stop_string_at_the_end(model, engine):
    full = "".join(engine.generate([4, 5], 6, temperature=0))
    last = engine.last_stats
    cut = "".join(engine.generate([4, 5], 6, temperature=0, stop=[full[-2:]]))
    assert cut == full[:full.index(full[-2:])]
    assert engine.last_stats.done_reason == "stop" and last.done_reason == "length"
