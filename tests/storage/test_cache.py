"""ExpertCache on its own, over a fixture's expert store: the bytes it serves, how many reads it
makes (checked against a small LRU model written here), pinning, overflow below one step's need,
shared in-flight reads, prefetch rules, read errors and shutdown."""

from __future__ import annotations

import os
import random
import shutil
import threading
import time
from collections import OrderedDict

import numpy as np
import pytest

from daemon.errors import GGUFError, ModelFileChanged, StorageError
from daemon.experts.policies import simulate_layer
from daemon.storage.cache import ExpertCache
from daemon.storage.experts import PROJECTIONS
from daemon.storage.gguf import GGUFFile
from daemon.storage.parallel_read import ParallelReader
from daemon.storage.store import ExpertStore, StoreReader, expert_layouts
from tests.fixtures.build import fixture_path


class Model:
    """A fixture's expert store plus the file's own bytes of every expert (uint8 [E, N, rb] per
    projection, from the tensor sizes in the file)."""

    def __init__(self, path):
        self.path = path
        with GGUFFile(path) as g:
            self.layouts = expert_layouts(g)
            self.store = ExpertStore.from_gguf(g, self.layouts)
            self.ref = {}
            self.expert_bytes = {}
            for il in self.layouts:
                self.ref[il] = {}
                total = 0
                for p in PROJECTIONS:
                    ti = g.tensor_info(f"blk.{il}.ffn_{p}_exps.weight")
                    e, n = ti.ne[2], ti.ne[1]
                    self.ref[il][p] = np.array(g.tensor_data(ti.name)).reshape(e, n, -1)
                    total += ti.nbytes // e
                self.expert_bytes[il] = total
        self.layers = sorted(self.layouts)
        self.n_expert = self.layouts[self.layers[0]].n_expert

    def limit_mb(self, slots: int) -> float:
        """A limit that gives `slots` slots in every layer (half an expert of slack per layer)."""
        per_layer = max(self.expert_bytes.values()) * (slots + 0.5)
        return per_layer * len(self.layers) / 2**20

    def check(self, batch, layer, ids):
        for e in ids:
            s = batch.rows[e]
            for p in PROJECTIONS:
                assert np.array_equal(getattr(batch, p)[s], self.ref[layer][p][e]), (layer, e, p)


@pytest.fixture(scope="module")
def m(tmp_path_factory):
    return Model(fixture_path("qwen3moe", "Q8_0", tmp_path_factory.mktemp("cache-fx")))


@pytest.fixture(params=["compute", "io"])
def make(m, request):
    """Caches reading a step's misses on the compute thread, and on the I/O thread."""
    made = []

    def mk(slots: int | None = None, limit_mb: float | None = None, store=None, **kw):
        if limit_mb is None:
            limit_mb = 0.0 if slots is None else m.limit_mb(slots)
        kw.setdefault("demand_reads", request.param)
        c = ExpertCache(store or m.store, limit_mb, **kw)
        made.append(c)
        return c
    yield mk
    for c in made:
        c.close()


def L(c, layer):
    return c.stats()["layers"][layer]


def wait_for(cond, timeout=10.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.002)
    return cond()


def settled(c, layer):
    """Wait until every issued read of the layer has completed (no reads are failing here)."""
    assert wait_for(lambda: L(c, layer)["loads"] == L(c, layer)["misses"] + L(c, layer)["prefetch_issued"])


@pytest.fixture
def slow_reads(monkeypatch):
    """Every expert read takes `delay` seconds more, so a read is reliably still in flight, on
    the I/O threads (read_sync) and on the compute thread (ParallelReader.read) alike."""
    orig, orig_parallel = StoreReader.read_sync, ParallelReader.read
    calls, done = [], []  # reads begun, reads whose bytes are in place

    def slow(self, fd, layer, expert, dests):
        calls.append((layer, expert))
        time.sleep(slow.delay)
        out = orig(self, fd, layer, expert, dests)
        done.append((layer, expert))
        return out

    def slow_parallel(self, layer, experts, dests):
        calls.extend((layer, e) for e in experts)
        time.sleep(slow.delay)
        out = orig_parallel(self, layer, experts, dests)
        done.extend((layer, e) for e in experts)
        return out
    slow.delay = 0.2
    slow.calls, slow.done = calls, done
    monkeypatch.setattr(StoreReader, "read_sync", slow)
    monkeypatch.setattr(ParallelReader, "read", slow_parallel)
    return slow


