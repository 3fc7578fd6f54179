"""Issue 9's socket, peer and connection defences (docs/security.md), each against the attack it
stops: an impostor on the socket path, unsafe socket directories, a planted lock symlink, a held
lock, MOED_ALLOWED_UIDS with real other users (uid 4242 and 4243: forked children that setuid, so
these tests run as root, else they skip), server-side paths and unreadable model files named by
another user,
a full listen backlog, one connection hogging the queue, a frame never finished, too many
connections; and the client's error classes for invalid requests."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import select
import shutil
import signal
import socket
import stat
import threading

import pytest

import ipc.client
import ipc.server
from daemon import service
from daemon.config import Settings
from daemon.engine import Engine
from daemon.scheduler import Scheduler
from daemon.scheduler.access import readable_by
from ipc import (
    AsyncClient,
    BadRequest,
    Busy,
    Client,
    ClientError,
    Forbidden,
    Impostor,
    ServerError,
    Timeout,
)
from ipc.errors import error_for
from ipc.framing import pack_frame, read_frame
from ipc.protocol import (
    PROTOCOL_VERSION,
    Chat,
    Chunk,
    Error,
    Generate,
    Health,
    HealthReply,
    Hello,
    Message,
    Ok,
    decode_reply,
    encode,
)
from ipc.server import Server, SocketInUse, UnsafeSocketPath
from ipc.testing import MockServer
from tests.fixtures.build import fixture_path
from tests.ipc.raw import Raw

T = 60  # seconds before a test fails rather than hangs
OTHER, STRANGER = 4242, 4243  # uids of other local users (no such accounts needed)
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as other users")


@pytest.fixture
def path(shared_dir) -> str:
    return os.path.join(shared_dir, "moed.sock")


@pytest.fixture(scope="module")
def model(fixture_dir) -> str:
    return str(fixture_path("qwen3moe", "Q8_0", fixture_dir))


class Factory:
    """Engine.load, held back until `gate` is set: requests for a loading model stay open for as
    long as a test needs (a decoding one may end early, on an end-of-generation token)."""

    def __init__(self):
        self.gate = threading.Event()
        self.gate.set()

    def __call__(self, path, **settings):
        assert self.gate.wait(T)
        return Engine.load(path, **{"n_threads": 1, **settings})


def make_server(path, **settings) -> Server:
    cfg = Settings.load(env={}, **settings)
    sched = Scheduler(cfg, factory=Factory(), default_model=lambda _progress: "/nonexistent/demo.gguf")
    return service.make_server(cfg, path, scheduler=sched, close_timeout=T)


@contextlib.contextmanager
def loads_held(server: Server):
    gate = server.handler.registry.factory.gate
    gate.clear()
    try:
        yield
    finally:
        gate.set()


def as_user(uid: int, fn, *args, timeout: float = T):
    """fn(*args) in a forked child running as another user (uid and gid `uid`, no groups); its
    JSON result. Forked, not exec'ed: the interpreter may live where other users cannot reach."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        try:
            os.close(r)
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
            out = json.dumps(fn(*args))
        except BaseException as e:  # noqa: BLE001 - reported to the parent
            out = json.dumps({"child_error": repr(e)})
        os.write(w, out.encode())
        os._exit(0)
    os.close(w)
    try:
        with os.fdopen(r, "rb") as f:
            ready, _, _ = select.select([f], [], [], timeout)
            assert ready, "the child did not answer"
            result = json.loads(f.read())
    finally:
        os.waitpid(pid, 0)
    assert "child_error" not in result, result
    return result


# -- the client checks who it talks to -------------------------------------------------------------

