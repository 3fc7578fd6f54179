"""The moed daemon's unix-socket server: framing, handshake, dispatch to the scheduler, shutdown.

    server = Server(socket_path, settings)      # or Server() for $MOED_SOCKET / the standard path
    await server.start()                        # claims the socket (see below), starts accepting
    await server.wait_closed()                  # until Shutdown, SIGTERM/SIGINT (serve()) or shutdown()

    serve(socket_path, settings) -> int         # `moed serve`: the above with signal handlers

The socket
    - path: the argument, else settings.socket ($MOED_SOCKET), else ipc.client.default_socket_path();
      a missing parent directory is created 0700.
    - `PATH.lock` is flock()ed for the daemon's lifetime, so two daemons never race for one path.
    - an existing socket file is connected to: a live daemon there is never replaced (SocketInUse);
      a dead one's file (connection refused) is removed. Something that is not a socket is left alone.
    - bound under umask 0177, so the file is 0600 from the start; removed at exit (if still ours).
    - every connection's peer is checked with SO_PEERCRED: its uid must be the daemon's own, or one
      of settings.allowed_uids ($MOED_ALLOWED_UIDS); others get Error(None, "forbidden") and are closed.

Each connection: Hello first (HealthReply, or Error("bad_version") and close); then any number of
requests, each in its own task, replies routed by id (ipc.protocol). Frames that do not decode get
an error reply and the connection goes on; an oversized or truncated frame gets Error(None,
"bad_frame") and the connection is closed (its stream position is lost). A client that closes its
connection cancels its running generations. A client that stops reading while more than
WRITE_LIMIT bytes of replies pile up is disconnected.

Shutdown (Shutdown request, SIGTERM, SIGINT): stop accepting, remove the socket, end every open
request with Error("shutdown"), stop the models' compute threads (each finishes its current step),
close the connections.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import os
import signal
import socket
import stat
import struct
import sys
import time

from daemon.config import Settings
from daemon.errors import MoedError
from daemon.scheduler import Scheduler, SchedulerError

from .client import default_socket_path
from .errors import FrameTooLarge, ProtocolError, TruncatedFrame
from .framing import pack_frame, read_frame
from .protocol import (
    PROTOCOL_VERSION,
    Cancel,
    Chat,
    Chunk,
    Error,
    Generate,
    Health,
    HealthReply,
    Hello,
    Load,
    Loaded,
    ModelInfo,
    Ok,
    Ps,
    PsReply,
    Reply,
    Request,
    Shutdown,
    Stats,
    StatsReply,
    Unload,
    decode_request,
    encode,
)

__all__ = ["WRITE_LIMIT", "Server", "SocketInUse", "serve"]

log = logging.getLogger("moed.server")

WRITE_LIMIT = 64 * 2**20  # reply bytes queued for one connection before it counts as not reading
_CRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


class SocketInUse(MoedError):
    """Another daemon serves (or is starting) on this socket path, or the path is not a socket."""


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("moed")
    except Exception:  # noqa: BLE001 - not installed: running from a checkout
        return "0+unknown"


def _allowed_uids(spec: str) -> frozenset[int]:
    uids = {os.getuid()} if not spec.strip() else set()
    for part in spec.replace(" ", "").split(","):
        if part:
            try:
                uids.add(int(part))
            except ValueError:
                raise MoedError(f"MOED_ALLOWED_UIDS: {part!r} is not a user id") from None
    return frozenset(uids)


def peer_uid(sock) -> int | None:
    """The uid of the process at the other end of an AF_UNIX socket (SO_PEERCRED), or None."""
    try:
        raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CRED.size)
    except (OSError, AttributeError):
        return None
    return _CRED.unpack(raw)[1]


# -- one request, one connection ------------------------------------------------------------------

class _Open:
    """A request that has not had its final reply yet."""

    __slots__ = ("closed", "conn", "id", "stream", "task")

    def __init__(self, conn: _Connection, id: int, stream: bool):
        self.conn = conn
        self.id = id
        self.stream = stream  # Generate/Chat: Chunks before the final reply; Cancel applies
        self.task: asyncio.Task | None = None
        self.closed = False

    def reply(self, reply: Reply) -> None:
        """Send a reply; the first that is not a Chunk ends the request (later ones are dropped)."""
        if self.closed:
            return
        if not isinstance(reply, Chunk):
            self.closed = True
            if self.conn.open.get(self.id) is self:
                del self.conn.open[self.id]
        self.conn.send(reply)

    def end(self, code: str, message: str) -> None:
        """Final Error now; the work behind it is cancelled."""
        self.reply(Error(self.id, code, message))
        if self.task is not None:
            self.task.cancel()


class _Connection:
    def __init__(self, server: Server, writer: asyncio.StreamWriter):
        self.server = server
        self.writer = writer
        self.open: dict[int, _Open] = {}
        self.hello = False

    def send(self, reply: Reply) -> None:
        """Frame and write one reply (one write call: frames never interleave)."""
        if self.writer.is_closing():
            return
        try:
            frame = pack_frame(encode(reply), self.server.max_frame)
        except FrameTooLarge as e:
            frame = pack_frame(encode(Error(reply.id, "internal", f"reply too large: {e}")))
        self.writer.write(frame)
        if self.writer.transport.get_write_buffer_size() > WRITE_LIMIT:
            log.warning("a client does not read its replies; disconnecting it")
            self.close()

    def close(self) -> None:
        """The client is gone (or must go): cancel what it still waits for, close the socket."""
        for op in list(self.open.values()):
            op.closed = True
            if op.task is not None:
                op.task.cancel()
        self.open.clear()
        if not self.writer.is_closing():
            self.writer.close()


# -- the server ------------------------------------------------------------------------------------

class Server:
    def __init__(self, socket_path: str | os.PathLike | None = None, settings: Settings | None = None, *,
                 scheduler: Scheduler | None = None, close_timeout: float = 30.0, **scheduler_kw):
        self.settings = settings or Settings.load()
        self.path = os.fspath(socket_path or self.settings.socket or default_socket_path())
        self.max_frame = self.settings.max_frame
        self.allowed_uids = _allowed_uids(self.settings.allowed_uids)
        self.scheduler = scheduler or Scheduler(self.settings, **scheduler_kw)
        self.close_timeout = close_timeout  # seconds shutdown waits for the compute threads
        self.version = _version()
        self.started = time.time()
        self.connections: set[_Connection] = set()
        self.stopping = False
        self._server: asyncio.AbstractServer | None = None
        self._lock_fd: int | None = None
        self._inode: tuple[int, int] | None = None
        self._shutdown_task: asyncio.Task | None = None
        self._closed = asyncio.Event()
        self._tasks: set[asyncio.Task] = set()

    async def __aenter__(self):
        await self.start()
        return self

    async def __aexit__(self, *exc):
        await self.shutdown()

    # -- socket --------------------------------------------------------------------------------

    async def start(self) -> Server:
        sock = self._claim()
        try:
            self._server = await asyncio.start_unix_server(self._serve, sock=sock)
        except BaseException:
            sock.close()
            self._release()
            raise
        log.info("moed %s serving on %s (pid %d)", self.version, self.path, os.getpid())
        return self

    def _claim(self) -> socket.socket:
        parent = os.path.dirname(os.path.abspath(self.path))
        os.makedirs(parent, mode=0o700, exist_ok=True)
        fd = os.open(self.path + ".lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise SocketInUse(f"a moed daemon is already serving on {self.path} (or starting)") from None
        self._lock_fd = fd
        try:
            self._remove_stale()
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            old = os.umask(0o177)  # the socket is 0600 from the moment it exists
            try:
                sock.bind(self.path)
            except BaseException:
                sock.close()
                raise
            finally:
                os.umask(old)
            os.chmod(self.path, 0o600)
            st = os.stat(self.path)
            self._inode = (st.st_dev, st.st_ino)
            sock.listen(128)
            sock.setblocking(False)
            return sock
        except BaseException:
            self._release()
            raise

    def _remove_stale(self) -> None:
        try:
            st = os.lstat(self.path)
        except FileNotFoundError:
            return
        if not stat.S_ISSOCK(st.st_mode):
            raise SocketInUse(f"{self.path} exists and is not a socket; not replacing it")
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        probe.settimeout(1.0)
        try:
            probe.connect(self.path)
        except (ConnectionRefusedError, FileNotFoundError):
            log.info("removing the stale socket %s", self.path)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)
            return
        except OSError as e:  # a timeout: someone is there but slow; never steal it
            raise SocketInUse(f"{self.path} is in use ({e})") from None
        finally:
            probe.close()
        raise SocketInUse(f"a moed daemon is already serving on {self.path}")

    def _release(self) -> None:
        """Remove the socket file if it is still ours; drop the lock."""
        if self._inode is not None:
            try:
                st = os.stat(self.path)
                if (st.st_dev, st.st_ino) == self._inode:
                    os.unlink(self.path)
            except FileNotFoundError:
                pass
            self._inode = None
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    # -- connections ---------------------------------------------------------------------------

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn = _Connection(self, writer)
        uid = peer_uid(writer.get_extra_info("socket"))
        if uid not in self.allowed_uids:
            log.warning("refused a connection from uid %s", uid)
            conn.send(Error(None, "forbidden", f"uid {uid} may not use this daemon"))
            await self._flush_and_close(writer)
            return
        if self.stopping:
            conn.send(Error(None, "shutdown", "the daemon is shutting down"))
            await self._flush_and_close(writer)
            return
        self.connections.add(conn)
        try:
            while not writer.is_closing():
                try:
                    frame = await read_frame(reader, self.max_frame)
                    if frame is None:
                        break
                    req = decode_request(frame)
                except (FrameTooLarge, TruncatedFrame) as e:  # out of sync: say why, then close
                    conn.send(Error(None, e.code, str(e)))
                    break
                except ProtocolError as e:
                    conn.send(Error(e.request_id, e.code, str(e)))
                    continue
                if not self._dispatch(conn, req):
                    break
                if writer.transport.get_write_buffer_size() > 2**20:
                    await writer.drain()  # a client flooding requests waits for its replies
        except (ConnectionError, OSError):
            pass
        except asyncio.CancelledError:
            pass
        finally:
            self.connections.discard(conn)
            conn.close()
            await self._flush_and_close(writer)

    @staticmethod
    async def _flush_and_close(writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(Exception):
            await asyncio.wait_for(writer.drain(), 1.0)
        writer.close()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(writer.wait_closed(), 1.0)

    def _dispatch(self, conn: _Connection, req: Request) -> bool:
        """Handle one decoded request; False closes the connection."""
        if isinstance(req, Hello):
            if req.protocol != PROTOCOL_VERSION:
                conn.send(Error(req.id, "bad_version", f"the daemon speaks protocol {PROTOCOL_VERSION}, "
                                                       f"not {req.protocol}"))
                return False
            conn.hello = True
            conn.send(self._health(req.id))
            return True
        if not conn.hello:
            conn.send(Error(req.id, "bad_request", "a connection must start with Hello"))
            return True
        if isinstance(req, Cancel):
            op = conn.open.get(req.id)
            if op is not None and op.stream:
                op.end("cancelled", "cancelled by the client")
            return True
        if req.id in conn.open:
            conn.send(Error(req.id, "bad_request", f"request id {req.id} is already in use"))
            return True
        if self.stopping:
            conn.send(Error(req.id, "shutdown", "the daemon is shutting down"))
            return True
        if isinstance(req, Health):
            conn.send(self._health(req.id))
            return True
        if isinstance(req, Ps):
            conn.send(PsReply(req.id, [ModelInfo(**m) for m in self.scheduler.ps()]))
            return True
        op = _Open(conn, req.id, isinstance(req, (Generate, Chat)))
        conn.open[req.id] = op
        op.task = self._spawn(self._handle(op, req, time.perf_counter_ns()))
        return True

    def _health(self, id: int) -> HealthReply:
        return HealthReply(id, self.version, PROTOCOL_VERSION, os.getpid(), time.time() - self.started)

    def _spawn(self, coro) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def _handle(self, op: _Open, req: Request, received_ns: int) -> None:
        sched = self.scheduler
        try:
            if isinstance(req, (Generate, Chat)):
                await sched.generate(req, op.reply, received_ns)
            elif isinstance(req, Load):
                model, load_ns = await sched.load(req.model, req.settings, req.keep_alive)
                op.reply(Loaded(req.id, model.name, load_ns))
            elif isinstance(req, Unload):
                await sched.unload(req.model)
                op.reply(Ok(req.id))
            elif isinstance(req, Stats):
                op.reply(StatsReply(req.id, await sched.stats(req.model)))
            elif isinstance(req, Shutdown):
                op.reply(Ok(req.id))
                self.request_shutdown()
            else:  # a request type this daemon does not serve
                op.reply(Error(req.id, "bad_request", f"unsupported request {type(req).__name__}"))
        except SchedulerError as e:
            op.reply(Error(req.id, e.code, str(e)))
        except asyncio.CancelledError:
            pass  # cancelled by the client, a disconnect or shutdown (which sent the final reply)
        except Exception as e:  # a bug answers the request; the daemon goes on
            log.exception("request %s failed", type(req).__name__)
            op.reply(Error(req.id, "internal", f"{type(e).__name__}: {e}"))
        finally:
            if not op.closed:  # e.g. cancelled with no reply sent
                op.closed = True
                if op.conn.open.get(op.id) is op:
                    del op.conn.open[op.id]

    # -- shutdown ------------------------------------------------------------------------------

    def request_shutdown(self) -> None:
        """Start shutting down (from a signal handler or a Shutdown request); idempotent."""
        if self._shutdown_task is None:
            self._shutdown_task = asyncio.get_running_loop().create_task(self.shutdown())

    async def shutdown(self) -> None:
        if self.stopping:
            await self._closed.wait()
            return
        self.stopping = True
        log.info("shutting down")
        if self._server is not None:
            self._server.close()  # stop accepting
        self._release()
        for conn in list(self.connections):
            for op in list(conn.open.values()):
                op.end("shutdown", "the daemon is shutting down")
        try:
            await asyncio.wait_for(self.scheduler.close(), self.close_timeout)
        except TimeoutError:
            log.warning("compute threads still busy after %.0fs; exiting anyway", self.close_timeout)
        except Exception:
            log.exception("closing the models failed")
        for conn in list(self.connections):
            conn.close()
        writers = [c.writer for c in self.connections]
        await asyncio.gather(*(self._flush_and_close(w) for w in writers), return_exceptions=True)
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._server is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 1.0)
        log.info("stopped")
        self._closed.set()

    async def wait_closed(self) -> None:
        await self._closed.wait()


# -- moed serve --------------------------------------------------------------------------------------

def serve(socket_path: str | None = None, settings: Settings | None = None, **server_kw) -> int:
    """Run the daemon in the foreground until Shutdown, SIGTERM or SIGINT; the exit status."""

    async def main() -> None:
        server = Server(socket_path, settings, **server_kw)
        await server.start()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, _on_signal, server, sig)
        await server.wait_closed()

    try:
        asyncio.run(main())
    except SocketInUse as e:
        print(f"moed: error: {e}", file=sys.stderr)
        return 1
    except OSError as e:  # path too long, no permission, read-only file system, ...
        print(f"moed: error: cannot serve on the socket: {e}", file=sys.stderr)
        return 1
    return 0


def _on_signal(server: Server, sig: int) -> None:
    if server.stopping:
        log.warning("%s again: exiting now", signal.Signals(sig).name)
        os._exit(128 + sig)
    log.info("%s received", signal.Signals(sig).name)
    server.request_shutdown()