def steps(rng, n, n_expert, max_k):
    return [rng.sample(range(n_expert), rng.randint(1, max_k)) for _ in range(n)]


# -- bytes --------------------------------------------------------------------------------------

@pytest.mark.parametrize("slots", [None, 3, 1, 0])
def test_batches_hold_the_files_bytes(m, make, slots):
    c = make(slots)
    rng = random.Random(slots or 7)
    for ids in steps(rng, 25, m.n_expert, m.n_expert):
        layer = rng.choice(m.layers)
        with c.fetch(layer, ids) as b:
            assert set(ids) <= set(b.rows)
            m.check(b, layer, ids)
    for il in m.layers:
        assert L(c, il)["cached"] <= (m.n_expert if slots is None else slots)


def test_duplicate_and_numpy_ids(m, make):
    c = make()
    with c.fetch(0, np.array([3, 3, 1, 3])) as b:
        m.check(b, 0, [1, 3])
    s = L(c, 0)
    assert (s["requests"], s["misses"], s["loads"]) == (2, 2, 2)


@pytest.mark.parametrize("slots", [None, 0])
def test_empty_fetch(m, make, slots):
    c = make(slots)
    with c.fetch(1, []) as b:  # a fresh layer, nothing asked for
        assert b.rows == {}
    assert L(c, 1)["requests"] == 0 and L(c, 1)["loads"] == 0


def test_out_of_range_id(m, make):
    c = make()
    with pytest.raises(GGUFError), c.fetch(0, [m.n_expert]):
        pass
    with c.fetch(0, [0]) as b:  # still usable
        m.check(b, 0, [0])


# -- counting -----------------------------------------------------------------------------------

def test_no_limit_reads_each_expert_once(m, make):
    c = make()
    rng = random.Random(1)
    seen = {il: set() for il in m.layers}
    requests = {il: 0 for il in m.layers}
    for k, ids in enumerate(steps(rng, 40, m.n_expert, 3)):
        layer = m.layers[k % len(m.layers)]
        if k % 5 == 0:
            c.begin_pass()
        with c.fetch(layer, ids) as b:
            m.check(b, layer, ids)
        seen[layer] |= set(ids)
        requests[layer] += len(set(ids))
    for il in m.layers:
        s = L(c, il)
        u = len(seen[il])
        assert s["unique_requested"] == u == s["loads"] == s["misses"]
        assert s["bytes_read"] == u * m.expert_bytes[il]
        assert s["requests"] == requests[il] and s["hits"] == requests[il] - u
        assert s["evictions"] == 0 and s["duplicate_reads"] == 0
        assert s["capacity"] == m.n_expert and s["cached"] == u
        assert s["hit_rate"] == pytest.approx((requests[il] - u) / requests[il], abs=1e-6)
    t = c.stats()["total"]
    assert t["loads"] == sum(len(v) for v in seen.values())
    assert t["bytes_read"] == sum(len(seen[il]) * m.expert_bytes[il] for il in m.layers)


def lru_model(capacity: int, step_ids: list[list[int]]):
    """An LRU of `capacity` experts where a step's experts are in use together: hits are touched
    (in request order) before any miss takes room, a miss evicts the least recently used expert the
    step does not use, and when there is none it is loaded outside the cache and dropped after the
    step. -> per step (hits, misses, evictions), and the final cache contents."""
    cache: OrderedDict[int, None] = OrderedDict()
    out = []
    for ids in step_ids:
        ids = list(dict.fromkeys(ids))
        in_use = set()
        hits = misses = evictions = 0
        for e in [e for e in ids if e in cache]:
            hits += 1
            cache.move_to_end(e)
            in_use.add(e)
        for e in [e for e in ids if e not in in_use]:
            misses += 1
            if len(cache) < capacity:
                cache[e] = None
            else:
                victim = next((v for v in cache if v not in in_use), None)
                if victim is None:  # everything cached is in use: overflow, dropped at the end
                    evictions += 1
                    continue
                del cache[victim]
                evictions += 1
                cache[e] = None
            in_use.add(e)
        out.append((hits, misses, evictions))
    return out, list(cache)


