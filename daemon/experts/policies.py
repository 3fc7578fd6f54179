"""Expert-cache policies (eviction, admission) and the simulator that replays a routing sequence
through one layer's cache of `capacity` experts and counts hits.

A layer's sequence is the token-ordered list of the expert sets each token used. A token's experts
are requested together: they are all needed at once, so during that step they are pinned and
cannot be evicted; the ones not resident (misses) are loaded then. A hit is a requested expert that
was already resident. When one token needs more experts than the capacity, they are all loaded for
the step anyway (counted as misses) and the cache is trimmed back to capacity afterwards, so a
budget below one step's need still completes.

Demand policies (`POLICIES`: every miss is inserted; the live caches use these: the host expert
cache (storage/cache.py, EXPERT_CACHE_POLICY) and the VRAM expert cache (MOE_GPU_CACHE_POLICY)):
- `lru`: evict the least recently used expert.
- `belady`: offline optimum of demand paging; evict the resident expert whose next use is farthest
  in the future (never-again first). Pinned experts of the current step cannot be evicted.
- `lfu-decay`: online; each expert keeps a score decayed by `LFU_DECAY` per token and bumped by 1
  when used; evict the lowest score (ties: least recently used). Frequency with recency.
- `lru2`: LRU-K with K=2; evict the expert whose second most recent use is oldest (experts used
  once so far go first, by LRU).
- `lfru`: online; two decayed use counts per expert, a fast one (recency: `LFRU_FAST`) weighted by
  `LFRU_WEIGHT` plus a slow one (frequency: `LFRU_SLOW`); evict the lowest sum (ties: LRU).
  Parameters tuned on the kimi-linear trace only (olmoe is held out): docs/benchmarks.md.

Admission policies (`ADMISSION_POLICIES`: a miss may bypass the cache, read in place by a
zero-copy kernel, nothing evicted):
- `lfru-admit`: `lfru`'s eviction order; a miss is inserted only when its score (this use
  counted) is at least the victim's.
- `opt-bypass`: offline optimum when a miss may bypass (`_simulate_opt_bypass`, independent of
  the demand loop): after each step keep the `capacity` experts whose next use is soonest.
  It bounds every policy of either kind, so it is >= `belady`.

All names simulate through `simulate_layer` / `simulate` (`SIMULATED` lists them).
"""

from __future__ import annotations

import bisect
import heapq
import math
from dataclasses import dataclass, field
from typing import Sequence

from ..errors import RequestError

Trace = list[list[frozenset[int]]]  # [moe layer][token] -> set of expert ids

LFU_DECAY = 0.95  # best of 0.7..0.98 on the two real traces (tuned on them: optimistic)
# lfru: best of a grid on the kimi trace's 64 and 128 slots (25%/50% of 256), olmoe held out
LFRU_FAST, LFRU_SLOW, LFRU_WEIGHT = 0.9, 0.995, 4.0


@dataclass
class LayerResult:
    hits: int = 0
    misses: int = 0

    @property
    def requests(self) -> int:
        return self.hits + self.misses

    @property
    def hit_rate(self) -> float:
        return self.hits / self.requests if self.requests else 0.0


@dataclass
class ReplayResult:
    policy: str
    layers: list[LayerResult] = field(default_factory=list)

    @property
    def hits(self) -> int:
        return sum(r.hits for r in self.layers)

    @property
    def misses(self) -> int:
        return sum(r.misses for r in self.layers)

    @property
    def hit_rate(self) -> float:
        n = self.hits + self.misses
        return self.hits / n if n else 0.0

    def to_dict(self) -> dict:
        return {"policy": self.policy, "hits": self.hits, "misses": self.misses, "hit_rate": self.hit_rate,
                "layers": [{"hits": r.hits, "misses": r.misses, "hit_rate": r.hit_rate} for r in self.layers]}


class _Policy:
    """Eviction bookkeeping for one layer's cache: `rank(e, t)` orders candidates, least wanted first."""

    def __init__(self, seq: Sequence[frozenset[int]]) -> None:
        self.seq = seq

    def touch(self, e: int, t: int) -> None: ...

    def rank(self, e: int, t: int): ...

    def victim(self, cands: list[int], t: int) -> int:
        return min(cands, key=lambda e: self.rank(e, t))

    def victims(self, cands: list[int], t: int, n: int) -> list[int]:
        """The n least wanted, in order: what n victim() calls give when each victim's slot goes to
        an expert that is then no candidate (a rank depends on its own expert's history alone)."""
        return heapq.nsmallest(n, cands, key=lambda e: self.rank(e, t))


