"""The host tier (issue 27): every expert in page-locked host memory mapped into the GPU, a share
of each MoE layer's experts also in VRAM slots. A layer's slot map on the device (cuda_experts.
SlotMap, int32 [E]) says where the expert kernels read each routed expert: its VRAM slot (>= 0),
or its row of the host tier (-2 - e), in place over PCIe (zero-copy, mmvq.py's module doc). The
routing never leaves the device, so a decode step is one CUDA graph whatever the experts chosen,
and the tokens are those of every expert in VRAM (the kernels compute the same bits from either
tier).

Promotion follows use, off the critical path (`launched`: the host's part runs while the step
just launched runs on the GPU, everything it enqueues stream-ordered after that step):
- each step counts its (token, expert) pairs per layer on the device (router.count_experts into the
  slot map's `usage`, captured with the step; a padded step's copies of row 0 count too);
- after each launch the counts of the steps since the last read are copied back in stream order
  and zeroed; once arrived they feed the stats (each step's experts, replayed against Belady) and
  add up; every `period` steps each expert's score decays and adds them, and up to `max_moves`
  experts a layer that clearly beat the weakest slot holders move in (experts/promotion.py);
- a move first unpublishes its victim (the map says host row again, written on the compute stream,
  so every later step reads the host tier), then the copy stream waits for that point (every step
  that may read the old slot is done) and copies the expert's rows from the host tier into the
  slot (a layer's moves in one batched driver call, Transfers.copy_many); a later `launched`
  that finds the copy done publishes the slot (written on the compute stream). So a step sees
  the old miss or the new hit, never a half copy, and the bits never change.
  A copy that fails (a CUDA error) fails nothing: its expert stays in the host tier, its slot
  empty (unpublished) until a later move fills it, and a warning is logged once.
A host tier smaller than the model (EXPERT_CACHE_LIMIT_MB: R host rows a layer, R < E) leaves
some experts in no tier (map -1: a cold miss). A step runs as if they were not needed: its
kernels skip their pairs, and the count kernel raises a flag on the device. The model syncs on
that flag after its layers, before sampling (`take_cold`); if raised, the cold experts the step's
counts show are read from the file into host rows and the step runs again, as a graph, up to
COLD_TRIES times; then blocking (`blocking`): its routing comes to the host, `waves` splits a
layer's experts into groups that fit R rows, and `fetch` reads the cold ones into rows that the
wave does not use (stream-ordered after every earlier reader), as block-on-miss does. KV
writes at the same positions are idempotent and the sampler has not run, so the tokens are those of
every expert in VRAM (models with recurrent layers always block: their states are not).
Hybrid compute: a CPU worker may compute some of a decode step's missed experts from its own
copy (cuda_cpu_share.py), decided on the device inside the same graph (`split`).

Legend: E = experts of a layer, S = VRAM slots of a layer, R = host rows of a layer (E unless
bounded), N = output rows, stride = repacked row bytes.
"""

from __future__ import annotations

import logging
import time
from contextlib import contextmanager, nullcontext

import numpy as np
from numba import cuda

from ..errors import DeviceError
from ..kernels.cuda.device import upload, zero_fill
from ..experts import promotion
from ..experts.policies import simulate_layer
from ..experts.stats import RequestLog
from ..storage.experts import ExpertBatch, ResidentExperts, check_ids
from .cuda_errors import CUDA_ERRORS
from .cuda_experts import DeviceExperts, SlotMap, Source, TieredStack, expert_sources
from .cuda_transfer import Event, Transfers, pinned_empty
from .cuda_upload import Target, Uploader

PERIOD = 4  # steps between promotions
LOG_STEPS = 512  # reads of the use counts kept for the Belady replay in stats (RequestLog)
log = logging.getLogger("moed.device")


