"""Expert prediction ahead of use, and its recall against the exact routing (Path B).

- Path A (`approx`): before a forward pass, each token's embedding goes through every MoE layer's
  router; the top-k per layer are prefetched for the whole pass at once. Cached per token id.
- Speculative: the hidden state entering layer L goes through the router of the next MoE layer,
  whose top-k are prefetched while layer L computes.

Predictions only decide what is read early: the exact router still decides what is computed, so
tokens never change. Routers are used in float32 with the FFN norm folded in (W' = W * g, so
W' @ rms(x) = W @ (rms(x) * g)); prediction needs no ggml rounding.

Legend: T = tokens in the pass, D = hidden size, E = experts, A = experts used per token,
L = MoE layers.
"""

from __future__ import annotations

import logging

import numpy as np

from ..kernels.quants import dequantize

log = logging.getLogger("moed.routing")

MODES = {"exact": (), "approx": ("path_a",), "speculative": ("speculative",), "all": ("path_a", "speculative")}


class RouterBank:
    """Every MoE layer's router with its FFN norm folded in, in float32."""

    def __init__(self, model):
        hp = model.hp
        self.layers = list(model.moe_layers)
        self.n_used = hp.n_expert_used  # A
        self.eps = np.float32(hp.rms_eps)
        ws, bs = [], []
        src, norm = model.source, model.family.ffn_norm
        for il in self.layers:  # from the file: a GPU model's own copies live in VRAM
            r = src.matrix(f"blk.{il}.ffn_gate_inp.weight", hp.n_embd, hp.n_expert)
            w = dequantize(r.raw, r.ggml_type, r.n_in).reshape(r.n_out, r.n_in)  # [E, D]
            ws.append(w * src.vector(f"blk.{il}.{norm}.weight", hp.n_embd)[None, :])
            b = src.optional_vector(f"blk.{il}.ffn_gate_inp.bias", hp.n_expert)
            bs.append(b if b is not None else np.zeros(r.n_out, np.float32))
        self.n_expert = ws[0].shape[0] if ws else 0
        self.stacked = np.ascontiguousarray(np.concatenate(ws)) if ws else np.zeros((0, hp.n_embd), np.float32)  # [L*E, D]
        self.bias = np.concatenate(bs) if bs else np.zeros(0, np.float32)  # [L*E]
        self.index = {il: i for i, il in enumerate(self.layers)}

    def _normed(self, x: np.ndarray) -> np.ndarray:
        x = x.astype(np.float32, copy=False)
        return x / np.sqrt((x * x).mean(axis=1, keepdims=True) + self.eps)

    def top_k(self, layer: int, x: np.ndarray) -> np.ndarray:
        """Top-A experts of one layer for hidden states x [T, D] -> [T, A]."""
        i, E = self.index[layer], self.n_expert
        logits = self._normed(x) @ self.stacked[i * E:(i + 1) * E].T + self.bias[i * E:(i + 1) * E]  # [T, E]
        return np.argpartition(-logits, self.n_used - 1, axis=1)[:, :self.n_used]

    def top_k_all(self, x: np.ndarray) -> np.ndarray:
        """Top-A experts of every MoE layer for x [T, D] -> [T, L, A]."""
        logits = (self._normed(x) @ self.stacked.T + self.bias).reshape(len(x), len(self.layers), self.n_expert)
        return np.argpartition(-logits, self.n_used - 1, axis=2)[:, :, :self.n_used]


class Recall:
    """Per-layer recall of one predictor: |predicted ∩ exact| / |exact|, over each pass's sets.
    Steps where a layer's cache already held every expert are not predicted, so not counted."""

    def __init__(self):
        self.found: dict[int, int] = {}
        self.exact: dict[int, int] = {}
        self.predicted: dict[int, int] = {}

    def add(self, layer: int, predicted: set[int], exact: set[int]) -> None:
        self.found[layer] = self.found.get(layer, 0) + len(predicted & exact)
        self.exact[layer] = self.exact.get(layer, 0) + len(exact)
        self.predicted[layer] = self.predicted.get(layer, 0) + len(predicted)

    def as_dict(self) -> dict:
        per = {il: round(self.found[il] / self.exact[il], 6) if self.exact[il] else 0.0 for il in self.exact}
        found, exact = sum(self.found.values()), sum(self.exact.values())
        return {"per_layer": per, "overall": round(found / exact, 6) if exact else 0.0,
                "predicted": sum(self.predicted.values()), "exact": exact}


QUIET_PASSES = 8  # MOE_ROUTING=auto: passes in a row that start at most one read each end the prediction


