"""A model file as it was opened: refuse anything but a regular file, and notice a change.

    open_regular(path) -> (fd, fstat)   a regular file only, never blocking on a FIFO or device
    FileIdentity.of(path, st)           device, inode, size, mtime, ctime and a content fingerprint;
    identity.check(fd, context)         ModelFileChanged once the file is not what was loaded

Used by the GGUF reader (gguf.py), the expert pack and store, and the routing replay's trace.
"""

from __future__ import annotations

import errno
import os
import stat
import threading
from dataclasses import dataclass, field

from daemon.errors import ModelFileChanged

from .fingerprint import Fingerprint


def open_regular(path: str) -> tuple[int, os.stat_result]:
    """Open `path` read-only if it is a regular file; -> (descriptor, its fstat).

    The type is checked before the open, so a FIFO or device is never opened (opening a FIFO
    blocks until a writer comes), and the open is non-blocking with the type checked again on
    the descriptor, so a swap between the two cannot block either. Raises OSError; a path that
    is not a regular file gives strerror "not a regular file"."""
    if not stat.S_ISREG(os.stat(path).st_mode):
        raise OSError(errno.EINVAL, "not a regular file", path)
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise OSError(errno.EINVAL, "not a regular file", path)
    except BaseException:
        os.close(fd)
        raise
    return fd, st


@dataclass(eq=False)
class FileIdentity:
    """A file as it was when it was loaded. `check` raises ModelFileChanged once it is not.

    ctime_ns: the last status-change time at which the content was known to be as loaded. A
    newer ctime with the same size and mtime (chmod, link, rename, or a rewrite that set the
    mtime back) is settled by the content: hashed again and compared with `fingerprint`, then
    remembered either way, so each ctime costs one hash. No fingerprint (a pack, whose every read
    is checked against its crc32): a ctime change alone is no change."""

    path: str
    dev: int
    ino: int
    size: int
    mtime_ns: int
    ctime_ns: int = 0
    fingerprint: Fingerprint | None = None
    _bad_ctime_ns: int | None = field(default=None, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @classmethod
    def of(cls, path: str, st: os.stat_result) -> FileIdentity:
        return cls(path, st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)

    def changes(self, fd: int | None = None) -> str:
        """What changed, or "" if nothing did. fd: a descriptor open on the file, whose size and
        mtime are compared (those of the path otherwise); the path's inode is always compared,
        to notice a file replaced (renamed over) or removed."""
        notes = []
        if fd is not None:
            try:
                st = os.fstat(fd)
            except OSError as e:
                return f"cannot stat the open file: {e.strerror or e}"
            if (st.st_dev, st.st_ino) != (self.dev, self.ino):
                notes.append("the open file is another file")
            notes += self._content_changes(st, fd)
        try:
            pst = os.stat(self.path)
        except FileNotFoundError:
            notes.append("removed")
        except OSError as e:
            notes.append(f"cannot stat the path: {e.strerror or e}")
        else:
            if (pst.st_dev, pst.st_ino) != (self.dev, self.ino):
                notes.append("replaced by another file")
            elif fd is None:
                notes += self._content_changes(pst)
        return "; ".join(notes)

    def _content_changes(self, st: os.stat_result, fd: int | None = None) -> list[str]:
        if st.st_size < self.size:
            return [f"truncated from {self.size} to {st.st_size} bytes"]
        if st.st_size > self.size:
            return [f"grew from {self.size} to {st.st_size} bytes"]
        if st.st_mtime_ns != self.mtime_ns:
            return ["modified: its modification time changed"]
        if st.st_ctime_ns != self.ctime_ns and self.fingerprint is not None:
            return self._verify(st.st_ctime_ns, fd)
        return []

    def _verify(self, ctime_ns: int, fd: int | None) -> list[str]:
        changed = ["modified: its content changed (its size and modification time did not)"]
        with self._lock:  # one hash per ctime, however many threads check at once
            if ctime_ns == self.ctime_ns:
                return []
            if ctime_ns == self._bad_ctime_ns:
                return changed
            try:
                same = self._matches(fd)
            except OSError as e:
                return [f"cannot read it to check its content: {e.strerror or e}"]
            if not same:
                self._bad_ctime_ns = ctime_ns
                return changed
            self.ctime_ns = ctime_ns  # the stat came first: a later change has a later ctime
            return []

    def _matches(self, fd: int | None) -> bool:
        if fd is not None:
            return self.fingerprint.matches(fd)
        fd, st = open_regular(self.path)
        try:
            return (st.st_dev, st.st_ino) == (self.dev, self.ino) and self.fingerprint.matches(fd)
        finally:
            os.close(fd)

    def check(self, fd: int | None = None, context: str = "") -> None:
        """Raise ModelFileChanged naming the file and what changed, if anything did.
        context: appended to the message (what was being read)."""
        what = self.changes(fd)
        if what:
            raise ModelFileChanged(self.changed_message(what, context))

    def changed_message(self, what: str, context: str = "") -> str:
        return f"model file changed on disk: {self.path} ({what})" + (f"; {context}" if context else "")