class ImpostorListener:
    """Another user's process listening on the socket path, as one can in a 0777 directory: it
    records how many bytes a client sends it."""

    def __init__(self, path: str, uid: int = OTHER):
        os.chmod(os.path.dirname(path), 0o777)
        r, w = os.pipe()
        self.pid = os.fork()
        if self.pid == 0:
            os.close(r)
            self._listen(path, uid, w)
        os.close(w)
        self.pipe = os.fdopen(r, "rb")
        ready, _, _ = select.select([self.pipe], [], [], T)
        assert ready and self.pipe.readline().strip() == b"ready"

    @staticmethod
    def _listen(path: str, uid: int, w: int) -> None:
        try:
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.bind(path)
            s.listen(8)
            os.write(w, b"ready\n")
            s.settimeout(T)
            conn, _ = s.accept()
            conn.settimeout(5)
            got = 0
            try:
                while chunk := conn.recv(65536):
                    got += len(chunk)
            except OSError:
                pass
            os.write(w, b"%d\n" % got)
        finally:
            os._exit(0)

    def bytes_received(self) -> int:
        ready, _, _ = select.select([self.pipe], [], [], T)
        assert ready, "the impostor did not report"
        return int(self.pipe.readline())

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGKILL)
        os.waitpid(self.pid, 0)
        self.pipe.close()


@pytest.fixture
def impostor(path):
    imp = ImpostorListener(path)
    yield imp
    imp.kill()


@as_root
def test_client_refuses_an_impostor_and_sends_nothing(impostor, path):
    with pytest.raises(Impostor) as e:
        Client(path).connect()
    assert f"uid {OTHER}" in str(e.value) and "expected_uid" in str(e.value)
    assert impostor.bytes_received() == 0


@as_root
async def test_async_client_refuses_an_impostor_and_sends_nothing(impostor, path):
    with pytest.raises(Impostor):
        await AsyncClient(path).connect()
    assert await asyncio.to_thread(impostor.bytes_received) == 0


@as_root
def test_expected_uid_trusts_that_user(impostor, path):
    c = Client(path, connect_timeout=1, expected_uid=OTHER)
    with pytest.raises(Timeout):  # it is not a daemon: no HealthReply comes
        c.connect()
    assert impostor.bytes_received() > 0  # the Hello went out


def test_own_daemon_is_trusted(path):
    with MockServer(lambda req: [Ok(req.id)], path).in_thread(), Client(path) as c:
        assert c.server.version == "mock"


def test_peer_of_a_socket_pair_is_this_process():
    a, b = socket.socketpair(socket.AF_UNIX)
    with a, b:
        pid, uid, _gid = ipc.client.peer_cred(a)
        assert (pid, uid) == (os.getpid(), os.getuid())


# -- the client retries a full backlog ---------------------------------------------------------------

def _fill_backlog(path: str) -> list[socket.socket]:
    """Connections that fill the listen queue of a server that is not accepting."""
    held = []
    for _ in range(64):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.setblocking(False)
        try:
            s.connect(path)
        except BlockingIOError:
            s.close()
            return held
        held.append(s)
    raise AssertionError("the backlog never filled")


class StalledMock:
    """A MockServer (backlog 1) whose event loop is blocked until release()."""

    def __init__(self, path: str):
        self.gate = threading.Event()
        self.blocked = threading.Event()
        self.mock = MockServer(lambda req: [Ok(req.id)], path, backlog=1)
        self._cm = self.mock.in_thread()

    def __enter__(self):
        self._cm.__enter__()
        self.mock.loop.call_soon_threadsafe(self._block)
        assert self.blocked.wait(T)
        return self

    def _block(self) -> None:
        self.blocked.set()
        self.gate.wait(T)

    def release_after(self, seconds: float) -> None:
        threading.Timer(seconds, self.gate.set).start()

    def __exit__(self, *exc):
        self.gate.set()
        self._cm.__exit__(*exc)


def test_client_retries_a_full_backlog(path):
    with StalledMock(path) as stalled:
        held = _fill_backlog(path)
        stalled.release_after(0.5)
        with Client(path, connect_timeout=T) as c:
            assert c.server.version == "mock"
        for s in held:
            s.close()


def test_async_client_retries_a_full_backlog(path):
    async def connect():
        async with AsyncClient(path, connect_timeout=T) as c:
            return c.server.version

    with StalledMock(path) as stalled:
        held = _fill_backlog(path)
        stalled.release_after(0.5)
        assert asyncio.run(connect()) == "mock"
        for s in held:
            s.close()


def test_full_backlog_past_connect_timeout_is_timeout(path):
    with StalledMock(path):
        held = _fill_backlog(path)
        with pytest.raises(Timeout, match="connecting"):
            Client(path, connect_timeout=0.3).connect()
        with pytest.raises(Timeout, match="connecting"):
            asyncio.run(AsyncClient(path, connect_timeout=0.3).connect())
        for s in held:
            s.close()


