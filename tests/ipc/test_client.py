"""AsyncClient and Client against MockServer on a real unix socket."""

from __future__ import annotations

import asyncio
import os
import socket
import tempfile
import time

import pytest

from ipc import (
    AsyncClient,
    BadRequest,
    Busy,
    Cancelled,
    Client,
    ModelError,
    NotRunning,
    ProtocolError,
    SamplingOptions,
    ServerError,
    Timeout,
    default_socket_path,
)
from ipc.framing import HEADER, pack_frame, read_frame
from ipc.protocol import (
    PROTOCOL_VERSION,
    Cancel,
    Chat,
    Chunk,
    Done,
    Error,
    Generate,
    Health,
    HealthReply,
    Load,
    Loaded,
    ModelInfo,
    Ok,
    Progress,
    Ps,
    PsReply,
    Shutdown,
    Stats,
    StatsReply,
    Unload,
    decode_reply,
    encode,
)
from ipc.testing import MockServer


@pytest.fixture
def path(tmp_path):
    p = tmp_path / "moed.sock"
    if len(str(p)) < 100:  # AF_UNIX paths are limited to 107 bytes
        return str(p)
    return os.path.join(tempfile.mkdtemp(prefix="moed-"), "moed.sock")


def words(req) -> list[str]:
    return (req.prompt if isinstance(req, Generate) else req.messages[-1].content).split()


def done(req, n: int) -> Done:
    return Done(req.id, "stop", prompt_eval_count=3, prompt_eval_duration=1_000, eval_count=n,
                eval_duration=n * 10_000, load_duration=5, total_duration=99_999)


async def handler(req):
    """A scripted daemon. Prompts: words are echoed one chunk each; magic first words below."""
    match req:
        case Generate(prompt="busy") | Chat(model="busy"):
            return [Error(req.id, "busy", "queue full")]
        case Generate(prompt="broken"):
            return [Chunk(req.id, "a"), Error(req.id, "model_error", "expert read failed")]
        case Generate(prompt="stall"):
            return stall(req)
        case Generate(prompt="slow"):
            return slow(req)
        case Generate(prompt=None):
            return [Chunk(req.id, f"<{t}>", [t]) for t in req.tokens] + [done(req, len(req.tokens))]
        case Generate() | Chat():
            return interleaved(req)
        case Load(model="missing.gguf"):
            return [Error(req.id, "not_found", "no such file")]
        case Load():
            return [Loaded(req.id, req.model, 123)]
        case Unload():
            return [Ok(req.id)]
        case Ps():
            return [PsReply(req.id, [ModelInfo("m.gguf", expert_cache_bytes=7, expires_at=1.5e9)])]
        case Stats():
            return [StatsReply(req.id, {"m.gguf": {"layers": [{"hits": 1}], "model": req.model}})]
        case Health():
            return [HealthReply(req.id, "mock", 1, 1, 2.0)]
        case Shutdown():
            return [Ok(req.id)]


async def interleaved(req):
    for i, word in enumerate(words(req)):
        await asyncio.sleep(0)  # lets other streams' chunks in between
        yield Chunk(req.id, word + " ", [i])
    yield done(req, len(words(req)))


async def stall(req):
    yield Chunk(req.id, "first ")
    await asyncio.sleep(3600)


async def slow(req):
    for i in range(10_000):
        yield Chunk(req.id, f"{i} ", [i])
        await asyncio.sleep(0.002)


@pytest.fixture
async def server(path):
    async with MockServer(handler, path) as s:
        yield s


@pytest.fixture
def sync_server(path):
    with MockServer(handler, path).in_thread() as s:
        yield s


def wait_until(predicate, timeout=2.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.005)


# -- AsyncClient --------------------------------------------------------------------------------

async def test_generate_streams_chunks_then_done(server):
    async with AsyncClient(server.path) as c:
        assert c.server.protocol == PROTOCOL_VERSION
        gen = c.generate("the quick brown fox", max_tokens=9, options={"temperature": 0.0, "seed": 3},
                         stop=["\n"], keep_alive=0.0, raw=True)
        chunks = [chunk async for chunk in gen]
    assert "".join(ch.text for ch in chunks) == "the quick brown fox "
    assert [ch.tokens for ch in chunks] == [[0], [1], [2], [3]]
    assert gen.done == done(gen._request, 4) and gen.done.total_duration == 99_999
    req = server.requests[-1]
    assert isinstance(req, Generate) and req.id == gen.id
    assert (req.max_tokens, req.stop, req.keep_alive, req.raw) == (9, ["\n"], 0.0, True)
    assert req.options == SamplingOptions(temperature=0.0, seed=3)


