"""Replay simulator: hand-computed LRU/Belady counts, Belady optimality on random traces, budgets
below one token's need, both file formats, malformed input, and the CLI; the history-only
predictors' recall, hand-computed."""

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest
import zstandard

from daemon.errors import RequestError
from daemon.routing.replay import (POLICIES, capacity_from_mb, format_table, load_trace, predictor_recall,
                                   simulate, simulate_layer)

REAL = Path(__file__).resolve().parents[2] / "benchmarks" / "data" / "traces"  # shipped in the repo

# First lines of the real OLMoE trace (copied; 16 MoE layers, top-8 of 64), cut to 3 layers.
SAMPLE = """\
{"tok": 1, "layers": [[6, 8, 15, 23, 31, 37, 53, 63], [7, 16, 18, 24, 25, 29, 47, 60], [5, 9, 22, 24, 30, 40, 60, 63]]}
{"tok": 2, "layers": [[6, 8, 15, 23, 31, 37, 53, 62], [7, 16, 18, 24, 25, 29, 47, 61], [5, 9, 22, 24, 30, 40, 60, 62]]}
{"tok": 3, "layers": [[1, 8, 15, 23, 31, 37, 53, 62], [7, 16, 18, 24, 25, 29, 47, 61], [5, 9, 22, 24, 30, 40, 59, 62]]}
"""


def S(*xs):
    return frozenset(xs)


def test_lru_and_belady_hand_computed_single():
    seq = [S(0), S(1), S(2), S(0), S(1), S(2)]
    lru = simulate_layer(seq, 2, "lru")
    assert (lru.hits, lru.misses) == (0, 6)  # cyclic access defeats LRU
    bel = simulate_layer(seq, 2, "belady")
    # t2 evicts 1 (next use 4 > 3); t3 hit 0; t4 evicts 0 (never again); t5 hit 2
    assert (bel.hits, bel.misses) == (2, 4)
    full = simulate_layer(seq, 3, "lru")
    assert (full.hits, full.misses) == (3, 3)


def test_lru_and_belady_hand_computed_sets():
    seq = [S(0, 1), S(2, 3), S(0, 1), S(2, 3), S(4, 0)]
    # cap 3, LRU: t1 evicts 0 (tie, lower id); t2: 1 hit, 0 miss, evicts 2; t3: 3 hit, 2 miss,
    # evicts 1 (used at t2? no: residents {0,1,3}, 3 pinned; 0,1 both last used t2 -> 0)
    # t3 residents {1,2,3}; t4 {4,0}: 2 misses -> hits total 2
    lru = simulate_layer(seq, 3, "lru")
    assert (lru.hits, lru.misses) == (2, 8)
    # Belady: t1 evicts 0 or 1 (both next at t2; the higher id kept? max (2,-e) -> evicts 0)
    # t2: 1 hit, load 0 evicting 2 or 3 (both next at t3): evicts 2; t3: 3 hit, load 2 evicting 1
    # (never again) -> residents {0,2,3}; t4: 0 hit, 4 miss -> hits 3
    bel = simulate_layer(seq, 3, "belady")
    assert (bel.hits, bel.misses) == (3, 7)


def test_capacity_below_one_token_completes():
    seq = [S(0, 1, 2), S(0, 1, 2), S(3, 4, 5, 6)]
    for pol in POLICIES:
        r = simulate_layer(seq, 1, pol)
        assert r.requests == 10
        assert r.hits <= 1  # at most one expert survives a step
        z = simulate_layer(seq, 0, pol)
        assert (z.hits, z.misses) == (0, 10)
    assert simulate_layer(seq, 1, "lru").hits == 1  # trim keeps one of the step's experts


