"""The daemon's start-up: the scheduler and the socket server, wired from Settings.

    server_config(settings, socket_path=None) -> ServerConfig   the server's plain values
    make_scheduler(settings, **kw) -> Scheduler   given the engine loader and the demo resolver
    make_server(settings, socket_path=None, *, scheduler=None, **server_kw) -> ipc.server.Server
    serve(settings, socket_path=None) -> int      `moed serve`: ipc.server.serve, the exit status

The layers run one way, daemon → ipc: ipc/server.py knows only ipc.handler (Handler,
ServerConfig, ErrorOf); this module passes it the Scheduler, the config and wire_error. The daemon's
policy stays here: which uids MOED_ALLOWED_UIDS names (config.allowed_uid_set), the socket path
($MOED_SOCKET), what each exception means on the wire (errors.wire_error).

The engine (numba kernels) and the demo builder are imported when the first model loads, never at
start: `moed --help`, the client and the event loop's start-up do not import numba.
"""

from __future__ import annotations

import os
from typing import Any

from ipc.handler import ServerConfig

from .config import Settings, allowed_uid_set
from .errors import wire_error
from .progress import Report

__all__ = ["demo_model", "load_engine", "make_scheduler", "make_server", "serve", "server_config"]


def load_engine(path: str, **settings: Any):
    """Engine.load: the scheduler's factory."""
    from .engine import Engine  # numba: imported only when a model loads

    return Engine.load(path, **settings)


def demo_model(progress: Report) -> str:
    """The demo MoE's path, built on first use: the scheduler's default model."""
    from .demo import demo_model_path

    return str(demo_model_path(progress=progress))


def server_config(settings: Settings, socket_path: str | os.PathLike | None = None) -> ServerConfig:
    """The server's settings; ConfigError for a bad MOED_ALLOWED_UIDS (Settings.load refuses it
    already)."""
    return ServerConfig(socket_path=socket_path or settings.socket or None,
                        allowed_uids=allowed_uid_set(settings.allowed_uids),
                        max_frame=settings.max_frame,
                        max_connections=settings.max_connections,
                        max_requests_per_connection=settings.max_requests_per_connection,
                        frame_timeout=settings.frame_timeout)


def make_scheduler(settings: Settings, **kw: Any):
    """The daemon's Scheduler: Engine.load and the demo MoE unless `kw` says otherwise."""
    from .catalog import Catalog
    from .scheduler import Scheduler

    return Scheduler(settings, **{"factory": load_engine, "default_model": demo_model,
                                  "catalog": Catalog.of(settings), **kw})


def make_server(settings: Settings, socket_path: str | os.PathLike | None = None, *, scheduler=None,
                **server_kw: Any):
    """An ipc.server.Server serving `scheduler` (default: make_scheduler(settings)), errors mapped
    by wire_error; server_kw: Server's (close_timeout)."""
    from ipc.server import Server

    return Server(server_config(settings, socket_path), handler=scheduler or make_scheduler(settings),
                  error_of=wire_error, **server_kw)


def serve(settings: Settings, socket_path: str | os.PathLike | None = None) -> int:
    """Run the daemon in the foreground until Shutdown, SIGTERM or SIGINT; the exit status. The
    HTTP server (daemon/http) runs beside the socket server, on the same scheduler."""
    from ipc import server as ipc_server

    config = server_config(settings, socket_path)
    scheduler = make_scheduler(settings)

    async def start_http(server) -> None:
        http = make_http(settings, scheduler, server)
        await http.start()
        server.on_shutdown.append(http.close)

    return ipc_server.serve(config, scheduler, companion=start_http, error_of=wire_error)


def make_http(settings: Settings, scheduler, server):
    """The HTTP server beside an ipc Server (its socket's path and allowed uids)."""
    from .http.server import HttpServer

    return HttpServer(settings, scheduler, server.path, server.allowed_uids, server.version)
