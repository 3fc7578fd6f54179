"""Ollama's API (/api/*) of `moed serve`, through the real `ollama` Python client (and curl for the
bytes on the wire), over TCP and over the HTTP unix socket.

The reference for generated text is moed's own msgspec protocol (ipc.client.Client) asking the same
daemon for the same prompt with the same sampling options (Ollama's documented defaults, greedy);
sizes come from os.stat of the model file. The model is `tiny` (random weights, qwen3moe, Q8_0):
its text is gibberish, but greedy decoding is deterministic.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from datetime import datetime, timedelta, timezone

import httpx
import numpy as np
import ollama
import pytest

from ipc.protocol import SamplingOptions

from .conftest import via_socket

MODEL = "tiny"
NAME = "tiny:latest"
N = 8  # num_predict of most tests
T = 120  # seconds before a request fails rather than hangs
PROMPT = "The capital of France is"
MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a colour."}]
GREEDY = {"temperature": 0, "num_predict": N}

# Ollama's documented defaults (docs/api.md, "options"); moed maps them onto its SamplingOptions.
OLLAMA_DEFAULTS = {"temperature": 0.8, "top_k": 40, "top_p": 0.9, "min_p": 0.0, "repeat_penalty": 1.1,
                   "repeat_last_n": 64}


def sampling(**over) -> SamplingOptions:
    """SamplingOptions for the msgspec reference: Ollama's defaults, with `over`."""
    return SamplingOptions(**{**OLLAMA_DEFAULTS, **over})


# -- clients -----------------------------------------------------------------------------------------

def tcp_client(daemon) -> ollama.Client:
    return ollama.Client(host=daemon.url, timeout=T)


def unix_client(daemon) -> ollama.Client:
    # ollama.Client hands its keyword arguments on to httpx.Client (ollama/_client.py, BaseClient)
    return ollama.Client(host="http://localhost", timeout=T, transport=httpx.HTTPTransport(uds=daemon.http_socket))


@pytest.fixture(params=["tcp", "unix"])
def client(request, daemon) -> ollama.Client:
    c = tcp_client(daemon) if request.param == "tcp" else unix_client(daemon)
    yield c
    c.close()


@pytest.fixture
def tcp(daemon) -> ollama.Client:
    c = tcp_client(daemon)
    yield c
    c.close()


# -- the reference: moed's msgspec protocol -------------------------------------------------------------

def ref_generate(daemon, prompt: str, n: int = N, raw: bool = True, **options) -> tuple[str, object]:
    opts = sampling(**{"temperature": 0, **options})
    return via_socket(daemon, lambda c: c.generate(prompt, model=MODEL, max_tokens=n, raw=raw, options=opts))


def ref_chat(daemon, messages, n: int = N, **options) -> tuple[str, object]:
    opts = sampling(**{"temperature": 0, **options})
    return via_socket(daemon, lambda c: c.chat(messages, model=MODEL, max_tokens=n, options=opts))


def loaded(c: ollama.Client) -> dict:
    return {m.model: m for m in c.ps().models}


def check_final(final, n: int, elapsed_ns: int) -> None:
    """The last object of a generation that hit num_predict: counts and durations (ns)."""
    assert final.done is True
    assert final.done_reason == "length"
    assert final.eval_count == n
    assert final.prompt_eval_count > 0
    for field in ("total_duration", "prompt_eval_duration", "eval_duration"):
        value = getattr(final, field)
        assert isinstance(value, int) and value > 0, (field, value)
    assert final.load_duration is not None and final.load_duration >= 0
    assert final.total_duration >= final.eval_duration
    assert final.total_duration >= final.prompt_eval_duration
    # nanoseconds: within the wall-clock time the client saw, and not 1000 times smaller than it
    assert final.total_duration <= elapsed_ns
    assert final.total_duration > elapsed_ns / 500


def timed(fn, *args, **kw):
    t0 = time.perf_counter_ns()
    out = fn(*args, **kw)
    return out, time.perf_counter_ns() - t0


# -- generate and chat ---------------------------------------------------------------------------------

def test_generate_not_streamed(client, daemon):
    out, elapsed = timed(client.generate, model=MODEL, prompt=PROMPT, raw=True, stream=False, options=GREEDY)
    want, done = ref_generate(daemon, PROMPT)
    assert out.model == NAME
    assert out.response == want
    check_final(out, N, elapsed)
    assert out.prompt_eval_count == done.prompt_eval_count


