"""The daemon's HTTP server: Ollama's and OpenAI's APIs on the scheduler the unix-socket protocol
uses (its queue, batching, keep-alive and cancellation), in the daemon's own event loop.

    http = HttpServer(settings, scheduler, socket_path, allowed_uids)
    await http.start()     # TCP at MOED_HTTP_HOST, and HTTP on a unix socket beside moed's own
    await http.close()     # at the daemon's shutdown: stop accepting, cancel open requests

Why aiohttp: it runs in the event loop it is given (uvicorn installs its own signal handlers and
wants its own loop), it streams responses, it serves a socket we bind ourselves (the unix socket's
mode bits are set before anyone can connect), and `handler_cancellation=True` cancels a request
whose client is gone, a non-streamed one included: the generation stops within one step.

Listeners (docs/security.md)
    TCP         MOED_HTTP_HOST, default 127.0.0.1:11434 (Ollama's); "off" disables it. A busy
                default port (an Ollama running) logs a warning and leaves TCP off; a busy port that
                MOED_HTTP_HOST names is an error. TCP has no peer credentials, so any local user can
                reach it: models are names from the models directory only (never paths), and
                /api/copy and /api/delete need MOED_API_KEY set and sent as `Authorization: Bearer`.
                A non-loopback address needs MOED_API_KEY, and then every request must send it.
    unix socket http_socket_path(moed's socket), mode 0600 (0666 when MOED_ALLOWED_UIDS names
                others), each connection's uid checked (SO_PEERCRED) as on moed's own socket;
                paths are taken, and the scheduler checks the peer may read the file.

Bodies are limited to MOED_MAX_FRAME bytes (413). Every error, routing's own 404 and 405
included, is written in the API's shape: OpenAI's object under /v1/, else Ollama's {"error"}.
"""

from __future__ import annotations

import contextlib
import hmac
import ipaddress
import logging
import os
import socket
import stat
from collections.abc import Awaitable, Callable

from aiohttp import web

from ipc.client import peer_cred
from ipc.server import PeerCred

from ..errors import ConfigError, MoedError
from . import ollama, openai
from .common import CALLER, ApiError, Caller, json_response

log = logging.getLogger("moed.http")

DEFAULT_HOST = "127.0.0.1:11434"
DEFAULT_PORT = 11434


def http_socket_path(socket_path: str) -> str:
    """The HTTP unix socket beside moed's own: moed.sock -> moed-http.sock."""
    base = socket_path[:-5] if socket_path.endswith(".sock") else socket_path
    return base + "-http.sock"