class _Layer:
    """One MoE layer's tiers and its promotion state (host mirrors of the device map)."""

    def __init__(self, il: int, stacks: list[TieredStack], rows: SlotMap, host_map: np.ndarray, slots: int,
                 sources: list[Source] | None = None):
        self.il = il
        self.stacks = stacks
        self.rows = rows  # .device: the map the kernels read; .usage: the counts
        self.sources = sources  # gate, up, down in the file (for cold misses)
        n_rows = stacks[0].host.shape[0] if stacks else host_map.size
        self.holder = np.arange(slots, dtype=np.int32)  # [S] expert in each slot (the first S at load)
        self.row_holder = np.arange(n_rows, dtype=np.int32)  # [R] expert in each host row (-1: none)
        self.row_of = np.full(host_map.size, -1, np.int32)  # [E] its host row, -1: cold
        self.row_of[:n_rows] = self.row_holder
        self.map = host_map  # [E] mirror of rows.device (a row of the tier's stacked mirror)
        self.map[:] = -1
        self.map[:n_rows] = -2 - self.row_holder
        self.map[:slots] = np.arange(slots, dtype=np.int32)
        self.score = np.zeros(host_map.size)  # [E] decayed use
        self.moving: list[tuple[int, int]] = []  # (slot, expert) copies in flight
        self.copied = Event()  # recorded on the copy stream after them
        self.expert_bytes = sum(int(st.host[0].nbytes) for st in stacks)  # gate + up + down of one expert


