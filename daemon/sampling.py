"""Token sampling: repeat penalty, then top-k, top-p, min-p, temperature, and a seeded draw.

temperature <= 0 is greedy (the first index of the maximum logit). The same seed, prompt and
options give the same tokens.
"""

from __future__ import annotations

import msgspec
import numpy as np

from .errors import RequestError


class SamplingOptions(msgspec.Struct, kw_only=True, frozen=True):
    temperature: float = 0.8
    top_k: int = 40  # 0 = off
    top_p: float = 0.95  # 1 = off
    min_p: float = 0.05  # 0 = off
    repeat_penalty: float = 1.1  # 1 = off
    repeat_last_n: int = 64
    seed: int | None = None  # None = a fresh random seed

    def __post_init__(self):
        checks = (
            (self.temperature >= 0, "temperature must be >= 0"),
            (self.top_k >= 0, "top_k must be >= 0"),
            (0 < self.top_p <= 1, "top_p must be in (0, 1]"),
            (0 <= self.min_p <= 1, "min_p must be in [0, 1]"),
            (self.repeat_penalty > 0, "repeat_penalty must be > 0"),
            (self.repeat_last_n >= 0, "repeat_last_n must be >= 0"),
        )
        for ok, message in checks:
            if not ok or any(isinstance(v, float) and not np.isfinite(v) for v in
                             (self.temperature, self.top_p, self.min_p, self.repeat_penalty)):
                raise RequestError(message if not ok else "sampling options must be finite")


class Sampler:
    def __init__(self, options: SamplingOptions):
        self.options = options
        self.rng = np.random.default_rng(options.seed)

    def sample(self, logits: np.ndarray, history: list[int]) -> int:
        """logits: [V] f32 for the next token; history: tokens so far (prompt + generated)."""
        o = self.options
        logits = np.asarray(logits, dtype=np.float32)
        if o.repeat_penalty != 1.0 and o.repeat_last_n and history:
            logits = logits.copy()
            recent = np.unique(np.asarray(history[-o.repeat_last_n:], dtype=np.int64))
            vals = logits[recent]
            logits[recent] = np.where(vals > 0, vals / o.repeat_penalty, vals * o.repeat_penalty)
        if o.temperature <= 0:
            return int(np.argmax(logits))
        order = np.argsort(-logits, kind="stable")  # candidates, best first
        if o.top_k:
            order = order[:o.top_k]
        cand = logits[order].astype(np.float64)
        probs = np.exp(cand - cand[0])
        probs /= probs.sum()
        if o.top_p < 1.0:
            keep = int(np.searchsorted(np.cumsum(probs), o.top_p) + 1)
            order, cand, probs = order[:keep], cand[:keep], probs[:keep]
        if o.min_p > 0:
            keep = probs >= o.min_p * probs[0]
            order, cand = order[keep], cand[keep]
        scaled = (cand - cand[0]) / o.temperature
        p = np.exp(scaled)
        p /= p.sum()
        return int(order[self.rng.choice(len(order), p=p)])


class StopMatcher:
    """Holds back text that might begin a stop string; reports when one appears."""

    def __init__(self, stops: list[str] | tuple[str, ...]):
        self.stops = [s for s in stops if s]
        self.pending = ""
        self.stopped = False

    def feed(self, text: str) -> str:
        """Returns the text that is safe to emit now."""
        self.pending += text
        if not self.stops:
            out, self.pending = self.pending, ""
            return out
        hits = [i for i in (self.pending.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.stopped = True
            out, self.pending = self.pending[:min(hits)], ""
            return out
        hold = 0
        for s in self.stops:
            for n in range(min(len(s) - 1, len(self.pending)), 0, -1):
                if self.pending.endswith(s[:n]):
                    hold = max(hold, n)
                    break
        cut = len(self.pending) - hold
        out, self.pending = self.pending[:cut], self.pending[cut:]
        return out

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out