# -- invalid requests are not daemon faults ----------------------------------------------------------

def test_invalid_request_codes_are_bad_request_not_server_error():
    for code in ("bad_request", "forbidden"):
        err = error_for(code, "why", 3)
        assert isinstance(err, BadRequest) and not isinstance(err, ServerError)
    assert isinstance(error_for("forbidden", "x"), Forbidden)
    assert isinstance(error_for("internal", "x"), ServerError)


def test_prompt_longer_than_the_context_is_bad_request(path):
    too_long = "prompt of 5000 tokens does not fit the context of 4096"
    with MockServer(lambda req: [Error(req.id, "bad_request", too_long)], path).in_thread(), Client(path) as c:
        with pytest.raises(BadRequest, match="does not fit"):
            list(c.generate("x" * 5000))


# -- the daemon's socket directory, lock and socket ------------------------------------------------------

async def test_world_writable_socket_directory_is_refused(path):
    os.chmod(os.path.dirname(path), 0o777)
    with pytest.raises(UnsafeSocketPath, match="writable"):
        await make_server(path).start()
    assert not os.path.exists(path)
    os.chmod(os.path.dirname(path), 0o775)  # group-writable too
    with pytest.raises(UnsafeSocketPath, match="writable"):
        await make_server(path).start()


@as_root
async def test_socket_directory_of_another_user_is_refused(path):
    os.chown(os.path.dirname(path), OTHER, OTHER)
    os.chmod(os.path.dirname(path), 0o700)
    with pytest.raises(UnsafeSocketPath, match=f"uid {OTHER}"):
        await make_server(path).start()
    assert not os.path.exists(path)


async def test_sticky_world_writable_directory_is_accepted(path):
    os.chmod(os.path.dirname(path), 0o1777)
    async with make_server(path), AsyncClient(path) as c:
        await c.health()


@as_root
async def test_socket_pre_created_by_another_user_is_refused(path):
    os.chmod(os.path.dirname(path), 0o1777)
    planted = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    planted.bind(path)
    planted.close()
    os.chown(path, OTHER, OTHER)
    with pytest.raises(UnsafeSocketPath, match=f"uid {OTHER}"):
        await make_server(path).start()
    assert os.stat(path).st_uid == OTHER  # left alone


async def test_missing_parent_is_created_0700(shared_dir):
    path = os.path.join(shared_dir, "run", "moed.sock")
    async with make_server(path):
        assert stat.S_IMODE(os.stat(os.path.dirname(path)).st_mode) == 0o700
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600


async def test_allowed_uids_open_the_socket_and_a_new_parent(shared_dir):
    path = os.path.join(shared_dir, "run", "moed.sock")
    async with make_server(path, allowed_uids=str(OTHER)):
        assert stat.S_IMODE(os.stat(os.path.dirname(path)).st_mode) == 0o711
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o666


async def test_planted_lock_symlink_creates_nothing(path, shared_dir):
    target = os.path.join(shared_dir, "created-by-the-daemon")
    os.symlink(target, path + ".lock")
    with pytest.raises(UnsafeSocketPath, match="lock"):
        await make_server(path).start()
    assert not os.path.lexists(target)
    precious = os.path.join(shared_dir, "precious")
    with open(precious, "w") as f:
        f.write("precious")
    os.unlink(path + ".lock")
    os.symlink(precious, path + ".lock")
    with pytest.raises(UnsafeSocketPath, match="lock"):
        await make_server(path).start()
    with open(precious) as f:
        assert f.read() == "precious"
    assert not os.path.exists(path)


async def test_lock_hard_linked_to_another_file_is_refused(path, shared_dir):
    precious = os.path.join(shared_dir, "precious")
    with open(precious, "w") as f:
        f.write("precious")
    os.link(precious, path + ".lock")
    with pytest.raises(UnsafeSocketPath, match="lock"):
        await make_server(path).start()
    with open(precious) as f:
        assert f.read() == "precious"


@as_root
async def test_lock_owned_by_another_user_is_refused(path):
    with open(path + ".lock", "w"):
        pass
    os.chown(path + ".lock", OTHER, OTHER)
    with pytest.raises(UnsafeSocketPath, match=f"uid {OTHER}"):
        await make_server(path).start()


