"""The model: embeddings, the layers a family's builder assembles (daemon/model/layers.py), the
output norm and head; and the pass over a step's rows, shared by every family: the stages of the
model's layer plan (plan.py), which the CPU's compiled step runs too.

Legend: T = rows (tokens) in the step, S = sequences, D = hidden size, H = query heads,
Hkv = key/value heads, Dh = head size, Dv = value head size, V = vocabulary.

Model code only: every computation is an operation of the model's backend (daemon/backend), which
also makes the per-layer caches. The default is the CPU backend, whose numerics ("ggml": llama.cpp's
CPU rounding; "float32") are its option.
"""

from __future__ import annotations

import numpy as np

from ..backend import Backend, CPUBackend, SequenceCache, Step
from ..errors import GGUFError, RequestError
from ..storage.experts import ExpertProvider, ResidentExperts
from ..storage.gguf import GGUFFile
from .family import Family, family_for
from .hparams import HParams
from .layers import decoder_layer
from .moe import MoE, dense_ffn, moe_forward
from .plan import HEAD, MIXER, LayerPlan
from .weights import TensorSource

COLD_TRIES = 3  # graph runs of a decode step over a bounded host tier before it blocks


class _Uploaded:
    """A TensorSource whose weights come back uploaded to a backend."""

    def __init__(self, src: TensorSource, backend: Backend):
        self.src, self.backend = src, backend
        self.has = src.has

    def matrix(self, *args):
        return self.backend.upload(self.src.matrix(*args))

    def matrices(self, *specs):
        """Matrices that read the same input, as one upload group (backend.upload_group)."""
        return self.backend.upload_group([self.src.matrix(*a) for a in specs])

    def vector(self, *args, **kw):
        return self.backend.upload(self.src.vector(*args, **kw))

    def optional_vector(self, *args, **kw):
        v = self.src.optional_vector(*args, **kw)
        return None if v is None else self.backend.upload(v)


