"""Expert-cache policies replayed on the real routing traces (../shared/traces).

    python benchmarks/replay_traces.py [TRACES_DIR] [--sweep]

Prints, per trace and capacity (experts per MoE layer), the overall hit rate of each policy.
Demand policies (every miss inserted) are scored against `belady`, their offline optimum: the gap
(belady - lru) and the share of it each online one closes. Admission policies (a miss may bypass
the cache, read in place) are scored against `opt-bypass`, theirs. lfu-decay's decay was chosen on
both traces (optimistic); lfru's parameters on the kimi trace only, so olmoe is held out.

--lookahead: how far ahead a predictor would have to see: lfru told the exact experts of the next
k tokens (an oracle: a victim used within k tokens goes last, the farthest use first), for k = 1..16,
as the share of (belady - lru) closed at 25% and 50% of the experts.

--sweep: lfru's parameter grid (GRID) at 25% and 50% of the experts: the best parameters for each
trace scored on the other (tuned-on and held-out, both ways), and the family's hindsight ceiling
(the best parameters, or lru, picked per layer after the fact). A minute or two on one core.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from daemon.experts.policies import (ADMISSION_POLICIES, LFRU_FAST, LFRU_SLOW, LFRU_WEIGHT,  # noqa: E402
                                     LFU_DECAY, POLICIES, _LFRU, _Policy, replay_demand, simulate)
from daemon.routing.replay import load_trace  # noqa: E402

CAPACITIES = {"olmoe": [8, 16, 24, 32], "kimi": [16, 32, 64, 128]}
TUNED_ON = "kimi"  # lfru's parameters were picked on this trace
GRID = [(f, s, w) for f in (0.5, 0.8, 0.9) for s in (0.95, 0.98, 0.99, 0.995) for w in (1.0, 4.0, 16.0)]


def sweep(files: list[Path]) -> None:
    """lfru's grid on each trace at 25% and 50% of its experts: tuned on one, scored on the other."""
    runs = {}  # trace -> {cap: (lru hits per layer, belady hits per layer, requests, {cfg: hits per layer})}
    for f in files:
        tr = load_trace(f)
        n_exp = max(max(s) for seq in tr for s in seq if s) + 1
        runs[f.name.split("_")[0]] = got = {}
        for c in (n_exp // 4, n_exp // 2):
            lru, bel = simulate(tr, c, "lru"), simulate(tr, c, "belady")
            by_cfg = {cfg: [replay_demand(seq, c, _LFRU(seq, *cfg)).hits for seq in tr] for cfg in GRID}
            got[c] = ([r.hits for r in lru.layers], [r.hits for r in bel.layers], lru.hits + lru.misses, by_cfg)

    def closed(name, c, hits):
        lru, bel, _, _ = runs[name][c]
        return (hits - sum(lru)) / (sum(bel) - sum(lru))

    print("\nlfru sweep (fast, slow, weight) at 25% / 50% of the experts: share of (belady - lru) closed")
    for tune in runs:
        best = max(GRID, key=lambda cfg: sum(closed(tune, c, sum(v[3][cfg])) for c, v in runs[tune].items()))
        row = "  ".join(f"{name} {c}: {closed(name, c, sum(v[3][best])):.0%}" + (" (tuned)" if name == tune else "")
                        for name in runs for c, v in runs[name].items())
        print(f"  tuned on {tune}: {best} -> {row}")
    row = "  ".join(f"{name} {c}: {closed(name, c, sum(max(x) for x in zip(v[0], *v[3].values()))):.0%}"
                    for name in runs for c, v in runs[name].items())
    print(f"  hindsight ceiling (best of lru and the grid, per layer): {row}")


class _Lookahead(_Policy):
    """lfru plus an oracle of the next k tokens' experts: an expert used within k tokens is evicted
    last (the farthest use first); the others by lfru's rank."""

    def __init__(self, seq, k: int):
        super().__init__(seq)
        self.k, self.base = k, _LFRU(seq)

    def touch(self, e, t):
        self.base.touch(e, t)

    def rank(self, e, t):
        for d in range(1, self.k + 1):
            if t + d < len(self.seq) and e in self.seq[t + d]:
                return 1, -d, 0
        return 0, 0, self.base.rank(e, t)


def lookahead(files: list[Path]) -> None:
    print("\nlfru with the next k tokens' experts known: share of (belady - lru) closed")
    for f in files:
        tr = load_trace(f)
        n_exp = max(max(s) for seq in tr for s in seq if s) + 1
        for c in (n_exp // 4, n_exp // 2):
            lru, bel = simulate(tr, c, "lru"), simulate(tr, c, "belady")
            row = []
            for k in (1, 2, 4, 8, 16):
                hits = sum(replay_demand(seq, c, _Lookahead(seq, k)).hits for seq in tr)
                row.append(f"k={k} {(hits - lru.hits) / (bel.hits - lru.hits):>4.0%}")
            print(f"  {f.name.split('_')[0]:>16} {c:>4} ({c / n_exp:.0%}): " + "  ".join(row))


def _closes(h: float, lo: float, hi: float) -> str:
    return f"{(h - lo) / (hi - lo):>7.0%}" if hi - lo > 1e-12 else f"{'-':>7}"


def main(argv: list[str]) -> int:
    do_sweep, do_look = "--sweep" in argv, "--lookahead" in argv
    argv = [a for a in argv if a not in ("--sweep", "--lookahead")]
    root = Path(argv[0]) if argv else Path(__file__).resolve().parents[2] / "shared" / "traces"
    files = sorted(root.glob("*.jsonl")) + sorted(root.glob("*.jsonl.zst"))
    if not files:
        print(f"no traces in {root}", file=sys.stderr)
        return 1
    pols = [*POLICIES, *ADMISSION_POLICIES]
    online = [p for p in POLICIES if p not in ("lru", "belady")]
    admit = [p for p in ADMISSION_POLICIES if p != "opt-bypass"]
    print(f"lfu-decay decay = {LFU_DECAY} (tuned on both traces); lfru fast {LFRU_FAST} x{LFRU_WEIGHT:g} + "
          f"slow {LFRU_SLOW} (tuned on {TUNED_ON} only)")
    print("closes: share of (belady - lru) a demand policy closes; admission policies: of (opt-bypass - lru)")
    for f in files:
        tr = load_trace(f)
        key = next((k for k in CAPACITIES if f.name.startswith(k)), None)
        caps = CAPACITIES.get(key, [8, 16, 32, 64])
        n_exp = max(max(s) for seq in tr for s in seq if s) + 1
        role = "tuned on" if key == TUNED_ON else "held out"
        print(f"\n{f.name}: {len(tr[0])} tokens, {len(tr)} MoE layers, {n_exp} experts; lfru {role}")
        print("  cap   %exp " + "".join(f"{p:>11}" for p in pols) + "   gap  "
              + "".join(f"{p + ' closes':>{max(16, len(p) + 8)}}" for p in online + admit)
              + "  lfru-belady")
        for c in caps:
            res = {p: simulate(tr, c, p).hit_rate for p in pols}
            lo, bel, byp = res["lru"], res["belady"], res["opt-bypass"]
            closed = "".join(f"{_closes(res[p], lo, bel):>{max(16, len(p) + 8)}}" for p in online)
            closed += "".join(f"{_closes(res[p], lo, byp):>{max(16, len(p) + 8)}}" for p in admit)
            print(f"{c:>5} {c / n_exp:>5.0%} " + "".join(f"{res[p]:>11.1%}" for p in pols)
                  + f" {(bel - lo) * 100:>+5.1f}" + closed + f"{(res['lfru'] - bel) * 100:>+11.1f}")
    if do_sweep:
        sweep(files)
    if do_look:
        lookahead(files)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
