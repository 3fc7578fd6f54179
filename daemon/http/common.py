"""What the Ollama and OpenAI routes share: request bodies, errors, model references, and one
generation through the scheduler as an async stream of its replies.

    ApiError(status, message, kind)    raised by a route; the server's middleware writes it in the
                                       route's API shape (ollama.error_body / openai.error_body)
    read_body(request, Struct)         the JSON body decoded and checked by msgspec -> 400 / 413
    CALLER                             request[CALLER]: who asks (Caller: over TCP or not, the peer)
    model_ref(request, value)          a model reference as this listener may use it (TCP: names only)
    Generation(scheduler, req, ...)    scheduler.generate on a task; `await start()` waits for the
                                       first token (errors before it become ApiError), then iterate
    parse_keep_alive(value)            Ollama's keep_alive (a Go duration string, or seconds) -> s
"""

from __future__ import annotations

import asyncio
import itertools
import json
import math
import re
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import msgspec
from aiohttp import web

from ipc.protocol import Chat, Chunk, Done, Error, Generate, Progress

from ..catalog import is_path
from ..errors import wire_error

# An HTTP status for each of the scheduler's error codes (ipc.protocol "Error codes").
STATUS = {"bad_request": 400, "not_found": 404, "forbidden": 403, "busy": 503, "shutdown": 503,
          "model_error": 500, "cancelled": 499, "internal": 500, "bad_frame": 400}

_ids = itertools.count(1)  # request ids for the scheduler (replies are routed by them)


@dataclass(frozen=True)
class Caller:
    """Who sent a request, as the server admitted it."""

    tcp: bool  # over TCP: no peer credentials; model names only
    peer: Any = None  # on the unix socket: its PeerCred (the scheduler checks its access); None over TCP
    manage: Callable[[], None] = lambda: None  # raises ApiError unless it may copy or delete models


CALLER = web.RequestKey("caller", Caller)


def caller(request: web.Request) -> Caller:
    return request[CALLER]


class ApiError(Exception):
    """A request that fails with an HTTP status; `kind` is OpenAI's error type."""

    def __init__(self, status: int, message: str, kind: str | None = None):
        super().__init__(message)
        self.status = status
        self.kind = kind or ("invalid_request_error" if status < 500 else "server_error")

    @classmethod
    def of(cls, e: BaseException) -> ApiError:
        """The ApiError for a scheduler failure or a reply's Error."""
        if isinstance(e, ApiError):
            return e
        code, message = (e.code, e.message) if isinstance(e, Error) else wire_error(e)
        return cls(STATUS.get(code, 500), message or code)


encode_json = msgspec.json.Encoder().encode


def json_response(body: Any, status: int = 200) -> web.Response:
    return web.Response(body=encode_json(body), status=status, content_type="application/json")


def next_id() -> int:
    return next(_ids)


async def read_body(request: web.Request, kind: type) -> Any:
    """The request's JSON body as `kind` (a msgspec Struct). 413 past the size limit, 400 for bad
    JSON, a wrong type or a bad value (msgspec's message names the field)."""
    raw = await request.read()  # past client_max_size: HTTPRequestEntityTooLarge, a 413 (server.py)
    if not raw.strip():
        raise ApiError(400, "the request needs a JSON body")
    try:
        return msgspec.json.decode(raw, type=kind)
    except msgspec.ValidationError as e:
        raise ApiError(400, f"invalid request: {e}") from None
    except msgspec.DecodeError as e:
        raise ApiError(400, f"the body is not valid JSON: {e}") from None


def model_ref(request: web.Request, value: str | None) -> str:
    """A request's model as the scheduler takes it: required; over TCP a name, never a path (any
    local user can reach TCP, and the daemon would read the file for them)."""
    if not value:
        raise ApiError(400, "model is required")
    if is_path(value) and request[CALLER].tcp:
        raise ApiError(400, f"{value!r}: over TCP a model is named, never given as a path (paths are "
                            f"taken on the unix sockets only; `moed import PATH` names a file)")
    return value


_DURATION = re.compile(r"([0-9]*\.?[0-9]+)(ns|us|µs|ms|s|m|h)")
_UNIT_S = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}


def parse_keep_alive(value: Any) -> float | None:
    """Ollama's keep_alive: seconds as a number, or a Go duration ("5m", "1h30m", "-1s"); a
    negative value keeps the model loaded forever (-1), 0 unloads it at once. None: the daemon's
    default. ApiError 400 for anything else."""
    if value is None:
        return None
    if isinstance(value, bool):
        raise ApiError(400, "keep_alive: expected a duration (\"5m\") or seconds")
    if isinstance(value, (int, float)):
        seconds = float(value)
    elif isinstance(value, str):
        text = value.strip()
        sign, body = (-1.0, text[1:]) if text.startswith("-") else (1.0, text.removeprefix("+"))
        try:
            seconds = sign * float(body)  # a bare number: seconds
        except ValueError:
            parts = _DURATION.findall(body)
            if not body or "".join(n + u for n, u in parts) != body:
                raise ApiError(400, f"keep_alive: {value!r} is not a duration "
                                    f"(e.g. \"5m\", \"1h30m\", \"-1\")") from None
            seconds = sign * sum(float(n) * _UNIT_S[u] for n, u in parts)
    else:
        raise ApiError(400, "keep_alive: expected a duration (\"5m\") or seconds")
    if not math.isfinite(seconds):
        raise ApiError(400, "keep_alive must be finite")
    return -1.0 if seconds < 0 else min(seconds, 1e9)


