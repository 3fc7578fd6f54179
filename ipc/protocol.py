"""The moed wire protocol: msgspec Structs in one tagged union per direction.

Wire format
    frame    u32 big-endian body length, then the body (ipc.framing; at most 16 MiB by default)
    body     msgpack array [tag, field1, field2, ...]: fields in declaration order (array_like)
    tags     one character; requests upper case, replies lower case, so a frame decoded in the
             wrong direction fails as an unknown tag

Conversation
    - A connection starts with Hello(id, protocol). The daemon answers HealthReply, or
      Error(code="bad_version") and closes. Hello's layout never changes, whatever the version.
    - Every request carries `id`, chosen by the client and unique on its connection (the client
      library counts from 1). Every reply carries the id of the request it answers, so any number
      of requests, concurrent generations included, share one connection.
    - Generate and Chat answer zero or more Chunk, then exactly one Done or Error. Cancel(id)
      names a running Generate/Chat and has no reply of its own: that stream ends with
      Error(code="cancelled"), or with its Done if it finished first; an unknown id is ignored.
      Every other request gets exactly one reply (see REPLIES).
    - A Generate, Chat or Load that waits for work before it can be served (building the demo
      model, loading the model, compiling kernels on a fresh machine) may first get any number of
      Progress(id, phase, percent, message), as Ollama streams a pull's progress. They are
      advisory: the daemon sends only the latest when they come faster than it writes.
    - A body that does not decode gets Error(id, code) with the id when it can be read
      (ProtocolError.request_id), else id=None, and the connection goes on. After FrameTooLarge
      or TruncatedFrame the stream is out of sync: Error(None, "bad_frame"), then close.

Error codes (Error.code)
    bad_frame    not a frame / not msgpack        bad_request  valid msgpack, not a valid request
    bad_version  Hello's protocol not spoken      busy         the request queue, this connection's
                                                               share of it, or the connections are full
    not_found    no such model (file or loaded)   model_error  the model failed to load or run
    cancelled    stopped by Cancel                shutdown     the daemon is stopping
    forbidden    the peer's uid may not connect,  internal     a bug in the daemon
                 or may not make this request

Evolution: requests forbid unknown (extra trailing) fields, so the daemon never silently ignores
something it does not implement; replies tolerate them, so an older client reads a newer daemon.
New fields go at the end, with a default; any other change bumps PROTOCOL_VERSION.

Limits: a frame is at most 16 MiB (ipc.framing.MAX_FRAME); a Generate's or Chat's stop list
holds at most STOP_MAX_COUNT (64) strings of STOP_MAX_BYTES (4 KiB) of UTF-8 in all, else
bad_request (empty strings count, and are ignored as llama.cpp's server ignores them).

Units: durations are int nanoseconds; keep_alive is float seconds (None = the daemon's default,
5 minutes; 0 = unload when idle; < 0 = never unload); expires_at is unix seconds.
"""

from __future__ import annotations

import math
from typing import Annotated, Any

import msgspec

from .errors import ProtocolError

PROTOCOL_VERSION = 3  # 2: the Progress reply (a version-1 client fails on its unknown tag); 3: format, tools

__all__ = [
    "PROTOCOL_VERSION",
    "REPLIES",
    "Cancel",
    "Chat",
    "Chunk",
    "Done",
    "Error",
    "Generate",
    "Health",
    "HealthReply",
    "Hello",
    "Load",
    "Loaded",
    "Message",
    "ModelInfo",
    "Ok",
    "ProtocolError",
    "Ps",
    "Progress",
    "PsReply",
    "Reply",
    "Request",
    "SEED_LIMIT",
    "STOP_MAX_BYTES",
    "STOP_MAX_COUNT",
    "SamplingOptions",
    "Shutdown",
    "Stats",
    "StatsReply",
    "Unload",
    "decode_reply",
    "decode_request",
    "encode",
]

