"""Client library for the moed daemon: AsyncClient (asyncio) and Client (blocking).

    async with AsyncClient() as c:               with Client() as c:
        gen = c.generate("Hi", max_tokens=32)        gen = c.generate("Hi", max_tokens=32)
        async for chunk in gen:                      for chunk in gen:
            print(chunk.text, end="")                    print(chunk.text, end="")
        print(gen.done.eval_count)                   print(gen.done.eval_count)

One connection per client, opened on first use (with the Hello handshake) and reopened after it
is lost. Every request carries a fresh id and replies are routed by id, so on an AsyncClient any
number of tasks may generate at once over the one connection. Client is for one thread; it too
buffers replies by id, so a request made while a generation is unfinished still works.

generate()/chat() return a Generation: an iterator of Chunk whose Done is put in `.done` when the
stream ends (errors are raised, see ipc.errors). Leaving it early (break, close()/aclose(), a
`with` block, garbage collection) sends Cancel and drops the rest of that stream.

Progress: while a request waits for the daemon (building the demo model, loading the model,
compiling kernels), it may get Progress replies. generate(), chat() and load() take
`on_progress`, called with each Progress (from the iterating thread or task); without it they are
skipped. They count as replies for `timeout`.

Timeouts: `connect_timeout` bounds connecting plus the handshake; `timeout` bounds the wait for
each reply (inactivity, not the whole generation; None = wait forever). On Timeout an
AsyncClient cancels the generation and keeps the connection; a Client closes its connection
(the next call reconnects), since a frame may have been cut in half. A connect that finds the
daemon's listen queue full (EAGAIN) is retried with a short backoff until connect_timeout. The
Timeout's message names the limit that fired (a stopped daemon fails the handshake on
connect_timeout, not on timeout).

Who is listening: right after connecting, before a byte is sent, the client reads the server's
uid from the kernel (SO_PEERCRED). It must be the client's own uid, root, or `expected_uid=`
(to use another user's daemon); anything else raises Impostor. Another user who can write to the
socket's directory could otherwise put a listener of their own at the daemon's path and read
every prompt. This module imports nothing from `daemon` (no numba).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import itertools
import os
import socket as _socket
import struct
import time
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from .errors import BadRequest, ClientError, Impostor, NotRunning, ProtocolError, Timeout, error_for
from .framing import MAX_FRAME, pack_frame, read_frame, recv_frame, send_frame
from .protocol import (
    PROTOCOL_VERSION,
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
    Ps,
    PsReply,
    Reply,
    Request,
    SamplingOptions,
    Shutdown,
    Stats,
    StatsReply,
    Unload,
    decode_reply,
    encode,
)

__all__ = ["AsyncClient", "AsyncGeneration", "Client", "Generation", "default_socket_path", "peer_cred"]

_NO_DAEMON = (errno.ENOENT, errno.ECONNREFUSED, errno.ENOTSOCK)
_CRED = struct.Struct("3i")  # struct ucred: pid, uid, gid
_BACKOFF_FIRST, _BACKOFF_MAX = 0.002, 0.1  # seconds between connects while the listen queue is full


def default_socket_path() -> str:
    """$MOED_SOCKET, else $XDG_RUNTIME_DIR/moed.sock, else /tmp/moed-<uid>/moed.sock; absolute
    (a daemon started from here runs in "/")."""
    if path := os.environ.get("MOED_SOCKET"):
        return os.path.abspath(path)
    if runtime := os.environ.get("XDG_RUNTIME_DIR"):
        return os.path.join(os.path.abspath(runtime), "moed.sock")
    return f"/tmp/moed-{os.getuid()}/moed.sock"


# -- shared between the two clients -------------------------------------------------------------

@contextlib.contextmanager
def _refused_locally():
    """A request the daemon would refuse (the structs check themselves: ValueError, TypeError, a
    KeyError for a message without a role) fails here as the daemon's reply would: BadRequest."""
    try:
        yield
    except (ValueError, TypeError, KeyError) as e:
        raise BadRequest(f"invalid request: {e}", code="bad_request") from None


def _options(options: SamplingOptions | Mapping[str, Any] | None) -> SamplingOptions | None:
    return SamplingOptions(**options) if isinstance(options, Mapping) else options


