"""What a VRAM expert cache's fetch hands the backend, and the cache's counters.

`StagedBatch.compute` (CUDABackend.expert_ffn) orders a layer's expert work by arrival: the ready
experts' gate/up at once, each copied expert's after a wait on its own gate/up event, the down
projection of every GPU pair after a wait on each down event, and the CPU's experts computed on
the host meanwhile and scattered in (cuda_expert_cache.py describes the whole).

Legend: T = rows of the step, A = experts per row, P = T*A pairs, D = hidden size, F = expert FFN size.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, replace

import numpy as np

from .base import compose_expert_ffn
from .cuda_transfer import Event, Transfers
from .cuda_weights import scatter_rows


@dataclass
class VRAMStats:
    requests: int = 0  # experts asked for by steps (unique within a step's layer)
    hits: int = 0  # ... in VRAM (ready, or a copy in flight)
    misses: int = 0  # ... not in VRAM
    loads: int = 0  # experts copied in (demand, prefetch and admission)
    evictions: int = 0
    bytes_copied: int = 0
    copied_demand: int = 0  # misses copied for the step that asked
    cpu_hybrid: int = 0  # misses computed on the CPU by the offload policy's choice
    cpu_forced: int = 0  # experts computed on the CPU under MOE_POSTFETCH_FORCE_CPU
    fallbacks: int = 0  # experts computed on the CPU because the GPU could not serve them
    admitted: int = 0  # CPU-computed misses copied in the background
    prefetch_issued: int = 0
    prefetch_used: int = 0
    prefetch_wasted: int = 0
    tokens: int = 0  # rows routed through the first MoE layer (bytes per token)
    copy_ms: float = 0.0  # fetch-stream time of demand copies (timing events)
    stall_ms: float = 0.0  # compute-stream time spent waiting on them
    cpu_ms: float = 0.0  # host time computing CPU experts

    def add(self, other: VRAMStats) -> None:
        for k, v in asdict(other).items():
            setattr(self, k, getattr(self, k) + v)

    def summary(self) -> dict:
        d = asdict(self)
        routed = self.requests or 1
        d["hit_rate"] = round(self.hits / routed, 6)
        d["fallback_rate"] = round(self.fallbacks / routed, 6)
        d["overlap_pct"] = round(100.0 * (1.0 - self.stall_ms / self.copy_ms), 2) if self.copy_ms > 0 else None
        d["bytes_per_token"] = round(self.bytes_copied / self.tokens) if self.tokens else 0
        d["h2d_gbps"] = round(self.bytes_copied / (self.copy_ms * 1e6), 2) if self.copy_ms > 0 else None
        return d


class _Rows(dict):
    """expert -> slot of a staged batch's GPU experts, with the device map kernels read."""

    def __init__(self, rows: dict, device):
        super().__init__(rows)
        self.device = device


@dataclass(eq=False)
class StagedBatch:
    """A layer's experts for one step, some still arriving (see the module doc)."""
    gate: object
    up: object
    down: object
    rows: _Rows  # every GPU expert (its map: maps[2])
    gate_bias: object
    up_bias: object
    down_bias: object
    ready_map: object  # device int32 [E]: experts usable at once
    later_map: object  # ... experts whose copies the compute stream waits on
    gu_waits: list  # their gate/up events
    down_waits: list  # their down events
    cpu_ids: list  # experts computed on the CPU
    host: object  # host ExpertBatch of the CPU experts (and of the copied ones)
    routed: np.ndarray  # the step's ids [T, A]
    cache: object  # the VRAMExpertCache that made it
    vl: object  # its layer's state there
    copy_timer: tuple | None = None  # timing events around this step's demand copies
    covers_all: bool = True  # the GPU maps hold every expert the step routed to (no CPU pair, no other wave)

    def compute(self, backend, x, layout, plan, kind, alpha, limit):
        """x [T, D] prepared -> [P, D]: every pair's expert, GPU and CPU."""
        c = self.cache
        tr, stream = c.transfers, backend.stream
        x_host = backend.to_host(x.x) if self.cpu_ids else None  # the router just synced: no wait
        P, F = plan.T * plan.A, layout.n_ff
        y = None
        if self.rows:
            # pairs no GPU map covers (the CPU's, a later wave's) stay zero: their rows are quantized too
            partial = not self.covers_all
            h = backend.zeros((P, F)) if partial else backend.empty((P, F))  # [P, F]
            fused = layout.up_type == layout.gate_type and not any(seg.tiled for seg in plan.segments)
            timer = _Timer(self.copy_timer) if self.gu_waits else None
            if timer is not None and c.postfetch and fused:  # ready experts now, each copied one after its event
                backend.expert_glu(x, self, layout, replace(plan, slot_of=self.ready_map), kind, alpha, limit, out=h)
                _waits(tr, stream, timer, 0, self.gu_waits)
                backend.expert_glu(x, self, layout, replace(plan, slot_of=self.later_map), kind, alpha, limit, out=h)
                _waits(tr, stream, timer, 2, self.down_waits)
            else:  # every copy first (Post-Fetch off, or a prefill's tiled kernels)
                if timer is not None:
                    _waits(tr, stream, timer, 0, self.gu_waits + self.down_waits)
                    _waits(tr, stream, timer, 2, [])
                if fused:
                    backend.expert_glu(x, self, layout, plan, kind, alpha, limit, out=h)
                else:
                    hg = backend.expert_glu(x, self, layout, plan, kind, alpha, limit)
                    if partial:
                        held = np.flatnonzero(np.isin(self.routed.reshape(-1), list(self.rows))).astype(np.int32)
                        scatter_rows(hg, backend.put(held), h, stream)
                    else:
                        h = hg
            y = backend.expert_linear(h, self.down, layout.down_type, layout.n_ff, plan, self.down_bias,
                                      per_token=False)  # [P, D]
            if timer is not None:
                c._timers.append((self.vl, timer))
        if self.cpu_ids:
            t0 = time.perf_counter()
            pairs, yc = c.cpu_pairs(x_host, self.routed, self.cpu_ids, self.host, layout, kind, alpha, limit)
            self.vl.stats.cpu_ms += (time.perf_counter() - t0) * 1e3
            if y is None:
                y = backend.empty((P, layout.n_embd))
            scatter_rows(backend.put(yc), backend.put(pairs.astype(np.int32)), y, stream)
        return y


def _waits(tr: Transfers, stream, timer: _Timer, i: int, events: list) -> None:
    """`stream` waits on each event, between timing marks i and i+1."""
    timer.mark(tr, stream, i)
    for ev in events:
        tr.wait(stream, ev)
    timer.mark(tr, stream, i + 1)


class _Timer:
    """Timing events of one layer's step: its demand copies on the fetch stream (c: start, end;
    None without copies) and the compute stream's two waits (w: before and after each)."""

    __slots__ = ("c", "w")

    def __init__(self, copies: tuple | None):
        self.c = copies
        self.w = tuple(Event(timing=True) for _ in range(4))

    def mark(self, tr: Transfers, stream, i: int) -> None:
        tr.record(self.w[i], stream)
