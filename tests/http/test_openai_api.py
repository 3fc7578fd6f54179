"""OpenAI's API (/v1/*) of `moed serve`, through the real `openai` Python client (httpx and curl for
the error body and the bytes on the wire), over TCP and over the HTTP unix socket.

The reference for generated text is moed's own msgspec protocol (ipc.client.Client) asking the same
daemon for the same prompt, greedy, with the sampling defaults the routes document (OpenAI's
temperature and top_p of 1, llama.cpp's top_k 40, min_p 0.05, repeat_penalty 1.0). The model is
`tiny` (random weights, qwen3moe, Q8_0): its text is gibberish, but greedy decoding is deterministic.
"""

from __future__ import annotations

import json
import shutil
import subprocess

import httpx
import openai
import pytest

from ipc.protocol import SamplingOptions

from .conftest import via_socket

MODEL = "tiny"
NAME = "tiny:latest"
N = 8  # max_tokens of most tests
T = 120  # seconds before a request fails rather than hangs
PROMPT = "The capital of France is"
MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a colour."}]

# the defaults of daemon/http/openai.py's docstring: OpenAI's, and llama.cpp's server's extensions
OPENAI_DEFAULTS = {"temperature": 1.0, "top_p": 1.0, "top_k": 40, "min_p": 0.05, "repeat_penalty": 1.0}


def sampling(**over) -> SamplingOptions:
    return SamplingOptions(**{**OPENAI_DEFAULTS, **over})


# -- clients -----------------------------------------------------------------------------------------

@pytest.fixture(params=["tcp", "unix"])
def client(request, daemon) -> openai.OpenAI:
    if request.param == "tcp":
        c = openai.OpenAI(base_url=daemon.url + "/v1", api_key="unused", max_retries=0, timeout=T)
    else:
        http = httpx.Client(transport=httpx.HTTPTransport(uds=daemon.http_socket), timeout=T)
        c = openai.OpenAI(base_url="http://localhost/v1", api_key="unused", max_retries=0, http_client=http)
    yield c
    c.close()


@pytest.fixture
def tcp(daemon) -> openai.OpenAI:
    c = openai.OpenAI(base_url=daemon.url + "/v1", api_key="unused", max_retries=0, timeout=T)
    yield c
    c.close()


# -- the reference: moed's msgspec protocol -------------------------------------------------------------

def ref_generate(daemon, prompt: str, n: int = N, **options) -> tuple[str, object]:
    opts = sampling(**{"temperature": 0, **options})
    return via_socket(daemon, lambda c: c.generate(prompt, model=MODEL, max_tokens=n, raw=True, options=opts))


def ref_chat(daemon, messages, n: int = N, **options) -> tuple[str, object]:
    opts = sampling(**{"temperature": 0, **options})
    return via_socket(daemon, lambda c: c.chat(messages, model=MODEL, max_tokens=n, options=opts))


def check_usage(usage, n: int, prompt_tokens: int | None = None) -> None:
    assert usage.completion_tokens == n
    assert usage.prompt_tokens > 0
    if prompt_tokens is not None:
        assert usage.prompt_tokens == prompt_tokens
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens


# -- chat.completions --------------------------------------------------------------------------------

def test_chat_not_streamed(client, daemon):
    out = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=N, temperature=0)
    want, done = ref_chat(daemon, MESSAGES)
    assert out.object == "chat.completion"
    assert out.model == NAME
    assert out.id.startswith("chatcmpl-")
    assert len(out.choices) == 1
    choice = out.choices[0]
    assert choice.index == 0
    assert choice.message.role == "assistant"
    assert choice.message.content == want
    assert choice.finish_reason == "length"
    check_usage(out.usage, N, done.prompt_eval_count)


def test_chat_streamed_concatenates_to_not_streamed(client):
    whole = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=N, temperature=0)
    chunks = list(client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=N, temperature=0,
                                                 stream=True))
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert len({c.id for c in chunks}) == 1
    assert all(len(c.choices) == 1 for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks] == [None] * (len(chunks) - 1) + ["length"]
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert text == whole.choices[0].message.content
    assert text
    assert all(c.usage is None for c in chunks)  # no usage unless stream_options asks for it


