"""What the server needs from the daemon, as plain interfaces: ipc/ imports nothing from daemon/.

    Handler       what the server calls for each request (the daemon's Scheduler is one)
    ServerConfig  the server's settings as plain values (the daemon builds it from its Settings)
    ErrorOf       exc -> (code, message) of the Error reply that ends a failed request

The dependency runs one way, daemon → ipc: the daemon's start-up (daemon/service.py) builds a
ServerConfig, passes its scheduler as the Handler and its own error mapping as `error_of`.
tests/ipc/test_layering.py holds ipc/ to it.

Handler, request by request (the server frames, checks and routes; the handler does the work)
    Generate/Chat  await generate(req, emit, received_ns, peer=peer): emit(reply) gets any Progress
                   while the request waits for its model, each Chunk, then Done or Error; an
                   exception before that ends the request with Error(*error_of(exc)). The server
                   cancels the task running it on Cancel, a disconnect or shutdown: the handler
                   must stop the sequence then (within one decode step).
    Load           await load(name, settings, keep_alive, peer=peer, progress=report) -> (model, load_ns):
                   `model.name` goes in the Loaded reply; report(phase, percent, message) as Progress
    Unload         await unload(name)
    Ps             ps() -> [dict of ipc.protocol.ModelInfo's fields], called on the event loop
    Stats          await stats(name or None) -> {model name: {...}}
    shutdown       await close(): stop the models' compute threads (bounded by close_timeout)
`peer` is the connection's Peer (SO_PEERCRED: uid, gid, and gids looked up on first use); the
handler decides what that user may do.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from .framing import MAX_FRAME
from .protocol import Chat, Generate, Reply

__all__ = ["ErrorOf", "Handler", "Named", "Peer", "Report", "ServerConfig", "internal_error"]

Report = Callable[[str, "float | None", str], None]  # (phase, percent or None, message): a Progress
ErrorOf = Callable[[BaseException], tuple[str, str]]


class Peer(Protocol):
    uid: int
    gid: int
    gids: frozenset[int]  # the groups its processes have (primary and supplementary)


class Named(Protocol):
    name: str


@runtime_checkable
class Handler(Protocol):
    async def generate(self, req: Generate | Chat, emit: Callable[[Reply], None], received_ns: int,
                       peer: Peer | None = None) -> None: ...

    async def load(self, name: str, settings: dict[str, Any] | None = None, keep_alive: float | None = None,
                   progress: Report | None = None, peer: Peer | None = None) -> tuple[Named, int]: ...

    async def unload(self, name: str) -> None: ...

    def ps(self) -> list[dict[str, Any]]: ...

    async def stats(self, name: str | None = None) -> dict[str, Any]: ...

    async def close(self) -> None: ...


def internal_error(e: BaseException) -> tuple[str, str]:
    """The mapping a server uses when given none: every failure is a fault ("internal")."""
    return "internal", f"{type(e).__name__}: {e}"


@dataclass(frozen=True)
class ServerConfig:
    """The server's settings. Defaults are the daemon's (daemon/config.py: MOED_*; a test holds
    them equal); the daemon passes its own values anyway."""

    socket_path: str | os.PathLike | None = None  # None: ipc.client.default_socket_path()
    allowed_uids: frozenset[int] = field(default_factory=frozenset)  # besides the daemon's own, who always may
    max_frame: int = MAX_FRAME  # bytes of one frame's body
    max_connections: int = 256  # open at once; one more gets Error(None, "busy")
    max_requests_per_connection: int = 16  # generations open on one connection; one more: busy
    frame_timeout: float = 30.0  # seconds to finish a frame after its first byte; 0: no limit
