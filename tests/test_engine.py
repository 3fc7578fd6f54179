"""Engine API on the real SmolLM2 model: generation options, stop strings, seeds, errors."""

from __future__ import annotations

import dataclasses
import gc
import weakref

import pytest

from daemon import Engine
from daemon.errors import ModelError, RequestError


@pytest.fixture(scope="module")
def engine(smollm2):
    with Engine.load(smollm2, n_ctx=512) as e:
        yield e


def test_tokenize_and_forward_shapes(engine):
    ids = engine.tokenize("Hello world")
    logits = engine.forward(ids)
    assert logits.shape == (len(ids), engine.model.hp.n_vocab)
    assert logits.dtype.name == "float32"


def test_generate_streams_pieces_and_counts(engine):
    pieces = list(engine.generate("The capital of France is", max_tokens=12, temperature=0))
    assert len(pieces) > 1
    s = engine.last_stats
    assert s.eval_count == 12 and s.done_reason == "length"
    assert s.prompt_eval_count == len(engine.tokenize("The capital of France is"))
    assert s.eval_duration > 0 and s.prompt_eval_duration > 0


def test_same_seed_same_text_other_seed_differs(engine):
    kw = dict(max_tokens=16, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0)
    a = "".join(engine.generate("Tell me a story", seed=3, **kw))
    b = "".join(engine.generate("Tell me a story", seed=3, **kw))
    c = "".join(engine.generate("Tell me a story", seed=4, **kw))
    assert a == b
    assert a != c


def test_stop_string_cuts_output(engine):
    full = "".join(engine.generate("Count: 1, 2, 3,", max_tokens=12, temperature=0))
    assert "5" in full
    cut = "".join(engine.generate("Count: 1, 2, 3,", max_tokens=12, temperature=0, stop=["5"]))
    assert cut == full[:full.index("5")]
    assert engine.last_stats.done_reason == "stop"


def test_chat_uses_template_and_stops_at_end_of_turn(engine):
    prompt = engine.apply_chat_template([{"role": "user", "content": "Say hi"}])
    assert prompt.endswith("<|im_start|>assistant\n")
    text = "".join(engine.chat([{"role": "user", "content": "Say hi"}], max_tokens=64, temperature=0))
    assert text and "<|im_end|>" not in text


@pytest.mark.parametrize("kwargs", [dict(max_tokens=-1), dict(temperature=-0.5), dict(top_p=3.0)])
def test_bad_options_raise_request_error(engine, kwargs):
    with pytest.raises(RequestError):
        list(engine.generate("hi", **{"max_tokens": 4, **kwargs}))


def test_empty_and_overlong_prompts_rejected(engine):
    with pytest.raises(RequestError):
        list(engine.generate([], max_tokens=4))
    with pytest.raises(RequestError):
        list(engine.generate([1] * 600, max_tokens=4))


def test_bad_chat_messages_rejected(engine):
    with pytest.raises(RequestError):
        list(engine.chat([{"role": "user"}], max_tokens=4))


def test_load_missing_and_malformed_files(tmp_path):
    with pytest.raises(ModelError):
        Engine.load(tmp_path / "nope.gguf")
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\xff" * 64)
    with pytest.raises(ModelError):
        Engine.load(bad)


def test_extreme_sampling_options_generate(engine):
    text = "".join(engine.generate("Hello", max_tokens=4, temperature=0.7, repeat_penalty=1e-300, seed=1))
    assert isinstance(text, str) and engine.last_stats.done_reason in ("length", "stop")


@pytest.fixture
def capped(engine, monkeypatch):
    """The engine with MOED_MAX_PROMPT_BYTES=64; the texts its tokenizer is given."""
    monkeypatch.setattr(engine, "settings", dataclasses.replace(engine.settings, max_prompt_bytes=64))
    seen = []
    real = engine.tokenize
    monkeypatch.setattr(engine, "tokenize", lambda text, *a, **k: (seen.append(text), real(text, *a, **k))[1])
    return engine, seen


def test_prompt_size_is_capped_before_tokenizing(capped):
    engine, seen = capped
    for prompt in ("x" * 65, "é" * 33):  # 65 characters; 33 characters but 66 bytes
        with pytest.raises(RequestError, match="MOED_MAX_PROMPT_BYTES"):
            list(engine.generate(prompt, max_tokens=1))
    with pytest.raises(RequestError, match="MOED_MAX_PROMPT_BYTES"):
        list(engine.chat([{"role": "user", "content": "ü" * 40}], max_tokens=1))
    assert seen == []
    list(engine.generate("é" * 32, max_tokens=1))  # 64 bytes: allowed
    assert seen == ["é" * 32]


def test_rendered_chat_prompt_is_capped(capped):
    engine, seen = capped
    # SmolLM2's template adds a system prompt: two bytes of content render to more than 64
    with pytest.raises(RequestError, match="MOED_MAX_PROMPT_BYTES"):
        engine.apply_chat_template([{"role": "user", "content": "hi"}])
    with pytest.raises(RequestError, match="MOED_MAX_PROMPT_BYTES"):
        list(engine.chat([{"role": "user", "content": "hi"}], max_tokens=1))
    assert seen == []
    assert engine.apply_chat_template([{"role": "user", "content": "hi"}], max_bytes=1000).endswith("assistant\n")


def test_a_loaded_model_is_kept_from_the_collector_and_freed_after_close(engine, smollm2):
    """daemon.heap: a load freezes what is alive (a full collection no longer walks the model); a
    close gives the frozen objects back, so a reference cycle among the closed engine's objects is
    freed while another engine (the module's) stays loaded, and the next load freezes again."""
    other = Engine.load(smollm2, n_ctx=64)
    assert gc.get_freeze_count() > 0
    other.model.cycle = other.model  # a cycle: refcounting alone never frees it
    model = weakref.ref(other.model)
    other.close()
    assert gc.get_freeze_count() == 0
    del other
    gc.collect()
    assert model() is None
    assert "".join(engine.generate("Hi", max_tokens=2, temperature=0))  # the module's engine still serves
    with Engine.load(smollm2, n_ctx=64):
        assert gc.get_freeze_count() > 0
