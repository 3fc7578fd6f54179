"""The moed daemon's unix-socket server: framing, handshake, dispatch to a handler, shutdown.

    server = Server(config, handler=scheduler, error_of=wire_error)  # ipc.handler: ServerConfig, Handler
    await server.start()                        # claims the socket (see below), starts accepting
    await server.wait_closed()                  # until Shutdown, SIGTERM/SIGINT (serve()) or shutdown()

    serve(config, handler, **server_kw) -> int   # `moed serve`: the above with signal handlers

The handler (the daemon's Scheduler, built by daemon/service.py) does the work behind each request;
this module only frames, checks and routes. It imports nothing from daemon/ (ipc/handler.py).

The socket (docs/security.md says why each rule is there)
    - path: config.socket_path (the daemon's: --socket, else $MOED_SOCKET), else
      ipc.client.default_socket_path().
    - its directory must be the daemon's own (or root's) and not writable by group or others unless
      sticky (as /tmp), as ssh-agent and tmux insist; else UnsafeSocketPath. A missing one is
      created 0700 (0711 when config.allowed_uids names other users, so they can reach the socket).
    - `PATH.lock` is opened O_NOFOLLOW and must be a regular file of ours with one link (a planted
      symlink or hard link is refused, never followed or truncated); it is flock()ed for the
      daemon's lifetime and holds its pid, so a second daemon says which process holds it.
    - an existing socket file is connected to: a live daemon there is never replaced (SocketInUse);
      a dead one's file (connection refused) is removed if it is ours (another user's is refused).
      Something that is not a socket is left alone.
    - bound under umask 0177, so the file is 0600 from the start; 0666 when allowed_uids names other
      users (inside a 0711 directory): then SO_PEERCRED below is the gate. Removed at exit (if ours).
    - listen backlog BACKLOG (the kernel caps it at net.core.somaxconn); clients retry EAGAIN.
    - every connection's peer is checked with SO_PEERCRED: its uid must be the daemon's own, or one
      of config.allowed_uids ($MOED_ALLOWED_UIDS); others get Error(None, "forbidden") and are closed.
      Past config.max_connections open connections, one more gets Error(None, "busy") and is closed.

Each connection: Hello first (HealthReply, or Error("bad_version") and close); then any number of
requests, each in its own task, replies routed by id (ipc.protocol). Frames that do not decode get
an error reply and the connection goes on; an oversized or truncated frame, or one not finished
within config.frame_timeout of its first byte, gets Error(None, "bad_frame") and the connection is
closed (its stream position is lost). Waiting between frames has no limit. A connection may hold
config.max_requests_per_connection generations at once; one more gets Error(id, "busy") at once,
so one client cannot fill the daemon's queue. A Generate, Chat or Load that waits for a model (the
demo build, the load, the first kernel compile) gets the handler's Progress replies meanwhile
(they do not end the request). A client that closes its connection cancels its
running generations. A client that stops reading while more than WRITE_LIMIT bytes of replies pile
up is disconnected.

Each request goes to the handler with its peer's uid and groups: the daemon's scheduler holds a
user other than the daemon's own (or root) to what it could do itself (daemon/scheduler/access.py:
no daemon-side path settings, no model file, named or the default, that it could not read), else
Error(id, "forbidden"). A request that fails ends with Error(id, *error_of(exc)); an "internal"
one (a bug) is logged with its traceback.

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
import pwd
import signal
import socket
import stat
import sys
import time

from .client import default_socket_path, peer_cred
from .errors import FrameTooLarge, ProtocolError, SocketInUse, TruncatedFrame, UnsafeSocketPath
from .framing import pack_frame, read_frame
from .handler import ErrorOf, Handler, ServerConfig, internal_error
from .ownfile import NotOurFile, open_own
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
    Progress,
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

__all__ = ["BACKLOG", "WRITE_LIMIT", "PeerCred", "Server", "ServerConfig", "SocketInUse", "UnsafeSocketPath", "peer_cred",
           "prepare_socket_dir", "serve"]

log = logging.getLogger("moed.server")

WRITE_LIMIT = 64 * 2**20  # reply bytes queued for one connection before it counts as not reading
BACKLOG = max(socket.SOMAXCONN, 4096)  # connections the kernel queues before accept(); it caps this


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("moed")
    except Exception:  # noqa: BLE001 - not installed: running from a checkout
        return "0+unknown"


def prepare_socket_dir(socket_path: str, allowed_uids: frozenset[int] = frozenset()) -> str:
    """The socket's directory, created if missing (0700; 0711 when allowed_uids names other users,
    so they can reach the socket) and refused (UnsafeSocketPath) if another user could write to it:
    they could move our socket away and listen in its place. As ssh-agent and tmux: it must be
    ours or root's, and not writable by group or others unless sticky (as /tmp)."""
    uid = os.geteuid()
    others = bool(allowed_uids - {uid})
    parent = os.path.dirname(os.path.abspath(socket_path))
    mode = 0o711 if others else 0o700
    try:
        os.makedirs(parent, mode)
        os.chmod(parent, mode)  # the umask may have taken bits from it
    except FileExistsError:
        pass
    link = os.lstat(parent)
    if stat.S_ISLNK(link.st_mode) and link.st_uid not in (uid, 0):
        raise UnsafeSocketPath(f"{parent} is a symbolic link of uid {link.st_uid}: they could point it "
                               f"elsewhere; put the socket in a directory of your own (MOED_SOCKET)")
    st = os.stat(parent)
    if not stat.S_ISDIR(st.st_mode):
        raise UnsafeSocketPath(f"{parent} is not a directory")
    if st.st_uid not in (uid, 0):
        raise UnsafeSocketPath(f"the socket directory {parent} belongs to uid {st.st_uid}, not to this user "
                               f"(uid {uid}) or root: they could replace the socket; use a directory of "
                               f"your own (MOED_SOCKET)")
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not st.st_mode & stat.S_ISVTX:
        raise UnsafeSocketPath(f"the socket directory {parent} is writable by group or others (mode "
                               f"{stat.S_IMODE(st.st_mode):04o}): they could replace the socket; "
                               f"`chmod go-w {parent}`, or use a directory of your own (MOED_SOCKET)")
    if others and not st.st_mode & stat.S_IXOTH:
        log.warning("MOED_ALLOWED_UIDS names other users, but they cannot reach %s (mode %04o): "
                    "`chmod 711 %s`", parent, stat.S_IMODE(st.st_mode), parent)
    return parent


