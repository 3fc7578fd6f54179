"""Recall of the expert predictors: moed's Path A and speculative on models, set beside three
predictors that read only the routing history (replay.predictor_recall), which can also be scored
on the real traces that hold no hidden states.

    python benchmarks/recall.py [--model PATH ...] [--trace PATH ...] [--tokens N] [--limit-mb MB]

For each model: a greedy decode of --tokens tokens after a short prompt, with MOE_ROUTING=all and
an expert cache of --limit-mb (small, so that every layer is predicted every step: a layer whose
cache holds all of its experts is not predicted); recall = |predicted & exact| / |exact| per decode
step, the prompt's prefill not counted. The routing of the same decode is recorded and scored with
the history predictors. For each trace, the history predictors alone (with neither --model nor
--trace: the real traces in ../shared/traces). Prints per-layer recall of the model predictors,
then one row per model or trace.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

from daemon.engine import Engine  # noqa: E402
from daemon.routing.replay import HISTORY_PREDICTORS, load_trace, predictor_recall  # noqa: E402
from daemon.routing.trace import RoutingRecorder  # noqa: E402

PROMPT = "The history of the printing press begins"
MODEL_PATHS = ("path_a", "speculative")


def model_recall(path: str, tokens: int, limit_mb: float) -> tuple[dict, dict]:
    """-> (moed's predictors' recall dicts, the history predictors' on the same decode)."""
    with Engine.load(path, expert_cache_limit_mb=limit_mb, routing="all", expert_pack=False) as eng:
        model = eng.model
        ids = eng.tokenize(PROMPT)
        cache = model.new_cache(len(ids) + tokens + 8)
        tok = int(np.argmax(model.forward(ids, cache)[-1]))
        eng.reset_stats()
        rec = RoutingRecorder().attach(model)
        for _ in range(tokens):
            tok = int(np.argmax(model.forward([tok], cache)[-1]))
        rec.detach()
        live = eng.stats()["routing"]["recall"]
    n_moe = len(rec.moe_layers)
    trace = [[frozenset(r[i]) for r in rec.records] for i in range(n_moe)]
    return live, predictor_recall(trace)


def _row(name: str, rec: dict) -> str:
    cols = [f"{rec[p]['overall']:.3f}" if p in rec else "-" for p in MODEL_PATHS + HISTORY_PREDICTORS]
    return f"| {name} | " + " | ".join(cols) + " |"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", action="append", default=[], help="a GGUF MoE model (repeatable)")
    ap.add_argument("--trace", action="append", default=None, help="a routing trace (repeatable)")
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--limit-mb", type=float, default=1.0)
    args = ap.parse_args()
    traces = args.trace or []
    if not args.model and not traces:
        traces = sorted(str(p) for p in (Path(__file__).resolve().parents[2] / "shared" / "traces").glob("*.jsonl"))
    head = "| source | " + " | ".join(MODEL_PATHS + HISTORY_PREDICTORS) + " |"
    rows, detail = [], []
    for path in args.model:
        live, hist = model_recall(path, args.tokens, args.limit_mb)
        rows.append(_row(Path(path).name, {**live, **hist}))
        for p in MODEL_PATHS:
            per = live[p]["per_layer"]
            detail.append(f"{Path(path).name} {p} per layer: " + " ".join(f"{per[k]:.2f}" for k in sorted(per)))
    for path in traces:
        rows.append(_row(Path(path).name + " (trace)", predictor_recall(load_trace(path))))
    print("\n".join(detail))
    print("\n".join([head, "| --- |" + " ---: |" * (len(MODEL_PATHS) + len(HISTORY_PREDICTORS))] + rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