def _generate(id: int, prompt: str | Sequence[int], model, max_tokens, options, stop, keep_alive,
              raw, format=None) -> Generate:
    with _refused_locally():
        text, tokens = (prompt, None) if isinstance(prompt, str) else (None, [int(t) for t in prompt])
        return Generate(id, model, text, tokens, max_tokens, _options(options), list(stop), keep_alive, raw,
                        _format(format))


def _chat(id: int, messages: Iterable[Message | Mapping[str, Any]], model, max_tokens, options,
          stop, keep_alive, format=None, tools=None) -> Chat:
    with _refused_locally():
        msgs = [m if isinstance(m, Message) else Message(**m) for m in messages]
        return Chat(id, msgs, model, max_tokens, _options(options), list(stop), keep_alive, _format(format),
                    list(tools) if tools else None)


def _format(format) -> str | None:
    """A format as the wire takes it: "json", a JSON schema (a dict, sent as its text), or None."""
    if format is None or isinstance(format, str):
        return format
    import json

    return json.dumps(format)


def _expect(reply: Reply, kind: type):
    if isinstance(reply, Error):
        raise error_for(reply.code, reply.message, reply.id)
    if not isinstance(reply, kind):
        raise ProtocolError(f"expected {kind.__name__}, got {type(reply).__name__}")
    return reply


def _check_hello(reply: Reply) -> HealthReply:
    hello = _expect(reply, HealthReply)
    if hello.protocol != PROTOCOL_VERSION:
        raise ProtocolError(f"daemon speaks protocol {hello.protocol}, client {PROTOCOL_VERSION}",
                            code="bad_version")
    return hello


def _connect_error(path: str, e: OSError) -> ClientError:
    if e.errno in _NO_DAEMON:
        return NotRunning(f"no moed daemon at {path} ({e.strerror or e}); start one with `moed serve`")
    return ClientError(f"cannot connect to {path}: {e}")


# -- connecting: a full listen queue is retried; the peer is checked before anything is sent -------

def peer_cred(sock) -> tuple[int, int, int] | None:
    """(pid, uid, gid) of the process at the other end of an AF_UNIX socket (SO_PEERCRED; for a
    listening server, as of its listen()), or None where the kernel cannot tell."""
    try:
        raw = sock.getsockopt(_socket.SOL_SOCKET, _socket.SO_PEERCRED, _CRED.size)
    except (OSError, AttributeError):
        return None
    return _CRED.unpack(raw)


def _check_peer(sock, path: str, expected_uid: int | None) -> None:
    """Impostor unless the server runs as us, as root, or as the uid we were told to expect."""
    cred = peer_cred(sock)
    uid = None if cred is None else cred[1]
    trusted = {os.getuid(), 0} | ({expected_uid} if expected_uid is not None else set())
    if uid in trusted:
        return
    who = "a user the kernel does not name" if uid is None else f"uid {uid}"
    hint = "" if uid is None else f"If that is the daemon you mean, pass expected_uid={uid}; otherwise "
    raise Impostor(f"the process listening on {path} runs as {who}, not as you (uid {os.getuid()}) or "
                   f"root: refusing to talk to it. {hint or 'Perhaps '}someone has taken the daemon's "
                   f"socket path (check its directory's owner and permissions)")


def _try_connect(path: str) -> _socket.socket | None:
    """A non-blocking socket connected to `path`, or None while the listen queue is full."""
    sock = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
    sock.setblocking(False)
    try:
        sock.connect(path)  # AF_UNIX connects at once, or fails with EAGAIN when the queue is full
    except BlockingIOError:
        sock.close()
        return None
    except BaseException:
        sock.close()
        raise
    return sock


def _pauses():
    pause = _BACKOFF_FIRST
    while True:
        yield pause
        pause = min(pause * 2, _BACKOFF_MAX)


def _deadline(timeout: float | None) -> float | None:
    return None if timeout is None else time.monotonic() + timeout


def _left(deadline: float | None) -> float | None:
    return None if deadline is None else max(1e-3, deadline - time.monotonic())  # 0 would mean non-blocking


def _timed_out(limit: str, seconds: float | None) -> Timeout:
    """The Timeout for a wait that `limit` ("timeout" or "connect_timeout") bounded."""
    if limit == "connect_timeout":
        return Timeout(f"the daemon did not answer the handshake within connect_timeout={seconds:.3g} s")
    return Timeout(f"no reply from the daemon within timeout={seconds:.3g} s")


def _queue_full(path: str) -> Timeout:
    return Timeout(f"connecting to {path} timed out: the daemon's listen queue stayed full")