class Transformer:
    def __init__(self, gguf: GGUFFile, numerics: str = "ggml", experts: ExpertProvider | None = None,
                 backend: Backend | None = None):
        """backend: where the model computes; default the CPU backend with `numerics`."""
        self.family: Family = family_for(gguf.architecture)
        self.hp: HParams = self.family.read_hparams(gguf)
        self.backend: Backend = backend if backend is not None else CPUBackend(numerics)
        src = self.source = TensorSource(gguf)  # host tensors (the predictors read routers from it)
        up = _Uploaded(src, self.backend)
        hp = self.hp
        self.tok_embd = up.matrix("token_embd.weight", hp.n_embd, hp.n_vocab)
        self.output_norm = up.vector("output_norm.weight", hp.n_embd)
        self.output = (up.matrix("output.weight", hp.n_embd, hp.n_vocab) if src.has("output.weight")
                       else self.tok_embd)
        build = self.family.build_layer or decoder_layer
        self.layers = [build(up, hp, self.family, il) for il in range(hp.n_layer)]
        self.plan = LayerPlan.of(hp.n_layer, self.family.last_layer_all_rows)  # shared with the compiled step
        moe_layers = [il for il, layer in enumerate(self.layers) if isinstance(layer.ffn, MoE)]
        self.moe_layers = moe_layers
        F = hp.n_ff_exp or hp.n_ff
        if experts is None and moe_layers:
            experts = ResidentExperts(src, moe_layers, hp.n_embd, F, hp.n_expert)
        for il in moe_layers:
            lay = experts.layout(il)
            if (lay.n_expert, lay.n_embd, lay.n_ff) != (hp.n_expert, hp.n_embd, F):
                raise GGUFError(f"layer {il}: experts are [{lay.n_expert} x {lay.n_ff} x {lay.n_embd}], "
                                f"the model expects [{hp.n_expert} x {F} x {hp.n_embd}]")
        self.experts = experts
        self.trace = None  # callable(layer, ids [T, A]) observing routing decisions
        # a RoutingReplay: its .table [L_moe, N, A] replaces the routers' top-k (MOE_ROUTING_REPLAY)
        self.route_override = None
        self.step_hooks = None  # .begin(tokens [T]) per forward pass, .layer_input(il, x [T, D]) per layer
        self.ffn_observer = None  # callable(layer, x [T, D], h [T, F]) observing dense FFN activations

    @property
    def numerics(self) -> str | None:
        """The CPU backend's numerics ("ggml" or "float32"); None on another backend."""
        return getattr(self.backend, "numerics", None)

    # -- running -------------------------------------------------------------------------------

    def new_cache(self, n_ctx: int) -> SequenceCache:
        """An empty sequence of up to n_ctx positions, one cache per layer (the backend's)."""
        return self.backend.new_cache(self.hp, n_ctx)

    def forward(self, tokens, cache: SequenceCache, all_logits: bool = False) -> np.ndarray:
        """Append tokens to the sequence in `cache` and return logits: [T, V] if all_logits
        else [1, V] for the last token."""
        return self._pass([self._check_tokens(tokens)], [cache], all_logits)

    def forward_batch(self, tokens, caches: list[SequenceCache]) -> np.ndarray:
        """One decode step for B sequences: token b is appended to caches[b]. -> logits [B, V].

        Batch-invariant: row b is bit-identical to `forward([tokens[b]], caches[b])` alone, since
        the backend computes each sequence's row as a step of that sequence alone would. The
        experts of the step are fetched once for all B."""
        tokens = self._check_tokens(tokens)
        if tokens.size != len(caches):
            raise RequestError(f"{tokens.size} tokens for {len(caches)} distinct sequences")
        return self._pass(list(tokens.reshape(-1, 1)), caches, True)

    def forward_many(self, prompts, caches: list[SequenceCache]) -> np.ndarray:
        """Prefill S sequences in one pass: prompts[s] is appended to caches[s]. -> logits [S, V]
        after each prompt's last token, bit-identical to `forward(prompts[s], caches[s])[-1]`:
        the backend computes each sequence's rows as a step of that sequence alone would."""
        toks = [self._check_tokens(p) for p in prompts]
        if len(toks) != len(caches):
            raise RequestError(f"{len(toks)} prompts for {len(caches)} distinct sequences")
        return self._pass(toks, caches, False)

    def decode_sampled(self, tokens, caches: list[SequenceCache], samplers, feed=None, pad: int = 0,
                       deferred: bool = False):
        """One decode step for S sequences that samples on the device (a backend with `sample`):
        -> (tokens [S] int32, flags [S] int32) as backend arrays, not waited for. samplers [S]:
        each sequence's sampler slot. feed: (src [S], prev) when some input tokens are the step
        before's sampled ids, never seen by the host (src[s] >= 0: prev[src[s]]; tokens[s] is then
        a placeholder); only when `device_fed` (nothing on the host reads the step's tokens).
        pad > S: the step runs as one of pad rows, S..pad-1 copies of row 0 (Step.padded: sampled
        by no slot), so that few batch sizes need a graph. deferred: the layers are launched now,
        and a function is returned that launches the sampling when called (after the caller has
        put grammar masks in the slots) -> (tokens, flags); the caller must call it before the
        next step is launched (a graph's logits buffer is reused)."""
        tokens = self._check_tokens(tokens)
        if tokens.size != len(caches):
            raise RequestError(f"{tokens.size} tokens for {len(caches)} distinct sequences")
        if pad > tokens.size and not self.paddable:
            raise RequestError("a model with recurrent layers cannot pad a step")
        return self._pass(list(tokens.reshape(-1, 1)), caches, True,
                          samplers=np.asarray(samplers, np.int32), feed=feed, pad=pad, deferred=deferred)

    @property
    def paddable(self) -> bool:
        """Whether a decode step may be padded with copies of a row (Step.padded)."""
        return not any(self.hp.recurrent)

    def prefill_sampled(self, prompts, caches: list[SequenceCache], samplers):
        """forward_many whose last rows are sampled on the device by each sequence's sampler slot
        -> (tokens [S] int32, flags [S] int32) as backend arrays, not waited for."""
        toks = [self._check_tokens(p) for p in prompts]
        if len(toks) != len(caches):
            raise RequestError(f"{len(toks)} prompts for {len(caches)} distinct sequences")
        return self._pass(toks, caches, False, samplers=np.asarray(samplers, np.int32))

    @property
    def device_fed(self) -> bool:
        """A decode step needs its tokens on the device only: no hook, trace, routing override
        or expert provider reads them on the host (which also makes it one graph)."""
        return self._plain() and (not self.moe_layers or getattr(self.experts, "routing_free", False))

    def _check_tokens(self, tokens) -> np.ndarray:
        tokens = np.asarray(tokens, dtype=np.int64).reshape(-1)
        if tokens.size == 0:
            raise RequestError("no tokens to evaluate")
        if tokens.min() < 0 or tokens.max() >= self.hp.n_vocab:
            raise RequestError(f"token id out of range 0..{self.hp.n_vocab - 1}")
        return tokens

    def hidden_states(self, tokens, cache: SequenceCache) -> np.ndarray:
        """Append tokens to the sequence in `cache`; -> the final hidden states [T, D] float32
        (after the output norm, before the output head), on the host: what embeddings pool."""
        return self._pass([self._check_tokens(tokens)], [cache], True, hidden=True)

    def _pass(self, tokens: list[np.ndarray], caches: list[SequenceCache], all_logits: bool,
              samplers=None, feed=None, pad: int = 0, hidden: bool = False, deferred: bool = False):
        """tokens[s] appended to caches[s] in one step. -> logits [T, V], or [S, V] of each
        sequence's last row; with samplers, the sampled (tokens, flags) on the device."""
        if len(caches) > 1 and len({id(c) for c in caches}) != len(caches):
            raise RequestError(f"{len(tokens)} token lists for {len(caches)} distinct sequences")
        for c, t in zip(caches, tokens):
            c.reserve(c.n_past + t.size)
        step = Step.append(tokens, caches, all_logits)
        step.samplers, step.feed, step.hidden, step.deferred = samplers, feed, hidden, deferred
        out = self._run(step.padded(pad))
        for c, t in zip(caches, tokens):
            c.n_past += t.size
        return out

    def _run(self, step: Step):
        """The layers over the step's rows. -> logits [T, V], or of each sequence's last row
        (on the host); with step.samplers, the backend's sampled (tokens, flags)."""
        B = self.backend
        begin_pass = getattr(self.experts, "begin_pass", None)  # a streaming provider's per-pass bookkeeping
        if begin_pass is not None:
            begin_pass(step.T)
        step.variant = getattr(self.experts, "graph_variant", None)
        if step.hidden:  # its own graphs, and never the compiled step (which ends in logits)
            step.variant = ("hidden", step.variant)
        elif step.deferred:  # graphs of the layers alone
            step.variant = ("deferred", step.variant)
        plain = self._plain()
        if getattr(self.experts, "checked", False):
            return self._run_checked(step, plain)
        static = plain and (not self.moe_layers or getattr(self.experts, "routing_free", False))
        segmentable = getattr(self.experts, "segmentable", None)  # (row, expert) pairs -> bool
        segmented = plain and not static and segmentable is not None and segmentable(step.T * self.hp.n_expert_used)
        if step.feed is not None and not static:
            raise RequestError("a step whose tokens are read on the host cannot take them from the device")
        if plain and step.samplers is None and self.route_override is None and not step.hidden:
            compiled = getattr(B, "run_compiled", None)  # the whole step as one call (the CPU's)
            logits = compiled(self, step) if compiled is not None else None
            if logits is not None:
                return logits
        if step.samplers is not None and step.deferred:  # the layers now; the sampling when asked
            logits = self._launched(B.run_step(step, lambda: self._layers(step), static=static, segmented=segmented))
            return lambda: B.sample(logits, step, reuse=True)
        if step.samplers is not None:  # sampled in the step (its last segment): not waited for
            return self._launched(B.run_step(step, lambda: B.sample(self._layers(step), step), static=static,
                                             segmented=segmented))
        return B.to_host(self._launched(B.run_step(step, lambda: self._layers(step), static=static,
                                                   segmented=segmented)))

    def _launched(self, out):
        """The step is launched: the experts' host work that may overlap it (promotion) runs now."""
        launched = getattr(self.experts, "launched", None)
        if launched is not None:
            launched()
        return out

    def _run_checked(self, step: Step, plain: bool):
        """_run over a host tier whose steps are checked before sampling (cuda_host_tier.py: cold
        misses, or a CPU worker's share). Cold misses: a decode step runs as one graph, with no
        routing on the host, its kernels skipping experts in no tier; the tier's flag, read after
        the layers and before sampling, says whether one was needed, and then the step runs again
        (up to COLD_TRIES runs, the cold experts its counts show read in between), then blocking
        (every cold expert read before its layer; KV rewritten at the same positions). A prefill,
        or a model with recurrent states (not idempotent), always blocks. A failed CPU share fails
        the step there (take_cold raises), before anything is sampled. Promotion (`launched`) follows
        the final run."""
        B, experts = self.backend, self.experts
        logits = None
        if plain and step.T == step.S and self.paddable and experts.routing_free:
            for _ in range(COLD_TRIES):  # each flagged run reads the cold experts its counts show
                logits = B.run_step(step, lambda: self._layers(step), static=True)
                if not experts.take_cold():
                    break
                # what the run derived (RoPE tables, inputs) is made again: a graph captured on a
                # second run would otherwise keep the first run's arrays
                step.memo.clear()
            else:
                logits = None
        elif not experts.cold_possible:  # nothing to block on: only the share to check
            if step.feed is not None and not (plain and experts.routing_free):
                raise RequestError("a step whose tokens are read on the host cannot take them from the device")
            logits = B.run_step(step, lambda: self._layers(step), static=plain and experts.routing_free)
            experts.take_cold()
        if logits is None:
            with experts.blocking():
                logits = B.run_step(step, lambda: self._layers(step))
        # the step is final: its counts are read now (not while it runs: a flagged run's are take_cold's,
        # and a CPU worker's Python would share the interpreter with promotion's)
        experts.launched()
        if step.samplers is not None:
            return (lambda: B.sample(logits, step, reuse=True)) if step.deferred else B.sample(logits, step)
        return B.to_host(logits)

    def _plain(self) -> bool:
        """No hook, trace or observer: only the experts (at their host points) touch the host while
        a step runs (backend.run_step)."""
        return self.step_hooks is None and self.trace is None and self.ffn_observer is None

    def _layers(self, step: Step):
        """The layers over the step's rows. -> logits [T, V] (the backend's array), or of each
        sequence's last row."""
        B, hp = self.backend, self.hp
        eps = hp.rms_eps
        hooks = self.step_hooks
        if hooks is not None:
            hooks.begin(step.tokens)
        replay = self.route_override
        routes = None  # the replayed ids of every MoE layer [L_moe, T, A], gathered on the device
        if replay is not None and self.moe_layers:
            routes = B.replay_routes(replay.table, step)
        x = B.embed(self.tok_embd, step.tokens, step)  # [T, D]
        h = B.rms_norm(x, self.layers[0].attn_norm, eps)  # each stage's input normed: [T, D]
        for stage, (kind, il, may_trim) in enumerate(self.plan):  # model/plan.py: each stage and its fusion group
            if kind == HEAD:
                if step.hidden:
                    return h  # [T, D], after the output norm
                if not step.all_logits and step.T != step.S:  # the last layer ran on every row
                    h, step = B.take_rows(h, step.last_rows()), step.outputs()
                return B.linear(h, self.output, step)  # [T, V]
            layer = self.layers[il]
            if kind == MIXER:
                if hooks is not None:
                    hooks.layer_input(il, x)
                a = layer.mixer.forward(self, il, h, step)
                if may_trim and not step.all_logits:  # as llama.cpp: the rest runs on output rows only
                    x, step = B.take_rows(B.add(x, a), step.last_rows()), step.outputs()
                    h = B.rms_norm(x, layer.ffn_norm, eps)
                else:
                    x, h = B.add_rms_norm(x, a, layer.ffn_norm, eps)
                continue
            # the FFN, the residual add and the next stage's input norm (the output norm before the head)
            nxt = self.plan.next_layer(stage)
            next_norm = self.layers[nxt].attn_norm if nxt >= 0 else self.output_norm
            if isinstance(layer.ffn, MoE):
                chosen = None
                if routes is not None:  # the last layer of a prefill has fewer rows: gathered again
                    if step.T != routes.shape[1]:
                        routes = B.replay_routes(replay.table, step)
                    chosen = routes[self.moe_layers.index(il)]
                f = moe_forward(layer.ffn, self.family, self.experts, h, B, step, self.trace, chosen)
            else:
                d = layer.ffn
                obs = self.ffn_observer
                f = dense_ffn(d.gate, d.up, d.down, h, B, step,
                              observe=None if obs is None else (lambda a, b, il=il: obs(il, a, b)))
            x, h = B.add_rms_norm(x, f, next_norm, eps)
