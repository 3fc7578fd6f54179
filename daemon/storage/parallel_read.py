"""Demand reads on the compute threads: one parallel `pread` over a step's missing experts.

When a step misses experts it can do nothing else until they arrive, and the compute pool's
threads are idle (or spinning) meanwhile. Handing the reads to the I/O thread pool costs two
thread hand-offs per batch and, with as many compute threads as cores, the readers then compete
with spinning workers for a core (the 16-thread decode cliff of docs/benchmarks.md). Here the
compute pool itself reads: each expert's byte ranges are cut into chunks of at most CHUNK bytes
and one numba parallel loop `pread`s them straight into the cache slots, so every core copies
from the page cache (or keeps a disk read in flight) and no other thread is involved.

Errors are not decoded in the kernel: an entry with a short chunk is read again with
`StoreReader.read_sync`, which raises the usual StorageError naming file, layer and expert.
Legend: C = chunks of one batch.
"""

from __future__ import annotations

import os
import zlib
from collections.abc import Sequence

import numpy as np
from numba import njit, prange, types

from ..errors import ModelFileChanged, StorageError
from .identity import open_regular
from .store import ExpertStore, StoreReader, no_readahead

CHUNK = 1 << 19  # bytes: small enough that a few experts spread over 16 threads

# libc's pread by symbol (cacheable, unlike a ctypes pointer); the buffer address travels as
# size_t, the same ABI as void* on the platforms numba targets
_pread = types.ExternalFunction("pread", types.intp(types.int32, types.uintp, types.uintp, types.int64))


@njit(parallel=True, cache=True, nogil=True)
def _pread_chunks(fd, dest, offset, length, got):
    """dest [C] addresses, offset [C] file offsets, length [C] bytes -> got [C] bytes read."""
    for i in prange(dest.size):
        done = 0
        while done < length[i]:
            n = _pread(fd, dest[i] + done, length[i] - done, offset[i] + done)
            if n <= 0:  # error or end of file: read_sync reports it
                break
            done += n
        got[i] = done


class ParallelReader:
    """Reads experts of one store on the calling thread's numba pool. Opens its own descriptor
    on first use (a StorageError / ModelFileChanged then fails that read batch only)."""

    def __init__(self, store: ExpertStore):
        self.store = store
        self._sync = StoreReader(store)
        self._fd: int | None = None

    def close(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)

    def _open(self) -> int:
        if self._fd is None:
            store = self.store
            try:
                fd, _ = open_regular(store.path)
            except OSError as e:
                why = f"cannot open {store.path}: {e.strerror or e}"
                what = store.identity.changes() if store.identity is not None else ""
                if what:
                    raise ModelFileChanged(store.identity.changed_message(what, why)) from None
                raise StorageError(why) from None
            no_readahead(fd)
            self._fd = fd
        return self._fd

    def read(self, layer: int, experts: Sequence[int], dests: Sequence[tuple[np.ndarray, ...]]
             ) -> list[tuple[int, BaseException | None]]:
        """Read experts[i] into dests[i] (its gate, up, down arrays, C-contiguous uint8).
        -> [(bytes read, None) or (0, the error)] per expert; never raises for one expert's fault."""
        try:
            fd = self._open()
        except StorageError as e:
            return [(0, e)] * len(experts)
        raw = [i for i, e in enumerate(experts) if self.store.location(layer, e).codec == "raw"]
        compressed = set(range(len(experts))) - set(raw)
        results: list[tuple[int, BaseException | None]] = [(0, None)] * len(experts)
        if raw:
            chunk_owner, plan = _plan(self.store, layer, [experts[i] for i in raw], [dests[i] for i in raw])
            got = np.zeros(len(plan[0]), np.int64)
            _pread_chunks(fd, *plan, got)
            short = set(chunk_owner[got != plan[2]].tolist())
            for j, i in enumerate(raw):
                results[i] = self._finish(fd, layer, experts[i], dests[i], retry=j in short)
        for i in sorted(compressed):  # zstd (packs): read and decompressed on this thread
            results[i] = self._finish(fd, layer, experts[i], dests[i], retry=True)
        changed = self.store.changes(fd)  # after the reads: a change made before them shows here
        if changed is not None:
            ident, what = changed
            return [(0, ModelFileChanged(ident.changed_message(what, f"reading layer {layer} expert {e}")))
                    for e in experts]
        return results

    def _finish(self, fd: int, layer: int, expert: int, dest: tuple[np.ndarray, ...], retry: bool
                ) -> tuple[int, BaseException | None]:
        loc = self.store.location(layer, expert)
        views = [memoryview(d).cast("B") for d in dest]
        try:
            if retry:  # re-read the slow way: raises the precise StorageError if it fails again
                return self._sync.read_sync(fd, layer, expert, views), None
            if loc.checksum is not None:
                crc = 0
                for v in views:
                    crc = zlib.crc32(v, crc)
                if crc != loc.checksum:
                    raise StorageError(f"{self.store.path}: layer {layer} expert {expert}: "
                                       "checksum mismatch (corrupt pack?)")
            return loc.nbytes, None
        except StorageError as e:
            return 0, e


def _plan(store: ExpertStore, layer: int, experts, dests):
    """The chunks of raw experts: -> (owner [C] index into experts, (dest [C], offset [C], length [C]))."""
    owner, dest, offset, length = [], [], [], []
    for j, (e, bufs) in enumerate(zip(experts, dests)):
        targets = [(b.ctypes.data, b.nbytes) for b in bufs]  # consecutive destination buffers
        t, pos = 0, 0
        for file_off, n in store.location(layer, e).segments:
            while n > 0:
                if t >= len(targets):
                    raise StorageError("expert location is longer than its slices")
                addr, size = targets[t]
                k = min(n, size - pos, CHUNK)
                owner.append(j)
                dest.append(addr + pos)
                offset.append(file_off)
                length.append(k)
                file_off += k
                pos += k
                n -= k
                if pos == size:
                    t, pos = t + 1, 0
    return (np.array(owner, np.int64),
            (np.array(dest, np.uint64), np.array(offset, np.int64), np.array(length, np.int64)))