def _groups(uid: int, gid: int) -> frozenset[int]:
    """The groups a user's processes have: `gid` (from SO_PEERCRED) and its supplementary ones."""
    try:
        return frozenset(os.getgrouplist(pwd.getpwuid(uid).pw_name, gid))
    except (KeyError, OSError):  # a uid with no passwd entry: only the group the kernel told us
        return frozenset({gid})


def _lock_holder(fd: int) -> str:
    """" (pid N)" from a held lock file (its holder wrote its pid there), or "" if unreadable."""
    try:
        pid = int(os.pread(fd, 32, 0).decode().strip())
    except (OSError, ValueError, UnicodeDecodeError):
        return ""
    return f" (pid {pid})"


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
        """Send a reply; the first that is not a Chunk or Progress ends the request (later ones are
        dropped)."""
        if self.closed:
            return
        if not isinstance(reply, (Chunk, Progress)):
            self.closed = True
            if self.conn.open.get(self.id) is self:
                del self.conn.open[self.id]
        self.conn.send(reply)

    def end(self, code: str, message: str) -> None:
        """Final Error now; the work behind it is cancelled."""
        self.reply(Error(self.id, code, message))
        if self.task is not None:
            self.task.cancel()


class PeerCred:
    """Who is at the other end of a connection, as the kernel says (SO_PEERCRED); handed to the
    handler with each request (ipc.handler.Peer: the uid and gids it checks access with)."""

    __slots__ = ("gid", "uid", "_gids")

    def __init__(self, uid: int, gid: int):
        self.uid = uid
        self.gid = gid
        self._gids: frozenset[int] | None = None

    @property
    def gids(self) -> frozenset[int]:
        if self._gids is None:  # looked up once, and only for a peer that needs checking
            self._gids = _groups(self.uid, self.gid)
        return self._gids


class _Started:
    """The reader of a frame whose first byte is already read: read_frame sees it again."""

    def __init__(self, reader: asyncio.StreamReader, first: bytes):
        self.reader = reader
        self.first = first

    async def readexactly(self, n: int) -> bytes:
        head, self.first = self.first[:n], self.first[n:]
        try:
            return head + await self.reader.readexactly(n - len(head))
        except asyncio.IncompleteReadError as e:
            raise asyncio.IncompleteReadError(head + e.partial, n) from None


class _FrameTimeout(Exception):
    """A frame begun but not finished within frame_timeout."""