async def test_held_lock_names_the_holders_pid(path):
    async with make_server(path):
        with open(path + ".lock") as f:
            assert f.read().strip() == str(os.getpid())
        with pytest.raises(SocketInUse, match=f"pid {os.getpid()}"):
            await make_server(path).start()


# -- MOED_ALLOWED_UIDS, with real other users -----------------------------------------------------------

def client_call(path: str, action: str, arg: str = "") -> dict:
    """One call through the blocking Client; what came of it (run as another user by as_user)."""
    try:
        with Client(path, timeout=T) as c:
            if action == "health":
                c.health()
            elif action == "trace":
                c.load(arg, expert_trace_output=arg + ".trace.json")
            elif action == "load":
                c.load(arg)
            elif action == "generate":
                list(c.generate([1, 2], model=arg, max_tokens=1))
        return {"ok": True}
    except ClientError as e:
        return {"ok": False, "cls": type(e).__name__, "code": e.code, "message": str(e)}


def other_user(uid: int, path: str, action: str, arg: str = "") -> dict:
    return as_user(uid, client_call, path, action, arg)


@as_root
async def test_allowed_uid_can_connect_others_cannot(shared_dir):
    path = os.path.join(shared_dir, "run", "moed.sock")
    async with make_server(path, allowed_uids=str(OTHER)):
        assert await asyncio.to_thread(other_user, OTHER, path, "health") == {"ok": True}
        refused = await asyncio.to_thread(other_user, STRANGER, path, "health")
        assert (refused["cls"], refused["code"]) == ("Forbidden", "forbidden")


@as_root
@pytest.mark.usefixtures("warm_kernels")  # it loads a model: compile outside the time limits
async def test_other_user_may_not_set_daemon_side_paths(shared_dir, model):
    path = os.path.join(shared_dir, "run", "moed.sock")
    readable = os.path.join(shared_dir, "model.gguf")
    shutil.copyfile(model, readable)
    os.chmod(readable, 0o644)
    async with make_server(path, allowed_uids=str(OTHER)):
        r = await asyncio.to_thread(other_user, OTHER, path, "trace", readable)
        assert (r["cls"], r["code"]) == ("Forbidden", "forbidden") and "expert_trace_output" in r["message"]
        assert not os.path.exists(readable + ".trace.json")
        assert await asyncio.to_thread(other_user, OTHER, path, "load", readable) == {"ok": True}


@as_root
async def test_other_user_may_only_name_model_files_it_can_read(shared_dir):
    path = os.path.join(shared_dir, "run", "moed.sock")
    secret = os.path.join(shared_dir, "shadow")
    with open(secret, "w") as f:
        f.write("root:$6$secret")
    os.chmod(secret, 0o600)
    async with make_server(path, allowed_uids=str(OTHER)):
        for action in ("load", "generate"):
            r = await asyncio.to_thread(other_user, OTHER, path, action, secret)
            assert (r["cls"], r["code"]) == ("Forbidden", "forbidden"), r
            assert "root" not in r["message"].replace(secret, "")
        os.chown(secret, OTHER, OTHER)  # its own file: it may name it (and gets the load error)
        r = await asyncio.to_thread(other_user, OTHER, path, "load", secret)
        assert r["code"] == "model_error"


async def test_untrusted_peer_checks_with_a_faked_uid(path, model, shared_dir, monkeypatch):
    """The same rules, without forking: the server is told the peer is uid 4242."""
    monkeypatch.setattr(ipc.server, "peer_cred", lambda sock: (os.getpid(), OTHER, OTHER))
    hidden = os.path.join(shared_dir, "hidden")
    os.mkdir(hidden, 0o700)
    inside = os.path.join(hidden, "model.gguf")
    shutil.copyfile(model, inside)
    os.chmod(inside, 0o644)  # world-readable, but in a directory uid 4242 cannot search
    async with make_server(path, allowed_uids=str(OTHER)), AsyncClient(path, timeout=T) as c:
        with pytest.raises(Forbidden, match="expert_trace_output"):
            await c.load(model, expert_trace_output=os.path.join(shared_dir, "trace.json"))
        with pytest.raises(Forbidden):
            await c.load(inside)
    assert not os.path.exists(os.path.join(shared_dir, "trace.json"))


