"""Tool calls and reasoning through both APIs, with the real ollama and openai clients: the HTTP
server in process over a scheduler that streams a golden model output token by token (a
random-weight fixture never writes a call), for Qwen3's and gpt-oss's formats. Checks what reaches
the scheduler (tools, the history's calls and results in the shape chat templates read) and what
the clients get (tool_calls, thinking / reasoning_content, content, finish reasons), streamed and
not."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import ollama
import openai
import pytest
from gguf import GGUFWriter

from daemon.config import Settings
from daemon.http.server import HttpServer
from ipc.protocol import Chunk, Done
from tests.text.test_reply import pieces

GOLDEN = Path(__file__).resolve().parent.parent / "fixtures" / "replies"
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]
MODELS = {"qwen": ("qwen3moe", "{% for m in messages %}{{ m.content }}{% endfor %}<tool_call>",
                   "qwen3_think_tool_call"),
          "oss": ("gpt-oss", "{% for m in messages %}{{ m.content }}{% endfor %}", "gptoss_tool_call"),
          "plain": ("llama", "{% for m in messages %}{{ m.content }}{% endfor %}", "gptoss_final")}


class ScriptedScheduler:
    """What the HTTP routes call, answering every chat with the model's golden reply."""

    catalog = None

    def __init__(self, directory: Path):
        self.paths = {}
        for name, (arch, template, _) in MODELS.items():
            path = directory / f"{name}.gguf"
            w = GGUFWriter(str(path), arch)
            w.add_chat_template(template)
            w.write_header_to_file()
            w.write_kv_data_to_file()
            w.write_tensors_to_file()
            w.close()
            self.paths[name] = str(path)
        self.requests = []

    def path_of(self, ref):
        return self.paths[ref.split(":")[0]]

    @staticmethod
    def label(ref, path):
        return ref

    async def generate(self, req, emit, received_ns, peer=None, settings=None):
        self.requests.append(req)
        text = (GOLDEN / f"{MODELS[req.model.split(':')[0]][2]}.txt").read_text()
        parts = pieces(text, 3)
        for p in parts:
            emit(Chunk(req.id, p, [0]))
            await asyncio.sleep(0)
        emit(Done(req.id, "stop", prompt_eval_count=5, eval_count=len(parts), eval_duration=1, total_duration=2))


@pytest.fixture
async def served(tmp_path):
    sched = ScriptedScheduler(tmp_path)
    http = HttpServer(Settings.load(env={}, http_host="127.0.0.1:0"), sched, str(tmp_path / "moed.sock"),
                      frozenset(), "test")
    await http.start()
    yield sched, f"http://127.0.0.1:{http.port}"
    await http.close()


HISTORY = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.mark.parametrize("model", ["qwen", "oss"])
async def test_ollama_chat_gives_tool_calls_and_thinking(served, model):
    sched, url = served
    client = ollama.Client(host=url)
    r = await asyncio.to_thread(client.chat, model=model, messages=HISTORY, tools=TOOLS, stream=False)
    assert [(c.function.name, dict(c.function.arguments)) for c in r.message.tool_calls] == \
        [("get_weather", {"city": "Paris"} if model == "oss" else {"city": "Paris", "unit": "celsius"})]
    assert "weather" in r.message.thinking and "<" not in r.message.thinking
    assert "<" not in r.message.content
    assert sched.requests[-1].tools == TOOLS

    def stream():
        return list(client.chat(model=model, messages=HISTORY, tools=TOOLS, stream=True))

    parts = await asyncio.to_thread(stream)
    calls = [c for p in parts for c in (p.message.tool_calls or [])]
    assert [c.function.name for c in calls] == ["get_weather"]
    assert "".join(p.message.thinking or "" for p in parts) == r.message.thinking
    assert "".join(p.message.content for p in parts) == r.message.content
    assert parts[-1].done and parts[-1].done_reason == "stop"


