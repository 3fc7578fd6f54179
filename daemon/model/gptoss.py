"""gpt-oss: attention sinks, sliding window on alternate layers, biases everywhere, YaRN RoPE
(NEOX), top-k on raw router logits then softmax over the k, clamped SwiGLU, MXFP4 experts."""

from ..storage.gguf import GGUFFile
from .family import Family, register
from .hparams import HParams, block_count, read_hparams


def _hparams(g: GGUFFile) -> HParams:
    n_layer = block_count(g, "gpt-oss")
    # llama.cpp's swa pattern 2: even layers use the sliding window, odd layers full attention.
    return read_hparams(g, "gpt-oss", neox=True, swa_layers=tuple(i % 2 == 0 for i in range(n_layer)))


FAMILY = register(Family(
    arch="gpt-oss",
    read_hparams=_hparams,
    gating="softmax_weight",
    glu="oai",
    ffn_norm="post_attention_norm",
))