class _LRU(_Policy):
    """Least recently touched first, by the order of the touches themselves: experts touched in one
    step keep their touch order (the simulator touches a step's experts by id; the host cache in
    request order, hits before misses)."""

    def __init__(self, seq):
        super().__init__(seq)
        self.last: dict[int, int] = {}
        self._touches = 0

    def touch(self, e, t):
        self._touches += 1
        self.last[e] = self._touches

    def rank(self, e, t):
        return self.last[e]


class _LRU2(_Policy):
    def __init__(self, seq):
        super().__init__(seq)
        self.hist: dict[int, tuple[int, int]] = {}  # (previous use, last use)

    def touch(self, e, t):
        prev = self.hist.get(e, (-1, -1))[1]
        self.hist[e] = (prev, t)

    def rank(self, e, t):
        return self.hist[e][0], self.hist[e][1], e


class _LFUDecay(_Policy):
    def __init__(self, seq, decay=LFU_DECAY):
        super().__init__(seq)
        self.decay = decay
        self.score: dict[int, tuple[float, int]] = {}  # expert -> (score at time, time)
        self.last: dict[int, int] = {}

    def _now(self, e, t):
        s, t0 = self.score.get(e, (0.0, t))
        return s * self.decay ** (t - t0)

    def touch(self, e, t):
        self.score[e] = (self._now(e, t) + 1.0, t)
        self.last[e] = t

    def rank(self, e, t):
        return self._now(e, t), self.last[e], e


class _Belady(_Policy):
    def __init__(self, seq):
        super().__init__(seq)
        self.uses: dict[int, list[int]] = {}
        for t, s in enumerate(seq):
            for e in s:
                self.uses.setdefault(e, []).append(t)
        self.ptr: dict[int, int] = {e: 0 for e in self.uses}

    def _next(self, e, t):
        u = self.uses.get(e, ())
        i = self.ptr.get(e, 0)
        while i < len(u) and u[i] <= t:
            i += 1
        self.ptr[e] = i
        return u[i] if i < len(u) else math.inf

    def rank(self, e, t):  # farthest next use first (never again: -inf), then the lower id
        return -self._next(e, t), e


class _LFRU(_Policy):
    """Frequency plus recency: a fast-decaying use count (recency) weighted above a slow one
    (frequency); evict the lowest sum, ties by LRU. A step's uses count once (the VRAM cache may
    touch an expert twice in a step). A rank reads only its own expert's counts, so victims()
    holds. `admit`: a miss goes in only if its score with this use is at least the victim's."""

    def __init__(self, seq, fast=LFRU_FAST, slow=LFRU_SLOW, weight=LFRU_WEIGHT):
        super().__init__(seq)
        self.fast, self.slow, self.weight = fast, slow, weight
        self.counts: dict[int, tuple[float, float, int]] = {}  # expert -> (fast, slow, as of step)
        self.last: dict[int, int] = {}

    def score(self, e: int, t: int) -> float:
        f, s, t0 = self.counts.get(e, (0.0, 0.0, t))
        return self.weight * f * self.fast ** (t - t0) + s * self.slow ** (t - t0)

    def touch(self, e, t):
        if self.last.get(e) == t:
            return
        f, s, t0 = self.counts.get(e, (0.0, 0.0, t))
        self.counts[e] = (f * self.fast ** (t - t0) + 1.0, s * self.slow ** (t - t0) + 1.0, t)
        self.last[e] = t

    def rank(self, e, t):
        return self.score(e, t), self.last[e], e

    def admit(self, e: int, victim: int, t: int) -> bool:
        return self.score(e, t) + self.weight + 1.0 >= self.score(victim, t)


LIVE_POLICIES = ("lru", "lfu-decay", "lfru")  # the live caches' choices (online; belady needs the future)
POLICIES = {"lru": _LRU, "belady": _Belady, "lfu-decay": _LFUDecay, "lru2": _LRU2, "lfru": _LFRU}
_ADMITTING = {"lfru-admit": _LFRU}  # live admission policies: a class with admit()
ADMISSION_POLICIES = (*_ADMITTING, "opt-bypass")
SIMULATED = (*POLICIES, *ADMISSION_POLICIES)


def simulate_layer(seq: Sequence[frozenset[int]], capacity: int, policy: str = "lru",
                   count_from: int = 0) -> LayerResult:
    """Replay one layer's token sequence of expert sets through a cache of `capacity` experts.
    count_from: hits and misses are counted from this step on (the ones before warm the cache)."""
    if policy not in SIMULATED:
        raise RequestError(f"unknown policy {policy!r} (choose from {', '.join(SIMULATED)})")
    if capacity < 0:
        raise RequestError("capacity must be >= 0")
    if policy == "opt-bypass":
        return _simulate_opt_bypass(seq, capacity, count_from)
    if policy in _ADMITTING:
        return _simulate_admit(seq, capacity, _ADMITTING[policy](seq), count_from)
    return replay_demand(seq, capacity, POLICIES[policy](seq), count_from)


