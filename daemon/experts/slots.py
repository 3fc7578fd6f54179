"""One layer's slots of a cache tier: which expert each holds, as arrays (the form a device copy of
the table takes), with the claims, pins and evictions the VRAM expert cache makes.

Legend: E = the layer's experts, S = its slots.
    slot_of    int32 [E]  expert -> its slot, -1 = a miss
    expert_of  int32 [S]  slot -> its expert, -1 = free
    pins       int32 [S]  steps that read the slot now: never a victim while > 0
    pending    bool  [S]  a copy into it was issued and not yet seen done (copied[s]: its event,
                          issued_at[s]: when, time.monotonic)
    prefetched bool  [S]  brought in by a prediction; used: read by a step since it came in

The eviction policy (daemon/experts/policies.py) is asked for victims among the unpinned
occupied slots, in slot order; a free slot is always taken first, the lowest first.
"""

from __future__ import annotations

import numpy as np


class SlotTable:
    """Slots of one layer. on_evict(wasted) is told of each eviction (wasted: the expert came from
    a prediction and no step read it)."""

    def __init__(self, n_expert: int, capacity: int, policy, on_evict=None):
        self.capacity = capacity
        self.policy = policy
        self.clock = 0  # bumped by the cache once per step's decision: the policy's time
        self.on_evict = on_evict or (lambda _wasted: None)
        self.slot_of = np.full(n_expert, -1, np.int32)
        self.expert_of = np.full(capacity, -1, np.int32)
        self.pins = np.zeros(capacity, np.int32)
        self.pending = np.zeros(capacity, bool)
        self.prefetched = np.zeros(capacity, bool)
        self.used = np.zeros(capacity, bool)
        self.issued_at = np.zeros(capacity, np.float64)
        self.copied: list = [None] * capacity

    def __len__(self) -> int:
        """Experts held."""
        return int(np.count_nonzero(self.expert_of >= 0))

    def __contains__(self, e: int) -> bool:
        return self.slot_of[e] >= 0

    def slot(self, e: int) -> int | None:
        si = int(self.slot_of[e])
        return None if si < 0 else si

    def holds_all(self) -> bool:
        return len(self) == self.slot_of.shape[0]

    def touch(self, e: int, pin: bool) -> None:
        """e was asked for now (the policy's recency and frequency); pin: a step reads its slot."""
        self.policy.touch(e, self.clock)
        if pin:
            self.pins[self.slot_of[e]] += 1

    def take(self, e: int, prefetch: bool) -> int | None:
        """A slot for expert e (claimed, now its own; pinned for a step's own miss), or None."""
        si = self.claim(prefetch)
        if si is not None:
            self.own(e, si, prefetch)
        return si

    def own(self, e: int, si: int, prefetch: bool) -> None:
        self.slot_of[e] = si
        self.expert_of[si] = e
        self.prefetched[si], self.used[si] = prefetch, not prefetch
        self.touch(e, pin=not prefetch)

    def claim_many(self, n: int) -> list[int]:
        """Slots for n experts of a step's own misses, as n claim(prefetch=False) calls give them
        (each claimed slot is pinned by its expert, so no later call's candidate), in one pass: free
        ones in slot order, then the policy's least wanted unpinned ones. Fewer than n when the
        step holds the rest."""
        free = np.flatnonzero((self.expert_of < 0) & (self.pins == 0))[:n].tolist()
        if len(free) == n:
            return free
        cands = self.expert_of[(self.pins == 0) & (self.expert_of >= 0)].tolist()
        for victim in self.policy.victims(cands, self.clock, n - len(free)):
            free.append(int(self.slot_of[victim]))
            self.drop(victim, evicted=True)
        return free

    def claim(self, prefetch: bool) -> int | None:
        """A slot for a new expert: a free one, else the policy's victim among those no step holds
        (a prefetch also spares copies in flight and predicted experts not read yet)."""
        free = np.flatnonzero((self.expert_of < 0) & (self.pins == 0))
        if free.size:
            return int(free[0])
        ok = (self.pins == 0) & (self.expert_of >= 0)
        if prefetch:
            ok &= ~(self.pending | (self.prefetched & ~self.used))
        cands = self.expert_of[ok].tolist()
        if not cands:
            return None
        victim = self.policy.victim(cands, self.clock)
        si = int(self.slot_of[victim])
        self.drop(victim, evicted=True)
        return si

    def drop(self, e: int, evicted: bool = False) -> None:
        """Expert e leaves its slot (evicted: for another; else its copy failed or went stale)."""
        si = int(self.slot_of[e])
        self.slot_of[e] = -1
        if evicted:
            self.on_evict(bool(self.prefetched[si] and not self.used[si]))
        self.expert_of[si] = -1
        self.pending[si] = self.prefetched[si] = self.used[si] = False
        self.pins[si] = 0
        self.copied[si] = None

    def forget(self, items) -> None:
        """Give back the slots claimed for (expert, slot) items whose copies did not happen."""
        for e, si in items:
            if self.slot_of[e] == si:
                self.drop(e)

    def issued(self, slots, event, now: float) -> None:
        """Copies into `slots` were issued; `event` is recorded after them."""
        for si in slots:
            self.pending[si], self.issued_at[si], self.copied[si] = True, now, event
