"""The VRAM expert cache: a model whose experts do not fit in GPU memory, its experts streamed in
from host memory while the GPU computes (Post-Fetch), the misses of a small batch computed on the
CPU instead (hybrid compute).

Three tiers, each with its own statistics: the SSD (the expert store or pack), host RAM (the host
ExpertCache, storage/cache.py, its slots in pinned memory), and VRAM (here: per MoE layer, S slots
of gate/up/down stacks in the kernels' repacked layout, S = MOE_GPU_CACHE_MB per layer / expert
bytes).

One layer of a step (`fetch` right after routing; the routing came back to the host in the
router's one small copy):
1. `_decide` (its bookkeeping: experts/demand.py): the experts split into ready (in VRAM), in flight (in VRAM, a prefetch's or
   admission's copy not yet known done) and missing. The offload policy (experts/offload.py) may send
   missing ones to the CPU. The rest get a slot (the policy's victim among slots this step does
   not hold) and are copied on the fetch stream: every missing expert's gate and up first, then
   the downs, each projection's raw bytes from the host cache's pinned slot into a staging area
   (one batched driver call a chunk), repacked into the slots by one kernel. The layer's `gu`
   event is recorded after the gates and ups, its `down` event after the downs; the maps (ready,
   later, every GPU expert) are written.
2. `StagedBatch.compute` (the backend's expert_ffn) runs the ready experts' gate/up at once, makes
   the compute stream wait on `gu`, runs the copied ones', waits on `down`, and runs every GPU
   pair's down projection; the kernels skip pairs of experts not in the map they are given.
3. `after_gpu` (a host point: the GPU's work is queued) computes the CPU's experts' pairs, which a
   kernel scatters into the output; the slots are given back (the layer's `freed` event).
4. Up to MOE_POSTFETCH_MAX_TRANSFERS experts computed on the CPU are admitted into VRAM in the
   background (nothing waits for them now: their copies record the layer's `bg` event), so a
   burst of misses cannot stall a step.

A decode step whose every layer fits its experts in one wave is captured as CUDA graph segments
(`segmentable`; cuda_graphs.py): the host points of 1 and 3 cut it, and each replay runs segment,
`_decide`, segment, `after_gpu`, ... The captured work is every launch a step could need (both
gate/up launches, both waits, the scatter), steered by the maps and events `_decide` writes: the
same kernels on the same bytes as an eager step.

Invariants:
- A slot is never overwritten while a kernel may read it: a copy into a layer's slots first makes
  the fetch stream wait on the layer's `freed` event, recorded on the compute stream after the last
  kernels that read its slots.
- A host slot is never overwritten while a copy reads it: its host cache entry stays pinned until
  an event recorded after that copy is done.
- A wrong prediction wastes a slot, never corrupts one: a slot is only read after its copy, every
  read of an expert in flight waits on the layer's events, and the fetch stream runs in order, so
  an event recorded on it after a copy covers that copy.
- Bits: a pair's result depends on its row, its expert's bytes and its kernel, not on which launch
  or slot computed it, so with hybrid compute off tokens do not depend on any cache size or setting.

Fail-safe: a copy that fails (a CUDA error, or `Transfers.fault` in tests) or an in-flight copy not
done after STALE_S sends its expert to the CPU; a warning is logged once; the slot is dropped.

Legend: E = experts of a layer, S = VRAM slots of a layer, R = rows of a projection, rb = raw row
bytes, stride = repacked row bytes, T = rows of the step, A = experts per row, P = T*A pairs,
D = hidden size, F = expert FFN size.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import numpy as np
from numba import cuda

from ..kernels.cuda.device import upload, zero_fill
from ..kernels.cuda.layout import repack_into_slots, repacked_stride
from ..experts.policies import POLICIES
from ..experts.stats import RequestLog, VRAMStats
from ..experts import demand
from ..experts.slots import SlotTable
from ..storage.experts import PROJECTIONS, ExpertLayout, check_ids
from .base import pairs_on_cpu
from .cuda_errors import CUDA_ERRORS
from .cuda_weights import scatter_rows
from .cuda_staged import Decision, StagedBatch, Timer
from .cuda_transfer import Event, Transfers, pinned_empty
from ..experts.offload import CPUCostFit, OffloadPolicy, parse_min_batch

log = logging.getLogger("moed.device")

STALE_S = 5.0  # an in-flight copy not done this long after it was issued is taken as failed
_FIT_ROWS = 8  # steps of at most this many rows refit the CPU's cost (its per-token model is a decode GEMV's)


@dataclass(eq=False)
class _VLayer:
    layout: ExpertLayout
    capacity: int  # S
    stacks: tuple = ()  # gate, up: device uint8 [S, F, stride]; down: [S, D, stride]
    gate_up: object = None  # gate and up as one array [2S, F, stride] (when alike), stacks[0:2] its halves
    biases: tuple = (None, None, None)  # device f32 [E, F|D] or None
    table: SlotTable = None  # which expert each slot holds, pins, copies in flight
    requests: RequestLog = field(default_factory=RequestLog)  # each step's expert set (the Belady replay)
    maps: object = None  # device int32 [3, E]: ready now / after waits / every GPU expert
    map_rows: tuple = ()
    decision: Decision | None = None  # the current (or last) step's
    # events, recorded again each step: demand copies' gates and ups landed, their downs landed,
    # background copies landed (fetch stream); the slots' last readers done, x on the host (compute)
    gu: Event = field(default_factory=Event)
    down: Event = field(default_factory=Event)
    bg: Event = field(default_factory=Event)
    freed: Event = field(default_factory=Event)
    freed_set: bool = False  # freed recorded at least once
    x_ready: Event = field(default_factory=Event)
    timer: Timer = field(default_factory=Timer)
    stats: VRAMStats = field(default_factory=VRAMStats)


class _Hold:
    """What fetch returns: the staged batch in the block. Its slots are given back by the host
    point after the GPU's work (or here, if the block ended before it)."""

    __slots__ = ("cache", "vl", "batch")

    def __init__(self, cache, vl, batch):
        self.cache, self.vl, self.batch = cache, vl, batch

    def __enter__(self) -> StagedBatch:
        return self.batch

    def __exit__(self, *exc) -> None:
        if not self.batch.graph:
            self.cache._release(self.vl)