@pytest.mark.parametrize("slots", [1, 2, 3, 5])
def test_lru_matches_a_model(m, make, slots):
    c = make(slots)
    assert all(L(c, il)["capacity"] == slots for il in m.layers)
    rng = random.Random(100 + slots)
    per_layer = {il: steps(rng, 60, m.n_expert, min(m.n_expert, slots + 2)) for il in m.layers}
    got = {il: [] for il in m.layers}
    for k in range(60):
        for il in m.layers:  # interleaved layers must not disturb each other
            before = L(c, il)
            ids = per_layer[il][k]
            with c.fetch(il, ids) as b:
                m.check(b, il, ids)
            after = L(c, il)
            got[il].append(tuple(after[f] - before[f] for f in ("hits", "misses", "evictions")))
    for il in m.layers:
        want, final = lru_model(slots, per_layer[il])
        assert got[il] == want
        s = L(c, il)
        assert s["cached"] == len(final) <= slots
        assert s["loads"] == s["misses"] and s["bytes_read"] == s["misses"] * m.expert_bytes[il]
    # the model's final contents are what is cached: fetching them is all hits, no reads
    for il in m.layers:
        _, final = lru_model(slots, per_layer[il])
        before = L(c, il)
        with c.fetch(il, final) as b:
            m.check(b, il, final)
        after = L(c, il)
        assert after["hits"] - before["hits"] == len(final) and after["loads"] == before["loads"]


@pytest.mark.parametrize("slots", [1, 0])
def test_budget_below_one_step(m, make, slots):
    c = make(slots)
    assert L(c, 0)["capacity"] == slots
    ids = [6, 1, 4, 2]
    for rep in range(3):
        with c.fetch(0, ids) as b:
            m.check(b, 0, ids)
        s = L(c, 0)
        assert s["cached"] <= slots
    s = L(c, 0)
    # each step reloads all it can't keep: with 1 slot the one kept expert hits next time
    assert s["misses"] == 4 + 2 * (4 - slots)
    assert s["hits"] == 2 * slots
    assert s["loads"] == s["misses"] and s["bytes_read"] == s["misses"] * m.expert_bytes[0]
    assert s["evictions"] == 3 * (4 - slots)


def test_tiny_limit_gives_zero_slots(m, make):
    c = make(limit_mb=0.001)
    for il in m.layers:
        assert L(c, il)["capacity"] == 0
        with c.fetch(il, [0, 7]) as b:
            m.check(b, il, [0, 7])
        assert L(c, il)["cached"] == 0


def test_bytes_read_is_misses_plus_prefetches(m, make):
    c = make(3)
    rng = random.Random(5)
    for k in range(80):
        il = rng.choice(m.layers)
        c.begin_pass()
        if rng.random() < 0.5:
            c.prefetch(il, rng.sample(range(m.n_expert), rng.randint(1, 4)))
        ids = rng.sample(range(m.n_expert), rng.randint(1, 3))
        with c.fetch(il, ids) as b:
            m.check(b, il, ids)
        for jl in m.layers:
            settled(c, jl)
            s = L(c, jl)
            assert s["bytes_read"] == (s["misses"] + s["prefetch_issued"]) * m.expert_bytes[jl]
            assert s["prefetch_used"] + s["prefetch_wasted"] <= s["prefetch_issued"]
            assert s["duplicate_reads"] == 0
    t = c.stats()["total"]
    assert t["prefetch_issued"] > 0 and t["prefetch_used"] > 0


# -- in-flight reads ----------------------------------------------------------------------------

def test_demand_shares_an_in_flight_prefetch(m, make, slow_reads):
    c = make()
    c.prefetch(0, [2, 5])
    assert wait_for(lambda: len(slow_reads.calls) == 2, timeout=60)  # the I/O thread took both
    with c.fetch(0, [5, 2]) as b:
        assert sorted(slow_reads.done) == [(0, 2), (0, 5)]  # it waited for the reads already under way
        m.check(b, 0, [2, 5])
    s = L(c, 0)
    assert s["loads"] == 2 and s["bytes_read"] == 2 * m.expert_bytes[0]
    assert (s["hits"], s["misses"], s["prefetch_issued"], s["prefetch_used"]) == (2, 0, 2, 2)
    assert sorted(slow_reads.calls) == [(0, 2), (0, 5)]


