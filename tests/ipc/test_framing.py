"""Frames: round trips, clean EOF, truncation, and oversized prefixes that must cost nothing."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
import tracemalloc

import pytest

from ipc.errors import FrameTooLarge, ProtocolError, TruncatedFrame
from ipc.framing import (
    HEADER,
    MAX_FRAME,
    pack_frame,
    read_frame,
    recv_frame,
    send_frame,
    write_frame,
)

GIB_PREFIX = HEADER.pack(2**30)  # a 1 GiB length prefix


def stream(data: bytes, eof: bool = True) -> asyncio.StreamReader:
    reader = asyncio.StreamReader()
    reader.feed_data(data)
    if eof:
        reader.feed_eof()
    return reader


def test_limits_and_error_classes():
    assert MAX_FRAME == 16 * 2**20
    assert issubclass(FrameTooLarge, ProtocolError) and issubclass(TruncatedFrame, ProtocolError)
    assert pack_frame(b"abc") == b"\x00\x00\x00\x03abc"


async def test_read_frames_then_clean_eof():
    reader = stream(pack_frame(b"one") + pack_frame(b"") + pack_frame(b"x" * 70_000))
    assert await read_frame(reader) == b"one"
    assert await read_frame(reader) == b""
    assert await read_frame(reader) == b"x" * 70_000  # beyond StreamReader's 64 KiB line limit
    assert await read_frame(reader) is None
    assert await read_frame(stream(b"")) is None


@pytest.mark.parametrize("data", [b"\x00\x00", b"\x00\x00\x00\x05ab"], ids=["header", "body"])
async def test_truncated_frame(data):
    with pytest.raises(TruncatedFrame):
        await read_frame(stream(data))


async def test_one_gib_prefix_fails_at_once_without_allocating():
    reader = stream(GIB_PREFIX + b"tail", eof=False)  # no EOF: reading on would hang (the guard's 60 s)
    tracemalloc.start()
    try:
        with pytest.raises(FrameTooLarge) as e:
            await asyncio.wait_for(read_frame(reader), 60)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 2**20 and e.value.code == "bad_frame"
    reader.feed_eof()
    assert await reader.read() == b"tail"  # at once: refused from the header, nothing read past it


async def test_max_frame_is_configurable_and_inclusive():
    assert await read_frame(stream(pack_frame(b"12345")), max_frame=5) == b"12345"
    with pytest.raises(FrameTooLarge):
        await read_frame(stream(pack_frame(b"123456")), max_frame=5)
    with pytest.raises(FrameTooLarge):
        pack_frame(b"123456", max_frame=5)


async def test_write_frame_round_trip_and_refuses_oversized():
    a, b = socket.socketpair()
    reader, reader_side = await asyncio.open_unix_connection(sock=a)  # keep both writers alive:
    _, writer = await asyncio.open_unix_connection(sock=b)  # a collected one closes its socket
    await write_frame(writer, b"hello")
    assert await read_frame(reader) == b"hello"
    with pytest.raises(FrameTooLarge):
        await write_frame(writer, b"x" * 11, max_frame=10)
    writer.close()
    assert await read_frame(reader) is None  # nothing of the refused frame was sent
    reader_side.close()


# -- blocking sockets ---------------------------------------------------------------------------

@pytest.fixture
def pair():
    a, b = socket.socketpair()
    a.settimeout(2.0)
    yield a, b
    a.close()
    b.close()


def test_sync_round_trip_with_partial_recv(pair):
    a, b = pair
    data = pack_frame(b"first") + pack_frame(b"y" * 100_000)

    def dribble():  # cuts inside headers and bodies, so recv returns partial frames
        pieces = [data[i:i + 3] for i in range(0, 21, 3)]
        pieces += [data[i:i + 9_999] for i in range(21, len(data), 9_999)]
        for piece in pieces:
            b.sendall(piece)
            time.sleep(0.001)
        b.shutdown(socket.SHUT_WR)

    thread = threading.Thread(target=dribble)
    thread.start()
    assert recv_frame(a) == b"first"
    assert recv_frame(a) == b"y" * 100_000
    assert recv_frame(a) is None
    thread.join()


@pytest.mark.parametrize("data", [b"\x00", b"\x00\x00\x00\x09abc"], ids=["header", "body"])
def test_sync_truncated(pair, data):
    a, b = pair
    b.sendall(data)
    b.shutdown(socket.SHUT_WR)
    with pytest.raises(TruncatedFrame):
        recv_frame(a)


def test_sync_one_gib_prefix_fails_at_once_without_allocating(pair):
    a, b = pair
    b.sendall(GIB_PREFIX + b"tail")  # no EOF: a reader that tried to read on would time out (TimeoutError)
    tracemalloc.start()
    try:
        with pytest.raises(FrameTooLarge):
            recv_frame(a)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 2**20
    b.shutdown(socket.SHUT_WR)
    assert a.recv(16) == b"tail"  # at once: refused from the header, nothing read past it


def test_send_frame(pair):
    a, b = pair
    send_frame(b, b"payload")
    assert recv_frame(a) == b"payload"
    with pytest.raises(FrameTooLarge):
        send_frame(b, b"x" * 11, max_frame=10)
    with pytest.raises(FrameTooLarge):
        send_frame(b, b"x" * 11)
        recv_frame(a, max_frame=10)
