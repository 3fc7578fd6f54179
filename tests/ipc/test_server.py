"""The daemon's server in process, on a real unix socket, with the qwen3moe fixture: the socket
(0600, stale vs live, peer uid), hostile bytes, 16 concurrent clients, disconnects, busy, shutdown,
load failures, keep-alive and single-flight loads, through AsyncClient/Client and raw sockets."""

from __future__ import annotations

import asyncio
import os
import socket
import stat
import tempfile
import time

import msgspec
import pytest

from daemon import service
from daemon.config import Settings
from daemon.engine import Engine
from daemon.scheduler import Scheduler
from ipc import (
    AsyncClient,
    BadRequest,
    Busy,
    Client,
    Forbidden,
    ModelError,
    NotRunning,
    SamplingOptions,
    ServerError,
)
from ipc.framing import HEADER, pack_frame
from ipc.protocol import (
    PROTOCOL_VERSION,
    Chunk,
    Done,
    Error,
    Generate,
    Health,
    HealthReply,
    Hello,
    Progress,
    encode,
)
from ipc.server import Server, SocketInUse
from tests.fixtures.build import fixture_path
from tests.ipc.raw import Raw

pytestmark = pytest.mark.usefixtures("warm_kernels")  # compile outside the time limits

GREEDY = SamplingOptions(temperature=0.0)
T = 60  # seconds: the longest any step may take before a test fails instead of hanging


@pytest.fixture(scope="module")
def model(fixture_dir) -> str:
    return str(fixture_path("qwen3moe", "Q8_0", fixture_dir))


@pytest.fixture
def path(tmp_path) -> str:
    p = tmp_path / "moed.sock"
    if len(str(p)) < 100:  # AF_UNIX paths are limited to 107 bytes
        return str(p)
    return os.path.join(tempfile.mkdtemp(prefix="moed-"), "moed.sock")


class Factory:
    def __init__(self):
        self.calls = 0

    def __call__(self, path, **settings):
        self.calls += 1
        return Engine.load(path, **{"n_threads": 1, **settings})


def make_server(path, **settings) -> Server:
    cfg = Settings.load(env={}, **settings)
    sched = Scheduler(cfg, factory=Factory(), default_model=lambda _progress: "/nonexistent/demo.gguf")
    return service.make_server(cfg, path, scheduler=sched, close_timeout=T)


@pytest.fixture
async def server(path):
    async with make_server(path) as s:
        yield s


async def tokens_of(gen) -> list[int]:
    out = []
    async for chunk in gen:
        out += chunk.tokens
    return out


# -- raw connections ----------------------------------------------------------------------------

# -- the socket ---------------------------------------------------------------------------------

async def test_socket_is_0600_and_removed_at_exit(path):
    async with make_server(path) as s:
        mode = os.stat(path).st_mode
        assert stat.S_ISSOCK(mode) and stat.S_IMODE(mode) == 0o600
        async with AsyncClient(path) as c:
            h = await c.health()
            assert h.pid == os.getpid() and h.protocol == PROTOCOL_VERSION
        assert s.path == path
    assert not os.path.exists(path)


async def test_stale_socket_is_replaced_live_one_is_not_stolen(path):
    dead = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    dead.bind(path)  # a socket file nobody listens on: a daemon that died
    dead.close()
    assert os.path.exists(path)
    async with make_server(path):
        async with AsyncClient(path) as c:
            await c.health()
        with pytest.raises(SocketInUse):
            await make_server(path).start()
        os.unlink(path + ".lock")  # even without the lock, the connect test keeps it
        with pytest.raises(SocketInUse):
            await make_server(path).start()
        async with AsyncClient(path) as c:  # the first daemon still serves
            await c.health()


async def test_a_file_that_is_not_a_socket_is_left_alone(tmp_path):
    precious = tmp_path / "moed.sock"
    precious.write_bytes(b"precious")
    with pytest.raises(SocketInUse):
        await make_server(str(precious)).start()
    assert precious.read_bytes() == b"precious"


async def test_peer_uid_is_checked(path, monkeypatch):
    import ipc.server

    async with make_server(path, allowed_uids=str(os.getuid() + 4242)):
        async with AsyncClient(path) as c:  # the daemon's own user is always admitted (issue 25)
            await c.health()
        monkeypatch.setattr(ipc.server, "peer_cred", lambda sock: (os.getpid(), os.getuid() + 4243, 0))
        with pytest.raises(Forbidden) as e:  # a user the list does not name is not
            async with AsyncClient(path) as c:
                await c.health()
        assert e.value.code == "forbidden"
        monkeypatch.undo()
    async with make_server(path, allowed_uids=f"{os.getuid() + 4242},{os.getuid()}"), AsyncClient(path) as c:
        await c.health()


