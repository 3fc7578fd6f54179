"""OpenAI's API, the part a local runner can serve (as its API reference names the fields).

    POST /v1/chat/completions   chat.completion, or SSE chat.completion.chunk events; reasoning in
                                reasoning_content, calls in tool_calls (daemon/text/reply.py);
                                tool_choice "required" or a function: the reply is held to one
                                call by a grammar (<tool_call> templates and gpt-oss)
    POST /v1/completions        text_completion, or SSE text_completion events
    GET  /v1/models  /v1/models/{id}
    POST /v1/embeddings         mean-pooled final hidden states, L2-normalized; float or base64

A stream is `data: {json}` events ending in `data: [DONE]`; `usage` comes in the response, and in
a stream as a last chunk with no choices when `stream_options.include_usage` asks for it.
Sampling: temperature (default 1) and top_p (default 1) as OpenAI; seed; stop (a string or up to
4); max_tokens / max_completion_tokens (chat default: to the end of the context; completions: 16,
as OpenAI). llama.cpp's extensions top_k, min_p and repeat_penalty are taken too (defaults 40,
0.05, 1.0 as llama.cpp's server).
Fields that would change the meaning and are not served (n > 1, logit_bias, logprobs, echo,
suffix, best_of, penalties, images) get a 400; harmless
ones (user, metadata, store, service_tier, ...) are ignored, as LangChain and Open WebUI send them.
Errors are OpenAI's object: {"error": {"message", "type", "param", "code"}}.
"""

from __future__ import annotations

import base64
import json
import secrets
import time
from typing import Any

import msgspec
from aiohttp import web

from ipc.protocol import Chat, Done, Error, Generate, Message, SamplingOptions

from ..catalog import full_name, is_path
from ..errors import MoedError
from ..grammar import tool_call_format
from ..text.reply import HarmonyReply, HermesReply
from .common import (ApiError, Generation, caller, collect, encode_json, json_response, model_ref, next_id, parsed,
                     read_body, reply_parser_for, template_calls)

NO_LIMIT = 2**31 - 1
MAX_STOP = 4  # OpenAI's limit


class StreamOptions(msgspec.Struct):
    include_usage: bool = False


class _Sampling(msgspec.Struct, kw_only=True):
    model: str = ""
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    max_tokens: int | None = None
    n: int = 1
    logit_bias: dict[str, float] | None = None
    logprobs: Any = None
    top_logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # llama.cpp's server takes these too
    top_k: int | None = None
    min_p: float | None = None
    repeat_penalty: float | None = None


class ChatMessage(msgspec.Struct):
    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[Any] | None = None
    tool_call_id: str | None = None


class ChatRequest(_Sampling, kw_only=True):
    messages: list[ChatMessage] = []
    max_completion_tokens: int | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    response_format: dict[str, Any] | None = None


class CompletionRequest(_Sampling, kw_only=True):
    prompt: Any = ""  # a string, a list of one string, or token ids
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None


class EmbeddingsRequest(msgspec.Struct):
    model: str = ""
    input: Any = None
    encoding_format: str = "float"
    dimensions: int | None = None
    user: str | None = None


def error_body(status: int, message: str, kind: str) -> dict:
    return {"error": {"message": message, "type": kind, "param": None, "code": None}}


def _options(req: _Sampling) -> SamplingOptions:
    refused = [name for name, bad in (("n", req.n != 1), ("logit_bias", bool(req.logit_bias)),
                                      ("logprobs", req.logprobs not in (None, False, 0)),
                                      ("top_logprobs", bool(req.top_logprobs)),
                                      ("presence_penalty", req.presence_penalty != 0),
                                      ("frequency_penalty", req.frequency_penalty != 0)) if bad]
    if refused:
        raise ApiError(400, f"{', '.join(refused)}: not supported by moed (one choice, no log "
                            f"probabilities, no logit bias or presence/frequency penalties)")
    seed = req.seed if req.seed is not None and req.seed >= 0 else None
    try:
        return SamplingOptions(temperature=1.0 if req.temperature is None else req.temperature,
                               top_p=1.0 if req.top_p is None else req.top_p,
                               top_k=40 if req.top_k is None else req.top_k,
                               min_p=0.05 if req.min_p is None else req.min_p,
                               repeat_penalty=1.0 if req.repeat_penalty is None else req.repeat_penalty,
                               seed=seed)
    except (ValueError, TypeError) as e:
        raise ApiError(400, str(e)) from None