# -- fairness and limits -----------------------------------------------------------------------------

async def test_two_hundred_back_to_back_connects_all_succeed(path):
    async with make_server(path):
        socks = []
        try:
            for _ in range(200):  # the event loop is blocked: nothing is accepted meanwhile
                s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                socks.append(s)
                s.setblocking(False)
                s.connect(path)  # BlockingIOError (EAGAIN) once the listen queue is full
            streams = [await asyncio.open_unix_connection(sock=s) for s in socks]
            for _, w in streams:
                w.write(pack_frame(encode(Hello(1, PROTOCOL_VERSION))))
            for r, _ in streams:
                assert isinstance(decode_reply(await asyncio.wait_for(read_frame(r), T)), HealthReply)
        finally:
            for s in socks:
                s.close()


@pytest.mark.usefixtures("warm_kernels")
async def test_requests_past_the_per_connection_cap_are_busy_at_once(path, model):
    async with make_server(path, max_requests_per_connection=2) as server:
        raw = await Raw.open(path)
        with loads_held(server):  # the first two stay open while the model loads
            for i in (2, 3, 4):
                await raw.send(Generate(i, model, tokens=[1, i], max_tokens=2))
            r = await raw.recv()
            assert (r.id, r.code) == (4, "busy") and "MOED_MAX_REQUESTS_PER_CONNECTION" in r.message
        finals = {}
        while len(finals) < 2:  # then they are served
            r = await raw.recv()
            if not isinstance(r, Chunk):
                finals[r.id] = type(r).__name__
        assert finals == {2: "Done", 3: "Done"}
        raw.close()


@pytest.mark.usefixtures("warm_kernels")
async def test_a_connection_that_queues_64_and_never_reads_does_not_starve_others(path, model):
    async with make_server(path) as server:
        hog = await Raw.open(path)
        with loads_held(server):
            for i in range(2, 66):
                hog.writer.write(pack_frame(encode(Generate(i, model, tokens=[1, 2], max_tokens=4))))
            await hog.writer.drain()
            async with asyncio.timeout(T):
                while server.handler.inflight < 16:
                    await asyncio.sleep(0.01)
            await asyncio.sleep(0.3)  # the rest of the hog's frames are read meanwhile
            assert server.handler.inflight == 16
            c = AsyncClient(path, timeout=T)
            other = asyncio.create_task(c.generate([3, 4], model=model, max_tokens=3).__anext__())
            async with asyncio.timeout(T):
                while server.handler.inflight < 17:
                    assert not other.done(), other.result()  # not busy: it waits its turn
                    await asyncio.sleep(0.01)
        assert isinstance(await asyncio.wait_for(other, T), Chunk)
        await c.close()
        hog.close()


async def test_a_frame_not_finished_in_time_disconnects(path):
    async with make_server(path, frame_timeout=0.3):
        idle = await Raw.open(path)
        slow = await Raw.open(path)
        slow.writer.write(b"\x00\x00")  # half a header, then nothing
        r = await slow.recv(timeout=10)
        assert (r.id, r.code) == (None, "bad_frame") and "MOED_FRAME_TIMEOUT" in r.message
        assert await slow.recv(timeout=10) is None  # closed
        body = await Raw.open(path)
        frame = pack_frame(encode(Health(2)))
        body.writer.write(frame[:-1])  # all but the last byte of a frame
        r = await body.recv(timeout=10)
        assert (r.id, r.code) == (None, "bad_frame")
        await asyncio.sleep(0.5)  # idle between frames is fine
        await idle.send(Health(3))
        assert isinstance(await idle.recv(), HealthReply)
        for raw in (idle, slow, body):
            raw.close()


async def test_one_connection_past_the_cap_is_busy_and_closed(path):
    async with make_server(path, max_connections=2):
        a, b = await Raw.open(path), await Raw.open(path)
        third = await Raw.open(path, hello=False)
        r = await third.recv()
        assert (r.id, r.code) == (None, "busy") and "MOED_MAX_CONNECTIONS" in r.message
        assert await third.recv() is None
        with pytest.raises(Busy):
            await AsyncClient(path).connect()
        a.close()
        async with asyncio.timeout(T):
            while True:  # a place is free once the server has seen a go
                try:
                    async with AsyncClient(path) as c:
                        await c.health()
                    break
                except Busy:
                    await asyncio.sleep(0.01)
        b.close()


