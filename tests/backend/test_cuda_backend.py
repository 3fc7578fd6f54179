"""What only the CUDA backend has: experts of one step split between the GEMV and the tiled
matmul by sequence (and waves joined), and the KV pool's slots (reuse, growth). Small shapes: these
run under the simulator in CI."""

from __future__ import annotations

import gc

import numpy as np
import pytest

from daemon.backend import Step
from daemon.backend.cpu_cache import KVCache
from daemon.kernels import quants as Q
from daemon.storage.experts import ExpertLayout

from . import reference as R
from .conftest import CUDA_SKIP_REASON

pytestmark = pytest.mark.skipif(CUDA_SKIP_REASON is not None, reason=str(CUDA_SKIP_REASON))


@pytest.fixture(scope="module")
def cuda_backend():
    from daemon.backend.cuda import CUDABackend

    return CUDABackend(0)


def test_expert_rows_take_their_sequences_kernel(cuda_backend):
    """A step of a 1-row and a 17-row sequence: the first's pairs on the GEMV, the second's on
    the tiled matmul, each matching numpy and bit-identical to its sequence alone; the same
    step in two waves of one expert each, joined, gives the same bits."""
    b = cuda_backend
    E, N, K = 2, 16, 128  # K: the tiled matmul's step
    rng = np.random.default_rng(0)
    stack = R.raw_weights(Q.Q8_0, (E, N), K, rng)  # [E, N, rb]
    layout = ExpertLayout(E, K, 128, Q.Q8_0, Q.Q8_0, Q.Q8_0)  # n_ff 128: the down projection could tile too
    slots = {0: 1, 1: 0}
    held = np.ascontiguousarray(stack[[1, 0]])  # expert e at slot slots[e]
    counts = (1, 17)
    x = rng.standard_normal((sum(counts), K)).astype(np.float32)
    ids = rng.integers(0, E, (sum(counts), 1))
    caches = [KVCache(1, 1, 4, 4, 32) for _ in counts]
    step = Step.append([np.zeros(n, np.int64) for n in counts], caches, True)

    plan = b.expert_plan(ids, slots, layout, step)
    assert [(s.r0, s.r1, s.tiled) for s in plan.segments] == [(0, 1, False), (1, 18, True)]
    both = b.to_host(b.expert_linear(x, held, Q.Q8_0, K, plan))  # [P, N]
    want = np.einsum("tnk,tk->tn", R.dequant(stack, Q.Q8_0)[ids[:, 0]], x.astype(np.float64))
    assert R.rel_err(both, want) < R.tolerance(b, Q.Q8_0)
    for s, c in enumerate(caches):
        r0, r1 = step.offsets[s], step.offsets[s + 1]
        alone = Step.append([np.zeros(r1 - r0, np.int64)], [c], True)
        got = b.to_host(b.expert_linear(x[r0:r1], held, Q.Q8_0, K, b.expert_plan(ids[r0:r1], slots, layout, alone)))
        assert np.array_equal(got, both[r0:r1]), s

    parts, plans = [], []
    for wave in ([0], [1]):
        plans.append(b.expert_plan(ids, {e: slots[e] for e in wave}, layout, step, only=np.array(wave)))
        parts.append(b.expert_linear(x, held, Q.Q8_0, K, plans[-1]))
    assert np.array_equal(b.to_host(b.join_parts(parts, plans)), both)


def test_kv_slots_are_reused_and_kept_when_the_pool_grows(cuda_backend):
    """A dropped sequence's slot goes to the next one; a fifth live sequence grows the pool (4
    slots at first) and every sequence keeps its cells."""
    b = cuda_backend
    hp = R.small_hparams(n_layer=1, n_head=2, n_head_kv=1, head_dim=8, head_dim_v=8)
    first = b.new_cache(hp, 8)
    slot = first.slot
    del first
    gc.collect()
    caches = [b.new_cache(hp, 8)]
    assert caches[0].slot == slot
    rng = np.random.default_rng(1)
    k = rng.standard_normal((1, 1, 8)).astype(np.float32)
    caches[0].reserve(1)
    b.attention(0, np.zeros((1, 2, 8), np.float32), k, k, Step.append([np.zeros(1, np.int64)], caches, True), 1.0,
                0, None)
    pool = caches[0].pool
    assert pool.slots == 4
    caches += [b.new_cache(hp, 8) for _ in range(4)]
    assert pool.slots == 8 and len({c.slot for c in caches}) == 5
    kept = pool.k[0][:1].copy_to_host()[0, caches[0].slot, 0, 0]  # [Dh] of cell 0 (block 0, row 0)
    assert np.array_equal(kept, k[0, 0].astype(np.float16))


def test_more_cells_map_memory_without_moving_the_pool(cuda_backend):
    """Cells grow inside the range reserved for the largest n_ctx: the arrays (their addresses,
    which captured graphs hold) stay, and a sequence's cells are kept; the backend keeps its graphs.
    Only more sequences than slots make the arrays again."""
    from daemon.backend.cuda_cache import FIRST_CELLS, KVPool

    grew = []
    # 4 KiB a cell (2 slots x 8 heads x 128 x f16): a 2 MiB granule of VRAM maps 512 cells
    pool = KVPool(2, 8, 128, 128, slots=2, on_grow=lambda delta, moved: grew.append((delta, moved)))
    slot = pool.acquire(8 * FIRST_CELLS)
    assert pool.cells >= FIRST_CELLS and pool.reserved_cells == 8 * FIRST_CELLS and grew[-1][1]
    k = pool.k[0]
    def address(a):  # the simulator's arrays have none: their identity stands for it
        return a.__cuda_array_interface__["data"][0] if hasattr(a, "__cuda_array_interface__") else id(a)

    ptr = address(k)
    vals = np.arange(128, dtype=np.float16)
    host = k[:1].copy_to_host()  # only the mapped cells may be touched
    host[0, slot, 5, 3] = vals  # cell 3 of head 5 (block 0, row 3)
    k[:1].copy_to_device(host)
    cells, before = pool.cells, pool.nbytes
    pool.reserve(cells + 1)
    assert pool.cells >= 2 * cells and pool.k[0] is k and address(k) == ptr
    assert grew[-1] == (pool.nbytes - before, False) and pool.nbytes >= 2 * 2 * pool.cells * 2 * 8 * 128 * 2
    assert np.array_equal(pool.k[0][:1].copy_to_host()[0, slot, 5, 3], vals)
    pool.acquire(8 * FIRST_CELLS)
    pool.acquire(8 * FIRST_CELLS)  # a third sequence: 4 slots, new arrays holding the old cells
    assert pool.slots == 4 and grew[-1][1] is True and pool.k[0] is not k
    assert np.array_equal(pool.k[0][:1].copy_to_host()[0, slot, 5, 3], vals)


def test_a_kv_growth_in_cells_keeps_the_backends_graphs(cuda_backend):
    b = cuda_backend
    hp = R.small_hparams(n_layer=1, n_head=2, n_head_kv=2, head_dim=8, head_dim_v=8)  # a pool of its own
    c = b.new_cache(hp, 100_000)  # past a 2 MiB granule's cells: a growth maps more
    b.graphs.first_sighting("a key")  # stands for a captured step's graph
    c.reserve(c.pool.cells + 1)
    assert not b.graphs.first_sighting("a key")  # not cleared
    b._kv_grew(0, True)  # new arrays: every graph is stale
    assert b.graphs.first_sighting("a key")
