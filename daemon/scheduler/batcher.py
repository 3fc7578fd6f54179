"""Continuous batching, overlapped: one compute thread per model runs every pass of that model, and
launches each decode step before it looks at the tokens of the step before.

    event loop                          compute thread (one per model)          text thread
    ----------                          ------------------------------          -----------
    call(fn) -> Future  ───jobs──────▶  between steps: fn(engine)
    submit(seq)         ───incoming──▶  prepare; prefill the prompts that
                                        arrived together (decoder.prefill:
                                        each first token sampled)      ──events──▶ seq.text:
                                        launch step N+1 (its inputs are            detokenize,
                                        step N's tokens, on the device)            stop strings,
                                        wait for step N's tokens; the id           Chunk/Done
    emit(reply)  ◀──call_soon_threadsafe─ rules (EOG, max_tokens, context) ──events──▶ (one hand-over
                                        decided at once                             per step)

The decoder (daemon/model/decoding.py) is the model's: on a GPU the step samples on the device and
reads its input tokens from the step before's sampled ids, so the host waits once per step, for
the token ids, while the next step already runs; on the CPU the step runs in this thread and the
text of step N is worked on beside step N+1.

Exactness: every row of a launched step is either accepted (in order, per sequence) or dropped. A
sequence that ends at step N (end of generation, or a stop string, which the text thread reports
before step N+2 is launched) has at most its row of step N+1 computed and dropped; max_tokens and
the context end are known in advance and cost nothing. Cancel and client disconnects stop a
sequence at the next launch. A sequence's KV cache and sampler slot are given back once no launched
step has its row. forward passes are batch-invariant, so a request gets the same tokens whatever
else shares its steps.

Failures stay with the sequences they concern: an exception while one sequence is prepared,
prefilled or sampled (non-finite logits included) fails that sequence; a failed step fails the
sequences of that step; the loop goes on. ModelFileChanged fails them and stops the batcher (the
model's weights no longer match its file), with that message for every sequence left. If the loop
itself ever breaks, the thread still fails every sequence and resolves `stopped`, and the registry
drops the model (`stopping` is set from then on: call/submit refuse), so the next request loads it
again instead of waiting forever. Every reply goes through the text thread, in order.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable
from typing import Any

from .. import heap
from ..errors import ModelFileChanged, MoedError, RequestError, SchedulerError, wire_error
from ..model.decoding import decoder_for
from .sequence import ERROR, Sequence
from .text_thread import TextThread

log = logging.getLogger("moed.scheduler")

PREFILL_TOKENS = 512  # prompt rows evaluated in one pass (a longer prompt gets a pass of its own)


class Batcher:
    def __init__(self, name: str, max_batch: int, loop: asyncio.AbstractEventLoop | None = None):
        self.name = name
        self.max_batch = max(1, max_batch)
        self.loop = loop or asyncio.get_running_loop()
        self.engine = None  # set by the first job (the load)
        self._cv = threading.Condition()
        self._jobs: deque[tuple[Callable, asyncio.Future]] = deque()
        self._incoming: deque[Sequence] = deque()
        self._active: list[Sequence] = []
        self._stopping = False
        self._stop_reason = ("model_error", "the model was unloaded")
        self.stopped: asyncio.Future = self.loop.create_future()
        # counters (read from the event loop; plain ints, updated by the compute thread)
        self.steps = 0  # decode steps (forward_batch calls)
        self.step_tokens = 0  # sequences advanced by those steps
        self.prefills = 0
        self.prefill_passes = 0  # forward passes those prefills took (prompts arriving together share one)
        self.peak_batch = 0
        self._pending: _InFlight | None = None  # the decode step launched and not yet processed
        self._launched = 0  # decode steps launched (the text thread's batches are tagged with them)
        self._decoder_ = None  # the model's decoder (daemon.model.decoding), made after the load
        self._text = TextThread(name, lambda events: self._post(self._deliver, events))
        self._thread = threading.Thread(target=self._run, name=f"moed-compute:{name}", daemon=True)
        self._thread.start()

    # -- event loop side -----------------------------------------------------------------------

    @property
    def stopping(self) -> bool:
        """The thread is ending or has ended (an unload, a changed model file or a broken loop)."""
        return self._stopping

    @property
    def stop_reason(self) -> str:
        """Why it stopped (or will): the message its unfinished sequences get."""
        return self._stop_reason[1]

    @property
    def active(self) -> int:
        """Sequences decoding or waiting for their prefill."""
        return len(self._active) + len(self._incoming)

    def call(self, fn: Callable[[Any], Any]) -> asyncio.Future:
        """Run fn(engine) on the compute thread between two steps; its result as a Future."""
        fut = self.loop.create_future()
        with self._cv:
            if self._stopping:
                fut.set_exception(RuntimeError(f"{self.name} is stopping"))
                return fut
            self._jobs.append((fn, fut))
            self._cv.notify()
        return fut

    def submit(self, seq: Sequence) -> None:
        """Queue a sequence; it joins the batch at the next step boundary with room."""
        with self._cv:
            if self._stopping:
                raise RuntimeError(f"{self.name} is stopping")
            self._incoming.append(seq)
            self._cv.notify()

    def wake(self) -> None:
        """A sequence was cancelled: let an idle thread drop it now."""
        with self._cv:
            self._cv.notify()

    def stop(self, code: str = "model_error", message: str = "the model was unloaded") -> asyncio.Future:
        """End the thread after the current step: unfinished sequences get Error(code, message),
        then `close_fn` jobs run and the engine is closed. Returns `stopped`."""
        with self._cv:
            if not self._stopping:
                self._stopping = True
                self._stop_reason = (code, message)
                self._cv.notify()
        return self.stopped

    # -- compute thread ------------------------------------------------------------------------

    def _post(self, fn, *args) -> None:
        try:
            self.loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the loop is closed: the daemon is gone
            pass

    @staticmethod
    def _deliver(events: list[tuple[Sequence, list]]) -> None:
        for seq, replies in events:
            for reply in replies:
                seq.emit(reply)

    @staticmethod
    def _resolve(fut: asyncio.Future, ok: bool, value) -> None:
        if fut.done():
            return
        if ok:
            fut.set_result(value)
        else:
            fut.set_exception(value)

    def _run(self) -> None:
        try:
            while True:
                with self._cv:
                    while not (self._jobs or self._incoming or self._active or self._pending or self._stopping):
                        self._cv.wait()
                    if self._stopping:
                        break
                    jobs = list(self._jobs)
                    self._jobs.clear()
                    room = self.max_batch - len(self._active)
                    new = []
                    while self._incoming and len(new) < room:
                        seq = self._incoming.popleft()
                        if not seq.cancelled:
                            new.append(seq)
                if jobs or new:
                    self._drain()  # nothing in flight: jobs see a quiet engine, KV pools may grow
                for fn, fut in jobs:
                    try:
                        self._post(self._resolve, fut, True, fn(self.engine))
                    except BaseException as e:  # noqa: BLE001 - handed to the awaiting request
                        self._post(self._resolve, fut, False, e)
                jobs = fn = fut = None  # the load's future holds the engine: not past its unload
                try:
                    self._advance(new)
                except Exception as e:  # a bug outside every guard: its sequences fail, the loop goes on
                    log.exception("%s: a step failed", self.name)
                    self._pending = None
                    self._fail_all(new + self._active, e)
        except BaseException as e:  # noqa: BLE001 - the loop broke: fail everything, let the registry know
            log.critical("%s: the compute thread failed", self.name, exc_info=True)
            code, why = wire_error(e)
            self._stop_self(code, f"the compute thread of {self.name} failed: {why}")
        finally:
            self._shutdown()

    def _advance(self, new: list[Sequence]) -> None:
        """Prefill the sequences that arrived, then launch the next decode step."""
        if new:  # the prompts that arrived together are evaluated together
            self._start(new)
        if (self._active or self._pending) and not self._stopping:
            self._launch()

    def _fail_all(self, seqs: list[Sequence], e: BaseException) -> None:
        events = []
        for s in seqs:
            if not s.ended:
                s.ended = True
                events.append((s, ERROR, e))
        self._text.put(self._launched, events)
        self._retire()

    def _stop_self(self, code: str, message: str) -> None:
        """The batcher cannot go on (its model file changed, its loop broke): the loop ends after
        this step; every sequence left gets Error(code, message)."""
        with self._cv:
            if not self._stopping:
                self._stopping = True
                self._stop_reason = (code, message)

    def warm(self) -> None:
        """Compute thread (the load's job): the decode graphs captured before the first request."""
        t0 = time.perf_counter()
        try:
            made = self._decoder().warm(self.engine.n_ctx, PREFILL_TOKENS)
        except Exception as e:  # noqa: BLE001 - graphs are an optimisation: they are made when first needed
            log.warning("%s: capturing the decode graphs at load failed (%s); they are captured as needed",
                        self.name, e)
            return
        if made:
            log.info("%s: %d decode graphs captured in %.1f s", self.name, made, time.perf_counter() - t0)

    def _decoder(self):
        if self._decoder_ is None:
            self._decoder_ = decoder_for(self.engine.model, self.max_batch)
            self._text.inline = not self._decoder_.overlapping  # no step runs beside the text work
        return self._decoder_

    def _start(self, seqs: list[Sequence]) -> None:
        """Prepare and prefill new sequences, their prompts in passes of up to PREFILL_TOKENS
        rows; each sequence's first token goes to the text thread as soon as its pass ends, and
        the sequence joins the decode batch."""
        ready, failed = [], []
        for seq in seqs:
            event = self._guard(seq, lambda s=seq: s.prepare(self.engine))
            (failed if event else ready).append(event or seq)
        self._text.put(self._launched, failed)
        while ready:
            if self._stopping:  # stopped meanwhile: the rest never start
                self._text.put(self._launched, [(s, ERROR, self._stop_error()) for s in ready])
                return
            n, rows = 0, 0
            while n < len(ready) and (n == 0 or rows + len(ready[n].ids) <= PREFILL_TOKENS):
                rows += len(ready[n].ids)
                n += 1
            part, ready = ready[:n], ready[n:]
            t0 = time.perf_counter_ns()
            decoder = self._decoder()
            try:
                tokens, errors = decoder.prefill(part)
                self.prefill_passes += 1
                log.debug("%s: prefill of %d prompts (%d rows) in %.3f s", self.name, n, rows,
                          (time.perf_counter_ns() - t0) / 1e9)
            except Exception:  # alone, each sequence gets its own outcome
                log.debug("a prefill of %d prompts failed; each is retried alone", len(part), exc_info=True)
                tokens, errors = [0] * len(part), [None] * len(part)
                for b, s in enumerate(part):
                    try:
                        (tokens[b],), (errors[b],) = decoder.prefill([s])
                    except Exception as e:  # noqa: BLE001 - this sequence fails
                        errors[b] = e
                self.prefill_passes += len(part)
            for s, token, error in zip(part, tokens, errors):
                if error is not None:
                    self._failed(error, f"request {s.id}")
                    s.ended = True
                    event = (s, ERROR, error)
                else:
                    event = self._guard(s, lambda s=s, t=int(token): s.first_token(t, t0))
                self.prefills += not (event is not None and event[1] == ERROR)
                if s.live():
                    self._active.append(s)
                elif s.slot is not None:
                    decoder.detach(s)
                if event is not None:
                    self._text.put(self._launched, [event])

    def _stop_error(self) -> SchedulerError:
        return SchedulerError(*self._stop_reason)

    def _guard(self, seq: Sequence, fn) -> tuple | None:
        """fn() for one sequence: its text event (or None); on an exception the sequence has
        ended and the event is ERROR."""
        try:
            return fn()
        except Exception as e:  # a bad request, a broken model or a bug: this sequence only
            self._failed(e, f"request {seq.id}")
            seq.ended = True
            return (seq, ERROR, e)

    def _failed(self, e: Exception, what: str) -> None:
        """Log a failure; a changed model file also stops the batcher."""
        if isinstance(e, ModelFileChanged):
            log.warning("%s: %s; unloading", self.name, e)
            self._stop_self(*wire_error(e))
        elif isinstance(e, RequestError):
            pass  # the requester is told; nothing is wrong here
        elif isinstance(e, MoedError):
            log.warning("%s: %s failed: %s", self.name, what, e)
        else:  # a bug must not take the daemon down, but it is logged in full
            log.error("%s: %s failed", self.name, what, exc_info=e)

    def _launch(self) -> None:
        """Launch the next decode step of every live sequence, then process the step before
        (whose tokens this one may read on the device: the overlap)."""
        # a stop string seen in the text of the step before the one in flight ends its sequence
        # here, so a sequence that ends at step N costs at most its row of step N+1
        self._text.wait_upto(self._launched - 1)
        self._retire()
        seqs = [s for s in self._active if s.live()]
        pending = self._pending
        if not seqs:
            self._drain()
            return
        decoder = self._decoder()
        if pending is not None and not decoder.overlaps(seqs):
            self._drain()  # its tokens may end some of them
            pending = None
            seqs = [s for s in self._active if s.live()]
            if not seqs:
                return
        src = None
        if pending is not None:
            where = {id(s): b for b, s in enumerate(pending.seqs)}
            src = [where.get(id(s), -1) for s in seqs]
        try:
            handle = decoder.launch(seqs, src, pending.handle if pending is not None else None)
        except Exception as e:  # every sequence of the step fails; the daemon goes on
            self._failed(e, "a decode step")
            if pending is not None:
                self._drain()
            self._fail_all(seqs, e)
            return
        self._launched += 1
        self.steps += 1
        self.step_tokens += len(seqs)
        self.peak_batch = max(self.peak_batch, len(seqs))
        for s in seqs:
            s.inflight += 1
        self._pending = _InFlight(handle, seqs, self._launched)
        if pending is not None:
            self._process(pending)
        if not decoder.overlapping:  # computed already: its tokens go to the text thread now
            self._drain()

    def _drain(self) -> None:
        """Process the step in flight, if any."""
        pending, self._pending = self._pending, None
        if pending is not None:
            self._process(pending)

    def _process(self, step: _InFlight) -> None:
        """Wait for a launched step's tokens; the id rules now, the text on the text thread."""
        events = []
        try:
            tokens, errors = step.handle.wait()
        except Exception as e:  # every sequence of the step fails; the daemon goes on
            self._failed(e, "a decode step")
            tokens, errors = None, [e] * len(step.seqs)
        for b, s in enumerate(step.seqs):
            s.inflight -= 1
            if s.cancelled:  # nobody reads its replies any more
                s.ended = True
            elif errors[b] is not None:
                if not s.ended:
                    if tokens is not None:
                        self._failed(errors[b], f"request {s.id}")
                    s.ended = True
                    events.append((s, ERROR, errors[b]))
            else:
                event = s.accept(int(tokens[b]))
                if event is not None:
                    events.append(event)
        issue = getattr(self._pending.handle, "issue", None) if self._pending is not None else None
        if issue is not None:  # the step in flight samples under grammar masks: they are known now
            try:
                issue()
            except Exception:  # noqa: BLE001 - raised again where its tokens are waited for
                pass
        self._retire()  # before their Done goes out: a finished request is out of the batch
        self._text.put(step.number, events)

    def _retire(self) -> None:
        """Sequences that will not go on leave the batch once no launched step has their row:
        their sampler slot and KV cache are given back."""
        keep = []
        for s in self._active:
            if s.live() or s.inflight:
                keep.append(s)
            else:
                try:
                    if self._decoder_ is not None:
                        self._decoder_.detach(s)
                except Exception:  # noqa: BLE001 - a slot lost, not a request
                    log.exception("%s: releasing the sampler of request %s failed", self.name, s.id)
                s.cache = None  # freed now, not at the end of the stream
        self._active = keep

    def _shutdown(self) -> None:
        try:
            self._drain()
        except Exception:  # noqa: BLE001 - its sequences are failed below
            log.debug("%s: the last step failed", self.name, exc_info=True)
        with self._cv:
            self._stopping = True  # however the loop ended: call/submit refuse from now on
            left = self._active + list(self._incoming)
            self._active, self._incoming = [], deque()
            jobs = list(self._jobs)
            self._jobs.clear()
        error = self._stop_error()
        self._text.put(self._launched, [(s, ERROR, error) for s in left if not s.cancelled])
        self._text.close()  # every reply is handed over before `stopped` resolves
        for _fn, fut in jobs:
            self._post(self._resolve, fut, False, RuntimeError(f"{self.name} stopped"))
        for s in left:
            s.cache = None
        self._decoder_ = None
        t0 = time.perf_counter()
        if self.engine is not None:
            try:
                self.engine.close()
            except Exception:
                log.exception("closing %s failed", self.name)
            try:
                dropped = weakref.ref(self.engine)
            except TypeError:  # a test's stand-in
                dropped = None
            self.engine = None
            heap.settle(dropped)  # it is gone now: refreeze the other models, give the freed pages back
        log.debug("%s: compute thread ended (close took %.3fs)", self.name, time.perf_counter() - t0)
        self._post(self._resolve, self.stopped, True, None)

    def stats(self) -> dict:
        return {"steps": self.steps, "step_tokens": self.step_tokens, "prefills": self.prefills,
                "prefill_passes": self.prefill_passes,
                "peak_batch": self.peak_batch, "active": self.active,
                "mean_batch": round(self.step_tokens / self.steps, 3) if self.steps else 0.0}


class _InFlight:
    """A launched decode step: the decoder's handle, its sequences (row order) and its number."""

    __slots__ = ("handle", "seqs", "number")

    def __init__(self, handle, seqs: list[Sequence], number: int):
        self.handle, self.seqs, self.number = handle, seqs, number

