"""olmoe: q/k RMSNorm over the whole projection, NEOX RoPE, softmax top-k without renormalising."""

from .family import Family, register
from .hparams import read_hparams

FAMILY = register(Family(
    arch="olmoe",
    read_hparams=lambda g: read_hparams(g, "olmoe", neox=True),
    qk_norm="full",
    norm_topk=False,
))
