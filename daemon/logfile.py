"""The background daemon's log file, beside its socket (PATH.log): opened with the lock file's
care and kept to a bounded size.

    open_log(path, write=True) -> fd      refuse anything but a private regular file of ours
    RotatingStderr(path)                  a logging handler on stderr that rotates the file

The socket may live in a sticky shared directory such as /tmp, where another user can plant a
FIFO, a symbolic link or their own 0666 file (they would read the model paths and errors we log).
So the log is opened as the lock file is (ipc.ownfile: O_NOFOLLOW|O_NONBLOCK, a regular file of
the daemon's user with one link, made 0600); anything else is refused (MoedError naming the path
and MOED_SOCKET).

Size: when the file passes LOG_MAX_BYTES it is renamed to PATH.log.1 (replacing the older one)
and a fresh PATH.log is opened onto stdout and stderr, so that logging, warnings and a crash's
traceback all follow. At most about 2 x LOG_MAX_BYTES are on disk. If the rename fails (say,
another user planted PATH.log.1 in a sticky directory), the file is truncated instead: the
cap holds either way.
"""

from __future__ import annotations

import logging
import os
import sys

from ipc.ownfile import NotOurFile, open_own

from .errors import MoedError

LOG_MAX_BYTES = 16 * 2**20  # per file; one old file (.1) is kept
_WRITE_FLAGS = os.O_WRONLY | os.O_APPEND | os.O_CREAT


def _refuse(path: str, why: str) -> MoedError:
    return MoedError(f"the daemon's log {path} {why}; remove it if you made it, or put the socket "
                     f"in a directory of your own (MOED_SOCKET)")


def open_log(path: str, write: bool = True) -> int:
    """A blocking fd on the log at `path` (created 0600 when writing), or MoedError if it is not a
    regular file of ours with one link (ipc.ownfile). Never follows a link, never blocks on a FIFO."""
    try:
        return open_own(path, _WRITE_FLAGS if write else os.O_RDONLY)
    except NotOurFile as e:
        raise _refuse(path, str(e)) from None
    except OSError as e:
        raise MoedError(f"cannot open the daemon's log {path}: {e.strerror or e}") from None


def tail(path: str, n: int = 5, max_bytes: int = 8192) -> list[str]:
    """The last `n` lines of the log (of its last `max_bytes`), [] if it is missing or unsafe."""
    try:
        fd = open_log(path, write=False)
    except MoedError:
        return []
    try:
        size = os.fstat(fd).st_size
        data = os.pread(fd, max_bytes, max(0, size - max_bytes))
    except OSError:
        return []
    finally:
        os.close(fd)
    return data.decode(errors="replace").splitlines()[-n:]


class RotatingStderr(logging.StreamHandler):
    """Log to stderr, which is the log file at `path`; past `max_bytes`, rotate it (see above).
    Checked before each record: one fstat."""

    def __init__(self, path: str, max_bytes: int = LOG_MAX_BYTES):
        super().__init__(sys.stderr)
        self.path = path
        self.max_bytes = max_bytes

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self._rotate_if_full()
        except Exception:  # noqa: BLE001 - the record still goes out; never kill the daemon over its log
            self.handleError(record)
        super().emit(record)

    def _rotate_if_full(self) -> None:
        err = sys.stderr.fileno()
        st = os.fstat(err)
        if st.st_size < self.max_bytes:
            return
        sys.stderr.flush()
        sys.stdout.flush()
        try:
            cur = os.lstat(self.path)
        except FileNotFoundError:  # removed by hand: start a new one
            cur = None
        ours = cur is not None and (cur.st_dev, cur.st_ino) == (st.st_dev, st.st_ino)
        if ours:
            try:
                os.replace(self.path, self.path + ".1")
            except OSError:
                ours = False  # e.g. another user's .1 in a sticky directory
        if cur is None or ours:
            try:
                fd = open_log(self.path)
            except MoedError:
                fd = None
            if fd is not None:
                os.dup2(fd, 1)
                os.dup2(fd, 2)
                os.close(fd)
                return
        os.ftruncate(err, 0)  # cannot rotate: cap it in place (O_APPEND writes go to the new end)
