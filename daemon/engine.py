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
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import numba
import numpy as np

from .config import Settings
from .errors import RequestError
from .model.transformer import Transformer
from .model.weights import TensorSource
from .routing.predict import Prefetcher
from .routing.tracer import ExpertUsageTracer
from .sampling import Sampler, SamplingOptions, StopMatcher, sampling_options
from .storage.cache import ExpertCache
from .storage.experts import expert_biases
from .storage.gguf import GGUFFile
from .storage.store import ExpertStore, expert_layouts
from .text.chat import chat_template_from_metadata, render_chat, template_tokens
from .text.tokenizer import StreamDecoder, Tokenizer


@dataclass
class GenerationStats:
    """Counts and durations (ns) of the last generation, with Ollama's meanings."""
    prompt_eval_count: int = 0
    prompt_eval_duration: int = 0
    eval_count: int = 0
    eval_duration: int = 0
    done_reason: str = ""


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


def _expert_cache(gguf: GGUFFile, cfg: Settings, say) -> ExpertCache | None:
    """The streaming expert cache over the model's expert pack (when valid) or the GGUF itself."""
    layouts = expert_layouts(gguf)
    if not layouts:
        return None
    store = None
    if cfg.expert_pack:
        from .storage.pack import open_pack

        store = open_pack(gguf.path, gguf, layouts)
    store = store or ExpertStore.from_gguf(gguf, layouts)
    src = TensorSource(gguf)
    biases = {il: tuple(expert_biases(src, il, lay.n_embd, lay.n_ff, lay.n_expert)) for il, lay in layouts.items()}
    limit = f"{cfg.expert_cache_limit_mb:g} MB" if cfg.expert_cache_limit_mb else "no limit"
    say(f"streaming experts from the {store.kind} ({limit})")
    return ExpertCache(store, cfg.expert_cache_limit_mb, cfg.io_depth, biases)


