"""The decoder every supported family shares: attention + (dense FFN | MoE), pre-norm residual.

Legend: T = tokens in the step, D = hidden size, H = query heads, Hkv = key/value heads,
Dh = head size, Dv = value head size, C = cached positions, V = vocabulary.

Numerics: in "ggml" mode the matmuls quantize activations like llama.cpp's CPU backend, and the
KV cache, the queries and the attention weights are rounded to f16 as its f16 KV cache and
f16 mul_mats do. In "float32" mode nothing is rounded beyond float32.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numba.typed import List

from ..errors import GGUFError, RequestError
from ..kernels import ops
from ..kernels.matmul import linear, linear_prepared, prepare
from ..kernels.quants import dequantize
from ..storage.experts import ExpertProvider, ResidentExperts
from ..storage.gguf import GGUFFile
from .family import Family, family_for
from .hparams import HParams
from .moe import MoE, SharedExpert, dense_ffn, moe_forward
from .weights import QWeight, TensorSource


@dataclass(frozen=True)
class Attention:
    norm: np.ndarray  # [D]
    wq: QWeight  # [H*Dh, D]
    wk: QWeight  # [Hkv*Dh, D]
    wv: QWeight  # [Hkv*Dv, D]
    wo: QWeight  # [D, H*Dv]
    bq: np.ndarray | None
    bk: np.ndarray | None
    bv: np.ndarray | None
    bo: np.ndarray | None
    q_norm: np.ndarray | None  # [Dh] per head, or [H*Dh] whole projection
    k_norm: np.ndarray | None
    sinks: np.ndarray | None  # [H]
    window: int  # 0 = full attention


@dataclass(frozen=True)
class _DecodeStep:
    """The KV caches of a decode step's sequences, one per row, as numba Lists for one attention
    call per layer: k[b] is sequence b's KVCache.k, [L, C_b, Hkv, Dh]."""
    k: List
    v: List


@dataclass(frozen=True)
class _PrefillStep:
    """Several sequences' prompts in one pass: rows groups[s]..groups[s+1] are appended to caches[s]."""
    caches: list[KVCache]
    groups: np.ndarray  # [S+1] row offsets


@dataclass(frozen=True)
class DenseFFN:
    gate: QWeight
    up: QWeight
    down: QWeight


@dataclass(frozen=True)
class Layer:
    attn: Attention
    ffn_norm: np.ndarray  # [D]
    ffn: DenseFFN | MoE


class KVCache:
    """One sequence's keys and values: k [L, C, Hkv, Dh], v [L, C, Hkv, Dv] f32 (L layers, C
    cells), grown on demand up to n_ctx. k[il] is layer il's cache."""

    def __init__(self, hp: HParams, n_ctx: int):
        self.n_ctx = n_ctx
        self.n_past = 0
        cap = min(n_ctx, 256)
        self.k = np.zeros((hp.n_layer, cap, hp.n_head_kv, hp.head_dim), np.float32)
        self.v = np.zeros((hp.n_layer, cap, hp.n_head_kv, hp.head_dim_v), np.float32)

    def reserve(self, n: int) -> None:
        if n > self.n_ctx:
            raise RequestError(f"context full: {n} positions requested, n_ctx is {self.n_ctx}")
        cap = self.k.shape[1]
        if n <= cap:
            return
        new = min(self.n_ctx, max(n, 2 * cap))
        for name in ("k", "v"):
            a = getattr(self, name)
            grown = np.zeros((a.shape[0], new, *a.shape[2:]), np.float32)
            grown[:, :cap] = a
            setattr(self, name, grown)