# -- hostile bytes ------------------------------------------------------------------------------

async def test_bad_frames_get_error_replies_and_the_daemon_goes_on(server, path):
    raw = await Raw.open(path)
    await raw.send_bytes(pack_frame(b"\xc1\xc1 not msgpack"))
    r = await raw.recv()
    assert isinstance(r, Error) and (r.id, r.code) == (None, "bad_frame")
    await raw.send_bytes(pack_frame(msgspec.msgpack.encode(["Z", 5])))  # unknown tag
    r = await raw.recv()
    assert (r.id, r.code) == (5, "bad_request")
    await raw.send_bytes(pack_frame(msgspec.msgpack.encode(["G", 6, 123, "prompt"])))  # model must be a str
    r = await raw.recv()
    assert (r.id, r.code) == (6, "bad_request")
    await raw.send_bytes(pack_frame(msgspec.msgpack.encode(["G", 7, None, "p", [1, 2]])))  # prompt and tokens
    r = await raw.recv()
    assert (r.id, r.code) == (7, "bad_request")
    await raw.send_bytes(pack_frame(msgspec.msgpack.encode(
        ["G", 8, None, None, [1], 4, {"temperature": -1.0}])))  # SamplingOptions out of range
    r = await raw.recv()
    assert (r.id, r.code) == (8, "bad_request")
    await raw.send_bytes(pack_frame(msgspec.msgpack.encode(["H", "nine"])))
    r = await raw.recv()
    assert (r.id, r.code) == (None, "bad_request")
    await raw.send_bytes(pack_frame(encode(Chunk(10, "a reply, sent as a request"))))
    r = await raw.recv()
    assert r.code == "bad_request"
    await raw.send(Health(11))  # the same connection still works
    assert isinstance(await raw.recv(), HealthReply)
    raw.close()


async def test_oversized_and_truncated_frames_close_only_that_connection(server, path, model):
    big = await Raw.open(path)
    await big.send_bytes(HEADER.pack(2**30))  # a 1 GiB length prefix: never read, never allocated
    r = await big.recv()
    assert (r.id, r.code) == (None, "bad_frame") and "exceeds" in r.message
    assert await big.recv() is None  # closed
    cut = await Raw.open(path)
    await cut.send_bytes(HEADER.pack(100) + b"only ten b")
    cut.writer.write_eof()
    r = await cut.recv()
    assert (r.id, r.code) == (None, "bad_frame")
    assert await cut.recv() is None
    half = await Raw.open(path)
    await half.send_bytes(b"\x00\x00")  # EOF inside a header
    half.writer.write_eof()
    assert (await half.recv()).code == "bad_frame"
    async with AsyncClient(path, timeout=T) as c:  # the daemon still serves
        assert len(await tokens_of(c.generate([1, 2], model=model, max_tokens=3))) == 3


async def test_handshake_rules(server, path):
    raw = await Raw.open(path, hello=False)
    await raw.send(Health(3))
    r = await raw.recv()
    assert (r.id, r.code) == (3, "bad_request")
    await raw.send(Hello(4, PROTOCOL_VERSION + 1))
    r = await raw.recv()
    assert (r.id, r.code) == (4, "bad_version")
    assert await raw.recv() is None
    raw = await Raw.open(path)
    await raw.send(Generate(5, "/nonexistent.gguf", tokens=[1]))
    await raw.send(Health(6))
    replies = {(await raw.recv()).id for _ in range(2)}
    assert replies == {5, 6}
    raw.close()


async def test_duplicate_request_id_is_refused(server, path, model):
    raw = await Raw.open(path)
    await raw.send(Generate(5, model, tokens=[1, 2], max_tokens=3000))
    assert isinstance(await raw.recv(), Chunk)
    await raw.send(Generate(5, model, tokens=[1, 2], max_tokens=1))
    while isinstance(r := await raw.recv(), Chunk):
        pass
    assert (r.id, r.code) == (5, "bad_request") and "in use" in r.message
    raw.close()


# -- generation ---------------------------------------------------------------------------------

async def test_sixteen_concurrent_clients_get_their_solo_tokens(server, path, model):
    n, max_tokens = 16, 12
    prompts = [[(37 * i) % 500 + 1, (11 * i) % 500 + 2, 300 + i] for i in range(n)]

    async def one(i: int) -> tuple[list[int], str, Done]:
        async with AsyncClient(path, timeout=T) as c:
            gen = c.generate(prompts[i], model=model, max_tokens=max_tokens, options=GREEDY)
            toks, text = [], []
            async for chunk in gen:
                toks += chunk.tokens
                text.append(chunk.text)
            return toks, "".join(text), gen.done

    solo = [await one(i) for i in range(n)]
    batcher = server.handler.registry.find(model).batcher
    assert batcher.peak_batch == 1
    together = await asyncio.gather(*(one(i) for i in range(n)))
    assert batcher.peak_batch > 1  # they did share decode steps
    assert [t for t, _, _ in together] == [t for t, _, _ in solo]
    assert [x for _, x, _ in together] == [x for _, x, _ in solo]
    for _, _, done in together:
        assert done.eval_count == max_tokens and done.prompt_eval_count == 3 and done.total_duration > 0
    with Engine.load(model, n_threads=1) as engine:
        for p, (_, text, done) in zip(prompts, solo):
            assert "".join(engine.generate(p, max_tokens, temperature=0)) == text
            assert engine.last_stats.eval_count == done.eval_count