def test_chat_stream_include_usage(client, daemon):
    chunks = list(client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=N, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    _, done = ref_chat(daemon, MESSAGES)
    last = chunks[-1]
    assert last.choices == []
    check_usage(last.usage, N, done.prompt_eval_count)
    assert chunks[-2].choices[0].finish_reason == "length"
    assert all(c.usage is None for c in chunks[:-1])


def test_chat_equals_msgspec_protocol(tcp, daemon):
    messages = [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "Hello!"},
                {"role": "assistant", "content": "Hi."}, {"role": "user", "content": "How are you?"}]
    out = tcp.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=12, temperature=0)
    # "developer" is OpenAI's newer name for the system role
    want, done = ref_chat(daemon, [{**m, "role": "system"} if m["role"] == "developer" else m for m in messages], n=12)
    assert out.choices[0].message.content == want
    check_usage(out.usage, 12, done.prompt_eval_count)


def test_chat_content_parts(tcp, daemon):
    messages = [{"role": "user", "content": [{"type": "text", "text": "Name a "}, {"type": "text", "text": "colour."}]}]
    out = tcp.chat.completions.create(model=MODEL, messages=messages, max_tokens=N, temperature=0)
    want, _ = ref_chat(daemon, [{"role": "user", "content": "Name a colour."}])
    assert out.choices[0].message.content == want


def test_chat_seed_matches_msgspec_protocol(tcp, daemon):
    kw = {"model": MODEL, "messages": MESSAGES, "max_tokens": 16, "temperature": 1.0, "seed": 99}
    a = tcp.chat.completions.create(**kw)
    b = tcp.chat.completions.create(**kw)
    assert a.choices[0].message.content == b.choices[0].message.content
    want, _ = ref_chat(daemon, MESSAGES, n=16, temperature=1.0, seed=99)
    assert a.choices[0].message.content == want


def test_chat_stop(tcp, daemon):
    text, _ = ref_chat(daemon, MESSAGES, n=16)
    stop = next((text[k:k + 2] for k in range(len(text) // 3, len(text) - 2)
                 if text[k:k + 2].strip() and text.find(text[k:k + 2]) > 0), None)
    assert stop is not None, f"no usable stop string in {text!r}"
    out = tcp.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=16, temperature=0, stop=stop)
    assert out.choices[0].message.content == text[:text.find(stop)]
    assert out.choices[0].finish_reason == "stop"


# -- completions -----------------------------------------------------------------------------------------

def test_completions_not_streamed(client, daemon):
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=N, temperature=0)
    want, done = ref_generate(daemon, PROMPT)
    assert out.object == "text_completion"
    assert out.model == NAME
    assert out.id.startswith("cmpl-")
    assert len(out.choices) == 1
    assert out.choices[0].text == want
    assert out.choices[0].finish_reason == "length"
    check_usage(out.usage, N, done.prompt_eval_count)


def test_completions_streamed_concatenates_to_not_streamed(client):
    whole = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=N, temperature=0)
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=N, temperature=0, stream=True))
    assert len(chunks) >= 2
    assert all(c.object == "text_completion" for c in chunks)
    assert [c.choices[0].finish_reason for c in chunks] == [None] * (len(chunks) - 1) + ["length"]
    text = "".join(c.choices[0].text for c in chunks)
    assert text == whole.choices[0].text
    assert text


def test_completions_stream_include_usage(client, daemon):
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=N, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    _, done = ref_generate(daemon, PROMPT)
    assert chunks[-1].choices == []
    check_usage(chunks[-1].usage, N, done.prompt_eval_count)
    assert chunks[-2].choices[0].finish_reason == "length"


def test_completions_equal_msgspec_protocol(tcp, daemon):
    prompt = "Once upon a time"
    out = tcp.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0)
    want, _ = ref_generate(daemon, prompt, n=12)
    assert out.choices[0].text == want


def test_completions_default_max_tokens_is_16(tcp, daemon):
    out = tcp.completions.create(model=MODEL, prompt=PROMPT, temperature=0)
    want, _ = ref_generate(daemon, PROMPT, n=16)
    assert out.choices[0].text == want
    assert out.usage.completion_tokens == 16


def test_completions_from_token_ids(tcp, daemon):
    ids = [1, 2, 3, 4, 5]
    out = tcp.completions.create(model=MODEL, prompt=ids, max_tokens=N, temperature=0)
    with daemon.client() as c:
        gen = c.generate(ids, model=MODEL, max_tokens=N, options=sampling(temperature=0))
        want = "".join(ch.text for ch in gen)
    assert out.choices[0].text == want
    assert out.usage.prompt_tokens == len(ids)


def test_completions_by_path_on_the_unix_socket(daemon):
    http = httpx.Client(transport=httpx.HTTPTransport(uds=daemon.http_socket), timeout=T)
    with openai.OpenAI(base_url="http://localhost/v1", api_key="unused", max_retries=0, http_client=http) as c:
        out = c.completions.create(model=daemon.model, prompt=PROMPT, max_tokens=N, temperature=0)
    want, _ = ref_generate(daemon, PROMPT)
    assert out.choices[0].text == want