# -- docs/security.md's claims, each against the defence it names ---------------------------------------

async def test_a_connection_that_leaves_its_replies_unread_is_closed(path, monkeypatch):
    """"Replies nobody reads": past WRITE_LIMIT bytes queued for a connection, it is closed. The
    rule at 64 KiB here (a flood of Health replies fills that fast; the server pauses reading a
    connection only past 1 MiB, so the flood goes on until the limit acts)."""
    assert ipc.server.WRITE_LIMIT == 64 * 2**20  # the figure docs/security.md states
    monkeypatch.setattr(ipc.server, "WRITE_LIMIT", 64 * 2**10)
    async with make_server(path) as server:
        hog = await Raw.open(path)
        other = await Raw.open(path)
        batch = pack_frame(encode(Health(2))) * 1000
        sent = 0
        async with asyncio.timeout(T):  # without the limit the server stops reading: the drain hangs
            while len(server.connections) == 2:
                assert sent < 10**6, "the server never closed the connection"
                try:
                    await hog.send_bytes(batch)
                except ConnectionError:
                    break
                sent += 1000
                await asyncio.sleep(0)
            while len(server.connections) == 2:
                await asyncio.sleep(0.01)
        await other.send(Health(3))  # the other connection goes on
        assert isinstance(await other.recv(), HealthReply)
        try:
            while isinstance(r := await hog.recv(), HealthReply):  # what the server had written, then
                pass
            assert r is None  # EOF: closed
        except ConnectionResetError:  # closed with requests of ours unread: the kernel resets it
            pass
        hog.close()
        other.close()


@as_root
async def test_a_socket_directory_behind_another_users_symlink_is_refused(shared_dir):
    real = os.path.join(shared_dir, "real")
    os.mkdir(real, 0o700)  # ours and safe: only the link is another user's
    link = os.path.join(shared_dir, "link")
    os.symlink(real, link)
    os.lchown(link, OTHER, OTHER)
    path = os.path.join(link, "moed.sock")
    with pytest.raises(UnsafeSocketPath, match=f"{link} is a symbolic link of uid {OTHER}"):
        await make_server(path).start()
    assert os.listdir(real) == []  # no socket, no lock
    os.lchown(link, os.geteuid(), os.getegid())  # our own link to our own directory is fine
    async with make_server(path), AsyncClient(path, timeout=T) as c:
        await c.health()


@as_root
def test_readable_by_follows_the_group_bits(shared_dir):
    """Mode bits as the kernel reads them: the owner's, else the group's (any of the peer's groups),
    else others'. A file and a directory open to group 4300 only."""
    group = 4300
    d = os.path.join(shared_dir, "team")
    os.mkdir(d)
    os.chown(d, OTHER, group)
    os.chmod(d, 0o711)  # first the file's bits: everyone may search the directory
    f = os.path.join(d, "model.gguf")
    with open(f, "wb") as fh:
        fh.write(b"GGUF")
    os.chown(f, OTHER, group)
    os.chmod(f, 0o040)  # readable by its group only (not even by its owner)
    assert readable_by(f, STRANGER, frozenset({STRANGER, group}))  # a supplementary group
    assert readable_by(f, STRANGER, frozenset({group}))
    assert not readable_by(f, STRANGER, frozenset({STRANGER}))  # outside the group: others' bits
    assert not readable_by(f, OTHER, frozenset({group}))  # the owner gets the owner's bits, not the group's
    os.chmod(f, 0o044)  # then the directory's: a readable file
    os.chmod(d, 0o710)  # searchable by its group only
    assert readable_by(f, STRANGER, frozenset({group}))
    assert not readable_by(f, STRANGER, frozenset({STRANGER}))
    os.chmod(d, 0o701)  # searchable by others, not by its group: a member gets the group's bits
    assert not readable_by(f, STRANGER, frozenset({group}))
    assert readable_by(f, STRANGER, frozenset({STRANGER}))