@pytest.mark.parametrize("model", ["qwen", "oss"])
async def test_openai_chat_gives_tool_calls_and_reasoning(served, model):
    sched, url = served
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    r = await asyncio.to_thread(client.chat.completions.create, model=model, messages=HISTORY, tools=TOOLS)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_") and call.function.name == "get_weather"
    assert json.loads(call.function.arguments)["city"] == "Paris"
    assert "weather" in choice.message.model_extra["reasoning_content"]

    def stream():
        return list(client.chat.completions.create(model=model, messages=HISTORY, tools=TOOLS, stream=True))

    chunks = await asyncio.to_thread(stream)
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    calls = [t for d in deltas for t in (d.tool_calls or [])]
    assert [(t.index, t.function.name) for t in calls] == [(0, "get_weather")]
    assert json.loads(calls[0].function.arguments)["city"] == "Paris"
    reasoning = "".join((d.model_extra or {}).get("reasoning_content") or "" for d in deltas)
    assert reasoning == choice.message.model_extra["reasoning_content"]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


async def test_a_conversation_with_calls_reaches_the_template_in_its_shape(served):
    """The history's calls (OpenAI: arguments as a JSON string; Ollama: an object) and tool
    results reach the scheduler as Message fields chat templates read."""
    sched, url = served
    oa = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    history = HISTORY + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "22C and sunny"}]
    await asyncio.to_thread(oa.chat.completions.create, model="qwen", messages=history, tools=TOOLS)
    msgs = sched.requests[-1].messages
    assert msgs[1].tool_calls == [{"id": "call_1", "type": "function",
                                   "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]
    assert (msgs[2].role, msgs[2].tool_call_id, msgs[2].content) == ("tool", "call_1", "22C and sunny")
    ol = ollama.Client(host=url)
    history = HISTORY + [
        {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "get_weather",
                                                                         "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "tool_name": "get_weather", "content": "22C"}]
    await asyncio.to_thread(ol.chat, model="qwen", messages=history, tools=TOOLS, stream=False)
    msgs = sched.requests[-1].messages
    assert msgs[1].tool_calls == [{"type": "function", "function": {"name": "get_weather",
                                                                    "arguments": {"city": "Paris"}}}]
    assert (msgs[2].role, msgs[2].name) == ("tool", "get_weather")
    with pytest.raises(openai.BadRequestError, match="not JSON"):
        bad = [HISTORY[0], {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{oops"}}]}]
        await asyncio.to_thread(oa.chat.completions.create, model="qwen", messages=bad)


# -- from a model: a random-weight fixture with a <tool_call> template, held to a call by tool_choice --

HERMES_TEMPLATE = """{%- if tools %}<|im_start|>system
<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools>
Call a tool as <tool_call>{"name": ..., "arguments": ...}</tool_call><|im_end|>
{% endif %}
{%- for m in messages %}<|im_start|>{{ m.role }}
{{ m.content }}{% for c in m.tool_calls or [] %}<tool_call>
{{ c.function | tojson }}
</tool_call>{% endfor %}<|im_end|>
{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                     "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "days"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
    "additionalProperties": False}}}


@pytest.fixture(scope="module")
def tool_daemon(tmp_path_factory, fixture_dir, warm_kernels):
    from tests.fixtures.build import fixture_path

    from .conftest import _short_dir, spawn

    model = str(fixture_path("qwen3moe", "Q8_0", fixture_dir, chat_template=HERMES_TEMPLATE))
    d = spawn(_short_dir(tmp_path_factory.mktemp("tools")), model)
    yield d
    d.stop()


@pytest.mark.parametrize("seed", range(3))
def test_a_model_held_to_a_call_gives_a_parsed_valid_call(tool_daemon, seed):
    import jsonschema

    client = openai.OpenAI(base_url=tool_daemon.url + "/v1", api_key="unused", max_retries=0)
    for choice, names in (("required", {"get_weather", "get_time"}),
                          ({"type": "function", "function": {"name": "get_time"}}, {"get_time"})):
        r = client.chat.completions.create(model="tiny", messages=HISTORY, tools=[WEATHER, TIME], tool_choice=choice,
                                           temperature=1.0, seed=seed, max_tokens=120)
        assert r.choices[0].finish_reason == "tool_calls"
        (call,) = r.choices[0].message.tool_calls
        assert call.function.name in names
        spec = WEATHER if call.function.name == "get_weather" else TIME
        jsonschema.validate(json.loads(call.function.arguments), spec["function"]["parameters"])
    ol = ollama.Client(host=tool_daemon.url)
    r = ol.chat(model="tiny", messages=HISTORY, tools=[WEATHER, TIME], stream=False,
                options={"num_predict": 8, "temperature": 0})
    assert r.message.tool_calls is None and r.done  # "auto": a random model writes no call here


def test_tools_are_rendered_into_the_prompt(tool_daemon):
    ol = ollama.Client(host=tool_daemon.url)
    plain = ol.chat(model="tiny", messages=HISTORY, stream=False, options={"num_predict": 1})
    tooled = ol.chat(model="tiny", messages=HISTORY, tools=[WEATHER], stream=False, options={"num_predict": 1})
    # the system block listing the tool: its JSON, tokenized by the fixture's byte-level vocabulary
    assert tooled.prompt_eval_count > plain.prompt_eval_count + len(json.dumps(WEATHER)) // 4


async def test_a_forced_call_is_refused_where_it_cannot_be_held(served):
    sched, url = served
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    cases = [("plain", "required", "gpt-oss"),  # a format moed cannot write calls in
             ("qwen", {"type": "function", "function": {"name": "nope"}}, "nope"),
             ("qwen", "sometimes", "tool_choice")]
    for model, choice, words in cases:
        with pytest.raises(openai.BadRequestError, match=words):
            await asyncio.to_thread(client.chat.completions.create, model=model, messages=HISTORY, tools=TOOLS,
                                    tool_choice=choice)


@pytest.fixture(scope="module")
def harmony_daemon(tmp_path_factory, warm_kernels):
    """A small gpt-oss file from `moed synth` (the harmony vocabulary and template)."""
    from daemon.synth import synth

    from .conftest import _short_dir, spawn

    directory = _short_dir(tmp_path_factory.mktemp("harmony"))
    model = directory / "oss.gguf"
    synth(model, "gpt-oss-20b", n_layer=1, n_embd=256, n_ff_exp=256, n_head=8, n_expert=4, n_expert_used=2,
          report=lambda *a: None)
    d = spawn(directory / "d", str(model))
    yield d
    d.stop()


def test_a_gpt_oss_model_held_to_a_call_gives_a_parsed_valid_call(harmony_daemon):
    import jsonschema

    client = openai.OpenAI(base_url=harmony_daemon.url + "/v1", api_key="unused", max_retries=0)
    for seed, choice in enumerate(("required", {"type": "function", "function": {"name": "get_weather"}})):
        r = client.chat.completions.create(model="tiny", messages=HISTORY, tools=[WEATHER, TIME], tool_choice=choice,
                                           temperature=1.0, seed=seed, max_tokens=120)
        assert r.choices[0].finish_reason == "tool_calls", r.choices[0]
        (call,) = r.choices[0].message.tool_calls
        spec = WEATHER if call.function.name == "get_weather" else TIME
        assert isinstance(choice, str) or call.function.name == "get_weather"
        jsonschema.validate(json.loads(call.function.arguments), spec["function"]["parameters"])
    ol = ollama.Client(host=harmony_daemon.url)
    r = ol.chat(model="tiny", messages=HISTORY, stream=False, options={"num_predict": 6, "temperature": 0})
    assert "<|" not in r.message.content  # harmony markers never reach the content