# omit_defaults is a no-op for array_like structs in msgspec 0.22 (the whole array is sent);
# kept so the config matches the project's IPC habit and a switch to maps stays compact.
_REQ = {"array_like": True, "omit_defaults": True, "forbid_unknown_fields": True}
_REP = {"array_like": True, "omit_defaults": True}


# -- nested values ------------------------------------------------------------------------------

SEED_LIMIT = 2**64  # seeds are 0..2**64-1: what msgpack carries as an unsigned int
# A stop list real clients live with (they send a handful; OpenAI's API takes at most 4); the bounds
# keep a request from making the matcher's automaton (and the decoder's work) large.
STOP_MAX_COUNT = 64
STOP_MAX_BYTES = 4096  # UTF-8 bytes of all the strings together
# The wire decoder refuses a longer array as it reads its length, before building its strings.
StopList = Annotated[list[str], msgspec.Meta(max_length=STOP_MAX_COUNT)]


def _check_stop(stop: list[str]) -> None:
    """ValueError unless stop is within the bounds (the decoder checked the count already)."""
    if len(stop) > STOP_MAX_COUNT:
        raise ValueError(f"stop: at most {STOP_MAX_COUNT} strings")
    if sum(len(s.encode("utf-8", "surrogatepass")) for s in stop) > STOP_MAX_BYTES:
        raise ValueError(f"stop: at most {STOP_MAX_BYTES} bytes of UTF-8 in all")


class SamplingOptions(msgspec.Struct, kw_only=True, frozen=True):
    """How the next token is drawn (daemon.sampling.Sampler). The same struct in process and on
    the wire (a msgpack map of its non-default fields)."""

    temperature: float = 0.8  # 0 = greedy
    top_k: int = 40  # 0 = off
    top_p: float = 0.95  # 1 = off
    min_p: float = 0.05  # 0 = off
    repeat_penalty: float = 1.1  # 1 = off
    repeat_last_n: int = 64
    seed: int | None = None  # None = a fresh random seed; else 0..2**64-1

    def __post_init__(self):  # ValueError: bad_request on decode (msgspec's ValidationError)
        floats = (self.temperature, self.top_p, self.min_p, self.repeat_penalty)
        if any(isinstance(v, float) and not math.isfinite(v) for v in floats):
            raise ValueError("sampling options must be finite")
        checks = (
            (self.temperature >= 0, "temperature must be >= 0"),
            (self.top_k >= 0, "top_k must be >= 0"),
            (0 < self.top_p <= 1, "top_p must be in (0, 1]"),
            (0 <= self.min_p <= 1, "min_p must be in [0, 1]"),
            (self.repeat_penalty > 0, "repeat_penalty must be > 0"),
            (self.repeat_last_n >= 0, "repeat_last_n must be >= 0"),
            (self.seed is None or 0 <= self.seed < SEED_LIMIT, f"seed must be an integer in 0..{SEED_LIMIT - 1}"),
        )
        for ok, message in checks:
            if not ok:
                raise ValueError(message)


class Message(msgspec.Struct, **_REQ):
    role: str  # "system" | "user" | "assistant" | "tool"
    content: str
    # an assistant's calls: [{"type": "function", "function": {"name": ..., "arguments": {...}}}]
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None  # a tool message: the call it answers
    name: str | None = None  # a tool message: the tool's name
    thinking: str | None = None  # an assistant's reasoning, for templates that show it


class ModelInfo(msgspec.Struct, **_REP):
    name: str  # as given to Load (usually the path)
    path: str = ""  # resolved file path
    arch: str = ""  # GGUF general.architecture
    size_bytes: int = 0  # resident non-expert weights + KV caches
    expert_cache_bytes: int = 0  # host expert LRU in use now
    expert_cache_limit_bytes: int = 0  # its bound; 0 = unlimited
    expires_at: float | None = None  # unix seconds of keep-alive unload; None = never
    active: int = 0  # sequences decoding now
    device: str = ""  # where it computes: "cpu", "cuda:0", ...
    vram_bytes: int = 0  # GPU memory it holds (weights, experts, KV caches, scratch)
    gpu_cache_bytes: int = 0  # of which its VRAM expert cache (MOE_GPU_CACHE_MB); 0 = every expert resident
    n_ctx: int = 0  # context length per sequence (0 while it loads)


