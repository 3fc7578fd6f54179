"""How close the demo MoE stays to the dense SmolLM2 it was made from, per number of experts used.

    python benchmarks/demo_quality.py [--experts 16] [--used 16 12 8] [--tokens 200]

Builds (or reuses, from the cache) the demo MoE for each k, then measures teacher-forced top-1
agreement with the dense model over text the dense model wrote itself: the fraction of positions
where both predict the same next token.
"""

from __future__ import annotations

import argparse

from daemon import Engine
from daemon.demo import demo_model_path, find_source_model

PROMPTS = ["Explain why the moon has phases.", "Write a short poem about the sea.",
           "What should I pack for a weekend hiking trip?"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--used", type=int, nargs="+", default=[16, 12, 8])
    ap.add_argument("--tokens", type=int, default=200)
    args = ap.parse_args()
    dense = Engine.load(find_source_model())
    ids: list[int] = []
    for p in PROMPTS:  # held-out prompts, not the calibration ones
        prompt = dense.tokenize(dense.apply_chat_template([{"role": "user", "content": p}]), add_special=False)
        reply = "".join(dense.generate(prompt, max_tokens=args.tokens // len(PROMPTS), temperature=0))
        ids += prompt + dense.tokenize(reply, add_special=False)
    ref = dense.forward(ids).argmax(1)
    print(f"{len(ids)} tokens of dense-model text; teacher-forced top-1 agreement with the dense model:")
    for k in args.used:
        with Engine.load(demo_model_path(args.experts, k)) as moe:
            agree = float((moe.forward(ids).argmax(1) == ref).mean())
        print(f"E={args.experts} k={k:<3} agreement {agree:.3f}")


if __name__ == "__main__":
    main()
