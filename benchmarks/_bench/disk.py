"""Disk measurements: a `dd iflag=direct`-style sequential read, and dropping a file's cached pages."""

from __future__ import annotations

import mmap
import os
import time

from memory_limited import _io_read_bytes as io_read_bytes  # re-exported for the children
from memory_limited import drop_cache

__all__ = ["direct_read_rate", "drop_file_pages", "io_read_bytes"]

DIRECT_READ_LIMIT = 1 << 30
DIRECT_CHUNK = 4 << 20  # dd bs=4M


def direct_read_rate(path: str, limit: int = DIRECT_READ_LIMIT) -> dict:
    """Read the first `limit` bytes of `path` (or all of it) sequentially with O_DIRECT into an
    aligned buffer, as `dd iflag=direct bs=4M` does. -> {"bytes", "seconds", "bytes_per_s", "mode"}.
    Where O_DIRECT is refused (tmpfs, some overlay file systems), the file's cached pages are
    dropped and it is read buffered; "mode" says which."""
    buf = mmap.mmap(-1, DIRECT_CHUNK)  # anonymous mappings are page-aligned, as O_DIRECT needs
    try:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
            mode = "O_DIRECT"
        except OSError:
            fd, mode = None, ""
        if fd is not None:
            try:
                return _timed_read(fd, buf, limit) | {"mode": mode}
            except OSError:  # EINVAL on the first read: the file system takes the flag but not the I/O
                pass
            finally:
                os.close(fd)
        drop_cache(path)
        fd = os.open(path, os.O_RDONLY)
        try:
            return _timed_read(fd, buf, limit) | {"mode": "buffered after fadvise DONTNEED (no O_DIRECT here)"}
        finally:
            os.close(fd)
    finally:
        buf.close()


def _timed_read(fd: int, buf: mmap.mmap, limit: int) -> dict:
    done = 0
    t0 = time.perf_counter()
    while done < limit:
        n = os.preadv(fd, [buf], done)
        if n <= 0:
            break
        done += n
    dt = time.perf_counter() - t0
    return {"bytes": done, "seconds": dt, "bytes_per_s": done / dt if dt > 0 else 0.0}


def drop_file_pages(path: str) -> str:
    """Evict `path` from the page cache: posix_fadvise(DONTNEED) always, and the whole page cache
    (`echo 1 > /proc/sys/vm/drop_caches`) where this user may. -> what was done, in words."""
    drop_cache(path)
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("1")
        return "fadvise DONTNEED + drop_caches"
    except OSError:
        return "fadvise DONTNEED only (drop_caches not permitted)"
