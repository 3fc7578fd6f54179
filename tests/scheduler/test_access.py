"""The scheduler's access rules for peers other than the daemon's user (issue 25, item 4): the
default model, the demo included, passes the same readability check as a named one, whatever
server the request came through; readable_by's mode-bit rules (owner, group, others, the
directories above). Fake engines: no numba."""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from daemon.config import Settings
from daemon.scheduler import Scheduler, SchedulerError
from daemon.scheduler.access import check_model, check_settings, readable_by
from ipc.protocol import Chat, Generate, Message

OTHER = 4242  # another user's uid (no account needed: the rules read mode bits)


@dataclass
class Peer:
    uid: int
    gids: frozenset[int] = field(default_factory=frozenset)


class Factory:
    def __init__(self):
        self.loads: list[str] = []

    def __call__(self, path, progress=None, **settings):
        self.loads.append(path)
        return self  # a stand-in engine

    def close(self) -> None:
        pass


@pytest.fixture
def private(shared_dir) -> str:
    """A 0600 file of the daemon's user in a searchable directory."""
    p = os.path.join(shared_dir, "private.gguf")
    with open(p, "wb") as f:
        f.write(b"x")
    os.chmod(p, 0o600)
    return p


def scheduler(default: str) -> Scheduler:
    s = Scheduler(Settings.load(env={}), factory=Factory(), warm=False, default_model=lambda _progress: default)
    s.registry.available_memory = None
    return s


async def test_the_default_model_passes_the_same_check_as_a_named_one(private):
    s = scheduler(private)
    try:
        for req in (Generate(1, None, tokens=[1], max_tokens=1),
                    Chat(2, [Message("user", "hi")], None, max_tokens=1),
                    Generate(3, private, tokens=[1], max_tokens=1)):
            with pytest.raises(SchedulerError) as e:
                await s.generate(req, lambda r: None, 0, peer=Peer(OTHER))
            assert e.value.code == "forbidden", e.value
            if req.model is None:  # the daemon's own path stays its business
                assert "the default model" in str(e.value) and private not in str(e.value)
        with pytest.raises(SchedulerError) as e:
            await s.load(private, peer=Peer(OTHER))
        assert e.value.code == "forbidden"
        assert s.registry.factory.loads == [] and s.inflight == 0
        os.chmod(private, 0o644)  # now it could read it itself: served
        await s.load(private, peer=Peer(OTHER))
        assert s.registry.factory.loads == [private]
    finally:
        await s.close()


async def test_the_daemon_user_and_in_process_callers_are_trusted(private):
    for peer in (None, Peer(os.geteuid()), Peer(0)):
        check_model(peer, private, private)
        check_settings(peer, {"expert_trace_output": "/tmp/x"})
    with pytest.raises(SchedulerError) as e:
        check_settings(Peer(OTHER), {"n_ctx": 512, "expert_trace_output": "/tmp/x"})
    assert e.value.code == "forbidden" and "expert_trace_output" in str(e.value)
    check_settings(Peer(OTHER), {"n_ctx": 512})


def test_readable_by_follows_owner_group_and_other_bits(shared_dir):
    d = Path(shared_dir)
    f = d / "m.gguf"
    f.write_bytes(b"x")
    st = os.stat(f)
    group = st.st_gid
    os.chmod(f, 0o640)  # group may read, others not
    assert readable_by(str(f), OTHER, frozenset({group}))
    assert not readable_by(str(f), OTHER, frozenset({group + 1}))
    os.chmod(f, 0o604)  # others may read, but the group's bits (none) rule for its members
    assert readable_by(str(f), OTHER, frozenset())
    assert not readable_by(str(f), OTHER, frozenset({group}))
    os.chmod(f, 0o644)
    os.chmod(d, 0o700)  # a directory above that others cannot search
    assert not readable_by(str(f), OTHER, frozenset())
    os.chmod(d, 0o755)
    assert readable_by(str(d / "missing.gguf"), OTHER, frozenset())  # they can see it is missing
    assert stat.S_IMODE(os.stat(f).st_mode) == 0o644


async def test_the_only_loaded_model_as_the_default_is_checked_too(private):
    """The issue's repro: the daemon's user loads a 0600 model; another user's model=None request
    would be served from it, the only loaded model."""
    s = scheduler("/nonexistent/demo.gguf")
    try:
        await s.load(private)  # the daemon's own user
        for req in (Generate(1, None, tokens=[1], max_tokens=1), Chat(2, [Message("user", "hi")], None, max_tokens=1)):
            with pytest.raises(SchedulerError) as e:
                await s.generate(req, lambda r: None, 0, peer=Peer(OTHER))
            assert e.value.code == "forbidden" and private not in str(e.value)
        assert s.inflight == 0 and s.registry.find(private).users == 0
    finally:
        await s.close()