def _stop(req: _Sampling) -> list[str]:
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    if len(stop) > MAX_STOP:
        raise ApiError(400, f"stop: at most {MAX_STOP} sequences")
    return stop


def _max_tokens(value: int | None, default: int) -> int:
    if value is None:
        return default
    if value < 0:
        raise ApiError(400, "max_tokens must be >= 0")
    return value


def _text(m: ChatMessage) -> str:
    if m.content is None or isinstance(m.content, str):
        return m.content or ""
    parts = []
    for part in m.content:
        kind = part.get("type")
        if kind == "text" and isinstance(part.get("text"), str):
            parts.append(part["text"])
        else:
            raise ApiError(400, f"message content of type {kind!r}: this model takes text only")
    return "".join(parts)


def _forced_tool(choice: Any, tools: list | None) -> str | None | bool:
    """False: no call is forced ("auto", "none", none given); None: one of the tools must be called
    ("required"); a name: that function."""
    if choice in (None, "auto", "none"):
        return False
    if not tools:
        raise ApiError(400, "tool_choice: no tools are given")
    if choice == "required":
        return None
    f = choice.get("function") if isinstance(choice, dict) else None
    if isinstance(f, dict) and isinstance(f.get("name"), str):
        return f["name"]
    raise ApiError(400, "tool_choice: \"auto\", \"none\", \"required\" or {\"type\": \"function\", "
                        "\"function\": {\"name\": ...}}")


def _response_format(rf: dict[str, Any] | None) -> str | None:
    """OpenAI's response_format as the scheduler's format: text (none), json_object ("json"), or
    json_schema (its schema's text)."""
    kind = (rf or {}).get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return "json"
    if kind == "json_schema":
        spec = rf.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise ApiError(400, "response_format: json_schema needs "
                                "{\"json_schema\": {\"name\": ..., \"schema\": {...}}}")
        return msgspec.json.encode(schema).decode()
    raise ApiError(400, f"response_format: type {kind!r} (text, json_object or json_schema)")


_ROLES = {"developer": "system"}  # OpenAI's newer name for the system role


def _message(m: ChatMessage) -> Message:
    """An OpenAI message as chat templates read it: a call's arguments as an object (they come as
    a JSON string), a tool result's call id."""
    calls = template_calls(m.tool_calls, '{"type": "function", "function": {"name": ..., "arguments": "..."}}')
    return Message(_ROLES.get(m.role, m.role), _text(m), tool_calls=calls, tool_call_id=m.tool_call_id, name=m.name)


