"""The exception tree of the IPC layer (client library, wire decoding, the server's socket).

    ClientError            base; .code is the wire error code when the daemon sent one, else None
    ├── NotRunning         no daemon: socket file missing, connection refused, connection lost
    ├── Impostor           the process on the socket runs as a user the client does not trust
    │                      (not the client's own uid, root, or the expected_uid it was given);
    │                      nothing was sent to it
    ├── ProtocolError      the bytes are not the protocol: undecodable frame, unknown tag, wrongly
    │   │                  typed field (code "bad_frame"/"bad_request"), version mismatch ("bad_version")
    │   ├── FrameTooLarge  a length prefix above the maximum frame size (never read or allocated)
    │   └── TruncatedFrame EOF inside a frame's header or body
    ├── Busy               "busy": the daemon's request queue, this connection's share of it, or
    │                      its connections are full; retry later
    ├── BadRequest         "bad_request": the daemon refused the request as invalid (a prompt
    │   │                  longer than the context, a bad setting, ...), or the client's structs
    │   │                  did before sending (a stop list past its bounds, ...); retrying will not help
    │   └── Forbidden      "forbidden": this user may not do that (connect, set a daemon-side
    │                      path, name a model file it cannot read itself)
    ├── ModelError         "model_error" (failed to load or run), "not_found" (no such model)
    ├── Cancelled          "cancelled": the generation was stopped by a Cancel
    ├── Timeout            connecting, or waiting for the next reply, took longer than the timeout
    ├── ServerError        any other error reply: "shutdown", "internal" (a daemon fault), ...
    ├── SocketInUse        (the server) another daemon serves, or is starting, on the socket path,
    │                      or the path is not a socket
    └── UnsafeSocketPath   (the server) the socket's directory, an existing socket file or the lock
                           file is not safely ours; nothing was created

The daemon's side uses ProtocolError too: `ipc.protocol.decode_request` raises it, and its `code`
and `request_id` are what the error reply should carry.
"""

from __future__ import annotations


class ClientError(Exception):
    """Base of every error the IPC layer raises on purpose."""

    def __init__(self, message: str = "", *, code: str | None = None, request_id: int | None = None):
        super().__init__(message)
        self.code = code  # wire error code, e.g. "busy"; None for local errors
        self.request_id = request_id  # the request it concerns, when known


class NotRunning(ClientError):
    """No daemon answers on the socket (missing, refused, or it closed the connection)."""


class ProtocolError(ClientError):
    """Bytes that are not a valid frame or message of this protocol version."""

    def __init__(self, message: str = "", *, code: str = "bad_frame", request_id: int | None = None):
        super().__init__(message, code=code, request_id=request_id)


class FrameTooLarge(ProtocolError):
    """A frame's length prefix exceeds the maximum; the stream is out of sync afterwards."""


class TruncatedFrame(ProtocolError):
    """The stream ended inside a frame; the stream is out of sync afterwards."""


class Impostor(ClientError):
    """The socket is served by a process of a user the client does not trust: someone may have
    put their own listener at the daemon's path. Nothing was sent to it."""


class Busy(ClientError):
    """The daemon's queue (or this connection's share of it, or its connection slots) is full."""


class BadRequest(ClientError):
    """The request is invalid (refused by the daemon, or by the client before sending); the same
    request will fail again."""


class Forbidden(BadRequest):
    """This user may not make that request (or use this daemon at all)."""


class ModelError(ClientError):
    """The model was not found, or failed to load or run."""


class Cancelled(ClientError):
    """The generation was cancelled (by this client or another caller of cancel(id))."""


class Timeout(ClientError):
    """No connection, or no reply, within the timeout."""


class ServerError(ClientError):
    """An error reply whose code has no class of its own: the daemon is stopping, or failed."""


class SocketInUse(ClientError):
    """Another daemon serves (or is starting) on this socket path, or the path is not a socket."""


class UnsafeSocketPath(ClientError):
    """The socket's directory, an existing socket file or the lock file is not safely ours: another
    user could take the daemon's place (or make it write where they choose). Nothing was created."""


_BY_CODE: dict[str, type[ClientError]] = {
    "bad_frame": ProtocolError,
    "bad_version": ProtocolError,
    "busy": Busy,
    "bad_request": BadRequest,
    "forbidden": Forbidden,
    "model_error": ModelError,
    "not_found": ModelError,
    "cancelled": Cancelled,
}


def error_for(code: str, message: str, request_id: int | None = None) -> ClientError:
    """The exception for an Error reply with this code."""
    return _BY_CODE.get(code, ServerError)(message or code, code=code, request_id=request_id)
