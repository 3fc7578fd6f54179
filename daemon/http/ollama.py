"""Ollama's API (its docs/api.md: field names, defaults and units as written there).

    GET  /  /api/version  /api/tags  /api/ps          POST /api/show
    POST /api/generate  /api/chat     NDJSON stream by default; "stream": false gives one object;
                                      a chat's reasoning in "thinking", its calls in "tool_calls"
                                      (daemon/text/reply.py), `tools` rendered by the chat template
    POST /api/embed  /api/embeddings  mean-pooled final hidden states, L2-normalized (Engine.embed)
    POST /api/pull  /api/push  /api/create            400: moed has no registry, no network
    POST /api/copy  /api/delete                       a link in the models directory (TCP: MOED_API_KEY)

Requests decode into the structs below (unknown fields are ignored, as Ollama does); options map
onto ipc.protocol.SamplingOptions with Ollama's defaults, not moed's own: temperature 0.8, top_k
40, top_p 0.9, min_p 0, repeat_penalty 1.1, repeat_last_n 64 (-1: the whole context), seed
(negative: random), num_predict -1 (to the end of the context; -2 the same: the context fills),
num_ctx (unlike the loaded model's: the model is reloaded with it). Options that would change
the meaning and that moed does not have (mirostat, typical_p, presence and frequency penalties)
are refused with 400; tuning knobs of Ollama's runner (num_gpu, num_thread, ...) are ignored.

Durations are nanoseconds; keep_alive is a Go duration or seconds (common.parse_keep_alive). An
empty prompt (or no messages) loads the model, or with keep_alive 0 unloads it.
Errors are {"error": message} with the status (common.STATUS).
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import time
from typing import Any

import msgspec
from aiohttp import web

from ipc.protocol import Chat, Done, Error, Generate, Message, SamplingOptions

from ..catalog import full_name, is_path
from ..errors import MoedError, RequestError, SchedulerError
from ..storage.card import card
from .common import (ApiError, Generation, caller, collect, encode_json, json_response, model_ref, next_id,
                     now_rfc3339, parse_keep_alive, parsed, read_body, reply_parser_for, rfc3339,
                     template_calls)

NO_LIMIT = 2**31 - 1  # num_predict -1/-2 and repeat_last_n -1: the context bounds them


class Options(msgspec.Struct, omit_defaults=True):
    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 0.9
    min_p: float = 0.0
    repeat_penalty: float = 1.1
    repeat_last_n: int = 64
    seed: int | None = None
    num_predict: int = -1
    stop: list[str] | str | None = None
    num_ctx: int | None = None
    # known to Ollama, not to moed: refused unless they are their "off" values
    mirostat: int = 0
    typical_p: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0


class OllamaMessage(msgspec.Struct):
    role: str
    content: str = ""
    images: list[str] | None = None
    tool_calls: list[Any] | None = None
    thinking: str | None = None
    tool_name: str | None = None


class GenerateRequest(msgspec.Struct):
    model: str = ""
    prompt: str = ""
    suffix: str = ""
    system: str | None = None
    template: str | None = None
    context: list[int] | None = None
    stream: bool = True
    raw: bool = False
    format: Any = None
    images: list[str] | None = None
    options: Options | None = None
    keep_alive: Any = None
    think: Any = None


class ChatRequest(msgspec.Struct):
    model: str = ""
    messages: list[OllamaMessage] = []
    tools: list[Any] | None = None
    format: Any = None
    stream: bool = True
    options: Options | None = None
    keep_alive: Any = None
    think: Any = None


class NameRequest(msgspec.Struct):
    model: str = ""
    name: str = ""  # the older field name, still sent by some clients
    verbose: bool = False

    def ref(self) -> str:
        return self.model or self.name


class EmbedRequest(msgspec.Struct):
    model: str = ""
    input: Any = None  # a string or a list of strings (/api/embed)
    prompt: str = ""  # /api/embeddings
    truncate: bool = True
    options: Options | None = None
    keep_alive: Any = None


class CopyRequest(msgspec.Struct):
    source: str
    destination: str


def error_body(status: int, message: str, kind: str) -> dict:
    return {"error": message}


# -- requests -> the scheduler -------------------------------------------------------------------

def _sampling(o: Options) -> tuple[SamplingOptions, int, dict[str, Any]]:
    """(sampling options, max_tokens, model settings) from Ollama's options."""
    unsupported = [name for name, off in (("mirostat", 0), ("typical_p", 1.0), ("presence_penalty", 0.0),
                                          ("frequency_penalty", 0.0)) if getattr(o, name) != off]
    if unsupported:
        raise ApiError(400, f"options {', '.join(unsupported)}: not supported by moed (leave them at their "
                            f"defaults)")
    if o.num_predict < -2:
        raise ApiError(400, "num_predict must be -1 (to the end of the context), -2 (fill the context) or >= 0")
    if o.repeat_last_n < -1:
        raise ApiError(400, "repeat_last_n must be -1 (the whole context) or >= 0")
    seed = o.seed if o.seed is not None and o.seed >= 0 else None
    try:
        sampling = SamplingOptions(temperature=o.temperature, top_k=o.top_k, top_p=o.top_p, min_p=o.min_p,
                                   repeat_penalty=o.repeat_penalty,
                                   repeat_last_n=NO_LIMIT if o.repeat_last_n == -1 else o.repeat_last_n, seed=seed)
    except (ValueError, TypeError) as e:
        raise ApiError(400, f"options: {e}") from None
    settings = {}
    if o.num_ctx is not None:
        if o.num_ctx < 1:
            raise ApiError(400, "num_ctx must be >= 1")
        settings["n_ctx"] = o.num_ctx
    return sampling, NO_LIMIT if o.num_predict < 0 else o.num_predict, settings