@pytest.mark.parametrize("seed", range(20))
def test_belady_is_optimal_on_random(seed):
    rng = random.Random(seed)
    n_exp, k = rng.choice([(8, 2), (16, 4), (32, 8)])
    trace = []
    for _ in range(3):  # layers
        hot = rng.sample(range(n_exp), n_exp // 2)
        trace.append([frozenset(rng.sample(hot if rng.random() < 0.7 else range(n_exp), k))
                      for _ in range(rng.randint(1, 60))])
    for cap in (0, 1, k - 1, k, k + 1, 2 * k, n_exp):
        best = simulate(trace, cap, "belady")
        for pol in POLICIES:
            r = simulate(trace, cap, pol)
            for lb, lp in zip(best.layers, r.layers):
                assert lb.hits >= lp.hits, (pol, cap)
                assert lb.requests == lp.requests


def test_load_jsonl_and_zst(tmp_path):
    p = tmp_path / "t.jsonl"
    p.write_text(SAMPLE + "\n")
    z = tmp_path / "t.jsonl.zst"
    z.write_bytes(zstandard.ZstdCompressor().compress(SAMPLE.encode()))
    a, b = load_trace(p), load_trace(z)
    assert a == b
    assert len(a) == 3 and len(a[0]) == 3
    assert a[0][1] == S(6, 8, 15, 23, 31, 37, 53, 62)
    r = simulate(a, 8, "lru")
    # capacity 8 = one token's experts: the cache holds the previous token's set, so hits are the
    # overlaps: layer 0: 7 + 7, layer 1: 7 + 8, layer 2: 7 + 7
    assert [x.hits for x in r.layers] == [14, 15, 14]


@pytest.mark.parametrize("line,msg", [
    ("{not json", "not valid JSON"),
    ('{"tok": 2}', "layers"),
    ('{"tok": 2, "layers": [[1, 2]]}', "1 layers, but earlier lines have 3"),
    ('{"tok": 2, "layers": [[1, "a"], [1], [2]]}', "layer 0"),
    ('{"tok": 2, "layers": [[1, 1], [1], [2]]}', "repeats"),
    ('[1, 2]', "layers"),
])
def test_malformed_line_named(tmp_path, line, msg):
    p = tmp_path / "bad.jsonl"
    p.write_text(SAMPLE.splitlines()[0] + "\n" + line + "\n")
    with pytest.raises(RequestError, match=rf"bad.jsonl:2: .*{msg}"):
        load_trace(p)


def test_empty_and_missing(tmp_path):
    p = tmp_path / "e.jsonl"
    p.write_text("\n")
    with pytest.raises(RequestError, match="no tokens"):
        load_trace(p)
    with pytest.raises(RequestError, match="cannot read"):
        load_trace(tmp_path / "nope.jsonl")
    bad = tmp_path / "b.jsonl.zst"
    bad.write_bytes(b"not zstd")
    with pytest.raises(RequestError, match="zstd"):
        load_trace(bad)


def test_capacity_from_mb():
    assert capacity_from_mb(64, [2**20], 4) == [16, 16, 16, 16]
    assert capacity_from_mb(64, [2**20, 2**21], 2) == [32, 16]
    with pytest.raises(RequestError):
        capacity_from_mb(64, [1, 2, 3], 2)


def test_format_table_has_gap():
    tr = [[S(0), S(1), S(2), S(0), S(1), S(2)]]
    res = {p: simulate(tr, 2, p) for p in ("lru", "belady", "lfu-decay")}
    out = format_table(res, 2)
    assert "Belady gap" in out and "all" in out


def _cli(*args):
    root = Path(__file__).resolve().parents[2]
    return subprocess.run([sys.executable, "-m", "daemon.cli", "trace", "replay", *map(str, args)],
                          capture_output=True, text=True, cwd=root, timeout=120)


def test_cli_replay(tmp_path):
    p = tmp_path / "t.jsonl"
    p.write_text(SAMPLE)
    r = _cli(p, "--cache-experts", 8, "--policy", "lru,belady,lfu-decay,lru2")
    assert r.returncode == 0, r.stderr
    assert "Belady gap" in r.stdout and "lru2" in r.stdout
    lines = r.stdout.splitlines()
    assert sum(1 for ln in lines if ln.split()[:1] in (["0"], ["1"], ["2"])) == 3
    j = _cli(p, "--cache-mb", 3, "--expert-mb", 0.125, "--json")
    assert j.returncode == 0, j.stderr
    d = json.loads(j.stdout)
    assert d["capacity"] == 8 and d["results"][0]["hits"] == 43
    bad = _cli(p, "--cache-mb", 3)
    assert bad.returncode != 0 and "--expert-mb" in bad.stderr
    p.write_text(SAMPLE + "oops\n")
    err = _cli(p, "--cache-experts", 4)
    assert err.returncode == 1 and "t.jsonl:4" in err.stderr


def test_real_traces():
    files = sorted(REAL.glob("*.jsonl"))
    assert len(files) >= 2, REAL  # a missing folder must fail, not pass vacuously
    for f in files:
        tr = load_trace(f)
        assert len(tr[0]) >= 299
        res = {p: simulate(tr, 16, p) for p in POLICIES}
        assert all(res["belady"].hits >= r.hits for r in res.values())
        assert res["lfu-decay"].hit_rate >= res["lru"].hit_rate


def test_count_from_warms_the_cache_without_counting():
    seq = [frozenset({1}), frozenset({2}), frozenset({1}), frozenset({2})]
    whole = simulate_layer(seq, 2, "lru")
    assert (whole.hits, whole.misses) == (2, 2)  # two cold misses, then both hit
    warm = simulate_layer(seq, 2, "lru", count_from=2)
    assert (warm.hits, warm.misses) == (2, 0)  # only the warm steps counted
    tight = simulate_layer(seq, 1, "belady", count_from=2)
    assert (tight.hits, tight.misses) == (0, 2)  # one slot, alternating experts: nothing to keep


def test_history_predictors_recall_hand_computed():
    # layer 0 then layer 1, three tokens (worked out by hand in the comments)
    trace = [[S(0, 1), S(1, 2), S(0, 1)],
             [S(2, 3), S(0, 3), S(2, 3)]]
    r = predictor_recall(trace)
    # previous token: every step keeps one of its two experts
    assert r["previous_token"]["per_layer"] == {0: 0.5, 1: 0.5} and r["previous_token"]["exact"] == 8
    # frequent: t1 predicts {0,1} and {2,3} (1 right each); t2: uses [1,2,1] -> {1,0} (2 right) and
    # [1,0,1,2] -> {3,0} (ties to the lower id: 1 right)
    assert r["frequent"]["per_layer"] == {0: 0.75, 1: 0.5} and r["frequent"]["overall"] == 0.625
    # next layer: t1 from {1,2}: only row 1 has counts (cols 2,3) -> {2,3}, 1 right; after it rows 1,2 gain
    # cols 0,3; t2 from {0,1}: rows sum to [1,0,2,3] -> {3,2}, both right
    assert r["next_layer"]["per_layer"] == {1: 0.75} and r["next_layer"]["exact"] == 4


def test_history_predictors_on_a_repeating_trace_are_perfect():
    trace = [[S(4, 7)] * 5, [S(1, 9)] * 5]
    r = predictor_recall(trace)
    assert all(r[p]["overall"] == 1.0 for p in r)


@pytest.mark.parametrize("policy", list(POLICIES))
def test_victims_are_the_victim_calls_in_order(policy):
    """victims(n) = n victim() calls, each victim's slot taken by a new expert no longer a candidate."""
    rng = random.Random(7)
    seq = [frozenset(rng.sample(range(12), 3)) for _ in range(40)]
    pol = POLICIES[policy](seq)
    for t, need in enumerate(seq[:30]):
        for e in sorted(need):
            pol.touch(e, t)
    cands = sorted({e for s in seq[:30] for e in s})
    for n in (1, 3, len(cands)):
        left, one_by_one = list(cands), []
        for _ in range(n):
            v = pol.victim(left, 30)
            left.remove(v)
            one_by_one.append(v)
        assert pol.victims(cands, 30, n) == one_by_one
