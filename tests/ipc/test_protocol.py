"""Every message round-trips; anything else raises ProtocolError with the right code."""

from __future__ import annotations

import random
import typing

import msgspec
import pytest

from ipc import errors
from ipc.framing import MAX_FRAME
from ipc.protocol import (
    PROTOCOL_VERSION,
    REPLIES,
    Cancel,
    Chat,
    Chunk,
    Done,
    Error,
    Generate,
    Health,
    HealthReply,
    Hello,
    Load,
    Loaded,
    Message,
    ModelInfo,
    Ok,
    Progress,
    ProtocolError,
    Ps,
    PsReply,
    Reply,
    Request,
    STOP_MAX_BYTES,
    STOP_MAX_COUNT,
    SamplingOptions,
    Shutdown,
    Stats,
    StatsReply,
    Unload,
    decode_reply,
    decode_request,
    encode,
)

REQUESTS = [
    Hello(1, 1),
    Load(2, "/m/qwen3.gguf"),
    Load(3, "/m/a.gguf", {"n_ctx": 8192, "routing": "exact", "expert_cache_limit_mb": 512.5,
                          "expert_pack": False}, keep_alive=0.0),
    Unload(4, "/m/a.gguf"),
    Generate(5, prompt="Hello"),
    Generate(6, "/m/a.gguf", tokens=[1, 2, 3], max_tokens=0,
             options=SamplingOptions(temperature=0.0, top_k=1, seed=7), stop=["\n\n", "</s>"],
             keep_alive=-1.0, raw=True),
    Chat(7, [Message("system", "Be brief."), Message("user", "Hi ✓")], "/m/a.gguf", 32,
         SamplingOptions(min_p=0.0), ["x"], 300.0),
    Cancel(5),
    Ps(8),
    Stats(9),
    Stats(10, "/m/a.gguf"),
    Health(11),
    Shutdown(12),
]
REPLY_MSGS = [
    Chunk(5, "Hel"),
    Chunk(5, "", [128, 129]),
    Done(5, "length", 5, 1_000, 16, 2_000_000, 0, 2_100_000),
    Error(None, "bad_frame", "undecodable"),
    Error(5, "busy"),
    Loaded(2, "/m/qwen3.gguf", 1_500_000_000),
    PsReply(8),
    PsReply(8, [ModelInfo("/m/a.gguf", "/m/a.gguf", "qwen3moe", 2**30, 2**28, 2**29, 1.7e9, 2),
                ModelInfo("demo", expires_at=None)]),
    StatsReply(9, {"/m/a.gguf": {"layers": [{"hits": 10, "misses": 2, "hit_rate": 0.83}]}}),
    HealthReply(11, "0.1.0", 1, 4242, 12.5),
    Ok(12),
    Progress(2, "build", 42.5, "calibration text 5/12"),
    Progress(5, "compile"),
]


@pytest.mark.parametrize("msg", REQUESTS, ids=lambda m: type(m).__name__)
def test_request_round_trip(msg):
    back = decode_request(encode(msg))
    assert type(back) is type(msg) and back == msg


@pytest.mark.parametrize("msg", REPLY_MSGS, ids=lambda m: type(m).__name__)
def test_reply_round_trip(msg):
    back = decode_reply(encode(msg))
    assert type(back) is type(msg) and back == msg


def test_every_type_is_covered_and_tags_are_distinct():
    assert {type(m) for m in REQUESTS} == set(typing.get_args(Request)) == set(REPLIES)
    assert {type(m) for m in REPLY_MSGS} == set(typing.get_args(Reply))
    tags = [t.__struct_config__.tag for t in typing.get_args(Request) + typing.get_args(Reply)]
    assert len(set(tags)) == len(tags) and all(len(t) == 1 for t in tags)


def test_wire_shape_is_a_compact_array():
    body = encode(Chunk(3, "hi", [5]))
    assert msgspec.msgpack.decode(body) == ["c", 3, "hi", [5]]
    assert len(body) == 9


def raw(*items) -> bytes:
    return msgspec.msgpack.encode(list(items))


@pytest.mark.parametrize("data", [b"", b"\xc1", b"\xd9", b"\x92\xa1", b"\x92\xa1\xff"], ids=repr)
def test_undecodable_is_bad_frame(data):
    for decode in (decode_request, decode_reply):
        with pytest.raises(ProtocolError) as e:
            decode(data)
        assert e.value.code == "bad_frame" and e.value.request_id is None


