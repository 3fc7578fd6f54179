"""qwen2moe: q/k/v biases, NEOX RoPE, softmax top-k without renormalising, plus a shared expert
scaled by sigmoid(ffn_gate_inp_shexp · x)."""

from .family import Family, register
from .hparams import read_hparams

FAMILY = register(Family(
    arch="qwen2moe",
    read_hparams=lambda g: read_hparams(g, "qwen2moe", neox=True),
    norm_topk=False,
))
