"""A bare connection to a daemon for tests: frames in, replies out, no client library."""

from __future__ import annotations

import asyncio

from ipc.framing import pack_frame, read_frame
from ipc.protocol import PROTOCOL_VERSION, HealthReply, Hello, Progress, decode_reply, encode

T = 60  # seconds: the longest any step may take before a test fails instead of hanging


class Raw:
    def __init__(self, reader, writer):
        self.reader, self.writer = reader, writer

    @classmethod
    async def open(cls, path, hello: bool = True) -> Raw:
        raw = cls(*await asyncio.open_unix_connection(path))
        if hello:
            await raw.send(Hello(1, PROTOCOL_VERSION))
            assert isinstance(await raw.recv(), HealthReply)
        return raw

    async def send(self, msg) -> None:
        await self.send_bytes(pack_frame(encode(msg)))

    async def send_bytes(self, data: bytes) -> None:
        self.writer.write(data)
        await self.writer.drain()

    async def recv(self, progress: bool = False, timeout: float = T):
        """The next reply (None at EOF); Progress replies (advisory) are skipped unless `progress`."""
        while True:
            frame = await asyncio.wait_for(read_frame(self.reader), timeout)
            reply = None if frame is None else decode_reply(frame)
            if progress or not isinstance(reply, Progress):
                return reply

    def close(self) -> None:
        self.writer.close()