class Engine:
    def __init__(self, gguf: GGUFFile, settings: Settings, model: Transformer, tokenizer: Tokenizer,
                 load_duration_ns: int):
        self.gguf = gguf
        self.settings = settings
        self.model = model
        self.tokenizer = tokenizer
        self.load_duration_ns = load_duration_ns
        self.last_stats = GenerationStats()
        self.n_ctx = min(settings.n_ctx, model.hp.n_ctx_train) if settings.n_ctx else model.hp.n_ctx_train
        self.cache = model.experts if isinstance(model.experts, ExpertCache) else None
        self.routing = settings.routing
        if self.routing == "auto":
            self.routing = "exact" if settings.expert_cache_limit_mb else "speculative"
        self.prefetcher = (Prefetcher(model, self.cache, self.routing, settings.routing_verbose).attach(model)
                           if self.cache is not None else None)
        self.tracer = ExpertUsageTracer.from_settings(settings) if model.moe_layers else None
        if self.tracer is not None:
            self.tracer.attach(model)

    @classmethod
    def load(cls, path: str | os.PathLike, progress: Callable[[str], None] | None = None,
             **settings) -> Engine:
        """Open and validate a GGUF model. `settings` are keyword overrides of daemon.config."""
        t0 = time.perf_counter_ns()
        cfg = Settings.load(**settings)
        if cfg.n_threads:
            numba.set_num_threads(min(cfg.n_threads, numba.config.NUMBA_NUM_THREADS))
        say = progress or (lambda _msg: None)
        say(f"reading {os.fspath(path)}")
        gguf = GGUFFile(path)
        cache = None
        try:
            cache = _expert_cache(gguf, cfg, say)
            say(f"building {gguf.architecture} model")
            model = Transformer(gguf, numerics=cfg.numerics, experts=cache)
            say("building tokenizer")
            tokenizer = Tokenizer.from_metadata(gguf.metadata)
        except BaseException:
            if cache is not None:
                cache.close()
            gguf.close()
            raise
        return cls(gguf, cfg, model, tokenizer, time.perf_counter_ns() - t0)

    def close(self) -> None:
        if self.tracer is not None:
            self.tracer.close()  # writes what is not written yet, once
            self.tracer = None
        if self.prefetcher is not None:
            self.prefetcher.detach()
        if self.cache is not None:
            self.cache.close()
        self.gguf.close()

    def stats(self) -> dict:
        """Expert cache and routing statistics, per layer and in total (JSON-serialisable);
        None parts for a model without experts."""
        return {"model": str(self.gguf.path),
                "cache": self.cache.stats() if self.cache is not None else None,
                "routing": self.prefetcher.stats() if self.prefetcher is not None else None}

    def reset_stats(self) -> None:
        if self.cache is not None:
            self.cache.reset_stats()
            self.prefetcher.reset_stats()

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
                            max_bytes: int | None = None, timeout: float | None = None) -> str:
        """The prompt for a conversation, by the model's template (ChatML without one). Messages
        and the rendered prompt are capped at max_bytes (default settings.max_prompt_bytes); the
        render gets timeout seconds (default settings.template_timeout)."""
        limit = self.settings.max_prompt_bytes if max_bytes is None else max_bytes
        prompt = render_chat(chat_template_from_metadata(self.gguf.metadata), messages,
                             add_generation_prompt=add_generation_prompt, **template_tokens(self.tokenizer),
                             timeout=self.settings.template_timeout if timeout is None else timeout,
                             max_bytes=limit)  # messages are refused before rendering, output while it grows
        check_prompt_bytes(prompt, limit, "rendered chat prompt")  # what the tokenizer gets, whatever rendered it
        return prompt

    def prompt_ids(self, prompt: str, *, max_bytes: int | None = None) -> list[int]:
        """Token ids of a raw prompt (BOS as the model wants), refused beyond max_bytes."""
        if not isinstance(prompt, str):
            raise RequestError(f"a prompt must be a string, not {type(prompt).__name__}")
        check_prompt_bytes(prompt, self.settings.max_prompt_bytes if max_bytes is None else max_bytes)
        return self.tokenize(prompt)

    def chat_ids(self, messages: list[dict], *, max_bytes: int | None = None,
                 timeout: float | None = None) -> list[int]:
        """Token ids of a conversation rendered by the template (apply_chat_template's bounds);
        BOS is added unless the template wrote it."""
        prompt = self.apply_chat_template(messages, max_bytes=max_bytes, timeout=timeout)
        return self.tokenize(prompt, add_special=not self._template_adds_bos(prompt), parse_special=True)

    # -- compute -------------------------------------------------------------------------------

    def forward(self, tokens: Sequence[int]) -> np.ndarray:
        """Logits [len(tokens), vocab] (float32) of a fresh sequence."""
        tokens = list(tokens)
        cache = self.model.new_cache(max(len(tokens), 1))
        return self.model.forward(tokens, cache, all_logits=True)

    def generate(self, prompt: str | Sequence[int], max_tokens: int = 256, *, stop: Sequence[str] = (),
                 options: SamplingOptions | None = None, **sampling) -> Iterator[str]:
        """Yield text pieces as tokens are produced. `sampling`: fields of SamplingOptions."""
        options = options or sampling_options(**sampling)  # a bad value: RequestError
        if max_tokens < 0:
            raise RequestError("max_tokens must be >= 0")
        ids = self.prompt_ids(prompt) if isinstance(prompt, str) else [int(t) for t in prompt]
        if not ids:
            raise RequestError("empty prompt")
        if len(ids) >= self.n_ctx:
            raise RequestError(f"prompt of {len(ids)} tokens does not fit the context of {self.n_ctx}")
        return self._generate(ids, max_tokens, list(stop), options)

    def chat(self, messages: list[dict], max_tokens: int = 256, **kw) -> Iterator[str]:
        return self.generate(self.chat_ids(messages), max_tokens, **kw)

    def _template_adds_bos(self, prompt: str) -> bool:
        bos = template_tokens(self.tokenizer)["bos_token"]
        return bool(bos) and prompt.startswith(bos)

    def _generate(self, ids: list[int], max_tokens: int, stop: list[str], options: SamplingOptions) -> Iterator[str]:
        stats = self.last_stats = GenerationStats()
        try:
            sampler = Sampler(options)
            decoder = StreamDecoder(self.tokenizer)
            stopper = StopMatcher(stop)
            cache = self.model.new_cache(min(self.n_ctx, len(ids) + max_tokens + 1))
            history = list(ids)
            t0 = time.perf_counter_ns()
            logits = self.model.forward(ids, cache)[-1]
            stats.prompt_eval_count = len(ids)
            stats.prompt_eval_duration = time.perf_counter_ns() - t0
            t1 = time.perf_counter_ns()
            reason = "length"
            for _ in range(max_tokens):
                token = sampler.sample(logits, history)
                if token in self.tokenizer.eog_ids:
                    reason = "stop"
                    break
                history.append(token)
                stats.eval_count += 1
                text = stopper.feed(decoder.feed(token))
                if text:
                    yield text
                if stopper.stopped:
                    reason = "stop"
                    break
                if cache.n_past + 1 > cache.n_ctx:
                    break
                logits = self.model.forward([token], cache)[-1]
            stats.eval_duration = time.perf_counter_ns() - t1
            stats.done_reason = reason
            if not stopper.stopped:
                tail = stopper.feed(decoder.flush()) + stopper.flush()
                if tail:
                    yield tail
        finally:
            self._after_generation()

    def _after_generation(self) -> None:
        if self.prefetcher is not None and self.settings.routing_verbose:
            self.prefetcher.log_stats(self.cache.stats())
        if self.tracer is not None:
            self.tracer.report()
            self.tracer.write()