async def test_text_prompt_with_the_blocking_client(server, path, model):
    def run():
        with Client(path, timeout=T) as c:
            gen = c.generate("Hello world", model=model, max_tokens=8, options=GREEDY)
            return "".join(ch.text for ch in gen), gen.done

    text, done = await asyncio.to_thread(run)
    with Engine.load(model, n_threads=1) as engine:
        assert "".join(engine.generate("Hello world", 8, temperature=0)) == text
    assert done.eval_count == 8 and done.done_reason == "length"


async def test_killed_client_stops_its_sequence_others_go_on(server, path, model):
    async with AsyncClient(path, timeout=T) as c:
        expected = await tokens_of(c.generate([9, 8, 7], model=model, max_tokens=40, options=GREEDY))
        victim = await Raw.open(path)
        # greedy: [1, 2, 3] runs 2560 tokens before an end token (sampled, it may end before the
        # test sees it decoding: the compute thread runs ahead of the replies)
        await victim.send(Generate(777, model, tokens=[1, 2, 3], max_tokens=3000, options=GREEDY))
        assert isinstance(await victim.recv(), Chunk)
        batcher = server.handler.registry.find(model).batcher
        async with asyncio.timeout(T):  # its first chunk may come before it is listed as active
            while (seq := next((s for s in batcher._active if s.id == 777), None)) is None:
                await asyncio.sleep(0.001)
        survivor = asyncio.create_task(tokens_of(c.generate([9, 8, 7], model=model, max_tokens=40,
                                                            options=GREEDY)))
        async with asyncio.timeout(T):
            while batcher.active < 2:
                await asyncio.sleep(0.001)
        victim.writer.transport.abort()  # killed: the socket just goes away
        async with asyncio.timeout(T):
            while not seq.cancelled:
                await asyncio.sleep(0.0005)
            at_cancel = seq.eval_count
            while seq.cache is not None or seq in batcher._active:
                await asyncio.sleep(0.001)
        assert seq.eval_count <= at_cancel + 1 and seq.eval_count < 3000
        assert await asyncio.wait_for(survivor, T) == expected
        assert server.handler.inflight == 0


async def test_cancel_ends_the_stream_with_cancelled(server, path, model):
    raw = await Raw.open(path)
    await raw.send(Generate(3, model, tokens=[1, 2], max_tokens=3000))
    assert isinstance(await raw.recv(), Chunk)
    await raw.send_bytes(pack_frame(msgspec.msgpack.encode(["X", 3])))
    await raw.send_bytes(pack_frame(msgspec.msgpack.encode(["X", 99])))  # unknown id: ignored
    while isinstance(r := await raw.recv(), Chunk):
        pass
    assert (r.id, r.code) == (3, "cancelled")
    await raw.send(Health(4))
    assert isinstance(await raw.recv(), HealthReply)
    raw.close()


async def test_queue_full_is_busy(path, model):
    async with make_server(path, queue_size=2, max_batch=1), AsyncClient(path, timeout=T) as c:
        await c.load(model)
        raw = await Raw.open(path)
        for i in (2, 3):  # one decoding, one waiting for a place in the batch
            await raw.send(Generate(i, model, tokens=[1, i], max_tokens=3000))
        await raw.send(Generate(4, model, tokens=[1], max_tokens=1))
        while (r := await raw.recv()).id != 4:
            assert isinstance(r, Chunk)  # at once: 2 and 3 (up to 3000 tokens) have not ended before it
        assert r.code == "busy"
        with pytest.raises(Busy):  # through the client library too
            await tokens_of(c.generate([1], model=model, max_tokens=1))
        raw.close()
        async with asyncio.timeout(T):
            while True:  # the cancelled ones leave the queue; then there is room again
                try:
                    assert len(await tokens_of(c.generate([1], model=model, max_tokens=2))) == 2
                    break
                except Busy:
                    await asyncio.sleep(0.01)