class Transformer:
    def __init__(self, gguf: GGUFFile, numerics: str = "ggml", experts: ExpertProvider | None = None):
        self.family: Family = family_for(gguf.architecture)
        self.hp: HParams = self.family.read_hparams(gguf)
        self.numerics = numerics
        src = TensorSource(gguf)
        hp = self.hp
        self.tok_embd = src.matrix("token_embd.weight", hp.n_embd, hp.n_vocab)
        self.output_norm = src.vector("output_norm.weight", hp.n_embd)
        self.output = (src.matrix("output.weight", hp.n_embd, hp.n_vocab) if src.has("output.weight")
                       else self.tok_embd)
        self.layers = [self._load_layer(src, il) for il in range(hp.n_layer)]
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
        # callable(layer, positions [T]) -> ids [T, A] replacing the router's top-k (MOE_ROUTING_REPLAY)
        self.route_override = None
        self.step_hooks = None  # .begin(tokens [T]) per forward pass, .layer_input(il, x [T, D]) per layer
        self.ffn_observer = None  # callable(layer, x [T, D], h [T, F]) observing dense FFN activations

    # -- loading ------------------------------------------------------------------------------

    def _load_layer(self, src: TensorSource, il: int) -> Layer:
        hp, fam, p = self.hp, self.family, f"blk.{il}."
        D, H, Hkv, Dh, Dv = hp.n_embd, hp.n_head, hp.n_head_kv, hp.head_dim, hp.head_dim_v
        qk_len = {"head": Dh, "full": None}.get(fam.qk_norm)
        attn = Attention(
            norm=src.vector(p + "attn_norm.weight", D),
            wq=src.matrix(p + "attn_q.weight", D, H * Dh),
            wk=src.matrix(p + "attn_k.weight", D, Hkv * Dh),
            wv=src.matrix(p + "attn_v.weight", D, Hkv * Dv),
            wo=src.matrix(p + "attn_output.weight", H * Dv, D),
            bq=src.optional_vector(p + "attn_q.bias", H * Dh),
            bk=src.optional_vector(p + "attn_k.bias", Hkv * Dh),
            bv=src.optional_vector(p + "attn_v.bias", Hkv * Dv),
            bo=src.optional_vector(p + "attn_output.bias", D),
            q_norm=src.vector(p + "attn_q_norm.weight", qk_len or H * Dh) if fam.qk_norm else None,
            k_norm=src.vector(p + "attn_k_norm.weight", qk_len or Hkv * Dh) if fam.qk_norm else None,
            sinks=src.optional_vector(p + "attn_sinks.weight", H),
            window=hp.sliding_window if hp.swa_layers and hp.swa_layers[il] else 0,
        )
        ffn_norm = src.vector(p + fam.ffn_norm + ".weight", D)
        if src.has(p + "ffn_gate_inp.weight"):
            F = hp.n_ff_exp or hp.n_ff
            shared = None
            if src.has(p + "ffn_gate_shexp.weight"):
                Fs = hp.n_ff_shexp or F
                shared = SharedExpert(
                    gate=src.matrix(p + "ffn_gate_shexp.weight", D, Fs),
                    up=src.matrix(p + "ffn_up_shexp.weight", D, Fs),
                    down=src.matrix(p + "ffn_down_shexp.weight", Fs, D),
                    gate_inp=(src.matrix(p + "ffn_gate_inp_shexp.weight", D, 1)
                              if src.has(p + "ffn_gate_inp_shexp.weight") else None))
            ffn = MoE(layer=il, router=src.matrix(p + "ffn_gate_inp.weight", D, hp.n_expert),
                      router_bias=src.optional_vector(p + "ffn_gate_inp.bias", hp.n_expert),
                      n_used=hp.n_expert_used, weights_scale=hp.expert_weights_scale, shared=shared)
        else:
            ffn = DenseFFN(gate=src.matrix(p + "ffn_gate.weight", D, hp.n_ff),
                           up=src.matrix(p + "ffn_up.weight", D, hp.n_ff),
                           down=src.matrix(p + "ffn_down.weight", hp.n_ff, D))
        return Layer(attn, ffn_norm, ffn)

    # -- running -------------------------------------------------------------------------------

    def new_cache(self, n_ctx: int) -> KVCache:
        return KVCache(self.hp, n_ctx)

    def forward(self, tokens, cache: KVCache, all_logits: bool = False) -> np.ndarray:
        """Append tokens to the sequence in `cache` and return logits: [T, V] if all_logits
        else [1, V] for the last token."""
        tokens = self._check_tokens(tokens)
        T, start = tokens.size, cache.n_past
        cache.reserve(start + T)
        positions = np.arange(start, start + T, dtype=np.int64)
        logits = self._run(tokens, positions, cache, all_logits, solo=False)
        cache.n_past = start + T
        return logits

    def forward_batch(self, tokens, caches: list[KVCache]) -> np.ndarray:
        """One decode step for B sequences: token b is appended to caches[b]. -> logits [B, V].

        Batch-invariant: row b is bit-identical to `forward([tokens[b]], caches[b])` alone, since
        every matmul computes each row as a one-row call (solo) and attention computes each
        sequence as a one-token call. The experts of the step are fetched once for all B."""
        tokens = self._check_tokens(tokens)
        if tokens.size != len(caches) or len({id(c) for c in caches}) != len(caches):
            raise RequestError(f"{tokens.size} tokens for {len(caches)} distinct sequences")
        for c in caches:
            c.reserve(c.n_past + 1)
        positions = np.array([c.n_past for c in caches], dtype=np.int64)
        step = _DecodeStep(List([c.k for c in caches]), List([c.v for c in caches]))
        logits = self._run(tokens, positions, step, True, solo=True)
        for c in caches:
            c.n_past += 1
        return logits

    def forward_many(self, prompts, caches: list[KVCache]) -> np.ndarray:
        """Prefill S sequences in one pass: prompts[s] is appended to caches[s]. -> logits [S, V]
        after each prompt's last token, bit-identical to `forward(prompts[s], caches[s])[-1]`: every
        matmul takes, per sequence, the path a call on that sequence's rows alone takes, and
        attention runs per sequence."""
        toks = [self._check_tokens(p) for p in prompts]
        if len(toks) != len(caches) or len({id(c) for c in caches}) != len(caches):
            raise RequestError(f"{len(toks)} prompts for {len(caches)} distinct sequences")
        for c, t in zip(caches, toks):
            c.reserve(c.n_past + t.size)
        groups = np.concatenate([[0], np.cumsum([t.size for t in toks])]).astype(np.int64)
        positions = np.concatenate([np.arange(c.n_past, c.n_past + t.size) for c, t in zip(caches, toks)])
        logits = self._run(np.concatenate(toks), positions, _PrefillStep(list(caches), groups), False, solo=False)
        for c, t in zip(caches, toks):
            c.n_past += t.size
        return logits

    def _check_tokens(self, tokens) -> np.ndarray:
        tokens = np.asarray(tokens, dtype=np.int64).reshape(-1)
        if tokens.size == 0:
            raise RequestError("no tokens to evaluate")
        if tokens.min() < 0 or tokens.max() >= self.hp.n_vocab:
            raise RequestError(f"token id out of range 0..{self.hp.n_vocab - 1}")
        return tokens

    def _run(self, tokens, positions, kv: KVCache | _DecodeStep | _PrefillStep, all_logits: bool,
             solo: bool) -> np.ndarray:
        """The layers over T rows: T tokens of one sequence (kv: its cache; the rows follow its
        n_past), one token of each of T sequences (kv: a _DecodeStep), or the prompts of several
        sequences (kv: a _PrefillStep). -> logits [T, V], or of each sequence's last row."""
        groups = kv.groups if isinstance(kv, _PrefillStep) else None
        hp = self.hp
        rope = hp.rope
        rope_tab = ops.rope_cache(positions, rope.n_dims, rope.freq_base, rope.freq_scale,
                                  rope.ext_factor, rope.attn_factor, rope.corr_dims)
        hooks = self.step_hooks
        if hooks is not None:
            hooks.begin(tokens)
        x = dequantize(self.tok_embd.raw[tokens], self.tok_embd.ggml_type, hp.n_embd)  # [T, D]
        for il, layer in enumerate(self.layers):
            if hooks is not None:
                hooks.layer_input(il, x)
            h = ops.rms_norm(x, layer.attn.norm, np.float32(hp.rms_eps))
            x = x + self._attention(il, layer.attn, h, kv, positions, rope_tab, solo, groups)
            if il == hp.n_layer - 1 and not all_logits:
                # as llama.cpp: the last FFN runs on output rows only, one per sequence
                out_rows = slice(-1, None) if groups is None else groups[1:] - 1
                x, positions = np.ascontiguousarray(x[out_rows]), positions[out_rows]
                solo, groups = groups is not None, None
            h = ops.rms_norm(x, layer.ffn_norm, np.float32(hp.rms_eps))
            if isinstance(layer.ffn, MoE):
                chosen = None if self.route_override is None else self.route_override(il, positions)
                x = x + moe_forward(layer.ffn, self.family, self.experts, h, self.numerics, self.trace, solo, groups,
                                    chosen)
            else:
                f = layer.ffn
                obs = self.ffn_observer
                x = x + dense_ffn(f.gate, f.up, f.down, h, self.numerics, solo=solo, groups=groups,
                                  observe=None if obs is None else (lambda a, b, il=il: obs(il, a, b)))
        x = ops.rms_norm(x, self.output_norm, np.float32(hp.rms_eps))
        return linear(x, self.output.raw, self.output.ggml_type, hp.n_embd, self.numerics, solo=solo, groups=groups)

    def _attention(self, il: int, a: Attention, x, kv, positions, rope_tab, solo: bool, groups) -> np.ndarray:
        hp, fam, num = self.hp, self.family, self.numerics
        T = x.shape[0]
        H, Hkv, Dh, Dv = hp.n_head, hp.n_head_kv, hp.head_dim, hp.head_dim_v
        rows = {"solo": solo, "groups": groups}
        if a.wq.ggml_type == a.wk.ggml_type == a.wv.ggml_type:
            xp = prepare(x, a.wq.ggml_type, num)
            q, k, v = (linear_prepared(xp, w.raw, w.ggml_type, w.n_in, **rows) for w in (a.wq, a.wk, a.wv))
        else:
            q, k, v = (linear(x, w.raw, w.ggml_type, w.n_in, num, **rows) for w in (a.wq, a.wk, a.wv))
        for t, b in ((q, a.bq), (k, a.bk), (v, a.bv)):
            if b is not None:
                t += b
        eps = np.float32(hp.rms_eps)
        if fam.qk_norm == "full":
            q = ops.rms_norm(q, a.q_norm, eps)
            k = ops.rms_norm(k, a.k_norm, eps)
        q = q.reshape(T, H, Dh)
        k = k.reshape(T, Hkv, Dh)
        v = v.reshape(T, Hkv, Dv)
        if fam.qk_norm == "head":
            q = ops.rms_norm_heads(q, a.q_norm, eps)
            k = ops.rms_norm_heads(k, a.k_norm, eps)
        q = ops.apply_rope(q, rope_tab, hp.rope.n_dims, hp.rope.neox)
        k = ops.apply_rope(k, rope_tab, hp.rope.n_dims, hp.rope.neox)
        ggml = num == "ggml"
        if ggml:  # f16 KV cache; q converted to f16 for the K·q product
            q, k, v = (np.ascontiguousarray(t) for t in (q, k, v))
            for t in (q, k, v):
                ops.to_f16_values(t)
        sinks = a.sinks if a.sinks is not None else np.empty(0, np.float32)
        scale = np.float32(1.0 / np.sqrt(Dh))
        if isinstance(kv, _DecodeStep):  # one new cell per sequence, all sequences in one call
            out = ops.attention_decode(q, k, v, kv.k, kv.v, il, positions, scale, a.window, sinks, ggml)
        else:  # each sequence's rows against its own cache
            seqs = zip(kv.caches, kv.groups[:-1], kv.groups[1:]) if isinstance(kv, _PrefillStep) else [(kv, 0, T)]
            out = np.empty((T, H, Dv), np.float32)
            for cache, r0, r1 in seqs:
                start, end = cache.n_past, cache.n_past + r1 - r0
                cache.k[il, start:end] = k[r0:r1]
                cache.v[il, start:end] = v[r0:r1]
                out[r0:r1] = ops.attention(q[r0:r1], cache.k[il, :end], cache.v[il, :end], positions[r0:r1], scale,
                                           a.window, sinks, ggml)
        y = linear(out.reshape(T, H * Dv), a.wo.raw, a.wo.ggml_type, a.wo.n_in, num, **rows)
        if a.bo is not None:
            y += a.bo
        return y