def parse_host(spec: str) -> tuple[str, int] | None:
    """MOED_HTTP_HOST -> (host, port), None for "off". Takes "host", "host:port", ":port",
    "[v6]:port", with or without "http://", as OLLAMA_HOST does. ConfigError otherwise."""
    text = spec.strip()
    if text.lower() in ("off", "", "none", "0"):
        return None
    text = text.removeprefix("http://").rstrip("/")
    host, port = text, DEFAULT_PORT
    if text.startswith("["):
        end = text.find("]")
        if end < 0:
            raise ConfigError(f"MOED_HTTP_HOST: {spec!r}: unclosed '['")
        host, rest = text[1:end], text[end + 1:]
        if rest:
            if not rest.startswith(":"):
                raise ConfigError(f"MOED_HTTP_HOST: {spec!r}: expected [address]:port")
            port = rest[1:]
    elif text.count(":") == 1:
        host, port = text.split(":")
    try:
        port = int(port)
    except ValueError:
        raise ConfigError(f"MOED_HTTP_HOST: {spec!r}: the port must be a number") from None
    if not 0 <= port <= 65535:
        raise ConfigError(f"MOED_HTTP_HOST: {spec!r}: the port must be in 0..65535")
    return host or "127.0.0.1", port


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class HttpServer:
    def __init__(self, settings, scheduler, socket_path: str, allowed_uids: frozenset[int], version: str):
        self.settings = settings
        self.scheduler = scheduler
        self.socket_path = http_socket_path(os.fspath(socket_path))
        self.uid = os.geteuid()
        self.allowed_uids = frozenset(allowed_uids) | {self.uid}
        self.api_key = settings.api_key
        self.tcp = parse_host(settings.http_host)
        self.key_for_all = self.tcp is not None and not is_loopback(self.tcp[0])
        if self.key_for_all and not self.api_key:
            raise ConfigError(f"MOED_HTTP_HOST={settings.http_host} is not a loopback address: set MOED_API_KEY, "
                              f"which every request must then send")
        self.app = web.Application(client_max_size=settings.max_frame, middlewares=[self._guard])
        ollama.Routes(scheduler, version).add_to(self.app)
        openai.Routes(scheduler).add_to(self.app)
        self.runner = web.AppRunner(self.app, handle_signals=False, handler_cancellation=True, access_log=None,
                                    shutdown_timeout=1.0)
        self.port: int | None = None  # the TCP port bound (MOED_HTTP_HOST may ask for 0)
        self._unix_inode: tuple[int, int] | None = None

    async def start(self) -> None:
        await self.runner.setup()
        try:
            if self.tcp is not None:
                await self._start_tcp(*self.tcp)
            sock = self._bind_unix()
            await web.SockSite(self.runner, sock).start()
        except BaseException:
            await self.close()
            raise

    async def _start_tcp(self, host: str, port: int) -> None:
        site = web.TCPSite(self.runner, host, port, reuse_address=True)
        try:
            await site.start()
        except OSError as e:
            if not _asked():
                log.warning("HTTP: %s:%d is in use (%s; an Ollama running?): HTTP over TCP is off. Set "
                            "MOED_HTTP_HOST to another address, or to off", host, port, e.strerror or e)
                return
            raise ConfigError(f"MOED_HTTP_HOST={self.settings.http_host}: cannot listen on {host}:{port}: "
                              f"{e.strerror or e}") from None
        server = site._server  # the port actually bound, for MOED_HTTP_HOST's port 0
        self.port = server.sockets[0].getsockname()[1] if server is not None and server.sockets else port
        log.info("HTTP (Ollama's and OpenAI's APIs) on http://%s:%d", host, self.port)

    def _bind_unix(self) -> socket.socket:
        path = self.socket_path
        with contextlib.suppress(FileNotFoundError):
            st = os.lstat(path)
            if not stat.S_ISSOCK(st.st_mode) or st.st_uid != self.uid:
                raise MoedError(f"{path} exists and is not a socket of ours: not replacing it")
            os.unlink(path)  # moed's own socket's lock is ours: this one is a dead daemon's
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o177)
        try:
            sock.bind(path)
        except BaseException:
            sock.close()
            raise
        finally:
            os.umask(old)
        os.chmod(path, 0o666 if self.allowed_uids - {self.uid} else 0o600)
        st = os.stat(path)
        self._unix_inode = (st.st_dev, st.st_ino)
        log.info("HTTP on the unix socket %s", path)
        return sock

    async def close(self) -> None:
        with contextlib.suppress(Exception):
            await self.runner.cleanup()
        if self._unix_inode is not None:
            with contextlib.suppress(FileNotFoundError):
                st = os.stat(self.socket_path)
                if (st.st_dev, st.st_ino) == self._unix_inode:
                    os.unlink(self.socket_path)
            self._unix_inode = None

    # -- every request -------------------------------------------------------------------------

    @web.middleware
    async def _guard(self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]):
        """Who is asking (peer, TCP or not, the API key), then the route; every error in the
        route's API shape."""
        api = openai if request.path.startswith("/v1/") else ollama
        try:
            self._admit(request)
            return await handler(request)
        except ApiError as e:
            return _error(api, e.status, str(e), e.kind)
        except web.HTTPException as e:
            if e.status < 400:
                raise
            return _error(api, e.status, e.reason if e.status != 413 else
                          f"the request body is larger than {self.settings.max_frame} bytes (MOED_MAX_FRAME)",
                          "invalid_request_error" if e.status < 500 else "server_error")
        except MoedError as e:
            err = ApiError.of(e)
            return _error(api, err.status, str(err), err.kind)
        except Exception as e:  # a bug: logged, and told as the API's 500
            log.exception("HTTP %s %s failed", request.method, request.path)
            return _error(api, 500, f"internal error: {type(e).__name__}: {e}", "server_error")

    def _admit(self, request: web.Request) -> None:
        sock = request.transport.get_extra_info("socket") if request.transport is not None else None
        unix = sock is not None and sock.family == socket.AF_UNIX
        peer = None
        if unix:
            cred = peer_cred(sock)
            uid, gid = (None, None) if cred is None else cred[1:]
            if uid not in self.allowed_uids:
                raise ApiError(403, f"uid {uid} may not use this daemon (MOED_ALLOWED_UIDS)")
            peer = PeerCred(uid, gid)
        elif self.key_for_all:
            self._check_key(request, "this daemon listens beyond loopback")
        request[CALLER] = Caller(not unix, peer, lambda: self._may_manage(request, peer))

    def _may_manage(self, request: web.Request, peer: PeerCred | None) -> None:
        """Creating, copying or deleting a model: over TCP only with MOED_API_KEY; on the unix
        socket only as the daemon's own user."""
        if peer is None:
            if not self.api_key:
                raise ApiError(403, "models are managed over TCP only when MOED_API_KEY is set (and sent as "
                                    "Authorization: Bearer); use the unix socket or `moed import`")
            self._check_key(request, "managing models over TCP")
        elif peer.uid not in (self.uid, 0):
            raise ApiError(403, "only the daemon's own user may manage its models")

    def _check_key(self, request: web.Request, why: str) -> None:
        sent = request.headers.get("Authorization", "")
        scheme, _, token = sent.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), self.api_key.encode()):
            raise ApiError(401, f"{why}: send MOED_API_KEY as Authorization: Bearer <key>",
                           "authentication_error")


def _asked() -> bool:
    """Whether MOED_HTTP_HOST was set (a busy port is then an error, not a warning)."""
    return "MOED_HTTP_HOST" in os.environ


def _error(api, status: int, message: str, kind: str) -> web.Response:
    return json_response(api.error_body(status, message, kind), status)