async def test_shutdown_during_generation_ends_every_stream(path, model):
    server = make_server(path)
    await server.start()
    clients = [AsyncClient(path, timeout=T) for _ in range(3)]
    gens = [c.generate([1 + i, 2], model=model, max_tokens=3000) for i, c in enumerate(clients)]
    firsts = await asyncio.gather(*(g.__anext__() for g in gens))
    assert all(isinstance(f, Chunk) for f in firsts)
    async with AsyncClient(path, timeout=T) as admin:
        await admin.shutdown()  # answered Ok, then the streams end

    async def drain(g):
        with pytest.raises(ServerError) as e:
            async for _ in g:
                pass
        return e.value.code

    codes = await asyncio.wait_for(asyncio.gather(*(drain(g) for g in gens)), T)
    assert codes == ["shutdown"] * 3
    await asyncio.wait_for(server.wait_closed(), T)
    assert not os.path.exists(path)
    with pytest.raises(NotRunning):
        await AsyncClient(path).connect()
    for c in clients:
        await c.close()


async def test_failed_load_answers_the_requester_and_the_daemon_stays_up(server, path, model, tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\x03\x00\x00\x00" + b"\xff" * 64)
    async with AsyncClient(path, timeout=T) as c:
        with pytest.raises(ModelError) as e:
            await c.load(str(bad))
        assert e.value.code == "model_error"
        with pytest.raises(ModelError) as e:
            await tokens_of(c.generate([1], model=str(bad)))
        assert e.value.code == "model_error"
        with pytest.raises(ModelError) as e:
            await c.load(str(tmp_path / "missing.gguf"))
        assert e.value.code == "not_found"
        with pytest.raises(BadRequest) as e:
            await c.load(model, numerix="x")
        assert e.value.code == "bad_request"
        assert await c.ps() == []
        assert len(await tokens_of(c.generate([1, 2], model=model, max_tokens=2))) == 2
        await c.health()


async def test_keep_alive_zero_unloads(server, path, model):
    async with AsyncClient(path, timeout=T) as c:
        loaded = await c.load(model)
        assert loaded.load_duration > 0 and [m.name for m in await c.ps()] == [model]
        gen = c.generate([1, 2], model=model, max_tokens=2, keep_alive=0)
        await tokens_of(gen)
        assert gen.done.load_duration == 0
        async with asyncio.timeout(T):
            while await c.ps():
                await asyncio.sleep(0.01)
        gen = c.generate([1, 2], model=model, max_tokens=2)  # loads again
        await tokens_of(gen)
        assert gen.done.load_duration > 0
        await c.unload(model)
        assert await c.ps() == []


async def test_two_concurrent_loads_load_once(server, path, model):
    async with AsyncClient(path, timeout=T) as c1, AsyncClient(path, timeout=T) as c2:
        a, b = await asyncio.gather(c1.load(model), c2.load(model))
        assert a.model == b.model == model
        assert server.handler.registry.factory.calls == 1
        (info,) = await c1.ps()
        assert info.arch == "qwen3moe" and info.expert_cache_bytes > 0 and info.expires_at > time.time()


async def test_stats_and_health(server, path, model):
    async with AsyncClient(path, timeout=T) as c:
        assert await c.stats() == {}
        await tokens_of(c.generate([1, 2, 3], model=model, max_tokens=4))
        stats = await c.stats()
        layers = stats[model]["cache"]["layers"]
        assert layers and all("bytes_read" in v for v in layers.values())
        assert stats[model]["scheduler"]["step_tokens"] >= 3
        assert (await c.stats(model)).keys() == {model}
        with pytest.raises(ModelError):
            await c.stats("/not/loaded.gguf")
        h = await c.health()
        assert h.uptime_s >= 0 and h.version


async def test_a_waiting_generate_and_load_get_the_loads_progress(path, model):
    from tests.scheduler.test_scheduler import Gate, until

    gate = Gate()
    cfg = Settings.load(env={})
    async with service.make_server(cfg, path, scheduler=Scheduler(cfg, factory=gate), close_timeout=T), \
            AsyncClient(path, timeout=T) as c:
        generated, loaded = [], []
        gen = c.generate([1, 2], model=model, max_tokens=2, options=GREEDY, on_progress=generated.append)
        text = asyncio.create_task(asyncio.wait_for(_text(gen), T))
        await until(lambda: generated)  # the daemon's compute thread is still loading
        load = asyncio.create_task(c.load(model, on_progress=loaded.append))
        await until(lambda: loaded)
        gate.go.set()
        await asyncio.gather(text, load)
    assert gen.done is not None and gen.done.eval_count == 2
    for seen in (generated, loaded):
        assert all(isinstance(p, Progress) for p in seen)
        assert any(p.message == "reading the file" for p in seen)
        assert (seen[-1].phase, seen[-1].percent) == ("load", 100.0)


async def _text(gen) -> str:
    return "".join([chunk.text async for chunk in gen])