async def test_generate_from_token_ids_and_chat(server):
    async with AsyncClient(server.path) as c:
        gen = c.generate([5, 6])
        assert [ch.text async for ch in gen] == ["<5>", "<6>"]
        assert gen.done.eval_count == 2 and server.requests[-1].tokens == [5, 6]
        chat = c.chat([{"role": "system", "content": "x"}, {"role": "user", "content": "hi there"}])
        assert [ch.text async for ch in chat] == ["hi ", "there "]
        assert chat.done.eval_count == 2 and server.requests[-1].messages[0].role == "system"


async def test_unary_calls(server):
    async with AsyncClient(server.path) as c:
        loaded = await c.load("m.gguf", keep_alive=60.0, n_ctx=2048, routing="exact")
        assert loaded.model == "m.gguf" and loaded.load_duration == 123
        assert server.requests[-1] == Load(loaded.id, "m.gguf", {"n_ctx": 2048, "routing": "exact"}, 60.0)
        assert await c.unload("m.gguf") is None
        assert (await c.ps())[0].expert_cache_bytes == 7
        assert (await c.stats("m.gguf"))["m.gguf"] == {"layers": [{"hits": 1}], "model": "m.gguf"}
        assert (await c.health()).version == "mock"
        assert await c.shutdown() is None
    assert server.connections == 1


async def test_error_replies_map_to_exceptions(server):
    async with AsyncClient(server.path) as c:
        with pytest.raises(Busy) as e:
            [ch async for ch in c.generate("busy")]
        assert e.value.code == "busy" and "queue full" in str(e.value)
        with pytest.raises(Busy):
            [ch async for ch in c.chat([{"role": "user", "content": "x"}], model="busy")]
        gen = c.generate("broken")
        assert (await gen.__anext__()).text == "a"
        with pytest.raises(ModelError, match="expert read failed"):
            await gen.__anext__()
        assert gen.done is None
        with pytest.raises(ModelError) as e:
            await c.load("missing.gguf")
        assert e.value.code == "not_found"
        assert (await c.health()).pid == 1  # the connection survives error replies


async def test_not_running(path):
    with pytest.raises(NotRunning):
        await AsyncClient(path).health()
    stale = socket.socket(socket.AF_UNIX)  # a socket file nobody listens on: a dead daemon's
    stale.bind(path)
    stale.close()
    with pytest.raises(NotRunning):
        await AsyncClient(path).health()


async def test_timeout_when_the_daemon_stalls(server):
    async with AsyncClient(server.path, timeout=0.2) as c:
        gen = c.generate("stall")
        assert (await gen.__anext__()).text == "first "
        with pytest.raises(Timeout, match=r"0\.2 s"):  # the client's own 0.2 s, not the hang guard below
            async with asyncio.timeout(60):
                await gen.__anext__()
        assert (await server.wait_for(Cancel)).id == gen.id  # the client gave up: stop the work
        assert (await c.health()).version == "mock"  # same connection, still usable


async def test_connect_timeout_when_nothing_answers_hello(path):
    listener = socket.socket(socket.AF_UNIX)  # listens, never accepts nor answers
    listener.bind(path)
    listener.listen()
    try:
        with pytest.raises(Timeout):
            await AsyncClient(path, connect_timeout=0.2).health()
    finally:
        listener.close()


async def test_a_stalled_handshake_names_connect_timeout(path):
    listener = socket.socket(socket.AF_UNIX)  # as a SIGSTOPped daemon: the kernel queues, nobody answers
    listener.bind(path)
    listener.listen()
    try:
        with pytest.raises(Timeout) as e:
            await AsyncClient(path, timeout=60.0, connect_timeout=0.2).health()
        assert "connect_timeout=0.2 s" in str(e.value) and "60" not in str(e.value)
        with pytest.raises(Timeout) as e:
            Client(path, timeout=60.0, connect_timeout=0.2).health()
        assert "connect_timeout=0.2 s" in str(e.value) and "60" not in str(e.value)
    finally:
        listener.close()


async def test_a_stalled_reply_names_timeout(server):
    async with AsyncClient(server.path, timeout=0.2, connect_timeout=30.0) as c:
        gen = c.generate("stall")
        await gen.__anext__()
        with pytest.raises(Timeout, match=r"within timeout=0\.2 s"):
            await gen.__anext__()


@pytest.mark.parametrize("leave", ["break", "aclose", "async_with"])
async def test_leaving_a_generation_early_sends_cancel(server, leave):
    async with AsyncClient(server.path) as c:
        if leave == "break":
            async for _ in c.generate("slow"):
                break
        elif leave == "aclose":
            gen = c.generate("slow")
            await gen.__anext__()
            await gen.aclose()
        else:
            async with c.generate("slow") as gen:
                await gen.__anext__()
        cancel = await server.wait_for(Cancel)
        assert any(isinstance(r, Generate) and r.id == cancel.id for r in server.requests)
        assert not c._pending  # the rest of that stream is dropped
        assert [ch.text async for ch in c.generate("still works")] == ["still ", "works "]


