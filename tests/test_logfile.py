"""daemon/logfile.py: the daemon's log is opened with the lock file's care (no FIFO, link or other
user's file) and rotated to PATH.1 past its cap, or truncated where it cannot rotate."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import textwrap

import pytest

from daemon.errors import MoedError
from daemon.logfile import open_log, tail
from tests.ipc.test_security import OTHER, as_root

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_a_new_log_is_a_private_file(tmp_path):
    path = str(tmp_path / "moed.log")
    os.close(open_log(path))
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600


def test_a_fifo_is_refused_without_blocking(tmp_path):
    path = str(tmp_path / "moed.log")
    os.mkfifo(path, 0o666)
    # In a child with a time limit: an open() that blocks would hang the suite, not fail it.
    code = f"from daemon.logfile import open_log\ntry:\n    open_log({path!r})\nexcept Exception as e:\n    print(e)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert "not a regular file" in out.stdout and path in out.stdout and "MOED_SOCKET" in out.stdout
    assert tail(path) == []  # reading it must not block either


def test_a_fifo_with_a_reader_is_refused(tmp_path):
    path = str(tmp_path / "moed.log")
    os.mkfifo(path, 0o666)
    reader = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # the planter listening: open() would succeed
    try:
        with pytest.raises(MoedError, match="not a regular file"):
            open_log(path)
    finally:
        os.close(reader)


def test_a_symlink_is_not_followed(tmp_path):
    target = tmp_path / "elsewhere"
    path = str(tmp_path / "moed.log")
    os.symlink(target, path)
    with pytest.raises(MoedError, match="symbolic link") as e:
        open_log(path)
    assert path in str(e.value) and "MOED_SOCKET" in str(e.value)
    assert not os.path.lexists(target)


def test_a_hard_linked_file_is_refused(tmp_path):
    path = str(tmp_path / "moed.log")
    (tmp_path / "precious").write_text("precious\n")
    os.link(tmp_path / "precious", path)
    with pytest.raises(MoedError, match="hard links"):
        open_log(path)
    assert (tmp_path / "precious").read_text() == "precious\n"


@as_root
def test_another_users_0666_file_is_refused(tmp_path):
    path = str(tmp_path / "moed.log")
    with open(path, "w") as f:
        f.write("planted\n")
    os.chmod(path, 0o666)
    os.chown(path, OTHER, OTHER)
    with pytest.raises(MoedError, match=f"uid {OTHER}") as e:
        open_log(path)
    assert path in str(e.value) and "MOED_SOCKET" in str(e.value)
    with open(path) as f:
        assert f.read() == "planted\n"


def test_our_own_open_file_is_made_private(tmp_path):
    path = str(tmp_path / "moed.log")
    with open(path, "w") as f:
        f.write("old line\n")
    os.chmod(path, 0o666)
    os.close(open_log(path))
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert tail(path) == ["old line"]


def test_tail_reads_only_the_end(tmp_path):
    path = tmp_path / "moed.log"
    path.write_text("".join(f"line {i}\n" for i in range(100_000)))
    assert tail(str(path), 2) == ["line 99998", "line 99999"]


# The handler moves fds 1 and 2: run it in a child, as the daemon does.
ROTATE = textwrap.dedent("""
    import logging, os, sys
    from daemon.logfile import RotatingStderr, open_log
    path = sys.argv[1]
    fd = open_log(path)
    os.dup2(fd, 1); os.dup2(fd, 2); os.close(fd)
    log = logging.getLogger("t")
    log.addHandler(RotatingStderr(path, max_bytes=1000))
    log.propagate = False
    for i in range(200):
        log.warning("record %03d %s", i, "x" * 40)
    print("printed after the last record", flush=True)
""")


def _rotate(path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", ROTATE, str(path)], capture_output=True, text=True, timeout=60,
                          cwd=ROOT)


def test_the_log_rotates_to_dot_1_past_its_cap(tmp_path):
    path = tmp_path / "moed.log"
    out = _rotate(path)
    assert out.returncode == 0, out.stderr
    line = len("record 000 " + "x" * 40 + "\n")
    cur, old = path.read_text(), (tmp_path / "moed.log.1").read_text()
    assert len(old) < 1000 + line  # rotated before the record that would pass the cap
    assert os.path.getsize(path) < 1000 + line + len("printed after the last record\n")
    assert cur.endswith("record 199 " + "x" * 40 + "\nprinted after the last record\n")  # stdout follows too
    assert old.splitlines()[-1].split()[1] == f"{int(cur.split()[1]) - 1:03d}"  # no record lost in between
    assert sorted(os.listdir(tmp_path)) == ["moed.log", "moed.log.1"]  # one old file kept
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600


def test_the_log_is_truncated_where_it_cannot_rotate(tmp_path):
    path = tmp_path / "moed.log"
    (tmp_path / "moed.log.1").mkdir()  # a rename onto it fails (as another user's file would in /tmp)
    out = _rotate(path)
    assert out.returncode == 0, out.stderr
    assert os.path.getsize(path) < 1000 + 2 * 60  # at most one record and the print past the cap
    assert path.read_text().endswith("printed after the last record\n")
