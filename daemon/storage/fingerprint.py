"""A model file's content fingerprint: blake2b-256 over the header and a sample of the data.

A rewrite in place that sets the old mtime back keeps the size and mtime that `FileIdentity`
compares; only the ctime moves. The ctime also moves on chmod, chown, link and rename, which
change no byte, so a ctime change alone cannot fail a request: the content is hashed again and
compared with the fingerprint taken at load (issue 25).

What is hashed (a few hundred small reads, milliseconds on a multi-GB file; no full read):
- the whole header region (magic, metadata, tensor table, padding): [0, data_offset);
- SPREAD blocks of BLOCK bytes at evenly spaced offsets over the tensor data;
- the first and last BLOCK bytes of every expert tensor (the tensors read after load: the others
  are copied into memory by the load, so a later change to them changes no output).
A rewrite that touches only unsampled bytes goes unseen (docs/security.md says so).
"""

from __future__ import annotations

import hashlib
import os
import struct
from collections.abc import Iterable
from dataclasses import dataclass

BLOCK = 4096
SPREAD = 256
_CHUNK = 1 << 20
_RANGE = struct.Struct("<QQ")


@dataclass(frozen=True)
class Fingerprint:
    ranges: tuple[tuple[int, int], ...]  # (offset, bytes), sorted, disjoint
    digest: bytes

    @classmethod
    def take(cls, fd: int, ranges: Iterable[tuple[int, int]]) -> Fingerprint:
        ranges = _merge(ranges)
        return cls(ranges, _digest(fd, ranges))

    def matches(self, fd: int) -> bool:
        """Whether the file open as fd holds the bytes it held when the fingerprint was taken.
        Raises OSError if it cannot be read."""
        return _digest(fd, self.ranges) == self.digest


def sample_ranges(file_size: int, data_offset: int, tensors: Iterable) -> list[tuple[int, int]]:
    """The byte ranges hashed for a GGUF file (tensors: TensorInfo, absolute offsets)."""
    head_end = min(data_offset, file_size)
    out = [(0, head_end)]
    span = file_size - head_end
    if span > 0:
        out += [(head_end + i * span // SPREAD, BLOCK) for i in range(SPREAD)]
    for ti in tensors:
        if "_exps." in ti.name and ti.nbytes:
            n = min(BLOCK, ti.nbytes)
            out += [(ti.offset, n), (ti.offset + ti.nbytes - n, n)]
    return [(off, min(n, file_size - off)) for off, n in out if off < file_size and n > 0]


def _merge(ranges: Iterable[tuple[int, int]]) -> tuple[tuple[int, int], ...]:
    out: list[list[int]] = []
    for off, n in sorted(ranges):
        if out and off <= out[-1][0] + out[-1][1]:
            out[-1][1] = max(out[-1][1], off + n - out[-1][0])
        else:
            out.append([off, n])
    return tuple((off, n) for off, n in out)


def _digest(fd: int, ranges: tuple[tuple[int, int], ...]) -> bytes:
    h = hashlib.blake2b(digest_size=32)
    for off, n in ranges:
        h.update(_RANGE.pack(off, n))  # a short read hashes differently from a full one
        end = off + n
        while off < end:
            chunk = os.pread(fd, min(_CHUNK, end - off), off)
            if not chunk:
                break
            h.update(chunk)
            off += len(chunk)
    return h.digest()