def test_deep_nesting_is_an_error_not_a_crash():
    for data in (b"\x91" * 100_000, b"\x93\xa1s\x01" + b"\x81\xa1a" * 100_000 + b"\x01"):
        for decode in (decode_request, decode_reply):
            with pytest.raises(ProtocolError):
                decode(data)


def test_random_bytes_and_mutations_only_ever_raise_protocol_error():
    rng = random.Random(0)
    valid = [encode(m) for m in REQUESTS + REPLY_MSGS]
    for i in range(3000):
        if i % 2:
            data = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 40)))
        else:  # a valid body with a few bytes flipped, cut or appended
            data = bytearray(rng.choice(valid))
            for _ in range(rng.randrange(1, 4)):
                data[rng.randrange(len(data))] = rng.randrange(256)
            data = bytes(data[:rng.randrange(1, len(data) + 1)]) + b"\x00" * rng.randrange(2)
        for decode in (decode_request, decode_reply):
            try:
                decode(data)
            except ProtocolError as e:
                assert e.code in ("bad_frame", "bad_request")


@pytest.mark.parametrize("data, request_id", [
    (raw("Z", 4), 4),  # unknown tag
    (raw("c", 4, "text"), 4),  # a reply's tag sent as a request
    (raw("G", "4", None, "p"), None),  # id of the wrong type
    (raw("G", 4, None, 17), 4),  # prompt: int for str
    (raw("G", 4, None, "p", [1, "2"]), 4),  # tokens: a str inside
    (raw("G", 4, None, "p", None, 256, {"temperature": "hot"}), 4),
    (raw("G", 4, None, "p", None, 256, {"temperature": -1.0}), 4),  # out of range (RequestError)
    (raw("G", 4), 4),  # neither prompt nor tokens
    (raw("G", 4, None, "p", None, -1), 4),  # negative max_tokens
    (raw("C", 4, []), 4),  # no messages
    (raw("C", 4, [["user"]]), 4),  # a message without content
    (raw("L", 4, "m", {"n_ctx": [1]}), 4),  # setting value of a type settings cannot hold
    (raw("U", 4), 4),  # missing field
    (raw("Q", 4, "extra"), 4),  # unknown trailing field
    (msgspec.msgpack.encode({"type": "H", "id": 4}), None),  # a map, not an array
], ids=lambda x: repr(x)[:40])
def test_invalid_request_is_bad_request_with_its_id(data, request_id):
    with pytest.raises(ProtocolError) as e:
        decode_request(data)
    assert e.value.code == "bad_request"
    assert e.value.request_id == request_id


def test_replies_tolerate_new_trailing_fields_but_not_wrong_types():
    assert decode_reply(raw("c", 1, "a", [2], "field of a newer daemon")) == Chunk(1, "a", [2])
    with pytest.raises(ProtocolError, match="bad_request|Expected"):
        decode_reply(raw("d", 1, "stop", "many"))


def test_local_construction_validates_too():
    with pytest.raises(ValueError, match="exactly one"):
        Generate(1, prompt="a", tokens=[1])
    with pytest.raises(ValueError, match="messages"):
        Chat(1, [])


@pytest.mark.parametrize("code, cls", [
    ("busy", errors.Busy), ("model_error", errors.ModelError), ("not_found", errors.ModelError),
    ("cancelled", errors.Cancelled), ("bad_frame", errors.ProtocolError),
    ("bad_version", errors.ProtocolError), ("bad_request", errors.BadRequest), ("forbidden", errors.Forbidden),
    ("shutdown", errors.ServerError), ("internal", errors.ServerError), ("new_code", errors.ServerError),
])
def test_error_codes_map_to_classes(code, cls):
    err = errors.error_for(code, "why", 3)
    assert type(err) is cls and isinstance(err, errors.ClientError)
    assert (err.code, err.request_id, str(err)) == (code, 3, "why")


def test_progress_is_a_reply_of_the_requests_that_wait_and_bumps_the_version():
    assert PROTOCOL_VERSION >= 2  # a version-1 client would fail on the unknown tag: bad_version at Hello
    for kind in (Generate, Chat, Load):
        assert REPLIES[kind][0] is Progress
    assert msgspec.msgpack.decode(encode(Progress(3, "load", 50.0, "reading"))) == ["r", 3, "load", 50.0, "reading"]