def _attempt(path: str, deadline: float | None, pause: float, expected_uid: int | None) -> _socket.socket | None:
    """One connect: the socket, its peer checked; or None to try again after `pause` (the listen
    queue is full); Timeout when the deadline would pass first."""
    try:
        sock = _try_connect(path)
    except OSError as e:
        raise _connect_error(path, e) from None
    if sock is None:
        if deadline is not None and time.monotonic() + pause > deadline:
            raise _queue_full(path)
        return None
    try:
        _check_peer(sock, path, expected_uid)
    except BaseException:
        sock.close()
        raise
    return sock


def _connect_sync(path: str, deadline: float | None, expected_uid: int | None) -> _socket.socket:
    for pause in _pauses():
        if (sock := _attempt(path, deadline, pause, expected_uid)) is not None:
            return sock
        time.sleep(pause)


async def _connect_async(path: str, deadline: float | None, expected_uid: int | None) -> _socket.socket:
    for pause in _pauses():
        if (sock := _attempt(path, deadline, pause, expected_uid)) is not None:
            return sock
        await asyncio.sleep(pause)


def _progressed(reply: Reply, on_progress) -> bool:
    """Whether reply is a Progress (handed to on_progress, if any): the caller reads on."""
    if not isinstance(reply, Progress):
        return False
    if on_progress is not None:
        on_progress(reply)
    return True


class _GenerationBase:
    """State shared by the sync and async generation iterators."""

    def __init__(self, client, request: Generate | Chat, on_progress=None):
        self.id = request.id  # request id; pass to client.cancel() from elsewhere
        self.done: Done | None = None  # the final Done, once the stream has ended normally
        self.on_progress = on_progress  # called with each Progress reply
        self._client = client
        self._request = request
        self._started = False
        self._finished = False

    def _take(self, reply: Reply) -> Chunk | None:
        """The chunk to yield, or None when the stream ended with Done; raises on Error. Progress
        replies never reach it."""
        if isinstance(reply, Chunk):
            return reply
        self._finished = True
        self._client._forget(self.id)
        if isinstance(reply, Done):
            self.done = reply
            return None
        return _expect(reply, Done)  # raises: an Error, or a reply of the wrong kind

    def _abandon(self) -> None:
        """Stop listening; tell the daemon to stop if the stream is still running."""
        if self._started and not self._finished:
            self._finished = True
            self._client._forget(self.id)
            self._client._send_cancel(self.id)

    def __del__(self):
        with contextlib.suppress(Exception):  # loop or interpreter gone: the daemon sees the disconnect
            self._abandon()


# -- asyncio ------------------------------------------------------------------------------------

class AsyncGeneration(_GenerationBase):
    """`async for chunk in gen`; then `gen.done`. The request is sent on the first iteration."""

    def __aiter__(self):
        return self

    async def __anext__(self) -> Chunk:
        if self._finished:
            raise StopAsyncIteration
        try:
            if not self._started:  # one shot: a failed send is not retried
                self._started = True
                self._queue = await self._client._open(self._request)
            while _progressed(reply := await self._client._recv(self._queue), self.on_progress):
                pass
        except BaseException:  # Timeout, lost connection, task cancelled
            self._abandon()
            raise
        chunk = self._take(reply)
        if chunk is None:
            raise StopAsyncIteration
        return chunk

    async def aclose(self) -> None:
        self._abandon()

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        self._abandon()


