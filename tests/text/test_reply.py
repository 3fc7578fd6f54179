"""daemon/text/reply.py: chat replies parsed into reasoning, content and tool calls, for Qwen3's
<think>/<tool_call> format and gpt-oss's harmony channels, from golden model outputs fed whole,
character by character and in scripted token-sized pieces (markers whole, as special tokens come)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from daemon.text.reply import CONTENT, TOOL_CALL, HarmonyReply, HermesReply, PlainReply, reply_parser

GOLDEN = Path(__file__).resolve().parent.parent / "fixtures" / "replies"
CASES = sorted(p.stem for p in GOLDEN.glob("*.txt"))
MARKER = re.compile(r"(<\|[a-z]+\|>|</?think>|</?tool_call>)")


def parser_for(name: str):
    return HarmonyReply() if name.startswith("gptoss") else HermesReply()


def pieces(text: str, size: int) -> list[str]:
    """Token-like pieces: each marker whole (a special token), the text between in `size` chars."""
    out = []
    for part in MARKER.split(text):
        if MARKER.fullmatch(part):
            out.append(part)
        else:
            out += [part[i:i + size] for i in range(0, len(part), size)]
    return [p for p in out if p]


def merged(parser, parts: list[str]) -> list:
    events = []
    for p in parts:
        events += parser.feed(p)
    events += parser.finish()
    out = []
    for kind, value in events:
        if kind == TOOL_CALL:
            out.append([kind, {"name": value.name, "arguments": value.arguments}])
        elif out and out[-1][0] == kind:
            out[-1][1] += value
        else:
            out.append([kind, value])
    return out


@pytest.mark.parametrize("name", CASES)
@pytest.mark.parametrize("split", ["whole", "chars", "tokens2", "tokens5"])
def test_golden_replies(name, split):
    text = (GOLDEN / f"{name}.txt").read_text()
    want = json.loads((GOLDEN / f"{name}.json").read_text())
    parts = {"whole": [text], "chars": list(text), "tokens2": pieces(text, 2), "tokens5": pieces(text, 5)}[split]
    got = merged(parser_for(name), parts)
    # adjacent content events are one text however the stream was cut
    assert got == [e for e in _merge(want)]


def _merge(events):
    out = []
    for kind, value in events:
        if kind != TOOL_CALL and out and out[-1][0] == kind:
            out[-1] = [kind, out[-1][1] + value]
        else:
            out.append([kind, value])
    return out


def test_text_that_only_looks_like_a_marker_is_content():
    got = merged(HermesReply(), list("a < b and <tool is not a tag; <thinking> neither"))
    assert got == [[CONTENT, "a < b and <tool is not a tag; <thinking> neither"]]


def test_a_reply_cut_inside_a_call_keeps_its_text():
    got = merged(HermesReply(), ["<tool_call>\n{\"name\": \"f\", \"argu"])
    assert got == [[CONTENT, "<tool_call>\n{\"name\": \"f\", \"argu"]]
    got = merged(HarmonyReply(), ["<|channel|>final<|message|>Hello, wor"])
    assert got == [[CONTENT, "Hello, wor"]]


def test_the_parser_follows_the_model():
    assert isinstance(reply_parser("gpt-oss", ""), HarmonyReply)
    assert isinstance(reply_parser("qwen3moe", "{% if tools %}<tool_call>{% endif %}"), HermesReply)
    assert isinstance(reply_parser("llama", "{{ messages }}"), PlainReply)
    assert merged(PlainReply(), ["<tool_call>{}</tool_call>"]) == [[CONTENT, "<tool_call>{}</tool_call>"]]


def test_tools_and_calls_reach_the_chat_template():
    """A Chat's tools become the template's `tools`; its messages' calls and results keep their
    fields (sequence.prompt_ids -> Engine.chat_ids -> render_chat)."""
    from types import SimpleNamespace

    from daemon.scheduler.sequence import prompt_ids
    from daemon.text.chat import render_chat
    from ipc.protocol import Chat, Message

    template = ("{% if tools %}<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}</tools>{% endif %}"
                "{% for m in messages %}[{{ m.role }}]{{ m.content }}"
                "{% for c in m.tool_calls or [] %}<tool_call>{{ c.function | tojson }}</tool_call>{% endfor %}"
                "{% if m.tool_call_id %}({{ m.tool_call_id }}){% endif %}{% endfor %}")
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    seen = {}

    def chat_ids(messages, *, max_bytes, timeout, tools=None):
        seen["prompt"] = render_chat(template, messages, tools=tools)
        return [1, 2, 3]

    engine = SimpleNamespace(gguf=SimpleNamespace(metadata={"tokenizer.chat_template": template}),
                             chat_ids=chat_ids, n_ctx=100, model=SimpleNamespace(hp=SimpleNamespace(n_vocab=10)))
    call = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    req = Chat(1, [Message("user", "Weather?"), Message("assistant", "", tool_calls=[call]),
                   Message("tool", "22C", tool_call_id="c1", name="get_weather")], tools=tools)
    assert prompt_ids(req, engine, max_bytes=10_000, template_timeout=5) == [1, 2, 3]
    assert seen["prompt"] == ('<tools>{"type": "function", "function": {"name": "get_weather", "parameters": '
                              '{"type": "object"}}}</tools>[user]Weather?[assistant]<tool_call>{"name": '
                              '"get_weather", "arguments": {"city": "Paris"}}</tool_call>[tool]22C(c1)')
