"""Who may ask the daemon for what: a peer other than the daemon's own user (or root) gets nothing
it could not get itself. The scheduler checks every request here, whatever server it came through.

    check_settings(peer, settings)   a Load's settings: no daemon-side paths (the daemon would write
                                     where they say)
    check_model(peer, path, what)    a model file, named or the daemon's default (the demo
                                     included): the peer must be able to read it by the mode bits
                                     of the file and every directory above it
    Each raises SchedulerError("forbidden"). `peer` is anything with `uid` (int) and `gids` (the
    peer's groups, a frozenset of ints); None = an in-process caller, trusted. A peer whose uid is
    the daemon's own or root's is trusted too.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Mapping
from typing import Any, Protocol

from ..config import Settings
from ..errors import SchedulerError

PATH_SETTINGS = Settings.path_settings()


class Peer(Protocol):
    uid: int
    gids: frozenset[int]  # the group ids its processes have (primary and supplementary)


def trusted(peer: Peer | None) -> bool:
    return peer is None or peer.uid in (os.geteuid(), 0)


def check_settings(peer: Peer | None, settings: Mapping[str, Any] | None) -> None:
    if trusted(peer) or not settings:
        return
    paths = sorted(PATH_SETTINGS & settings.keys())
    if paths:
        raise SchedulerError("forbidden", f"{', '.join(paths)}: only the daemon's own user may set "
                                          f"daemon-side paths")


def check_model(peer: Peer | None, path: str, what: str) -> None:
    """`path`: resolved (the file the load opens); `what`: how the error names it (the name the
    peer sent, or "the default model": its path is the daemon's business)."""
    if trusted(peer):
        return
    if not readable_by(path, peer.uid, peer.gids):
        raise SchedulerError("forbidden", f"uid {peer.uid} cannot read {what} itself, so the daemon "
                                          f"will not read it for it")


def _permits(st: os.stat_result, uid: int, gids: frozenset[int], owner: int, group: int, other: int) -> bool:
    """The mode bits' answer for this user: the owner's bits, else the group's, else others'."""
    if st.st_uid == uid:
        return bool(st.st_mode & owner)
    if st.st_gid in gids:
        return bool(st.st_mode & group)
    return bool(st.st_mode & other)


def readable_by(path: str, uid: int, gids: frozenset[int]) -> bool:
    """Whether the user could read the file at this resolved path: every directory above it
    searchable and the file readable, by mode bits (ACLs are not consulted). A missing file whose
    directory the user can search counts as readable: they could see it is missing themselves."""
    parent = os.path.dirname(path)
    dirs = [parent]
    while dirs[-1] != os.path.dirname(dirs[-1]):
        dirs.append(os.path.dirname(dirs[-1]))
    for d in reversed(dirs):  # from "/" down: stop at the first the user may not search
        try:
            st = os.stat(d)
        except FileNotFoundError:
            return True
        if not stat.S_ISDIR(st.st_mode) or not _permits(st, uid, gids, stat.S_IXUSR, stat.S_IXGRP, stat.S_IXOTH):
            return False
    try:
        st = os.stat(path)  # stat, not open: a FIFO must not block here
    except FileNotFoundError:
        return True
    return _permits(st, uid, gids, stat.S_IRUSR, stat.S_IRGRP, stat.S_IROTH)
