"""moed IPC: the wire protocol (protocol), frames (framing), the client library (client) and its
exception tree (errors); the socket server (server) and what it needs from the daemon (handler:
Handler, ServerConfig); a mock daemon for tests lives in ipc.testing. Nothing here imports daemon/."""

from .client import (
                     AsyncClient,
                     AsyncGeneration,
                     Client,
                     Generation,
                     default_socket_path,
)
from .errors import (
                     BadRequest,
                     Busy,
                     Cancelled,
                     ClientError,
                     Forbidden,
                     FrameTooLarge,
                     Impostor,
                     ModelError,
                     NotRunning,
                     ProtocolError,
                     ServerError,
                     Timeout,
                     TruncatedFrame,
)
from .framing import MAX_FRAME
from .protocol import PROTOCOL_VERSION, Message, SamplingOptions

__all__ = [
                     "MAX_FRAME",
                     "PROTOCOL_VERSION",
                     "AsyncClient",
                     "AsyncGeneration",
                     "BadRequest",
                     "Busy",
                     "Cancelled",
                     "Client",
                     "ClientError",
                     "Forbidden",
                     "FrameTooLarge",
                     "Generation",
                     "Impostor",
                     "Message",
                     "ModelError",
                     "NotRunning",
                     "ProtocolError",
                     "SamplingOptions",
                     "ServerError",
                     "Timeout",
                     "TruncatedFrame",
                     "default_socket_path",
]
