"""MOED_MAX_LOADED_MODELS (issue 25, item 13): past the cap the least recently used idle model is
unloaded, never one kept with a negative keep-alive; while every model is busy a request waits in
the bounded queue (busy when it is full); a load that cannot fit in host memory is refused with the
sizes, after idle models were unloaded to make room; a file that cannot load unloads none. Fake
engines: no numba; the model files are copies of a fixture GGUF, whose header is read."""

from __future__ import annotations

import asyncio
import os
import shutil

import pytest

from daemon.config import Settings
from daemon.scheduler import ModelRegistry, Scheduler, SchedulerError
from daemon.scheduler import capacity
from tests.fixtures.build import fixture_path


class FakeEngine:
    def __init__(self, path: str, log: list):
        self.path = path
        self.log = log

    def close(self) -> None:
        self.log.append(("closed", self.path))


class Factory:
    """Engine.load's stand-in: records each load and close in order."""

    def __init__(self):
        self.log: list[tuple[str, str]] = []

    def __call__(self, path, progress=None, **settings):
        self.log.append(("loaded", path))
        return FakeEngine(path, self.log)


@pytest.fixture
def files(tmp_path, gguf) -> list[str]:
    """Five copies of a real GGUF: a load that unloads another checks the file's header first."""
    out = []
    for name in "abcde":
        p = tmp_path / f"{name}.gguf"
        shutil.copyfile(gguf, p)
        out.append(str(p))
    return out


def registry(max_loaded: int, factory=None, **kw) -> ModelRegistry:
    return ModelRegistry(factory or Factory(), warm=False, max_loaded=max_loaded, available_memory=None, **kw)


async def use(reg: ModelRegistry, path: str, keep_alive: float | None = None, settings=None) -> None:
    m, _ = await reg.acquire(path, settings, keep_alive=keep_alive)
    reg.release(m)


async def test_past_the_cap_the_least_recently_used_idle_model_is_unloaded(files):
    a, b, c = files[:3]
    reg = registry(2)
    try:
        await use(reg, a)
        await use(reg, b)
        await use(reg, a)  # a is now the more recently used
        await use(reg, c)
        assert sorted(reg.models) == sorted([a, c])
        assert ("closed", b) in reg.factory.log and ("closed", a) not in reg.factory.log
        assert reg.factory.log.index(("closed", b)) < reg.factory.log.index(("loaded", c))  # room first
    finally:
        await reg.close()


async def test_a_model_kept_forever_is_never_evicted(files):
    a, b, c, d = files[:4]
    reg = registry(2)
    try:
        await use(reg, a, keep_alive=-1)  # the oldest, but pinned
        await use(reg, b)
        await use(reg, c, keep_alive=-1)
        assert sorted(reg.models) == sorted([a, c])  # b went, though a is older
        with pytest.raises(SchedulerError) as e:  # both idle and pinned: waiting could never help
            await use(reg, d)
        assert e.value.code == "busy" and "MOED_MAX_LOADED_MODELS=2" in str(e.value)
        assert sorted(reg.models) == sorted([a, c])
    finally:
        await reg.close()


async def test_when_every_model_is_busy_a_load_waits_for_one_to_go_idle(files):
    a, b = files[:2]
    reg = registry(1)
    try:
        held, _ = await reg.acquire(a)  # a request is decoding on it
        waiting = asyncio.create_task(reg.acquire(b))
        for _ in range(20):
            await asyncio.sleep(0)
        assert not waiting.done() and list(reg.models) == [a]
        reg.release(held)
        m, _ = await asyncio.wait_for(waiting, 30)
        assert m.path == b and list(reg.models) == [b]
        log = reg.factory.log
        assert log.index(("closed", a)) < log.index(("loaded", b))
        reg.release(m)
    finally:
        await reg.close()


async def test_a_second_request_for_the_same_model_joins_the_waiting_one(files):
    a, b = files[:2]
    reg = registry(1)
    try:
        held, _ = await reg.acquire(a)
        first, second = asyncio.create_task(reg.acquire(b)), asyncio.create_task(reg.acquire(b))
        await asyncio.sleep(0)
        reg.release(held)
        (m1, _), (m2, _) = await asyncio.wait_for(asyncio.gather(first, second), 30)
        assert m1 is m2 and reg.loads == 2
    finally:
        await reg.close()


