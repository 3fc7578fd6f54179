"""qwen3next (Qwen3-Next, Qwen3-Coder-Next) and qwen35moe (Qwen3.5 MoE): hybrids of Gated
DeltaNet layers and gated full-attention layers (every `full_attention_interval`-th), each with
routed experts plus a shared expert behind a sigmoid gate (docs/qwen3next.md).

Attention layers: per-head q/k RMSNorm, partial NEOX RoPE (qwen35moe's IMRoPE is NEOX on text:
every section holds the same position), and an output gate carried by the q projection. The
FFN norm is `post_attention_norm`. qwen35moe differs only in its delta-net b/a projections (two
matrices instead of one grouped by key head) and in pairing value head h with key head h % Hk.
"""

import numpy as np

from ..errors import GGUFError, UnsupportedError
from ..storage.gguf import GGUFFile
from .attention import Attention
from .deltanet import GatedDeltaNet
from .family import Family, register
from .hparams import HParams, block_count, read_hparams, read_ssm
from .layers import Layer, load_ffn


def _hparams(arch: str, tiled: bool):
    def read(g: GGUFFile) -> HParams:
        # multi-token-prediction blocks come after the trunk; the main pass does not run them
        n_mtp = g.get(f"{arch}.nextn_predict_layers", int, 0)
        n_layer = block_count(g, arch) - n_mtp
        if n_mtp < 0 or n_layer <= 0:
            raise GGUFError(f"metadata {arch}.nextn_predict_layers = {n_mtp} must be in 0..{arch}.block_count - 1")
        ssm, recurrent = read_ssm(g, arch, n_layer, tiled=tiled)
        hp = read_hparams(g, arch, neox=True, ssm=ssm, recurrent=recurrent, n_layer=n_layer,
                          swa_layers=(False,) * n_layer)
        if hp.n_expert <= 0:
            raise GGUFError(f"metadata {arch}.expert_count must be positive: {arch} has routed experts in every layer")
        if arch == "qwen35moe":
            _check_imrope(g, arch, hp.rope.n_dims)
        return hp
    return read


def _check_imrope(g: GGUFFile, arch: str, n_rot: int) -> None:
    """qwen35moe's IMRoPE on text gives the t, h and w sections the token's position and the e
    section position 0 (llama.cpp's llm_graph_input_pos): it is NEOX, which moed runs, when
    every rotated pair falls in t, h or w (the converter's [11, 11, 10, 0]); refuse the others."""
    key = f"{arch}.rope.dimension_sections"
    sec = [int(v) for v in g.get(key, np.ndarray).reshape(-1)]
    if len(sec) < 4 or min(sec) < 0 or not any(sec[:3]):
        raise GGUFError(f"metadata {key} = {sec} must hold 4 non-negative sections, the first three not all 0")
    total = sum(sec[:4])
    for i in range(n_rot // 2):
        s = i % total
        if not (s % 3 == 0 and s < 3 * sec[0] or s % 3 == 1 and s < 3 * sec[1] or s % 3 == 2 and s < 3 * sec[2]):
            raise UnsupportedError(f"metadata {key} = {sec[:4]}: rotated pair {i} of {n_rot // 2} falls outside the "
                                   "t/h/w sections (text positions rotate only those); moed supports sections "
                                   "that cover every pair, such as [11, 11, 10, 0]")


def _layer(src, hp, family, il: int) -> Layer:
    p, D = f"blk.{il}.", hp.n_embd
    mixer = (GatedDeltaNet.load(src, hp, il) if hp.is_recurrent(il)
             else Attention.load(src, hp, family, il, gated=True))
    return Layer(attn_norm=src.vector(p + "attn_norm.weight", D), mixer=mixer,
                 ffn_norm=src.vector(p + "post_attention_norm.weight", D), ffn=load_ffn(src, hp, family, il))


for _arch, _tiled in (("qwen3next", False), ("qwen35moe", True)):
    register(Family(
        arch=_arch,
        read_hparams=_hparams(_arch, _tiled),
        qk_norm="head",
        norm_topk=True,
        ffn_norm="post_attention_norm",
        shexp_gate="sigmoid",
        build_layer=_layer,
        last_layer_all_rows=True,
    ))