def test_concurrent_demands_share_one_read(m, make, slow_reads):
    c = make(2)
    barrier = threading.Barrier(4)
    errors = []

    def worker():
        try:
            barrier.wait()
            with c.fetch(1, [3]) as b:
                m.check(b, 1, [3])
        except (StorageError, AssertionError) as e:  # pragma: no cover - reported below
            errors.append(e)
    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert not errors
    s = L(c, 1)
    assert s["loads"] == 1 and s["misses"] == 1 and s["hits"] == 3
    assert slow_reads.calls == [(1, 3)]


# -- prefetch rules -----------------------------------------------------------------------------

def test_prefetch_never_evicts_pinned_or_unused_predictions(m, make):
    c = make(2)
    with c.fetch(0, [0, 1]) as b:
        c.prefetch(0, [2, 3])  # both slots pinned: nothing to give
        s = L(c, 0)
        assert (s["prefetch_issued"], s["prefetch_skipped"], s["evictions"]) == (0, 2, 0)
        m.check(b, 0, [0, 1])
    c.prefetch(0, [2, 3])  # 0 and 1 are used and released: fair game
    settled(c, 0)
    s = L(c, 0)
    assert (s["prefetch_issued"], s["prefetch_skipped"], s["evictions"]) == (2, 2, 2)
    c.prefetch(0, [4, 5])  # 2 and 3 are predictions still to be used: kept
    s = L(c, 0)
    assert (s["prefetch_issued"], s["prefetch_skipped"], s["evictions"]) == (2, 4, 2)
    with c.fetch(0, [2]) as b:
        m.check(b, 0, [2])
    c.prefetch(0, [4])  # 2 is used now: it goes, 3 stays
    settled(c, 0)
    s = L(c, 0)
    assert (s["prefetch_issued"], s["prefetch_used"], s["prefetch_wasted"], s["evictions"]) == (3, 1, 0, 3)
    loads = s["loads"]
    with c.fetch(0, [3, 4]) as b:
        m.check(b, 0, [3, 4])
    s = L(c, 0)
    assert s["loads"] == loads and s["prefetch_used"] == 3 and s["hits"] == 3
    # a demand may evict an unused prediction: that one is wasted
    c.prefetch(0, [6])  # evicts LRU 3 (used)
    settled(c, 0)
    with c.fetch(0, [7, 4]) as b:  # 4 hits; 7 misses and takes 6's slot, unused
        m.check(b, 0, [4, 7])
    s = L(c, 0)
    assert s["prefetch_wasted"] == 1 and s["prefetch_used"] == 3


@pytest.mark.parametrize("policy", ["lfu-decay", "lfru"])
def test_a_frequency_policy_evicts_as_the_replay_simulator_does(m, make, policy):
    """EXPERT_CACHE_POLICY: the cache's hits and misses step for step equal the replay simulator's
    demand loop (experts/policies.py) with the same policy, on steps that fit the slots; and they
    differ from LRU's on this sequence (the simulator: 100 LRU hits against 95-96), so the setting
    reaches the eviction."""
    slots = 4
    rng = random.Random(11)
    seq = [sorted({rng.choice([0, 1, 2]), *rng.sample(range(3, m.n_expert), 2)}) for _ in range(60)]
    got = []
    for kind in (policy, "lru"):
        c = make(slots, policy=kind)
        for ids in seq:
            with c.fetch(0, ids) as b:
                m.check(b, 0, ids)
        got.append((L(c, 0)["hits"], L(c, 0)["misses"]))
    want = simulate_layer([frozenset(ids) for ids in seq], slots, policy)
    assert got[0] == (want.hits, want.misses)
    assert got[0] != got[1]


def test_an_unknown_policy_is_refused(m):
    with pytest.raises(ValueError, match="lfru"):
        ExpertCache(m.store, 1.0, policy="belady")


def test_prefetch_of_cached_or_in_flight_reads_nothing(m, make, slow_reads):
    c = make()
    with c.fetch(0, [1]):
        pass
    c.prefetch(0, [1, 2])
    c.prefetch(0, [2])  # 2 is in flight
    settled(c, 0)
    s = L(c, 0)
    assert s["prefetch_issued"] == 1 and s["loads"] == 2
    assert sorted(slow_reads.calls) == [(0, 1), (0, 2)]