def test_generate_streamed_concatenates_to_not_streamed(client, daemon):
    whole = client.generate(model=MODEL, prompt=PROMPT, stream=False, options=GREEDY)
    t0 = time.perf_counter_ns()
    parts = list(client.generate(model=MODEL, prompt=PROMPT, stream=True, options=GREEDY))
    elapsed = time.perf_counter_ns() - t0
    assert len(parts) >= 2
    assert all(p.done is False for p in parts[:-1])
    assert all(p.model == NAME for p in parts)
    final = parts[-1]
    assert final.response == ""
    assert "".join(p.response for p in parts) == whole.response
    assert whole.response  # greedy, 8 tokens: some text
    check_final(final, N, elapsed)


def test_chat_not_streamed(client, daemon):
    out, elapsed = timed(client.chat, model=MODEL, messages=MESSAGES, stream=False, options=GREEDY)
    want, done = ref_chat(daemon, MESSAGES)
    assert out.model == NAME
    assert out.message.role == "assistant"
    assert out.message.content == want
    check_final(out, N, elapsed)
    assert out.prompt_eval_count == done.prompt_eval_count


def test_chat_streamed_concatenates_to_not_streamed(client, daemon):
    whole = client.chat(model=MODEL, messages=MESSAGES, stream=False, options=GREEDY)
    t0 = time.perf_counter_ns()
    parts = list(client.chat(model=MODEL, messages=MESSAGES, stream=True, options=GREEDY))
    elapsed = time.perf_counter_ns() - t0
    assert len(parts) >= 2
    assert all(p.done is False for p in parts[:-1])
    assert all(p.message.role == "assistant" for p in parts)
    assert parts[-1].message.content == ""
    assert "".join(p.message.content for p in parts) == whole.message.content
    check_final(parts[-1], N, elapsed)


@pytest.mark.parametrize("raw", [True, False])
def test_generate_equals_msgspec_protocol(tcp, daemon, raw):
    """raw: the prompt as is; not raw: through the model's chat template, on both sides."""
    prompt = "Once upon a time"
    out = tcp.generate(model=MODEL, prompt=prompt, raw=raw, stream=False, options={"temperature": 0, "num_predict": 12})
    want, done = ref_generate(daemon, prompt, n=12, raw=raw)
    assert out.response == want
    assert out.eval_count == done.eval_count == 12
    assert out.prompt_eval_count == done.prompt_eval_count


def test_chat_equals_msgspec_protocol(tcp, daemon):
    messages = [{"role": "user", "content": "Hello!"}, {"role": "assistant", "content": "Hi."},
                {"role": "user", "content": "How are you?"}]
    out = tcp.chat(model=MODEL, messages=messages, stream=False, options={"temperature": 0, "num_predict": 12})
    want, done = ref_chat(daemon, messages, n=12)
    assert out.message.content == want
    assert out.prompt_eval_count == done.prompt_eval_count


def test_generate_with_system_is_chat(tcp, daemon):
    """A system prompt (not raw): the conversation [system, user] through the chat template."""
    out = tcp.generate(model=MODEL, prompt="Name a colour.", system="You are terse.", stream=False, options=GREEDY)
    want, _ = ref_chat(daemon, MESSAGES)
    assert out.response == want


def test_generate_by_path_on_the_unix_socket(daemon):
    with unix_client(daemon) as c:
        out = c.generate(model=daemon.model, prompt=PROMPT, raw=True, stream=False, options=GREEDY)
    want, _ = ref_generate(daemon, PROMPT)
    assert out.response == want
    assert out.model == daemon.model


def test_a_path_over_tcp_is_refused(tcp, daemon):
    with pytest.raises(ollama.ResponseError) as e:
        tcp.generate(model=daemon.model, prompt=PROMPT, stream=False, options=GREEDY)
    assert e.value.status_code == 400
    assert "path" in e.value.error


# -- options -------------------------------------------------------------------------------------------

def test_seed_makes_sampling_reproducible(tcp, daemon):
    options = {"temperature": 1.0, "seed": 1234, "num_predict": 16}
    a = tcp.generate(model=MODEL, prompt=PROMPT, raw=True, stream=False, options=options)
    b = tcp.generate(model=MODEL, prompt=PROMPT, raw=True, stream=False, options=options)
    assert a.response == b.response
    assert a.eval_count == 16
    # and it is the draw the msgspec protocol makes with that seed and Ollama's other defaults
    want, _ = ref_generate(daemon, PROMPT, n=16, temperature=1.0, seed=1234)
    assert a.response == want