async def test_cancel_by_id_from_another_task(server):
    async with AsyncClient(server.path) as c:
        gen = c.generate("slow")
        await gen.__anext__()
        await c.cancel(gen.id)
        with pytest.raises(Cancelled):
            async for _ in gen:
                pass


async def test_concurrent_generations_share_one_connection(server):
    async with AsyncClient(server.path) as c:
        async def one(i):
            gen = c.generate(" ".join(f"s{i}w{j}" for j in range(20)))
            return "".join([ch.text async for ch in gen]), gen.done.eval_count

        results = await asyncio.gather(*(one(i) for i in range(16)))
    for i, (text, count) in enumerate(results):
        assert text == "".join(f"s{i}w{j} " for j in range(20)) and count == 20
    assert server.connections == 1


async def test_protocol_version_mismatch(path):
    async with MockServer(handler, path, protocol=PROTOCOL_VERSION + 1):
        with pytest.raises(ProtocolError) as e:
            await AsyncClient(path).health()
        assert e.value.code == "bad_version"


async def test_lost_connection_fails_the_stream_and_the_client_reconnects(path):
    server = await MockServer(handler, path).start()
    c = AsyncClient(path)
    gen = c.generate("stall")
    await gen.__anext__()
    await server.close()
    with pytest.raises(NotRunning):
        await gen.__anext__()
    async with MockServer(handler, path):  # the daemon restarted
        assert (await c.health()).version == "mock"
    await c.close()


async def test_oversized_reply_is_a_protocol_error(path):
    async def big(req):
        return [Chunk(req.id, "x" * 5000), Done(req.id)] if isinstance(req, Generate) else []

    async with MockServer(big, path), AsyncClient(path, max_frame=4096) as c:
        with pytest.raises(ProtocolError):
            [ch async for ch in c.generate("hi")]


# -- Client (blocking) --------------------------------------------------------------------------

def test_sync_generate_chat_and_unary_calls(sync_server):
    with Client(sync_server.path) as c:
        gen = c.generate("a b c", options=SamplingOptions(temperature=0.0))
        assert [ch.text for ch in gen] == ["a ", "b ", "c "]
        assert gen.done.eval_count == 3 and gen.done.prompt_eval_duration == 1_000
        chat = c.chat([{"role": "user", "content": "hello"}])
        assert "".join(ch.text for ch in chat) == "hello " and chat.done.done_reason == "stop"
        assert c.load("m.gguf", n_ctx=1).load_duration == 123
        assert c.unload("m.gguf") is None
        assert c.ps()[0].expires_at == 1.5e9
        assert c.stats()["m.gguf"]["model"] is None
        assert c.health().uptime_s == 2.0
        assert c.shutdown() is None


def test_sync_error_mapping(sync_server):
    with Client(sync_server.path) as c:
        with pytest.raises(Busy):
            list(c.generate("busy"))
        with pytest.raises(ModelError):
            list(c.generate("broken"))
        with pytest.raises(ModelError):
            c.load("missing.gguf")
        assert c.health().version == "mock"


@pytest.mark.parametrize("bad", [{"stop": ["x"] * 65}, {"options": {"top_p": 2.0}},
                                 {"messages": [{"content": "no role"}]}])
def test_a_request_the_daemon_would_refuse_is_bad_request_before_sending(sync_server, bad):
    # the CLI reports BadRequest (a ClientError) as `moed: error:`; a bare ValueError was a traceback
    with Client(sync_server.path) as c:
        sent = len(sync_server.requests)
        with pytest.raises(BadRequest) as e:
            if "messages" in bad:
                list(c.chat(bad["messages"]))
            else:
                list(c.generate("x", **bad))
        assert e.value.code == "bad_request" and len(sync_server.requests) == sent


def test_sync_not_running(path):
    with pytest.raises(NotRunning):
        Client(path).health()


def test_sync_timeout_then_reconnect(sync_server):
    c = Client(sync_server.path, timeout=0.2)
    gen = c.generate("stall")
    assert next(gen).text == "first "
    with pytest.raises(Timeout):
        next(gen)
    assert c.health().version == "mock"  # a fresh connection
    assert sync_server.connections == 2
    c.close()


def test_sync_stalled_reply_names_timeout(sync_server):
    with Client(sync_server.path, timeout=0.2, connect_timeout=30.0) as c:
        gen = c.generate("stall")
        next(gen)
        with pytest.raises(Timeout, match=r"within timeout=0\.2 s"):
            next(gen)