def _stop(o: Options) -> list[str]:
    return [o.stop] if isinstance(o.stop, str) else list(o.stop or [])


def _refuse(images: Any) -> None:
    if images:
        raise ApiError(400, "images: this model takes text only (moed runs no vision encoder)")


def _format(format: Any) -> str | None:
    """Ollama's format ("json", or a JSON schema object) as the scheduler takes it."""
    if format in (None, ""):
        return None
    if format == "json":
        return "json"
    if isinstance(format, dict):
        return msgspec.json.encode(format).decode()
    raise ApiError(400, 'format: expected "json" or a JSON schema object')


def _message(m: OllamaMessage) -> Message:
    """An Ollama message as the chat template reads it: calls in the function-call shape
    templates expect, a tool result's tool name as `name`."""
    if m.images:
        raise ApiError(400, "images: this model takes text only (moed runs no vision encoder)")
    calls = template_calls(m.tool_calls, '{"function": {"name": ..., "arguments": {...}}}')
    return Message(m.role, m.content, tool_calls=calls, name=m.tool_name, thinking=m.thinking)


class Routes:
    """Ollama's routes over one scheduler (and the models directory it names models from)."""

    def __init__(self, scheduler, version: str):
        self.scheduler = scheduler
        self.version = version

    def add_to(self, app: web.Application) -> None:
        r = app.router
        r.add_get("/", self.root)
        r.add_get("/api/version", self.api_version)
        r.add_get("/api/tags", self.tags)
        r.add_get("/api/ps", self.ps)
        r.add_post("/api/show", self.show)
        r.add_post("/api/generate", self.generate)
        r.add_post("/api/chat", self.chat)
        for path in ("/api/embed", "/api/embeddings"):
            r.add_post(path, self.embed)
        for path in ("/api/pull", "/api/push", "/api/create"):
            r.add_post(path, self.no_registry)
        r.add_post("/api/copy", self.copy)
        r.add_delete("/api/delete", self.delete)

    # -- plain ---------------------------------------------------------------------------------

    async def root(self, request: web.Request) -> web.Response:
        return web.Response(text="moed is running (Ollama's API)")

    async def api_version(self, request: web.Request) -> web.Response:
        return json_response({"version": self.version})

    async def tags(self, request: web.Request) -> web.Response:
        catalog = self.scheduler.catalog
        entries = catalog.entries() if catalog is not None else []
        models = await asyncio.to_thread(lambda: [_tag(e) for e in entries])
        return json_response({"models": models})

    async def ps(self, request: web.Request) -> web.Response:
        out = []
        for m in self.scheduler.ps():
            details = await asyncio.to_thread(_details, m["path"])
            out.append({"name": m["name"], "model": m["name"], "size": m["size_bytes"] + m["vram_bytes"],
                        "digest": _digest(m["path"]), "details": details,
                        "expires_at": _expires(m["expires_at"]), "size_vram": m["vram_bytes"],
                        "context_length": m.get("n_ctx", 0)})
        return json_response({"models": out})

    async def show(self, request: web.Request) -> web.Response:
        req = await read_body(request, NameRequest)
        path = self._path(request, req.ref())
        data = await asyncio.to_thread(_show, path)
        return json_response(data)

    def _path(self, request: web.Request, ref: str) -> str:
        """A model's file (the demo is built first if need be: not here, so it must exist)."""
        ref = model_ref(request, ref)
        try:
            path = self.scheduler.path_of(ref)
        except SchedulerError as e:
            raise ApiError.of(e) from None
        if path is None:
            raise ApiError(404, f"model {ref!r} is not built yet: run it once first")
        return path

    # -- generation ----------------------------------------------------------------------------

    async def generate(self, request: web.Request) -> web.StreamResponse:
        req = await read_body(request, GenerateRequest)
        model = model_ref(request, req.model)
        _refuse(req.images)
        if req.suffix:
            raise ApiError(400, "suffix: fill-in-the-middle is not supported")
        if req.template:
            raise ApiError(400, "template: moed renders the model's own chat template only")
        if req.raw and req.system:
            raise ApiError(400, "raw mode does not take a system prompt (it skips the chat template)")
        if req.context:
            raise ApiError(400, "context: continuing from returned token ids is not supported; send the text")
        keep_alive = parse_keep_alive(req.keep_alive)
        if not req.prompt and not req.system:
            return await self._load_or_unload(request, model, keep_alive, "response")
        sampling, max_tokens, settings = _sampling(req.options or Options())
        stop = _stop(req.options or Options())
        common = {"model": model, "max_tokens": max_tokens, "options": sampling, "stop": stop,
                  "keep_alive": keep_alive, "format": _format(req.format)}
        if req.system and not req.raw:
            msgs = [Message("system", req.system)] + ([Message("user", req.prompt)] if req.prompt else [])
            sreq = Chat(next_id(), msgs, **common)
        else:
            sreq = Generate(next_id(), prompt=req.prompt, raw=req.raw, **common)
        return await self._serve(request, sreq, settings, req.stream, chat=False)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        req = await read_body(request, ChatRequest)
        model = model_ref(request, req.model)
        keep_alive = parse_keep_alive(req.keep_alive)
        if not req.messages:
            return await self._load_or_unload(request, model, keep_alive, "message")
        options = req.options or Options()
        sampling, max_tokens, settings = _sampling(options)
        sreq = Chat(next_id(), [_message(m) for m in req.messages], model=model, max_tokens=max_tokens,
                    options=sampling, stop=_stop(options), keep_alive=keep_alive, format=_format(req.format),
                    tools=req.tools or None)
        parser = await reply_parser_for(self.scheduler, model)
        return await self._serve(request, sreq, settings, req.stream, chat=True, parser=parser,
                                 think=req.think is not False)

    async def _load_or_unload(self, request: web.Request, model: str, keep_alive: float | None,
                              field: str) -> web.Response:
        """An empty prompt: load the model (keep_alive 0: unload it), as Ollama does."""
        empty = {"role": "assistant", "content": ""} if field == "message" else ""
        name = model if is_path(model) else full_name(model)
        if keep_alive == 0:
            try:
                self.scheduler.path_of(model)  # a model that does not exist is 404, loaded or not
            except SchedulerError as e:
                raise ApiError.of(e) from None
            try:
                await self.scheduler.unload(model)
            except SchedulerError as e:
                if e.code != "not_found":
                    raise ApiError.of(e) from None
            return json_response({"model": name, "created_at": now_rfc3339(), field: empty, "done": True,
                          "done_reason": "unload"})
        try:
            loaded, load_ns = await self.scheduler.load(model, None, keep_alive, peer=caller(request).peer)
        except MoedError as e:
            raise ApiError.of(e) from None
        return json_response({"model": loaded.name, "created_at": now_rfc3339(), field: empty, "done": True,
                      "done_reason": "load", "load_duration": load_ns})

    async def _serve(self, request: web.Request, sreq: Generate | Chat, settings: dict, stream: bool,
                     chat: bool, parser=None, think: bool = True) -> web.StreamResponse:
        """The generation's replies as Ollama's objects; a chat's text through `parser` (reasoning
        into "thinking", calls into "tool_calls")."""
        model = sreq.model if is_path(sreq.model) else full_name(sreq.model)
        gen = Generation(self.scheduler, sreq, peer=caller(request).peer, settings=settings)

        def body(text: str, final: bool = False) -> dict:
            if not chat:
                return {"response": text}
            content, thinking, calls = parsed(parser, text, final)
            message = {"role": "assistant", "content": content}
            if thinking and think:
                message["thinking"] = thinking
            if calls:
                message["tool_calls"] = [{"function": {"name": c.name, "arguments": c.arguments}} for c in calls]
            return {"message": message}

        try:
            first = await gen.start()
            if not stream:
                text, _ids, done = await collect(gen, first)
                return json_response({**_head(model), **body(text, final=True), **_final(done)})
            resp = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
            await resp.prepare(request)
            async for reply in _chain(first, gen):
                if isinstance(reply, Error):
                    await resp.write(_line({"error": reply.message or reply.code}))
                    break
                if isinstance(reply, Done):
                    await resp.write(_line({**_head(model), **body("", final=True), **_final(reply)}))
                    break
                if reply.text:
                    part = body(reply.text)
                    if chat and not (part["message"]["content"] or len(part["message"]) > 2):
                        continue  # all held back (a marker may be starting)
                    await resp.write(_line({**_head(model), **part, "done": False}))
            await resp.write_eof()
            return resp
        finally:
            gen.cancel()

    # -- embeddings, registry, management ------------------------------------------------------

    async def embed(self, request: web.Request) -> web.Response:
        """/api/embed ({"input": text or [texts]} -> "embeddings"), and the older /api/embeddings
        ({"prompt": text} -> "embedding")."""
        t0 = time.perf_counter_ns()
        legacy = request.path == "/api/embeddings"
        req = await read_body(request, EmbedRequest)
        model = model_ref(request, req.model)
        texts = [req.prompt] if legacy else ([req.input] if isinstance(req.input, str) else req.input)
        if not isinstance(texts, list) or not all(isinstance(t, str) for t in texts):
            raise ApiError(400, "input: expected a string or a list of strings")
        if not texts:
            raise ApiError(400, "input must not be empty")
        settings = _sampling(req.options or Options())[2]
        try:
            vectors, count, load_ns = await self.scheduler.embed(
                model, texts, truncate=req.truncate, keep_alive=parse_keep_alive(req.keep_alive),
                peer=caller(request).peer, settings=settings)
        except MoedError as e:
            raise ApiError.of(e) from None
        if legacy:
            return json_response({"embedding": vectors[0].tolist()})
        return json_response({"model": self.scheduler.label(model, model), "embeddings": vectors.tolist(),
                      "total_duration": time.perf_counter_ns() - t0, "load_duration": load_ns,
                      "prompt_eval_count": count})

    async def no_registry(self, request: web.Request) -> web.Response:
        raise ApiError(400, "moed has no model registry and no network: add a local GGUF file with "
                            "`moed import PATH [--name NAME]`")

    async def copy(self, request: web.Request) -> web.Response:
        caller(request).manage()
        req = await read_body(request, CopyRequest)
        src = self._path(request, req.source)
        try:
            self.scheduler.catalog.import_model(src, req.destination)
        except (RequestError, SchedulerError) as e:
            raise ApiError.of(e) from None
        return web.Response()

    async def delete(self, request: web.Request) -> web.Response:
        caller(request).manage()
        req = await read_body(request, NameRequest)
        ref = model_ref(request, req.ref())
        if is_path(ref):
            raise ApiError(400, f"{ref!r}: delete takes a model name")
        try:
            self.scheduler.catalog.remove(ref)
        except (RequestError, SchedulerError) as e:
            raise ApiError.of(e) from None
        return web.Response()


