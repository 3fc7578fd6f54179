"""Path-valued settings (found by the protocol fuzzer, issue 25): MOE_ROUTING_REPLAY is read only
from a regular file of bounded size (a FIFO would block the load forever, /dev/zero would fill
memory), zstd output bounded too; MOE_EXPERT_TRACE_OUTPUT never renames over a FIFO, device,
directory or symbolic link, refused when the setting is given and again at write time."""

from __future__ import annotations

import json
import os
import stat
import threading

import pytest
import zstandard

from daemon.errors import ConfigError, RequestError
from daemon.routing import replay
from daemon.routing.tracer import ExpertUsageTracer

LINE = json.dumps({"tok": 0, "layers": [[1, 2], [3, 4]]}) + "\n"


def load_in_thread(path: str):
    """load_trace_ids(path) on a thread; -> (the exception it raised or None, whether it returned).
    A hang is released by opening the FIFO's other end, so the test fails rather than hangs."""
    out: list = []

    def job():
        try:
            replay.load_trace_ids(path)
            out.append(None)
        except Exception as e:  # noqa: BLE001 - handed to the test
            out.append(e)

    t = threading.Thread(target=job, daemon=True)
    t.start()
    t.join(20)
    hung = t.is_alive()
    if hung and stat.S_ISFIFO(os.stat(path).st_mode):
        fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)  # the blocked open() now returns
        os.close(fd)
        t.join(20)
    return (out[0] if out else None), hung


def test_a_fifo_as_the_trace_is_refused_without_blocking(tmp_path):
    fifo = str(tmp_path / "trace.jsonl")
    os.mkfifo(fifo)
    err, hung = load_in_thread(fifo)
    assert not hung, "load_trace_ids blocked in open() on a FIFO"
    assert isinstance(err, RequestError) and "not a regular file" in str(err)


@pytest.mark.parametrize("dev", ["/dev/zero", "/dev/null"])
def test_a_device_as_the_trace_is_refused_at_once(dev):
    if not os.path.exists(dev):
        pytest.skip(f"no {dev}")
    with pytest.raises(RequestError, match="not a regular file"):
        replay.load_trace_ids(dev)


def test_a_directory_as_the_trace_is_refused(tmp_path):
    with pytest.raises(RequestError, match="cannot read trace"):
        replay.load_trace_ids(str(tmp_path))


def test_a_trace_over_the_size_bound_is_refused(tmp_path, monkeypatch):
    path = tmp_path / "t.jsonl"
    path.write_text(LINE * 100)
    assert len(replay.load_trace_ids(str(path))[0]) == 100  # under the bound: read
    monkeypatch.setattr(replay, "MAX_TRACE_BYTES", len(LINE) * 10)
    with pytest.raises(RequestError, match="larger than"):
        replay.load_trace_ids(str(path))


def test_a_zstd_trace_that_expands_past_the_bound_is_refused(tmp_path, monkeypatch):
    path = tmp_path / "t.jsonl.zst"
    path.write_bytes(zstandard.ZstdCompressor().compress((LINE * 10_000).encode()))
    assert os.path.getsize(path) < len(LINE) * 100  # the file itself is under the bound below
    assert len(replay.load_trace_ids(str(path))[0]) == 10_000
    monkeypatch.setattr(replay, "MAX_TRACE_BYTES", len(LINE) * 100)
    with pytest.raises(RequestError, match="decompresses to more than"):
        replay.load_trace_ids(str(path))


# -- MOE_EXPERT_TRACE_OUTPUT -------------------------------------------------------------------


def targets(tmp_path):
    fifo = tmp_path / "fifo.json"
    os.mkfifo(fifo)
    real = tmp_path / "real.json"
    real.write_text("{}")
    link = tmp_path / "link.json"
    link.symlink_to(real)
    sub = tmp_path / "dir.json"
    sub.mkdir()
    return {"fifo": fifo, "symlink": link, "directory": sub}


@pytest.mark.parametrize("kind", ["fifo", "symlink", "directory"])
def test_the_trace_output_is_never_renamed_over_what_is_not_a_regular_file(tmp_path, kind):
    target = targets(tmp_path)[kind]
    before = os.lstat(target)
    tr = ExpertUsageTracer(output=str(tmp_path / "fine.json"))
    tr.output = str(target)  # as if swapped in after the setting was checked: the write checks again
    with pytest.raises(ConfigError, match="MOE_EXPERT_TRACE_OUTPUT"):
        tr.write()
    after = os.lstat(target)
    assert (after.st_ino, stat.S_IFMT(after.st_mode)) == (before.st_ino, stat.S_IFMT(before.st_mode))
    assert sorted(os.listdir(tmp_path)) == ["dir.json", "fifo.json", "link.json", "real.json"]  # no temp left


@pytest.mark.parametrize("kind", ["fifo", "symlink", "directory"])
def test_a_bad_trace_output_is_refused_when_the_setting_is_given(tmp_path, kind):
    with pytest.raises(ConfigError, match="MOE_EXPERT_TRACE_OUTPUT"):
        ExpertUsageTracer(output=str(targets(tmp_path)[kind]))


def test_a_trace_output_swapped_for_a_fifo_after_the_check_is_refused_at_write_time(tmp_path):
    out = tmp_path / "usage.json"
    tr = ExpertUsageTracer(output=str(out))  # nothing there yet: accepted
    os.mkfifo(out)
    with pytest.raises(ConfigError, match="not a regular file"):
        tr.write()
    assert stat.S_ISFIFO(os.lstat(out).st_mode) and os.listdir(tmp_path) == ["usage.json"]


def test_the_trace_output_replaces_a_regular_file_and_is_private(tmp_path):
    out = tmp_path / "usage.json"
    out.write_text("old")
    ExpertUsageTracer(output=str(out)).write()
    assert json.loads(out.read_text())["format"] == "moed-expert-usage/1"
    assert stat.S_IMODE(os.stat(out).st_mode) == 0o600
    assert os.listdir(tmp_path) == ["usage.json"]



def test_a_bad_trace_output_fails_the_load(fixture_dir, tmp_path):
    from daemon.engine import Engine
    from tests.fixtures.build import fixture_path

    fifo = tmp_path / "usage.json"
    os.mkfifo(fifo)
    with pytest.raises(ConfigError, match="MOE_EXPERT_TRACE_OUTPUT.*not a regular file"):
        Engine.load(fixture_path("qwen3moe", "Q8_0", fixture_dir), expert_trace_output=str(fifo))
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)
