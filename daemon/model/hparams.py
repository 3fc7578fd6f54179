"""Hyper-parameters read from GGUF metadata, shared by every family.

Keys are `{arch}.<name>` as llama.cpp names them. A key the model needs that is missing or has the
wrong type raises GGUFError naming it (GGUFFile.get does the checking).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from ..errors import GGUFError, UnsupportedError
from ..kernels.ops import yarn_corr_dims
from ..storage.gguf import GGUFFile


@dataclass(frozen=True)
class Rope:
    n_dims: int
    freq_base: float
    neox: bool  # NEOX rotates halves; NORM rotates adjacent pairs
    freq_scale: float = 1.0
    ext_factor: float = 0.0
    attn_factor: float = 1.0
    corr_dims: tuple[float, float] = (0.0, 0.0)


@dataclass(frozen=True)
class HParams:
    arch: str
    n_vocab: int
    n_embd: int  # D
    n_layer: int
    n_head: int  # H
    n_head_kv: int  # Hkv
    head_dim: int  # Dh (keys and queries)
    head_dim_v: int  # Dv
    n_ctx_train: int
    rms_eps: float
    rope: Rope
    n_ff: int = 0  # dense FFN size
    n_expert: int = 0  # E
    n_expert_used: int = 0  # A
    n_ff_exp: int = 0  # per-expert FFN size
    n_ff_shexp: int = 0  # shared expert FFN size
    expert_weights_scale: float = 0.0  # 0 = not applied
    sliding_window: int = 0
    swa_layers: tuple[bool, ...] = field(default_factory=tuple)

    @property
    def is_moe(self) -> bool:
        return self.n_expert > 0


def read_hparams(g: GGUFFile, arch: str, *, neox: bool, **extra) -> HParams:
    """The hyper-parameters common to the supported families; `extra` overrides per family."""
    def key(name: str) -> str:
        return f"{arch}.{name}"

    def get(name: str, kind=int, default=...):
        return g.get(key(name), kind) if default is ... else g.get(key(name), kind, default)

    n_embd = get("embedding_length")
    n_head = get("attention.head_count")
    n_head_kv = _uniform(g, key("attention.head_count_kv"), n_head)
    n_layer = get("block_count")
    head_dim = get("attention.key_length", int, n_embd // n_head if n_head else 0)
    head_dim_v = get("attention.value_length", int, head_dim)
    n_vocab = _n_vocab(g, arch)
    for name, value in (("embedding_length", n_embd), ("attention.head_count", n_head),
                        ("block_count", n_layer), ("attention.key_length", head_dim)):
        if value <= 0:
            raise GGUFError(f"metadata {key(name)} must be positive, got {value}")
    if n_head_kv <= 0 or n_head % n_head_kv:
        raise GGUFError(f"metadata {key('attention.head_count_kv')}={n_head_kv} must divide head_count={n_head}")
    rope = _read_rope(g, arch, head_dim, neox)
    n_expert = get("expert_count", int, 0)
    n_expert_used = get("expert_used_count", int, 0)
    if n_expert and not 0 < n_expert_used <= n_expert:
        raise GGUFError(f"metadata {key('expert_used_count')}={n_expert_used} must be in 1..{n_expert}")
    hp = dict(
        arch=arch, n_vocab=n_vocab, n_embd=n_embd, n_layer=n_layer, n_head=n_head, n_head_kv=n_head_kv,
        head_dim=head_dim, head_dim_v=head_dim_v, n_ctx_train=get("context_length", int, 4096),
        rms_eps=float(get("attention.layer_norm_rms_epsilon", float, 1e-5)), rope=rope,
        n_ff=_uniform(g, key("feed_forward_length"), 0), n_expert=n_expert, n_expert_used=n_expert_used,
        n_ff_exp=get("expert_feed_forward_length", int, 0),
        n_ff_shexp=get("expert_shared_feed_forward_length", int, 0),
        expert_weights_scale=float(get("expert_weights_scale", float, 0.0)),
        sliding_window=get("attention.sliding_window", int, 0),
        swa_layers=(False,) * n_layer,
    )
    hp.update(extra)
    return HParams(**hp)


def _uniform(g: GGUFFile, name: str, default: int) -> int:
    """An int that some files store per layer as an array; moed needs it uniform."""
    value = g.get(name, (int, np.ndarray), default)
    if isinstance(value, np.ndarray):
        if value.size == 0 or not (value == value.flat[0]).all():
            raise UnsupportedError(f"metadata {name}: per-layer values {value.tolist()[:8]}... are not supported")
        value = int(value.flat[0])
    return int(value)


def _n_vocab(g: GGUFFile, arch: str) -> int:
    n = g.get(f"{arch}.vocab_size", int, 0)
    if not n:
        n = g.tensor_info("token_embd.weight").ne[1]
    return n


def _read_rope(g: GGUFFile, arch: str, head_dim: int, neox: bool) -> Rope:
    n_dims = g.get(f"{arch}.rope.dimension_count", int, head_dim)
    if not 0 < n_dims <= head_dim or n_dims % 2:
        raise GGUFError(f"metadata {arch}.rope.dimension_count={n_dims} must be even and in 1..{head_dim}")
    base = float(g.get(f"{arch}.rope.freq_base", float, 10000.0))
    kind = g.get(f"{arch}.rope.scaling.type", str, "none")
    factor = float(g.get(f"{arch}.rope.scaling.factor", float, 0.0))
    freq_scale = 1.0 / factor if factor > 0 else 1.0
    if kind in ("none", "") or freq_scale == 1.0 and kind != "yarn":
        return Rope(n_dims, base, neox)
    if kind == "linear":
        return Rope(n_dims, base, neox, freq_scale=freq_scale)
    if kind != "yarn":
        raise UnsupportedError(f"rope scaling type {kind!r} is not supported")
    n_ctx_orig = g.get(f"{arch}.rope.scaling.original_context_length", int, 0) or g.get(f"{arch}.context_length", int)
    # As llama.cpp: betas fixed at 32 / 1, ext_factor 1, and an attn_factor that cancels
    # rope_yarn's own mscale correction up to float32 rounding.
    beta_fast, beta_slow, ext_factor = 32.0, 1.0, 1.0
    f32 = np.float32
    mscale = f32(1.0) if factor <= 1 else f32(f32(0.1) * f32(math.log(f32(factor))) + f32(1.0))
    attn_factor = float(f32(mscale * f32(f32(1.0) / f32(f32(1.0) + f32(0.1) * f32(math.log(f32(factor))))))
                        * f32(g.get(f"{arch}.rope.scaling.attn_factor", float, 1.0)))
    corr = yarn_corr_dims(n_dims, n_ctx_orig, base, beta_fast, beta_slow)
    return Rope(n_dims, base, neox, freq_scale, ext_factor, attn_factor, corr)
