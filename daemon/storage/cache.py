"""Per-layer cache of expert weights in host memory, filled from the expert store by async reads.

Each MoE layer owns an arena of S slots (uint8 [S, rows, row bytes] per projection), S =
budget per layer / bytes per expert, budget per layer = EXPERT_CACHE_LIMIT_MB / MoE layers (no
limit: S = E). A fetched batch indexes the arena directly, so a decode step copies nothing.

Rules:
- Eviction follows the layer's policy (daemon/experts/policies.py: lru by default, lfu-decay or
  lfru; EXPERT_CACHE_POLICY), whose time is the layer's counted fetches (one a step).
- `fetch(layer, ids)` pins its experts until the `with` block ends; pinned or loading slots are
  never evicted or overwritten. When every slot is pinned, the extra experts load into buffers of
  their own, are used, and are dropped on release (a budget below one step's need still runs).
- One read per expert: a request for an expert already in flight waits on that read.
- `prefetch(layer, ids)` starts reads ahead of use. It only evicts entries that are neither pinned
  nor prefetched-and-unused, so a prediction never pushes out another one that is still to be
  used, and nothing is read twice in one forward pass (`duplicate_reads` counts it if it were).
- Prefetches run on an I/O thread with its own asyncio loop (aiofiles, MOE_IO_DEPTH in flight).
  A step's misses are read by the compute threads themselves (parallel_read.py: one parallel
  pread, no hand-off), or with MOE_DEMAND_READS=io on the I/O thread, ahead of queued
  prefetches. Cache state is guarded by one lock, so a step whose experts are all cached never
  waits on the I/O thread. Each read is claimed once (`started`), whichever thread gets it.
- A failed read (StorageError; ModelFileChanged once the file changed on disk) is forgotten, so a
  later request reads again; the fetch that waited on it raises the read's exception itself.

Legend: E = experts, S = slots, F = expert FFN size, D = hidden size.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field

import numpy as np

from ..errors import GGUFError, StorageError
from ..experts.policies import LIVE_POLICIES, POLICIES
from .experts import PROJECTIONS, ExpertBatch, ExpertLayout, check_ids
from .parallel_read import ParallelReader
from .store import ExpertStore, StoreReader

log = logging.getLogger("moed.cache")

DEMAND, PREFETCH = 0, 1  # read priorities: lower first
MIN_JOB_BYTES = 1 << 20  # smaller experts are read several per thread-pool job


@dataclass
class LayerStats:
    requests: int = 0  # experts asked for by steps (unique within a step)
    hits: int = 0  # ... already cached or in flight
    misses: int = 0  # ... that needed a read
    loads: int = 0  # reads completed, demand and prefetch
    evictions: int = 0
    bytes_read: int = 0
    prefetch_issued: int = 0
    prefetch_used: int = 0  # prefetched experts a step then asked for
    prefetch_wasted: int = 0  # prefetched experts evicted unused
    prefetch_skipped: int = 0  # predictions dropped: no slot free of pinned / pending entries
    duplicate_reads: int = 0  # an expert read twice in one forward pass (should stay 0)
    unique_requested: int = 0  # distinct experts ever asked for: the reads an unlimited cache needs

    @property
    def hit_rate(self) -> float:
        return self.hits / self.requests if self.requests else 0.0

    def as_dict(self) -> dict:
        return {**asdict(self), "hit_rate": round(self.hit_rate, 6)}


@dataclass(eq=False)
class _Entry:
    expert: int
    slot: int  # arena slot, or -1: an overflow buffer of its own
    views: tuple[np.ndarray, np.ndarray, np.ndarray]  # gate, up, down of this expert
    future: Future
    pins: int = 0
    prefetched: bool = False
    used: bool = False
    started: bool = False
    ready: bool = False  # read and usable (set under the cache lock)
    priority: int = DEMAND


@dataclass(eq=False)
class _Layer:
    layout: ExpertLayout
    capacity: int  # S
    policy: object  # experts/policies.py: which entry is evicted
    arena: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None  # gate, up, down: [S, rows, rb]
    free: list[int] = field(default_factory=list)
    entries: dict = field(default_factory=dict)  # expert -> _Entry
    clock: int = 0  # the policy's time: counted fetches of this layer
    stats: LayerStats = field(default_factory=LayerStats)
    seen: set[int] = field(default_factory=set)
    read_this_pass: set[int] = field(default_factory=set)
    biases: tuple = (None, None, None)
    resident: ExpertBatch | None = None  # set once an unlimited layer holds every expert
    arrived: int = 0  # experts read into slots, ever (moves: not reset with the statistics)
    evicted: int = 0  # experts whose slot was taken, ever


class ExpertCache:
    """Expert provider backed by an ExpertStore and bounded per layer. Close it when done."""

    def __init__(self, store: ExpertStore, limit_mb: float = 0.0, io_depth: int = 8,
                 biases: dict[int, tuple] | None = None, demand_reads: str = "compute", allocate=None,
                 policy: str = "lru"):
        if demand_reads not in ("compute", "io"):
            raise ValueError(f"demand_reads must be 'compute' or 'io', not {demand_reads!r}")
        if policy not in LIVE_POLICIES:
            raise ValueError(f"policy must be one of {', '.join(LIVE_POLICIES)}, not {policy!r}")
        self.policy = policy
        self.store = store
        self._allocate = allocate or np.empty  # arenas: pinned memory when a GPU copies from them
        self.limit_bytes = int(limit_mb * 2**20)
        n_layers = max(len(store.layouts), 1)
        self.layer_budget = self.limit_bytes // n_layers if self.limit_bytes else 0
        self._layers: dict[int, _Layer] = {}
        for il, lay in store.layouts.items():
            cap = lay.n_expert if not self.limit_bytes else min(lay.n_expert, self.layer_budget // lay.expert_nbytes)
            self._layers[il] = _Layer(lay, cap, POLICIES[policy]([]), free=list(range(cap - 1, -1, -1)),
                                      biases=(biases or {}).get(il, (None, None, None)))
        self._lock = threading.Lock()
        self._seq = itertools.count()
        self._claim_lock = threading.Lock()
        self._closed = False
        self.reads_started = 0  # experts whose read was started, demand or prefetch, ever (not reset)
        self._io = _IOThread(store, io_depth, self._read_done, self._claimed)
        self._here = ParallelReader(store) if demand_reads == "compute" else None

    # -- provider interface ---------------------------------------------------------------------

    def layout(self, layer: int) -> ExpertLayout:
        return self._layer(layer).layout

    def _layer(self, layer: int) -> _Layer:
        try:
            return self._layers[layer]
        except KeyError:
            raise GGUFError(f"{self.store.path}: layer {layer} has no expert tensors "
                            f"(blk.{layer}.ffn_{{gate,up,down}}_exps.weight)") from None

    def fetch(self, layer: int, ids: Sequence[int], routed=None, count: bool = True) -> _Held:
        """The experts `ids` of `layer`, pinned until the `with` block exits:
        `with cache.fetch(layer, ids) as batch: ...`. Raises StorageError if a read fails, and
        ModelFileChanged (the read's own exception) if the file changed since it was loaded.
        count: a step's request (False: a copy of predicted experts to VRAM, not counted)."""
        lc = self._layer(layer)
        if self._closed:
            raise StorageError(f"{self.store.path}: the expert cache is closed (the model was unloaded)")
        wanted = list(dict.fromkeys(int(e) for e in ids))
        check_ids(layer, wanted, lc.layout.n_expert)
        if lc.resident is not None:  # unlimited and every expert read: nothing can move any more
            with self._lock:
                if count:
                    self._count_resident_hits(lc, wanted)
            return _Held(self, lc, [], lc.resident)
        held: list[_Entry] = []
        reads: list[_Entry] = []
        try:
            with self._lock:
                entries = lc.entries
                lc.clock += count
                n_miss = sum(e not in entries for e in wanted)
                slots = []
                if n_miss:  # cached ones first (touched first: LRU's order within a step)
                    wanted.sort(key=lambda e: e not in entries)
                    slots = self._claim(lc, n_miss, prefetch=False, keep=set(wanted))
                for e in wanted:
                    held.append(self._demand(lc, layer, e, reads, count, slots))
            if self._here is not None:
                self._read_here(layer, reads)
            else:
                self._queue(DEMAND, layer, reads)
            for h in held:
                if not h.ready:  # in flight: wait for its read (shared with whoever started it)
                    h.future.result()  # raises the read's StorageError
            batch = self._batch(lc, held)
            if lc.capacity == lc.layout.n_expert and len(lc.entries) == lc.capacity:
                with self._lock:
                    if all(ent.ready for ent in lc.entries.values()):
                        lc.resident = ExpertBatch(*lc.arena, {e: ent.slot for e, ent in lc.entries.items()},
                                                  *lc.biases)
            return _Held(self, lc, held, batch)
        except BaseException:
            self._release(lc, held)
            raise

    def _count_resident_hits(self, lc: _Layer, wanted: list[int]) -> None:
        st = lc.stats
        st.requests += len(wanted)
        st.hits += len(wanted)
        for e in wanted:
            ent = lc.entries[e]
            if not ent.used:
                ent.used = True
                st.prefetch_used += 1
            if e not in lc.seen:
                lc.seen.add(e)
                st.unique_requested += 1

    def _release(self, lc: _Layer, held: list[_Entry]) -> None:
        with self._lock:
            for h in held:
                h.pins -= 1
                if h.slot < 0:  # overflow buffer: used, now dropped
                    lc.stats.evictions += 1

    def waves(self, layer: int, ids: Sequence[int]) -> list[list[int]]:
        """More experts than the layer's slots: the cached ones first (used before any miss can
        evict them), then the misses, in waves of at most the slots (one at least: with no
        slots each expert gets a buffer of its own)."""
        lc = self._layer(layer)
        ids = [int(e) for e in ids]
        if lc.capacity >= len(ids):
            return [ids]
        with self._lock:
            order = sorted(ids, key=lambda e: e not in lc.entries)
        room = max(lc.capacity, 1)
        return [order[i:i + room] for i in range(0, len(order), room)]

    def prefetch(self, layer: int, ids: Sequence[int]) -> None:
        """Start reading experts predicted for `layer`; never waits."""
        lc = self._layers.get(layer)
        if lc is None or self._closed:
            return
        with self._lock:
            new = []
            for e in dict.fromkeys(int(e) for e in ids):
                if e in lc.entries:
                    lc.policy.touch(e, lc.clock)  # predicted again: keep it
                else:
                    new.append(e)
            slots = self._claim(lc, len(new), prefetch=True) if new else []
            reads = [self._start(lc, e, PREFETCH, slot) for e, slot in zip(new, slots)]
            for ent in reads:
                lc.policy.touch(ent.expert, lc.clock)
            lc.stats.prefetch_issued += len(reads)
            lc.stats.prefetch_skipped += len(new) - len(reads)
        self._queue(PREFETCH, layer, reads)

    def biases(self, layer: int) -> tuple:
        """The layer's expert biases (gate, up, down: f32 [E, F|D] or None), resident."""
        return self._layer(layer).biases

    def ready(self, layer: int, ids: Sequence[int]) -> list[int]:
        """Those of `ids` read into the layer's cache already (a fetch of them will not wait)."""
        lc = self._layers.get(layer)
        if lc is None:
            return []
        with self._lock:
            return [e for e in ids if (ent := lc.entries.get(e)) is not None and ent.ready]

    def holds_all(self, layer: int) -> bool:
        """Whether every expert of the layer is cached (nothing left to predict)."""
        lc = self._layers.get(layer)
        return lc is not None and len(lc.entries) == lc.layout.n_expert

    def in_place(self, layer: int) -> ExpertBatch:
        """The layer's arenas, with `rows` naming the experts read into them: for a reader that
        takes the experts where they lie, without pins (the CPU's compiled step). In an unlimited
        cache an expert once read never moves; in a bounded one it stays until a fetch or prefetch
        of this layer takes its slot, which `moves` counts."""
        lc = self._layer(layer)
        with self._lock:
            if lc.resident is not None:
                return lc.resident
            arena = self._arena(lc)
            rows = {e: ent.slot for e, ent in lc.entries.items() if ent.ready and ent.slot >= 0}
        return ExpertBatch(*arena, rows, *lc.biases)

    def moves(self, layers: Sequence[int]) -> np.ndarray:
        """[len(layers), 2] int64: each layer's experts read into slots, and evicted from them, ever
        (an in_place reader re-reads a layer whose counts moved; an eviction it did not make while
        it read voids what it computed)."""
        with self._lock:
            return np.array([(self._layers[il].arrived, self._layers[il].evicted) for il in layers],
                            np.int64).reshape(len(layers), 2)

    def slots(self, layer: int) -> int:
        """The layer's slots (its expert count when unlimited)."""
        return self._layer(layer).capacity

    def count_in_place(self, layers: Sequence[int], routes: np.ndarray) -> None:
        """A step read its experts in place (the compiled step): layers[i] chose routes[i] (ids
        [R], any order, repeats allowed), all hits. Counted as a fetch of them would count them;
        a bounded layer's policy is touched in a fetch's order (ascending ids), its clock ticks."""
        routes = np.sort(np.asarray(routes, np.int64).reshape(len(layers), -1), axis=1)
        first = np.ones(routes.shape, bool)  # each id's first place in its sorted row
        first[:, 1:] = routes[:, 1:] != routes[:, :-1]
        with self._lock:
            for i, il in enumerate(layers):
                lc = self._layers[il]
                if lc.capacity == lc.layout.n_expert:  # nothing is ever evicted: statistics only
                    n = int(first[i].sum())
                    lc.stats.requests += n
                    lc.stats.hits += n
                    continue
                lc.clock += 1
                for e in routes[i][first[i]].tolist():
                    self._request(lc, lc.stats, lc.entries[e], True, True)

    def begin_pass(self, rows: int = 0) -> None:
        """A new forward pass starts: reads from now on count toward its duplicate check."""
        with self._lock:
            for lc in self._layers.values():
                lc.read_this_pass.clear()

    def stats(self) -> dict:
        """Per-layer and total statistics, JSON-serialisable."""
        with self._lock:
            per = {il: lc.stats.as_dict() | {"capacity": lc.capacity, "cached": len(lc.entries)}
                   for il, lc in self._layers.items()}
            total = LayerStats()
            for lc in self._layers.values():
                for k, v in asdict(lc.stats).items():
                    setattr(total, k, getattr(total, k) + v)
        return {"source": self.store.kind, "path": self.store.path, "limit_mb": self.limit_bytes / 2**20,
                "policy": self.policy,
                "layer_budget_bytes": self.layer_budget,
                "expert_bytes": {il: lc.layout.expert_nbytes for il, lc in self._layers.items()},
                "cached_bytes": sum(len(lc.entries) * lc.layout.expert_nbytes for lc in self._layers.values()),
                "layers": per, "total": total.as_dict()}

    def reset_stats(self) -> None:
        with self._lock:
            for lc in self._layers.values():
                lc.stats = LayerStats()
                lc.seen.clear()

    def close(self) -> None:
        """Stop reading and free the cached experts now (not when the last reference goes: a
        closed engine still referenced somewhere must not hold its budget while a new one loads)."""
        self._io.stop()
        if self._here is not None:
            self._here.close()
        with self._lock:
            self._closed = True
            for lc in self._layers.values():
                lc.arena, lc.resident = None, None
                lc.entries.clear()
                lc.free = list(range(lc.capacity - 1, -1, -1))

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # -- internals (called with the lock held) ----------------------------------------------------

    def _demand(self, lc: _Layer, layer: int, e: int, reads: list[_Entry], count: bool, slots: list[int]) -> _Entry:
        """Expert e for a step, pinned: a hit, or a miss read into the next of `slots` (claimed for
        the step's misses; none left: a buffer of its own)."""
        st = lc.stats if count else LayerStats()  # not counted: a throwaway
        ent = lc.entries.get(e)
        hit = ent is not None
        if hit:
            if not ent.started and ent.priority != DEMAND:  # queued prefetch: read it now
                ent.priority = DEMAND
                reads.append(ent)
        else:
            ent = self._start(lc, e, DEMAND, slots.pop(0) if slots else -1)
            reads.append(ent)
        self._request(lc, st, ent, hit, count)
        ent.pins += 1
        return ent

    def _request(self, lc: _Layer, st: LayerStats, ent: _Entry, hit: bool, count: bool) -> None:
        """A step asked for ent's expert (a hit: cached or in flight before it asked): counted, and
        touched."""
        e = ent.expert
        st.requests += 1
        if count and e not in lc.seen:
            lc.seen.add(e)
            st.unique_requested += 1
        if hit:
            st.hits += 1
            if ent.prefetched and not ent.used:
                st.prefetch_used += 1
        else:
            st.misses += 1
        lc.policy.touch(e, lc.clock)
        ent.used = ent.used or count

    def _start(self, lc: _Layer, e: int, priority: int, slot: int) -> _Entry:
        """A read of expert e into `slot` (-1: a buffer of its own, dropped after its step)."""
        if slot < 0:
            views = tuple(np.empty(lc.layout.shape(p), np.uint8) for p in PROJECTIONS)
        else:
            views = tuple(a[slot] for a in self._arena(lc))
        ent = _Entry(e, slot, views, Future(), prefetched=priority == PREFETCH, priority=priority)
        self.reads_started += 1
        if slot >= 0:
            lc.entries[e] = ent
        if e in lc.read_this_pass:
            lc.stats.duplicate_reads += 1
        lc.read_this_pass.add(e)
        return ent

    def _claimed(self, entries: list[_Entry]) -> list[_Entry]:
        """The entries nobody read yet, marked started (a boosted entry sits in two jobs)."""
        with self._claim_lock:
            mine = [e for e in entries if not e.started]
            for e in mine:
                e.started = True
        return mine

    def _read_here(self, layer: int, reads: list[_Entry]) -> None:
        """Read a step's misses on this (the compute) thread's pool; a prefetch the I/O thread
        already started is left to it (the step waits on its future)."""
        mine = self._claimed(reads)
        if not mine:
            return
        try:
            results = self._here.read(layer, [ent.expert for ent in mine], [ent.views for ent in mine])
        except Exception as e:  # not an expert's fault (a bug): fail the reads, keep the cache
            results = [(0, StorageError(f"expert read failed: {e!r}"))] * len(mine)
        for ent, (n, err) in zip(mine, results):
            self._read_done(layer, ent, n, err)

    def _queue(self, priority: int, layer: int, reads: list[_Entry]) -> None:
        """Hand reads to the I/O thread in up to io_depth jobs of >= MIN_JOB_BYTES each."""
        if not reads:
            return
        size = self._layers[layer].layout.expert_nbytes
        n_jobs = max(1, min(self._io.depth, len(reads), len(reads) * size // MIN_JOB_BYTES))
        for j in range(n_jobs):
            self._io.submit(priority, next(self._seq), layer, reads[j::n_jobs])

    def _claim(self, lc: _Layer, n: int, prefetch: bool, keep=frozenset()) -> list[int]:
        """Up to n slots: free ones, then those of the policy's least wanted entries that no step
        holds, no read fills, `keep` does not name and (for a prefetch) are not predictions still
        to be used. Fewer when nothing else can go."""
        slots = [lc.free.pop() for _ in range(min(n, len(lc.free)))]
        if len(slots) == n:
            return slots
        cands = [e for e, ent in lc.entries.items()
                 if not ent.pins and ent.future.done() and e not in keep
                 and not (prefetch and ent.prefetched and not ent.used)]
        for e in lc.policy.victims(cands, lc.clock, n - len(slots)):
            ent = lc.entries.pop(e)
            lc.stats.evictions += 1
            lc.evicted += 1
            if ent.prefetched and not ent.used:
                lc.stats.prefetch_wasted += 1
            slots.append(ent.slot)
        return slots

    def _arena(self, lc: _Layer):
        if lc.arena is None:  # np.empty: pages are committed as slots fill
            lc.arena = tuple(self._allocate((lc.capacity, *lc.layout.shape(p)), np.uint8) for p in PROJECTIONS)
        return lc.arena

    def _batch(self, lc: _Layer, held: list[_Entry]) -> ExpertBatch:
        if not held:  # nothing asked for (the arena may not exist yet: don't make it outside the lock)
            gate, up, down = (np.empty((0, *lc.layout.shape(p)), np.uint8) for p in PROJECTIONS)
            return ExpertBatch(gate, up, down, {}, *lc.biases)
        if all(h.slot >= 0 for h in held):
            gate, up, down = lc.arena
            rows = {h.expert: h.slot for h in held}
        else:  # some experts live outside the arena: stack copies for this step
            gate, up, down = (np.stack([h.views[i] for h in held]) for i in range(3))
            rows = {h.expert: i for i, h in enumerate(held)}
        return ExpertBatch(gate, up, down, rows, *lc.biases)

    def _read_done(self, layer: int, ent: _Entry, nbytes: int, error: BaseException | None) -> None:
        """Called on the reading thread when a read ends."""
        lc = self._layers[layer]
        with self._lock:
            if error is None:
                lc.stats.loads += 1
                lc.stats.bytes_read += nbytes
                ent.ready = True
                lc.arrived += ent.slot >= 0
            else:
                lc.read_this_pass.discard(ent.expert)  # nothing was read: a retry is no duplicate
                if ent.slot >= 0 and lc.entries.get(ent.expert) is ent:  # forget it: a later request retries
                    del lc.entries[ent.expert]
                    lc.free.append(ent.slot)
        if error is None:
            ent.future.set_result(None)
        else:
            if ent.prefetched and not ent.used:
                log.debug("prefetch of layer %d expert %d failed: %s", layer, ent.expert, error)
            ent.future.set_exception(error)


class _Held:
    """What fetch returns: the batch while the block runs, then its experts unpinned."""

    __slots__ = ("_cache", "_lc", "_held", "batch")

    def __init__(self, cache: ExpertCache, lc: _Layer, held: list[_Entry], batch: ExpertBatch):
        self._cache, self._lc, self._held, self.batch = cache, lc, held, batch

    def __enter__(self) -> ExpertBatch:
        return self.batch

    def __exit__(self, *exc) -> None:
        held, self._held = self._held, []
        self._cache._release(self._lc, held)


class _IOThread:
    """An asyncio loop on a thread of its own: `depth` tasks take read jobs (lists of entries of
    one layer) from a priority queue and run each as one aiofiles thread-pool job."""

    def __init__(self, store: ExpertStore, depth: int, done, claimed):
        self._store = store
        self.depth = max(1, depth)
        self._done = done
        self._claimed = claimed
        self._ready = threading.Event()
        self._start_error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="moed-expert-io", daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._start_error is not None:  # the loader gets it; waiting on, it would hang forever
            self._thread.join()
            raise self._start_error

    def _run(self) -> None:
        try:
            self.loop = asyncio.new_event_loop()
            self.loop.set_default_executor(ThreadPoolExecutor(self.depth, thread_name_prefix="moed-read"))
            self._queue: asyncio.PriorityQueue = asyncio.PriorityQueue()
            self._reader = StoreReader(self._store)
            self._open_error: BaseException | None = None
            self.loop.run_until_complete(self._open())
            self._workers = [self.loop.create_task(self._work()) for _ in range(self.depth)]
        except BaseException as e:  # e.g. MemoryError: hand it to __init__, free what was made
            self._start_error = e
            try:
                self._teardown()
            except Exception:  # noqa: BLE001 - the start's own error is the one to report
                log.exception("cleaning up the expert I/O thread after a failed start")
            self._ready.set()
            return
        self._ready.set()
        self.loop.run_forever()
        self._teardown()

    def _teardown(self) -> None:
        """Cancel the workers, then close the reader, the executor and the loop (after a stop, or
        what a failed start made of them)."""
        loop = getattr(self, "loop", None)
        if loop is None:
            return
        try:
            workers = getattr(self, "_workers", [])
            for w in workers:
                w.cancel()
            loop.run_until_complete(asyncio.gather(*workers, return_exceptions=True))
            # a cancelled task's traceback holds its frame, and the frame self: drop the tasks, or the
            # last read's views keep the arenas until a full collection (issue 25)
            self._workers = []
            if hasattr(self, "_reader"):
                loop.run_until_complete(self._reader.close())
            loop.run_until_complete(loop.shutdown_default_executor())
        finally:
            loop.close()

    async def _open(self) -> None:
        try:
            await self._reader.open()
        except StorageError as e:
            self._open_error = e

    def submit(self, priority: int, seq: int, layer: int, entries: list[_Entry]) -> None:
        self.loop.call_soon_threadsafe(self._queue.put_nowait, (priority, seq, layer, entries))

    async def _work(self) -> None:
        while True:
            _, _, layer, entries = await self._queue.get()
            mine = self._claimed(entries)
            if not mine:
                continue
            if self._open_error is not None:
                for ent in mine:
                    self._done(layer, ent, 0, self._open_error)
                continue
            items = [(layer, ent.expert, [memoryview(v).cast("B") for v in ent.views],
                      lambda n, err, ent=ent: self._done(layer, ent, n, err)) for ent in mine]
            try:
                await self._reader.read_batch(items)
            except Exception as e:  # not a StorageError: fail the entries, keep the worker
                for ent in mine:
                    if not ent.future.done():
                        self._done(layer, ent, 0, StorageError(f"expert read failed: {e!r}"))

    def stop(self) -> None:
        if self._thread.is_alive():
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join()
        self._done = self._claimed = None  # the cache's methods: no cycle once stopped
