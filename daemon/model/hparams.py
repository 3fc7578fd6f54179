"""Hyper-parameters read from GGUF metadata, shared by every family.

Keys are `{arch}.<name>` as llama.cpp names them. A key the model needs that is missing or has the
wrong type raises GGUFError naming it (GGUFFile.get does the checking), and so does a value the
file cannot back or the model cannot compute with: a block count beyond the blocks whose tensors
the file holds (checked before anything is sized by it), a negative count, a float that is not
finite as a float32 (the model computes in float32), or not positive where the model divides by
it or takes its log.
"""

from __future__ import annotations

import math
import re
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
class Ssm:
    """A Gated DeltaNet layer's dimensions (qwen3next, qwen35moe; docs/qwen3next.md)."""

    conv_kernel: int  # Kc (ssm.conv_kernel)
    n_k_head: int  # Hk (ssm.group_count)
    n_v_head: int  # Hv (ssm.time_step_rank)
    head_k: int  # Dk (ssm.state_size)
    head_v: int  # Dv (ssm.inner_size / time_step_rank; equal to Dk)
    tiled: bool  # value head h reads key head h % Hk (qwen35moe); else h // (Hv/Hk) (qwen3next)

    @property
    def conv_channels(self) -> int:
        """C: the convolved q, k and v channels, 2*Hk*Dk + Hv*Dv."""
        return 2 * self.n_k_head * self.head_k + self.n_v_head * self.head_v

    @property
    def v_dim(self) -> int:
        return self.n_v_head * self.head_v


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
    ssm: Ssm | None = None  # the Gated DeltaNet layers' dimensions (hybrid families)
    recurrent: tuple[bool, ...] = field(default_factory=tuple)  # per layer: a Gated DeltaNet layer

    @property
    def is_moe(self) -> bool:
        return self.n_expert > 0

    def is_recurrent(self, il: int) -> bool:
        return bool(self.recurrent) and self.recurrent[il]


def read_hparams(g: GGUFFile, arch: str, *, neox: bool, **extra) -> HParams:
    """The hyper-parameters common to the supported families; `extra` overrides per family."""
    def key(name: str) -> str:
        return f"{arch}.{name}"

    def get(name: str, kind=int, default=...):
        return g.get(key(name), kind) if default is ... else g.get(key(name), kind, default)

    n_embd = get("embedding_length")
    n_head = get("attention.head_count")
    n_head_kv = _uniform(g, key("attention.head_count_kv"), n_head)
    n_layer = block_count(g, arch)
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
    n_ctx_train = get("context_length", int, 4096)
    if n_ctx_train <= 0:
        raise GGUFError(f"metadata {key('context_length')} must be positive, got {n_ctx_train}")
    hp = dict(
        arch=arch, n_vocab=n_vocab, n_embd=n_embd, n_layer=n_layer, n_head=n_head, n_head_kv=n_head_kv,
        head_dim=head_dim, head_dim_v=head_dim_v, n_ctx_train=n_ctx_train,
        rms_eps=_float(g, key("attention.layer_norm_rms_epsilon"), 1e-5, positive=True), rope=rope,
        n_ff=_uniform(g, key("feed_forward_length"), 0), n_expert=n_expert, n_expert_used=n_expert_used,
        n_ff_exp=get("expert_feed_forward_length", int, 0),
        n_ff_shexp=get("expert_shared_feed_forward_length", int, 0),
        expert_weights_scale=_float(g, key("expert_weights_scale"), 0.0, at_least=0.0),
        sliding_window=get("attention.sliding_window", int, 0),
        swa_layers=(False,) * n_layer,
    )
    for name in ("n_vocab", "head_dim_v", "n_ff", "n_ff_exp", "n_ff_shexp", "sliding_window"):
        if hp[name] < 0:
            raise GGUFError(f"metadata of {arch}: {name} = {hp[name]} is negative")
    hp.update(extra)
    return HParams(**hp)


_BLOCK_TENSOR = re.compile(r"blk\.(0|[1-9]\d*)\.")  # the names the model loads: no leading zeros


def block_count(g: GGUFFile, arch: str) -> int:
    """`{arch}.block_count`, checked against the blocks the file has tensors for (blk.N.*) before
    anything is sized by it: every block 0..n-1 must have tensors."""
    name = f"{arch}.block_count"
    n = g.get(name, int)
    if n <= 0:
        raise GGUFError(f"metadata {name} must be positive, got {n}")
    blocks = {int(m.group(1)) for m in map(_BLOCK_TENSOR.match, g.tensors) if m}
    if n > len(blocks):
        raise GGUFError(f"metadata {name} = {n}, but the file has tensors for {len(blocks)} blocks")
    for i in range(n):  # n <= the number of tensors: cheap
        if i not in blocks:
            raise GGUFError(f"metadata {name} = {n}, but the file has no tensors for block {i} (blk.{i}.*)")
    return n


_F32_MAX = float(np.finfo(np.float32).max)


