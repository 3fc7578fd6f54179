"""The expert store: where every (layer, expert) lives on disk, and async reads of it.

An expert is read as a few byte ranges (segments) whose concatenation is its gate|up|down slices.
In a GGUF file the three slices sit in three stacked tensors, so an expert is three segments:
expert e of a tensor with ne = [K, N, E] is the contiguous range data_offset + e * nbytes / E.
In an expert pack (pack.py) they are adjacent, so an expert is one segment, possibly zstd.

Reads are positional (`preadv` straight into the destination buffers, run in the I/O thread pool
through aiofiles), so the model is never mapped or read whole and several reads can be in flight
on one descriptor. Every read's length is checked, and after each batch of reads the file is
compared with the one loaded (`FileIdentity`: inode, size, mtime; and the GGUF a pack was made
from): if it changed, every expert of the batch fails with ModelFileChanged, since its bytes may
not be the ones validated. Legend: E = experts, K = input length, N = output rows.
"""

from __future__ import annotations

import os
import re
import zlib
from collections.abc import Sequence
from dataclasses import dataclass

import aiofiles.os

from ..errors import GGUFError, ModelFileChanged, StorageError
from .experts import PROJECTIONS, ExpertLayout
from .identity import FileIdentity, open_regular


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
    """Locations of every expert of every MoE layer in one file.

    identity: that file as loaded (None: not checked); source: for a pack, the GGUF file it was
    made from, also checked at each read batch (the model is that file)."""

    def __init__(self, path: str, layouts: dict[int, ExpertLayout],
                 locations: dict[int, list[ExpertLocation]], kind: str,
                 identity: FileIdentity | None = None, source: FileIdentity | None = None):
        self.path = path
        self.layouts = layouts  # MoE layer -> layout
        self.locations = locations  # MoE layer -> [E] locations
        self.kind = kind  # "gguf" | "pack"
        self.identity = identity
        self.source = source

    @classmethod
    def from_gguf(cls, gguf, layouts: dict[int, ExpertLayout]) -> ExpertStore:
        locations = {}
        for il, lay in layouts.items():
            infos = [gguf.tensor_info(f"blk.{il}.ffn_{p}_exps.weight") for p in PROJECTIONS]
            sizes = [lay.nbytes(p) for p in PROJECTIONS]
            for ti, size in zip(infos, sizes):
                if ti.nbytes != size * lay.n_expert:
                    raise GGUFError(f"{gguf.path}: tensor {ti.name!r}: {ti.nbytes} bytes, "
                                    f"expected {lay.n_expert} x {size}")
            locations[il] = [ExpertLocation(tuple((ti.offset + e * size, size) for ti, size in zip(infos, sizes)))
                             for e in range(lay.n_expert)]
        return cls(os.fspath(gguf.path), layouts, locations, "gguf", gguf.identity)

    def location(self, layer: int, expert: int) -> ExpertLocation:
        return self.locations[layer][expert]

    def changes(self, fd: int) -> tuple[FileIdentity, str] | None:
        """(the file, what changed) if the store's file (open as fd) or its source changed."""
        for ident, ident_fd in ((self.identity, fd), (self.source, None)):
            if ident is not None:
                what = ident.changes(ident_fd)
                if what:
                    return ident, what
        return None


_EXPERT_TENSOR = re.compile(r"blk\.(0|[1-9]\d*)\.ffn_(?:gate_exps|up_exps|down_exps|gate_inp)\.weight")


