"""Model references: a name from the models directory (issue 29: tags as Ollama's, `demo` the
demo MoE), a path; an empty name (issue 25, item 14) is bad_request: it used to resolve to the
daemon's working directory, whose path the load error then echoed to the client."""

from __future__ import annotations

import os

import pytest

from daemon.catalog import Catalog
from daemon.config import Settings
from daemon.scheduler import Scheduler, SchedulerError
from daemon.scheduler.models import runs_with
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


class Recording:
    """A factory that records the file it was asked to load, then fails as a bad file would."""

    def __init__(self):
        self.paths = []

    def __call__(self, path, progress=None, **settings):
        from daemon.errors import ModelError

        self.paths.append(path)
        raise ModelError("not a model (test)")


@pytest.fixture
def catalog(tmp_path) -> tuple[Catalog, str]:
    target = tmp_path / "file.gguf"
    target.write_bytes(b"GGUF")
    d = tmp_path / "models"
    d.mkdir()
    (d / "qwen.gguf").symlink_to(target)
    (d / "qwen:30b.gguf").symlink_to(target)
    return Catalog(d), str(target)


async def test_names_resolve_in_the_models_directory(catalog):
    cat, target = catalog
    s = Scheduler(Settings.load(env={}), factory=Recording(), warm=False, catalog=cat,
                  default_model=lambda _progress: "/nonexistent/demo.gguf")
    try:
        assert s.path_of("qwen") == s.path_of("qwen:latest") == s.path_of("qwen:30b") == target
        assert s.path_of(target) == target  # a path is a path
        assert s.path_of("demo") is None  # built by the scheduler when first asked for
        with pytest.raises(SchedulerError) as e:
            s.path_of("qwen:7b")
        assert e.value.code == "not_found" and "qwen:7b" in str(e.value) and "moed import" in str(e.value)
        with pytest.raises(SchedulerError) as e:
            s.path_of("no such name")
        assert e.value.code == "bad_request"
        assert s.label("qwen", target) == "qwen:latest" and s.label(target, target) == target
    finally:
        await s.close()


async def test_demo_is_the_demo_moe_unless_the_directory_has_one(catalog, tmp_path):
    cat, target = catalog
    factory = Recording()
    (tmp_path / "built-demo.gguf").write_bytes(b"GGUF")
    s = Scheduler(Settings.load(env={}), factory=factory, warm=False, catalog=cat,
                  default_model=lambda _progress: str(tmp_path / "built-demo.gguf"))
    s.registry.available_memory = None
    try:
        with pytest.raises(SchedulerError):
            await s.load("demo")
        assert factory.paths == [str(tmp_path / "built-demo.gguf")]
        (cat.directory / "demo.gguf").symlink_to(target)
        with pytest.raises(SchedulerError):
            await s.load("demo")
        assert factory.paths[-1] == target
    finally:
        await s.close()


def test_settings_a_model_runs_with_already_do_not_reload_it():
    default_ctx = Settings.load().n_ctx
    assert runs_with({}, {}) and runs_with({}, {"n_ctx": default_ctx})
    assert not runs_with({}, {"n_ctx": default_ctx * 2})
    assert runs_with({"n_ctx": 8192}, {"n_ctx": 8192}) and not runs_with({"n_ctx": 8192}, {"n_ctx": 4096})
    assert runs_with({"n_ctx": 8192, "numerics": "float32"}, {"n_ctx": 8192})