class _Connection:
    def __init__(self, server: Server, writer: asyncio.StreamWriter, peer: PeerCred | None = None):
        self.server = server
        self.writer = writer
        self.peer = peer
        self.open: dict[int, _Open] = {}
        self.hello = False

    def generations(self) -> int:
        """Generate/Chat requests of this connection without their final reply yet."""
        return sum(1 for op in self.open.values() if op.stream)

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
    def __init__(self, config: ServerConfig, *, handler: Handler, error_of: ErrorOf = internal_error,
                 close_timeout: float = 30.0):
        self.config = config
        self.path = os.fspath(config.socket_path or default_socket_path())
        self.max_frame = config.max_frame
        self.uid = os.geteuid()
        self.allowed_uids = frozenset(config.allowed_uids) | {self.uid}  # else `moed stop` is locked out
        self.for_others = bool(self.allowed_uids - {self.uid})  # the socket must be reachable by other users
        self.max_connections = max(1, config.max_connections)
        self.max_requests = max(1, config.max_requests_per_connection)
        self.frame_timeout = config.frame_timeout or None  # 0: no limit
        self.handler = handler
        self.error_of = error_of  # exc -> (code, message) of a failed request's Error reply
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
        self.on_shutdown: list = []  # async callables, awaited first at shutdown (the daemon's HTTP server)

    async def __aenter__(self):
        await self.start()
        return self

    async def __aexit__(self, *exc):
        await self.shutdown()

    # -- socket --------------------------------------------------------------------------------

    async def start(self) -> Server:
        sock = self._claim()
        try:
            self._server = await asyncio.start_unix_server(self._serve, sock=sock, backlog=BACKLOG)
        except BaseException:
            sock.close()
            self._release()
            raise
        log.info("moed %s serving on %s (pid %d)", self.version, self.path, os.getpid())
        return self

    def _claim(self) -> socket.socket:
        prepare_socket_dir(self.path, self.allowed_uids)
        self._lock_fd = self._take_lock(self.path + ".lock")
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
            # Opened up only for allowed_uids naming other users: SO_PEERCRED is then the gate.
            os.chmod(self.path, 0o666 if self.for_others else 0o600)
            st = os.stat(self.path)
            self._inode = (st.st_dev, st.st_ino)
            sock.listen(BACKLOG)
            sock.setblocking(False)
            return sock
        except BaseException:
            self._release()
            raise

    def _take_lock(self, lock: str) -> int:
        """flock the lock file for the daemon's lifetime and write our pid into it; never follow
        a link or truncate a file that is not a private lock of ours."""
        try:
            fd = open_own(lock, os.O_RDWR | os.O_CREAT, self.uid)
        except NotOurFile as e:
            raise UnsafeSocketPath(f"the lock file {lock} {e}; remove it if you made it, or use a directory "
                                   f"of your own (MOED_SOCKET)") from None
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _lock_holder(fd)
                raise SocketInUse(f"a moed daemon{holder} is already serving on {self.path} (or starting): "
                                  f"it holds {lock}") from None
            os.ftruncate(fd, 0)
            os.write(fd, f"{os.getpid()}\n".encode())
        except BaseException:
            os.close(fd)
            raise
        return fd

    def _remove_stale(self) -> None:
        try:
            st = os.lstat(self.path)
        except FileNotFoundError:
            return
        if not stat.S_ISSOCK(st.st_mode):
            raise SocketInUse(f"{self.path} exists and is not a socket; not replacing it")
        if st.st_uid != self.uid:
            raise UnsafeSocketPath(f"{self.path} is a socket of uid {st.st_uid}, not of this user (uid "
                                   f"{self.uid}); not replacing it: use a directory of your own (MOED_SOCKET)")
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
        refusal = self._admit(conn, writer.get_extra_info("socket"))
        if refusal is not None:
            conn.send(refusal)
            await self._flush_and_close(writer)
            return
        self.connections.add(conn)
        try:
            while not writer.is_closing():
                try:
                    frame = await self._read_frame(reader)
                    if frame is None:
                        break
                    req = decode_request(frame)
                except (FrameTooLarge, TruncatedFrame) as e:  # out of sync: say why, then close
                    conn.send(Error(None, e.code, str(e)))
                    break
                except _FrameTimeout:
                    conn.send(Error(None, "bad_frame", f"a frame was not finished within {self.frame_timeout:g} s "
                                                      f"of its first byte (MOED_FRAME_TIMEOUT); closing"))
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

    def _admit(self, conn: _Connection, sock) -> Error | None:
        """Who may connect: an allowed uid, while the daemon runs and has a connection slot."""
        cred = peer_cred(sock)
        uid, gid = (None, None) if cred is None else cred[1:]
        if uid not in self.allowed_uids:
            log.warning("refused a connection from uid %s", uid)
            return Error(None, "forbidden", f"uid {uid} may not use this daemon (MOED_ALLOWED_UIDS)")
        if self.stopping:
            return Error(None, "shutdown", "the daemon is shutting down")
        if len(self.connections) >= self.max_connections:
            log.warning("refused a connection: %d are open (MOED_MAX_CONNECTIONS)", len(self.connections))
            return Error(None, "busy", f"the daemon has {len(self.connections)} connections open "
                                       f"(MOED_MAX_CONNECTIONS={self.max_connections}); retry later")
        conn.peer = PeerCred(uid, gid)
        return None

    async def _read_frame(self, reader: asyncio.StreamReader) -> bytes | None:
        """The next frame, or None at a clean EOF. The wait for a frame to begin is unbounded; once
        its first byte is in, the rest must follow within frame_timeout (else _FrameTimeout)."""
        first = await reader.read(1)
        if not first:
            return None
        try:
            async with asyncio.timeout(self.frame_timeout):
                return await read_frame(_Started(reader, first), self.max_frame)
        except TimeoutError:
            raise _FrameTimeout from None

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
            conn.send(PsReply(req.id, [ModelInfo(**m) for m in self.handler.ps()]))
            return True
        stream = isinstance(req, (Generate, Chat))
        if stream and conn.generations() >= self.max_requests:
            conn.send(Error(req.id, "busy", f"this connection already has {self.max_requests} generation "
                                            f"requests open (MOED_MAX_REQUESTS_PER_CONNECTION); wait for "
                                            f"one to finish"))
            return True
        op = _Open(conn, req.id, stream)
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
        handler = self.handler
        try:
            peer = op.conn.peer
            if isinstance(req, (Generate, Chat)):
                await handler.generate(req, op.reply, received_ns, peer=peer)
            elif isinstance(req, Load):
                model, load_ns = await handler.load(req.model, req.settings, req.keep_alive, peer=peer,
                                                  progress=lambda *report: op.reply(Progress(req.id, *report)))
                op.reply(Loaded(req.id, model.name, load_ns))
            elif isinstance(req, Unload):
                await handler.unload(req.model)
                op.reply(Ok(req.id))
            elif isinstance(req, Stats):
                op.reply(StatsReply(req.id, await handler.stats(req.model)))
            elif isinstance(req, Shutdown):
                op.reply(Ok(req.id))
                self.request_shutdown()
            else:  # a request type this daemon does not serve
                op.reply(Error(req.id, "bad_request", f"unsupported request {type(req).__name__}"))
        except asyncio.CancelledError:
            pass  # cancelled by the client, a disconnect or shutdown (which sent the final reply)
        except Exception as e:  # the request's error reply; a bug is logged too, and the daemon goes on
            code, message = self.error_of(e)
            if code == "internal":
                log.exception("request %s failed", type(req).__name__)
            op.reply(Error(req.id, code, message))
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
        for close in self.on_shutdown:
            try:
                await close()
            except Exception:
                log.exception("closing %s failed", close)
        for conn in list(self.connections):
            for op in list(conn.open.values()):
                op.end("shutdown", "the daemon is shutting down")
        try:
            await asyncio.wait_for(self.handler.close(), self.close_timeout)
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

class CompanionError(Exception):
    """A companion of the server (serve's `companion`) could not start: told, and the daemon exits."""


def serve(config: ServerConfig, handler: Handler, companion=None, **server_kw) -> int:
    """Run the daemon in the foreground until Shutdown, SIGTERM or SIGINT; the exit status.
    `companion`: an async callable given the started Server, which starts whatever else the daemon
    serves (its HTTP server) and may add closers to server.on_shutdown; if it raises, the daemon
    stops and exits 1 with its message."""

    async def main() -> None:
        server = Server(config, handler=handler, **server_kw)
        await server.start()
        if companion is not None:
            try:
                await companion(server)
            except Exception as e:
                await server.shutdown()
                raise CompanionError(str(e)) from e
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, _on_signal, server, sig)
        await server.wait_closed()

    try:
        asyncio.run(main())
    except (SocketInUse, UnsafeSocketPath, CompanionError) as e:
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