def expert_layouts(gguf) -> dict[int, ExpertLayout]:
    """MoE layer -> layout, from the stacked expert tensors the file holds (ne = [K, N, E]).

    A layer with a router or any of its three expert tensors must have all three, of matching
    shapes and no empty dimension; otherwise GGUFError names what is missing or wrong."""
    layers = sorted({int(m.group(1)) for m in map(_EXPERT_TENSOR.fullmatch, gguf.tensors) if m})
    layouts = {}
    for il in layers:
        names = [f"blk.{il}.ffn_{p}_exps.weight" for p in PROJECTIONS]
        missing = [n for n in names if n not in gguf.tensors]
        if missing:
            has = [n for n in (f"blk.{il}.ffn_gate_inp.weight", *names) if n in gguf.tensors]
            raise GGUFError(f"{gguf.path}: no tensor named {missing[0]!r} (layer {il} has "
                            f"{', '.join(repr(n) for n in has)})")
        g, u, d = (gguf.tensor_info(n) for n in names)
        if len(g.ne) != 3 or g.ne != u.ne or tuple(d.ne) != (g.ne[1], g.ne[0], g.ne[2]):
            raise GGUFError(f"{gguf.path}: layer {il}: expert tensors of mismatched shapes "
                            f"{list(g.ne)}, {list(u.ne)}, {list(d.ne)}")
        if 0 in g.ne:
            raise GGUFError(f"{gguf.path}: layer {il}: expert tensors of empty shape {list(g.ne)}")
        layouts[il] = ExpertLayout(g.ne[2], g.ne[0], g.ne[1], g.ggml_type, u.ggml_type, d.ggml_type)
    return layouts


class StoreReader:
    """Reads experts from one store's file. `await open()` in the loop that reads; then
    `await read_into(...)` for one expert, or `await read_batch(...)` for several in one
    thread-pool job (a job costs tens of microseconds of thread hand-off: small experts are
    batched, big ones read in parallel by the caller)."""

    def __init__(self, store: ExpertStore):
        self.store = store
        self._fd: int | None = None

    async def open(self) -> None:
        """Open the store's file (a regular file, never blocking) and check it is the one loaded.
        Raises StorageError, or ModelFileChanged."""
        self._fd = await _open_store(self.store)

    async def close(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)

    async def read_into(self, layer: int, expert: int, dests: Sequence[memoryview]) -> int:
        """Read one expert into dests (gate, up, down byte buffers); -> bytes read.
        Raises StorageError naming the file, layer and expert on a short read or an I/O error,
        ModelFileChanged if the file is no longer the one loaded."""
        out: list = []
        await self.read_batch([(layer, expert, dests, lambda n, err: out.append((n, err)))])
        n, err = out[0]
        if err is not None:
            raise err
        return n

    async def read_batch(self, items) -> None:
        """items: (layer, expert, dests, done(nbytes, error | None)). The experts are read, the file
        is checked, then each done runs on the reading thread, so a waiter wakes without another
        hop through the loop. A changed file fails every expert of the batch."""
        await _read_batch(self, self._fd, items)

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


def no_readahead(fd: int) -> None:
    """Expert reads are exact byte ranges at random places: readahead past them only reads
    bytes nobody asked for (cold, with uniform routing, it more than doubled the disk reads)."""
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
    except (AttributeError, OSError):  # not on this platform / filesystem: only a hint
        pass


@aiofiles.os.wrap
def _open_store(store: ExpertStore) -> int:
    try:
        fd, _ = open_regular(store.path)
    except OSError as e:
        why = f"cannot open {store.path}: {e.strerror or e}"
        what = store.identity.changes() if store.identity is not None else ""
        if what:  # removed or replaced since it was loaded
            raise ModelFileChanged(store.identity.changed_message(what, why)) from None
        raise StorageError(why) from None
    changed = store.changes(fd)
    if changed is not None:
        os.close(fd)
        ident, what = changed
        raise ModelFileChanged(ident.changed_message(what))
    no_readahead(fd)
    return fd


@aiofiles.os.wrap
def _read_batch(reader: StoreReader, fd: int | None, items) -> None:
    if fd is None:
        err = StorageError(f"{reader.store.path}: the store is not open")
        for *_, done in items:
            done(0, err)
        return
    results = []
    for layer, expert, dests, _ in items:
        try:
            results.append((reader.read_sync(fd, layer, expert, dests), None))
        except StorageError as e:
            results.append((0, e))
    # Checked after the reads: a change made before them (truncation, rewrite) shows here.
    changed = reader.store.changes(fd)
    for (layer, expert, _, done), (n, err) in zip(items, results):
        if changed is not None:
            ident, what = changed
            done(0, ModelFileChanged(ident.changed_message(what, f"reading layer {layer} expert {expert}")))
        else:
            done(n, err)


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
