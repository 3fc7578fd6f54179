"""qwen3next (Qwen3-Next, Qwen3-Coder-Next) and qwen35moe (Qwen3.5 MoE): hybrids of Gated
DeltaNet layers and gated full-attention layers (every `full_attention_interval`-th), each with
routed experts plus a shared expert behind a sigmoid gate (docs/qwen3next.md).

Attention layers: per-head q/k RMSNorm, partial NEOX RoPE (qwen35moe's IMRoPE is NEOX on text:
every section holds the same position), and an output gate carried by the q projection. The
FFN norm is `post_attention_norm`. qwen35moe differs only in its delta-net b/a projections (two
matrices instead of one grouped by key head) and in pairing value head h with key head h % Hk.
"""

from ..errors import GGUFError
from ..storage.gguf import GGUFFile
from .attention import Attention
from .deltanet import GatedDeltaNet
from .family import Family, register
from .hparams import HParams, block_count, read_hparams, read_ssm
from .layers import Layer, load_ffn


def _hparams(arch: str, tiled: bool):
    def read(g: GGUFFile) -> HParams:
        n_layer = block_count(g, arch)
        ssm, recurrent = read_ssm(g, arch, n_layer, tiled=tiled)
        hp = read_hparams(g, arch, neox=True, ssm=ssm, recurrent=recurrent)
        if hp.n_expert <= 0:
            raise GGUFError(f"metadata {arch}.expert_count must be positive: {arch} has routed experts in every layer")
        return hp
    return read


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
