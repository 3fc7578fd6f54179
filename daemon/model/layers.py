"""A decoder layer as shared blocks, and the builders that assemble it from a file's tensors.

Every family's layer is `x += mixer(norm(x)); x += ffn(norm(x))`. The mixer is a block
(attention.Attention, deltanet.GatedDeltaNet) and the FFN a dense FFN or moe.MoE. The shared
decoder's builder (`decoder_layer`) gives every layer attention; a family whose layers differ
(qwen3next: Gated DeltaNet layers between gated attention layers) has its own builder, made of
the same blocks, as llama.cpp's src/models/*.cpp and mlx-lm's per-model files.

Legend: D = hidden size, F = FFN size, Fs = shared-expert FFN size, E = experts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from .attention import Attention
from .moe import MoE, SharedExpert
from .weights import QWeight


@dataclass(frozen=True)
class DenseFFN:
    gate: QWeight  # [F, D]
    up: QWeight  # [F, D]
    down: QWeight  # [D, F]


@dataclass(frozen=True)
class Layer:
    attn_norm: np.ndarray  # [D], before the mixer
    mixer: Any  # a block with .forward(model, il, x, step) -> [T, D]
    ffn_norm: np.ndarray  # [D], before the FFN
    ffn: DenseFFN | MoE


def load_ffn(src, hp, family, il: int) -> DenseFFN | MoE:
    """Layer il's FFN: routed experts (their router, scale and shared expert) or a dense FFN."""
    p, D = f"blk.{il}.", hp.n_embd
    if not src.has(p + "ffn_gate_inp.weight"):
        return DenseFFN(gate=src.matrix(p + "ffn_gate.weight", D, hp.n_ff),
                        up=src.matrix(p + "ffn_up.weight", D, hp.n_ff),
                        down=src.matrix(p + "ffn_down.weight", hp.n_ff, D))
    shared = None
    if src.has(p + "ffn_gate_shexp.weight"):
        Fs = hp.n_ff_shexp or hp.n_ff_exp or hp.n_ff
        shared = SharedExpert(
            gate=src.matrix(p + "ffn_gate_shexp.weight", D, Fs),
            up=src.matrix(p + "ffn_up_shexp.weight", D, Fs),
            down=src.matrix(p + "ffn_down_shexp.weight", Fs, D),
            gate_inp=(src.matrix(p + "ffn_gate_inp_shexp.weight", D, 1)
                      if src.has(p + "ffn_gate_inp_shexp.weight") else None),
            gate_kind=family.shexp_gate)
    return MoE(layer=il, router=src.matrix(p + "ffn_gate_inp.weight", D, hp.n_expert),
               router_bias=src.optional_vector(p + "ffn_gate_inp.bias", hp.n_expert),
               n_used=hp.n_expert_used, weights_scale=hp.expert_weights_scale, shared=shared)


def decoder_layer(src, hp, family, il: int) -> Layer:
    """The shared decoder's layer il: attention, then the FFN."""
    p, D = f"blk.{il}.", hp.n_embd
    return Layer(attn_norm=src.vector(p + "attn_norm.weight", D), mixer=Attention.load(src, hp, family, il),
                 ffn_norm=src.vector(p + family.ffn_norm + ".weight", D), ffn=load_ffn(src, hp, family, il))
