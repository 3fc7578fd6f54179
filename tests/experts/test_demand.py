"""One step's demand on a layer of the VRAM expert cache (daemon/experts/demand.py), on the CPU:
ready, in flight, copied, on the CPU, admitted, against a slot table and its stats."""

from __future__ import annotations

from daemon.experts.demand import decide
from daemon.experts.policies import POLICIES
from daemon.experts.slots import SlotTable
from daemon.experts.stats import VRAMStats


def _table(n_expert: int = 8, capacity: int = 3) -> SlotTable:
    return SlotTable(n_expert, capacity, POLICIES["lru"]([]))


def _decide(table, wanted, st=None, *, arrived=lambda si: True, now=0.0, hybrid=False, block_on_miss=True,
            force_cpu=False, choose_cpu=lambda missing: set(), max_transfers=4):
    return decide(table, wanted, st or VRAMStats(), arrived=arrived, now=now, stale_s=5.0, hybrid=hybrid,
                  block_on_miss=block_on_miss, force_cpu=force_cpu, choose_cpu=choose_cpu,
                  max_transfers=max_transfers)


def test_misses_claim_free_slots_and_are_copied():
    table, st = _table(), VRAMStats()
    d = _decide(table, [4, 1], st)
    assert d.copy == [(4, 0), (1, 1)] and not d.ready and not d.cpu
    assert table.slot(4) == 0 and table.pins[0] == 1  # the step reads it: pinned
    assert (st.hits, st.misses) == (0, 2)


def test_held_experts_are_ready_or_in_flight():
    table = _table()
    table.issued([table.take(2, prefetch=True)], event="e2", now=0.0)  # slot 0, copy in flight
    table.take(3, prefetch=False)  # slot 1, already there
    table.pins[:] = 0
    d = _decide(table, [2, 3], arrived=lambda si: False, now=1.0)
    assert d.flying == [2] and d.ready == [3] and not d.copy
    d = _decide(table, [2], arrived=lambda si: True, now=1.0)  # its copy is done now
    assert d.ready == [2] and not table.pending[0]


def test_a_copy_in_flight_too_long_goes_to_the_cpu():
    table, st = _table(), VRAMStats()
    table.issued([table.take(2, prefetch=True)], event="e2", now=0.0)
    d = _decide(table, [2], st, arrived=lambda si: False, now=6.0)
    assert d.cpu == [2] and "stale" in d.warnings
    assert d.admit == [(2, 0)]  # its slot dropped, then a fresh copy admitted in the background
    assert st.fallbacks == 1


def test_every_slot_pinned_sends_the_rest_to_the_cpu():
    table, st = _table(capacity=2), VRAMStats()
    d = _decide(table, [0, 1, 2], st)
    assert [e for e, _ in d.copy] == [0, 1] and d.cpu == [2] and "full" in d.warnings
    assert st.fallbacks == 1


def test_no_slots_at_all_warns_and_computes_on_the_cpu():
    d = _decide(_table(capacity=0), [5])
    assert d.cpu == [5] and "noslot" in d.warnings and not d.copy


def test_hybrid_sends_what_the_policy_chooses_and_admits_it_after():
    table, st = _table(capacity=4), VRAMStats()
    d = _decide(table, [1, 2, 3], st, hybrid=True, choose_cpu=lambda missing: {2, 3}, max_transfers=1)
    assert [e for e, _ in d.copy] == [1] and d.cpu == [2, 3]
    assert [e for e, _ in d.admit] == [2]  # at most max_transfers copied in beside, for later steps
    assert st.cpu_hybrid == 2


def test_without_waiting_every_miss_and_arrival_goes_to_the_cpu():
    table = _table()
    table.issued([table.take(2, prefetch=True)], event="e2", now=0.0)
    d = _decide(table, [2, 6], hybrid=True, block_on_miss=False, arrived=lambda si: False, now=1.0,
                choose_cpu=lambda missing: set())
    assert set(d.cpu) == {2, 6} and not d.copy and not d.flying


def test_force_cpu_computes_everything_there():
    table, st = _table(), VRAMStats()
    table.take(3, prefetch=False)
    table.pins[:] = 0
    d = _decide(table, [3, 4], st, force_cpu=True)
    assert d.cpu == [4, 3] and not d.ready and not d.copy and not d.admit
    assert st.cpu_forced == 2