def test_a_path_over_tcp_is_refused(tcp, daemon):
    with pytest.raises(openai.BadRequestError):
        tcp.completions.create(model=daemon.model, prompt=PROMPT, max_tokens=N, temperature=0)


# -- models ----------------------------------------------------------------------------------------------

def test_models(client):
    ids = [m.id for m in client.models.list()]
    assert NAME in ids
    m = client.models.retrieve(NAME)
    assert m.id == NAME
    assert m.object == "model"
    assert m.owned_by
    assert client.models.retrieve(MODEL).id == NAME  # the tag defaults to latest
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")


def test_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="no-such-model", messages=MESSAGES, max_tokens=N)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt=PROMPT, max_tokens=N, stream=True)


# -- what is refused, what is ignored ----------------------------------------------------------------------

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                           "parameters": {"type": "object",
                                                          "properties": {"city": {"type": "string"}}}}}]


@pytest.mark.parametrize("field", [{"n": 2}, {"logit_bias": {"1": 5}}, {"logprobs": True},
                                   {"logprobs": True, "top_logprobs": 2}, {"presence_penalty": 0.5},
                                   {"frequency_penalty": 0.5}, {"tool_choice": "required", "tools": TOOLS},
                                   {"response_format": {"type": "xml"}},
                                   {"response_format": {"type": "json_schema"}}])
def test_chat_unsupported_fields_are_refused(tcp, field):
    with pytest.raises(openai.BadRequestError) as e:
        tcp.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=N, temperature=0, **field)
    assert e.value.status_code == 400
    assert e.value.body["type"] == "invalid_request_error"
    assert next(iter(field)) in e.value.body["message"]


@pytest.mark.parametrize("field", [{"n": 2}, {"logit_bias": {"1": 5}}, {"logprobs": 2}, {"echo": True},
                                   {"suffix": "end"}, {"best_of": 2}])
def test_completions_unsupported_fields_are_refused(tcp, field):
    with pytest.raises(openai.BadRequestError):
        tcp.completions.create(model=MODEL, prompt=PROMPT, max_tokens=N, temperature=0, **field)


def test_image_content_is_refused(tcp):
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    messages = [{"role": "user", "content": [{"type": "text", "text": "What is this?"}, image]}]
    with pytest.raises(openai.BadRequestError) as e:
        tcp.chat.completions.create(model=MODEL, messages=messages, max_tokens=N)
    assert "image_url" in e.value.body["message"]


def test_harmless_fields_are_accepted(tcp, daemon):
    out = tcp.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=N, temperature=0, user="x",
                                      metadata={"a": "b"}, store=False, service_tier="auto",
                                      response_format={"type": "text"}, logprobs=False)
    want, _ = ref_chat(daemon, MESSAGES)
    assert out.choices[0].message.content == want
    out = tcp.completions.create(model=MODEL, prompt=PROMPT, max_tokens=N, temperature=0, user="x",
                                 extra_body={"metadata": {"a": "b"}, "store": False})
    assert out.choices[0].text == ref_generate(daemon, PROMPT)[0]


# -- the error body ----------------------------------------------------------------------------------------

def check_error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status
    assert r.headers["content-type"].startswith("application/json")
    body = r.json()
    assert set(body) == {"error"}
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    assert isinstance(err["type"], str)
    assert err["param"] is None and err["code"] is None
    return err


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_malformed_json_gets_openai_error(daemon, path):
    r = httpx.post(daemon.url + path, content=b'{"model": "tiny", "messages": [', timeout=T,
                   headers={"Content-Type": "application/json"})
    err = check_error(r, 400)
    assert err["type"] == "invalid_request_error"


def test_wrong_type_gets_openai_error(daemon):
    r = httpx.post(daemon.url + "/v1/chat/completions", json={"model": MODEL, "messages": "hello"}, timeout=T)
    check_error(r, 400)


def test_unknown_route_and_method_get_openai_error(daemon):
    check_error(httpx.get(daemon.url + "/v1/no-such-route", timeout=T), 404)
    check_error(httpx.get(daemon.url + "/v1/chat/completions", timeout=T), 405)


# -- the bytes on the wire ---------------------------------------------------------------------------------

