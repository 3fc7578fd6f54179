"""llama: dense, or Mixtral-style with experts (softmax, top-k, renormalise). NORM RoPE."""

from .family import Family, register
from .hparams import read_hparams

FAMILY = register(Family(
    arch="llama",
    read_hparams=lambda g: read_hparams(g, "llama", neox=False),
    norm_topk=True,
))
