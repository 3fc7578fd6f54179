"""The host tier (issue 27): every expert in page-locked host memory mapped into the GPU, a share
of each MoE layer's experts also in VRAM slots. A layer's slot map on the device (cuda_experts.
SlotMap, int32 [E]) says where the expert kernels read each routed expert: its VRAM slot (>= 0),
or its row of the host tier (-2 - e), in place over PCIe (zero-copy, mmvq.py's module doc). The
routing never leaves the device, so a decode step is one CUDA graph whatever the experts chosen,
and the tokens are those of every expert in VRAM (the kernels compute the same bits from either
tier).

Promotion follows use, between steps and off the critical path (`begin_pass`, before each step):
- each step counts its (token, expert) pairs per layer on the device (router.count_experts into the
  slot map's `usage`, captured with the step; a padded step's copies of row 0 count too);
- before each step the counts of the steps since the last read are copied back in stream order
  and zeroed; once arrived they feed the stats (each step's experts, replayed against Belady) and
  add up; every `period` steps each expert's score decays and adds them, and up to `max_moves`
  experts a layer that clearly beat the weakest slot holders move in (experts/promotion.py);
- a move first unpublishes its victim (the map says host row again, written on the compute stream,
  so every later step reads the host tier), then the copy stream waits for that point (every step
  that may read the old slot is done) and copies the expert's rows from the host tier into the
  slot; a later begin_pass that finds the copy done publishes the slot (written on the compute
  stream). So a step sees the old miss or the new hit, never a half copy, and the bits never change.
  A copy that fails (a CUDA error) fails nothing: its expert stays in the host tier, its slot
  empty (unpublished) until a later move fills it, and a warning is logged once.
Hybrid compute and SSD streaming are the VRAM expert cache's (cuda_expert_cache.py): this tier
needs host memory for every expert (MOE_GPU_HOST_TIER).

Legend: E = experts of a layer, S = VRAM slots of a layer, N = output rows, stride = repacked
row bytes.
"""

from __future__ import annotations

import logging

import numpy as np
from numba import cuda

from ..kernels.cuda.device import upload, zero_fill
from ..experts import promotion
from ..experts.policies import simulate_layer
from ..experts.stats import RequestLog
from ..storage.experts import ExpertBatch, ResidentExperts
from .cuda_errors import CUDA_ERRORS
from .cuda_experts import DeviceExperts, SlotMap, TieredStack
from .cuda_transfer import Event, Transfers, pinned_empty

PERIOD = 4  # steps between promotions
LOG_STEPS = 512  # reads of the use counts kept for the Belady replay in stats (RequestLog)
log = logging.getLogger("moed.device")


class _Layer:
    """One MoE layer's tiers and its promotion state (host mirrors of the device map)."""

    def __init__(self, il: int, stacks: list[TieredStack], rows: SlotMap, host_map: np.ndarray, slots: int):
        self.il = il
        self.stacks = stacks
        self.rows = rows  # .device: the map the kernels read; .usage: the counts
        self.holder = np.arange(slots, dtype=np.int32)  # [S] expert in each slot (the first S at load)
        self.map = host_map  # [E] mirror of rows.device (a row of the tier's stacked mirror)
        self.map[:] = -2 - np.arange(host_map.size, dtype=np.int32)
        self.map[:slots] = np.arange(slots, dtype=np.int32)
        self.score = np.zeros(host_map.size)  # [E] decayed use
        self.moving: list[tuple[int, int]] = []  # (slot, expert) copies in flight
        self.copied = Event()  # recorded on the copy stream after them
        self.expert_bytes = sum(int(st.host[0].nbytes) for st in stacks)  # gate + up + down of one expert


