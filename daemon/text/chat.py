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

Bounds: a template comes from a model file and may be hostile or just careless, so each render
is bounded in time, memory and output (``render_chat``'s ``timeout`` and ``max_bytes``):

* the conversation (message fields, tools, extra variables) may hold at most ``max_bytes`` bytes
  of text, checked before rendering; the rendered prompt at most ``max_bytes`` UTF-8 bytes;
* the template runs in the bounded sandbox of :mod:`daemon.text.sandbox`, with ``max_bytes`` as
  its value cap: no value inside may grow past ``max_bytes`` characters, all ``for`` loops
  together may take at most ``MAX_LOOP_ITERATIONS`` steps, and the time budget is checked
  throughout (see that module for how, and for what is not bounded).

Errors:

* bad ``messages`` (not a list of objects with a string ``role`` and a string ``content``) and a
  template calling ``raise_exception`` (e.g. "roles must alternate user/assistant") raise
  ``RequestError``;
* a conversation over ``max_bytes``, and a size bound hit while rendering a conversation that is
  itself a quarter of the cap or more, raise ``RequestError`` ("prompt too large: ...");
* a template that exceeds a bound raises ``ModelError`` naming it ("chat template exceeded its
  time budget of 5 s", "... its loop limit of 1,000,000 iterations", "... the sandbox's size
  limit: ...");
* a template that does not compile, fails while rendering, or touches anything the sandbox
  forbids (``''.__class__``, ``list.append`` ...) raises ``ModelError`` whose message says so;
  nothing outside the sandbox is executed.

No template: when the model has no ``tokenizer.chat_template`` (``template`` is None or empty)
the conversation is rendered as ChatML (``<|im_start|>role\\ncontent<|im_end|>\\n`` ... then
``<|im_start|>assistant\\n``), which is also llama.cpp's fallback.  It is only right for models
trained on ChatML; for others the caller should let the user supply a template.
"""

from __future__ import annotations

import functools
import itertools
import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

from jinja2 import nodes
from jinja2.exceptions import SecurityError, TemplateError, TemplateSyntaxError
from jinja2.ext import Extension

from daemon.errors import ModelError, RequestError
from daemon.text.sandbox import (
    MAX_LOOP_ITERATIONS,
    Budget,
    Exceeded,
    Sandbox,
    bounded_environment,
    render,
    text_size,
    utf8_len,
)

__all__ = ["CHATML_TEMPLATE", "MAX_LOOP_ITERATIONS", "chat_template_from_metadata", "render_chat",
           "template_tokens"]

#: fallback template for models without one (ChatML)
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + (message['content'] or '') + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_DEFAULT_VALUE_CAP = 4 * 2**20  # characters a value may reach when render_chat gets max_bytes=None
_NO_LIMIT = 1 << 62


class _TemplateRaised(Exception):
    """raise_exception() was called by the template."""


def _raise_exception(message: Any = "") -> None:
    raise _TemplateRaised(str(message))


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _check_strftime_now(budget: Budget, args: tuple, kwargs: dict) -> None:
    if args and isinstance(args[0], str):
        budget.expect_chars(len(args[0]) * 16)  # %c: 2 characters -> 24


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


@functools.lru_cache(maxsize=1)
def _environment() -> Sandbox:
    return bounded_environment(
        {"tojson": _tojson},
        {"raise_exception": _raise_exception, "strftime_now": _strftime_now},
        [(_strftime_now, _check_strftime_now)],
        trim_blocks=True, lstrip_blocks=True,
        extensions=["jinja2.ext.loopcontrols", _GenerationTag])


@functools.lru_cache(maxsize=32)
def _compile(template: str) -> Any:
    try:
        return _environment().from_string(template)
    except TemplateSyntaxError as e:
        raise ModelError(f"chat template does not compile: {e} (line {e.lineno})") from e
    except SecurityError as e:
        raise ModelError(f"chat template is not allowed: {e}") from e
    except TemplateError as e:
        raise ModelError(f"chat template does not compile: {e}") from e
    except RecursionError:
        raise ModelError("chat template does not compile: nested too deeply") from None


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


def _conversation_size(messages: list[dict[str, Any]], others: list[Any], limit: int) -> int:
    """UTF-8 bytes of the messages' text fields, plus about the size of everything else the
    template is given; stops counting once past ``limit``."""
    total = 0
    fields = itertools.chain.from_iterable(message.values() for message in messages)
    for value in itertools.chain(fields, others):
        total += utf8_len(value) if isinstance(value, str) else text_size(value, limit)
        if total > limit:
            break
    return total


def _bound_error(exc: Exceeded, budget: Budget) -> Exception:
    if exc.size and budget.input_size * 4 >= budget.value_cap:
        return RequestError(f"prompt too large: the chat template exceeded {exc.bound} with this "
                            "conversation; shorten the conversation or raise MOED_MAX_PROMPT_BYTES")
    return ModelError(f"chat template exceeded {exc.bound}")


def render_chat(
    template: str | None,
    messages: Sequence[Mapping[str, Any]],
    add_generation_prompt: bool = True,
    bos_token: str = "",
    eos_token: str = "",
    *,
    timeout: float | None = 5.0,
    max_bytes: int | None = 4 * 2**20,
    **extra: Any,
) -> str:
    """Render ``messages`` with the Jinja2 chat ``template`` (ChatML when it is None/empty).

    ``extra`` keywords become template variables (``tools=[...]``, ``enable_thinking=False``,
    ``reasoning_effort="low"``, ...).  ``timeout``: seconds the render may take (None: no limit).
    ``max_bytes``: the most UTF-8 bytes of text the conversation may hold and the prompt may
    reach, also the cap on any value built inside the template; None lifts the first two, and the
    cap is then 4 Mi characters or 4 times the conversation, whichever is more.  See the module
    docstring for the bounds and the errors raised.
    """
    msgs = _validate_messages(messages)
    if template is not None and not isinstance(template, str):
        raise RequestError("chat template must be a string")
    bos_token, eos_token = bos_token or "", eos_token or ""
    input_size = _conversation_size(msgs, [bos_token, eos_token, extra],
                                    _NO_LIMIT if max_bytes is None else max_bytes)
    if max_bytes is not None and input_size > max_bytes:
        raise RequestError(f"prompt too large: the conversation holds more than {max_bytes:,} "
                           "bytes of text (MOED_MAX_PROMPT_BYTES); shorten it or raise the limit")
    compiled = _compile(template or CHATML_TEMPLATE)
    variables: dict[str, Any] = {"tools": None, "documents": None}
    variables.update(extra)
    variables.update(messages=msgs, add_generation_prompt=bool(add_generation_prompt),
                     bos_token=bos_token, eos_token=eos_token)
    value_cap = max_bytes if max_bytes is not None else max(_DEFAULT_VALUE_CAP, 4 * input_size)
    budget = Budget(timeout, value_cap, input_size)
    try:
        return render(compiled, variables, budget, max_bytes)
    except Exceeded as e:
        raise _bound_error(e, budget) from None
    except _TemplateRaised as e:
        raise RequestError(f"chat template rejected the conversation: {e}") from None
    except SecurityError as e:
        raise ModelError(f"chat template tried something the sandbox forbids: {e}") from None
    except TemplateError as e:
        raise ModelError(f"chat template failed: {e}") from None
    except RecursionError:
        raise ModelError("chat template failed: recursion too deep") from None
    except MemoryError:
        raise ModelError("chat template failed: out of memory") from None
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