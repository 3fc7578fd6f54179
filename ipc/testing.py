"""A mock daemon for tests: the real framing and protocol on a real unix socket, replies scripted.

    def handler(req):                          # one request -> its replies
        if isinstance(req, Generate):
            return [Chunk(req.id, "hi", [1]), Done(req.id, eval_count=1)]
        return [Ok(req.id)]

    async with MockServer(handler, path) as server:        # for AsyncClient
        ...
    with MockServer(handler, path).in_thread() as server:  # for the blocking Client
        ...

handler(request) may return a list (any iterable) of replies, an async iterator of them (to pause
between replies, or stall), an awaitable of either, or None (no reply). As the daemon does, the
mock answers Hello itself (HealthReply, or Error("bad_version") when the client's protocol is not
`protocol`), runs each request in its own task so replies interleave, answers Cancel(id) by
cancelling that task and sending Error(id, "cancelled"), answers undecodable frames with
Error(request_id or None, code), and closes after a frame error that loses sync. Every decoded
request, Hello and Cancel included, is appended to `requests`. `backlog` is its listen queue (a
small one lets a test fill it); `loop` is the event loop it serves on, once started.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import os
import threading
from collections.abc import Callable, Iterator
from typing import Any

from .errors import FrameTooLarge, ProtocolError, TruncatedFrame
from .framing import MAX_FRAME, pack_frame, read_frame
from .protocol import (
    PROTOCOL_VERSION,
    Cancel,
    Error,
    HealthReply,
    Hello,
    Reply,
    Request,
    decode_request,
    encode,
)

Handler = Callable[[Request], Any]


class MockServer:
    def __init__(self, handler: Handler, path: str | os.PathLike, *, protocol: int = PROTOCOL_VERSION,
                 max_frame: int = MAX_FRAME, backlog: int = 100):
        self.handler = handler
        self.path = os.fspath(path)
        self.protocol = protocol  # what Hello accepts and HealthReply claims
        self.max_frame = max_frame
        self.backlog = backlog
        self.loop: asyncio.AbstractEventLoop | None = None
        self.requests: list[Request] = []
        self.connections = 0  # accepted so far
        self._server: asyncio.AbstractServer | None = None
        self._tasks: set[asyncio.Task] = set()

    async def start(self) -> MockServer:
        self.loop = asyncio.get_running_loop()
        self._server = await asyncio.start_unix_server(self._serve, self.path, backlog=self.backlog)
        return self

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)

    async def __aenter__(self):
        return await self.start()

    async def __aexit__(self, *exc):
        await self.close()

    async def wait_for(self, kind: type, timeout: float = 2.0) -> Request:
        """The first received request of this type, waiting for it if need be."""
        async with asyncio.timeout(timeout):
            while True:
                for req in self.requests:
                    if isinstance(req, kind):
                        return req
                await asyncio.sleep(0.005)

    @contextlib.contextmanager
    def in_thread(self) -> Iterator[MockServer]:
        """Serve from an event loop in a background thread (for blocking clients)."""
        loop = asyncio.new_event_loop()
        thread = threading.Thread(target=loop.run_forever, daemon=True)
        thread.start()
        try:
            asyncio.run_coroutine_threadsafe(self.start(), loop).result(5)
            yield self
        finally:
            asyncio.run_coroutine_threadsafe(self.close(), loop).result(5)
            loop.call_soon_threadsafe(loop.stop)
            thread.join(5)
            loop.close()

    # -- one connection ---------------------------------------------------------------------------

    def _spawn(self, coro) -> asyncio.Task:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        self._tasks.add(asyncio.current_task())
        running: dict[int, asyncio.Task] = {}  # request id -> its handler task
        try:
            while True:
                try:
                    frame = await read_frame(reader, self.max_frame)
                    if frame is None:
                        break
                    req = decode_request(frame)
                except (FrameTooLarge, TruncatedFrame) as e:  # out of sync: say why, then close
                    await self._send(writer, Error(None, e.code, str(e)))
                    break
                except ProtocolError as e:
                    await self._send(writer, Error(e.request_id, e.code, str(e)))
                    continue
                self.requests.append(req)
                if isinstance(req, Hello):
                    if req.protocol != self.protocol:
                        await self._send(writer, Error(req.id, "bad_version", f"mock speaks {self.protocol}"))
                        break
                    await self._send(writer, HealthReply(req.id, "mock", self.protocol, os.getpid()))
                elif isinstance(req, Cancel):
                    task = running.pop(req.id, None)
                    if task is not None and not task.done():
                        task.cancel()
                        await self._send(writer, Error(req.id, "cancelled", "cancelled by the client"))
                else:
                    running[req.id] = self._spawn(self._run(req, writer))
        except (ConnectionError, asyncio.CancelledError):
            pass
        finally:
            for task in running.values():
                task.cancel()
            writer.close()
            self._tasks.discard(asyncio.current_task())

    async def _run(self, req: Request, writer: asyncio.StreamWriter) -> None:
        try:
            replies = self.handler(req)
            if inspect.isawaitable(replies):
                replies = await replies
            if replies is None:
                return
            if hasattr(replies, "__aiter__"):
                async for reply in replies:
                    await self._send(writer, reply)
            else:
                for reply in replies:
                    await self._send(writer, reply)
        except (ConnectionError, asyncio.CancelledError):
            pass
        except Exception as e:  # noqa: BLE001 - a broken handler answers like a daemon bug would
            await self._send(writer, Error(req.id, "internal", repr(e)))

    @staticmethod
    async def _send(writer: asyncio.StreamWriter, reply: Reply) -> None:
        if writer.is_closing():
            return
        writer.write(pack_frame(encode(reply)))
        with contextlib.suppress(ConnectionError):
            await writer.drain()