class Prefetcher:
    """Step hooks of a Transformer: run the predictors of `mode` and prefetch into `cache`.

    attach(model) sets model.step_hooks and chains model.trace (to score predictions, or log the
    routing when verbose); in mode "exact" and not verbose it has nothing to do and sets neither,
    so a step reads nothing back for it (a GPU's decode steps may run as graph segments).

    until_quiet: predict only while the cache still reads experts (a cold start into an unlimited
    cache): once it holds every expert of every MoE layer, or after QUIET_PASSES passes in a row
    that started at most one read each, the hooks detach for good and the routing is exact (their
    per-layer work cost 30-70% of a warm step on 2 cores; a rare later miss is read on demand)."""

    def __init__(self, model, cache, mode: str = "all", verbose: bool = False, until_quiet: bool = False):
        if mode not in MODES:
            raise ValueError(f"routing mode {mode!r} is not one of {', '.join(MODES)}")
        self.cache = cache
        self.mode = mode
        self.paths = MODES[mode]
        self.verbose = verbose
        self.bank = RouterBank(model) if self.paths else None
        self._next_moe = {}  # layer -> the next MoE layer after it
        moe = list(model.moe_layers)
        for il in range(model.hp.n_layer):
            later = [m for m in moe if m > il]
            if later:
                self._next_moe[il] = later[0]
        self._token_cache: dict[int, np.ndarray] = {}  # token id -> [L, A] Path A prediction
        self._pending: dict[str, dict[int, set[int]]] = {p: {} for p in self.paths}
        self.recall = {p: Recall() for p in self.paths}
        self._tokens = np.zeros(0, np.int64)
        self._model = None
        self._prev_trace = None
        self._hooked = False
        self._until_quiet = until_quiet and bool(self.paths) and not verbose
        self._quiet = 0  # passes in a row that started at most one read
        self._reads = getattr(cache, "reads_started", 0)

    def attach(self, model) -> Prefetcher:
        self._model = model
        self._prev_trace = model.trace
        self._hooked = bool(self.paths) or self.verbose
        if self._hooked:
            model.trace = self.on_route
            model.step_hooks = self
        return self

    def detach(self) -> None:
        if self._model is not None:
            if self._hooked:
                self._model.trace = self._prev_trace
                self._model.step_hooks = None
            self._model = None

    # -- hooks --------------------------------------------------------------------------------

    def begin(self, tokens: np.ndarray) -> None:
        self._tokens = tokens
        for p in self._pending.values():
            p.clear()
        if self._until_quiet and self._quiet_now():
            return
        full = self.cache.holds_all
        if "path_a" in self.paths and not all(full(il) for il in self.bank.layers):
            pred = self._path_a(tokens)  # [T, L, A]
            for i, il in enumerate(self.bank.layers):
                if full(il):  # nothing to load: no prediction (and no recall sample)
                    continue
                ids = set(np.unique(pred[:, i]).tolist())
                self._pending["path_a"][il] = ids
                self.cache.prefetch(il, sorted(ids))

    def _quiet_now(self) -> bool:
        """Counts the last pass's reads; after QUIET_PASSES quiet ones, stops predicting (the
        current pass goes on without prediction) and detaches. -> whether it stopped."""
        reads = self.cache.reads_started
        self._quiet = self._quiet + 1 if reads - self._reads <= 1 else 0
        self._reads = reads
        resident = all(self.cache.holds_all(il) for il in self.bank.layers)  # nothing left to predict
        if self._quiet < QUIET_PASSES and not resident:
            return False
        log.info("routing auto: %s; exact routing from now on",
                 "every expert is cached" if resident else
                 f"the expert cache read nothing new for {QUIET_PASSES} passes")
        self.paths, self.mode = (), "exact"
        self._pending = {}
        self.detach()
        return True

    def layer_input(self, il: int, x: np.ndarray) -> None:
        if "speculative" not in self.paths:
            return
        nxt = self._next_moe.get(il)
        if nxt is None or self.cache.holds_all(nxt):  # nothing to load: no prediction
            return
        if not isinstance(x, np.ndarray):  # a GPU's hidden state: one small copy back
            x = self._model.backend.to_host(x)
        ids = set(np.unique(self.bank.top_k(nxt, x)).tolist())
        self._pending["speculative"][nxt] = ids
        self.cache.prefetch(nxt, sorted(ids))

    def on_route(self, layer: int, ids: np.ndarray) -> None:
        exact = set(np.unique(ids).tolist())
        for path, pending in self._pending.items():
            if layer in pending:
                self.recall[path].add(layer, pending.pop(layer), exact)
        if self.verbose:
            offset = len(self._tokens) - len(ids)  # the last layer may run on the last rows only
            for t, row in enumerate(ids):
                tok = int(self._tokens[offset + t]) if offset + t < len(self._tokens) else -1
                log.info("layer %d token %d: experts %s", layer, tok, " ".join(map(str, row.tolist())))
        if self._prev_trace is not None:
            self._prev_trace(layer, ids)

    # -- results ------------------------------------------------------------------------------

    def _path_a(self, tokens: np.ndarray) -> np.ndarray:
        missing = [t for t in dict.fromkeys(tokens.tolist()) if t not in self._token_cache]
        if missing:
            hp = self._model.hp
            emb = self._model.source.matrix("token_embd.weight", hp.n_embd, hp.n_vocab)  # the file's (host) table
            x = dequantize(emb.raw[np.asarray(missing)], emb.ggml_type, emb.n_in)  # [T', D]
            for t, pred in zip(missing, self.bank.top_k_all(x)):
                self._token_cache[t] = pred.astype(np.int16)  # bounded by the vocabulary: keep it small
        return np.stack([self._token_cache[t] for t in tokens.tolist()])

    def stats(self) -> dict:
        return {"mode": self.mode, "recall": {p: r.as_dict() for p, r in self.recall.items()}}

    def reset_stats(self) -> None:
        self.recall = {p: Recall() for p in self.paths}

    def log_stats(self, cache_stats: dict) -> None:
        """One line per layer: cache counters and each predictor's recall."""
        rec = {p: r.as_dict()["per_layer"] for p, r in self.recall.items()}
        for il, s in cache_stats["layers"].items():
            extra = " ".join(f"recall_{p}={rec[p].get(il, 0.0):.3f}" for p in rec)
            log.info("layer %d: hits %d misses %d loads %d evictions %d bytes %d prefetch used %d wasted %d "
                     "hit rate %.3f %s", il, s["hits"], s["misses"], s["loads"], s["evictions"], s["bytes_read"],
                     s["prefetch_used"], s["prefetch_wasted"], s["hit_rate"], extra)
