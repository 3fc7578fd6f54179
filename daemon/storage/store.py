"""The expert store: where every (layer, expert) lives on disk, and async reads of it.

An expert is read as a few byte ranges (segments) whose concatenation is its gate|up|down slices.
In a GGUF file the three slices sit in three stacked tensors, so an expert is three segments:
expert e of a tensor with ne = [K, N, E] is the contiguous range data_offset + e * nbytes / E.
In an expert pack (pack.py) they are adjacent, so an expert is one segment, possibly zstd.

Reads are positional (`preadv` straight into the destination buffers, run in the I/O thread pool
through aiofiles), so the model is never mapped or read whole and several reads can be in flight
on one descriptor. Legend: E = experts, K = input length, N = output rows.
"""

from __future__ import annotations

import os
import zlib
from collections.abc import Sequence
from dataclasses import dataclass

import aiofiles
import aiofiles.os

from ..errors import StorageError
from .experts import PROJECTIONS, ExpertLayout


@dataclass(frozen=True)
class ExpertLocation:
    """One expert on disk. The segments' bytes, concatenated, are gate|up|down (raw codec), or
    one segment of zstd that decompresses to them."""
    segments: tuple[tuple[int, int], ...]  # (file offset, bytes)
    codec: str = "raw"  # "raw" | "zstd"
    checksum: int | None = None  # crc32 of gate|up|down, checked after the read (packs)

    @property
    def nbytes(self) -> int:
        """Bytes read from disk for this expert."""
        return sum(n for _, n in self.segments)


class ExpertStore:
    """Locations of every expert of every MoE layer in one file."""

    def __init__(self, path: str, layouts: dict[int, ExpertLayout],
                 locations: dict[int, list[ExpertLocation]], kind: str):
        self.path = path
        self.layouts = layouts  # MoE layer -> layout
        self.locations = locations  # MoE layer -> [E] locations
        self.kind = kind  # "gguf" | "pack"

    @classmethod
    def from_gguf(cls, gguf, layouts: dict[int, ExpertLayout]) -> ExpertStore:
        locations = {}
        for il, lay in layouts.items():
            infos = [gguf.tensor_info(f"blk.{il}.ffn_{p}_exps.weight") for p in PROJECTIONS]
            sizes = [lay.nbytes(p) for p in PROJECTIONS]
            for ti, size in zip(infos, sizes):
                if ti.nbytes != size * lay.n_expert:
                    raise StorageError(f"{ti.name}: {ti.nbytes} bytes, expected {lay.n_expert} x {size}")
            locations[il] = [ExpertLocation(tuple((ti.offset + e * size, size) for ti, size in zip(infos, sizes)))
                             for e in range(lay.n_expert)]
        return cls(os.fspath(gguf.path), layouts, locations, "gguf")

    def location(self, layer: int, expert: int) -> ExpertLocation:
        return self.locations[layer][expert]


def expert_layouts(gguf) -> dict[int, ExpertLayout]:
    """MoE layer -> layout, from the stacked expert tensors the file holds (ne = [K, N, E])."""
    layouts = {}
    il = 0
    while f"blk.{il}.attn_norm.weight" in gguf.tensors or f"blk.{il}.ffn_gate_exps.weight" in gguf.tensors:
        names = [f"blk.{il}.ffn_{p}_exps.weight" for p in PROJECTIONS]
        if all(n in gguf.tensors for n in names):
            g, u, d = (gguf.tensor_info(n) for n in names)
            if len(g.ne) != 3 or g.ne != u.ne or tuple(d.ne) != (g.ne[1], g.ne[0], g.ne[2]):
                raise StorageError(f"layer {il}: expert tensors of mismatched shapes "
                                   f"{list(g.ne)}, {list(u.ne)}, {list(d.ne)}")
            layouts[il] = ExpertLayout(g.ne[2], g.ne[0], g.ne[1], g.ggml_type, u.ggml_type, d.ggml_type)
        il += 1
    return layouts