# -- bodies ------------------------------------------------------------------------------------------

def _line(body: Any) -> bytes:
    return encode_json(body) + b"\n"


async def _chain(first, gen: Generation):
    yield first
    if not isinstance(first, Done):
        async for reply in gen:
            yield reply


def _head(model: str) -> dict:
    return {"model": model, "created_at": now_rfc3339()}


def _final(done: Done) -> dict:
    return {"done": True, "done_reason": done.done_reason, "total_duration": done.total_duration,
            "load_duration": done.load_duration, "prompt_eval_count": done.prompt_eval_count,
            "prompt_eval_duration": done.prompt_eval_duration, "eval_count": done.eval_count,
            "eval_duration": done.eval_duration}


def _digest(path: str) -> str:
    """A stable id of a model file (its path, size and time: hashing 30 GB is not an option)."""
    try:
        st = os.stat(path)
        key = f"{os.path.realpath(path)}\0{st.st_size}\0{st.st_mtime_ns}"
    except OSError:
        key = path
    return hashlib.sha256(key.encode()).hexdigest()


def _expires(at: float | None) -> str:
    return rfc3339(at) if at is not None else "0001-01-01T00:00:00Z"


def _tag(entry) -> dict:
    return {"name": entry.name, "model": entry.name, "modified_at": rfc3339(entry.modified), "size": entry.size,
            "digest": _digest(str(entry.path)), "details": _details(str(entry.path))}


def _details(path: str) -> dict:
    """Ollama's "details" of a model file (empty where the header cannot be read)."""
    try:
        c = card(path)
    except (OSError, MoedError):
        return {"format": "gguf"}
    return {"parent_model": "", "format": "gguf", "family": c.arch, "families": [c.arch],
            "parameter_size": c.parameter_size, "quantization_level": c.quantization}


def _show(path: str) -> dict:
    try:
        c = card(path)
    except OSError as e:
        raise ApiError(404, f"{path}: {e.strerror}") from None
    except MoedError as e:
        raise ApiError(400, str(e)) from None
    return {"license": str(c.metadata.get("general.license", "")), "modelfile": "",
            "parameters": "", "template": c.chat_template, "details": _details(path),
            "model_info": {**c.metadata, "general.parameter_count": c.parameters,
                           f"{c.arch}.context_length": c.context_length},
            "capabilities": ["completion"], "modified_at": rfc3339(os.stat(path).st_mtime)}