# -- requests (client -> daemon) ----------------------------------------------------------------

class Hello(msgspec.Struct, tag="V", **_REQ):
    id: int
    protocol: int  # the client's PROTOCOL_VERSION


class Load(msgspec.Struct, tag="L", **_REQ):
    id: int
    model: str  # GGUF path
    settings: dict[str, str | int | float | bool] = {}  # daemon.config keys, e.g. {"n_ctx": 8192}
    keep_alive: float | None = None


class Unload(msgspec.Struct, tag="U", **_REQ):
    id: int
    model: str


class Generate(msgspec.Struct, tag="G", **_REQ):
    id: int
    model: str | None = None  # None = the demo MoE (or the only loaded model)
    prompt: str | None = None  # exactly one of prompt / tokens
    tokens: list[int] | None = None  # token ids, used as-is (no template, no BOS added)
    max_tokens: int = 256  # 0 = evaluate the prompt only
    options: SamplingOptions | None = None  # None = the daemon's defaults
    stop: StopList = []  # stop strings; the stream ends before them (see Limits)
    keep_alive: float | None = None
    raw: bool = False  # True: the prompt skips the model's chat template
    # "json", a JSON schema's text, or "lark:" + a Lark grammar: the output is held to it (daemon.grammar)
    format: str | None = None

    def __post_init__(self):  # ValueError: bad_request on decode, ValueError when built locally
        if (self.prompt is None) == (self.tokens is None):
            raise ValueError("exactly one of prompt and tokens must be given")
        if self.max_tokens < 0:
            raise ValueError("max_tokens must be >= 0")
        _check_stop(self.stop)


class Chat(msgspec.Struct, tag="C", **_REQ):
    id: int
    messages: list[Message]  # rendered with the model's chat template
    model: str | None = None
    max_tokens: int = 256
    options: SamplingOptions | None = None
    stop: StopList = []
    keep_alive: float | None = None
    format: str | None = None  # as Generate's
    tools: list[dict[str, Any]] | None = None  # JSON-schema function specs, given to the chat template

    def __post_init__(self):
        if not self.messages:
            raise ValueError("messages must not be empty")
        if self.max_tokens < 0:
            raise ValueError("max_tokens must be >= 0")
        _check_stop(self.stop)


class Cancel(msgspec.Struct, tag="X", **_REQ):
    id: int  # the Generate/Chat to stop (not a fresh id); no reply


class Ps(msgspec.Struct, tag="P", **_REQ):
    id: int


class Stats(msgspec.Struct, tag="S", **_REQ):
    id: int
    model: str | None = None  # None = every loaded model


class Health(msgspec.Struct, tag="H", **_REQ):
    id: int


class Shutdown(msgspec.Struct, tag="Q", **_REQ):
    id: int  # answered Ok, then running streams end with Error("shutdown") and the daemon exits


Request = Hello | Load | Unload | Generate | Chat | Cancel | Ps | Stats | Health | Shutdown


# -- replies (daemon -> client) -----------------------------------------------------------------

class Chunk(msgspec.Struct, tag="c", **_REP):
    id: int
    text: str  # may be "" while a multi-byte character or a possible stop string is held back
    tokens: list[int] = []  # the token ids generated since the previous chunk


class Done(msgspec.Struct, tag="d", **_REP):
    id: int
    done_reason: str = "stop"  # "stop" (EOS or stop string) | "length" (max_tokens reached)
    prompt_eval_count: int = 0  # prompt tokens evaluated
    prompt_eval_duration: int = 0  # ns evaluating the prompt
    eval_count: int = 0  # tokens generated
    eval_duration: int = 0  # ns generating them
    load_duration: int = 0  # ns loading the model for this request (0 when already loaded)
    total_duration: int = 0  # ns from receiving the request to this message


