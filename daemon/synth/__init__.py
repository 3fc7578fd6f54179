"""`moed synth OUT.gguf --like NAME`: full-size GGUF files with random but valid weights and the
exact shapes, metadata, tensor names and quant types of real MoE models, for benchmarks at scale.

    presets.py   the real models (PRESETS) and the tensor plan of each (plan, metadata)
    blocks.py    random quantized blocks with sane scales (no float quantization: fast)
    vocab.py     byte-level BPE vocabularies with each family's special tokens and chat template
    writer.py    synth(): check space, stream header + tensors to OUT.part, rename to OUT

Importing this package loads neither numpy nor gguf (the CLI lists PRESETS at start-up).
"""

from .presets import PRESETS, plan

__all__ = ["PRESETS", "plan", "synth"]


def synth(*args, **kwargs):
    """daemon.synth.writer.synth (imported on first use)."""
    from .writer import synth as write

    return write(*args, **kwargs)