class HostTierExperts:
    """An expert provider over the host tier and S VRAM slots a layer. Its batches hold
    TieredStacks: gate, up [S | E, F, stride], down [S | E, D, stride] (VRAM | host)."""

    routing_free = True  # the slot maps are read on the device: no routing on the host
    host_tier = True  # the engine reports stats() as "host_tier"

    def __init__(self, host: DeviceExperts, slots: int, stream=0, max_moves: int = 4, period: int = PERIOD):
        self._layouts = host._layouts  # noqa: SLF001  (the same package's loader)
        self._batches: dict[int, ExpertBatch] = {}
        self._layers: list[_Layer] = []
        self.slots = max(0, int(slots))
        self.max_moves, self.period = max(0, int(max_moves)), max(1, int(period))
        self.stream = stream
        self.vram_bytes = self.host_bytes = 0
        self.promotions = self.passes = self.failed_moves = 0
        self.pairs = self.requests = self.hits = self.missed_bytes = 0  # over the counts read (stats)
        self._warned = False
        n_max = max((lay.n_expert for lay in self._layouts.values()), default=1)
        L = len(host._batches)  # noqa: SLF001
        # every layer's use counts in one array, so a read of them is one copy and one fill: [L, E]
        self._usage = upload(np.zeros((L, n_max), np.int32), None if isinstance(stream, int) else stream)
        self._maps = np.full((L, n_max), -1, np.int32)  # [L, E] the maps' host mirrors (each layer's row)
        self._counted = np.zeros((L, n_max), np.int64)  # [L, E] use read since the last promotion
        self._used = RequestLog(LOG_STEPS, record=np.asarray)  # bool [L, E] per read: the experts its steps used
        for i, (il, b) in enumerate(host._batches.items()):  # noqa: SLF001
            n_expert = self._layouts[il].n_expert
            s = min(self.slots, n_expert)
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
            self._batches[il] = ExpertBatch(*stacks, rows, b.gate_bias, b.up_bias, b.down_bias)
            self._layers.append(_Layer(il, stacks, rows, self._maps[i, :n_expert], s))
        self._xfer = Transfers(stream)  # its fetch stream copies into the slots
        self._counts = pinned_empty(self._usage.shape, np.int32)  # [L, E]
        self._expert_bytes = np.array([lay.expert_bytes for lay in self._layers], np.int64)  # [L]
        self._read_done = Event()
        self._reading = False
        self._read_maps = self._maps.copy()  # the maps the steps of the read in flight used
        if not isinstance(stream, int):
            stream.synchronize()

    @classmethod
    def from_gguf(cls, gguf, backend, budget_bytes: int, say=lambda _msg: None, on_bytes=None,
                  max_moves: int = 4) -> HostTierExperts:
        """Every expert of the file loaded into the host tier (repacked on the GPU, written over
        PCIe), then as many VRAM slots a layer as budget_bytes holds over all MoE layers; up to
        max_moves promotions a layer per read of the counts."""
        host = DeviceExperts.from_gguf(gguf, None, backend.stream, on_bytes, mapped=True)
        per_expert = sum(int(s[0].nbytes) for b in host._batches.values()  # noqa: SLF001
                         for s in (b.gate, b.up, b.down)) // max(1, len(host._batches))  # noqa: SLF001
        slots = int(budget_bytes) // max(1, per_expert * len(host._batches))  # noqa: SLF001
        tier = cls(host, slots, backend.stream, max_moves)
        say(f"host tier: {tier.host_bytes / 2**30:.1f} GiB of experts in pinned host memory, "
            f"{tier.slots} of each layer's experts also in VRAM ({tier.vram_bytes / 2**30:.1f} GiB)")
        return tier

    def begin_pass(self) -> None:
        """Between steps (the model calls it before each): take the use counts that arrived, read
        the last steps' (the maps they used kept: nothing has changed them since), publish finished
        moves, and every `period` steps start the moves the counts call for (module doc)."""
        self.passes += 1
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
            moves = promotion.moves(lay.score, lay.holder, lay.map >= 0, self.max_moves)
            if moves:
                self._start(lay, moves)
        self._counted[:] = 0

    def _start(self, lay: _Layer, moves: list[tuple[int, int]]) -> None:
        """Unpublish the victims, then copy the newcomers into their slots on the copy stream."""
        for s, _ in moves:
            victim = lay.holder[s]
            if victim >= 0:  # else an empty slot (a failed copy's)
                lay.map[victim] = -2 - victim
            lay.holder[s] = -1
        Transfers.upload_into(lay.rows.device, lay.map, self.stream)
        unpublished = self._xfer.record(Event(), self.stream)
        self._xfer.wait(self._xfer.fetch, unpublished)  # every step that may read the old slots is done
        try:
            for s, e in moves:
                for st in lay.stacks:
                    self._copy(st.vram[s], st.host[e])
            self._xfer.record(lay.copied, self._xfer.fetch)
        except CUDA_ERRORS as err:  # the newcomers stay in the host tier; their slots stay empty
            self.failed_moves += len(moves)
            if not self._warned:
                self._warned = True
                log.warning("layer %d: copying experts into VRAM slots failed (%s); they are read from "
                            "host memory", lay.il, err)
            return
        lay.moving = moves

    def _copy(self, slot, host_rows) -> None:
        """One projection of an expert: its host rows into a VRAM slot, on the copy stream."""
        slot.copy_to_device(host_rows, stream=self._xfer.fetch)

    def _publish(self, lay: _Layer) -> None:
        for s, e in lay.moving:
            lay.holder[s] = e
            lay.map[e] = s
        Transfers.upload_into(lay.rows.device, lay.map, self.stream)
        self.promotions += len(lay.moving)
        lay.moving = []

    def stats(self) -> dict:
        """Over the steps whose use counts were read: the experts they used a layer (requests) and
        the share in VRAM slots, against Belady (demand paging: every miss inserted) and the
        optimum that may leave a miss in the host tier (opt-bypass), both replayed on the same
        requests with the same slots; (token, expert) pairs, bytes read in place over PCIe;
        promotions and their bytes."""
        per_expert = self._layers[0].expert_bytes if self._layers else 0
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
                "pairs": self.pairs, "read_in_place_bytes": self.missed_bytes, "promotions": self.promotions,
                "failed_moves": self.failed_moves, "promoted_bytes": self.promotions * per_expert}

    def reset_stats(self) -> None:
        self.pairs = self.requests = self.hits = self.missed_bytes = self.promotions = self.failed_moves = 0
        self._used.reset()

    def held(self, layer: int) -> list[int]:
        """The experts in layer's VRAM slots (published), by slot."""
        lay = next(lay for lay in self._layers if lay.il == layer)
        return [int(e) for e in lay.holder]

    @property
    def nbytes(self) -> int:
        """VRAM held (the slots; the biases are the host loader's, in VRAM too)."""
        return self.vram_bytes

    # every expert is served: the kernels pick the tier
    layout = ResidentExperts.layout
    fetch = ResidentExperts.fetch
    waves = ResidentExperts.waves
