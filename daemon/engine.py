"""Engine: one loaded model, in process. The daemon's scheduler drives the same pieces.

    engine = Engine.load("model.gguf", numerics="ggml")
    ids = engine.tokenize("Hello")
    logits = engine.forward(ids)            # [len(ids), vocab] f32, fresh sequence
    for piece in engine.generate("Hello", max_tokens=32, temperature=0):
        print(piece, end="")

Prompts are bounded like the daemon's (settings.max_prompt_bytes, MOED_MAX_PROMPT_BYTES): a raw
prompt, or a chat's messages before the template and its rendered prompt after it, longer than
that many UTF-8 bytes is a RequestError before anything is tokenized; the template renders within
settings.template_timeout seconds and max_prompt_bytes of output. prompt_ids / chat_ids are the
text steps alone (the daemon's scheduler runs them on its text threads).

generate and chat run the daemon's token loop (daemon.scheduler.sequence) on one sequence alone,
so they check, template, stop and finish exactly as a daemon's Generate(raw=True) and Chat do.
"""

from __future__ import annotations

import json
import os
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import msgspec
import numba
import numpy as np

from ipc.protocol import Chat, Done, Generate, Message, SamplingOptions

from . import heap
from .backend import CPUBackend, cpu_step
from .backend.cpu_threads import ThreadGovernor
from .backend.select import select_backend
from .config import Settings
from .errors import RequestError
from .model.transformer import Transformer
from .routing.predict import Prefetcher
from .routing.replay_routing import RoutingReplay
from .routing.tracer import ExpertUsageTracer
from .sampling import sampling_options
from .scheduler import sequence as token_loop
from .storage.cache import ExpertCache
from .storage.gguf import GGUFFile
from .text.chat import chat_template_from_metadata, render_chat, template_tokens
from .text.tokenizer import Tokenizer


@dataclass
class GenerationStats:
    """Counts and durations (ns) of the last generation, with Ollama's meanings (its Done);
    done_reason is "" when it did not finish (it raised, or its pieces were not all read)."""
    prompt_eval_count: int = 0
    prompt_eval_duration: int = 0
    eval_count: int = 0
    eval_duration: int = 0
    done_reason: str = ""

    @classmethod
    def of(cls, seq: token_loop.Sequence, done: Done | None) -> GenerationStats:
        """A sequence's Done; what it counted so far when it never finished (it failed, or its
        stream was dropped)."""
        if done is None:
            return cls(len(seq.ids) if seq.eval_started else 0, seq.prompt_eval_duration, seq.eval_count)
        return cls(done.prompt_eval_count, done.prompt_eval_duration, done.eval_count, done.eval_duration,
                   done.done_reason)


def check_prompt_bytes(text: str, limit: int, what: str = "prompt") -> None:
    """RequestError when text is more than `limit` bytes of UTF-8 (MOED_MAX_PROMPT_BYTES)."""
    if 4 * len(text) > limit and _utf8_size(text, limit) > limit:  # <= 4 bytes a character
        raise RequestError(f"the {what} is longer than {limit} bytes of UTF-8, the most MOED_MAX_PROMPT_BYTES "
                           f"allows; shorten it (or raise the daemon's limit)")


def _utf8_size(text: str, limit: int) -> int:
    """len(text) in UTF-8; a text of more than `limit` characters is not encoded (its length,
    already over the limit, is returned)."""
    n = len(text)
    return n if n > limit else len(text.encode("utf-8", "surrogatepass"))


