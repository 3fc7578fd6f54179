"""The scheduler is given its engine loader and default model (issue 26, item 7): no module of
daemon/scheduler/ imports daemon.engine or daemon.demo, at any depth (daemon/service.py does)."""

from __future__ import annotations

import inspect
import os

import pytest

import daemon.scheduler
from daemon import service
from daemon.config import Settings
from ipc.handler import Handler
from tests.imports import imported, offending, package_imports

SCHED_DIR = os.path.dirname(daemon.scheduler.__file__)


def test_no_module_of_the_scheduler_imports_the_engine_or_the_demo():
    found = package_imports(SCHED_DIR, "daemon.scheduler")
    assert {"scheduler.py", "models.py", "batcher.py"} <= {os.path.basename(p) for p in found}
    bad = {os.path.relpath(p, SCHED_DIR): offending(names, "daemon.engine") + offending(names, "daemon.demo")
           for p, names in found.items()}
    assert {p: n for p, n in bad.items() if n} == {}


def test_the_checker_flags_the_old_lazy_imports():
    old = ("def _engine_load(path, **settings):\n    from ..engine import Engine\n\n"
           "def _demo_model(progress):\n    from ..demo import demo_model_path\n")
    names = imported(old, "daemon.scheduler")
    assert offending(names, "daemon.engine") == ["daemon.engine", "daemon.engine.Engine"]
    assert offending(names, "daemon.demo") == ["daemon.demo", "daemon.demo.demo_model_path"]


def test_the_start_up_gives_the_scheduler_the_engine_and_the_demo():
    s = service.make_scheduler(Settings.load(env={}), warm=False)
    try:
        assert s.registry.factory is service.load_engine
        assert s._default_model_fn is service.demo_model
    finally:
        s.text.close()


def test_the_scheduler_is_the_servers_handler():
    """Every method the server calls (ipc.handler.Handler) exists on Scheduler, taking the same
    parameters by the same names (the server passes peer= and progress= by keyword); any more it
    takes (the HTTP server's) have defaults."""
    from daemon.scheduler import Scheduler

    for name in ("generate", "load", "unload", "ps", "stats", "close"):
        want = list(inspect.signature(getattr(Handler, name)).parameters)
        params = inspect.signature(getattr(Scheduler, name)).parameters
        got = list(params)
        assert got[:len(want)] == want, name
        assert all(params[p].default is not inspect.Parameter.empty for p in got[len(want):]), name
        assert inspect.iscoroutinefunction(getattr(Scheduler, name)) == \
            inspect.iscoroutinefunction(getattr(Handler, name)), name


async def test_a_scheduler_given_no_default_model_asks_for_a_name():
    from daemon.scheduler import Scheduler, SchedulerError
    from ipc.protocol import Generate

    def factory(path, **settings):
        raise AssertionError("nothing is loaded for a request that names no model")

    s = Scheduler(Settings.load(env={}), factory=factory)
    try:
        with pytest.raises(SchedulerError, match="default model is not available.*name a model") as e:
            await s.generate(Generate(1, tokens=[1, 2]), lambda reply: None, 0)
        assert e.value.code == "model_error" and s.inflight == 0
    finally:
        await s.close()