def test_pinned_batch_is_never_overwritten(m, make, slow_reads):
    slow_reads.delay = 0.01
    c = make(4)
    with c.fetch(0, [0, 1]) as held:
        m.check(held, 0, [0, 1])
        mine = [held.rows[0], held.rows[1]]
        snap = {p: np.array(getattr(held, p)[mine]) for p in PROJECTIONS}
        for _ in range(3):
            c.prefetch(0, list(range(2, m.n_expert)))
        settled(c, 0)
        assert L(c, 0)["prefetch_issued"] == 2  # the two free slots; the held ones are never given
        done = threading.Event()

        def other():  # another step of the same layer while ours is held: overflows, no deadlock
            with c.fetch(0, [4, 5, 6]) as b:
                m.check(b, 0, [4, 5, 6])
            done.set()
        t = threading.Thread(target=other)
        t.start()
        t.join(10)
        assert done.is_set()
        settled(c, 0)
        for p in PROJECTIONS:
            assert np.array_equal(getattr(held, p)[mine], snap[p])
        m.check(held, 0, [0, 1])
    assert L(c, 0)["cached"] <= 4


def test_no_duplicate_reads_across_passes(m, make):
    c = make(2)
    rng = random.Random(9)
    for _ in range(30):
        c.begin_pass()
        for il in m.layers:  # one fetch per layer per pass, as a forward pass does
            c.prefetch(il, rng.sample(range(m.n_expert), 2))
            ids = rng.sample(range(m.n_expert), rng.randint(1, 4))
            with c.fetch(il, ids) as b:
                m.check(b, il, ids)
    for il in m.layers:
        settled(c, il)
    assert c.stats()["total"]["duplicate_reads"] == 0
    assert c.stats()["total"]["evictions"] > 0


def test_duplicate_read_within_a_pass_is_counted(m, make):
    c = make(1)
    c.begin_pass()
    for ids in ([0], [1], [0]):  # 0 is evicted by 1 and read again in the same pass
        with c.fetch(0, ids):
            pass
    assert L(c, 0)["duplicate_reads"] == 1
    c.begin_pass()
    with c.fetch(0, [1]):
        pass
    assert L(c, 0)["duplicate_reads"] == 1


# -- errors -------------------------------------------------------------------------------------

@pytest.fixture
def faulty(monkeypatch):
    """Reads fail for the (layer, expert) pairs in `faulty.bad`: read_sync (I/O threads) and
    the compute thread's parallel reads, each bad expert of a batch alone."""
    orig, orig_parallel = StoreReader.read_sync, ParallelReader.read
    bad: set[tuple[int, int]] = set()
    hit = threading.Event()

    def injected(store, layer, expert):
        hit.set()
        return StorageError(f"{store.path}: layer {layer} expert {expert}: injected I/O error")

    def read(self, fd, layer, expert, dests):
        if (layer, expert) in bad:
            raise injected(self.store, layer, expert)
        return orig(self, fd, layer, expert, dests)

    def read_parallel(self, layer, experts, dests):
        good = [i for i, e in enumerate(experts) if (layer, e) not in bad]
        done = iter(orig_parallel(self, layer, [experts[i] for i in good], [dests[i] for i in good]))
        return [next(done) if (layer, e) not in bad else (0, injected(self.store, layer, e)) for e in experts]
    monkeypatch.setattr(StoreReader, "read_sync", read)
    monkeypatch.setattr(ParallelReader, "read", read_parallel)
    read.bad, read.hit = bad, hit
    return read


@pytest.mark.parametrize("slots", [None, 2, 0])
def test_read_error_fails_the_fetch_and_is_retried(m, make, faulty, slots):
    c = make(slots)
    c.begin_pass()
    faulty.bad.add((0, 3))
    with pytest.raises(StorageError, match="layer 0 expert 3"), c.fetch(0, [2, 3]):
        pytest.fail("the body must not run")
    with pytest.raises(StorageError), c.fetch(0, [3]):  # still failing: read again, fails again
        pass
    faulty.bad.clear()
    with c.fetch(0, [3, 2]) as b:
        m.check(b, 0, [2, 3])
    s = L(c, 0)
    assert s["cached"] <= (slots if slots is not None else m.n_expert)
    assert s["bytes_read"] == s["loads"] * m.expert_bytes[0]
    # the failed reads read nothing, so retrying them is no duplicate; with no slots at all,
    # expert 2 (read fine the first time) had to be read again in the same pass
    assert s["duplicate_reads"] == (1 if slots == 0 else 0)