class Engine:
    def __init__(self, gguf: GGUFFile, settings: Settings, model: Transformer, tokenizer: Tokenizer,
                 load_duration_ns: int):
        self.gguf = gguf
        self.settings = settings
        self.model = model
        self.tokenizer = tokenizer
        self.load_duration_ns = load_duration_ns
        self._heap_release = None  # Engine.load: gives the frozen heap back (daemon.heap)
        self.last_stats = GenerationStats()
        self.n_ctx = min(settings.n_ctx, model.hp.n_ctx_train) if settings.n_ctx else model.hp.n_ctx_train
        self.vram = model.experts if getattr(model.experts, "tiered", False) else None  # VRAMExpertCache
        self.host_tier = model.experts if getattr(model.experts, "host_tier", False) else None  # HostTierExperts
        self.cache = model.experts if isinstance(model.experts, ExpertCache) else getattr(self.vram, "host", None)
        try:  # a bad trace or trace output fails the load; the engine owns the file and cache it was given
            self.routing_replay = RoutingReplay.from_settings(settings, model)
            self.tracer = ExpertUsageTracer.from_settings(settings) if model.moe_layers else None
        except BaseException:
            (self.vram or self.cache or gguf).close()
            gguf.close()
            raise
        self.routing = settings.routing
        if self.routing == "auto":  # where prediction was measured to pay (docs/benchmarks.md, issue 28)
            self.routing = "speculative" if self._prediction_pays(settings) else "exact"
        self.prefetcher = (Prefetcher(model, self.vram or self.cache, self.routing, settings.routing_verbose,
                                      until_quiet=settings.routing == "auto").attach(model)
                           if self.cache is not None else None)
        if self.tracer is not None:
            self.tracer.attach(model)

    def _prediction_pays(self, settings: Settings) -> bool:
        """MOE_ROUTING=auto's rule. Prediction pays only while an unlimited cache still reads
        experts for a model the CPU serves op by op. Not under a cache limit (it read 1.3-2.6x the
        bytes), nor under replay (predictors read the real router), nor on a GPU (speculation reads
        each layer's hidden state back, a sync per layer), nor where the compiled decode step
        serves (the hooks keep every step op by op: 16 cores, Q4_K_M, first request 71-77 ms a
        token against exact's 49-59, prefill 3.5x slower)."""
        if settings.expert_cache_limit_mb or self.routing_replay is not None or self.vram is not None:
            return False
        step_serves = (getattr(self.model.backend, "compiled_step", "off") != "off"
                       and not cpu_step.unsupported(self.model))
        return not step_serves

    @classmethod
    def load(cls, path: str | os.PathLike, progress: Callable[[str], None] | None = None,
             **settings) -> Engine:
        """Open and validate a GGUF model. `settings` are keyword overrides of daemon.config.
        progress(message) at each step; progress.part(fraction, note), where it has one, as the
        experts' bytes reach the GPU (daemon.progress.Progress)."""
        t0 = time.perf_counter_ns()
        cfg = Settings.load(**settings)
        if cfg.n_threads:
            numba.set_num_threads(min(cfg.n_threads, numba.config.NUMBA_NUM_THREADS))
        say = progress or (lambda _msg: None)
        say(f"reading {os.fspath(path)}")
        gguf = GGUFFile(path)
        cache = None
        try:
            backend = select_backend(cfg, gguf)  # MOE_DEVICE; logs which and why
            if isinstance(backend, CPUBackend):
                backend.compiled_step = {"1": "background", "wait": "wait", "0": "off"}[cfg.cpu_step]
                if cfg.n_threads:  # numba's count is per thread: the backend sets it where steps run
                    backend.threads = min(cfg.n_threads, numba.config.NUMBA_NUM_THREADS)
                else:  # all cores, fewer while others are busy
                    backend.governor = ThreadGovernor(numba.config.NUMBA_NUM_THREADS)
            experts, cache = backend.expert_provider(gguf, cfg, say, progress)
            say(f"building {gguf.architecture} model")
            model = Transformer(gguf, experts=experts, backend=backend)
            say("building tokenizer")
            tokenizer = Tokenizer.from_metadata(gguf.metadata)
        except BaseException:
            if cache is not None:
                cache.close()
            gguf.close()
            raise
        engine = cls(gguf, cfg, model, tokenizer, time.perf_counter_ns() - t0)
        heap.hold()
        engine._heap_release = weakref.finalize(engine, heap.release)  # at close, or once dropped
        return engine

    def close(self) -> None:
        try:
            self._close()
        finally:
            if self._heap_release is not None:
                self._heap_release()  # runs once

    def _close(self) -> None:
        if self.tracer is not None:
            self.tracer.close()  # writes what is not written yet, once
            self.tracer = None
        if self.prefetcher is not None:
            self.prefetcher.detach()
        if self.vram is not None:
            self.vram.close()  # and the host cache under it
        elif self.cache is not None:
            self.cache.close()
        if self.host_tier is not None:
            self.host_tier.close()  # its CPU worker, if any
        self.gguf.close()

    def stats(self) -> dict:
        """The device and its VRAM held (0 on the CPU), its CUDA graphs (captured, replayed; None on
        the CPU), expert cache and routing statistics, per layer and in total (JSON-serialisable);
        None parts for a model without experts."""
        backend = self.model.backend
        graphs = getattr(backend, "graphs", None)
        return {"model": str(self.gguf.path),
                "device": backend.name,
                "vram_bytes": backend.vram_bytes() if hasattr(backend, "vram_bytes") else 0,
                "graphs": None if graphs is None else {"held": len(graphs), "bytes": graphs.nbytes,
                                                       "captures": graphs.captures,
                                                       "replays": graphs.replays,
                                                       "eager_shapes": len(graphs.failed)},
                "cache": self.cache.stats() if self.cache is not None else None,
                "vram_cache": self.vram.stats() if self.vram is not None else None,
                "host_tier": self.host_tier.stats() if self.host_tier is not None else None,
                "routing": self.prefetcher.stats() if self.prefetcher is not None else None}

    def reset_stats(self) -> None:
        if self.cache is not None:
            self.cache.reset_stats()
            self.prefetcher.reset_stats()
        if self.vram is not None:
            self.vram.reset_stats()
        if self.host_tier is not None:
            self.host_tier.reset_stats()
        if self.tracer is not None:
            self.tracer.reset()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # -- text ----------------------------------------------------------------------------------

    def tokenize(self, text: str, add_special: bool = True, parse_special: bool = True) -> list[int]:
        return self.tokenizer.encode(text, add_special=add_special, parse_special=parse_special)

    def detokenize(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids))

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, *,
                            max_bytes: int | None = None, timeout: float | None = None,
                            tools: list[dict] | None = None) -> str:
        """The prompt for a conversation, by the model's template (ChatML without one). Messages
        and the rendered prompt are capped at max_bytes (default settings.max_prompt_bytes); the
        render gets timeout seconds (default settings.template_timeout)."""
        limit = self.settings.max_prompt_bytes if max_bytes is None else max_bytes
        prompt = render_chat(chat_template_from_metadata(self.gguf.metadata), messages,
                             add_generation_prompt=add_generation_prompt, **template_tokens(self.tokenizer),
                             timeout=self.settings.template_timeout if timeout is None else timeout,
                             max_bytes=limit,  # messages are refused before rendering, output while it grows
                             **({"tools": tools} if tools else {}))
        check_prompt_bytes(prompt, limit, "rendered chat prompt")  # what the tokenizer gets, whatever rendered it
        return prompt

    def prompt_ids(self, prompt: str, *, max_bytes: int | None = None) -> list[int]:
        """Token ids of a raw prompt (BOS as the model wants), refused beyond max_bytes."""
        if not isinstance(prompt, str):
            raise RequestError(f"a prompt must be a string, not {type(prompt).__name__}")
        check_prompt_bytes(prompt, self.settings.max_prompt_bytes if max_bytes is None else max_bytes)
        return self.tokenize(prompt)

    def chat_ids(self, messages: list[dict], *, max_bytes: int | None = None,
                 timeout: float | None = None, tools: list[dict] | None = None) -> list[int]:
        """Token ids of a conversation rendered by the template (apply_chat_template's bounds;
        `tools` given to it as the template variable); BOS is added unless the template wrote it."""
        prompt = self.apply_chat_template(messages, max_bytes=max_bytes, timeout=timeout, tools=tools)
        return self.tokenize(prompt, add_special=not self._template_adds_bos(prompt), parse_special=True)

    # -- compute -------------------------------------------------------------------------------

    def forward(self, tokens: Sequence[int]) -> np.ndarray:
        """Logits [len(tokens), vocab] (float32) of a fresh sequence."""
        tokens = list(tokens)
        cache = self.model.new_cache(max(len(tokens), 1))
        return self.model.forward(tokens, cache, all_logits=True)

    def embed(self, texts: Sequence[str], *, truncate: bool = True) -> tuple[np.ndarray, int]:
        """Embeddings: each text's final hidden states (after the output norm), mean-pooled over
        its tokens (BOS included, as llama.cpp's mean pooling) and L2-normalized. -> ([N, D]
        float32, tokens evaluated). A text longer than the context is cut to it (truncate), else
        a RequestError."""
        out = np.empty((len(texts), self.model.hp.n_embd), np.float32)
        evaluated = 0
        for i, text in enumerate(texts):
            ids = self.prompt_ids(text)
            if not ids:
                raise RequestError(f"input {i} has no tokens")
            if len(ids) > self.n_ctx:
                if not truncate:
                    raise RequestError(f"input {i} has {len(ids)} tokens, more than the context ({self.n_ctx})")
                ids = ids[:self.n_ctx]
            h = self.model.hidden_states(ids, self.model.new_cache(len(ids)))  # [T, D]
            mean = h.astype(np.float64).mean(axis=0)
            norm = np.linalg.norm(mean)
            out[i] = mean / norm if norm > 0 else mean
            evaluated += len(ids)
        return out, evaluated

    def generate(self, prompt: str | Sequence[int], max_tokens: int = 256, *, stop: Sequence[str] = (),
                 options: SamplingOptions | None = None, format: str | dict | None = None,
                 **sampling) -> Iterator[str]:
        """Yield text pieces as tokens are produced. A text prompt is used raw (no chat template,
        BOS as the model wants), token ids as they are. `sampling`: fields of SamplingOptions;
        format: "json" or a JSON schema (a dict or its text), which the output is held to
        (daemon.grammar). A bad request raises RequestError here, before the first piece."""
        fields = dict(prompt=prompt, raw=True) if isinstance(prompt, str) else dict(tokens=[int(t) for t in prompt])
        return self._start(Generate, {**fields, "format": _format(format)}, max_tokens, stop, options, sampling)

    def chat(self, messages: list[dict], max_tokens: int = 256, *, stop: Sequence[str] = (),
             options: SamplingOptions | None = None, format: str | dict | None = None,
             **sampling) -> Iterator[str]:
        """generate's reply to a conversation of {role, content} strings, rendered as the daemon
        renders a Chat: by the model's template (BOS added unless the template wrote it), or,
        for a model without one, the contents in order."""
        return self._start(Chat, dict(messages=_messages(messages), format=_format(format)), max_tokens, stop,
                           options, sampling)

    def _template_adds_bos(self, prompt: str) -> bool:
        bos = template_tokens(self.tokenizer)["bos_token"]
        return bool(bos) and prompt.startswith(bos)

    def _start(self, kind: type[Generate | Chat], fields: dict, max_tokens: int, stop: Sequence[str],
               options: SamplingOptions | None, sampling: dict) -> Iterator[str]:
        """The request as the daemon gets it, checked and tokenized now; its token loop, lazily."""
        options = options or sampling_options(**sampling)
        try:
            req = kind(0, max_tokens=max_tokens, stop=list(stop), options=options, **fields)
        except ValueError as e:  # the struct's own checks (bad_request on the wire)
            raise RequestError(str(e)) from None
        ids = token_loop.prompt_ids(req, self, max_bytes=self.settings.max_prompt_bytes,
                                    template_timeout=self.settings.template_timeout)
        return self._generate(token_loop.Sequence(req, ids, received_ns=time.perf_counter_ns()))

    def _generate(self, seq: token_loop.Sequence) -> Iterator[str]:
        """Run seq alone: the text of its Chunks; its Done (or its counts so far) in last_stats.
        A failure raises as it was raised."""
        self.last_stats = GenerationStats()
        done = None
        try:
            for reply in seq.run(self):
                if isinstance(reply, Done):
                    done = reply
                elif reply.text:  # "" while a character or a possible stop string is held back
                    yield reply.text
        finally:
            self.last_stats = GenerationStats.of(seq, done)
            self._after_generation()

    def _after_generation(self) -> None:
        if self.prefetcher is not None and self.settings.routing_verbose:
            self.prefetcher.log_stats(self.cache.stats())
        if self.tracer is not None:
            self.tracer.report()
            self.tracer.write()


def _messages(messages: list[dict]) -> list[Message]:
    """The conversation as a Chat holds it; RequestError for what the wire would refuse."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise RequestError("messages must be a list of {role, content} objects")
    try:
        return [Message(**msgspec.convert(m, dict[str, str])) for m in messages]
    except (msgspec.ValidationError, TypeError) as e:
        raise RequestError(f"messages must be {{role, content}} strings: {e}") from None


def _format(format: str | dict | None) -> str | None:
    """A format as requests carry it: "json" or a JSON schema's text."""
    return format if format is None or isinstance(format, str) else json.dumps(format)