async def test_while_every_model_is_busy_loads_wait_in_the_bounded_queue(files):
    a, b, c = files[:3]
    sched = Scheduler(Settings.load(env={}, max_loaded_models=1, queue_size=1), factory=Factory(), warm=False)
    sched.registry.available_memory = None
    try:
        held, _ = await sched.registry.acquire(a)  # busy, outside the queue
        waiting = asyncio.create_task(sched.load(b))
        for _ in range(20):
            await asyncio.sleep(0)
        assert not waiting.done() and sched.inflight == 1
        with pytest.raises(SchedulerError) as e:  # the queue is full: busy at once
            await sched.load(c)
        assert e.value.code == "busy"
        sched.registry.release(held)
        model, _ = await asyncio.wait_for(waiting, 30)
        assert model.path == b and sched.inflight == 0
    finally:
        await sched.close()


def test_the_setting_reaches_the_registry_and_zero_is_three_per_gpu(monkeypatch):
    s = Settings.load(env={"MOED_MAX_LOADED_MODELS": "5"})
    assert ModelRegistry(Factory(), max_loaded=s.max_loaded_models).max_loaded == 5
    monkeypatch.setattr(capacity, "gpu_count", lambda: 0)
    assert ModelRegistry(Factory()).max_loaded == 3
    monkeypatch.setattr(capacity, "gpu_count", lambda: 2)
    assert ModelRegistry(Factory()).max_loaded == 6


# -- host memory ----------------------------------------------------------------------------------

CPU = {"device": "cpu"}  # the host-memory check is for models that compute on the CPU


@pytest.fixture(scope="module")
def gguf(fixture_dir) -> str:
    return str(fixture_path("qwen3moe", "Q8_0", fixture_dir))


async def test_a_load_that_cannot_fit_in_host_memory_is_refused_with_the_sizes(gguf):
    factory = Factory()
    reg = ModelRegistry(factory, warm=False, available_memory=lambda: 1000)
    try:
        with pytest.raises(SchedulerError) as e:
            await reg.acquire(gguf, {"device": "cpu"})
        assert e.value.code == "model_error"
        assert "needs about" in str(e.value) and "0 MiB is available" in str(e.value)
        assert factory.log == [] and reg.models == {}
        reg.available_memory = lambda: 2**36  # 64 GiB: the fixture's few MiB fit ...
        with pytest.raises(SchedulerError) as e:  # ... but not a 1 TB expert cache limit
            await reg.acquire(gguf, {"device": "cpu", "expert_cache_limit_mb": 10**6})
        assert "expert cache limit 1,000,000 MiB" in str(e.value) and factory.log == []
        m, _ = await reg.acquire(gguf, {"device": "cpu"})
        assert factory.log == [("loaded", gguf)]
        reg.release(m)
    finally:
        await reg.close()


