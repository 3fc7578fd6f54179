"""One generation request's token loop: the only one. The Batcher advances many sequences a
token at a time; Engine.generate/chat run one alone (run(engine)). The loop is cut at the forward
pass so that many sequences can share it, and cut again between ids and text so that the text work
runs beside the next step:

    prompt_ids(req, ...)  ids from the request (template, tokenizer, size and range checks); run by
                          the scheduler before the sequence exists, never on the compute thread
    prepare(engine)       sampler, detokenizer, stop strings; KV cache allocated
    first(logits [V])     after the prompt's pass (alone: prefill; together: forward_many): the first
                          token sampled on the host and accepted
    accept(token)         a token sampled for it (on the host or the device): the id rules (end of
                          generation, max_tokens, context) decided at once -> a text event
    text(event)           detokenize, stop strings, the replies (Chunk per token, then Done/Error)
    run(engine)           all of it alone, in the caller's thread; yields the replies

In the daemon the compute thread calls prepare/first/accept, the Batcher's text thread calls text,
and the event loop only sets `cancelled`; replies reach `emit` on the event loop.
`error_reply(id, exc)` is how an exception becomes the request's Error (daemon.errors.wire_error:
bad_request for a RequestError, model_error for another MoedError, internal for a bug).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

# Replies are built here: the Chunk made per token is the one sent.
# (ipc.protocol imports nothing from daemon.)
from ipc.protocol import Chat, Chunk, Done, Error, Generate

from ..errors import RequestError, wire_error
from ..sampling import Sampler, SamplingOptions, StopMatcher
from ..text.tokenizer import StreamDecoder

DEFAULT_OPTIONS = SamplingOptions()


class Sequence:
    """State of one Generate/Chat request, in the scheduler or alone (run).

    Two threads share it in the daemon. The compute thread owns the ids: `accept(token)` applies
    the rules that depend on ids alone (end of generation, max_tokens, the context), exactly and
    at once, and says what the text side must do. The text thread (Batcher's) owns the text:
    `text(event)` detokenizes, matches stop strings and builds the replies; a stop string sets
    `stopped`, which the compute thread reads before its next launch."""

    def __init__(self, request: Generate | Chat, ids: list[int], emit: Callable[[Any], None] | None = None,
                 *, received_ns: int, load_ns: int = 0):
        self.request = request
        self.id = request.id
        self.emit = emit  # called on the event loop with each reply (Chunk ..., then Done or Error)
        self.received_ns = received_ns  # perf_counter_ns when the daemon read the request
        self.load_ns = load_ns  # ns this request waited for its model to load
        self.cancelled = False  # set by the event loop; the compute thread drops it at the next step
        self.max_tokens = request.max_tokens
        self.options = request.options or DEFAULT_OPTIONS
        self.ids = ids  # the prompt, checked by prompt_ids
        # compute thread
        self.history: list[int] = []  # prompt + accepted tokens (the repeat penalty's window)
        self.token: int | None = None  # accepted, not yet fed to the model
        self.cache = None  # the model's SequenceCache, freed (None) when the sequence leaves the batch
        self.produced = 0  # tokens accepted
        self.ended = False  # no token after the accepted ones (an id rule, a failure, or `stopped` seen)
        self.inflight = 0  # launched decode steps with a row of this sequence, not yet processed
        self.slot = None  # its device sampler slot (the Batcher's decoder), if any
        self.grammar = None  # daemon.grammar.Matcher of a request with a format (the scheduler's, or prepare's)
        # text thread
        self.finished = False  # a terminal reply has been built
        self.stopped = False  # a stop string ended it
        self.eval_count = 0
        self.prompt_eval_duration = 0
        self.eval_started = 0

    # -- compute thread ------------------------------------------------------------------------

    def prepare(self, engine) -> None:
        """What the token loop needs, the KV cache included (the ids are ready and checked)."""
        self.history = list(self.ids)
        self.sampler = Sampler(self.options)
        if self.grammar is None and getattr(self.request, "format", None):  # in process (Engine)
            from ..grammar import compile_format

            self.grammar = compile_format(self.request.format, engine.tokenizer).matcher()
        self.decoder = StreamDecoder(engine.tokenizer)
        self.stopper = StopMatcher(list(self.request.stop))
        self.eog = engine.tokenizer.eog_ids
        self.n_ctx = min(engine.n_ctx, len(self.ids) + self.max_tokens + 1)
        self.cache = engine.model.new_cache(self.n_ctx)

    def prefill(self, engine) -> list:
        """Evaluate the prompt alone and take the first token; the replies to send."""
        t0 = time.perf_counter_ns()
        return self.prefilled(engine.model.forward(self.ids, self.cache)[-1], t0)

    def prefilled(self, logits: np.ndarray, started_ns: int) -> list:
        """The prompt was evaluated (alone or with others' since started_ns): logits [V] of its
        last token -> take the first token; the replies to send."""
        return self.text(self.first(logits, started_ns))

    def first(self, logits: np.ndarray, started_ns: int) -> tuple:
        """The compute thread's part of prefilled: the first token sampled and accepted -> the
        text event."""
        self.eval_started = time.perf_counter_ns()
        self.prompt_eval_duration = self.eval_started - started_ns
        return self.take(logits)

    def run(self, engine) -> Iterator[Chunk | Done]:
        """The whole loop alone, in the caller's thread (Engine.generate): the replies, ending
        with Done. An exception propagates as raised (no Error reply is built: that is the
        Batcher's way of failing one sequence of many)."""
        self.prepare(engine)
        yield from self.prefill(engine)
        while not self.finished:  # decode steps of one row, as Engine always did them
            yield from self.feed(engine.model.forward([self.token], self.cache)[-1])

    def feed(self, logits: np.ndarray) -> list:
        """Logits [V] for the next token: sample it; the replies to send. Afterwards either
        `finished`, or `token` waits to be decoded."""
        return self.text(self.take(logits))

    def first_token(self, token: int, started_ns: int) -> tuple | None:
        """The compute thread's part after a prompt's pass whose first token was sampled apart
        (the decoder's prefill) -> the text event."""
        self.eval_started = time.perf_counter_ns()
        self.prompt_eval_duration = self.eval_started - started_ns
        if self.exhausted():  # max_tokens 0: no token at all
            self.ended = True
            return (self, END, "length")
        return self.accept(token)

    def take(self, logits: np.ndarray) -> tuple:
        """Sample the next token from logits [V] on the host and accept it -> the text event."""
        if self.exhausted():  # max_tokens 0: no token at all
            self.ended = True
            return (self, END, "length")
        return self.accept(self.sampler.sample(logits, self.history, self.allowed()))

    def allowed(self):
        """The tokens its grammar allows next (int32 [ceil(V / 32)]), or None: any."""
        return None if self.grammar is None else self.grammar.mask()

    def accept(self, token: int) -> tuple | None:
        """The token sampled for this sequence: the id rules decided now -> the text event
        (kind, value, finish), or None when the sequence had ended already (its row of a step
        launched before that was known)."""
        if self.ended:
            return None
        if token in self.eog:
            self.ended = True
            return (self, END, "stop")
        if self.grammar is not None:
            try:
                self.grammar.consume(token)
            except RequestError as e:
                self.ended = True
                return (self, ERROR, e)
        self.history.append(token)
        self.produced += 1
        if self.exhausted():
            self.ended = True
            return (self, TOKEN, token, "length")
        self.token = token
        return (self, TOKEN, token, None)

    def exhausted(self) -> bool:
        """No token may follow the accepted ones: max_tokens reached, or the context has no room
        to evaluate the last one."""
        return self.produced >= self.max_tokens or len(self.ids) + self.produced > self.n_ctx

    def live(self) -> bool:
        """Whether its next token is to be computed."""
        return not (self.ended or self.stopped or self.cancelled or self.finished)

    # -- text thread ---------------------------------------------------------------------------

    def text(self, event: tuple | None) -> list:
        """The replies of a text event (accept's, or ERROR with the exception): detokenize, stop
        strings, Chunk, and Done or Error at the end. Nothing after the terminal reply."""
        if event is None or self.finished:
            return []
        kind = event[1]
        if kind == ERROR:
            return self.fail_with(event[2])
        if kind == END:
            return self._finish(event[2], [])
        token, finish = event[2], event[3]
        self.eval_count += 1
        text = self.stopper.feed(self.decoder.feed(token))
        out = [Chunk(self.id, text, [token])]  # one chunk per token, "" while text is held back
        if self.stopper.stopped:
            self.stopped = True
            return self._finish("stop", out)
        return self._finish(finish, out) if finish else out

    def fail(self, code: str, message: str) -> list:
        self.finished = True
        self.ended = True
        return [Error(self.id, code, message)]

    def fail_with(self, e: BaseException) -> list:
        """Fail because of e (daemon.errors.wire_error's code and message)."""
        return self.fail(*wire_error(e))

    def _finish(self, reason: str, out: list) -> list:
        if not self.stopper.stopped:
            tail = self.stopper.feed(self.decoder.flush()) + self.stopper.flush()
            if tail:
                out.append(Chunk(self.id, tail))
        now = time.perf_counter_ns()
        out.append(Done(self.id, done_reason=reason, prompt_eval_count=len(self.ids),
                        prompt_eval_duration=self.prompt_eval_duration, eval_count=self.eval_count,
                        eval_duration=now - self.eval_started, load_duration=self.load_ns,
                        total_duration=now - self.received_ns))
        self.finished = True
        return out


# text events: (sequence, kind, ...)
TOKEN = "token"  # (seq, TOKEN, token, finish: None or "length")
END = "end"  # (seq, END, done_reason): no token (end of generation, or max_tokens 0)
ERROR = "error"  # (seq, ERROR, exception)


def prompt_ids(req: Generate | Chat, engine, *, max_bytes: int, template_timeout: float) -> list[int]:
    """The request's prompt as token ids, checked; RequestError when they cannot be used, ModelError
    when the model's template fails. Text work (template, tokenizer): the scheduler runs it on its
    text threads. A text is refused beyond max_bytes before it is rendered or tokenized."""
    if isinstance(req, Generate) and req.tokens is not None:
        ids = list(req.tokens)
    elif isinstance(req, Generate) and (req.raw or not _has_template(engine)):
        ids = engine.prompt_ids(req.prompt, max_bytes=max_bytes)
    elif not _has_template(engine):  # a Chat for a model without a template: the contents, in order
        ids = engine.prompt_ids("\n\n".join(m.content for m in req.messages), max_bytes=max_bytes)
    else:
        messages = ([_message(m) for m in req.messages] if isinstance(req, Chat)
                    else [{"role": "user", "content": req.prompt}])
        tools = req.tools if isinstance(req, Chat) else None
        ids = engine.chat_ids(messages, max_bytes=max_bytes, timeout=template_timeout, tools=tools)
    check_ids(ids, engine)
    return ids


def _message(m) -> dict:
    """A Message as chat templates read it: role and content, and a tool call's fields when set."""
    out = {"role": m.role, "content": m.content}
    for key in ("tool_calls", "tool_call_id", "name", "thinking"):
        value = getattr(m, key)
        if value is not None:
            out[key] = value
    return out


def check_ids(ids: list[int], engine) -> None:
    """RequestError unless ids is a prompt the model can evaluate."""
    if not ids:
        raise RequestError("empty prompt")
    if len(ids) >= engine.n_ctx:  # first: a huge list is refused without a pass over it
        raise RequestError(f"prompt of {len(ids)} tokens does not fit the context of {engine.n_ctx}")
    n_vocab = engine.model.hp.n_vocab
    if min(ids) < 0 or max(ids) >= n_vocab:
        raise RequestError(f"token id out of range 0..{n_vocab - 1}")


def error_reply(id: int, e: BaseException) -> Error:
    """The Error that ends request `id` because of e (daemon.errors.wire_error)."""
    return Error(id, *wire_error(e))


def _has_template(engine) -> bool:
    from ..text.chat import chat_template_from_metadata

    return chat_template_from_metadata(engine.gguf.metadata) is not None
