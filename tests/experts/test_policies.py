"""Expert-cache policies: lfru and lfru-admit on hand-made sequences (hits worked out by hand),
belady and opt-bypass against an exhaustive search over every eviction / bypass choice on tiny
random sequences, and every policy under the bound of its kind."""

import itertools
import random
from functools import lru_cache
from pathlib import Path

import pytest

from daemon.errors import RequestError
from daemon.experts.policies import ADMISSION_POLICIES, POLICIES, SIMULATED, _LFRU, simulate, simulate_layer
from daemon.routing.replay import load_trace

REAL = Path(__file__).resolve().parents[2] / "benchmarks" / "data" / "traces"


def S(*xs):
    return frozenset(xs)


def hm(seq, cap, pol):
    r = simulate_layer(seq, cap, pol)
    return r.hits, r.misses


# -- exhaustive optima (independent of the simulator) -------------------------------------------


def brute_demand(seq, cap):
    """Most hits of any demand schedule: every miss goes in, evicting exactly as many residents the
    step does not use as needed (any of them); a step that alone overfills is then trimmed to any
    `cap` of what is resident."""
    @lru_cache(None)
    def best(t, res):
        if t == len(seq):
            return 0
        need = seq[t]
        miss = need - res
        cands = sorted(res - need)
        k = min(max(len(res) + len(miss) - cap, 0), len(cands))
        out = 0
        for ev in itertools.combinations(cands, k):
            after = (res - set(ev)) | miss
            for keep in itertools.combinations(sorted(after), min(cap, len(after))):
                out = max(out, best(t + 1, frozenset(keep)))
        return len(need & res) + out
    return best(0, frozenset())


def brute_bypass(seq, cap):
    """Most hits of any schedule when a miss may bypass: after each step the cache holds any subset
    of at most `cap` of (residents | the step's experts)."""
    @lru_cache(None)
    def best(t, res):
        if t == len(seq):
            return 0
        need = seq[t]
        pool = sorted(res | need)
        out = max(best(t + 1, frozenset(c)) for k in range(min(cap, len(pool)) + 1)
                  for c in itertools.combinations(pool, k))
        return len(need & res) + out
    return best(0, frozenset())


def test_brute_force_hand_checked():
    # the cyclic case of tests/routing: demand Belady 2 hits; bypass keeps 0 and 1, then hits 0,1 = 2
    seq = [S(0), S(1), S(2), S(0), S(1), S(2)]
    assert brute_demand(seq, 2) == 2
    assert brute_bypass(seq, 2) == 2
    # one slot, 0 0 1 0: demand must load 1 over 0 (1 hit), bypass skips 1 (2 hits)
    seq = [S(0), S(0), S(1), S(0)]
    assert brute_demand(seq, 1) == 1
    assert brute_bypass(seq, 1) == 2


@pytest.mark.parametrize("seed", range(40))
def test_belady_and_opt_bypass_match_exhaustive_search(seed):
    rng = random.Random(seed)
    n_exp = rng.choice([4, 5, 6])
    cap = rng.choice([1, 2, 3]) if seed % 4 == 0 else rng.choice([2, 3])
    size = rng.choice([1, 2]) if cap > 1 else 2
    seq = [frozenset(rng.sample(range(n_exp), rng.randint(1, size))) for _ in range(rng.randint(6, 8))]
    d, b = brute_demand(seq, cap), brute_bypass(seq, cap)
    assert simulate_layer(seq, cap, "belady").hits == d, (seq, cap)
    assert simulate_layer(seq, cap, "opt-bypass").hits == b, (seq, cap)
    for pol in POLICIES:
        assert simulate_layer(seq, cap, pol).hits <= d, pol
    for pol in ADMISSION_POLICIES:
        r = simulate_layer(seq, cap, pol)
        assert r.hits <= b and r.requests == sum(map(len, seq)), pol


# -- lfru / lfru-admit by hand ------------------------------------------------------------------