class Routes:
    def __init__(self, scheduler):
        self.scheduler = scheduler

    def add_to(self, app: web.Application) -> None:
        r = app.router
        r.add_post("/v1/chat/completions", self.chat)
        r.add_post("/v1/completions", self.completions)
        r.add_get("/v1/models", self.models)
        r.add_get("/v1/models/{model:.+}", self.model)
        r.add_post("/v1/embeddings", self.embeddings)

    async def models(self, request: web.Request) -> web.Response:
        catalog = self.scheduler.catalog
        entries = catalog.entries() if catalog is not None else []
        return json_response({"object": "list", "data": [_model(e.name, e.modified) for e in entries]})

    async def model(self, request: web.Request) -> web.Response:
        name = request.match_info["model"]
        catalog = self.scheduler.catalog
        entries = {e.name: e for e in (catalog.entries() if catalog is not None else [])}
        try:
            entry = entries.get(full_name(name))
        except Exception:  # noqa: BLE001 - not a name: no such model
            entry = None
        if entry is None:
            raise ApiError(404, f"the model {name!r} does not exist", "invalid_request_error")
        return json_response(_model(entry.name, entry.modified))

    async def embeddings(self, request: web.Request) -> web.Response:
        req = await read_body(request, EmbeddingsRequest)
        model = model_ref(request, req.model)
        texts = [req.input] if isinstance(req.input, str) else req.input
        if not isinstance(texts, list) or not texts or not all(isinstance(t, str) for t in texts):
            raise ApiError(400, "input: expected a string or a non-empty list of strings (token ids are not taken)")
        if req.encoding_format not in ("float", "base64"):
            raise ApiError(400, "encoding_format: expected float or base64")
        try:
            vectors, count, _load_ns = await self.scheduler.embed(model, texts, peer=caller(request).peer)
        except MoedError as e:
            raise ApiError.of(e) from None
        if req.dimensions is not None and req.dimensions != vectors.shape[1]:
            raise ApiError(400, f"dimensions: this model's embeddings have {vectors.shape[1]}")
        if req.encoding_format == "base64":  # little-endian float32, as OpenAI's
            data = [base64.b64encode(v.astype("<f4").tobytes()).decode() for v in vectors]
        else:
            data = vectors.tolist()
        return json_response({"object": "list", "model": model if is_path(model) else full_name(model),
                      "data": [{"object": "embedding", "index": i, "embedding": e} for i, e in enumerate(data)],
                      "usage": {"prompt_tokens": count, "total_tokens": count}})

    async def chat(self, request: web.Request) -> web.StreamResponse:
        req = await read_body(request, ChatRequest)
        model = model_ref(request, req.model)
        tools = req.tools or None
        forced = _forced_tool(req.tool_choice, tools)
        if req.tool_choice == "none":
            tools = None

        if not req.messages:
            raise ApiError(400, "messages must not be empty")
        msgs = [_message(m) for m in req.messages]
        limit = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        parser = await reply_parser_for(self.scheduler, model)
        format = _response_format(req.response_format)
        if forced is not False:  # "required", or a function named: the reply is held to a call
            style = "hermes" if isinstance(parser, HermesReply) else "harmony" if isinstance(parser, HarmonyReply) \
                else None
            if style is None:
                raise ApiError(400, "tool_choice: a forced call needs a model whose calls moed knows how to write "
                                    "(<tool_call> templates such as Qwen3's, or gpt-oss); use \"auto\"")
            if format is not None:
                raise ApiError(400, "tool_choice and response_format cannot both constrain the reply")
            try:
                format = tool_call_format(tools, forced, style)
            except MoedError as e:
                raise ApiError(400, str(e)) from None
        sreq = Chat(next_id(), msgs, model=model, max_tokens=_max_tokens(limit, NO_LIMIT), options=_options(req),
                    stop=_stop(req), format=format, tools=tools)
        return await self._serve(request, sreq, req, chat=True, parser=parser)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        req = await read_body(request, CompletionRequest)
        model = model_ref(request, req.model)
        if req.echo or req.suffix or (req.best_of or 1) != 1:
            raise ApiError(400, "echo, suffix and best_of are not supported by moed")
        kw = {"model": model, "max_tokens": _max_tokens(req.max_tokens, 16), "options": _options(req),
              "stop": _stop(req), "raw": True}
        prompt = req.prompt
        if isinstance(prompt, list) and prompt and all(type(p) is int for p in prompt):
            sreq = Generate(next_id(), tokens=list(prompt), **kw)
        else:
            if isinstance(prompt, list) and len(prompt) == 1:
                prompt = prompt[0]
            if not isinstance(prompt, str):
                raise ApiError(400, "prompt: expected a string, a list of one string, or a list of token ids "
                                    "(one prompt per request)")
            sreq = Generate(next_id(), prompt=prompt, **kw)
        return await self._serve(request, sreq, req, chat=False)

    async def _serve(self, request: web.Request, sreq: Generate | Chat, req: _Sampling,
                     chat: bool, parser=None) -> web.StreamResponse:
        model = sreq.model if is_path(sreq.model) else full_name(sreq.model)
        ident = ("chatcmpl-" if chat else "cmpl-") + f"{sreq.id:x}{time.time_ns() & 0xFFFFFFFF:08x}"
        head = {"id": ident, "object": "chat.completion.chunk" if chat else "text_completion",
                "created": int(time.time()), "model": model}
        gen = Generation(self.scheduler, sreq, peer=caller(request).peer)
        try:
            first = await gen.start()
            calls = 0  # tool calls given out
            if not req.stream:
                text, _ids, done = await collect(gen, first)
                if chat:
                    content, thinking, found = parsed(parser, text, final=True)
                    message = {"role": "assistant", "content": content if content or not found else None}
                    if thinking:
                        message["reasoning_content"] = thinking
                    if found:
                        message["tool_calls"] = [_tool_call(c, None) for c in found]
                    choice = {"index": 0, "message": message}
                else:
                    choice = {"index": 0, "text": text, "logprobs": None}
                choice["finish_reason"] = "tool_calls" if chat and found else done.done_reason
                return json_response({**head, "object": "chat.completion" if chat else "text_completion",
                              "choices": [choice], "usage": _usage(done)})
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
            await resp.prepare(request)
            if chat:  # the role comes first, in a delta of its own, as OpenAI sends it
                await resp.write(_event({**head, "choices": [_delta({"role": "assistant", "content": ""}, None)]}))
            reply = first
            while True:
                if isinstance(reply, Error):
                    await resp.write(_event(error_body(500, reply.message or reply.code, "server_error")))
                    break
                if isinstance(reply, Done):
                    if chat:
                        calls = await self._deltas(resp, head, parser, "", calls, final=True)
                    reason = "tool_calls" if calls else reply.done_reason
                    end = _delta({}, reason) if chat else _choice("", reason)
                    await resp.write(_event({**head, "choices": [end]}))
                    if req.stream_options is not None and req.stream_options.include_usage:
                        await resp.write(_event({**head, "choices": [], "usage": _usage(reply)}))
                    break
                if reply.text and chat:
                    calls = await self._deltas(resp, head, parser, reply.text, calls)
                elif reply.text:
                    await resp.write(_event({**head, "choices": [_choice(reply.text, None)]}))
                reply = await _next(gen)
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
            return resp
        finally:
            gen.cancel()


    @staticmethod
    async def _deltas(resp, head: dict, parser, text: str, calls: int, final: bool = False) -> int:
        """A chat's text as deltas: content, reasoning_content, each tool call whole (index
        `calls` on); -> the tool calls given out so far."""
        content, thinking, found = parsed(parser, text, final)
        if thinking:
            await resp.write(_event({**head, "choices": [_delta({"reasoning_content": thinking}, None)]}))
        if content:
            await resp.write(_event({**head, "choices": [_delta({"content": content}, None)]}))
        for c in found:
            await resp.write(_event({**head, "choices": [_delta({"tool_calls": [_tool_call(c, calls)]}, None)]}))
            calls += 1
        return calls


def _tool_call(c, index: int | None) -> dict:
    """A parsed call as OpenAI writes one (arguments as a JSON string); index in a stream's delta."""
    out = {"id": "call_" + secrets.token_hex(12), "type": "function",
           "function": {"name": c.name, "arguments": json.dumps(c.arguments, ensure_ascii=False)}}
    return out if index is None else {"index": index, **out}


async def _next(gen: Generation):
    try:
        return await gen._next()
    except ApiError as e:
        return Error(0, "internal", str(e))


def _event(body: Any) -> bytes:
    return b"data: " + encode_json(body) + b"\n\n"


def _delta(delta: dict, finish: str | None) -> dict:
    return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}


def _choice(text: str, finish: str | None) -> dict:
    return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}


def _usage(done: Done) -> dict:
    return {"prompt_tokens": done.prompt_eval_count, "completion_tokens": done.eval_count,
            "total_tokens": done.prompt_eval_count + done.eval_count}


def _model(name: str, modified: float) -> dict:
    return {"id": name, "object": "model", "created": int(modified), "owned_by": "moed"}
