"""ipc/ownfile.py: the rules the lock file and the daemon's log share (their own tests cover the
planted FIFO, link, hard link and other user's file through open_log and Server)."""

from __future__ import annotations

import os
import stat

import pytest

from ipc.ownfile import NotOurFile, open_own


def test_a_file_of_ours_opened_for_writing_is_made_private(tmp_path):
    path = tmp_path / "f"
    path.write_text("x")
    os.chmod(path, 0o644)
    os.close(open_own(str(path), os.O_RDONLY))
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o644  # reading changes nothing
    os.close(open_own(str(path), os.O_WRONLY))
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600


def test_a_file_of_another_uid_is_refused(tmp_path):
    path = tmp_path / "f"
    path.write_text("x")
    with pytest.raises(NotOurFile, match=f"belongs to uid {os.geteuid()}"):
        open_own(str(path), os.O_RDONLY, uid=os.geteuid() + 1)


def test_a_directory_is_refused_and_other_errors_pass_through(tmp_path):
    with pytest.raises(NotOurFile, match="not a regular file"):
        open_own(str(tmp_path), os.O_RDONLY)
    with pytest.raises(FileNotFoundError):
        open_own(str(tmp_path / "missing"), os.O_RDONLY)