def test_stop_string_ends_the_text_before_it(tcp, daemon):
    text, _ = ref_generate(daemon, PROMPT, n=16)
    # a stop string from the middle of the greedy text, whose first occurrence is not at its start
    stop = None
    for k in range(len(text) // 3, len(text) - 2):
        candidate = text[k:k + 2]
        if candidate.strip() and text.find(candidate) > 0:
            stop = candidate
            break
    assert stop is not None, f"no usable stop string in {text!r}"
    out = tcp.generate(model=MODEL, prompt=PROMPT, raw=True, stream=False,
                       options={"temperature": 0, "num_predict": 16, "stop": [stop]})
    assert out.response == text[:text.find(stop)]
    assert stop not in out.response
    assert out.done_reason == "stop"
    streamed = list(tcp.generate(model=MODEL, prompt=PROMPT, raw=True, stream=True,
                                 options={"temperature": 0, "num_predict": 16, "stop": [stop]}))
    assert "".join(p.response for p in streamed) == text[:text.find(stop)]
    assert streamed[-1].done_reason == "stop"


def test_num_predict_zero_evaluates_the_prompt_only(tcp):
    out = tcp.generate(model=MODEL, prompt=PROMPT, raw=True, stream=False, options={"temperature": 0, "num_predict": 0})
    assert out.response == ""
    assert out.eval_count in (0, None)
    assert out.prompt_eval_count > 0


# -- models: list, ps, show ------------------------------------------------------------------------------

def test_list(client, daemon):
    models = {m.model: m for m in client.list().models}
    assert NAME in models
    m = models[NAME]
    assert m.size == os.stat(daemon.model).st_size
    assert m.details.family == "qwen3moe"
    assert m.details.quantization_level == "Q8_0"
    assert m.details.format == "gguf"
    assert m.modified_at is not None
    assert m.digest


def test_ps_after_generate(client):
    client.generate(model=MODEL, prompt=PROMPT, stream=False, options=GREEDY)
    models = loaded(client)
    assert NAME in models
    m = models[NAME]
    assert m.size_vram == 0  # a CPU machine
    assert m.context_length > 0
    assert m.size > 0
    assert m.details.family == "qwen3moe"
    assert m.expires_at is not None


def test_show(client):
    out = client.show(MODEL)
    assert out.details.family == "qwen3moe"
    assert out.details.quantization_level == "Q8_0"
    assert out.modelinfo["general.architecture"] == "qwen3moe"
    assert out.modelinfo["qwen3moe.context_length"] > 0
    assert isinstance(out.template, str)


def test_version(client):
    assert client._client.get("/api/version").json()["version"]


# -- keep-alive ------------------------------------------------------------------------------------------

def test_keep_alive_zero_unloads_and_an_empty_prompt_loads(client):
    client.generate(model=MODEL, prompt=PROMPT, stream=False, options=GREEDY)
    assert NAME in loaded(client)

    out = client.generate(model=MODEL, prompt="", keep_alive=0)
    assert out.done is True
    assert out.done_reason == "unload"
    assert out.response == ""
    assert loaded(client) == {}

    again = client.generate(model=MODEL, prompt="", keep_alive=0)  # nothing loaded: still fine
    assert again.done_reason == "unload"

    out = client.generate(model=MODEL, prompt="")
    assert out.done is True
    assert out.done_reason == "load"
    assert out.response == ""
    assert NAME in loaded(client)


def test_chat_without_messages_loads_and_unloads(tcp):
    out = tcp.chat(model=MODEL, messages=[], keep_alive=0)
    assert out.done_reason == "unload"
    assert loaded(tcp) == {}
    out = tcp.chat(model=MODEL, messages=[])
    assert out.done_reason == "load"
    assert out.message.role == "assistant" and out.message.content == ""
    assert NAME in loaded(tcp)


def test_keep_alive_zero_on_a_generation_unloads_after_it(tcp, daemon):
    out = tcp.generate(model=MODEL, prompt=PROMPT, raw=True, stream=False, options=GREEDY, keep_alive=0)
    want, _ = ref_generate(daemon, PROMPT)  # (loads it again)
    assert out.response == want
    deadline = time.monotonic() + 10
    tcp.generate(model=MODEL, prompt=PROMPT, raw=True, stream=False, options=GREEDY, keep_alive="0s")
    while loaded(tcp) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert loaded(tcp) == {}


def test_keep_alive_duration_sets_expires_at(tcp):
    tcp.generate(model=MODEL, prompt=PROMPT, stream=False, options=GREEDY, keep_alive="10m")
    expires = loaded(tcp)[NAME].expires_at
    ahead = expires - datetime.now(timezone.utc)
    assert abs(ahead - timedelta(minutes=10)) < timedelta(minutes=1), ahead

    tcp.generate(model=MODEL, prompt=PROMPT, stream=False, options=GREEDY, keep_alive=90)  # seconds
    ahead = loaded(tcp)[NAME].expires_at - datetime.now(timezone.utc)
    assert abs(ahead - timedelta(seconds=90)) < timedelta(minutes=1), ahead


def test_bad_keep_alive(tcp):
    with pytest.raises(ollama.ResponseError) as e:
        tcp.generate(model=MODEL, prompt=PROMPT, stream=False, options=GREEDY, keep_alive="ten minutes")
    assert e.value.status_code == 400
    assert "keep_alive" in e.value.error


# -- errors ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("stream", [False, True])
def test_unknown_model_is_404(client, stream):
    with pytest.raises(ollama.ResponseError) as e:
        out = client.generate(model="no-such-model", prompt=PROMPT, stream=stream, options=GREEDY)
        if stream:
            list(out)
    assert e.value.status_code == 404
    with pytest.raises(ollama.ResponseError) as e:
        client.chat(model="no-such-model", messages=MESSAGES, stream=False, options=GREEDY)
    assert e.value.status_code == 404
    with pytest.raises(ollama.ResponseError) as e:
        client.show("no-such-model")
    assert e.value.status_code == 404


def test_raw_mode_refuses_a_system_prompt(tcp):
    with pytest.raises(ollama.ResponseError) as e:
        tcp.generate(model="tiny", prompt="x", raw=True, system="s")
    assert e.value.status_code == 400 and "raw" in str(e.value)


def test_unloading_an_unknown_model_is_404(tcp):
    with pytest.raises(ollama.ResponseError) as e:
        tcp.generate(model="no-such-model", prompt="", keep_alive=0)
    assert e.value.status_code == 404
    with pytest.raises(ollama.ResponseError) as e:
        tcp.chat(model="no-such-model", messages=[], keep_alive=0)
    assert e.value.status_code == 404


def test_loading_an_unknown_model_is_404(tcp):
    with pytest.raises(ollama.ResponseError) as e:
        tcp.generate(model="no-such-model", prompt="")
    assert e.value.status_code == 404
    with pytest.raises(ollama.ResponseError) as e:
        tcp.chat(model="no-such-model", messages=[])
    assert e.value.status_code == 404


def test_images_are_refused(tcp):
    messages = [{"role": "user", "content": "What is in this picture?", "images": [b"\x89PNG\r\n\x1a\nnot really"]}]
    with pytest.raises(ollama.ResponseError) as e:
        tcp.chat(model=MODEL, messages=messages, stream=False, options=GREEDY)
    assert e.value.status_code == 400
    assert "images" in e.value.error
    with pytest.raises(ollama.ResponseError) as e:
        tcp.generate(model=MODEL, prompt="What is this?", images=[b"not really a png"], stream=False, options=GREEDY)
    assert e.value.status_code == 400


SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                          "age": {"type": "integer", "minimum": 0, "maximum": 150},
                                          "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]},
                                                   "maxItems": 3}},
          "required": ["name", "age", "tags"], "additionalProperties": False}


