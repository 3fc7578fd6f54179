"""Chat templates: render a conversation into a prompt string.

Templates are the Jinja2 ``tokenizer.chat_template`` strings stored in GGUF files (copied from
HuggingFace ``tokenizer_config.json``), so they are rendered the way ``transformers``'
``apply_chat_template`` renders them:

* ``jinja2.sandbox.ImmutableSandboxedEnvironment`` with ``trim_blocks=True, lstrip_blocks=True``
  and the ``loopcontrols`` extension (``{% break %}`` / ``{% continue %}``);
* globals ``raise_exception(msg)`` and ``strftime_now(fmt)``, a ``tojson`` filter that does not
  HTML-escape (``json.dumps(x, ensure_ascii=False, ...)``), and a no-op
  ``{% generation %}...{% endgeneration %}`` tag;
* variables ``messages``, ``add_generation_prompt``, ``bos_token``, ``eos_token``, ``tools=None``,
  ``documents=None`` plus any extra keyword (``enable_thinking``, ``reasoning_effort``, ...).

Errors:

* bad ``messages`` (not a list of objects with a string ``role`` and a string ``content``) and a
  template calling ``raise_exception`` (e.g. "roles must alternate user/assistant") raise
  ``RequestError``;
* a template that does not compile, fails while rendering, or touches anything the sandbox
  forbids (``''.__class__``, ``list.append``, huge ``'x' * 10**9`` ...) raises ``ModelError``
  whose message says so; nothing outside the sandbox is executed.  (There is no time limit:
  a template can still loop for long, e.g. nested ``range(100000)`` loops.)

No template: when the model has no ``tokenizer.chat_template`` (``template`` is None or empty)
the conversation is rendered as ChatML (``<|im_start|>role\\ncontent<|im_end|>\\n`` ... then
``<|im_start|>assistant\\n``), which is also llama.cpp's fallback.  It is only right for models
trained on ChatML; for others the caller should let the user supply a template.
"""

from __future__ import annotations

import functools
import json
import operator
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

from jinja2 import nodes
from jinja2.exceptions import SecurityError, TemplateError, TemplateSyntaxError
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment

from daemon.errors import ModelError, RequestError

__all__ = ["CHATML_TEMPLATE", "chat_template_from_metadata", "render_chat", "template_tokens"]

#: fallback template for models without one (ChatML)
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + (message['content'] or '') + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_MAX_SEQUENCE = 1 << 20  # longest str / list a template may build with * (1 Mi items)


class _TemplateRaised(Exception):
    """raise_exception() was called by the template."""


def _raise_exception(message: Any = "") -> None:
    raise _TemplateRaised(str(message))


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: Any = None, sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


class _GenerationTag(Extension):
    """``{% generation %}...{% endgeneration %}`` (transformers' assistant-mask marker): no-op."""

    tags = {"generation"}

    def parse(self, parser: Any) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return caller()


class _Sandbox(ImmutableSandboxedEnvironment):
    """The HF sandbox, failing loudly at the first unsafe access instead of returning Undefined,
    and refusing to build huge sequences with ``*`` / ``**``."""

    intercepted_binops = frozenset({"*", "**"})

    def unsafe_undefined(self, obj: Any, attribute: Any) -> Any:
        raise SecurityError(f"access to {attribute!r} of a {type(obj).__name__} object is not "
                            "allowed in a chat template")

    def call_binop(self, context: Any, operator_: str, left: Any, right: Any) -> Any:
        if operator_ == "*":
            for seq, k in ((left, right), (right, left)):
                if isinstance(seq, (str, list, tuple)) and isinstance(k, int) \
                        and len(seq) * k > _MAX_SEQUENCE:
                    raise SecurityError("chat template builds a sequence that is too long")
            return operator.mul(left, right)
        if operator_ == "**":
            if isinstance(right, int) and not isinstance(right, bool) and abs(right) > 1024:
                raise SecurityError("chat template computes a power that is too large")
            return operator.pow(left, right)
        return super().call_binop(context, operator_, left, right)