class VRAMExpertCache:
    """An expert provider over a host ExpertCache (see the module doc). Close it when done."""

    routing_free = False  # a step's copies depend on its routing: no CUDA graphs
    tiered = True  # over a host cache (the engine's stats and prefetcher use both)

    def __init__(self, host, backend, budget_bytes: int, policy: OffloadPolicy, *, eviction: str = "lru",
                 postfetch: bool = True, block_on_miss: bool = True, max_transfers: int = 4,
                 scratchpad_bytes: int = 0, force_cpu: bool = False, dedicated_stream: bool = True,
                 debug: bool = False, numerics: str = "ggml"):
        from .cpu import CPUBackend

        self.host = host
        self.backend = backend
        self.offload = policy
        self._cpu_fit = CPUCostFit()  # the CPU's cost as steps measure it (auto refits the policy with it)
        self.postfetch = postfetch
        self.block_on_miss = block_on_miss
        self.max_transfers = max_transfers
        self.force_cpu = force_cpu
        self.debug = debug
        self.eviction = eviction
        self.cpu = CPUBackend(numerics)
        backend.bind()
        self.transfers = Transfers(backend.stream, dedicated_stream)
        layouts = host.store.layouts
        n = max(len(layouts), 1)
        self.budget_bytes = budget_bytes
        per_layer = budget_bytes // n
        self._layers: dict[int, _VLayer] = {}
        self._warned: set[str] = set()
        self._reap_list: list = []  # (event, host hold): released once the event is done
        self._x_bufs: dict = {}  # (T, D) -> page-locked f32 [T, D]: x for the CPU's experts
        self._cpu_bufs: dict = {}  # (P, D) -> _CPUOut: their outputs, scattered in by the GPU
        self._first_layer = min(layouts) if layouts else -1
        self._counted = None  # the routing last counted toward stats' tokens
        self.vram_bytes = 0
        try:
            for il, lay in layouts.items():
                cap = 0 if force_cpu else min(lay.n_expert, per_layer // self._device_expert_bytes(lay))
                self._layers[il] = self._make_layer(il, lay, cap)
            self._staging_bytes = max(scratchpad_bytes, self._min_staging()) if not force_cpu else 0
            self._staging = self._zeros(self._staging_bytes) if self._staging_bytes else None
            self._slot_list = cuda.device_array(2 * max([lay.n_expert for lay in layouts.values()] or [1]), np.int32)
        except CUDA_ERRORS as e:  # out of memory: every expert computes on the CPU instead
            self._warn("alloc", "VRAM for the expert cache (%s MiB) could not be allocated (%s): experts compute "
                       "on the CPU", budget_bytes >> 20, e)
            self.force_cpu = True
            self._staging, self._staging_bytes, self._slot_list = None, 0, None
            self.vram_bytes = 0
            for il, lay in layouts.items():
                self._layers[il] = self._make_layer(il, lay, 0)
        self._staging_views: dict = {}
        self._slot_views: dict = {}
        backend.bytes["experts"] += self.vram_bytes  # the backend's VRAM tally (moed ps)
        # the scatter compiled now: a captured step launches it even if no eager step did
        one = cuda.device_array((1, 1), np.float32)
        scatter_rows(one, upload(np.full(1, -1, np.int32), backend.stream), one, backend.stream)

    @classmethod
    def from_settings(cls, host, backend, cfg, say=lambda _msg: None) -> VRAMExpertCache:
        """The cache daemon.config's settings describe, on backend.expert_budget bytes of VRAM; the
        offload cost model (MOE_OFFLOAD_MIN_BATCH=auto) calibrated now, and logged."""
        min_batch = parse_min_batch(cfg.offload_min_batch)
        budget = int(backend.expert_budget or 0)
        say(f"expert cache of {budget / 2**20:,.0f} MiB in VRAM on {backend.name}")
        cache = cls(host, backend, budget, OffloadPolicy(min_batch), eviction=cfg.gpu_cache_policy,
                    postfetch=cfg.postfetch_enable, block_on_miss=cfg.postfetch_block_on_miss,
                    max_transfers=cfg.postfetch_max_transfers,
                    scratchpad_bytes=int(cfg.postfetch_scratchpad_mb * 2**20), force_cpu=cfg.postfetch_force_cpu,
                    dedicated_stream=cfg.postfetch_use_dedicated_streams, debug=cfg.postfetch_debug,
                    numerics=cfg.numerics)
        try:
            if min_batch is None and not cache.force_cpu:
                say("measuring host-to-device and CPU expert throughput (MOE_OFFLOAD_MIN_BATCH=auto)")
                cache.offload = OffloadPolicy(None, *cache.calibrate())
            log.info("expert cache: %s MiB of VRAM, %s; offload: %s", budget >> 20,
                     ", ".join(f"{n} slots" for n in sorted({vl.capacity for vl in cache._layers.values()})),
                     cache.offload.describe())
        except BaseException:
            cache.close()
            raise
        return cache

    def calibrate(self) -> tuple[float, float, float]:
        """(pinned host-to-device bytes/s, CPU expert bytes/s per token, the CPU experts' fixed
        seconds a layer), measured on this machine: a 64 MiB pinned copy (best of 3); the first
        layer's experts on the CPU for one token, one and then `many` of them a call, after an untimed
        call (numba compiles its kernels at the first), best of 9 each, interleaved: the slope between
        the two is the throughput, the rest of one call the fixed cost."""
        from .cuda_transfer import pinned_empty

        tr = self.transfers
        src = pinned_empty(64 << 20)
        src[:] = 1
        dst = cuda.device_array(src.shape[0], np.uint8)
        start, end = Event(timing=True), Event(timing=True)
        best = float("inf")
        for _ in range(3):
            tr.record(start, tr.fetch)
            tr.h2d(dst, src)
            tr.record(end, tr.fetch)
            tr.synchronize(end)
            ms = tr.elapsed_ms(start, end)
            best = min(best, ms if ms > 0 else float("inf"))
        h2d = src.nbytes / (best / 1e3) if best != float("inf") else 25e9  # the simulator times nothing
        layer = self._first_layer
        lay = self.host.layout(layer)
        x = np.random.default_rng(0).standard_normal((1, lay.n_embd)).astype(np.float32)
        many = min(4, lay.n_expert)
        ids = list(range(many))
        with self.host.fetch(layer, ids, count=False) as batch:
            def timed(n: int) -> float:
                routed = np.arange(n, dtype=np.int64).reshape(1, n)  # one token, n experts
                t0 = time.perf_counter()
                self.cpu_pairs(x, routed, ids[:n], batch, lay, "silu", 0.0, 0.0)
                return time.perf_counter() - t0

            timed(many)  # compiles, warms
            one = all_ = float("inf")
            for _ in range(9):  # interleaved, so that a busy moment weighs on both alike
                one, all_ = min(one, timed(1)), min(all_, timed(many))
        per_expert = (all_ - one) / (many - 1) if many > 1 else one
        if per_expert <= 0:  # timer noise: all of one call is the expert
            per_expert = one
        return h2d, lay.expert_nbytes / per_expert, max(one - per_expert, 0.0)

    # -- construction --------------------------------------------------------------------------

    @staticmethod
    def _device_expert_bytes(lay: ExpertLayout) -> int:
        return sum(rows * repacked_stride(t, k) for rows, t, k in _projections(lay))

    def _make_layer(self, il: int, lay: ExpertLayout, cap: int) -> _VLayer:
        vl = _VLayer(lay, cap)
        vl.table = SlotTable(lay.n_expert, cap, POLICIES[self.eviction]([]),
                             on_evict=lambda wasted, vl=vl: _evicted(vl, wasted))
        vl.maps = cuda.device_array((3, lay.n_expert), np.int32)
        vl.map_rows = tuple(vl.maps[i] for i in range(3))
        if cap:
            (gr, gt, gk), up, (dr, dt, dk) = _projections(lay)
            down = self._zeros((cap, dr, repacked_stride(dt, dk)))
            if up == (gr, gt, gk):  # one allocation [2S, R, stride]: gate and up repacked by one launch
                vl.gate_up = self._zeros((2 * cap, gr, repacked_stride(gt, gk)))
                vl.stacks = (vl.gate_up[:cap], vl.gate_up[cap:], down)
            else:
                vl.stacks = (self._zeros((cap, gr, repacked_stride(gt, gk))),
                             self._zeros((cap, up[0], repacked_stride(up[1], up[2]))), down)
        vl.biases = tuple(None if b is None else upload(np.ascontiguousarray(b, np.float32))
                          for b in self.host.biases(il))
        self.vram_bytes += sum(int(s.nbytes) for s in vl.stacks) + int(vl.maps.nbytes) + sum(
            0 if b is None else int(b.nbytes) for b in vl.biases)
        return vl

    def _zeros(self, shape):
        a = cuda.device_array(shape, np.uint8)
        zero_fill(a)
        if isinstance(shape, int):
            self.vram_bytes += shape
        return a

    def _min_staging(self) -> int:
        """Room to copy up to 8 experts of the largest layer at once (each chunk: their gates and ups,
        or their downs)."""
        most = 0
        for vl in self._layers.values():
            gate, up, down = (vl.layout.nbytes(p) for p in PROJECTIONS)
            most = max(most, max(gate + up, down) * min(vl.capacity or 1, 8))
        return most

    # -- the provider interface ----------------------------------------------------------------

    def layout(self, layer: int) -> ExpertLayout:
        return self.host.layout(layer)

    def segmentable(self, pairs: int) -> bool:
        """Whether a decode step of `pairs` (row, expert) pairs may be captured as graph segments:
        every layer can hold all of its experts at once (one wave), with gate and up of one type
        (fused), and the GPU computes some."""
        return not self.force_cpu and all(
            vl.capacity >= min(pairs, vl.layout.n_expert) and vl.layout.gate_type == vl.layout.up_type
            for vl in self._layers.values())

    def waves(self, layer: int, ids) -> list[list[int]]:
        """Waves of at most the layer's slots (ready ones first); one when every expert computes on
        the CPU, or while a step is captured (segmentable: its ids are not known yet)."""
        vl = self._layer(layer)
        if self.backend.capturing:
            return [[]]
        ids = [int(e) for e in ids]
        if self.force_cpu or len(ids) <= vl.capacity or not vl.capacity:
            return [ids]
        order = sorted(ids, key=lambda e: e not in vl.table)
        room = max(vl.capacity, 1)
        return [order[i:i + room] for i in range(0, len(order), room)]

    def fetch(self, layer: int, ids, routed=None) -> _Hold:
        """The staged batch of `ids` (of the step's routing `routed` [T, A]). While a step is
        captured, `routed` is the router's page-locked copy: the decision is a host point, made at
        each replay from what it holds then."""
        vl = self._layer(layer)
        if self.backend.capturing:
            self.backend.host_point(lambda: self._decide(vl, layer, None, routed, graph=True), sync=True)
            return _Hold(self, vl, StagedBatch(self, vl, graph=True))
        self._decide(vl, layer, ids, routed)
        return _Hold(self, vl, StagedBatch(self, vl))

    def _decide(self, vl: _VLayer, layer: int, ids, routed, graph: bool = False) -> None:
        """The layer's decision for this step (module doc, 1): vl.decision."""
        if vl.decision is not None and not vl.decision.released:
            self._release(vl)  # a step that failed before giving its slots back
        whole = ids is None  # a replay: every expert of the routing the router just copied (one wave)
        if whole:
            routed = np.array(routed, np.int64)
            wanted = list(dict.fromkeys(routed.reshape(-1).tolist()))
        else:
            if routed is None:
                routed = np.array([list(ids)], np.int64)
            wanted = list(dict.fromkeys(int(e) for e in ids))
        check_ids(layer, wanted, vl.layout.n_expert)
        self._reap()
        self._fold_timer(vl)
        st = vl.stats
        table = vl.table
        table.clock += 1
        vl.requests.add(wanted)
        st.requests += len(wanted)
        if layer == self._first_layer and routed is not self._counted:  # once for all of a step's waves
            self._counted = routed
            st.tokens += routed.shape[0]
        tr = self.transfers

        def choose_cpu(missing):  # the offload policy, on the tokens each miss has this step
            counts = np.bincount(routed.reshape(-1), minlength=vl.layout.n_expert)
            return self.offload.on_cpu({e: int(counts[e]) for e in missing}, vl.layout.expert_nbytes)

        d = demand.decide(table, wanted, st, arrived=lambda si: tr.done(table.copied[si]), now=time.monotonic(),
                          stale_s=STALE_S, hybrid=self.offload.hybrid, block_on_miss=self.block_on_miss,
                          force_cpu=self.force_cpu, choose_cpu=choose_cpu, max_transfers=self.max_transfers)
        for key in d.warnings:
            self._warn(key, *_WARNINGS[key](self, vl))
        ready, flying, copy, cpu, admit = d.ready, d.flying, d.copy, d.cpu, d.admit
        host_ids = [e for e, _ in copy] + cpu + [e for e, _ in admit if e not in cpu]
        try:
            held = self.host.fetch(layer, host_ids, count=True) if host_ids else None
        except BaseException:  # a failed read (StorageError): nothing was copied, nothing stays held
            table.forget(copy + admit)
            for e in ready + flying:
                table.pins[table.slot_of[e]] -= 1
            raise
        host_batch = held.batch if held is not None else None
        copy_event = None
        failed = []
        if copy or admit:
            try:
                if copy:
                    tr.record(vl.timer.c[0], tr.fetch)
                    copy_event = self._copy_in(vl, copy, host_batch, background=False)
                    tr.record(vl.timer.c[1], tr.fetch)
                    vl.timer.copies = True
                if admit:
                    copy_event = self._copy_in(vl, admit, host_batch, background=True)
            except (*CUDA_ERRORS, OSError, RuntimeError, ValueError) as err:
                self._copy_failed(vl, copy + admit, err)
                failed = [e for e, _ in copy]
                st.fallbacks += len(failed)
                cpu += failed
                copy, admit, copy_event = [], [], None
                vl.timer.copies = False
            st.copied_demand += len(copy)
            st.admitted += len(admit)
        if flying and not copy:  # the fetch stream runs in order: these cover the copies in flight
            tr.record(vl.gu, tr.fetch)
            tr.record(vl.down, tr.fetch)
        later = flying + [e for e, _ in copy]
        rows = {e: int(table.slot_of[e]) for e in ready + later}
        maps = np.full((3, vl.layout.n_expert), -1, np.int32)
        for e in ready:
            maps[0, e] = rows[e]
        for e in later:
            maps[1, e] = rows[e]
        for e, si in rows.items():
            maps[2, e] = si
        tr.upload_into(vl.maps, maps, self.backend.stream)
        if graph:  # a replay records the waits' marks every step: read them when it waited on copies
            vl.timer.waits = bool(later)
        n_routed = len(wanted) if whole else len(set(routed.reshape(-1).tolist()))  # of every wave
        vl.decision = Decision(rows, later, cpu, list(rows.values()), held, routed, copy_event,
                               covers_all=len(rows) == n_routed)
        if self.debug:
            log.info("postfetch layer %d: %d experts, %d ready, %d in flight, %d copied (%.1f MiB), %d on the CPU "
                     "(%d fallbacks), %d admitted", layer, len(wanted), len(ready), len(flying), len(copy),
                     len(copy) * vl.layout.expert_nbytes / 2**20, len(cpu), len(failed), len(admit))

    def after_gpu(self, vl: _VLayer, T: int, P: int, layout, kind, alpha, limit) -> None:
        """The host point after a layer's GPU expert work is queued (module doc, 3)."""
        d = vl.decision
        try:
            out = self._cpu_bufs.get((P, layout.n_embd))
            if d.cpu:
                tr = self.transfers
                tr.synchronize(vl.x_ready)
                t0 = time.perf_counter()
                pairs, yc = self.cpu_pairs(self.x_host(T, layout.n_embd), d.routed, d.cpu, d.host_batch, layout,
                                           kind, alpha, limit)
                spent = time.perf_counter() - t0
                vl.stats.cpu_ms += spent * 1e3
                if self.offload.min_batch is None and T <= _FIT_ROWS:  # the cost model learns the CPU's real cost
                    self._cpu_fit.observe(pairs.size * vl.layout.expert_nbytes, spent)
                    self.offload = self._cpu_fit.refit(self.offload)
                out = self.cpu_out(P, layout.n_embd)
                padded = np.full(P, -1, np.int32)
                padded[:pairs.size] = pairs
                tr.upload_into(out.y, yc, self.backend.stream)
                tr.upload_into(out.pairs, padded, self.backend.stream)
                out.dirty = True
            elif out is not None and out.dirty:  # a captured step scatters every layer: nothing this time
                self.transfers.upload_into(out.pairs, np.full(P, -1, np.int32), self.backend.stream)
                out.dirty = False
        finally:
            self._release(vl)

    def x_host(self, T: int, D: int) -> np.ndarray:
        """Page-locked f32 [T, D]: a layer's x for its CPU experts (one for all layers: each is read
        before the next layer's is written)."""
        buf = self._x_bufs.get((T, D))
        if buf is None:
            buf = self._x_bufs[(T, D)] = pinned_empty((T, D), np.float32)
        return buf

    def cpu_out(self, P: int, D: int) -> _CPUOut:
        """Device buffers of the CPU experts' outputs (one for all layers, written in stream order)."""
        out = self._cpu_bufs.get((P, D))
        if out is None:
            out = self._cpu_bufs[(P, D)] = _CPUOut(cuda.device_array((P, D), np.float32),
                                                   upload(np.full(P, -1, np.int32)))
        return out

    def prefetch(self, layer: int, ids) -> None:
        """Predicted experts (Path A, speculative): read into host memory, and copied into free or
        evictable VRAM slots when already there (at most MOE_POSTFETCH_MAX_TRANSFERS a call)."""
        vl = self._layers.get(layer)
        if vl is None:
            return
        ids = [int(e) for e in dict.fromkeys(ids)]
        self.host.prefetch(layer, ids)
        if self.force_cpu or not vl.capacity:
            return
        table = vl.table
        todo = [e for e in self.host.ready(layer, [e for e in ids if e not in table])][:self.max_transfers]
        items = []
        for e in todo:
            si = table.take(e, prefetch=True)
            if si is None:
                break
            items.append((e, si))
        if not items:
            return
        try:
            held = self.host.fetch(layer, [e for e, _ in items], count=False)
        except BaseException:
            table.forget(items)
            raise
        try:
            ev = self._copy_in(vl, items, held.batch, background=True)
        except (*CUDA_ERRORS, OSError, RuntimeError, ValueError) as err:
            self._copy_failed(vl, items, err)
            held.__exit__(None, None, None)
            return
        for _e, si in items:
            table.prefetched[si], table.used[si] = True, False
        vl.stats.prefetch_issued += len(items)
        self._reap_list.append((ev, held))

    def holds_all(self, layer: int) -> bool:
        vl = self._layers.get(layer)
        return vl is not None and vl.table.holds_all()

    def begin_pass(self, rows: int = 0) -> None:
        self.host.begin_pass()

    # -- work ----------------------------------------------------------------------------------

    def cpu_pairs(self, x_host, routed, cpu_ids, host_batch, layout, kind, alpha, limit):
        """The pairs of the CPU's experts, computed by the CPU backend from host memory:
        -> (pair indices [Pc], outputs [Pc, D])."""
        flat = routed.reshape(-1)
        pairs = np.flatnonzero(np.isin(flat, np.asarray(cpu_ids)))
        return pairs, pairs_on_cpu(self.cpu, x_host, flat, pairs, routed.shape[1], host_batch, layout, kind, alpha, limit)

    def _copy_in(self, vl: _VLayer, items: list, host_batch, background: bool) -> Event:
        """Copy experts (expert, slot) from the host batch into their slots on the fetch stream:
        every gate and up, then every down, in chunks the staging area holds, each chunk's
        projections repacked by one launch (gate and up together when alike). A step's own
        copies record the layer's gu and down events, background ones its bg event. -> the last
        event recorded."""
        tr = self.transfers
        fs = tr.fetch
        if vl.freed_set:
            tr.wait(fs, vl.freed)  # the slots' earlier experts' last kernels have run
        lay, S = vl.layout, vl.capacity
        (gr, gt, _), (ur, ut, _), (dr, dt, _) = _projections(lay)
        g_rb, u_rb, d_rb = (lay.shape(p)[1] for p in PROJECTIONS)
        fit = max(1, self._staging_bytes // max(gr * g_rb + ur * u_rb, dr * d_rb))  # experts a chunk
        chunks = [items[c0:c0 + fit] for c0 in range(0, len(items), fit)]
        # per chunk [its slots, the same + S] (the joint gate/up targets), uploaded once: the down and
        # a lone gate or up read the first half
        slots = np.array([si for _, si in items], np.int32)
        tr.upload_into(self._slot_list, np.concatenate(
            [np.concatenate([slots[c0:c0 + fit], slots[c0:c0 + fit] + S]) for c0 in range(0, len(items), fit)]), fs)
        at = 0
        for chunk in chunks:
            m = len(chunk)
            one, both = self._slot_view(at, m), self._slot_view(at, 2 * m)
            if vl.gate_up is not None:
                tr.h2d_many(self._staging, [((p * m + i) * gr * g_rb, host_batch_view(host_batch, p, e))
                                            for p in (0, 1) for i, (e, _si) in enumerate(chunk)])
                repack_into_slots(self._staging_view(2 * m, gr, g_rb), vl.gate_up, both, gt, stream=fs)
            else:
                for p, rows, rb, t in ((0, gr, g_rb, gt), (1, ur, u_rb, ut)):
                    tr.h2d_many(self._staging, [(i * rows * rb, host_batch_view(host_batch, p, e))
                                                for i, (e, _si) in enumerate(chunk)])
                    repack_into_slots(self._staging_view(m, rows, rb), vl.stacks[p], one, t, stream=fs)
            at += 2 * m
        if not background:
            tr.record(vl.gu, fs)
        at = 0
        for chunk in chunks:
            m = len(chunk)
            tr.h2d_many(self._staging, [(i * dr * d_rb, host_batch_view(host_batch, 2, e))
                                        for i, (e, _si) in enumerate(chunk)])
            repack_into_slots(self._staging_view(m, dr, d_rb), vl.stacks[2], self._slot_view(at, m), dt, stream=fs)
            at += 2 * m
        last = tr.record(vl.bg if background else vl.down, fs)
        vl.table.issued([si for _e, si in items], last, time.monotonic())
        vl.stats.loads += len(items)
        vl.stats.bytes_copied += len(items) * vl.layout.expert_nbytes
        return last

    def _slot_view(self, at: int, n: int):
        """The slot list's entries at..at+n (views made once)."""
        key = (at, n)
        v = self._slot_views.get(key)
        if v is None:
            v = self._slot_views[key] = self._slot_list[at:at + n]
        return v

    def _staging_view(self, n: int, rows: int, rb: int):
        """The staging area's first n experts of [rows, rb] (views made once)."""
        key = (n, rows, rb)
        v = self._staging_views.get(key)
        if v is None:
            v = self._staging_views[key] = self._staging[:n * rows * rb].reshape(n, rows, rb)
        return v

    def _fold_timer(self, vl: _VLayer) -> None:
        """The layer's last timed copies and waits into its stats (done by now: the compute stream
        has passed them; else waited for)."""
        t, tr = vl.timer, self.transfers
        if t.copies:
            tr.synchronize(t.c[1])
            vl.stats.copy_ms += tr.elapsed_ms(*t.c)
        if t.waits:
            tr.synchronize(t.w[3])
            vl.stats.stall_ms += tr.elapsed_ms(t.w[0], t.w[1]) + tr.elapsed_ms(t.w[2], t.w[3])
        t.copies = t.waits = False

    # -- bookkeeping ---------------------------------------------------------------------------

    def _layer(self, layer: int) -> _VLayer:
        vl = self._layers.get(layer)
        if vl is None:
            self.host.layout(layer)  # raises GGUFError naming the layer
        return vl

    def _copy_failed(self, vl: _VLayer, items: list, err: BaseException) -> None:
        self._warn("copy", "an expert copy to %s failed (%s): such experts compute on the CPU", self.backend.name, err)
        vl.table.forget(items)

    def _release(self, vl: _VLayer) -> None:
        """Give back the slots of the layer's decision (its kernels are queued) and hand its host
        pins to the reaper."""
        d = vl.decision
        if d is None or d.released:
            return
        d.released = True
        for si in d.used:
            vl.table.pins[si] -= 1
        if d.used:
            self.transfers.record(vl.freed, self.backend.stream)
            vl.freed_set = True
        if d.host_held is not None:
            if d.copy_event is None:
                d.host_held.__exit__(None, None, None)
            else:  # a copy may still read the host slots
                self._reap_list.append((d.copy_event, d.host_held))

    def _reap(self) -> None:
        """Release host pins whose copies are done; fold finished timing samples."""
        if self._reap_list:
            keep = []
            for ev, held in self._reap_list:
                if self.transfers.done(ev):
                    held.__exit__(None, None, None)
                else:
                    keep.append((ev, held))
            self._reap_list = keep

    def _warn(self, key: str, msg: str, *args) -> None:
        if key not in self._warned:
            self._warned.add(key)
            log.warning(msg, *args)

    # -- stats and life ------------------------------------------------------------------------

    def stats(self) -> dict:
        """The VRAM tier's counters per layer and in total, with a Belady and an LRU replay of the
        same requests at the same capacity (what an oracle would have hit), over the last
        256-512 steps of each layer kept, counted from the last reset_stats."""
        for vl in self._layers.values():
            self._fold_timer(vl)
        total = VRAMStats()
        per = {}
        belady_hits = lru_hits = replayed = 0
        for il, vl in self._layers.items():
            total.add(vl.stats)
            per[il] = vl.stats.summary() | {"capacity": vl.capacity, "cached": len(vl.table)}
            if vl.requests.counted and vl.capacity and not self.force_cpu:
                b = vl.requests.replay(vl.capacity, "belady")
                r = vl.requests.replay(vl.capacity, self.eviction)
                belady_hits += b.hits
                lru_hits += r.hits
                replayed += b.hits + b.misses
        out = total.summary()
        out.update({"budget_bytes": self.budget_bytes, "vram_bytes": self.vram_bytes, "policy": self.eviction,
                    "offload": self.offload.describe(), "postfetch": self.postfetch,
                    "block_on_miss": self.block_on_miss, "force_cpu": self.force_cpu,
                    "replayed_requests": replayed,
                    "belady_hit_rate": round(belady_hits / replayed, 6) if replayed else None,
                    f"{self.eviction}_replay_hit_rate": round(lru_hits / replayed, 6) if replayed else None,
                    "layers": per})
        return out

    def reset_stats(self) -> None:
        for vl in self._layers.values():
            self._fold_timer(vl)
            vl.stats = VRAMStats()
            vl.requests.reset()

    def close(self) -> None:
        self.backend.stream.synchronize()
        if self.transfers.fetch is not self.backend.stream:
            self.transfers.fetch.synchronize()
        for _ev, held in self._reap_list:
            held.__exit__(None, None, None)
        self._reap_list = []
        for vl in self._layers.values():
            vl.stacks, vl.maps, vl.map_rows = (), None, ()
        self._staging = None
        self._staging_views.clear()
        self.backend.bytes["experts"] -= self.vram_bytes
        self.vram_bytes = 0
        self.host.close()


class _CPUOut:
    """Device buffers the CPU's pairs of a layer are scattered from: y f32 [P, D], pairs int32 [P]
    (-1 past the last: skipped); dirty: pairs holds some."""

    __slots__ = ("y", "pairs", "dirty")

    def __init__(self, y, pairs):
        self.y, self.pairs, self.dirty = y, pairs, False


_WARNINGS = {  # demand.decide's warnings -> (message, args), each logged once
    "stale": lambda c, vl: ("an expert copy to %s did not complete in %.0f s: its experts compute on the CPU",
                            c.backend.name, STALE_S),
    "noslot": lambda c, vl: ("MOE_GPU_CACHE_MB leaves no VRAM slot for a layer's experts (%.1f MiB each): "
                             "they compute on the CPU", c._device_expert_bytes(vl.layout) / 2**20),
    "full": lambda c, vl: ("a layer's VRAM slots were all in use: an expert computes on the CPU",),
}


def _evicted(vl: _VLayer, wasted: bool) -> None:
    vl.stats.evictions += 1
    if wasted:
        vl.stats.prefetch_wasted += 1


def _projections(lay: ExpertLayout) -> tuple:
    """(rows, ggml type, K) of gate, up and down."""
    return ((lay.n_ff, lay.gate_type, lay.n_embd), (lay.n_ff, lay.up_type, lay.n_embd),
            (lay.n_embd, lay.down_type, lay.n_ff))


def host_batch_view(batch, p: int, e: int) -> np.ndarray:
    """Expert e's raw rows of projection p in a host batch: uint8 [R, rb], C-contiguous."""
    stack = (batch.gate, batch.up, batch.down)[p]
    return stack[batch.rows[e]]

