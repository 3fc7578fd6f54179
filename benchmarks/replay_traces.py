"""Expert-cache policies replayed on the real routing traces (../shared/traces).

    python benchmarks/replay_traces.py [TRACES_DIR]

Prints, per trace and capacity (experts per MoE layer), the overall hit rate of each policy, the
Belady gap (belady - lru) and the share of that gap each online policy closes. lfu-decay's decay
(LFU_DECAY) was chosen on these same traces, so its margin here is optimistic.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from daemon.routing.replay import LFU_DECAY, POLICIES, load_trace, simulate  # noqa: E402

CAPACITIES = {"olmoe": [8, 16, 24, 32], "kimi": [16, 32, 64, 128]}


def main(argv: list[str]) -> int:
    root = Path(argv[0]) if argv else Path(__file__).resolve().parents[2] / "shared" / "traces"
    files = sorted(root.glob("*.jsonl")) + sorted(root.glob("*.jsonl.zst"))
    if not files:
        print(f"no traces in {root}", file=sys.stderr)
        return 1
    pols = list(POLICIES)
    online = [p for p in pols if p not in ("lru", "belady")]
    print(f"lfu-decay decay = {LFU_DECAY}")
    for f in files:
        tr = load_trace(f)
        caps = next((c for k, c in CAPACITIES.items() if f.name.startswith(k)), [8, 16, 32, 64])
        print(f"\n{f.name}: {len(tr[0])} tokens, {len(tr)} MoE layers")
        print("  cap " + "".join(f"{p:>11}" for p in pols) + "   gap  " + "".join(f"{p + ' closes':>16}" for p in online))
        for c in caps:
            res = {p: simulate(tr, c, p).hit_rate for p in pols}
            gap = res["belady"] - res["lru"]
            closed = "".join(f"{((res[p] - res['lru']) / gap if gap > 0 else 0):>16.0%}" for p in online)
            print(f"{c:>5} " + "".join(f"{res[p]:>11.1%}" for p in pols) + f" {gap * 100:>+5.1f}" + closed)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