@pytest.mark.parametrize("seed", range(4))
def test_format_holds_the_output_to_a_schema(tcp, seed):
    import jsonschema

    opts = {"temperature": 1.0, "seed": seed, "num_predict": 200}
    r = tcp.generate(model=MODEL, prompt=f"Describe person {seed} as JSON", format=SCHEMA, stream=False, options=opts)
    jsonschema.validate(json.loads(r.response), SCHEMA)
    assert r.done_reason == "stop"
    parts = [p.message.content for p in tcp.chat(model=MODEL, messages=MESSAGES, format=SCHEMA, stream=True,
                                                 options=opts)]
    jsonschema.validate(json.loads("".join(parts)), SCHEMA)


def test_format_json_and_bad_formats(tcp, daemon):
    r = tcp.chat(model=MODEL, messages=MESSAGES, format="json", stream=False,
                 options={"num_predict": 60, "temperature": 0})
    assert r.message.content.startswith("{")  # an object, cut by num_predict on this random model
    with pytest.raises(ollama.ResponseError) as e:
        tcp.generate(model=MODEL, prompt=PROMPT, format={"type": "nonsense-type"}, stream=False, options=GREEDY)
    assert e.value.status_code == 400 and "format" in e.value.error
    r = httpx.post(daemon.url + "/api/generate", json={"model": MODEL, "prompt": PROMPT, "format": "yaml"})
    assert r.status_code == 400 and "format" in r.json()["error"]


