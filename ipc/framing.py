"""Length-prefixed frames: a u32 big-endian body length, then the body (one msgpack message).

The length is checked against `max_frame` before anything is read or allocated, so a hostile
prefix (say 1 GiB) costs nothing. After FrameTooLarge or TruncatedFrame the stream position is
lost: reply if you can, then close the connection.
"""

from __future__ import annotations

import asyncio
import socket
import struct

from .errors import FrameTooLarge, TruncatedFrame

MAX_FRAME = 16 * 2**20  # default maximum body size, bytes
HEADER = struct.Struct(">I")


def pack_frame(payload: bytes, max_frame: int = MAX_FRAME) -> bytes:
    """Header + payload, ready to write; FrameTooLarge if the payload exceeds max_frame."""
    if len(payload) > max_frame:
        raise FrameTooLarge(f"frame of {len(payload)} bytes exceeds the maximum of {max_frame}")
    return HEADER.pack(len(payload)) + payload


def _check(length: int, max_frame: int) -> None:
    if length > max_frame:
        raise FrameTooLarge(f"length prefix {length} exceeds the maximum frame of {max_frame} bytes")


# -- asyncio streams ----------------------------------------------------------------------------

async def read_frame(reader: asyncio.StreamReader, max_frame: int = MAX_FRAME) -> bytes | None:
    """The next frame's body, or None at a clean EOF (before a frame starts)."""
    try:
        header = await reader.readexactly(HEADER.size)
    except asyncio.IncompleteReadError as e:
        if not e.partial:
            return None
        raise TruncatedFrame(f"EOF after {len(e.partial)} of {HEADER.size} header bytes") from None
    (length,) = HEADER.unpack(header)
    _check(length, max_frame)
    try:
        return await reader.readexactly(length)
    except asyncio.IncompleteReadError as e:
        raise TruncatedFrame(f"EOF after {len(e.partial)} of {length} body bytes") from None


async def write_frame(writer: asyncio.StreamWriter, payload: bytes, max_frame: int = MAX_FRAME) -> None:
    writer.write(pack_frame(payload, max_frame))  # one write: frames from concurrent tasks never interleave
    await writer.drain()


# -- blocking sockets ---------------------------------------------------------------------------

def _recv_exactly(sock: socket.socket, n: int) -> bytearray:
    """n bytes, or fewer only at EOF (recv may return any part of what was sent)."""
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            del view
            del buf[got:]
            break
        got += k
    return buf


def recv_frame(sock: socket.socket, max_frame: int = MAX_FRAME) -> bytes | None:
    """Blocking read_frame; socket timeouts propagate (TimeoutError)."""
    header = _recv_exactly(sock, HEADER.size)
    if not header:
        return None
    if len(header) < HEADER.size:
        raise TruncatedFrame(f"EOF after {len(header)} of {HEADER.size} header bytes")
    (length,) = HEADER.unpack(header)
    _check(length, max_frame)
    body = _recv_exactly(sock, length)
    if len(body) < length:
        raise TruncatedFrame(f"EOF after {len(body)} of {length} body bytes")
    return bytes(body)


def send_frame(sock: socket.socket, payload: bytes, max_frame: int = MAX_FRAME) -> None:
    sock.sendall(pack_frame(payload, max_frame))