@functools.lru_cache(maxsize=1)
def _environment() -> _Sandbox:
    env = _Sandbox(trim_blocks=True, lstrip_blocks=True,
                   extensions=["jinja2.ext.loopcontrols", _GenerationTag])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


@functools.lru_cache(maxsize=32)
def _compile(template: str) -> Any:
    try:
        return _environment().from_string(template)
    except TemplateSyntaxError as e:
        raise ModelError(f"chat template does not compile: {e} (line {e.lineno})") from e
    except SecurityError as e:
        raise ModelError(f"chat template is not allowed: {e}") from e


def _validate_messages(messages: Any) -> list[dict[str, Any]]:
    if not isinstance(messages, Sequence) or isinstance(messages, (str, bytes)):
        raise RequestError("messages must be a list of {role, content} objects")
    if not messages:
        raise RequestError("messages is empty")
    out: list[dict[str, Any]] = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise RequestError(f"messages[{i}] must be an object with 'role' and 'content'")
        role = m.get("role")
        if not isinstance(role, str) or not role:
            raise RequestError(f"messages[{i}].role must be a non-empty string")
        content = m.get("content")
        if isinstance(content, str):
            pass
        elif content is None:
            if role != "assistant":
                raise RequestError(f"messages[{i}].content is missing ({role} message)")
        elif isinstance(content, Sequence) and not isinstance(content, (bytes, bytearray)):
            texts = []
            for j, part in enumerate(content):
                if isinstance(part, str):
                    texts.append(part)
                    continue
                if not isinstance(part, Mapping) or part.get("type") != "text" \
                        or not isinstance(part.get("text"), str):
                    raise RequestError(f"messages[{i}].content[{j}]: only text parts "
                                       "({'type': 'text', 'text': ...}) are supported")
                texts.append(part["text"])
            content = "\n".join(texts)
        else:
            raise RequestError(f"messages[{i}].content must be a string")
        msg = dict(m)
        msg["content"] = content
        out.append(msg)
    return out


def render_chat(
    template: str | None,
    messages: Sequence[Mapping[str, Any]],
    add_generation_prompt: bool = True,
    bos_token: str = "",
    eos_token: str = "",
    **extra: Any,
) -> str:
    """Render ``messages`` with the Jinja2 chat ``template`` (ChatML when it is None/empty).

    ``extra`` keywords become template variables (``tools=[...]``, ``enable_thinking=False``,
    ``reasoning_effort="low"``, ...).  See the module docstring for the errors raised.
    """
    msgs = _validate_messages(messages)
    if template is not None and not isinstance(template, str):
        raise RequestError("chat template must be a string")
    compiled = _compile(template or CHATML_TEMPLATE)
    variables: dict[str, Any] = {"tools": None, "documents": None}
    variables.update(extra)
    variables.update(messages=msgs, add_generation_prompt=bool(add_generation_prompt),
                     bos_token=bos_token or "", eos_token=eos_token or "")
    try:
        return compiled.render(**variables)
    except _TemplateRaised as e:
        raise RequestError(f"chat template rejected the conversation: {e}") from None
    except SecurityError as e:
        raise ModelError(f"chat template tried something the sandbox forbids: {e}") from None
    except TemplateError as e:
        raise ModelError(f"chat template failed: {e}") from None
    except RecursionError:
        raise ModelError("chat template failed: recursion too deep") from None
    except Exception as e:  # noqa: BLE001 - a template can raise anything (TypeError, ...)
        raise ModelError(f"chat template failed: {type(e).__name__}: {e}") from None


def chat_template_from_metadata(metadata: Mapping[str, Any], name: str | None = None) -> str | None:
    """The model's chat template (``tokenizer.chat_template`` or a named variant), or None."""
    key = "tokenizer.chat_template" + (f".{name}" if name else "")
    value = metadata.get(key)
    return value if isinstance(value, str) and value else None


def template_tokens(tokenizer: Any) -> dict[str, str]:
    """``bos_token`` / ``eos_token`` strings for :func:`render_chat` from a ``Tokenizer``."""
    out = {}
    for name, tid in (("bos_token", tokenizer.bos_id), ("eos_token", tokenizer.eos_id)):
        out[name] = tokenizer.token_text(tid) if tid is not None else ""
    return out
