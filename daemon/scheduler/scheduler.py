"""The scheduler: what the daemon does with each request, independent of the wire.

    generate(req, emit, received_ns)   serve a Generate/Chat to its end; emit(reply) gets each Chunk,
                                       then Done or Error. Raises SchedulerError before the stream
                                       starts (busy, not_found, model_error, ...). Cancelling the task
                                       that runs it cancels the sequence (within one decode step).
    load / unload / ps / stats / close

Bounded queue: at most `queue_size` generation requests are held at once, whether waiting for a
model to load, waiting for a place in the batch (`max_batch` per model) or decoding; one more is
refused with SchedulerError("busy") at once.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable
from typing import Any

from ipc.protocol import Chat, Done, Error, Generate

from ..config import Settings
from .models import LoadedModel, ModelRegistry, SchedulerError
from .sequence import Sequence

log = logging.getLogger("moed.scheduler")


def _engine_load(path, **settings):
    # numba kernels: imported by the daemon only when a model loads
    from ..engine import Engine

    return Engine.load(path, **settings)


def _demo_model() -> str:
    from ..demo import demo_model_path

    return str(demo_model_path())


def _in_thread(fn: Callable[[], Any], name: str) -> asyncio.Future:
    """fn() on a daemon thread of its own (building the demo MoE takes minutes: a shutdown must
    not wait for it, as it would for asyncio.to_thread's executor)."""
    loop = asyncio.get_running_loop()
    fut = loop.create_future()
    fut.add_done_callback(lambda f: f.cancelled() or f.exception())  # never "not retrieved"

    def settle(ok: bool, value) -> None:
        if not fut.done():
            (fut.set_result if ok else fut.set_exception)(value)

    def work() -> None:
        try:
            result = (True, fn())
        except BaseException as e:  # noqa: BLE001 - handed to the awaiting requests
            result = (False, e)
        try:
            loop.call_soon_threadsafe(settle, *result)
        except RuntimeError:  # the loop is closed
            pass

    threading.Thread(target=work, name=name, daemon=True).start()
    return fut


class Scheduler:
    def __init__(self, settings: Settings | None = None, *, factory: Callable[..., Any] | None = None,
                 default_model: Callable[[], str] | None = None, warm: bool = True):
        settings = settings or Settings.load()
        self.settings = settings
        self.queue_size = max(1, settings.queue_size)
        self.registry = ModelRegistry(factory or _engine_load, keep_alive=settings.keep_alive,
                                      max_batch=settings.max_batch, warm=warm)
        self._default_model_fn = default_model or _demo_model
        self._default_future: asyncio.Future | None = None
        self.inflight = 0  # generation requests held now
        self.closing = False

    # -- generation ----------------------------------------------------------------------------

    async def generate(self, req: Generate | Chat, emit: Callable[[Any], None], received_ns: int) -> None:
        if self.closing:
            raise SchedulerError("shutdown", "the daemon is shutting down")
        if self.inflight >= self.queue_size:
            raise SchedulerError("busy", f"{self.inflight} generation requests are queued or running "
                                         f"(MOED_QUEUE_SIZE={self.queue_size}); retry later")
        self.inflight += 1
        model: LoadedModel | None = None
        seq: Sequence | None = None
        try:
            name = req.model or await self.default_model()
            model, load_ns = await self.registry.acquire(name, keep_alive=req.keep_alive)
            done = asyncio.get_running_loop().create_future()

            def on_reply(reply) -> None:  # on the event loop, from the compute thread's hand-over
                if done.done():
                    return
                emit(reply)
                if isinstance(reply, (Done, Error)):
                    done.set_result(None)

            seq = Sequence(req, on_reply, received_ns=received_ns, load_ns=load_ns)
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

    async def default_model(self) -> str:
        """The only loaded model, else the demo MoE (built once, on a thread, on first use)."""
        models = list(self.registry.models.values())
        if len(models) == 1:
            return models[0].path
        if self._default_future is None:
            self._default_future = _in_thread(self._default_model_fn, "moed-default-model")
        try:
            return await asyncio.shield(self._default_future)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - reported to the requester
            self._default_future = None
            raise SchedulerError("model_error", f"the default model is not available: {e}") from None

    # -- models --------------------------------------------------------------------------------

    async def load(self, name: str, settings: dict[str, Any] | None = None,
                   keep_alive: float | None = None) -> tuple[LoadedModel, int]:
        if self.closing:
            raise SchedulerError("shutdown", "the daemon is shutting down")
        model, load_ns = await self.registry.acquire(name, settings, keep_alive)
        self.registry.release(model)  # keep-alive starts now (0: unloaded right away)
        return model, load_ns

    async def unload(self, name: str) -> None:
        await self.registry.unload(name)

    def ps(self) -> list[dict[str, Any]]:
        return [m.info() for m in self.registry.models.values() if m.loaded and not m.unloading]

    async def stats(self, name: str | None = None) -> dict[str, Any]:
        if name is None:
            models = [m for m in self.registry.models.values() if m.loaded]
        else:
            m = self.registry.find(name)
            if m is None or not m.loaded:
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
        await self.registry.close()