class AsyncClient:
    """asyncio client over one AF_UNIX connection, shared by any number of tasks. expected_uid:
    also trust a daemon running as this user (see "Who is listening")."""

    def __init__(self, socket: str | None = None, timeout: float | None = 60.0, *,
                 connect_timeout: float | None = 5.0, max_frame: int = MAX_FRAME,
                 expected_uid: int | None = None):
        self.socket = socket or default_socket_path()
        self.timeout = timeout
        self.connect_timeout = connect_timeout
        self.expected_uid = expected_uid
        self.max_frame = max_frame
        self.server: HealthReply | None = None  # the daemon's answer to Hello
        self._ids = itertools.count(1)
        self._pending: dict[int, asyncio.Queue] = {}  # request id -> its replies
        self._writer: asyncio.StreamWriter | None = None
        self._reader_task: asyncio.Task | None = None
        self._lock = asyncio.Lock()

    async def __aenter__(self):
        await self.connect()
        return self

    async def __aexit__(self, *exc):
        await self.close()

    # -- connection --------------------------------------------------------------------------

    def _connected(self) -> bool:
        return self._writer is not None and not self._reader_task.done()

    async def connect(self) -> HealthReply:
        """Connect and shake hands (idempotent); returns the daemon's HealthReply."""
        async with self._lock:
            if self._connected():
                return self.server
            deadline = _deadline(self.connect_timeout)
            sock = await _connect_async(self.socket, deadline, self.expected_uid)
            try:
                reader, self._writer = await asyncio.open_unix_connection(sock=sock)
            except BaseException:
                sock.close()
                raise
            self._reader_task = asyncio.create_task(self._read_loop(reader))
            hello = Hello(next(self._ids), PROTOCOL_VERSION)
            try:
                queue = self._send(hello)
                reply = await self._recv(queue, _left(deadline), "connect_timeout")
                self._forget(hello.id)
                self.server = _check_hello(reply)
            except BaseException:
                await self._disconnect()
                raise
            return self.server

    async def close(self) -> None:
        await self._disconnect()

    async def _disconnect(self) -> None:
        task, writer = self._reader_task, self._writer
        self._writer = None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        if writer is not None:
            writer.close()
            try:
                await writer.wait_closed()
            except OSError:
                pass

    async def _read_loop(self, reader: asyncio.StreamReader) -> None:
        """Route every reply to its request's queue; on any end, fail what is still waiting."""
        failure: BaseException = NotRunning("the daemon closed the connection")
        try:
            while (frame := await read_frame(reader, self.max_frame)) is not None:
                reply = decode_reply(frame)
                if reply.id is None:  # an error about the connection, not one request
                    failure = error_for(reply.code, reply.message)
                    break
                if (queue := self._pending.get(reply.id)) is not None:
                    queue.put_nowait(reply)  # replies to forgotten (cancelled) ids are dropped
        except ClientError as e:
            failure = e
        except OSError as e:
            failure = NotRunning(f"connection to the daemon lost: {e}")
        except asyncio.CancelledError:
            failure = ClientError("the client was closed")
            raise
        finally:
            if self._writer is not None:
                self._writer.close()
            for queue in self._pending.values():
                queue.put_nowait(failure)
            self._pending.clear()

    # -- requests ----------------------------------------------------------------------------

    def _send(self, msg: Request) -> asyncio.Queue:
        """Register msg.id and write the frame (one write call, so frames never interleave)."""
        frame = pack_frame(encode(msg), self.max_frame)
        if not self._connected():
            raise NotRunning("not connected to the daemon")
        queue: asyncio.Queue = asyncio.Queue()
        self._pending[msg.id] = queue
        self._writer.write(frame)
        return queue

    async def _open(self, msg: Request) -> asyncio.Queue:
        await self.connect()
        queue = self._send(msg)
        try:
            await self._writer.drain()
        except OSError as e:
            self._forget(msg.id)
            raise NotRunning(f"connection to the daemon lost: {e}") from None
        return queue

    async def _recv(self, queue: asyncio.Queue, timeout: float | None = ..., limit: str = "timeout") -> Reply:
        """The next reply; `timeout` defaults to self.timeout, `limit` names it in the Timeout."""
        timeout = self.timeout if timeout is ... else timeout
        try:
            item = await asyncio.wait_for(queue.get(), timeout)
        except TimeoutError:
            raise _timed_out(limit, getattr(self, limit)) from None
        if isinstance(item, BaseException):
            raise item
        return item

    def _forget(self, id: int) -> None:
        self._pending.pop(id, None)

    def _send_cancel(self, id: int) -> None:
        if self._connected() and not self._writer.is_closing():
            self._writer.write(pack_frame(encode(Cancel(id))))  # no drain: callable from __del__

    async def _call(self, msg: Request, kind: type, on_progress=None):
        queue = await self._open(msg)
        try:
            while _progressed(reply := await self._recv(queue), on_progress):
                pass
            return _expect(reply, kind)
        finally:
            self._forget(msg.id)

    # -- API -----------------------------------------------------------------------------------

    def generate(self, prompt: str | Sequence[int], *, model: str | None = None, max_tokens: int = 256,
                 options: SamplingOptions | Mapping[str, Any] | None = None, stop: Sequence[str] = (),
                 keep_alive: float | None = None, raw: bool = False, on_progress=None,
                 format: str | Mapping[str, Any] | None = None) -> AsyncGeneration:
        """Stream a completion of `prompt` (text, or token ids). format: "json" or a JSON schema
        (a dict): the output is held to it."""
        msg = _generate(next(self._ids), prompt, model, max_tokens, options, stop, keep_alive, raw, format)
        return AsyncGeneration(self, msg, on_progress)

    def chat(self, messages: Iterable[Message | Mapping[str, str]], *, model: str | None = None,
             max_tokens: int = 256, options: SamplingOptions | Mapping[str, Any] | None = None,
             stop: Sequence[str] = (), keep_alive: float | None = None, on_progress=None,
             format: str | Mapping[str, Any] | None = None, tools: Sequence[Mapping[str, Any]] | None = None,
             ) -> AsyncGeneration:
        """Stream the assistant's reply; messages are Message or {"role": ..., "content": ...}
        (and a call's fields: tool_calls, tool_call_id, name). tools: function specs the chat
        template is given; the text is the model's own (the HTTP API parses calls out of it)."""
        msg = _chat(next(self._ids), messages, model, max_tokens, options, stop, keep_alive, format, tools)
        return AsyncGeneration(self, msg, on_progress)

    async def cancel(self, id: int) -> None:
        """Stop generation `id`; its iterator then raises Cancelled (unless it already finished)."""
        await self.connect()
        self._send_cancel(id)
        await self._writer.drain()

    async def load(self, model: str, *, keep_alive: float | None = None, on_progress=None, **settings) -> Loaded:
        return await self._call(Load(next(self._ids), model, settings, keep_alive), Loaded, on_progress)

    async def unload(self, model: str) -> None:
        await self._call(Unload(next(self._ids), model), Ok)

    async def ps(self) -> list[ModelInfo]:
        return (await self._call(Ps(next(self._ids)), PsReply)).models

    async def stats(self, model: str | None = None) -> dict[str, Any]:
        return (await self._call(Stats(next(self._ids), model), StatsReply)).stats

    async def health(self) -> HealthReply:
        return await self._call(Health(next(self._ids)), HealthReply)

    async def shutdown(self) -> None:
        await self._call(Shutdown(next(self._ids)), Ok)


