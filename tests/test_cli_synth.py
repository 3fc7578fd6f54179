"""`moed synth` output handling: OUT.part is removed on SIGTERM and SIGHUP (as on SIGINT), and an
output that cannot be written is refused before the work, with the real reason."""

from __future__ import annotations

import os
import signal

import pytest

from daemon.cli import main
from daemon.synth import writer
from tests.interrupt import interrupt_mid_write

TINY = ["--like", "mixtral-8x7b", "--layers", "1", "--experts", "2", "--used", "1", "--hidden", "256", "--ff", "256",
        "--heads", "2"]
# About 200 MB of expert data: long enough to catch the process mid-write
BIG = ["--like", "mixtral-8x7b", "--layers", "2", "--experts", "4", "--used", "2", "--hidden", "2048", "--ff", "6144",
       "--heads", "16"]


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_a_signal_mid_write_removes_the_part_file(tmp_path, sig):
    out = tmp_path / "x.gguf"
    part = tmp_path / "x.gguf.part"
    err = interrupt_mid_write(["synth", str(out), *BIG], part.exists, out.exists, sig)
    assert f"stopped by signal {int(sig)}" in err
    assert os.listdir(tmp_path) == []


@pytest.fixture
def no_work(monkeypatch) -> list:
    """Count the blocks synth generates: a refusal must come before any."""
    calls = []
    real = writer.random_blocks
    monkeypatch.setattr(writer, "random_blocks", lambda *a: calls.append(1) or real(*a))
    return calls


def test_an_unwritable_place_says_why_not_no_space(no_work, capsys):
    # /sys takes no new files, even from root, and statvfs says 0 bytes free there: the old check
    # blamed the disk space. Permissions do not stop root, so no read-only directory is used here.
    assert main(["synth", "/sys/moed-test.gguf", *TINY]) == 1
    err = capsys.readouterr().err
    assert "moed: error: cannot write /sys/moed-test.gguf" in err and "disk space" not in err
    assert no_work == [] and not os.path.exists("/sys/moed-test.gguf.part")


def test_a_directory_out_is_refused_first(tmp_path, no_work, capsys):
    (tmp_path / "d.gguf").mkdir()
    assert main(["synth", str(tmp_path / "d.gguf"), *TINY]) == 1  # not "exists; pass --force"
    assert "is a directory" in capsys.readouterr().err
    assert no_work == [] and os.listdir(tmp_path) == ["d.gguf"]


@pytest.mark.parametrize("parent", ["missing", "a_file"])
def test_a_bad_parent_is_refused_before_the_work(tmp_path, no_work, capsys, parent):
    if parent == "a_file":
        (tmp_path / parent).write_text("")
    assert main(["synth", str(tmp_path / parent / "x.gguf"), *TINY]) == 1
    err = capsys.readouterr().err
    assert "moed: error: cannot write" in err
    assert ("Not a directory" if parent == "a_file" else "No such file or directory") in err
    assert no_work == [] and os.listdir(tmp_path) == ([parent] if parent == "a_file" else [])


def test_tiny_synth_still_writes(tmp_path, capsys):
    assert main(["synth", str(tmp_path / "x.gguf"), *TINY]) == 0
    assert os.listdir(tmp_path) == ["x.gguf"]
