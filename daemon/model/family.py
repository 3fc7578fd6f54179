"""What distinguishes one architecture family from another, as data.

Each family file (llama.py, qwen3moe.py, ...) declares one Family; the shared transformer code
reads it. Adding a family means writing its hyper-parameter reader and its Family record.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from ..storage.gguf import GGUFFile
from .hparams import HParams


@dataclass(frozen=True)
class Family:
    arch: str  # general.architecture
    read_hparams: Callable[[GGUFFile], HParams]
    qk_norm: str | None = None  # "head": RMSNorm per head (qwen3); "full": over the whole projection (olmoe)
    gating: str = "softmax"  # "softmax": softmax, then top-k; "softmax_weight": top-k logits, then softmax over k
    norm_topk: bool = False  # renormalise the k selected weights to sum to 1
    glu: str = "silu"  # "silu": silu(g) * u; "oai": gpt-oss clamped SwiGLU
    ffn_norm: str = "ffn_norm"  # tensor name of the norm before the FFN
    glu_alpha: float = 1.702
    glu_limit: float = 7.0
    shexp_gate: str = "silu_div"  # the shared expert's sigmoid gate: "silu_div" (qwen2moe) or "sigmoid"
    # the layer builder (layers.decoder_layer when None): (tensors, hparams, family, il) -> Layer
    build_layer: Callable | None = None
    # the last layer runs on every row and the rows whose logits are wanted are taken after the
    # output norm (qwen3next), not before the last FFN (llama.cpp's other graphs)
    last_layer_all_rows: bool = False


_REGISTRY: dict[str, Family] = {}


def register(family: Family) -> Family:
    _REGISTRY[family.arch] = family
    return family


def family_for(arch: str) -> Family:
    from ..errors import UnsupportedError
    from . import gptoss, llama, olmoe, qwen2moe, qwen3moe, qwen3next  # noqa: F401  (register themselves)

    try:
        return _REGISTRY[arch]
    except KeyError:
        raise UnsupportedError(
            f"architecture {arch!r} is not supported (supported: {', '.join(sorted(_REGISTRY))})") from None
