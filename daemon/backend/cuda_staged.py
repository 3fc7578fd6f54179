"""What a VRAM expert cache's fetch hands the backend (its counters: experts/stats.py).

`StagedBatch.compute` (CUDABackend.expert_ffn) orders a layer's expert work by arrival: the ready
experts' gate/up at once, the copied experts' after a wait on the layer's gate/up event, the down
projection of every GPU pair after a wait on its down event, and the CPU's experts computed on
the host meanwhile (a host point) and scattered in (cuda_expert_cache.py describes the whole).

Legend: T = rows of the step, A = experts per row, P = T*A pairs, D = hidden size, F = expert FFN size.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from .cuda_transfer import Event, Transfers
from .cuda_weights import put_rows, scatter_rows


class _Rows(dict):
    """expert -> slot of a staged batch's GPU experts, with the device map kernels read."""

    def __init__(self, rows: dict, device):
        super().__init__(rows)
        self.device = device


@dataclass(eq=False)
class Decision:
    """What the host decided for one layer of one step, right after its routing (the cache's
    `_decide`): read by the layer's expert work and by the host work after it."""
    rows: dict  # expert -> slot of every GPU expert
    later: list  # ... of those, the ones whose copies the compute stream waits on
    cpu: list  # experts computed on the CPU
    used: list  # slots this step pins until its kernels are enqueued
    host_held: object  # the host cache's hold (or None)
    routed: np.ndarray  # the step's ids [T, A]
    copy_event: object  # the last event of the copies this step issued (host slots stay pinned till then)
    covers_all: bool  # the GPU maps hold every expert the step routed to (no CPU pair, no other wave)
    released: bool = False

    @property
    def host_batch(self):
        return None if self.host_held is None else self.host_held.batch


@dataclass(eq=False)
class StagedBatch:
    """A layer's experts for one step, some still arriving (see the module doc). graph: made while
    the step is captured: its work is every launch a step could need, steered by the maps and
    events the host point before it writes; else only what this step's decision needs."""
    cache: object  # the VRAMExpertCache
    vl: object  # its layer's state there
    graph: bool = False

    def __post_init__(self):
        vl = self.vl
        self.gate, self.up, self.down = vl.stacks if vl.stacks else (None, None, None)
        self.gate_bias, self.up_bias, self.down_bias = vl.biases
        d = None if self.graph else vl.decision
        self.rows = _Rows({} if d is None else d.rows, vl.map_rows[2])  # every GPU expert (its map: maps[2])

    def compute(self, backend, x, layout, plan, kind, alpha, limit):
        """x [T, D] prepared -> [P, D]: every pair's expert, GPU and CPU."""
        c, vl, full = self.cache, self.vl, self.graph
        tr, stream = c.transfers, backend.stream
        d = None if full else vl.decision
        T, P, F, D = plan.T, plan.T * plan.A, layout.n_ff, layout.n_embd
        x_host, cpu_out = c.x_host(T, D), c.cpu_out(P, D)  # made by the eager step before a capture
        ext = backend.capturing  # events recorded or waited on outside the graph
        cpu = full or bool(d.cpu)
        if cpu:  # the CPU's experts read x once the stream has it
            tr.d2h(x_host, x.x, stream)
            tr.record(vl.x_ready, stream, external=ext)
        y = None
        if full or d.rows:
            later = full or bool(d.later)
            # pairs no GPU map covers (the CPU's, a later wave's) stay zero: their rows are quantized too
            partial = full or not d.covers_all
            h = backend.zeros((P, F)) if partial else backend.empty((P, F))  # [P, F]
            fused = layout.up_type == layout.gate_type and not any(seg.tiled for seg in plan.segments)
            w = vl.timer.w
            if later and not full:
                vl.timer.waits = True  # (a graph's marks are read when its step had copies: _decide)
            if later and c.postfetch and fused:  # ready experts now, the copied ones after their events
                backend.expert_glu(x, self, layout, replace(plan, slot_of=vl.map_rows[0]), kind, alpha, limit, out=h)
                _waits(tr, stream, w[0], w[1], (vl.gu,), ext)
                backend.expert_glu(x, self, layout, replace(plan, slot_of=vl.map_rows[1]), kind, alpha, limit, out=h)
                _waits(tr, stream, w[2], w[3], (vl.down,), ext)
            else:  # every copy first (Post-Fetch off, or a prefill's tiled kernels)
                if later:
                    _waits(tr, stream, w[0], w[1], (vl.gu, vl.down), ext)
                    _waits(tr, stream, w[2], w[3], (), ext)
                if fused:
                    backend.expert_glu(x, self, layout, plan, kind, alpha, limit, out=h)
                else:
                    hg = backend.expert_glu(x, self, layout, plan, kind, alpha, limit)
                    if partial:
                        held = np.flatnonzero(np.isin(d.routed.reshape(-1), list(d.rows))).astype(np.int32)
                        put_rows(hg, backend.put(held), h, stream)  # h[held] = hg[held]
                    else:
                        h = hg
            y = backend.expert_linear(h, self.down, layout.down_type, layout.n_ff, plan, self.down_bias,
                                      per_token=False)  # [P, D]
        if y is None:
            y = backend.empty((P, D))
        # the CPU's pairs, computed while the GPU runs the rest, then every slot given back
        backend.host_point(lambda: c.after_gpu(vl, T, P, layout, kind, alpha, limit), sync=False)
        if cpu:
            scatter_rows(cpu_out.y, cpu_out.pairs, y, stream)  # pairs < 0 (padding) are skipped
        return y


def _waits(tr: Transfers, stream, before: Event, after: Event, events: tuple, external: bool) -> None:
    """`stream` waits on each event, between two timing marks."""
    tr.record(before, stream, external)
    for ev in events:
        tr.wait(stream, ev, external)
    tr.record(after, stream, external)


class Timer:
    """A layer's timing events, reused every step: its demand copies on the fetch stream (c: start,
    end) and the compute stream's two waits (w: before and after each); `copies`/`waits`: recorded
    for the current step and not yet read into the stats."""

    __slots__ = ("c", "w", "copies", "waits")

    def __init__(self):
        self.c = (Event(timing=True), Event(timing=True))
        self.w = tuple(Event(timing=True) for _ in range(4))
        self.copies = self.waits = False