def _float(g: GGUFFile, name: str, default: float, *, positive: bool = False,
           at_least: float | None = None) -> float:
    """A float hyper-parameter, finite as a float32, and > 0 (positive) or >= at_least."""
    v = float(g.get(name, float, default))
    if not (math.isfinite(v) and abs(v) <= _F32_MAX):
        raise GGUFError(f"metadata {name} = {v} is not a finite float32")
    if positive and not np.float32(v) > 0:
        raise GGUFError(f"metadata {name} = {v} must be positive")
    if at_least is not None and v < at_least:
        raise GGUFError(f"metadata {name} = {v} must be at least {at_least}")
    return v


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
    base = _float(g, f"{arch}.rope.freq_base", 10000.0, positive=True)
    kind = g.get(f"{arch}.rope.scaling.type", str, "none")
    factor = _float(g, f"{arch}.rope.scaling.factor", 0.0, at_least=0.0)  # 0: none
    freq_scale = 1.0 / factor if factor > 0 else 1.0
    if factor > 0 and not (freq_scale <= _F32_MAX and np.float32(factor) > 0):
        raise GGUFError(f"metadata {arch}.rope.scaling.factor = {factor} is out of float32 range")
    if kind in ("none", "") or freq_scale == 1.0 and kind != "yarn":
        return Rope(n_dims, base, neox)
    if kind == "linear":
        return Rope(n_dims, base, neox, freq_scale=freq_scale)
    if kind != "yarn":
        raise UnsupportedError(f"rope scaling type {kind!r} is not supported")
    n_ctx_orig = g.get(f"{arch}.rope.scaling.original_context_length", int, 0) or g.get(f"{arch}.context_length", int)
    # YaRN takes the logs of the factor, of the base and of the original context
    if not factor > 0:
        raise GGUFError(f"metadata {arch}.rope.scaling.factor = {factor} must be positive for YaRN")
    if np.float32(base) == 1:
        raise GGUFError(f"metadata {arch}.rope.freq_base = {base} cannot be 1 with YaRN scaling")
    if n_ctx_orig <= 0:
        raise GGUFError(f"metadata {arch}.rope.scaling.original_context_length = {n_ctx_orig} must be positive")
    # As llama.cpp: betas fixed at 32 / 1, ext_factor 1, and an attn_factor that cancels
    # rope_yarn's own mscale correction up to float32 rounding.
    beta_fast, beta_slow, ext_factor = 32.0, 1.0, 1.0
    f32 = np.float32
    attn_scale = f32(_float(g, f"{arch}.rope.scaling.attn_factor", 1.0, positive=True))
    with np.errstate(all="ignore"):  # a result that is not finite is refused below
        mscale = f32(1.0) if factor <= 1 else f32(f32(0.1) * f32(math.log(f32(factor))) + f32(1.0))
        attn_factor = float(f32(mscale * f32(f32(1.0) / f32(f32(1.0) + f32(0.1) * f32(math.log(f32(factor))))))
                            * attn_scale)
        try:
            corr = yarn_corr_dims(n_dims, n_ctx_orig, base, beta_fast, beta_slow)
        except (OverflowError, ValueError):  # log of 0, or an infinite range
            corr = (math.nan, math.nan)
    if not (math.isfinite(attn_factor) and attn_factor > 0):
        raise GGUFError(f"metadata {arch}.rope.scaling.factor = {factor} gives a YaRN attention factor "
                        f"of {attn_factor}")
    if not all(math.isfinite(c) for c in corr):
        raise GGUFError(f"metadata {arch}.rope.freq_base = {base} and {arch}.rope.scaling.original_context_length = "
                        f"{n_ctx_orig} give no finite YaRN correction range")
    return Rope(n_dims, base, neox, freq_scale, ext_factor, attn_factor, corr)


def read_ssm(g: GGUFFile, arch: str, n_layer: int, *, tiled: bool) -> tuple[Ssm, tuple[bool, ...]]:
    """The Gated DeltaNet dimensions and which layers are recurrent (llama.cpp's
    load_arch_hparams of qwen3next / qwen35moe), checked for consistency: the graph needs
    inner_size = time_step_rank * state_size and value heads a multiple of key heads."""
    def key(name: str) -> str:
        return f"{arch}.{name}"

    dims = {name: g.get(key(name), int) for name in
            ("ssm.conv_kernel", "ssm.inner_size", "ssm.state_size", "ssm.time_step_rank", "ssm.group_count")}
    for name, value in dims.items():
        if value <= 0:
            raise GGUFError(f"metadata {key(name)} must be positive, got {value}")
    inner, state, rank, groups = (dims["ssm.inner_size"], dims["ssm.state_size"], dims["ssm.time_step_rank"],
                                  dims["ssm.group_count"])
    if inner % rank or inner // rank != state:
        raise GGUFError(f"metadata {key('ssm.state_size')} = {state} must equal {key('ssm.inner_size')} / "
                        f"{key('ssm.time_step_rank')} = {inner} / {rank} (the value head size)")
    if rank % groups:
        raise GGUFError(f"metadata {key('ssm.group_count')} = {groups} must divide {key('ssm.time_step_rank')} = "
                        f"{rank} (value heads share key heads)")
    ssm = Ssm(dims["ssm.conv_kernel"], groups, rank, state, inner // rank, tiled)
    layers = g.get(key("attention.recurrent_layers"), np.ndarray, None)
    if layers is not None:
        if layers.size < n_layer:
            raise GGUFError(f"metadata {key('attention.recurrent_layers')} has {layers.size} entries for "
                            f"{n_layer} layers")
        recurrent = tuple(bool(v) for v in layers.reshape(-1)[:n_layer])
    else:
        interval = g.get(key("full_attention_interval"), int, 4)
        if interval <= 0:
            raise GGUFError(f"metadata {key('full_attention_interval')} must be positive, got {interval}")
        recurrent = tuple((il + 1) % interval != 0 for il in range(n_layer))
    return ssm, recurrent
