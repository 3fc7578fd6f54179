"""Open a file beside the socket only if it is a private regular file of ours.

    open_own(path, flags) -> fd     raises NotOurFile(why) for anything else

The socket may live in a sticky shared directory such as /tmp, where another user can plant a
FIFO (open() would block forever), a symbolic link (we would write where it points), a hard link
to a file of ours, or their own 0666 file (they would read what we write). The daemon's lock file
(ipc/server.py) and its log (daemon/logfile.py) are both opened here, so the rules are one.
"""

from __future__ import annotations

import errno
import os
import stat

_FLAGS = os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC


class NotOurFile(Exception):
    """The path is not a private regular file of ours; str() says why ("is a symbolic link; ...")."""


def open_own(path: str, flags: int, uid: int | None = None) -> int:
    """A blocking fd on `path`, opened with `flags` (plus O_NOFOLLOW|O_NONBLOCK, so neither a link
    nor a FIFO is followed or waited on; created 0600 with O_CREAT), kept only if it is a regular
    file of `uid` (default: ours) with one link. A file opened for writing is made 0600: ours,
    but others could read it. Other OSErrors pass through."""
    uid = os.geteuid() if uid is None else uid
    try:
        fd = os.open(path, flags | _FLAGS, 0o600)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise NotOurFile("is a symbolic link; not following it") from None
        if e.errno == errno.ENXIO:  # a FIFO with no reader (O_NONBLOCK|O_WRONLY)
            raise NotOurFile("is not a regular file") from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise NotOurFile("is not a regular file")
        if st.st_uid != uid:
            raise NotOurFile(f"belongs to uid {st.st_uid}, not to this user (uid {uid})")
        if st.st_nlink != 1:
            raise NotOurFile("has other hard links; not writing to it")
        if flags & (os.O_WRONLY | os.O_RDWR) and stat.S_IMODE(st.st_mode) & 0o077:
            os.fchmod(fd, 0o600)
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd
