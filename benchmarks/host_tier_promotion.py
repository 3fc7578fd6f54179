"""The host tier's promotion rule (daemon/experts/promotion.py) replayed on the real traces and
under uniform routing: hit rate of its VRAM slots and moves (copies) per token and layer.

    python benchmarks/host_tier_promotion.py [--share 0.25] [--period 4] [--moves 4]

Each layer starts with its first S experts in the slots (as at load); every --period tokens the
counts fold into the scores and up to --moves experts move in. Compared with no promotion and with
the plain rule `score > holder + 1`. CPU only: the copies' cost on a GPU is in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from daemon.experts import promotion  # noqa: E402

TRACES = Path(__file__).resolve().parent / "data" / "traces"


def replay(seq, n_expert: int, slots: int, period: int, most: int, rule) -> tuple[float, float]:
    """(hit rate, moves a token) of one layer's routing `seq` ([tokens][A] ids)."""
    score = np.zeros(n_expert)
    holder = np.arange(slots)
    held = np.zeros(n_expert, bool)
    held[:slots] = True
    counts = np.zeros(n_expert)
    hits = total = n_moves = 0
    for t, ids in enumerate(seq):
        ids = np.asarray(ids)
        hits += int(held[ids].sum())
        total += ids.size
        np.add.at(counts, ids, 1)
        if t % period == period - 1:
            score = promotion.decayed(score, counts)
            counts[:] = 0
            for s, e in rule(score, holder, held, most):
                held[holder[s]] = False
                holder[s] = e
                held[e] = True
                n_moves += 1
    return hits / max(total, 1), n_moves / max(len(seq), 1)


def plain(score, holder, held, most):
    order = np.argsort(-score, kind="stable")
    wanted = order[~held[order]][:most]
    victims = np.argsort(score[holder], kind="stable")
    return [(s, e) for e, s in zip(wanted.tolist(), victims.tolist()) if score[e] > score[holder[s]] + 1][:most]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--share", type=float, default=0.25, help="share of each layer's experts in VRAM")
    ap.add_argument("--period", type=int, default=4)
    ap.add_argument("--moves", type=int, default=4)
    args = ap.parse_args()
    rules = {"none": lambda *_: [], "score > holder + 1": plain,
             f"score > {promotion.RATIO:g} holder + {promotion.MARGIN:g} (moed)": promotion.moves}
    rng = np.random.default_rng(0)
    print(f"{'routing':34} {'rule':38} {'hit rate':>8} {'moves/token/layer':>17}")
    for path in sorted(TRACES.glob("*.jsonl")):
        toks = [json.loads(line)["layers"] for line in path.open()]
        n_expert = 1 + max(max(max(ids) for ids in tok) for tok in toks)
        slots = int(n_expert * args.share)
        layers = range(len(toks[0]))
        uniform = [[rng.choice(n_expert, len(toks[0][0]), replace=False) for _ in toks] for _ in range(8)]
        for name, seqs in ((path.stem, [[tok[i] for tok in toks] for i in layers]),
                           (f"uniform, {n_expert} experts", uniform)):
            for rule_name, rule in rules.items():
                r = [replay(s, n_expert, slots, args.period, args.moves, rule) for s in seqs]
                print(f"{name[:34]:34} {rule_name:38} {np.mean([h for h, _ in r]):8.3f} "
                      f"{np.mean([m for _, m in r]):17.2f}")


if __name__ == "__main__":
    main()