# -- blocking -----------------------------------------------------------------------------------

class Generation(_GenerationBase):
    """`for chunk in gen`; then `gen.done`. The request is sent on the first iteration."""

    def __iter__(self):
        return self

    def __next__(self) -> Chunk:
        if self._finished:
            raise StopIteration
        if not self._started:
            self._client._send(self._request)
            self._started = True
        try:
            while _progressed(reply := self._client._recv(self.id), self.on_progress):
                pass
        except BaseException:
            self._abandon()
            raise
        chunk = self._take(reply)
        if chunk is None:
            raise StopIteration
        return chunk

    def close(self) -> None:
        self._abandon()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._abandon()


class Client:
    """Blocking client over one AF_UNIX socket; not thread-safe (use one per thread). expected_uid:
    also trust a daemon running as this user (see "Who is listening")."""

    def __init__(self, socket: str | None = None, timeout: float | None = 60.0, *,
                 connect_timeout: float | None = 5.0, max_frame: int = MAX_FRAME,
                 expected_uid: int | None = None):
        self.socket = socket or default_socket_path()
        self.timeout = timeout
        self.connect_timeout = connect_timeout
        self.expected_uid = expected_uid
        self.max_frame = max_frame
        self.server: HealthReply | None = None
        self._ids = itertools.count(1)
        self._sock: _socket.socket | None = None
        self._inbox: dict[int, deque] = {}  # open request id -> replies not yet taken

    def __enter__(self):
        self.connect()
        return self

    def __exit__(self, *exc):
        self.close()

    def connect(self) -> HealthReply:
        if self._sock is not None:
            return self.server
        deadline = _deadline(self.connect_timeout)
        sock = _connect_sync(self.socket, deadline, self.expected_uid)
        sock.settimeout(_left(deadline))
        self._sock = sock
        try:
            hello = Hello(next(self._ids), PROTOCOL_VERSION)
            self._send(hello)
            self.server = _check_hello(self._recv(hello.id, "connect_timeout"))
            self._forget(hello.id)
        except BaseException:
            self.close()
            raise
        sock.settimeout(self.timeout)
        return self.server

    def close(self) -> None:
        sock, self._sock = self._sock, None
        self._inbox.clear()  # open generations now raise NotRunning
        if sock is not None:
            sock.close()

    def _send(self, msg: Request) -> None:
        frame = pack_frame(encode(msg), self.max_frame)
        self.connect()
        self._inbox[msg.id] = deque()
        try:
            self._sock.sendall(frame)
        except OSError as e:
            said = self._parting_words()
            self.close()
            raise (said or NotRunning(f"connection to the daemon lost: {e}")) from None

    def _parting_words(self) -> ClientError | None:
        """The error a daemon sent before closing on us (forbidden, busy, shutdown), if it did: a
        refused connection may be closed before our first frame is written."""
        try:
            self._sock.settimeout(0.1)  # it is in our receive buffer already, or it never came
            frame = recv_frame(self._sock, self.max_frame)
            reply = decode_reply(frame) if frame is not None else None
        except (OSError, ClientError):
            return None
        if isinstance(reply, Error) and reply.id is None:
            return error_for(reply.code, reply.message)
        return None

    def _recv(self, id: int, limit: str = "timeout") -> Reply:
        """The next reply to request `id`, buffering replies to other open requests. `limit` names
        the setting the socket's timeout now comes from, for the Timeout."""
        while True:
            box = self._inbox.get(id)
            if box is None:
                raise NotRunning("the connection to the daemon was lost")
            if box:
                return box.popleft()
            try:
                frame = recv_frame(self._sock, self.max_frame)
                if frame is None:
                    raise NotRunning("the daemon closed the connection")
                reply = decode_reply(frame)
            except TimeoutError:
                self.close()
                raise _timed_out(limit, getattr(self, limit)) from None
            except OSError as e:
                self.close()
                raise NotRunning(f"connection to the daemon lost: {e}") from None
            except ClientError:
                self.close()
                raise
            if reply.id is None:
                self.close()
                raise error_for(reply.code, reply.message)
            if (other := self._inbox.get(reply.id)) is not None:
                other.append(reply)

    def _forget(self, id: int) -> None:
        self._inbox.pop(id, None)

    def _send_cancel(self, id: int) -> None:
        if self._sock is not None:
            try:
                send_frame(self._sock, encode(Cancel(id)))
            except OSError:
                self.close()

    def _call(self, msg: Request, kind: type, on_progress=None):
        self._send(msg)
        try:
            while _progressed(reply := self._recv(msg.id), on_progress):
                pass
            return _expect(reply, kind)
        finally:
            self._forget(msg.id)

    # -- API (as AsyncClient's) -----------------------------------------------------------------

    def generate(self, prompt: str | Sequence[int], *, model: str | None = None, max_tokens: int = 256,
                 options: SamplingOptions | Mapping[str, Any] | None = None, stop: Sequence[str] = (),
                 keep_alive: float | None = None, raw: bool = False, on_progress=None,
                 format: str | Mapping[str, Any] | None = None) -> Generation:
        msg = _generate(next(self._ids), prompt, model, max_tokens, options, stop, keep_alive, raw, format)
        return Generation(self, msg, on_progress)

    def chat(self, messages: Iterable[Message | Mapping[str, str]], *, model: str | None = None,
             max_tokens: int = 256, options: SamplingOptions | Mapping[str, Any] | None = None,
             stop: Sequence[str] = (), keep_alive: float | None = None, on_progress=None,
             format: str | Mapping[str, Any] | None = None, tools: Sequence[Mapping[str, Any]] | None = None,
             ) -> Generation:
        msg = _chat(next(self._ids), messages, model, max_tokens, options, stop, keep_alive, format, tools)
        return Generation(self, msg, on_progress)

    def cancel(self, id: int) -> None:
        self.connect()
        self._send_cancel(id)

    def load(self, model: str, *, keep_alive: float | None = None, on_progress=None, **settings) -> Loaded:
        return self._call(Load(next(self._ids), model, settings, keep_alive), Loaded, on_progress)

    def unload(self, model: str) -> None:
        self._call(Unload(next(self._ids), model), Ok)

    def ps(self) -> list[ModelInfo]:
        return self._call(Ps(next(self._ids)), PsReply).models

    def stats(self, model: str | None = None) -> dict[str, Any]:
        return self._call(Stats(next(self._ids), model), StatsReply).stats

    def health(self) -> HealthReply:
        return self._call(Health(next(self._ids)), HealthReply)

    def shutdown(self) -> None:
        self._call(Shutdown(next(self._ids)), Ok)
