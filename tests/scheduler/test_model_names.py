"""An empty model name (issue 25, item 14) is bad_request: it used to resolve to the daemon's working
directory, whose path the load error then echoed to the client."""

from __future__ import annotations

import os

import pytest

from daemon.config import Settings
from daemon.scheduler import Scheduler, SchedulerError
from ipc.protocol import Chat, Generate, Message


def opening_factory(path, progress=None, **settings):
    """Engine.load's first step: it opens the file (a directory fails here, naming its path)."""
    with open(path, "rb"):
        pass
    raise AssertionError("not reached in these tests")


@pytest.fixture
async def sched():
    s = Scheduler(Settings.load(env={}), factory=opening_factory, warm=False,
                  default_model=lambda _progress: "/nonexistent/demo.gguf")
    s.registry.available_memory = None
    yield s
    await s.close()


@pytest.mark.parametrize("name", ["", " ", "\t\n "])
async def test_an_empty_or_blank_name_is_bad_request(sched, name):
    requests = [sched.load(name), sched.unload(name),
                sched.generate(Generate(1, name, tokens=[1], max_tokens=1), lambda r: None, 0),
                sched.generate(Chat(2, [Message("user", "hi")], name, max_tokens=1), lambda r: None, 0)]
    for request in requests:
        with pytest.raises(SchedulerError) as e:
            await request
        assert e.value.code == "bad_request", e.value
        assert os.getcwd() not in str(e.value)
    assert sched.registry.models == {} and sched.registry.loads == 0 and sched.inflight == 0