class StoreReader:
    """Reads experts from one store's file. `await open()` in the loop that reads; then
    `await read_into(...)` for one expert, or `await read_batch(...)` for several in one
    thread-pool job (a job costs tens of microseconds of thread hand-off: small experts are
    batched, big ones read in parallel by the caller)."""

    def __init__(self, store: ExpertStore):
        self.store = store
        self._file = None

    async def open(self) -> None:
        try:
            self._file = await aiofiles.open(self.store.path, "rb", buffering=0)
        except OSError as e:
            raise StorageError(f"cannot open {self.store.path}: {e.strerror or e}") from None

    async def close(self) -> None:
        if self._file is not None:
            await self._file.close()
            self._file = None

    async def read_into(self, layer: int, expert: int, dests: Sequence[memoryview]) -> int:
        """Read one expert into dests (gate, up, down byte buffers); -> bytes read.
        Raises StorageError naming the file, layer and expert on a short read or an I/O error."""
        out: list = []
        await self.read_batch([(layer, expert, dests, lambda n, err: out.append((n, err)))])
        n, err = out[0]
        if err is not None:
            raise err
        return n

    async def read_batch(self, items) -> None:
        """items: (layer, expert, dests, done(nbytes, error | None)); done runs on the reading
        thread as each expert finishes, so a waiter wakes without another hop through the loop."""
        await _read_batch(self, self._file.fileno(), items)

    def read_sync(self, fd: int, layer: int, expert: int, dests: Sequence[memoryview]) -> int:
        loc = self.store.location(layer, expert)
        where = f"{self.store.path}: layer {layer} expert {expert}"
        try:
            if loc.codec == "zstd":
                _read_zstd(fd, loc, dests, where)
            else:  # preadv each segment straight into its part of the destination buffers
                flat = _Concat(dests)
                for offset, n in loc.segments:
                    got = os.preadv(fd, flat.take(n), offset)
                    if got != n:
                        raise StorageError(f"{where}: short read at offset {offset} ({got} of {n} bytes): "
                                           "is the file truncated?")
        except OSError as e:
            raise StorageError(f"{where}: {e.strerror or e}") from None
        if loc.checksum is not None:
            crc = 0
            for d in dests:
                crc = zlib.crc32(d, crc)
            if crc != loc.checksum:
                raise StorageError(f"{where}: checksum mismatch (corrupt pack?)")
        return loc.nbytes


@aiofiles.os.wrap
def _read_batch(reader: StoreReader, fd: int, items) -> None:
    for layer, expert, dests, done in items:
        try:
            n = reader.read_sync(fd, layer, expert, dests)
        except StorageError as e:
            done(0, e)
        else:
            done(n, None)


def _read_zstd(fd: int, loc: ExpertLocation, dests: Sequence[memoryview], where: str) -> None:
    import zstandard

    (offset, n), = loc.segments
    blob = os.pread(fd, n, offset)
    if len(blob) != n:
        raise StorageError(f"{where}: short read at offset {offset} ({len(blob)} of {n} bytes): "
                           "is the file truncated?")
    want = sum(d.nbytes for d in dests)
    try:
        raw = zstandard.ZstdDecompressor().decompress(blob, max_output_size=want)
    except zstandard.ZstdError as e:
        raise StorageError(f"{where}: bad zstd frame at offset {offset}: {e}") from None
    if len(raw) != want:
        raise StorageError(f"{where}: zstd frame at offset {offset} holds {len(raw)} bytes, expected {want}")
    pos = 0
    for d in dests:
        d[:] = raw[pos:pos + d.nbytes]
        pos += d.nbytes


class _Concat:
    """Consecutive buffers viewed as one byte stream: take(n) -> the next n bytes as buffers."""

    def __init__(self, bufs: Sequence[memoryview]):
        self._bufs = [memoryview(b).cast("B") for b in bufs]
        self._i = 0
        self._pos = 0

    def take(self, n: int) -> list[memoryview]:
        out = []
        while n > 0:
            if self._i >= len(self._bufs):
                raise StorageError("expert location is longer than its slices")
            b = self._bufs[self._i]
            k = min(n, b.nbytes - self._pos)
            out.append(b[self._pos:self._pos + k])
            self._pos += k
            n -= k
            if self._pos == b.nbytes:
                self._i, self._pos = self._i + 1, 0
        return out