class Error(msgspec.Struct, tag="e", **_REP):
    id: int | None  # None: the failing request's id could not be read
    code: str  # see "Error codes" above
    message: str = ""


class Loaded(msgspec.Struct, tag="l", **_REP):
    id: int
    model: str
    load_duration: int = 0  # ns; 0 when it was already loaded


class PsReply(msgspec.Struct, tag="p", **_REP):
    id: int
    models: list[ModelInfo] = []


class StatsReply(msgspec.Struct, tag="s", **_REP):
    id: int
    # JSON-like, per model: {name: {"layers": [{"hits": n, "misses": n, "bytes_read": n, ...}], ...}}
    stats: dict[str, Any] = {}


class HealthReply(msgspec.Struct, tag="h", **_REP):
    id: int
    version: str  # moed package version
    protocol: int  # PROTOCOL_VERSION the daemon speaks on this connection
    pid: int
    uptime_s: float = 0.0


class Ok(msgspec.Struct, tag="k", **_REP):
    id: int


class Progress(msgspec.Struct, tag="r", **_REP):
    id: int  # the Generate/Chat/Load that waits
    phase: str  # "download" | "build" (the demo model) | "load" | "compile" (kernels, first run only)
    percent: float | None = None  # 0..100 of this phase; None = unknown
    message: str = ""  # for people, e.g. "calibration text 3/12"


Reply = Chunk | Done | Error | Loaded | PsReply | StatsReply | HealthReply | Ok | Progress

# What each request is answered with (a stream for Generate/Chat; Error is always possible; Progress
# may come first for Generate, Chat and Load).
REPLIES: dict[type, tuple[type, ...]] = {
    Hello: (HealthReply,), Load: (Progress, Loaded), Unload: (Ok,), Generate: (Progress, Chunk, Done),
    Chat: (Progress, Chunk, Done),
    Cancel: (), Ps: (PsReply,), Stats: (StatsReply,), Health: (HealthReply,), Shutdown: (Ok,),
}


# -- encode / decode ----------------------------------------------------------------------------

_encoder = msgspec.msgpack.Encoder()
_requests = msgspec.msgpack.Decoder(Request)
_replies = msgspec.msgpack.Decoder(Reply)


def encode(msg: Request | Reply) -> bytes:
    """The msgpack body of one message (frame it with ipc.framing)."""
    return _encoder.encode(msg)


def decode_request(data: bytes) -> Request:
    """Decode a request body; ProtocolError (code "bad_frame" or "bad_request") otherwise."""
    return _decode(_requests, data)


def decode_reply(data: bytes) -> Reply:
    """Decode a reply body; ProtocolError (code "bad_frame" or "bad_request") otherwise."""
    return _decode(_replies, data)


def _decode(decoder: msgspec.msgpack.Decoder, data: bytes):
    try:
        return decoder.decode(data)
    except msgspec.ValidationError as e:  # msgpack, but unknown tag / wrong type / bad value
        raise ProtocolError(f"invalid message: {e}", code="bad_request", request_id=_peek_id(data)) from None
    except (msgspec.DecodeError, UnicodeDecodeError, RecursionError) as e:  # not msgpack, bad UTF-8, too deep
        raise ProtocolError(f"undecodable message: {e}", code="bad_frame") from None


class _Head(msgspec.Struct, array_like=True):
    """A body's first two items; the rest is skipped unbuilt (an 11 MB list in 7 ms, not 210)."""

    tag: Any = None
    id: Any = None


_heads = msgspec.msgpack.Decoder(_Head)


def _peek_id(data: bytes) -> int | None:
    """The id of a body that failed validation, so the error reply can name its request."""
    try:
        head = _heads.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError, UnicodeDecodeError, RecursionError):
        return None
    return head.id if type(head.id) is int else None