def test_lfru_keeps_the_frequent_expert_lru_drops():
    seq = [S(0), S(0), S(0), S(1), S(2), S(0), S(1)]
    # t4 needs a slot among {0, 1}: LRU evicts 0 (last used t2), then t5 misses 0 and t6 misses 1:
    # hits t1, t2 only. lfru (fast 0.9 x4 + slow 0.995): 0 scores 4(.9^2+.9^3+.9^4)+(.995^2+.995^3+
    # .995^4) = 11.7 > 1's 4(.9)+.995 = 4.6, so 1 goes; t5 hits 0, t6 misses 1: hits t1, t2, t5.
    assert hm(seq, 2, "lru") == (2, 5)
    assert hm(seq, 2, "lfru") == (3, 4)


def test_lfru_recency_beats_old_frequency():
    # own parameters: fast 0.5 x8, slow 1.0 (plain counts). 0 is used at t0..t2; 1 at t3, t4.
    pol = _LFRU([], fast=0.5, slow=1.0, weight=8.0)
    for t, e in [(0, 0), (1, 0), (2, 0), (3, 1), (4, 1)]:
        pol.touch(e, t)
    pol.touch(1, 4)  # a second touch in one step counts once
    # at t5: 0 = 8(.5^3+.5^4+.5^5) + 3 = 8(.21875) + 3 = 4.75; 1 = 8(.5^1+.5^2) + 2 = 8
    assert pol.score(0, 5) == pytest.approx(4.75)
    assert pol.score(1, 5) == pytest.approx(8.0)
    assert pol.victim([0, 1], 5) == 0
    # forty steps later recency has faded: 0 = 3 + tiny, 1 = 2 + tiny -> 1 goes
    assert pol.victim([0, 1], 45) == 1


def test_lfru_admit_bypasses_a_cold_miss():
    seq = [S(0), S(0), S(0), S(1), S(0)]
    # one slot. Demand policies must load 1 over 0 at t3, then miss 0 at t4: 2 hits.
    assert hm(seq, 1, "lfru") == (2, 3)
    # lfru-admit: 1 scores 0 + 4 + 1 = 5 with this use, 0 scores 4(.9+.81+.729) + (.995+.990+.985)
    # = 12.7: 1 is read in place, 0 stays, t4 hits: 3 hits.
    assert hm(seq, 1, "lfru-admit") == (3, 2)
    # a free slot always takes the miss
    assert hm([S(0), S(1), S(0), S(1)], 2, "lfru-admit") == (2, 2)


def test_opt_bypass_by_hand_and_count_from():
    # two slots; 0 and 1 are hot, 2..4 pass once: demand Belady must load each passer (evicting 0 or
    # 1, whichever is needed later); bypass never loads them.
    seq = [S(0, 1), S(2), S(0), S(3), S(1), S(4), S(0, 1)]
    assert hm(seq, 2, "opt-bypass") == (4, 5)  # t2 0, t4 1, t6 0 and 1 (9 requests)
    # Belady: t1 evicts 1 (next t4 > t2's 0); t2 hits 0; t3 evicts 2 (never again); t4 misses 1,
    # evicting 3; t5 evicts 0 or 1 (both next at t6) for 4; t6 hits the other: 2 hits
    assert hm(seq, 2, "belady") == (2, 7)
    assert brute_demand(seq, 2) == 2 and brute_bypass(seq, 2) == 4
    r = simulate_layer(seq, 2, "opt-bypass", count_from=3)
    assert (r.hits, r.misses) == (3, 2)  # t4 1, t6 0 and 1; t3 and t5 miss


def test_zero_capacity_and_unknown_names():
    seq = [S(0, 1), S(0, 1)]
    for pol in SIMULATED:
        assert hm(seq, 0, pol) == (0, 4), pol
    with pytest.raises(RequestError, match="opt-bypass"):
        simulate_layer(seq, 2, "arc")
    with pytest.raises(RequestError, match="capacity"):
        simulate_layer(seq, -1, "opt-bypass")


def test_real_traces_under_their_bounds():
    files = sorted(REAL.glob("*.jsonl"))
    assert len(files) >= 2, REAL
    for f in files:
        tr = load_trace(f)
        res = {p: simulate(tr, 16, p) for p in SIMULATED}
        assert res["opt-bypass"].hits >= res["belady"].hits
        assert all(res["belady"].hits >= res[p].hits for p in POLICIES)
        assert all(res["opt-bypass"].hits >= res[p].hits for p in SIMULATED)
        assert res["lfru"].hit_rate > res["lru"].hit_rate
