"""One step's demand on a layer of the VRAM expert cache, decided against its slot table: which
experts are ready in VRAM, which are still arriving, which are copied into which slots, which the
CPU computes, and which are admitted into VRAM after the CPU computed them. Bookkeeping only
(the table and the stats); the CUDA adapter (backend/cuda_expert_cache.py) reads the host cache,
issues the copies and writes the device maps.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterable

from .slots import SlotTable
from .stats import VRAMStats


@dataclass
class Demand:
    ready: list[int] = field(default_factory=list)  # in VRAM, their copies known done
    flying: list[int] = field(default_factory=list)  # in VRAM, a copy still in flight: wait for it
    copy: list[tuple[int, int]] = field(default_factory=list)  # (expert, slot): copied for this step
    cpu: list[int] = field(default_factory=list)  # computed on the CPU
    admit: list[tuple[int, int]] = field(default_factory=list)  # (expert, slot): CPU ones copied in after
    warnings: list[str] = field(default_factory=list)  # "stale", "noslot", "full"


def decide(table: SlotTable, wanted: Iterable[int], st: VRAMStats, *, arrived: Callable[[int], bool], now: float,
           stale_s: float, hybrid: bool, block_on_miss: bool, force_cpu: bool,
           choose_cpu: Callable[[list[int]], set], max_transfers: int) -> Demand:
    """The layer's demand for `wanted` (distinct experts) this step. arrived(slot): its copy is
    done; a copy in flight longer than stale_s is taken as failed (the CPU computes the expert).
    choose_cpu(missing): the misses the offload policy sends to the CPU (hybrid compute). Slots
    read this step are pinned; the step's copies claim theirs (victims by the table's policy)."""
    d = Demand()
    missing, fallback = [], []
    for e in wanted:
        si = table.slot(e)
        if si is None:
            missing.append(e)
            continue
        st.hits += 1
        if table.prefetched[si] and not table.used[si]:
            st.prefetch_used += 1
        table.used[si] = True
        if table.pending[si] and arrived(si):
            table.pending[si] = False
        if not table.pending[si]:
            d.ready.append(e)
        elif now - table.issued_at[si] > stale_s:  # a copy that never completes: the CPU computes it
            d.warnings.append("stale")
            table.drop(e)
            fallback.append(e)
        elif not block_on_miss and hybrid:
            fallback.append(e)  # not arrived yet, and the settings say not to wait
        else:
            d.flying.append(e)
    st.misses += len(missing)
    if force_cpu:
        d.cpu = missing + d.ready + d.flying
        st.cpu_forced += len(d.cpu)
        d.ready, d.flying, missing = [], [], []
    elif missing:
        chosen = set(missing) if hybrid and not block_on_miss else choose_cpu(missing) if hybrid else set()
        d.cpu = [e for e in missing if e in chosen]
        st.cpu_hybrid += len(d.cpu)
        missing = [e for e in missing if e not in chosen]
    st.fallbacks += len(fallback)
    d.cpu += fallback
    for e in d.ready + d.flying:
        table.touch(e, pin=True)
    if missing and not table.capacity:
        d.warnings.append("noslot")
    claimed = table.claim_many(len(missing)) if table.capacity and missing else []
    for e, si in zip(missing, claimed + [None] * (len(missing) - len(claimed))):
        if si is None:  # every slot held by this step (waves prevent it): the CPU computes it
            if table.capacity:
                d.warnings.append("full")
            st.fallbacks += 1
            d.cpu.append(e)
            continue
        table.own(e, si, prefetch=False)
        d.copy.append((e, si))
    if d.cpu and not force_cpu:  # a burst of misses on the CPU is copied in beside, for later steps
        for e in d.cpu[:max_transfers]:
            if e in table:
                continue
            si = table.take(e, prefetch=True)
            if si is None:
                break
            d.admit.append((e, si))
    return d
