"""qwen3moe: per-head q/k RMSNorm, NEOX RoPE, softmax top-k renormalised."""

from .family import Family, register
from .hparams import read_hparams

FAMILY = register(Family(
    arch="qwen3moe",
    read_hparams=lambda g: read_hparams(g, "qwen3moe", neox=True),
    qk_norm="head",
    norm_topk=True,
))