@pytest.mark.parametrize("route", ["chat", "completions"])
@pytest.mark.parametrize("via", ["tcp", "unix"])
def test_sse_framing_with_curl(daemon, tmp_path, via, route):
    curl = shutil.which("curl")
    if curl is None:
        pytest.skip("curl is not installed")
    if route == "chat":
        path, body = "/v1/chat/completions", {"messages": MESSAGES}
    else:
        path, body = "/v1/completions", {"prompt": PROMPT}
    body = json.dumps({"model": MODEL, "max_tokens": N, "temperature": 0, "stream": True, **body})
    headers, out = tmp_path / "headers", tmp_path / "body"
    url = (daemon.url if via == "tcp" else "http://localhost") + path
    unix = [] if via == "tcp" else ["--unix-socket", daemon.http_socket]
    subprocess.run([curl, "-sN", *unix, "-D", str(headers), "-o", str(out), "-H", "Content-Type: application/json",
                    "--data-binary", body, url], check=True, timeout=T)
    head = headers.read_text().splitlines()
    assert head[0].startswith("HTTP/1.1 200")
    content_type = [h.split(":", 1)[1].strip() for h in head if h.lower().startswith("content-type:")]
    assert content_type == ["text/event-stream"]

    raw = out.read_bytes()
    assert raw.endswith(b"\n\ndata: [DONE]\n\n")
    assert raw.count(b"data: [DONE]") == 1
    events = raw.split(b"\n\n")
    assert events[-1] == b""  # every event ends with a blank line
    events = events[:-1]
    assert events[-1] == b"data: [DONE]"
    chunks = []
    for event in events[:-1]:
        assert event.startswith(b"data: ")
        assert b"\n" not in event  # one line per event
        chunks.append(json.loads(event[len(b"data: "):]))
    assert all(isinstance(c, dict) for c in chunks)
    finish = [c["choices"][0]["finish_reason"] for c in chunks]
    assert finish == [None] * (len(chunks) - 1) + ["length"]
    if route == "chat":
        text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
        want, _ = ref_chat(daemon, MESSAGES)
    else:
        text = "".join(c["choices"][0]["text"] for c in chunks)
        want, _ = ref_generate(daemon, PROMPT)
    assert text == want


# -- embeddings ---------------------------------------------------------------------------------

def test_embeddings_equal_the_engines_as_float_and_base64(client, reference_embeddings):
    import numpy as np

    from .conftest import EMBED_TEXTS

    import base64

    want = reference_embeddings(EMBED_TEXTS)
    # no format: the client asks for base64 and decodes it; asked for by name, it is left as text
    for fmt in ("float", None, "base64"):
        kw = {} if fmt is None else {"encoding_format": fmt}
        r = client.embeddings.create(model="tiny", input=EMBED_TEXTS, **kw)
        rows = [d.embedding for d in sorted(r.data, key=lambda d: d.index)]
        if fmt == "base64":
            rows = [np.frombuffer(base64.b64decode(e), "<f4") for e in rows]
        assert np.array_equal(np.asarray(rows, np.float32), want), fmt
        assert r.usage.prompt_tokens == r.usage.total_tokens > len(EMBED_TEXTS)
    r = client.embeddings.create(model="tiny", input=EMBED_TEXTS[0])
    assert np.array_equal(np.asarray(r.data[0].embedding, np.float32), want[0])


def test_embeddings_errors(tcp):
    with pytest.raises(openai.NotFoundError):
        tcp.embeddings.create(model="no-such-model", input="x")
    with pytest.raises(openai.BadRequestError, match="dimensions"):
        tcp.embeddings.create(model="tiny", input="x", dimensions=3)
    with pytest.raises(openai.BadRequestError, match="token ids"):
        tcp.embeddings.create(model="tiny", input=[1, 2, 3])


# -- structured output --------------------------------------------------------------------------

SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                          "sunny": {"type": "boolean"},
                                          "temp": {"type": "integer", "minimum": -50, "maximum": 60}},
          "required": ["city", "sunny", "temp"], "additionalProperties": False}


@pytest.mark.parametrize("seed", range(4))
def test_response_format_json_schema_is_held_to(client, seed):
    import jsonschema

    rf = {"type": "json_schema", "json_schema": {"name": "weather", "schema": SCHEMA, "strict": True}}
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=200, temperature=1.0, seed=seed,
                                       response_format=rf)
    jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMA)
    assert r.choices[0].finish_reason == "stop"
    chunks = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=200, temperature=1.0,
                                            seed=seed, response_format=rf, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    jsonschema.validate(json.loads(text), SCHEMA)


def test_response_format_json_object_starts_an_object(tcp):
    r = tcp.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=40, temperature=0,
                                    response_format={"type": "json_object"})
    assert r.choices[0].message.content.startswith("{")
