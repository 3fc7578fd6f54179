"""One layer's slot table (daemon/experts/slots.py): free slots first and lowest first, victims
by the policy among unpinned slots only, a prefetch sparing copies in flight and unread
predictions, and the two maps staying each other's inverse under random use."""

import random

import numpy as np

from daemon.experts.policies import POLICIES
from daemon.experts.slots import SlotTable


def table(n_expert=8, capacity=3):
    evicted = []
    t = SlotTable(n_expert, capacity, POLICIES["lru"]([]), on_evict=evicted.append)
    return t, evicted


def test_free_slots_go_first_lowest_first():
    t, evicted = table()
    assert [t.take(e, prefetch=False) for e in (5, 2, 7)] == [0, 1, 2]
    assert t.slot_of.tolist() == [-1, -1, 1, -1, -1, 0, -1, 2] and t.expert_of.tolist() == [5, 2, 7]
    assert len(t) == 3 and 5 in t and 4 not in t and t.slot(4) is None
    assert t.pins.tolist() == [1, 1, 1] and t.used.all() and not t.prefetched.any() and evicted == []


def test_a_full_table_evicts_the_least_recent_unpinned_expert():
    t, evicted = table()
    for e in (5, 2, 7):  # times 1, 2, 3
        t.clock += 1
        t.take(e, prefetch=False)
    t.pins[:] = 0
    t.clock += 1
    t.touch(5, pin=False)  # 5 is recent again: 2 is the oldest
    assert t.claim(prefetch=False) == 1 and t.slot_of[2] == -1 and evicted == [False]
    t.own(4, 1, prefetch=False)
    t.pins[t.slot_of[7]] = 1  # a step reads 7, the oldest now: never a victim
    t.clock += 1
    assert t.claim(prefetch=False) == 0 and t.expert_of[0] == -1  # 5 went, 7 stayed
    assert 7 in t


def test_every_slot_pinned_gives_no_slot():
    t, _ = table()
    for e in (1, 2, 3):
        t.take(e, prefetch=False)
    assert t.claim(prefetch=False) is None and t.claim_many(2) == []


def test_a_prefetch_spares_copies_in_flight_and_unread_predictions():
    t, evicted = table()
    t.take(1, prefetch=True)  # slot 0, predicted, not read
    t.take(2, prefetch=False)  # slot 1
    t.take(3, prefetch=False)  # slot 2
    t.pins[:] = 0
    t.issued([1], event="copy", now=0.0)  # 2's copy in flight
    assert t.claim(prefetch=True) == 2 and evicted == [False]  # only 3 could go
    t.own(4, 2, prefetch=True)
    assert t.claim(prefetch=True) is None  # 1 and 4 unread, 2 in flight
    assert t.claim(prefetch=False) is not None and evicted[-1] is True  # a demand miss may take a prediction


def test_claim_many_takes_free_slots_then_victims_in_policy_order():
    t, evicted = table(capacity=4)
    for e in (0, 1, 2):
        t.clock += 1
        t.take(e, prefetch=False)
    t.pins[:] = 0
    t.pins[t.slot_of[0]] = 1  # the oldest is held
    got = t.claim_many(3)
    assert got[0] == 3 and sorted(got[1:]) == [1, 2] and evicted == [False, False]
    assert t.slot_of[0] == 0 and len(t) == 1


def test_forget_gives_back_only_its_own_claims():
    t, _ = table()
    t.take(6, prefetch=False)
    t.forget([(6, 1), (3, 0)])  # neither matches what the table holds
    assert t.slot_of[6] == 0
    t.forget([(6, 0)])
    assert 6 not in t and t.pins[0] == 0 and len(t) == 0


def test_random_use_keeps_the_maps_inverse_and_pinned_slots_in_place():
    rng = random.Random(3)
    for policy in ("lru", "lfru", "lru2"):
        t = SlotTable(32, 6, POLICIES[policy]([]))
        for _ in range(2000):
            t.clock += 1
            before = {si: int(t.expert_of[si]) for si in np.flatnonzero(t.pins > 0)}
            op = rng.random()
            e = rng.randrange(32)
            if op < 0.5 and e not in t:
                t.take(e, prefetch=rng.random() < 0.3)
            elif op < 0.7 and e in t:
                t.touch(e, pin=rng.random() < 0.5)
            elif op < 0.8:
                t.claim_many(rng.randrange(1, 4))
            elif op < 0.9 and e in t and t.pins[t.slot_of[e]] == 0:  # a stale or failed copy's
                t.drop(e)
            else:
                t.pins[:] = 0  # a step gave its slots back
                before = {}
            held = np.flatnonzero(t.expert_of >= 0)
            assert len(t) == held.size
            assert (t.slot_of[t.expert_of[held]] == held).all()
            assert (t.expert_of[t.slot_of[t.slot_of >= 0]] == np.flatnonzero(t.slot_of >= 0)).all()
            for si, e0 in before.items():
                assert t.expert_of[si] == e0, "a pinned slot changed hands"