def test_failed_prefetch_is_forgotten(m, make, faulty):
    c = make()
    faulty.bad.add((1, 6))
    c.prefetch(1, [6])
    assert faulty.hit.wait(10)
    assert wait_for(lambda: L(c, 1)["cached"] == 0)
    faulty.bad.clear()
    with c.fetch(1, [6]) as b:
        m.check(b, 1, [6])
    s = L(c, 1)
    assert s["misses"] == 1 and s["loads"] == 1


def test_truncated_file(m, make, tmp_path):
    """Without the check of the file (as if the truncation raced it), each read's length check
    still fails the read cleanly, and a file restored in place serves again."""
    path = tmp_path / "m.gguf"
    shutil.copyfile(m.path, path)
    with GGUFFile(path) as g:
        store = ExpertStore.from_gguf(g, expert_layouts(g))
        down = g.tensor_info("blk.1.ffn_down_exps.weight")
    store.identity = None
    original = path.read_bytes()
    with open(path, "r+b") as f:
        f.truncate(down.offset + down.nbytes // 2)
    c = make(2, store=store)
    with c.fetch(0, [1, 2]) as b:  # layer 0 lies before the cut
        m.check(b, 0, [1, 2])
    with pytest.raises(StorageError, match="truncated") as ei, c.fetch(1, [7]):
        pass
    assert str(path) in str(ei.value) and "layer 1" in str(ei.value) and "expert 7" in str(ei.value)
    with open(path, "r+b") as f:  # restored in place: the open descriptor sees it
        f.write(original)
    with c.fetch(1, [7, 0]) as b:
        m.check(b, 1, [0, 7])


def test_changed_file_fails_every_later_fetch(m, make, tmp_path):
    path = tmp_path / "m.gguf"
    shutil.copyfile(m.path, path)
    with GGUFFile(path) as g:
        store = ExpertStore.from_gguf(g, expert_layouts(g))
    original = path.read_bytes()
    c = make(2, store=store)
    with c.fetch(0, [1, 2]) as b:
        m.check(b, 0, [1, 2])
    os.truncate(path, len(original) - 4096)
    with pytest.raises(ModelFileChanged, match="truncated") as ei, c.fetch(0, [3]):
        pass
    assert str(path) in str(ei.value) and "layer 0 expert 3" in str(ei.value)
    with open(path, "r+b") as f:  # restored in place: still not the file that was loaded (mtime)
        f.write(original)
    st = os.stat(path)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # as the write does on a fine clock
    c.prefetch(1, [4])
    with pytest.raises(ModelFileChanged, match="modified"), c.fetch(1, [4, 5]):
        pass


def test_missing_file_fails_every_fetch(m, make, tmp_path):
    path = tmp_path / "m.gguf"
    shutil.copyfile(m.path, path)
    with GGUFFile(path) as g:
        store = ExpertStore.from_gguf(g, expert_layouts(g))
    path.unlink()
    c = make(store=store)
    for _ in range(2):
        with pytest.raises(StorageError, match="cannot open"), c.fetch(0, [0]):
            pass


# -- lifecycle ----------------------------------------------------------------------------------

def _io_threads():
    return [t for t in threading.enumerate() if t.name.startswith(("moed-expert-io", "moed-read"))]


def test_close_ends_threads_and_is_idempotent(m):
    before = set(_io_threads())
    c = ExpertCache(m.store, 0.0, io_depth=3)
    c.prefetch(0, [0, 1, 2, 3])
    with c.fetch(1, [4, 5]) as b:
        m.check(b, 1, [4, 5])
    assert set(_io_threads()) - before
    c.close()
    assert wait_for(lambda: not (set(_io_threads()) - before), 5)
    c.close()
    with ExpertCache(m.store, 0.0) as c2, c2.fetch(0, [1]) as b:
        m.check(b, 0, [1])
    assert wait_for(lambda: not (set(_io_threads()) - before), 5)


def test_stats_shape_and_reset(m, make):
    import json

    c = make(2)
    with c.fetch(0, [0, 1, 2]):
        pass
    st = c.stats()
    json.dumps(st)
    assert st["source"] == "gguf" and st["path"] == m.store.path
    assert set(st["layers"]) == set(m.layers)
    assert st["expert_bytes"] == m.expert_bytes
    assert st["cached_bytes"] == 2 * m.expert_bytes[0]
    for k in ("requests", "misses", "loads", "bytes_read", "evictions"):
        assert st["total"][k] == sum(st["layers"][il][k] for il in m.layers)
    c.reset_stats()
    s = L(c, 0)
    assert s["requests"] == s["loads"] == s["unique_requested"] == 0 and s["cached"] == 2
    with c.fetch(0, [1]):
        pass
    s = L(c, 0)
    assert s["unique_requested"] == 1 and s["hits"] == 1


def test_unlimited_layer_holding_every_expert_keeps_counting_and_serving(m, make):
    """Once an unlimited layer holds every expert, fetches take a shortcut (nothing can be evicted
    any more): the bytes served and the counters must stay what the slow path gives."""
    c = make()
    il = m.layers[0]
    E = m.n_expert
    c.prefetch(il, [E - 1])  # one predicted expert, used only later
    with c.fetch(il, list(range(E - 1))) as b:
        m.check(b, il, range(E - 1))
    time.sleep(0.2)  # let the prefetch land
    rng = random.Random(3)
    asked = E - 1
    used_prefetch = False
    for _ in range(20):
        ids = rng.sample(range(E), 3)
        with c.fetch(il, ids) as b:
            m.check(b, il, ids)
        asked += 3
        used_prefetch |= E - 1 in ids
    st = c.stats()["layers"][il]
    assert st["loads"] == E and st["requests"] == asked
    assert st["hits"] == asked - (E - 1) and st["misses"] == E - 1
    assert st["prefetch_used"] == int(used_prefetch) and st["unique_requested"] == E - 1 + int(used_prefetch)
    assert st["bytes_read"] == E * m.expert_bytes[il]


def test_waves_put_cached_experts_first_and_fit_the_slots(m, make):
    c = make(2)
    assert c.waves(0, [1, 4]) == [[1, 4]]  # fits: one fetch
    with c.fetch(0, [5, 6]):
        pass
    waves = c.waves(0, [1, 2, 5, 6, 7])
    assert waves[0] == [5, 6]  # cached: used before a miss can evict them
    assert sorted(sum(waves, [])) == [1, 2, 5, 6, 7] and all(len(w) <= 2 for w in waves)
    assert make(0).waves(0, [3, 1]) == [[3], [1]]  # no slots: one expert per fetch
    assert make().waves(0, list(range(m.n_expert))) == [list(range(m.n_expert))]


def test_close_frees_the_experts_and_later_fetches_fail_cleanly(m, make):
    c = make(3)
    with c.fetch(0, [1, 2]) as b:
        m.check(b, 0, [1, 2])
    c.close()
    assert L(c, 0)["cached"] == 0 and all(lc.arena is None for lc in c._layers.values())
    with pytest.raises(StorageError, match="closed"):
        c.fetch(0, [1])
    c.prefetch(0, [4])  # ignored, no error


@pytest.mark.parametrize("where", ["StoreReader", "ThreadPoolExecutor"])
def test_io_thread_that_fails_to_start_fails_the_cache_not_hangs_it(m, monkeypatch, where):
    """Issue 25: an exception in the I/O thread before it is ready (MemoryError for a huge
    io_depth) left the loader waiting forever; it must reach the loader, and leave no thread."""
    import daemon.storage.cache as cache_mod

    def boom(*a, **kw):
        raise MemoryError("injected")
    monkeypatch.setattr(cache_mod, where, boom)
    before = {t.ident for t in threading.enumerate()}
    out: list = []

    def build():
        try:
            out.append(ExpertCache(m.store, 0.0, io_depth=4, demand_reads="io"))
        except BaseException as e:  # noqa: BLE001 - handed to the test
            out.append(e)
    t = threading.Thread(target=build, daemon=True)
    t.start()
    t.join(60)  # a guard against the old hang, not a timing: the start fails at once
    assert not t.is_alive(), "ExpertCache() still waiting for its I/O thread"
    assert isinstance(out[0], MemoryError) and "injected" in str(out[0]), out
    assert not [t for t in threading.enumerate() if t.ident not in before and t.name.startswith("moed-")]