class HostTierExperts:
    """An expert provider over the host tier and S VRAM slots a layer. Its batches hold
    TieredStacks: gate, up [S | E, F, stride], down [S | E, D, stride] (VRAM | host)."""

    host_tier = True  # the engine reports stats() as "host_tier"

    def __init__(self, host: DeviceExperts, slots: int, stream=0, max_moves: int = 4, period: int = PERIOD,
                 gguf=None, sources: dict[int, list[Source]] | None = None, share=None):
        self.share = share  # a CPUShare (hybrid compute), or None
        self._step_began = None  # when the last step began (the share's tuner times steps)
        self._step_rows = 0
        self._layouts = host._layouts  # noqa: SLF001  (the same package's loader)
        self._batches: dict[int, ExpertBatch] = {}
        self._layers: list[_Layer] = []
        self._by_layer: dict[int, _Layer] = {}
        self.slots = max(0, int(slots))
        self.max_moves, self.period = max(0, int(max_moves)), max(1, int(period))
        self.stream = stream
        self.vram_bytes = self.host_bytes = 0
        self.promotions = self.passes = self.failed_moves = 0
        self.pairs = self.requests = self.hits = self.missed_bytes = 0  # over the counts read (stats)
        # runs of a step flagged for cold misses; steps run blocking; experts read from the file
        self.cold_steps = self.blocked_steps = self.cold_loads = 0
        self._gguf = gguf
        self._warned = False
        held = {il: int(b.gate.shape[0]) for il, b in host._batches.items()}  # noqa: SLF001  R per layer
        self.host_rows = min(held.values(), default=0)
        # some expert may be in no tier: the count kernel flags a step that routes to one
        self.cold_possible = any(held[il] < self._layouts[il].n_expert for il in held)
        if self.cold_possible and (gguf is None or sources is None):
            raise ValueError("a host tier smaller than the model needs the file to read cold experts from")
        self.routing_free = True  # the slot maps are read on the device: no routing on the host (blocking: off)
        self._cold = upload(np.zeros(1, np.int32), None if isinstance(stream, int) else stream) \
            if self.cold_possible else None
        self._cold_seen = pinned_empty(1, np.int32)
        n_max = max((lay.n_expert for lay in self._layouts.values()), default=1)
        L = len(host._batches)  # noqa: SLF001
        # every layer's use counts in one array, so a read of them is one copy and one fill: [L, E]
        self._usage = upload(np.zeros((L, n_max), np.int32), None if isinstance(stream, int) else stream)
        self._maps = np.full((L, n_max), -1, np.int32)  # [L, E] the maps' host mirrors (each layer's row)
        self._counted = np.zeros((L, n_max), np.int64)  # [L, E] use read since the last promotion
        self._used = RequestLog(LOG_STEPS, record=np.asarray)  # bool [L, E] per read: the experts its steps used
        for i, (il, b) in enumerate(host._batches.items()):  # noqa: SLF001
            n_expert = self._layouts[il].n_expert
            s = min(self.slots, n_expert, held[il])  # a slot's first copy comes from a host row
            stacks = []
            for h in (b.gate, b.up, b.down):  # [E, N, stride] in mapped host memory
                v = cuda.device_array((s, *h.shape[1:]), np.uint8)  # [S, N, stride]
                if s:
                    v.copy_to_device(h[:s], stream=stream)  # the first S experts, device to device
                stacks.append(TieredStack(v, h))
                self.vram_bytes += int(v.nbytes)
                self.host_bytes += int(h.nbytes)
            rows = SlotMap({e: e for e in range(s)}, n_expert, stream, host_tier=True)
            rows.usage = self._usage[i, :n_expert]
            rows.cold = self._cold
            self._batches[il] = ExpertBatch(*stacks, rows, b.gate_bias, b.up_bias, b.down_bias)
            lay = _Layer(il, stacks, rows, self._maps[i, :n_expert], s, None if sources is None else sources[il])
            Transfers.upload_into(rows.device, lay.map, stream)  # cold experts: -1
            self._layers.append(lay)
            self._by_layer[il] = lay
        self._xfer = Transfers(stream)  # its fetch stream copies into the slots
        self._counts = pinned_empty(self._usage.shape, np.int32)  # [L, E]
        self._step_counts = pinned_empty(self._usage.shape, np.int32)  # [L, E] a flagged step's (take_cold)
        self._expert_bytes = np.array([lay.expert_bytes for lay in self._layers], np.int64)  # [L]
        self._read_done = Event()
        self._reading = False
        self._read_maps = self._maps.copy()  # the maps the steps of the read in flight used
        if not isinstance(stream, int):
            stream.synchronize()

    @classmethod
    def from_gguf(cls, gguf, backend, budget_bytes: int, say=lambda _msg: None, on_bytes=None,
                  max_moves: int = 4, host_budget_bytes: int = 0, cpu_budget_bytes: int = 0,
                  cpu_count: str = "auto", numerics: str = "ggml") -> HostTierExperts:
        """The experts of the file loaded into the host tier (repacked on the GPU, written over
        PCIe): every one, or as many a layer as host_budget_bytes holds over all MoE layers (> 0;
        the rest are cold misses, read from the file when a step needs them); then as many VRAM
        slots a layer as budget_bytes holds; up to max_moves promotions a layer per read of the
        counts. cpu_budget_bytes > 0: a CPU worker's copy of as many experts a layer (the first
        not in VRAM) for hybrid compute, taking cpu_count ('auto' or N) a layer a step."""
        sources = expert_sources(gguf)
        raw = sum(s.n * s.rb for ss in sources.values() for s in ss) // max(1, len(sources))  # an expert's file bytes
        rows = None
        if host_budget_bytes > 0 and sources:
            rows = max(1, int(host_budget_bytes) // max(1, raw * len(sources)))
        host = DeviceExperts.from_gguf(gguf, None, backend.stream, on_bytes, mapped=True, rows=rows)
        per_expert = sum(int(s[0].nbytes) for b in host._batches.values()  # noqa: SLF001
                         for s in (b.gate, b.up, b.down)) // max(1, len(host._batches))  # noqa: SLF001
        slots = int(budget_bytes) // max(1, per_expert * len(host._batches))  # noqa: SLF001
        share = None
        if cpu_budget_bytes > 0 and sources:
            share = _cpu_share(gguf, host, sources, raw, slots, cpu_budget_bytes, cpu_count, numerics, backend.stream,
                               say)
        tier = cls(host, slots, backend.stream, max_moves, gguf=gguf, sources=sources, share=share)
        held = "every expert" if not tier.cold_possible else f"{tier.host_rows} experts a layer (the rest read when needed)"
        say(f"host tier: {tier.host_bytes / 2**30:.1f} GiB of experts in pinned host memory ({held}), "
            f"{tier.slots} of each layer's experts also in VRAM ({tier.vram_bytes / 2**30:.1f} GiB)")
        return tier

    def begin_pass(self, rows: int = 0) -> None:
        """Before a step of `rows` rows: the CPU share's tuner gets the last step's time."""
        self.passes += 1
        if self.share is not None:
            now = time.perf_counter()
            last = None if self._step_began is None else now - self._step_began
            self.share.begin_step(self._step_rows, last)
            self._step_began, self._step_rows = now, rows

    def launched(self) -> None:
        """While the step just launched runs (the model calls it once a step, before waiting for
        it): take the use counts that arrived, read the launched step's (the maps it reads kept:
        nothing changes them before this returns), publish finished moves, and every `period`
        steps start the moves the counts call for (module doc). All it enqueues follows the step."""
        if not self.slots or not self._layers:
            return
        if self._reading and self._xfer.done(self._read_done):
            self._reading = False
            self._take_counts()
        if not self._reading:
            self._read_maps[...] = self._maps
            Transfers.d2h(self._counts, self._usage, self.stream)
            zero_fill(self._usage, self.stream)
            self._xfer.record(self._read_done, self.stream)
            self._reading = True
        for lay in self._layers:
            if lay.moving and self._xfer.done(lay.copied):
                self._publish(lay)
        if self.passes % self.period == 0:
            self._promote()

    def _take_counts(self) -> None:
        """One read (usually one step) into the stats: its experts (a request each, as the VRAM
        cache counts them) and pairs, hits where the map the step read had the expert in a slot;
        the missed pairs' bytes crossed PCIe."""
        counts = self._counts  # [L, E]
        if not counts.any():
            return
        slotted = self._read_maps >= 0
        used = counts > 0
        pairs = counts.sum(axis=1)  # [L]
        hit_pairs = np.where(slotted, counts, 0).sum(axis=1)
        self.pairs += int(pairs.sum())
        self.missed_bytes += int(((pairs - hit_pairs) * self._expert_bytes).sum())
        self.requests += int(used.sum())
        self.hits += int((used & slotted).sum())
        self._counted += counts
        self._used.add(used)

    def _promote(self) -> None:
        for i, lay in enumerate(self._layers):
            lay.score = promotion.decayed(lay.score, self._counted[i, :lay.map.size])
            if lay.moving:
                continue
            moves = promotion.moves(lay.score, lay.holder, (lay.map >= 0) | (lay.row_of < 0), self.max_moves)
            if moves:
                self._start(lay, moves)
        self._counted[:] = 0

    def _start(self, lay: _Layer, moves: list[tuple[int, int]]) -> None:
        """Unpublish the victims, then copy the newcomers into their slots on the copy stream."""
        for s, _ in moves:
            victim = lay.holder[s]
            if victim >= 0:  # else an empty slot (a failed copy's)
                row = lay.row_of[victim]
                lay.map[victim] = -2 - row if row >= 0 else -1
            lay.holder[s] = -1
        Transfers.upload_into(lay.rows.device, lay.map, self.stream)
        unpublished = self._xfer.record(Event(), self.stream)
        self._xfer.wait(self._xfer.fetch, unpublished)  # every step that may read the old slots is done
        try:  # gate, up and down of every newcomer: one batched call for the layer
            self._xfer.copy_many([(st.vram[s], st.host[lay.row_of[e]]) for s, e in moves for st in lay.stacks])
            self._xfer.record(lay.copied, self._xfer.fetch)
        except CUDA_ERRORS as err:  # the newcomers stay in the host tier; their slots stay empty
            self.failed_moves += len(moves)
            if not self._warned:
                self._warned = True
                log.warning("layer %d: copying experts into VRAM slots failed (%s); they are read from "
                            "host memory", lay.il, err)
            return
        lay.moving = moves

    def _publish(self, lay: _Layer) -> None:
        for s, e in lay.moving:
            lay.holder[s] = e
            lay.map[e] = s
        Transfers.upload_into(lay.rows.device, lay.map, self.stream)
        self.promotions += len(lay.moving)
        lay.moving = []

    # -- cold misses (a host tier smaller than the model) --------------------------------------

    def take_cold(self) -> bool:
        """Whether the step just launched routed a pair to an expert in no tier (then its outputs
        are wrong and the model runs it again). Waits for the step; clears the flag; raises the
        CPU share's failure (DeviceError). If so, the
        cold experts its use counts show are read into host rows first, in one read for all
        layers: exact for the first layer that missed, a guess for the later ones (their inputs
        were wrong), so a second run usually finds every expert it needs."""
        if self._cold is None and self.share is None:
            return False
        if self._cold is not None:
            Transfers.d2h(self._cold_seen, self._cold, self.stream)
        self.stream.synchronize()
        if self.share is not None:
            self.share.end_step()
            self.share.raise_failure()
        if self._cold is None or not self._cold_seen[0]:
            return False
        self.cold_steps += 1
        Transfers.d2h(self._step_counts, self._usage, self.stream)
        zero_fill(self._cold, self.stream)
        zero_fill(self._usage, self.stream)  # the wrong run's counts: the next run counts again
        self.stream.synchronize()
        claims = []
        for i, lay in enumerate(self._layers):
            used = self._step_counts[i, :lay.map.size] > 0
            cold = np.flatnonzero(used & (lay.map == -1)).tolist()
            if cold:
                claim = self._claim_rows(lay, cold, keep=set(np.flatnonzero(used & (lay.map < 0)).tolist()))
                if claim:
                    claims.append((lay, claim))
        self._fill(claims)
        return True

    @contextmanager
    def blocking(self):
        """Steps in the block: each MoE layer's routing comes to the host, and fetch reads the cold
        experts it needs before its kernels run (module doc)."""
        was, self.routing_free = self.routing_free, False
        self.blocked_steps += 1
        try:
            yield self
        finally:
            self.routing_free = was
            if self._cold is not None:  # a wave's kernels flag the cold experts of later waves
                zero_fill(self._cold, self.stream)

    @property
    def checked(self) -> bool:
        """Whether the model reads each step's outcome before sampling (take_cold)."""
        return self.cold_possible or self.share is not None

    @property
    def graph_variant(self):
        """What a decode step's graph depends on besides its shape: whether the CPU takes a share."""
        return None if self.share is None else self.share.variant

    def split(self, layer: int, x, plan, glu: tuple):
        """A routing-free step's layer split with the CPU worker: (the GPU's plan, finish(y)), or
        None (no share this step)."""
        if self.share is None or not self.routing_free:
            return None
        return self.share.split(layer, x, plan, glu)

    def fetch(self, layer: int, ids, routed=None):
        """Every expert is served where the kernels read it. ids (blocking): these experts held in
        a tier until the next fetch, the cold ones read from the file first."""
        batch = self._batches[layer]
        if ids is not None:
            lay = self._by_layer[layer]
            check_ids(layer, ids, lay.map.size)
            cold = [int(e) for e in ids if lay.map[e] == -1]
            if cold:  # the rows to keep: those the fetch reads (VRAM serves the rest)
                self._read_cold(lay, cold, keep={int(e) for e in ids if lay.map[e] < 0})
        return nullcontext(batch)

    def waves(self, layer: int, ids) -> list[list[int]]:
        """[ids] when the experts not in VRAM fit the layer's host rows, else groups that do (the
        VRAM ones with the first)."""
        lay = self._by_layer[layer]
        ids = [int(e) for e in ids]
        rest = [e for e in ids if lay.map[e] < 0]
        n_rows = lay.row_holder.size
        if len(rest) <= n_rows:
            return [ids]
        waves = [rest[i:i + n_rows] for i in range(0, len(rest), n_rows)]
        waves[0] = [e for e in ids if lay.map[e] >= 0] + waves[0]
        return waves

    def _read_cold(self, lay: _Layer, cold: list[int], keep: set[int]) -> None:
        claim = self._claim_rows(lay, cold, keep)
        if claim is None:
            raise DeviceError(f"layer {lay.il}: {len(cold)} cold experts for fewer free host rows "
                              "(EXPERT_CACHE_LIMIT_MB too small for one step's experts)")
        self._fill([(lay, claim)])

    def _claim_rows(self, lay: _Layer, cold: list[int], keep: set[int]) -> list[tuple[int, int]] | None:
        """Host rows for the cold experts, from those whose experts are not in `keep`: empty ones,
        then ones whose expert VRAM also holds, then the least used; their experts leave the host
        tier now. -> [(expert, row)], or None when too few rows are free."""
        if lay.moving:  # a copy into VRAM reads its expert's row: let it finish (then the row is free)
            self._xfer.synchronize(lay.copied)
            self._publish(lay)
        free = [h for h in range(lay.row_holder.size) if lay.row_holder[h] not in keep]
        if len(free) < len(cold):
            return None

        def rank(h):
            e = lay.row_holder[h]
            return (e >= 0, e >= 0 and lay.map[e] < 0, lay.score[e] if e >= 0 else 0.0)

        rows = sorted(free, key=rank)[:len(cold)]
        for h in rows:
            old = lay.row_holder[h]
            if old >= 0:  # it leaves the host tier (a VRAM slot may still hold it)
                lay.row_of[old] = -1
                if lay.map[old] < 0:
                    lay.map[old] = -1
            lay.row_holder[h] = -1
        return list(zip(cold, rows))

    def _fill(self, claims: list[tuple[_Layer, list[tuple[int, int]]]]) -> None:
        """The claimed rows read from the file in one load, repacked on the compute stream (after
        every earlier reader of those rows), then published in the maps. On a failure the rows
        stay empty, their experts cold, and the error goes to the step."""
        targets = [Target(src.name, src.offset + e * src.n * src.rb, src.n, src.rb, src.ggml_type, st.host[h])
                   for lay, claim in claims for e, h in claim for src, st in zip(lay.sources, lay.stacks)]
        try:
            if targets:
                Uploader(self._gguf, self.stream, buffers=2).run(targets)
            for lay, claim in claims:
                for e, h in claim:
                    lay.row_holder[h] = e
                    lay.row_of[e] = h
                    lay.map[e] = -2 - h
                self.cold_loads += len(claim)
        finally:
            for lay, _ in claims:
                Transfers.upload_into(lay.rows.device, lay.map, self.stream)

    def stats(self) -> dict:
        """Over the steps whose use counts were read: the experts they used a layer (requests) and
        the share in VRAM slots, against Belady (demand paging: every miss inserted) and the
        optimum that may leave a miss in the host tier (opt-bypass), both replayed on the same
        requests with the same slots; (token, expert) pairs, bytes read in place over PCIe (the
        CPU share's pairs not); promotions and their bytes; the CPU share's figures."""
        per_expert = self._layers[0].expert_bytes if self._layers else 0
        cpu_pairs = self.share.pairs if self.share is not None else 0  # counted as misses, computed on the CPU
        oracle = {"belady": [0, 0], "opt-bypass": [0, 0]}
        if self.slots and self._used.counted:
            for i, lay in enumerate(self._layers):
                steps = [frozenset(np.flatnonzero(u[i]).tolist()) for u in self._used.steps]
                for policy, tally in oracle.items():
                    r = simulate_layer(steps, min(self.slots, lay.map.size), policy, self._used.counted_from)
                    tally[0] += r.hits
                    tally[1] += r.requests
        return {"slots_per_layer": self.slots, "vram_bytes": self.vram_bytes, "host_bytes": self.host_bytes,
                "requests": self.requests,
                "hit_rate": round(self.hits / self.requests, 4) if self.requests else None,
                **{f"{p.replace('-', '_')}_hit_rate": round(h / n, 4) if n else None for p, (h, n) in oracle.items()},
                "pairs": self.pairs, "read_in_place_bytes": max(0, self.missed_bytes - cpu_pairs * per_expert), "promotions": self.promotions,
                "failed_moves": self.failed_moves, "promoted_bytes": self.promotions * per_expert,
                "host_rows_per_layer": self.host_rows, "cold_steps": self.cold_steps, "blocked_steps": self.blocked_steps,
                "cold_loads": self.cold_loads, **(self.share.stats() if self.share is not None else {})}

    def reset_stats(self) -> None:
        self.pairs = self.requests = self.hits = self.missed_bytes = self.promotions = self.failed_moves = 0
        self.cold_steps = self.blocked_steps = self.cold_loads = 0
        self._used.reset()
        if self.share is not None:
            self.share.reset_stats()

    def close(self) -> None:
        if self.share is not None:
            self.share.close()

    def held(self, layer: int) -> list[int]:
        """The experts in layer's VRAM slots (published), by slot."""
        lay = next(lay for lay in self._layers if lay.il == layer)
        return [int(e) for e in lay.holder]

    @property
    def nbytes(self) -> int:
        """VRAM held (the slots; the biases are the host loader's, in VRAM too)."""
        return self.vram_bytes

    layout = ResidentExperts.layout


def _cpu_share(gguf, host: DeviceExperts, sources, raw: int, slots: int, budget_bytes: int, count: str,
               numerics: str, stream, say=lambda _msg: None):
    """The CPU worker of hybrid compute over as many experts a layer as budget_bytes holds in the
    file's layout: those after the first `slots` (which start in VRAM), among the host rows."""
    from .cuda_cpu_share import CPUShare

    layouts = host._layouts  # noqa: SLF001
    per_layer = int(budget_bytes) // max(1, raw * len(sources))
    held = {}
    for il, b in host._batches.items():  # noqa: SLF001
        rows = int(b.gate.shape[0])
        held[il] = list(range(min(slots, rows), min(slots + per_layer, rows)))
    held = {il: ids for il, ids in held.items() if ids}
    lay = next(iter(layouts.values()))
    fixed = None if str(count).strip().lower() == "auto" else int(count)
    say(f"hybrid compute: reading {sum(map(len, held.values())) * raw / 2**30:.1f} GiB of experts into host RAM "
        f"for the CPU ({'a tuned count' if fixed is None else fixed} a layer a step)")
    return CPUShare(gguf, layouts, held, sources, numerics, stream, lay.n_embd, _n_used(gguf), fixed=fixed)


def _n_used(gguf) -> int:
    """Experts a row uses (the file's metadata): the CPU share's buffers hold a step's pairs."""
    return int(gguf.get(f"{gguf.architecture}.expert_used_count", int))
