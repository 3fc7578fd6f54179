"""Loaded models: one load per file at a time, reference counts, keep-alive and unloading.

    acquire(name, settings, keep_alive, progress) -> (LoadedModel, ns waited for a load)
        the first request for a file starts its load (on that model's compute thread); every
        other request for the same file awaits the same load, so a model is never loaded twice
        concurrently. A failed load reaches each waiting requester as SchedulerError and the
        entry is dropped (the next request tries again). While it waits, `progress` gets the
        load's reports (daemon.progress: ("load", %, message), then ("compile", None, ...) when
        the warm-up compiles kernels), the latest one first; the compute thread never waits
        for them (LoadedModel.progress, a Relay).
    release(model)
        when the last user is gone the keep-alive starts: 0 = unload now, > 0 = unload after that
        many idle seconds (a new request stops the clock), < 0 = never.
    unload(name) / close()
        stop the compute thread(s): unfinished sequences end with an error, the engine closes.

At most `max_loaded` models are listed (MOED_MAX_LOADED_MODELS; loading ones count). A request for
one more unloads the least recently used idle model (never one with a negative keep-alive), or
waits until one is idle when all are in use or loading (the scheduler's queue bounds the waiters),
or is refused as busy when every model is idle and pinned by a negative keep-alive. A model that
will compute on the CPU must fit in MemAvailable (its resident bytes and cache limit, capacity.py,
less what the models still loading will take): idle models are unloaded, least recently used
first, to make room; if it still does not fit it is refused with the sizes, before its load.

Before a model is unloaded to make room, or a place awaited, the load's cheap refusals are checked
(check_load: the model file's GGUF header, the path settings), so a Load that cannot load costs no
other model its place.

A compute thread can also stop by itself: its model file changed on disk (ModelFileChanged), or,
as a last line of defence, its loop broke. The registry then drops the model as if unloaded
(`batcher.stopped` resolves; a request that comes first sees `batcher.stopping`), so the next
request loads the file afresh instead of waiting on a thread that is gone.

Models are keyed by their resolved path; `name` is what the first request called it.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable, Mapping
from typing import Any

from ..config import Settings
from ..errors import ConfigError, ModelError, MoedError, RequestError, SchedulerError, wire_error
from ..progress import COMPILE_NOTICE_S, COMPILING, Progress, Relay, Report, reported_if_slow
from ..routing.replay import check_trace_path
from ..routing.tracer import check_output_path
from .batcher import Batcher
from .capacity import (HostNeed, ResidentBytes, check_model_file, default_max_loaded, host_need, mem_available,
                       resident_bytes)

log = logging.getLogger("moed.scheduler")

# Settings of the daemon itself, never of one model (rejected in Load.settings).
DAEMON_SETTINGS = Settings.daemon_settings()


def _error_for_load(path: str, e: BaseException) -> SchedulerError:
    """What every requester of a failed load is told (its code by daemon.errors.wire_error)."""
    if isinstance(e, FileNotFoundError) or (isinstance(e, MoedError) and not os.path.exists(path)):
        return SchedulerError("not_found", f"no model file {path}")
    if not isinstance(e, MoedError):  # a failure the reader did not name: still the file's
        e = ModelError(f"loading {path} failed: {type(e).__name__}: {e}")
    return SchedulerError(*wire_error(e))


def check_load(path: str, settings: Mapping[str, Any], known: ResidentBytes | None = None) -> None:
    """What the load would refuse at once, raised as the load raises it: the model file (a regular
    file with a whole GGUF header, capacity.check_model_file) and the path settings (a replay trace
    that is a regular file of bounded size, a trace output that a rename may replace)."""
    check_model_file(path, known)
    cfg = Settings.load(**settings)  # as Engine.load reads them: environment, then the Load's
    if cfg.routing_replay:
        try:
            check_trace_path(cfg.routing_replay)
        except RequestError as e:
            raise ConfigError(f"MOE_ROUTING_REPLAY: {e}") from None
    if cfg.expert_trace_output:
        check_output_path(cfg.expert_trace_output)


LOAD_STEPS = 4  # Engine.load's progress messages: reading, experts, model, tokenizer


def load_engine(factory: Callable[..., Any], path: str, settings: Mapping[str, Any], report: Report,
                warm: bool = True, compile_notice: float = COMPILE_NOTICE_S):
    """factory(path, progress=..., **settings) with its steps reported as ("load", %, message);
    then, if warm, one token through the model (and on a GPU the prefills of warm_prefill) so
    numba compiles the kernels now rather than in the first request, reported as ("compile", None,
    COMPILING) when that is slow (a fresh machine)."""
    steps = Progress("load", LOAD_STEPS, report=report)
    engine = factory(path, progress=steps, **settings)  # a step per message, and its part(fraction, note)
    steps.close()
    if warm:
        try:
            with reported_if_slow(report, "compile", COMPILING, compile_notice):
                engine.forward(engine.tokenize("warm", add_special=False) or [0])
                warm_prefill(engine)
            engine.reset_stats()
        except BaseException:
            engine.close()
            raise
    return engine


WARM_PREFILL = 64  # prompt tokens of the load's prefill warm-up: past mmvq.MAX_COLS (16) rows, the tiled path


def warm_prefill(engine) -> None:
    """On a GPU: a WARM_PREFILL-token prompt alone, then with a shorter one in one forward_many, so
    the kernels a first long request (and a first batched prefill) needs compile during the load,
    or load from the kernel cache (daemon/kernels/cuda/kernel_cache.py): a first 64-token request
    after load had waited 6.3 s for them. Their caches are dropped. Not on the CPU, where it
    added ~0.5 s of CPU time to tests/scheduler/test_scheduler.py's loads (7.3 -> 7.9 s user)."""
    model = getattr(engine, "model", None)
    if not str(getattr(getattr(model, "backend", None), "name", "")).startswith("cuda"):
        return
    n = max(1, min(WARM_PREFILL, getattr(engine, "n_ctx", WARM_PREFILL)))
    ids = [i % model.hp.n_vocab for i in range(n)]
    for prompts in ([ids], [ids, ids[: max(1, n // 3)]]):
        model.forward_many(prompts, [model.new_cache(len(p)) for p in prompts])


def resolve_path(name: str) -> str:
    if not name.strip():  # "" would resolve to the daemon's working directory
        raise SchedulerError("bad_request", "a model name cannot be empty")
    if "\0" in name:  # no file has one; os.path would raise ValueError
        raise SchedulerError("bad_request", "a model path cannot contain a NUL character")
    return os.path.realpath(os.path.expanduser(name))


def runs_with(loaded: Mapping[str, Any], asked: Mapping[str, Any]) -> bool:
    """Whether a model loaded with `loaded` runs with every setting `asked` names (its defaults and
    the environment count: asking for the n_ctx it has already does not reload it)."""
    if not asked or dict(asked) == dict(loaded):
        return True
    effective = Settings.load(**loaded)
    return all(getattr(effective, k) == v for k, v in asked.items())


class LoadedModel:
    def __init__(self, name: str, path: str, settings: dict[str, Any], keep_alive: float, max_batch: int):
        self.name = name
        self.path = path
        self.settings = settings
        self.keep_alive = keep_alive
        self.batcher = Batcher(os.path.basename(path), max_batch)
        self.ready: asyncio.Future = asyncio.get_running_loop().create_future()  # -> load ns
        self.ready.add_done_callback(lambda f: f.cancelled() or f.exception())  # never "not retrieved"
        self.progress = Relay()  # the load's reports, to the requests awaiting `ready`
        self.users = 0  # requests holding it (loading, waiting or decoding)
        self.expires_at: float | None = None  # unix seconds of the keep-alive unload
        self.timer: asyncio.TimerHandle | None = None
        self.unloading = False
        self.last_used = time.monotonic()  # for the eviction of the least recently used
        self.host_bytes = 0  # host memory its load will take (capacity.HostNeed), until it is loaded
        self.arch = ""
        self.weights_bytes = 0  # non-expert tensors (resident)

    @property
    def engine(self):
        return self.batcher.engine

    @property
    def loaded(self) -> bool:
        return self.ready.done() and not self.ready.cancelled() and self.ready.exception() is None

    def info(self) -> dict[str, Any]:
        """Fields of ipc.protocol.ModelInfo."""
        engine = self.engine
        cache = getattr(engine, "cache", None)
        kv = 0
        for seq in list(self.batcher._active):
            c = seq.cache
            if c is not None and hasattr(c, "k"):  # host KV (a GPU's is in vram_bytes)
                kv += sum(a.nbytes for a in c.k) + sum(a.nbytes for a in c.v)
        cached = limit = 0
        if cache is not None:
            cached = cache.stats()["cached_bytes"]
            limit = cache.limit_bytes
        return {"name": self.name, "path": self.path, "arch": self.arch, "size_bytes": self.weights_bytes + kv,
                "expert_cache_bytes": cached, "expert_cache_limit_bytes": limit,
                "expires_at": self.expires_at, "active": self.batcher.active,
                "n_ctx": getattr(engine, "n_ctx", 0), **_device(engine)}


def _device(engine) -> dict[str, Any]:
    """ModelInfo's device and vram_bytes of an engine (none while it loads)."""
    backend = getattr(getattr(engine, "model", None), "backend", None)
    if backend is None:
        return {}
    vram = getattr(engine, "vram", None)
    return {"device": backend.name, "vram_bytes": backend.vram_bytes() if hasattr(backend, "vram_bytes") else 0,
            "gpu_cache_bytes": vram.budget_bytes if vram is not None else 0}


class ModelRegistry:
    def __init__(self, factory: Callable[..., Any], *, keep_alive: float = 300.0, max_batch: int = 16,
                 warm: bool = True, max_loaded: int = 0,
                 available_memory: Callable[[], int | None] | None = mem_available):
        self.factory = factory  # Engine.load(path, progress=..., **settings)
        self.default_keep_alive = keep_alive
        self.max_batch = max_batch
        self.warm = warm  # run one token through a new model so the kernels compile during the load
        self.models: dict[str, LoadedModel] = {}  # resolved path -> model (loading or loaded)
        self._closing: dict[str, asyncio.Future] = {}  # path -> its previous instance stopping
        self.loads = 0  # loads started (tests: a model is loaded once)
        self._max_loaded = max_loaded  # 0: default_max_loaded(), probed at the first need
        self.available_memory = available_memory  # host bytes free now; None: no memory check
        self.resident = ResidentBytes()  # files' non-expert bytes, for the check
        self._room = asyncio.Event()  # set (and replaced) when a model goes idle or is unlisted
        self.evictions = 0

    @property
    def max_loaded(self) -> int:
        if self._max_loaded <= 0:
            self._max_loaded = default_max_loaded()
        return self._max_loaded

    # -- lookup ----------------------------------------------------------------------------------

    def find(self, name: str) -> LoadedModel | None:
        m = self.models.get(resolve_path(name))
        if m is not None:
            return m
        return next((m for m in self.models.values() if m.name == name), None)

    # -- acquire / release ---------------------------------------------------------------------

    async def acquire(self, name: str, settings: Mapping[str, Any] | None = None,
                      keep_alive: float | None = None, progress: Report | None = None,
                      path: str | None = None) -> tuple[LoadedModel, int]:
        """`path`: the file, when `name` is not one (a model name the scheduler resolved)."""
        settings = dict(settings or {})
        bad = sorted(DAEMON_SETTINGS & settings.keys())
        if bad:
            raise SchedulerError("bad_request", f"{', '.join(bad)}: daemon settings, not model settings")
        try:
            Settings.load(env={}, **settings)  # a typo or bad value fails here, before any (re)load
        except ConfigError as e:
            raise SchedulerError(*wire_error(e)) from None
        path = path or resolve_path(name)
        m = self.models.get(path)
        if m is not None and m.batcher.stopping and not m.unloading:  # stopped by itself: load afresh
            await self._unload(m)
            m = self.models.get(path)
        if m is not None and not runs_with(m.settings, settings):
            if m.users or not m.ready.done():
                raise SchedulerError("busy", f"{m.name} is in use with other settings ({m.settings})")
            await self._unload(m)
            m = self.models.get(path)
        if m is None:
            if not os.path.exists(path):
                raise SchedulerError("not_found", f"no model file {name}")
            m, need = await self._make_room(path, settings)
            if m is not None and not runs_with(m.settings, settings):  # listed by another meanwhile
                raise SchedulerError("busy", f"{m.name} is in use with other settings ({m.settings})")
        if m is None:
            m = LoadedModel(name, path, settings, self.default_keep_alive, self.max_batch)
            m.host_bytes = need.total if need is not None else 0
            m.batcher.stopped.add_done_callback(lambda _f, m=m: self._forget(m))
            self.models[path] = m
            self.loads += 1
            asyncio.get_running_loop().create_task(self._load(m))
        m.users += 1
        m.last_used = time.monotonic()
        m.keep_alive = self.default_keep_alive if keep_alive is None else keep_alive
        self._stop_clock(m)
        t0 = time.perf_counter_ns()
        was_ready = m.ready.done()
        try:
            with m.progress.listening(None if was_ready else progress):
                await asyncio.shield(m.ready)
        except BaseException:
            m.users -= 1
            if m.loaded:
                self.release(m, _held=False)
            raise
        return m, 0 if was_ready else time.perf_counter_ns() - t0

    def release(self, m: LoadedModel, _held: bool = True) -> None:
        if _held:
            m.users -= 1
        if m.users > 0 or m.unloading or self.models.get(m.path) is not m:
            return
        m.last_used = time.monotonic()
        self._room_changed()
        self._stop_clock(m)
        ka = m.keep_alive
        if ka == 0:
            asyncio.get_running_loop().create_task(self._unload(m))
        elif ka > 0:
            m.expires_at = time.time() + ka
            m.timer = asyncio.get_running_loop().call_later(ka, self._expire, m)
        else:
            m.expires_at = None

    def _stop_clock(self, m: LoadedModel) -> None:
        if m.timer is not None:
            m.timer.cancel()
            m.timer = None
        m.expires_at = None if m.keep_alive < 0 else time.time() + m.keep_alive

    def _expire(self, m: LoadedModel) -> None:
        m.timer = None
        if m.users == 0:
            log.info("%s: idle for %gs, unloading", m.name, m.keep_alive)
            asyncio.get_running_loop().create_task(self._unload(m))

    # -- the cap on loaded models --------------------------------------------------------------

    async def _make_room(self, path: str,
                         settings: Mapping[str, Any]) -> tuple[LoadedModel | None, HostNeed | None]:
        """Wait until one more model may be listed (see the module doc): (the model of `path` if
        another request listed it meanwhile, else None: the caller lists it with no await between;
        the host memory its load needs, None when not checked)."""
        need = None
        checked = False
        if self.available_memory is not None:
            try:  # the GGUF header, off the event loop
                need = await asyncio.to_thread(host_need, path, settings, self.resident)
            except Exception:  # noqa: BLE001 - not a model file: its load says why, as before
                need = None
        while (m := self.models.get(path)) is None:
            models = list(self.models.values())
            idle = [x for x in models if x.loaded and x.users == 0 and not x.unloading]
            evictable = [x for x in idle if x.keep_alive >= 0]
            victim = min(evictable, key=lambda x: x.last_used) if evictable else None
            if len(models) >= self.max_loaded:
                if not checked and (victim is not None or len(idle) < len(models)):
                    checked = await self._check_load(path, settings)
                    continue  # the check awaited: look again
                if victim is not None:
                    await self._evict(victim, path, f"MOED_MAX_LOADED_MODELS={self.max_loaded}")
                elif len(idle) == len(models):  # every one idle and kept forever: waiting cannot help
                    raise SchedulerError("busy", f"{len(models)} models are loaded with a negative keep-alive "
                                                 f"(MOED_MAX_LOADED_MODELS={self.max_loaded}); unload one first")
                else:  # some are in use or loading: wait for one to go idle or away
                    await self._room.wait()
                continue
            free = self.available_memory() if need is not None else None
            if free is not None:
                free -= sum(x.host_bytes for x in models if not x.loaded)  # loads under way take theirs yet
                if need.total > free:
                    if victim is None:
                        raise need.refusal(path, max(free, 0))
                    if not checked:
                        checked = await self._check_load(path, settings)
                        continue
                    await self._evict(victim, path, "to make room in host memory")
                    continue
            break
        return m, need

    async def _evict(self, victim: LoadedModel, path: str, why: str) -> None:
        log.info("%s: unloading the least recently used idle model, %s (%s)", path, victim.name, why)
        self.evictions += 1
        await self._unload(victim)

    async def _check_load(self, path: str, settings: Mapping[str, Any]) -> bool:
        """check_load off the event loop, before a model is unloaded or a place awaited for this
        load: one that would fail at once costs no other model its place. -> True, else raises the
        load's SchedulerError."""
        try:
            await asyncio.to_thread(check_load, path, settings, self.resident)
        except Exception as e:  # noqa: BLE001 - told to the requester as its load's failure
            raise _error_for_load(path, e) from None
        return True

    def _room_changed(self) -> None:
        """Wake the requests waiting in _make_room (each looks again)."""
        self._room.set()
        self._room = asyncio.Event()

    # -- load / unload -------------------------------------------------------------------------

    async def _load(self, m: LoadedModel) -> None:
        previous = self._closing.get(m.path)
        if previous is not None:
            await asyncio.shield(previous)
        log.info("loading %s", m.path)
        t0 = time.perf_counter_ns()

        def job(_engine):
            engine = load_engine(self.factory, m.path, m.settings, m.progress, self.warm)
            try:
                gguf = getattr(engine, "gguf", None)
                if gguf is not None:
                    m.arch = gguf.architecture
                    m.weights_bytes = resident_bytes(gguf.tensors)
                    ident = gguf.identity  # the file as read: a reload of it needs no header parse
                    self.resident.put((ident.dev, ident.ino, ident.size, ident.mtime_ns), m.weights_bytes)
            except BaseException:
                engine.close()
                raise
            m.batcher.engine = engine
            if self.warm:
                m.batcher.warm()
            return engine

        try:
            await m.batcher.call(job)
        except BaseException as e:  # noqa: BLE001 - handed to every requester as an error reply
            err = _error_for_load(m.path, e)
            log.warning("loading %s failed: %s", m.path, err)
            if self.models.get(m.path) is m:
                del self.models[m.path]
                self._room_changed()
            m.batcher.stop()
            m.ready.set_exception(err)
            return
        if m.unloading:
            m.ready.set_exception(SchedulerError("model_error", f"{m.name} was unloaded while loading"))
            return
        ns = time.perf_counter_ns() - t0
        log.info("loaded %s in %.2fs", m.path, ns / 1e9)
        m.ready.set_result(ns)
        if m.users == 0:  # every requester gave up while it loaded: the keep-alive clock starts now
            self.release(m, _held=False)

    async def unload(self, name: str) -> None:
        m = self.find(name)
        if m is None:
            raise SchedulerError("not_found", f"{name} is not loaded")
        try:
            await asyncio.shield(m.ready)
        except SchedulerError:
            return  # its load failed: nothing is loaded
        await self._unload(m)

    async def _unload(self, m: LoadedModel, code: str = "model_error", message: str = "the model was unloaded"):
        if m.unloading:
            await asyncio.shield(m.batcher.stopped)
            return
        self._retire(m)
        stopped = m.batcher.stop(code, message)
        self._closing[m.path] = stopped
        try:
            await asyncio.shield(stopped)
        finally:
            if self._closing.get(m.path) is stopped:
                del self._closing[m.path]
        log.info("unloaded %s", m.path)

    def _forget(self, m: LoadedModel) -> None:
        """m's compute thread has ended. Without an unload (its model file changed, its loop
        broke) the model must not stay listed: the next request loads it again."""
        if not m.unloading and self._retire(m):
            log.warning("%s: its compute thread stopped (%s); dropped, the next request loads it again",
                        m.name, m.batcher.stop_reason)

    def _retire(self, m: LoadedModel) -> bool:
        """Mark m unloading, stop its keep-alive clock, unlist it; whether it was listed."""
        m.unloading = True
        self._stop_clock(m)
        m.expires_at = None
        listed = self.models.get(m.path) is m
        if listed:
            del self.models[m.path]
            self._room_changed()
        return listed

    async def close(self, code: str = "shutdown", message: str = "the daemon is shutting down") -> None:
        """Stop every model (loads in progress finish first, on their own threads)."""
        models = list(self.models.values())
        await asyncio.gather(*(self._unload(m, code, message) for m in models), return_exceptions=True)
