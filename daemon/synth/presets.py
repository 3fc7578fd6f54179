"""The real models `moed synth --like NAME` imitates: shapes, metadata, tensor names and types.

    PRESETS[name] -> Preset        published hyperparameters (the models' config.json) and quant mix
    plan(name, **overrides) -> Plan    every tensor (name, numpy shape, ggml type, init) and metadata key

Tensor names and metadata keys are the ones llama.cpp's loader reads (src/llama-arch.cpp,
src/models/<arch>.cpp), as in tests/fixtures/build.py. Types follow the published GGUFs:

    gpt-oss-20b / -120b   ggml-org's MXFP4 release (llama-quantize MXFP4_MOE): experts MXFP4, other
                          matrices Q8_0 (token_embd and output included); norms, biases, sinks, router F32
    qwen3-30b-a3b         Q4_K_M: llama.cpp's llama_tensor_get_type (src/llama-quant.cpp) mix, i.e. Q4_K
                          with Q6_K for output and for attn_v / ffn_down_exps in the layers
                          use_more_bits() picks; or Q8_0 for every matrix (`--type Q8_0`)
    mixtral-8x7b          Q4_K_M as above, plus its 8-expert rules: attn_k and attn_v Q8_0, attn_output Q5_K
    qwen3-next-80b,       Q4_K_M as llama_tensor_get_type (llama.cpp that llama-cpp-python 0.3.36 vendors) gives
    qwen3.5-35b-a3b       the hybrids; or Q8_0 for every matrix. Q4_K_M, read from llama-quant.cpp:
                          - attn_qkv (the delta net's q/k/v projection) is category ATTENTION_QKV, which
                            category_is_attn_v() counts with attn_v: the two share one counter (one per
                            layer, n_attention_wv = n_layer), so attn_qkv of a delta-net layer and attn_v of
                            an attention layer are Q6_K in the use_more_bits() layers, Q4_K elsewhere (the
                            QKV-specific Q5_K rule is never reached: the attn_v branch comes first)
                          - ffn_down_exps and ffn_down_shexp (both category FFN_DOWN, layer from the name,
                            n_layer = the block count): Q6_K in the use_more_bits() layers
                          - ssm_ba / ssm_beta / ssm_alpha, ssm_out, attn_gate (category OTHER), attn_q, attn_k,
                            attn_output, expert and shared-expert gate/up, token_embd: Q4_K; output: Q6_K
                          - not quantized: ssm_conv1d (excluded by name; llama.cpp's ssm_conv asserts F32),
                            ffn_gate_inp (the router), and every 1-D tensor or one without a ".weight" suffix
                            (norms, ssm_a, ssm_dt.bias, ffn_gate_inp_shexp): F32 as convert_hf_to_gguf writes
                            them (a published qwen3next Q4_K_M has F16 routers from an older converter; we
                            keep them F32 as for qwen3moe)
                          The q6_K/q4_K counts this gives match a published qwen3next Q4_K_M file of the older
                          ssm_in layout (55 Q6_K: output, 6 of its 12 attn_v, 48 ffn_down*).
                          Tensors are the current converter's (attn_qkv + attn_gate, not the legacy ssm_in);
                          the MTP block (mtp.* / nextn) is not written, as llama.cpp does not run it.

Overrides (`moed synth` options) change the depth (n_layer), the expert counts (n_expert,
n_expert_used) and, for small test files, the widths (n_embd, n_ff_exp, n_head; n_head_kv keeps
the model's head-to-kv-head ratio, head_dim stays). The per-layer type rules are applied to the
overridden depth, as llama-quantize would on that model. Hybrids (qwen3next, qwen35moe): the delta
net's key heads follow n_head (the models have as many linear key heads as query heads) and its value
heads keep their ratio to the key heads, its head size (ssm.state_size) stays, so inner_size /
time_step_rank == state_size and time_step_rank % group_count == 0 hold for any override; the shared
expert's width follows n_ff_exp (both are 512 in the real models).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ..errors import SynthError

# GGML types: name -> (block elements, block bytes)
BLOCK = {"F32": (1, 4), "Q8_0": (32, 34), "Q4_K": (256, 144), "Q5_K": (256, 176),
         "Q6_K": (256, 210), "MXFP4": (32, 17)}
FILE_TYPE = {"Q8_0": 7, "Q4_K_M": 15, "MXFP4": 38}  # general.file_type (llama_ftype)
HYBRID_ARCHS = ("qwen3next", "qwen35moe")  # Gated DeltaNet + gated attention + shared expert


@dataclasses.dataclass(frozen=True)
class Preset:
    arch: str  # general.architecture
    family: str  # tokenizer family (daemon.synth.vocab)
    types: tuple[str, ...]  # --type choices, the first is the default
    published_params: float  # total parameters of the real model
    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_ff_exp: int  # expert FFN width
    n_ff: int  # feed_forward_length (Mixtral: the expert width; others: metadata only)
    n_expert: int
    n_expert_used: int
    n_vocab: int
    n_ctx_train: int
    rope_freq_base: float
    rms_eps: float
    sliding_window: int = 0
    yarn: tuple[float, int] | None = None  # (factor, original context)
    # hybrids (qwen3next, qwen35moe); docs/qwen3next.md has the keys
    n_ff_shexp: int = 0  # shared expert FFN width
    rope_dim: int = 0  # rope.dimension_count (partial RoPE); 0: head_dim
    rope_sections: tuple[int, ...] = ()  # qwen35moe rope.dimension_sections
    ssm_conv_kernel: int = 0
    ssm_state_size: int = 0  # Dk = Dv
    ssm_group_count: int = 0  # key heads Hk
    ssm_time_step_rank: int = 0  # value heads Hv
    full_attention_interval: int = 0

    @property
    def hybrid(self) -> bool:
        return self.arch in HYBRID_ARCHS

    def is_recurrent(self, il: int) -> bool:
        """A Gated DeltaNet layer (llama.cpp load_arch_hparams: every interval-th layer is attention)."""
        return self.hybrid and (il + 1) % self.full_attention_interval != 0


PRESETS: dict[str, Preset] = {
    "gpt-oss-20b": Preset(
        "gpt-oss", "gpt-oss", ("MXFP4",), 20.91e9, n_layer=24, n_embd=2880, n_head=64, n_head_kv=8,
        head_dim=64, n_ff_exp=2880, n_ff=2880, n_expert=32, n_expert_used=4, n_vocab=201088,
        n_ctx_train=131072, rope_freq_base=150000.0, rms_eps=1e-5, sliding_window=128,
        yarn=(32.0, 4096)),
    "gpt-oss-120b": Preset(
        "gpt-oss", "gpt-oss", ("MXFP4",), 116.83e9, n_layer=36, n_embd=2880, n_head=64, n_head_kv=8,
        head_dim=64, n_ff_exp=2880, n_ff=2880, n_expert=128, n_expert_used=4, n_vocab=201088,
        n_ctx_train=131072, rope_freq_base=150000.0, rms_eps=1e-5, sliding_window=128,
        yarn=(32.0, 4096)),
    "qwen3-30b-a3b": Preset(
        "qwen3moe", "qwen", ("Q4_K_M", "Q8_0"), 30.53e9, n_layer=48, n_embd=2048, n_head=32,
        n_head_kv=4, head_dim=128, n_ff_exp=768, n_ff=6144, n_expert=128, n_expert_used=8,
        n_vocab=151936, n_ctx_train=40960, rope_freq_base=1e6, rms_eps=1e-6),
    "mixtral-8x7b": Preset(
        "llama", "mistral", ("Q4_K_M",), 46.70e9, n_layer=32, n_embd=4096, n_head=32, n_head_kv=8,
        head_dim=128, n_ff_exp=14336, n_ff=14336, n_expert=8, n_expert_used=2, n_vocab=32000,
        n_ctx_train=32768, rope_freq_base=1e6, rms_eps=1e-5),
    # Qwen/Qwen3-Next-80B-A3B-Instruct config.json (also Qwen3-Coder-Next): 80B total ("79B non-embedding"
    # on the model card; this plan: 79.67e9 without the MTP block). rope_theta 1e7 and
    # feed_forward_length 5120 as in published GGUFs' metadata.
    "qwen3-next-80b": Preset(
        "qwen3next", "qwen", ("Q4_K_M", "Q8_0"), 80e9, n_layer=48, n_embd=2048, n_head=16, n_head_kv=2,
        head_dim=256, n_ff_exp=512, n_ff=5120, n_expert=512, n_expert_used=10, n_vocab=151936,
        n_ctx_train=262144, rope_freq_base=1e7, rms_eps=1e-6, n_ff_shexp=512, rope_dim=64,
        ssm_conv_kernel=4, ssm_state_size=128, ssm_group_count=16, ssm_time_step_rank=32,
        full_attention_interval=4),
    # Qwen/Qwen3.5-35B-A3B, the smallest Qwen3.5 MoE (text tower: transformers' Qwen3_5MoeTextConfig
    # defaults, which are this checkpoint's, and published GGUFs' metadata: 40 layers of 2048, 16/2 heads of
    # 256, partial rotary 0.25 with mrope_section [11, 11, 10], rope_theta 1e7, 256 experts top 8 + shared,
    # 512 wide, linear 16 key / 32 value heads of 128, vocabulary 248320, context 262144). 35B total as
    # announced (with the vision tower and MTP block); this plan, the language model alone: 34.66e9.
    "qwen3.5-35b-a3b": Preset(
        "qwen35moe", "qwen35", ("Q4_K_M", "Q8_0"), 35e9, n_layer=40, n_embd=2048, n_head=16, n_head_kv=2,
        head_dim=256, n_ff_exp=512, n_ff=0, n_expert=256, n_expert_used=8, n_vocab=248320,
        n_ctx_train=262144, rope_freq_base=1e7, rms_eps=1e-6, n_ff_shexp=512, rope_dim=64,
        rope_sections=(11, 11, 10, 0), ssm_conv_kernel=4, ssm_state_size=128, ssm_group_count=16,
        ssm_time_step_rank=32, full_attention_interval=4),
}

OVERRIDABLE = ("n_layer", "n_expert", "n_expert_used", "n_embd", "n_ff_exp", "n_head")


@dataclasses.dataclass(frozen=True)
class Tensor:
    name: str
    shape: tuple[int, ...]  # numpy order: the last axis is ggml's ne[0] (the row)
    type: str
    init: str  # "weight" (std = gain / sqrt(row)), "norm" (1 + jitter), "bias", "sink", "dt", "ssm_a" (writer.py)
    gain: float = 1.0

    @property
    def n_elements(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def nbytes(self) -> int:
        elems, size = BLOCK[self.type]
        return self.n_elements // elems * size


@dataclasses.dataclass(frozen=True)
class Plan:
    name: str  # preset
    type: str  # quant mix (--type)
    preset: Preset  # with the overrides applied
    tensors: list[Tensor]

    @property
    def n_params(self) -> int:
        return sum(t.n_elements for t in self.tensors)

    @property
    def data_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)


def plan(name: str, type: str | None = None, **overrides: Any) -> Plan:
    """The tensors and hyperparameters of preset `name` with quant mix `type` and overrides."""
    if name not in PRESETS:
        raise SynthError(f"unknown model {name!r} for --like; choose one of: {', '.join(PRESETS)}")
    base = PRESETS[name]
    qtype = type or base.types[0]
    if qtype not in base.types:
        raise SynthError(f"--type {qtype} is not available for {name}; choose one of: {', '.join(base.types)}")
    p = _apply(base, {k: v for k, v in overrides.items() if v is not None})
    tensors = _tensors(p, qtype)
    for t in tensors:
        elems = BLOCK[t.type][0]
        if t.shape[-1] % elems:
            raise SynthError(f"{t.name}: rows of {t.shape[-1]} are not a multiple of {elems} ({t.type}); "
                             "choose other widths")
    return Plan(name, qtype, p, tensors)


def _apply(p: Preset, ov: dict[str, Any]) -> Preset:
    bad = set(ov) - set(OVERRIDABLE)
    if bad:
        raise SynthError(f"cannot override {sorted(bad)}")
    for k, v in ov.items():
        if not isinstance(v, int) or v < 1:
            raise SynthError(f"{k} must be a positive integer, got {v!r}")
    if "n_head" in ov:
        ov["n_head_kv"] = max(1, ov["n_head"] * p.n_head_kv // p.n_head)
        if p.hybrid:  # delta-net key heads follow the query heads, value heads keep their ratio
            groups = max(1, ov["n_head"] * p.ssm_group_count // p.n_head)
            ov["ssm_group_count"] = groups
            ov["ssm_time_step_rank"] = groups * (p.ssm_time_step_rank // p.ssm_group_count)
    if "n_ff_exp" in ov and p.arch == "llama":
        ov["n_ff"] = ov["n_ff_exp"]  # Mixtral's experts read feed_forward_length
    if "n_ff_exp" in ov and p.hybrid:
        ov["n_ff_shexp"] = max(1, ov["n_ff_exp"] * p.n_ff_shexp // p.n_ff_exp)
    p = dataclasses.replace(p, **ov)
    if p.n_expert_used > p.n_expert:
        raise SynthError(f"--used {p.n_expert_used} exceeds --experts {p.n_expert}")
    if p.n_head % p.n_head_kv:
        raise SynthError("the head count must be a multiple of the kv head count")
    if p.arch == "llama" and p.n_head * p.head_dim != p.n_embd:
        raise SynthError(f"{p.arch} needs heads * {p.head_dim} == hidden size")
    if p.hybrid and p.n_layer < p.full_attention_interval:
        # no full-attention layer: llama.cpp aborts allocating the empty KV cache (GGML_ASSERT(buffer))
        raise SynthError(f"{p.arch} needs at least {p.full_attention_interval} layers (every "
                         f"{p.full_attention_interval}th is full attention; llama.cpp cannot run a file without one)")
    return p


def use_more_bits(i_layer: int, n_layer: int) -> bool:
    """llama-quant.cpp: the layers Q4_K_M gives more bits (the first and last eighth, every third)."""
    return i_layer < n_layer // 8 or i_layer >= 7 * n_layer // 8 or (i_layer - n_layer // 8) % 3 == 2


def _matrix_type(p: Preset, qtype: str, role: str, layer: int) -> str:
    if qtype in ("Q8_0", "MXFP4"):
        return "MXFP4" if qtype == "MXFP4" and role.endswith("_exps") else "Q8_0"
    # Q4_K_M (llama_tensor_get_type). attn_qkv is attn_v-like (category_is_attn_v); the hybrids have one
    # attn_v-like tensor per layer (attn_qkv or attn_v), so the attn_v counter is the layer index.
    eight = p.n_expert == 8
    v_like = role in ("attn_v", "attn_qkv")
    if role == "output":
        return "Q6_K"
    if (role == "attn_k" or v_like) and eight:
        return "Q8_0"
    if v_like and use_more_bits(layer, p.n_layer):
        return "Q6_K"
    if role == "attn_output" and eight:
        return "Q5_K"
    if role in ("ffn_down_exps", "ffn_down_shexp") and use_more_bits(layer, p.n_layer):
        return "Q6_K"
    return "Q4_K"


# weight gains (std relative to 1/sqrt(row)), as the test fixtures: clear top-1 logits, a router
# that spreads tokens over the experts, gpt-oss activations large enough for its +-7 clamp
OUTPUT_GAIN, ROUTER_GAIN, GPT_OSS_ACT_GAIN = 3.0, 2.0, 3.0
# Token embeddings of rms 8 keep each token's own direction dominant in the residual stream over the
# ~O(1) per-layer updates (random attention averages over positions, so its output is alike for all
# tokens): the random routers then spread tokens over the experts nearly uniformly, through all
# layers (the worst case for an expert cache). With rms 1, qwen3-30b-a3b's deep layers sent 64
# tokens to as few as 22 of 128 experts.
EMBD_RMS = 8.0


def _tensors(p: Preset, qtype: str) -> list[Tensor]:
    D, V, E, F = p.n_embd, p.n_vocab, p.n_expert, p.n_ff_exp
    q_dim, kv_dim = p.n_head * p.head_dim, p.n_head_kv * p.head_dim
    gpt_oss = p.arch == "gpt-oss"
    out = [
        Tensor("token_embd.weight", (V, D), _matrix_type(p, qtype, "token_embd", 0), "weight", EMBD_RMS * D ** 0.5),
        Tensor("output_norm.weight", (D,), "F32", "norm"),
        Tensor("output.weight", (V, D), _matrix_type(p, qtype, "output", 0), "weight", OUTPUT_GAIN),
    ]
    act = GPT_OSS_ACT_GAIN if gpt_oss else 1.0
    for i in range(p.n_layer):
        b = f"blk.{i}."

        def mat(role: str, shape: tuple[int, ...], gain: float = 1.0) -> Tensor:
            return Tensor(f"{b}{role}.weight", shape, _matrix_type(p, qtype, role, i), "weight", gain)

        def vec(role: str, shape: tuple[int, ...], init: str) -> Tensor:
            return Tensor(f"{b}{role}", shape, "F32", init)

        if p.hybrid:
            out += _hybrid_layer(p, i, mat, vec)
            continue
        layer = [vec("attn_norm.weight", (D,), "norm"), mat("attn_q", (q_dim, D)),
                 mat("attn_k", (kv_dim, D)), mat("attn_v", (kv_dim, D)), mat("attn_output", (D, q_dim))]
        if gpt_oss:
            layer += [vec("attn_q.bias", (q_dim,), "bias"), vec("attn_k.bias", (kv_dim,), "bias"),
                      vec("attn_v.bias", (kv_dim,), "bias"), vec("attn_output.bias", (D,), "bias"),
                      vec("attn_sinks.weight", (p.n_head,), "sink"),
                      vec("post_attention_norm.weight", (D,), "norm")]
        else:
            layer.append(vec("ffn_norm.weight", (D,), "norm"))
        if p.arch == "qwen3moe":
            layer += [vec("attn_q_norm.weight", (p.head_dim,), "norm"),
                      vec("attn_k_norm.weight", (p.head_dim,), "norm")]
        layer += [Tensor(f"{b}ffn_gate_inp.weight", (E, D), "F32", "weight", ROUTER_GAIN),
                  mat("ffn_gate_exps", (E, F, D), act), mat("ffn_up_exps", (E, F, D), act),
                  mat("ffn_down_exps", (E, D, F), 1.0 / act)]
        if gpt_oss:
            layer += [vec("ffn_gate_inp.bias", (E,), "bias"), vec("ffn_gate_exps.bias", (E, F), "bias"),
                      vec("ffn_up_exps.bias", (E, F), "bias"), vec("ffn_down_exps.bias", (E, D), "bias")]
        out += layer
    return out


def _hybrid_layer(p: Preset, i: int, mat, vec) -> list[Tensor]:
    """One qwen3next / qwen35moe layer, as convert_hf_to_gguf writes it (docs/qwen3next.md): a Gated
    DeltaNet or a gated full-attention mixer, then routed experts plus a sigmoid-gated shared expert."""
    D, E, F, S = p.n_embd, p.n_expert, p.n_ff_exp, p.n_ff_shexp
    layer = [vec("attn_norm.weight", (D,), "norm")]
    if p.is_recurrent(i):
        Dk, Hk, Hv, Kc = p.ssm_state_size, p.ssm_group_count, p.ssm_time_step_rank, p.ssm_conv_kernel
        Vd = Hv * Dk
        C = 2 * Hk * Dk + Vd  # conv channels: q, k, v
        layer += [mat("attn_qkv", (C, D)), mat("attn_gate", (Vd, D))]
        if p.arch == "qwen3next":
            layer.append(mat("ssm_ba", (2 * Hv, D)))  # per key head: b of its value heads, then a
        else:
            layer += [mat("ssm_beta", (Hv, D)), mat("ssm_alpha", (Hv, D))]
        layer += [Tensor(f"blk.{i}.ssm_conv1d.weight", (C, Kc), "F32", "weight"),  # std 1/sqrt(Kc), as HF init
                  vec("ssm_dt.bias", (Hv,), "dt"), vec("ssm_a", (Hv,), "ssm_a"),
                  vec("ssm_norm.weight", (Dk,), "norm"), mat("ssm_out", (D, Vd))]
    else:
        q_dim, kv_dim = p.n_head * p.head_dim, p.n_head_kv * p.head_dim
        layer += [mat("attn_q", (2 * q_dim, D)),  # query and output gate, interleaved per head
                  mat("attn_k", (kv_dim, D)), mat("attn_v", (kv_dim, D)), mat("attn_output", (D, q_dim)),
                  vec("attn_q_norm.weight", (p.head_dim,), "norm"), vec("attn_k_norm.weight", (p.head_dim,), "norm")]
    layer += [vec("post_attention_norm.weight", (D,), "norm"),
              Tensor(f"blk.{i}.ffn_gate_inp.weight", (E, D), "F32", "weight", ROUTER_GAIN),
              mat("ffn_gate_exps", (E, F, D)), mat("ffn_up_exps", (E, F, D)), mat("ffn_down_exps", (E, D, F)),
              vec("ffn_gate_inp_shexp.weight", (D,), "weight"),  # one logit per token: sigmoid gate
              mat("ffn_gate_shexp", (S, D)), mat("ffn_up_shexp", (S, D)), mat("ffn_down_shexp", (D, S))]
    return layer


def metadata(pl: Plan) -> list[tuple[str, str, Any]]:
    """(key, kind, value) of the architecture keys; kind is "u32", "f32", "str" or "i32s" (an array)."""
    p, a = pl.preset, pl.preset.arch
    kv: list[tuple[str, str, Any]] = [
        (f"{a}.context_length", "u32", p.n_ctx_train),
        (f"{a}.embedding_length", "u32", p.n_embd),
        (f"{a}.block_count", "u32", p.n_layer),
    ]
    if p.n_ff:  # qwen35moe has no dense FFN width (its converter writes none)
        kv.append((f"{a}.feed_forward_length", "u32", p.n_ff))
    kv += [
        (f"{a}.attention.head_count", "u32", p.n_head),
        (f"{a}.attention.head_count_kv", "u32", p.n_head_kv),
        (f"{a}.attention.layer_norm_rms_epsilon", "f32", p.rms_eps),
        (f"{a}.rope.freq_base", "f32", p.rope_freq_base),
        (f"{a}.rope.dimension_count", "u32", p.rope_dim or p.head_dim),
        (f"{a}.expert_count", "u32", p.n_expert),
        (f"{a}.expert_used_count", "u32", p.n_expert_used),
        (f"{a}.vocab_size", "u32", p.n_vocab),
    ]
    if p.head_dim * p.n_head != p.n_embd:
        kv += [(f"{a}.attention.key_length", "u32", p.head_dim),
               (f"{a}.attention.value_length", "u32", p.head_dim)]
    if a != "llama":
        kv.append((f"{a}.expert_feed_forward_length", "u32", p.n_ff_exp))
    if p.hybrid:
        kv += [(f"{a}.expert_shared_feed_forward_length", "u32", p.n_ff_shexp),
               (f"{a}.ssm.conv_kernel", "u32", p.ssm_conv_kernel),
               (f"{a}.ssm.state_size", "u32", p.ssm_state_size),
               (f"{a}.ssm.group_count", "u32", p.ssm_group_count),
               (f"{a}.ssm.time_step_rank", "u32", p.ssm_time_step_rank),
               (f"{a}.ssm.inner_size", "u32", p.ssm_time_step_rank * p.ssm_state_size),
               (f"{a}.full_attention_interval", "u32", p.full_attention_interval)]
    if p.rope_sections:
        kv.append((f"{a}.rope.dimension_sections", "i32s", list(p.rope_sections)))
    if p.sliding_window:
        kv.append((f"{a}.attention.sliding_window", "u32", p.sliding_window))
    if p.yarn:
        kv += [(f"{a}.rope.scaling.type", "str", "yarn"), (f"{a}.rope.scaling.factor", "f32", p.yarn[0]),
               (f"{a}.rope.scaling.original_context_length", "u32", p.yarn[1])]
    return kv