def replay_demand(seq: Sequence[frozenset[int]], capacity: int, pol: _Policy, count_from: int = 0) -> LayerResult:
    """simulate_layer's demand loop with a policy object made by the caller (a policy class with
    other parameters than its defaults: the benchmark's parameter sweeps)."""
    resident: set[int] = set()
    res = LayerResult()
    for t, need in enumerate(seq):
        hits = need & resident
        miss = need - resident
        if t >= count_from:
            res.hits += len(hits)
            res.misses += len(miss)
        # make room for the misses: evict unpinned residents while over budget
        n_evict = len(resident) + len(miss) - capacity
        if n_evict > 0:
            cands = [e for e in resident if e not in need]
            for _ in range(min(n_evict, len(cands))):
                v = pol.victim(cands, t)
                cands.remove(v)
                resident.discard(v)
        resident |= miss
        for e in sorted(need):
            pol.touch(e, t)
        # over budget (one token needs more than the capacity): trim after the step, pins released
        while len(resident) > capacity:
            v = pol.victim(list(resident), t)
            resident.discard(v)
    return res


def simulate(trace: Trace, capacity: int | Sequence[int], policy: str = "lru") -> ReplayResult:
    """Replay every layer of `trace`; capacity is experts per layer (an int, or one per layer)."""
    caps = [capacity] * len(trace) if isinstance(capacity, int) else list(capacity)
    if len(caps) != len(trace):
        raise RequestError(f"{len(caps)} capacities for {len(trace)} layers")
    return ReplayResult(policy, [simulate_layer(seq, c, policy) for seq, c in zip(trace, caps)])


def _simulate_admit(seq: Sequence[frozenset[int]], capacity: int, pol, count_from: int) -> LayerResult:
    """A live admission policy: a miss takes a free slot, else it replaces the policy's victim
    among the residents this step does not use only if pol.admit says so; else it bypasses (read
    in place, nothing evicted). The cache never exceeds capacity."""
    resident: set[int] = set()
    res = LayerResult()
    for t, need in enumerate(seq):
        miss = need - resident
        if t >= count_from:
            res.hits += len(need) - len(miss)
            res.misses += len(miss)
        for e in sorted(miss, key=lambda e: (-pol.score(e, t), e)):  # the most wanted first
            if len(resident) < capacity:
                resident.add(e)
                continue
            cands = [x for x in resident if x not in need]
            if not cands:
                break
            v = pol.victim(cands, t)
            if pol.admit(e, v, t):
                resident.discard(v)
                resident.add(e)
        for e in sorted(need):
            pol.touch(e, t)
    return res


def _simulate_opt_bypass(seq: Sequence[frozenset[int]], capacity: int, count_from: int) -> LayerResult:
    """Offline optimum when a miss may bypass the cache: after each step, of the residents and
    this step's experts keep the `capacity` whose next use is soonest (never-again ones dropped).

    Every policy of either kind ends a step holding some subset of (residents | this step's
    experts) of at most `capacity`, so this bounds them all. Why the greedy is optimal (Belady's
    exchange argument, which bypass makes simpler: no pins, any subset is reachable): let an optimal
    schedule keep S after step t, and let g be kept by the greedy but not by S while e in S is not
    kept by the greedy, so next(g) < next(e). Keep S - e + g instead and then copy S's choices minus
    e: until next(g) nothing differs (e is not asked for before next(e) > next(g)); at next(g) this
    hits g, which S misses (g cannot enter S without a request); at worst it later misses e once
    where S hits it. Not worse, and one more expert agrees with the greedy: by induction the
    greedy is optimal. Ties in next use do not matter: both experts are requested at that step and
    either way both are then candidates. tests/experts check it against an exhaustive search."""
    uses: dict[int, list[int]] = {}
    for t, s in enumerate(seq):
        for e in s:
            uses.setdefault(e, []).append(t)

    def next_use(e: int, t: int) -> float:
        u = uses[e]
        i = bisect.bisect_right(u, t)
        return u[i] if i < len(u) else math.inf

    resident: set[int] = set()
    res = LayerResult()
    for t, need in enumerate(seq):
        hits = len(need & resident)
        if t >= count_from:
            res.hits += hits
            res.misses += len(need) - hits
        soon = sorted((next_use(e, t), e) for e in resident | need)
        resident = {e for n, e in soon[:capacity] if n != math.inf}
    return res