async def test_forbidden_says_the_same_whether_the_file_exists_or_not(path, shared_dir, monkeypatch):
    """A peer that may not search a directory learns nothing about what is in it."""
    monkeypatch.setattr(ipc.server, "peer_cred", lambda sock: (os.getpid(), OTHER, OTHER))
    hidden = os.path.join(shared_dir, "hidden")
    os.mkdir(hidden, 0o700)
    there, missing = os.path.join(hidden, "a.gguf"), os.path.join(hidden, "b.gguf")
    with open(there, "wb") as f:
        f.write(b"GGUF")
    os.chmod(there, 0o644)
    texts = {}
    async with make_server(path, allowed_uids=str(OTHER)), AsyncClient(path, timeout=T) as c:
        for name in (there, missing):
            calls = {"load": lambda: c.load(name),
                     "generate": lambda: tokens_of(c.generate([1, 2], model=name, max_tokens=1)),
                     "chat": lambda: tokens_of(c.chat([{"role": "user", "content": "hi"}], model=name,
                                                      max_tokens=1))}
            for what, call in calls.items():
                with pytest.raises(ClientError) as e:
                    await call()
                texts.setdefault(what, []).append((type(e.value).__name__, e.value.code,
                                                   str(e.value).replace(name, "NAME")))
    for what, (a, b) in texts.items():
        assert a == b, what
        assert a[:2] == ("Forbidden", "forbidden"), a


async def tokens_of(stream) -> list:
    return [r async for r in stream]


@pytest.mark.usefixtures("warm_kernels")  # it loads a model: compile outside the time limits
async def test_shutdown_does_not_wait_for_a_template_render(path, model):
    """A render that never ends on its own (held here until the test's end): the shutdown ends the
    request and completes anyway, and the render's thread is a daemon thread, so the process's exit
    does not wait for it either."""
    started, release, threads = threading.Event(), threading.Event(), []

    def render_forever(*args, **kwargs):
        threads.append(threading.current_thread())
        started.set()
        release.wait()
        return "hi"

    server = make_server(path)
    await server.start()
    try:
        await server.handler.load(model)
        engine = server.handler.registry.find(model).engine
        engine.gguf.metadata["tokenizer.chat_template"] = "{{ messages[0].content }}"  # a template: it renders
        engine.apply_chat_template = render_forever
        raw = await Raw.open(path)
        await raw.send(Chat(2, [Message("user", "hi")], model, 2))
        assert await asyncio.to_thread(started.wait, T)
        async with asyncio.timeout(T):  # only a hang guard: a shutdown that waited for the render ends here
            await server.shutdown()
            r = await raw.recv()
        assert (r.id, r.code) == (2, "shutdown")
        assert not release.is_set() and threads[0].is_alive()  # the render still runs, and the shutdown is done
        assert threads[0].daemon
        raw.close()
    finally:
        release.set()
        if not server.stopping:  # (a shutdown cut short by the guard is not waited for again)
            await server.shutdown()


# -- the default model is checked like a named one (issue 25, item 4) ---------------------------------

async def test_default_model_is_checked_for_other_users_as_a_named_one(path, shared_dir, monkeypatch):
    """uid 4242 naming no model used to be served from a file it could not read (a 0600 default);
    the scheduler now checks the default as it checks a named file, for every server."""
    monkeypatch.setattr(ipc.server, "peer_cred", lambda sock: (os.getpid(), OTHER, OTHER))
    secret = os.path.join(shared_dir, "default.gguf")
    with open(secret, "w") as f:
        f.write("root:$6$secret")
    os.chmod(secret, 0o600)
    cfg = Settings.load(env={}, allowed_uids=str(OTHER))
    sched = Scheduler(cfg, factory=Factory(), default_model=lambda _progress: secret)
    async with service.make_server(cfg, path, scheduler=sched, close_timeout=T), AsyncClient(path, timeout=T) as c:
        for request in (c.generate([1, 2], max_tokens=1), c.chat([{"role": "user", "content": "hi"}], max_tokens=1)):
            with pytest.raises(Forbidden) as e:
                async for _ in request:
                    pass
            assert secret not in str(e.value) and "default model" in str(e.value)
        with pytest.raises(Forbidden):
            await c.load(secret)
        assert sched.registry.loads == 0