def test_sync_break_sends_cancel_and_interleaving_works(sync_server):
    with Client(sync_server.path) as c:
        gen = c.generate("slow")
        first = next(gen)
        assert c.health().version == "mock"  # a request while the stream is open
        assert next(gen).tokens == [first.tokens[0] + 1]  # its chunks were kept meanwhile
        for _ in gen:
            break
        gen.close()
        wait_until(lambda: any(isinstance(r, Cancel) and r.id == gen.id for r in sync_server.requests))
        for _ in c.generate("slow"):  # break from a temporary: dropped, hence cancelled
            break
        wait_until(lambda: sum(isinstance(r, Cancel) for r in sync_server.requests) == 2)
        assert [ch.text for ch in c.generate("x y")] == ["x ", "y "]


def test_sync_cancel_by_id(sync_server):
    with Client(sync_server.path) as c:
        gen = c.generate("slow")
        next(gen)
        c.cancel(gen.id)
        with pytest.raises(Cancelled):
            list(gen)


# -- the mock daemon's answers to bad input (the contract the real daemon follows) ---------------

async def raw_exchange(path, data: bytes) -> list:
    reader, writer = await asyncio.open_unix_connection(path)
    writer.write(data)
    await writer.drain()
    writer.write_eof()
    replies = []
    while (frame := await asyncio.wait_for(read_frame(reader), 2)) is not None:
        replies.append(decode_reply(frame))
    writer.close()
    return replies


async def test_mock_answers_bad_frames_and_goes_on(server):
    hello = pack_frame(encode(Health(9)))
    bad_tag = pack_frame(b"\x92\xa1Z\x07")
    replies = await raw_exchange(server.path, pack_frame(b"\xc1garbage") + bad_tag + hello)
    assert [(r.id, r.code) for r in replies[:2]] == [(None, "bad_frame"), (7, "bad_request")]
    assert isinstance(replies[2], HealthReply)
    # these lose sync: one error reply, then the daemon closes (the Health after it is not read)
    for data in (HEADER.pack(2**30) + hello, hello + hello[:-1]):
        replies = await raw_exchange(server.path, data)
        assert [(r.id, getattr(r, "code", None)) for r in replies][-1] == (None, "bad_frame")
        assert len(replies) == (1 if data.startswith(HEADER.pack(2**30)) else 2)


def test_default_socket_path(monkeypatch):
    monkeypatch.setenv("MOED_SOCKET", "/x/y.sock")
    monkeypatch.setenv("XDG_RUNTIME_DIR", "/run/user/5")
    assert default_socket_path() == "/x/y.sock"
    monkeypatch.delenv("MOED_SOCKET")
    assert default_socket_path() == "/run/user/5/moed.sock"
    monkeypatch.delenv("XDG_RUNTIME_DIR")
    assert default_socket_path() == f"/tmp/moed-{os.getuid()}/moed.sock"
    assert AsyncClient().socket == Client().socket == default_socket_path()
    assert Client("/s").socket == "/s"


def test_server_error_for_other_codes(sync_server):
    sync_server.handler = lambda req: [Error(req.id, "internal", "boom")]
    with Client(sync_server.path) as c, pytest.raises(ServerError) as e:
        c.ps()
    assert e.value.code == "internal"


def progressing(req):
    """A daemon that reports a load before it answers."""
    steps = [Progress(req.id, "load", 50.0, "reading"), Progress(req.id, "compile", None, "compiling kernels")]
    if isinstance(req, Load):
        return [*steps, Loaded(req.id, req.model, 7)]
    return [*steps, Chunk(req.id, "hi", [1]), Done(req.id, eval_count=1)]


async def test_progress_goes_to_the_callback_and_never_into_the_stream(path):
    seen = []
    async with MockServer(progressing, path), AsyncClient(path) as c:
        gen = c.generate("Hi", on_progress=seen.append)
        assert [chunk.text async for chunk in gen] == ["hi"] and gen.done.eval_count == 1
        assert (await c.load("/m.gguf", on_progress=seen.append)).load_duration == 7
        assert [chunk.text async for chunk in c.chat([{"role": "user", "content": "Hi"}])] == ["hi"]  # no callback
    assert [(p.phase, p.percent) for p in seen] == [("load", 50.0), ("compile", None)] * 2


def test_progress_in_the_blocking_client(path):
    seen = []
    with MockServer(progressing, path).in_thread(), Client(path) as c:
        gen = c.chat([{"role": "user", "content": "Hi"}], on_progress=seen.append)
        assert [chunk.text for chunk in gen] == ["hi"]
        assert c.load("/m.gguf", on_progress=seen.append).model == "/m.gguf"
        assert [chunk.text for chunk in c.generate("Hi")] == ["hi"]
    assert [p.message for p in seen] == ["reading", "compiling kernels"] * 2
