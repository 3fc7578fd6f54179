"""How exactly moed reproduces llama.cpp: per architecture and weight type, on the test fixtures
(random weights, 64 random tokens), and on the real SmolLM2 and the demo MoE.

    python benchmarks/exactness.py [--tokens 64]

Prints, per file: positions whose logits are bit-identical to llama.cpp's, the relative error
||ours - ref|| / ||ref||, and top-1 agreement. Needs the test extra (llama-cpp-python).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from daemon import Engine  # noqa: E402
from tests.fixtures.build import WTYPES, fixture_path  # noqa: E402
from tests.fixtures.reference import reference_logits  # noqa: E402

CASES = [(a, t) for a in ("llama", "llama-moe", "qwen3moe", "qwen2moe", "olmoe", "gpt-oss")
         for t in WTYPES if t != "MXFP4"] + [("gpt-oss", "MXFP4")]
TEXT = ("The history of the printing press begins in the fifteenth century, when Johannes Gutenberg "
        "combined movable metal type with an oil-based ink and a wooden press. Within decades, printers "
        "across Europe were producing books faster and more cheaply than ever before.")


def row(name: str, path, tokens) -> None:
    ref = reference_logits(path, tokens)
    with Engine.load(path) as e:
        ours = e.forward(tokens)
    exact = int((ours == ref).all(axis=1).sum())
    err = np.linalg.norm(ours - ref) / np.linalg.norm(ref)
    top1 = (ours.argmax(1) == ref.argmax(1)).mean()
    print(f"{name:<34} {exact:>4}/{len(tokens):<4} {err:>10.2e} {top1:>6.3f}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=64)
    args = ap.parse_args()
    print(f"{'model':<34} {'exact rows':>9} {'rel err':>10} {'top-1':>6}")
    cache = tempfile.mkdtemp(prefix="moed-fixtures-")
    tokens = np.random.default_rng(7).integers(0, 509, args.tokens).tolist()
    for arch, wtype in CASES:
        row(f"fixture {arch} {wtype}", fixture_path(arch, wtype, cache), tokens)
    from daemon.demo import cache_dir, find_source_model
    src = find_source_model()
    with Engine.load(src) as e:
        ids = e.tokenize(TEXT)[:args.tokens]
    row("SmolLM2-135M-Instruct Q4_1", src, ids)
    demo = cache_dir() / "smollm2-135m-moe-e16k12.gguf"
    if demo.exists():
        row("demo MoE E=16 k=12", demo, ids)


if __name__ == "__main__":
    main()