def now_rfc3339() -> str:
    """The time now as Ollama writes created_at."""
    return rfc3339(time.time())


def rfc3339(seconds: float) -> str:
    """RFC 3339, UTC, microseconds."""
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(seconds)) + f".{int(seconds % 1 * 1e6):06d}Z"


_END = object()


class Generation:
    """One Generate/Chat through the scheduler: what the HTTP routes stream from.

        gen = Generation(scheduler, req, peer=..., settings=...)
        first = await gen.start()       # the first Chunk or the Done; ApiError if it failed first
        async for reply in gen: ...     # the later Chunks, then the Done (an Error mid-stream:
                                        # the reply itself, for the route to write in its shape)
        gen.cancel()                    # in a finally: the sequence stops within one step

    Progress replies (a model loading) are dropped: neither API has them for a generation."""

    def __init__(self, scheduler, req: Generate | Chat, *, peer=None, settings: dict[str, Any] | None = None):
        self.queue: asyncio.Queue = asyncio.Queue()
        self.task = asyncio.get_running_loop().create_task(
            scheduler.generate(req, self._put, time.perf_counter_ns(), peer=peer, settings=settings))
        self.task.add_done_callback(lambda _t: self.queue.put_nowait(_END))
        self.done: Done | None = None

    def _put(self, reply) -> None:
        if not isinstance(reply, Progress):
            self.queue.put_nowait(reply)

    async def _next(self):
        reply = await self.queue.get()
        if reply is _END:
            self.queue.put_nowait(_END)  # every later call sees the end too
            exc = None if self.task.cancelled() else self.task.exception()
            if exc is not None:
                raise ApiError.of(exc)
            raise ApiError(500, "the generation ended without a final reply")
        if isinstance(reply, Done):
            self.done = reply
        return reply

    async def start(self) -> Chunk | Done:
        """Wait for the first Chunk (or the Done of an empty one); ApiError if it fails first."""
        reply = await self._next()
        if isinstance(reply, Error):
            raise ApiError.of(reply)
        return reply

    async def __aiter__(self) -> AsyncIterator[Chunk | Done | Error]:
        while self.done is None:
            try:
                reply = await self._next()
            except ApiError as e:
                yield Error(0, "internal", str(e))
                return
            yield reply
            if isinstance(reply, Error):
                return

    def cancel(self) -> None:
        if not self.task.done():
            self.task.cancel()


async def collect(gen: Generation, first: Chunk | Done) -> tuple[str, list[int], Done]:
    """A whole generation's text, token ids and Done (for "stream": false); ApiError for an Error."""
    parts, ids = [], []
    reply = first
    while True:
        if isinstance(reply, Error):
            raise ApiError.of(reply)
        if isinstance(reply, Done):
            return "".join(parts), ids, reply
        parts.append(reply.text)
        ids.extend(reply.tokens)
        reply = await gen._next()


async def reply_parser_for(scheduler, ref: str):
    """The parser of a chat model's replies (daemon/text/reply.py), by its file's header; plain
    text for the demo or a file that cannot be read (its load reports that)."""
    from ..storage.card import card
    from ..text.reply import PlainReply, reply_parser

    try:
        path = scheduler.path_of(ref)
        if path is None:
            return PlainReply()
        c = await asyncio.to_thread(card, path)
    except Exception:  # noqa: BLE001 - the generation itself will say what is wrong
        return PlainReply()
    return reply_parser(c.arch, c.chat_template)


def parsed(parser, text: str, final: bool = False) -> tuple[str, str, list]:
    """(content, thinking, tool calls) of the text fed now (and of what was held, when final)."""
    from ..text.reply import CONTENT, THINKING

    events = parser.feed(text) + (parser.finish() if final else [])
    content = "".join(v for k, v in events if k == CONTENT)
    thinking = "".join(v for k, v in events if k == THINKING)
    return content, thinking, [v for k, v in events if k not in (CONTENT, THINKING)]


def template_calls(calls: list | None, shape: str) -> list[dict] | None:
    """A message's tool calls as chat templates read them: {"type": "function", "function":
    {"name", "arguments": {...}}} (and OpenAI's "id"). `shape` names the API in the error;
    OpenAI's arguments come as a JSON string and are parsed."""
    if not calls:
        return None
    out = []
    for c in calls:
        f = c.get("function") if isinstance(c, dict) else None
        if not isinstance(f, dict) or not isinstance(f.get("name"), str):
            raise ApiError(400, f"tool_calls: each is {shape}")
        args = f.get("arguments") or {}
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except json.JSONDecodeError:
                raise ApiError(400, f"tool_calls: the arguments of {f['name']!r} are not JSON") from None
        call = {"type": "function", "function": {"name": f["name"], "arguments": args}}
        out.append({"id": c["id"], **call} if c.get("id") is not None else call)
    return out
