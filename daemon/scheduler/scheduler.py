"""The scheduler: what the daemon does with each request, independent of the wire.

    generate(req, emit, received_ns, peer)  serve a Generate/Chat to its end; emit(reply) gets Progress
                                       while the request waits for its model (the demo build, the
                                       load, the kernel compile), each Chunk, then Done or Error.
                                       Raises SchedulerError before the stream
                                       starts (busy, not_found, model_error, ...). Cancelling the task
                                       that runs it cancels the sequence (within one decode step).
    load(name, settings, keep_alive, progress, peer) / unload / ps / stats / close
    embed(name, texts, truncate, keep_alive, peer, settings) -> (vectors, tokens, load ns)

A model is named by a path (it contains "/"; resolved as given) or by a name in the models
directory (daemon/catalog.py: "qwen3", "qwen3:30b"); `demo` is the demo MoE, built on first use,
unless the directory has a model of that name.
The server (ipc/server.py) calls these through ipc.handler.Handler, which the Scheduler is.

    Scheduler(settings, factory=..., default_model=..., warm=True, catalog=None)
        factory(path, progress=..., **settings) -> engine   loads a model (daemon/service.py passes
                                                             Engine.load, imported when first called)
        default_model(report) -> path                        the model of a request that names none
                                                             while not exactly one is loaded (the
                                                             demo MoE); None: such a request fails
        catalog                                              the models directory (default: none)
    The scheduler imports neither the engine nor the demo builder: it is given them.

`peer` is who asked (uid and gids, as the server learnt them; None = in-process, trusted): a
peer other than the daemon's own user gets only what it could get itself (access.py), the
default model included, whatever server the request came through.

Bounded queue: at most `queue_size` generation requests and loads are held at once, whether waiting
for room under MOED_MAX_LOADED_MODELS (models.py), for a model to load, for a place in the batch
(`max_batch` per model) or decoding; one more is refused with SchedulerError("busy") at once.

Text work is done here, before a sequence reaches its model's compute thread: the chat template
and the tokenizer run on TextThreads (two daemon threads), so a long prompt or a slow template
never holds up a forward pass, and cancelling the request while its prompt is prepared works.
Prompts are refused beyond MOED_MAX_PROMPT_BYTES (the raw prompt or the messages before the
template, the rendered prompt before the tokenizer); a template has MOED_TEMPLATE_TIMEOUT seconds.
A request given token ids has no text work: its ids are checked in place.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import queue
import sys
import threading
from collections.abc import Callable
from typing import Any

from ipc.protocol import Chat, Done, Error, Generate, Progress

from ..catalog import DEMO, Catalog, full_name, is_path, split_tag
from ..config import Settings
from ..progress import Relay, Renderer, Report
from ..errors import MoedError, SchedulerError
from .access import Peer, check_model, check_settings
from .models import LoadedModel, ModelRegistry, resolve_path
from .sequence import Sequence, error_reply, prompt_ids

TEXT_THREADS = 2  # template rendering and tokenizing for every model: a bound on the cores they take

log = logging.getLogger("moed.scheduler")


def _no_default_model(progress: Report) -> str:
    # default_model() reports it as "model_error: the default model is not available: ..."
    raise LookupError("this daemon has none; name a model")


def _in_thread(fn: Callable[[], Any], name: str) -> asyncio.Future:
    """fn() on a daemon thread of its own (building the demo MoE takes minutes: a shutdown must
    not wait for it, as it would for asyncio.to_thread's executor)."""
    loop = asyncio.get_running_loop()
    fut = loop.create_future()
    fut.add_done_callback(lambda f: f.cancelled() or f.exception())  # never "not retrieved"

    threading.Thread(target=_call_and_post, args=(fn, fut, loop), name=name, daemon=True).start()
    return fut


def _call_and_post(fn: Callable[[], Any], fut: asyncio.Future, loop: asyncio.AbstractEventLoop) -> None:
    """fn() on this thread; its result or exception settles fut on the loop."""
    try:
        result = (True, fn())
    except BaseException as e:  # noqa: BLE001 - handed to the awaiting request(s)
        result = (False, e)
    try:
        loop.call_soon_threadsafe(_settle, fut, *result)
    except RuntimeError:  # the loop is closed
        pass


def _settle(fut: asyncio.Future, ok: bool, value) -> None:
    if not fut.done():
        (fut.set_result if ok else fut.set_exception)(value)


class TextThreads:
    """A small pool of daemon threads for the text work of requests (chat template, tokenizer).
    Bounded, so text work cannot take every core; daemon threads, so a shutdown never waits for a
    render that is still running. Work whose future was cancelled before it started is skipped."""

    def __init__(self, n: int = TEXT_THREADS):
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._threads = [threading.Thread(target=self._work, name=f"moed-text-{i}", daemon=True) for i in range(n)]
        for t in self._threads:
            t.start()

    def run(self, fn: Callable[[], Any]) -> asyncio.Future:
        """fn() on one of the threads; its result as a Future of the running loop."""
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self._queue.put((fn, fut, loop))
        return fut

    def close(self) -> None:
        for _ in self._threads:
            self._queue.put(None)

    def _work(self) -> None:
        while (item := self._queue.get()) is not None:
            fn, fut, loop = item
            if not fut.cancelled():  # else its request gave up while it waited
                _call_and_post(fn, fut, loop)


class Scheduler:
    def __init__(self, settings: Settings | None = None, *, factory: Callable[..., Any],
                 default_model: Callable[[Report], str] | None = None, warm: bool = True,
                 catalog: Catalog | None = None):
        settings = settings or Settings.load()
        self.settings = settings
        self.catalog = catalog
        self.queue_size = max(1, settings.queue_size)
        self.registry = ModelRegistry(factory, keep_alive=settings.keep_alive,
                                      max_batch=settings.max_batch, warm=warm,
                                      max_loaded=settings.max_loaded_models)
        self._default_model_fn = default_model or _no_default_model
        self._default_future: asyncio.Future | None = None
        self._default_progress: Relay | None = None  # the demo build's reports
        self.text = TextThreads()
        self.inflight = 0  # generation requests held now
        self.closing = False

    # -- generation ----------------------------------------------------------------------------

    async def generate(self, req: Generate | Chat, emit: Callable[[Any], None], received_ns: int,
                       peer: Peer | None = None, settings: dict[str, Any] | None = None) -> None:
        """`settings`: model settings the request needs (an HTTP num_ctx): a model loaded with
        others is reloaded, as Ollama does."""
        if self.closing:
            raise SchedulerError("shutdown", "the daemon is shutting down")
        path = None
        if req.model is not None:  # a named file: refused before it takes a place in the queue
            path = self.path_of(req.model)
            if path is not None:
                check_model(peer, path, req.model)
        self._enqueue()
        model: LoadedModel | None = None
        seq: Sequence | None = None
        def progress(phase: str, percent: float | None, message: str) -> None:
            emit(Progress(req.id, phase, percent, message))

        try:
            if path is None:  # the default (or demo) is the daemon's choice, but read for this peer all the same
                path = await (self.default_model(progress) if req.model is None else self.demo(progress))
                check_model(peer, path, "the default model")
            model, load_ns = await self.registry.acquire(self.label(req.model, path), settings,
                                                         keep_alive=req.keep_alive, progress=progress, path=path)
            try:
                ids = await self._prompt_ids(req, model)
                grammar = await self._grammar(req, model)
            except SchedulerError:
                raise
            except Exception as e:  # noqa: BLE001 - the request's error reply, as the batcher gives it
                if not isinstance(e, MoedError):
                    log.exception("preparing request %s failed", req.id)
                emit(error_reply(req.id, e))
                return
            done = asyncio.get_running_loop().create_future()

            def on_reply(reply) -> None:  # on the event loop, from the compute thread's hand-over
                if done.done():
                    return
                emit(reply)
                if isinstance(reply, (Done, Error)):
                    done.set_result(None)

            seq = Sequence(req, ids, on_reply, received_ns=received_ns, load_ns=load_ns)
            seq.grammar = grammar
            try:
                model.batcher.submit(seq)
            except RuntimeError:
                raise SchedulerError("model_error", f"{model.name} is being unloaded") from None
            await done
        except asyncio.CancelledError:
            if seq is not None:
                seq.cancelled = True  # the compute thread drops it (and its KV cache) at the next step
                model.batcher.wake()
            raise
        finally:
            self.inflight -= 1
            if model is not None:
                self.registry.release(model)

    def _enqueue(self) -> None:
        if self.inflight >= self.queue_size:
            raise SchedulerError("busy", f"{self.inflight} requests are queued or running "
                                         f"(MOED_QUEUE_SIZE={self.queue_size}); retry later")
        self.inflight += 1

    async def _prompt_ids(self, req: Generate | Chat, model: LoadedModel) -> list[int]:
        """The request's token ids, checked (sequence.prompt_ids), prepared off the compute thread."""
        engine = model.engine
        if engine is None or model.batcher.stopping:
            raise SchedulerError("model_error", f"{model.name} is being unloaded")
        work = functools.partial(prompt_ids, req, engine, max_bytes=self.settings.max_prompt_bytes,
                                 template_timeout=self.settings.template_timeout)
        if isinstance(req, Generate) and req.tokens is not None and not req.format:
            return work()  # no text to render or tokenize: checked in place, no thread hop
        return await self.text.run(work)

    async def _grammar(self, req: Generate | Chat, model: LoadedModel):
        """The request's format compiled (daemon.grammar), off the compute thread; None without one."""
        if not req.format:
            return None
        from ..grammar import compile_format

        tokenizer = model.engine.tokenizer
        return await self.text.run(lambda: compile_format(req.format, tokenizer).matcher())

    def path_of(self, ref: str) -> str | None:
        """The file a model reference names: a path as resolved, a name from the models directory;
        None for the demo when the directory has no model of its name (self.demo builds it).
        SchedulerError: bad_request for a bad name, not_found for a name the directory lacks."""
        if is_path(ref) or not ref.strip() or "\0" in ref:
            return resolve_path(ref)  # (empty and NUL refused there)
        try:
            base, tag = split_tag(ref)
        except MoedError as e:
            raise SchedulerError("bad_request", str(e)) from None
        if self.catalog is not None:
            try:
                return os.path.realpath(self.catalog.resolve(ref))
            except SchedulerError:
                pass
        if base == DEMO and tag == "latest":
            return None
        where = f" in {self.catalog.directory}" if self.catalog is not None else ""
        raise SchedulerError("not_found", f"model {full_name(ref)!r} not found{where} (`moed list` shows the "
                                          f"models; `moed import PATH` adds one)")

    @staticmethod
    def label(ref: str | None, path: str) -> str:
        """What a model is called in replies: its full name ("qwen3:latest"), else its path."""
        return path if ref is None or is_path(ref) else full_name(ref)

    async def default_model(self, progress: Report | None = None) -> str:
        """The only loaded model, else the demo MoE."""
        models = list(self.registry.models.values())
        if len(models) == 1:
            return models[0].path
        return await self.demo(progress)

    async def demo(self, progress: Report | None = None) -> str:
        """The demo MoE's path (built once, on a thread, on first use; its build reported to
        `progress` and to the log)."""
        if self._default_future is None:
            relay = self._default_progress = Relay()
            log_lines = Renderer(sys.stderr)  # the daemon's log, as before

            def build() -> str:
                return self._default_model_fn(lambda *report: (log_lines(*report), relay(*report)))

            self._default_future = _in_thread(build, "moed-default-model")
        try:
            with self._default_progress.listening(progress):
                return await asyncio.shield(self._default_future)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - reported to the requester
            self._default_future = None
            raise SchedulerError("model_error", f"the default model is not available: {e}") from None

    # -- models --------------------------------------------------------------------------------

    async def load(self, name: str, settings: dict[str, Any] | None = None, keep_alive: float | None = None,
                   progress: Report | None = None, peer: Peer | None = None) -> tuple[LoadedModel, int]:
        if self.closing:
            raise SchedulerError("shutdown", "the daemon is shutting down")
        check_settings(peer, settings)
        path = self.path_of(name)
        if path is not None:
            check_model(peer, path, name)
        self._enqueue()  # it may wait for room (MOED_MAX_LOADED_MODELS): a place in the queue
        try:
            if path is None:
                path = await self.demo(progress)
                check_model(peer, path, "the default model")
            model, load_ns = await self.registry.acquire(self.label(name, path), settings, keep_alive, progress,
                                                         path=path)
        finally:
            self.inflight -= 1
        self.registry.release(model)  # keep-alive starts now (0: unloaded right away)
        return model, load_ns

    async def embed(self, name: str, texts: list[str], *, truncate: bool = True, keep_alive: float | None = None,
                    peer: Peer | None = None, settings: dict[str, Any] | None = None):
        """Embeddings of `texts` by the model `name` (Engine.embed, on its compute thread between
        two steps) -> (vectors [N, D] float32, tokens evaluated, ns waited for the load). A place
        in the queue while it waits and runs, as a generation."""
        if self.closing:
            raise SchedulerError("shutdown", "the daemon is shutting down")
        total = sum(len(t.encode("utf-8", "surrogatepass")) for t in texts)
        if total > self.settings.max_prompt_bytes:
            raise SchedulerError("bad_request", f"the inputs hold {total} bytes, more than MOED_MAX_PROMPT_BYTES="
                                                f"{self.settings.max_prompt_bytes}")
        path = self.path_of(name)
        if path is not None:
            check_model(peer, path, name)
        self._enqueue()
        model = None
        try:
            if path is None:
                path = await self.demo()
                check_model(peer, path, "the default model")
            model, load_ns = await self.registry.acquire(self.label(name, path), settings, keep_alive, path=path)
            try:
                vectors, count = await model.batcher.call(lambda engine: engine.embed(texts, truncate=truncate))
            except RuntimeError as e:
                raise SchedulerError("model_error", f"{model.name} is being unloaded") from e
            return vectors, count, load_ns
        finally:
            self.inflight -= 1
            if model is not None:
                self.registry.release(model)

    async def unload(self, name: str) -> None:
        await self.registry.unload(self._loaded_key(name))

    def _loaded_key(self, ref: str) -> str:
        """What the registry finds a loaded model by: its file where the reference names one,
        else the reference itself (a name it was loaded under)."""
        try:
            path = self.path_of(ref)
        except SchedulerError:
            return ref
        if path is None and self._default_future is not None and self._default_future.done() \
                and not self._default_future.cancelled() and self._default_future.exception() is None:
            path = self._default_future.result()
        return path or ref

    def ps(self) -> list[dict[str, Any]]:
        return [m.info() for m in self.registry.models.values() if self._serving(m)]

    @staticmethod
    def _serving(m: LoadedModel) -> bool:
        return m.loaded and not m.unloading and not m.batcher.stopping

    async def stats(self, name: str | None = None) -> dict[str, Any]:
        if name is None:
            models = [m for m in self.registry.models.values() if self._serving(m)]
        else:
            m = self.registry.find(self._loaded_key(name))
            if m is None or not self._serving(m):
                raise SchedulerError("not_found", f"{name} is not loaded")
            models = [m]
        out = {}
        for m in models:
            try:
                stats = await m.batcher.call(lambda engine: engine.stats())
            except RuntimeError:  # unloaded meanwhile
                continue
            out[m.name] = {**stats, "scheduler": m.batcher.stats()}
        return out

    async def close(self) -> None:
        self.closing = True
        self.text.close()
        await self.registry.close()