def test_mem_available_reads_proc_meminfo(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       16000000 kB\nMemFree:         1000 kB\nMemAvailable:    2048 kB\n")
    assert capacity.mem_available(str(meminfo)) == 2048 * 1024
    meminfo.write_text("MemTotal:       16000000 kB\n")  # a kernel older than 3.14
    assert capacity.mem_available(str(meminfo)) is None
    assert capacity.mem_available(str(tmp_path / "missing")) is None


async def test_idle_models_are_unloaded_to_make_room_in_host_memory(gguf, tmp_path):
    a, b, c = (str(tmp_path / f"{n}.gguf") for n in "abc")
    for p in (a, b, c):
        shutil.copyfile(gguf, p)
    factory = Factory()
    reg = ModelRegistry(factory, warm=False)
    reg.available_memory = lambda: 2**36 if not reg.models else 1000  # room for one model at a time
    try:
        await use(reg, a, settings=CPU)
        await use(reg, b, settings=CPU)  # a is idle: unloaded first, then b fits
        assert list(reg.models) == [b]
        assert factory.log == [("loaded", a), ("closed", a), ("loaded", b)]
        m, _ = await reg.acquire(b, keep_alive=-1)
        reg.release(m)  # b is now kept forever: never unloaded, not even for memory
        with pytest.raises(SchedulerError) as e:
            await reg.acquire(c, CPU)
        assert e.value.code == "model_error" and "needs about" in str(e.value)
        assert list(reg.models) == [b] and ("loaded", c) not in factory.log
    finally:
        await reg.close()


async def test_a_reload_reads_the_resident_size_without_parsing_the_header_again(gguf, tmp_path, monkeypatch):
    import daemon.storage.gguf as reader

    path = str(tmp_path / "m.gguf")
    shutil.copyfile(gguf, path)
    opened = []

    class Counted(reader.GGUFFile):
        def __init__(self, p):
            opened.append(p)
            super().__init__(p)

    monkeypatch.setattr(reader, "GGUFFile", Counted)
    reg = ModelRegistry(Factory(), warm=False, available_memory=lambda: 2**36)
    try:
        for _ in range(3):  # loaded and unloaded three times: one parse
            await use(reg, path, settings=CPU)
            await reg.unload(path)
        assert reg.loads == 3 and opened == [path]
        st = os.stat(path)
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # another file now, for all it knows
        await use(reg, path, settings=CPU)
        assert reg.loads == 4 and opened == [path, path]
    finally:
        await reg.close()


# -- a Load that cannot load costs no other model its place (protocol fuzzer, issue 25) ----------


def unloadable(kind: str, gguf: str, tmp_path) -> str:
    if kind == "devnull":
        return "/dev/null"
    if kind == "directory":
        return str(tmp_path)
    p = tmp_path / f"{kind}.gguf"
    if kind == "truncated":  # a whole header, tensor data cut short
        p.write_bytes(open(gguf, "rb").read()[: os.path.getsize(gguf) // 2])
    else:  # not_gguf
        p.write_bytes(b"not a model" * 100)
    return str(p)


@pytest.mark.parametrize("kind", ["devnull", "directory", "truncated", "not_gguf"])
async def test_a_file_that_cannot_load_unloads_no_idle_model(gguf, tmp_path, kind):
    a = str(tmp_path / "a.gguf")
    shutil.copyfile(gguf, a)
    bad = unloadable(kind, gguf, tmp_path)
    reg = registry(1)
    try:
        await use(reg, a)  # idle, and the only place is taken
        with pytest.raises(SchedulerError) as e:
            await asyncio.wait_for(use(reg, bad), 60)
        assert e.value.code == "model_error"
        assert list(reg.models) == [a] and reg.factory.log == [("loaded", a)] and reg.evictions == 0
    finally:
        await reg.close()


async def test_a_file_that_cannot_load_does_not_wait_for_a_place(gguf, tmp_path):
    a = str(tmp_path / "a.gguf")
    shutil.copyfile(gguf, a)
    reg = registry(1)
    try:
        held, _ = await reg.acquire(a)  # in use: a good file would wait for it
        with pytest.raises(SchedulerError) as e:
            await asyncio.wait_for(reg.acquire("/dev/null"), 60)
        assert e.value.code == "model_error" and list(reg.models) == [a]
        reg.release(held)
    finally:
        await reg.close()


@pytest.mark.parametrize("setting", ["routing_replay", "expert_trace_output"])
async def test_a_bad_path_setting_unloads_no_idle_model(gguf, tmp_path, setting):
    a, b = str(tmp_path / "a.gguf"), str(tmp_path / "b.gguf")
    shutil.copyfile(gguf, a)
    shutil.copyfile(gguf, b)
    fifo = str(tmp_path / "fifo")
    os.mkfifo(fifo)
    reg = registry(1)
    try:
        await use(reg, a)
        with pytest.raises(SchedulerError) as e:
            await asyncio.wait_for(use(reg, b, settings={setting: fifo}), 60)
        assert "not a regular file" in str(e.value)
        assert list(reg.models) == [a] and reg.factory.log == [("loaded", a)]
    finally:
        await reg.close()