def test_unsupported_options_are_refused(tcp):
    with pytest.raises(ollama.ResponseError) as e:
        tcp.generate(model=MODEL, prompt=PROMPT, stream=False, options={**GREEDY, "mirostat": 2})
    assert e.value.status_code == 400
    assert "mirostat" in e.value.error


def test_registry_routes_are_refused(tcp):
    with pytest.raises(ollama.ResponseError) as e:
        tcp.pull("llama3")
    assert e.value.status_code == 400


def test_bad_json_body(daemon):
    r = httpx.post(daemon.url + "/api/generate", content=b"{not json", headers={"Content-Type": "application/json"})
    assert r.status_code == 400
    body = r.json()
    assert set(body) == {"error"} and isinstance(body["error"], str)


# -- the bytes on the wire -------------------------------------------------------------------------------

@pytest.mark.parametrize("via", ["tcp", "unix"])
def test_ndjson_framing_with_curl(daemon, tmp_path, via):
    curl = shutil.which("curl")
    if curl is None:
        pytest.skip("curl is not installed")
    body = json.dumps({"model": MODEL, "prompt": PROMPT, "raw": True, "stream": True,
                       "options": {"temperature": 0, "num_predict": N}})
    headers, out = tmp_path / "headers", tmp_path / "body"
    url = (daemon.url if via == "tcp" else "http://localhost") + "/api/generate"
    unix = [] if via == "tcp" else ["--unix-socket", daemon.http_socket]
    subprocess.run([curl, "-sN", *unix, "-D", str(headers), "-o", str(out), "-H", "Content-Type: application/json",
                    "--data-binary", body, url], check=True, timeout=T)
    head = headers.read_text().splitlines()
    assert head[0].startswith("HTTP/1.1 200")
    content_type = [h.split(":", 1)[1].strip() for h in head if h.lower().startswith("content-type:")]
    assert content_type == ["application/x-ndjson"]

    raw = out.read_bytes()
    assert raw.endswith(b"\n")
    lines = raw[:-1].split(b"\n")
    assert b"" not in lines  # no blank lines
    objects = [json.loads(line) for line in lines]
    assert all(isinstance(o, dict) for o in objects)
    assert [o["done"] for o in objects] == [False] * (len(objects) - 1) + [True]
    assert objects[-1]["done_reason"] == "length" and objects[-1]["eval_count"] == N
    want, _ = ref_generate(daemon, PROMPT)
    assert "".join(o["response"] for o in objects) == want


# -- num_ctx (last: it reloads the model) ----------------------------------------------------------------

def test_num_ctx_reloads_the_model(tcp, daemon):
    tcp.generate(model=MODEL, prompt=PROMPT, stream=False, options=GREEDY)
    before = loaded(tcp)[NAME].context_length
    assert before > 0
    want = 96 if before != 96 else 128
    out = tcp.generate(model=MODEL, prompt=PROMPT, raw=True, stream=False, options={**GREEDY, "num_ctx": want})
    assert loaded(tcp)[NAME].context_length == want
    assert out.eval_count == N
    ref, _ = ref_generate(daemon, PROMPT)  # the context's length does not change greedy text
    assert out.response == ref
    tcp.generate(model=MODEL, prompt="", keep_alive=0)  # leave the daemon as the others found it




# -- embeddings ---------------------------------------------------------------------------------

def test_embed_equals_the_engines_over_both_listeners(client, reference_embeddings):
    from .conftest import EMBED_TEXTS

    r = client.embed(model="tiny", input=EMBED_TEXTS)
    got = np.asarray(r.embeddings, np.float32)
    assert np.array_equal(got, reference_embeddings(EMBED_TEXTS))
    assert r.model == "tiny:latest" and r.prompt_eval_count > len(EMBED_TEXTS) and r.total_duration > 0
    one = client.embed(model="tiny", input=EMBED_TEXTS[0])
    assert np.array_equal(np.asarray(one.embeddings, np.float32), got[:1])
    legacy = client.embeddings(model="tiny", prompt=EMBED_TEXTS[1])
    assert np.array_equal(np.asarray(legacy.embedding, np.float32), got[1])


def test_embed_errors(tcp):
    for kw, status in (({"model": "no-such-model", "input": "x"}, 404), ({"model": "tiny", "input": []}, 400)):
        with pytest.raises(ollama.ResponseError) as e:
            tcp.embed(**kw)
        assert e.value.status_code == status