def test_format_and_tools_are_new_trailing_fields_of_version_3():
    """Requests are arrays with every field: a field added to Generate, Chat or Message would be
    refused by a version-2 daemon, so version 3 says so at Hello."""
    assert PROTOCOL_VERSION == 3
    body = msgspec.msgpack.decode(encode(Chat(1, [Message("user", "hi")], format="json", tools=[{"type": "function"}])))
    assert body[-2:] == ["json", [{"type": "function"}]]
    assert msgspec.msgpack.decode(encode(Message("tool", "22C", tool_call_id="c1", name="get_weather"))) == \
        ["tool", "22C", None, "c1", "get_weather", None]
    assert decode_request(encode(Generate(2, prompt="x", format='{"type": "object"}'))).format == '{"type": "object"}'


# -- the stop list's bounds (issue 25, item 2): one request's list used to stall every stream ---

def _stops(count: int, total_bytes: int) -> list[str]:
    """count stop strings of total_bytes UTF-8 bytes in all, multi-byte characters included."""
    per, extra = divmod(total_bytes, count)
    stops = []
    for k in range(count):
        n = per + (k < extra)
        stops.append("☃" * (n // 3) + "x" * (n % 3))  # ☃ is 3 bytes in UTF-8
    assert sum(len(s.encode()) for s in stops) == total_bytes
    return stops


def _wire(kind: str, stop: list[str]) -> bytes:
    if kind == "G":  # id, model, prompt, tokens, max_tokens, options, stop
        return raw("G", 4, None, "p", None, 8, None, stop)
    return raw("C", 4, [["user", "hi"]], None, 8, None, stop)  # id, messages, model, max_tokens, options, stop


def _local(kind: str, stop: list[str]):
    if kind == "G":
        return Generate(4, prompt="p", max_tokens=8, stop=stop)
    return Chat(4, [Message("user", "hi")], max_tokens=8, stop=stop)


@pytest.mark.parametrize("kind", ["G", "C"])
@pytest.mark.parametrize("stop", [
    _stops(STOP_MAX_COUNT, STOP_MAX_COUNT),  # 64 strings
    _stops(1, STOP_MAX_BYTES),  # 4096 bytes in one string
    _stops(STOP_MAX_COUNT, STOP_MAX_BYTES),  # both at once
    [""] * STOP_MAX_COUNT,  # empty strings are ignored (as llama.cpp's server does), but count
], ids=["64 strings", "4096 bytes", "64 strings of 4096 bytes", "64 empty"])
def test_a_stop_list_at_the_bounds_is_served(kind, stop):
    assert decode_request(_wire(kind, stop)).stop == stop
    assert _local(kind, stop).stop == stop


@pytest.mark.parametrize("kind", ["G", "C"])
@pytest.mark.parametrize("stop, why", [
    (_stops(STOP_MAX_COUNT + 1, STOP_MAX_COUNT + 1), "at most 64"),  # 65 strings
    ([""] * (STOP_MAX_COUNT + 1), "at most 64"),
    (_stops(1, STOP_MAX_BYTES + 1), "4096 bytes"),  # 4097 bytes
    (_stops(STOP_MAX_COUNT, STOP_MAX_BYTES + 1), "4096 bytes"),
], ids=["65 strings", "65 empty", "4097 bytes", "64 strings of 4097 bytes"])
def test_a_stop_list_past_the_bounds_is_bad_request(kind, stop, why):
    with pytest.raises(ProtocolError) as e:
        decode_request(_wire(kind, stop))
    assert (e.value.code, e.value.request_id) == ("bad_request", 4)
    with pytest.raises(ValueError, match=why):  # built in process (Engine.generate: RequestError)
        _local(kind, stop)


def test_the_probes_million_stop_strings_are_bad_request():
    stop = ["☃%07d" % k for k in range(10**6)]  # an 11 MB frame, under the 16 MiB frame limit
    data = _wire("G", stop)
    assert 10 * 2**20 < len(data) < MAX_FRAME
    with pytest.raises(ProtocolError) as e:
        decode_request(data)
    assert (e.value.code, e.value.request_id) == ("bad_request", 4)
