"""Sampling on the device against the CPU Sampler (daemon.sampling): greedy and the repeat penalty
bit for bit, the top-k candidate set, the draw's distribution (chi-square against an independent
float64 reference written from the documented semantics), batch invariance, seeds, non-finite
rows, the history ring over steps, and pool growth.

Shapes are tiny (the simulator runs each thread as a Python thread); threads per block 4 or 32.
"""

import math
import sys
import threading
import traceback

import numpy as np
import pytest
from numba import cuda

from daemon.kernels.cuda.ptx import SIMULATOR
from daemon.kernels.cuda.sample import SamplerSlots, _best_sorted, _scan, sample, sample_rows
from daemon.sampling import Sampler, SamplingOptions

# numba's xoroshiro128+ wraps uint64 arithmetic, which numpy scalars report under the simulator
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")


@pytest.fixture(autouse=True)
def _fast_switch():
    """The simulator's block manager polls its threads under the GIL: a short switch interval
    makes a barrier cost microseconds, not milliseconds (no effect on results)."""
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    yield
    sys.setswitchinterval(old)


@pytest.fixture(autouse=True)
def _shared_arrays_made_once():
    """numba-cuda 0.30's simulator makes a shared array on its first use in a launch without a
    lock (FakeCUDAShared.array: get, then np.empty): two threads of the first block may each get
    their own, uninitialized, and not see each other's writes (seen here once under load: a
    token -1). Made under a lock while these tests run; nothing changes on a GPU."""
    if not SIMULATOR:
        yield
        return
    from numba.cuda.simulator import kernelapi

    lock = threading.Lock()
    plain = kernelapi.FakeCUDAShared.array

    def array(self, shape, dtype, alignment=None):
        if shape == 0 or alignment is not None:
            return plain(self, shape, dtype, alignment)  # not used here (its caller frame differs)
        if isinstance(dtype, kernelapi.types.Type):
            dtype = kernelapi.numpy_support.as_dtype(dtype)
        where = traceback.extract_stack(sys._getframe(1), limit=1)[0][0:2]  # the kernel's line
        with lock:
            res = self._allocations.get(where)
            if res is None:
                res = self._allocations[where] = np.empty(shape, dtype)
        return res

    kernelapi.FakeCUDAShared.array = array
    yield
    kernelapi.FakeCUDAShared.array = plain


_GPU_ONLY = pytest.mark.skipif(SIMULATOR, reason="slow in the simulator (test_block_scan_over_warps "
                                                  "covers scans over several warps there)")


def _opts(**kw):
    base = dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, repeat_penalty=1.0)
    return SamplingOptions(**{**base, **kw})


def _expected(logits, o):
    """{token: probability} of one draw, from the documented semantics, in Python floats: top-k of
    the order (logit desc, index asc), probabilities at temperature 1 over them, top-p (through
    the first whose cumulative probability reaches top_p), min-p (>= min_p * the best's), then
    weights exp((l - best) / temperature)."""
    order = sorted(range(len(logits)), key=lambda i: (-float(logits[i]), i))
    if o.top_k:
        order = order[:o.top_k]
    best = float(logits[order[0]])
    e = [math.exp(float(logits[i]) - best) for i in order]
    probs = [x / sum(e) for x in e]
    if o.top_p < 1:
        cum, keep = 0.0, len(order)
        for n, p in enumerate(probs):
            cum += p
            if cum >= o.top_p:
                keep = n + 1
                break
        order, probs = order[:keep], probs[:keep]
    if o.min_p > 0:
        kept = [(i, p) for i, p in zip(order, probs) if p >= o.min_p * probs[0]]
        order, probs = [i for i, _ in kept], [p for _, p in kept]
    w = []
    for i in order:
        d = (float(logits[i]) - best) / o.temperature if float(logits[i]) != best else 0.0
        w.append(math.exp(max(d, -800.0)))
    return {i: x / sum(w) for i, x in zip(order, w) if x > 0}


def _chi2_ok(tokens, expected, alpha_z=3.29):
    """Every token in the support, and Pearson's chi-square under the critical value at
    p ~ 5e-4 (Wilson-Hilferty), over bins with expected count >= 5 (the rest pooled)."""
    n = len(tokens)
    assert set(tokens) <= set(expected), f"drawn outside the support: {set(tokens) - set(expected)}"
    counts = {i: 0 for i in expected}
    for t in tokens:
        counts[t] += 1
    big = [i for i in expected if expected[i] * n >= 5]
    obs = [counts[i] for i in big]
    exp = [expected[i] * n for i in big]
    rest = n - sum(obs)
    if n - sum(exp) >= 5:
        obs.append(rest)
        exp.append(n - sum(exp))
    df = len(obs) - 1
    if df == 0:
        return True
    stat = sum((o - e) ** 2 / e for o, e in zip(obs, exp))
    crit = df * (1 - 2 / (9 * df) + alpha_z * math.sqrt(2 / (9 * df))) ** 3
    assert stat < crit, f"chi2 {stat:.1f} >= {crit:.1f} (df {df}): counts {obs}, expected {[round(e, 1) for e in exp]}"
    return True


def _draws(logits, o, n, threads=4, sort_max=1024, seed0=1000, chunk=2048, single=False):
    """One draw each from n slots seeded seed0.. over the same logits, in one launch."""
    pool = SamplerSlots(n, 4)
    slots = [pool.assign(SamplingOptions(**{**_fields(o), "seed": seed0 + s}), [], 64) for s in range(n)]
    tokens, flags = sample(np.tile(logits, (n, 1)), slots, pool, threads=threads, sort_max=sort_max,
                           chunk=chunk, single=single)
    assert not flags.any()
    return tokens.tolist()


def _fields(o):
    return {f: getattr(o, f) for f in o.__struct_fields__}


# ---- greedy and the penalty: bit for bit -------------------------------------------------------

@pytest.mark.parametrize("threads", [4, 32, 64])
def test_greedy_and_penalized_logits_are_the_cpus(threads):
    rng = np.random.default_rng(0)
    V, S = 150, 8
    logits = rng.integers(-4, 5, size=(S, V)).astype(np.float32)  # ties everywhere
    logits[:, ::7] *= np.float32(0.37)  # and some non-integers
    logits[1, :] = -logits[1, :] - np.float32(1e-45)  # denormals
    penalties = [1.0, 1.3, 0.7, 1e-300, 1e300, 2.5, 1.0001, 40.0]
    pool = SamplerSlots(2, 4)
    slots, want, want_logits = [], [], []
    for r in range(S):
        o = _opts(temperature=0.0, repeat_penalty=penalties[r], repeat_last_n=[5, 64, 1, 20, 3, 0, 9, 30][r])
        history = rng.integers(0, V, size=40).tolist() + [int(np.argmax(logits[r]))] * 3  # duplicates
        slots.append(pool.assign(o, history, 200))
        s = Sampler(o)
        want.append(s.sample(logits[r], history))
        pen = s._penalized(logits[r], history) if o.repeat_penalty != 1.0 and o.repeat_last_n else logits[r]
        want_logits.append(pen)
    d_logits = cuda.to_device(logits)
    tokens, flags = sample(d_logits, slots, pool, threads=threads)
    assert tokens.tolist() == want
    assert not flags.any()
    assert np.array_equal(d_logits.copy_to_host().view(np.uint32), np.array(want_logits).view(np.uint32))


def test_penalty_sees_history_and_sampled_tokens_over_steps():
    rng = np.random.default_rng(1)
    V = 40
    o = _opts(temperature=0.0, repeat_penalty=3.0, repeat_last_n=4)
    prompt = [5, 5, 7, 9, 5, 11]
    pool = SamplerSlots(1, 2)  # the window (4) grows the ring
    slot = pool.assign(o, prompt, 100)
    cpu, history = Sampler(o), list(prompt)
    got, want = [], []
    base = rng.integers(0, 3, size=V).astype(np.float32)
    base[[5, 7, 9, 11, 13]] = [6.0, 5.5, 5.0, 4.5, 4.0]  # favourites, penalized in turn
    for _ in range(7):
        logits = base + rng.integers(0, 2, size=V).astype(np.float32) * np.float32(0.25)
        tokens, _ = sample(logits[None], [slot], pool, threads=4)
        got.append(int(tokens[0]))
        want.append(cpu.sample(logits, history))
        history.append(want[-1])
    assert got == want
    assert len(set(want)) > 2  # the penalty did move the choice
    history = [5, 7, 9, 11, 13, 13]  # a history set from outside (tokens not sampled here)
    pool.set_history(slot, history)
    logits = base.copy()
    assert int(sample(logits[None], [slot], pool, threads=4)[0][0]) == Sampler(o).sample(logits, history)


# ---- the candidates ---------------------------------------------------------------------------

@pytest.mark.parametrize("sort_max", [1024, 0], ids=["sorted", "radix"])
def test_top_k_candidates_are_the_cpus_first_k_with_boundary_ties(sort_max):
    # temperature 1e300 makes the draw uniform over the candidates: 60 draws see every one of 3..4
    ties = np.array([1, 3, 2, 3, 0, 2, 3, 2, 1, 2, -1, 2, 0, 2], np.float32)
    zeros = np.array([-1, -0.0, 0.0, -0.0, -3], np.float32)  # -0.0 ties +0.0, as on the CPU
    for logits, k, n in ((ties, 3, 60), (ties, 4, 60), (zeros, 1, 4), (zeros, 2, 30)):
        o = _opts(top_k=k, temperature=1e300)
        first_k = sorted(range(len(logits)), key=lambda i: (-logits[i], i))[:k]
        got = set(_draws(logits, o, n, sort_max=sort_max))
        assert got == set(first_k), (k, got, first_k)


_TIES = np.full(12, -20, np.float32)
_TIES[[0, 2, 4, 5, 7]] = 4  # five equal best: top_p 0.5 keeps the three of lowest index
_TIES_K = np.full(12, -20, np.float32)
_TIES_K[[0, 3, 5, 6, 9]] = [4, 3, 3, 3, 3]  # top_k 4 takes three of the 3s; top_p 0.75 two of those
_TIE_CASES = {
    "top_p_in_ties_of_the_best": (_TIES, _opts(top_k=8, top_p=0.5, temperature=1e300)),
    "top_p_in_ties_no_top_k": (_TIES, _opts(top_k=0, top_p=0.5, temperature=1e300)),
    "top_p_in_ties_at_the_top_k_bound": (_TIES_K, _opts(top_k=4, top_p=0.75, temperature=1e300)),
}


@pytest.mark.parametrize("sort_max", [1024, 2], ids=["sorted", "radix"])
@pytest.mark.parametrize("case", list(_TIE_CASES))
def test_a_cut_through_ties_keeps_the_lowest_indices(case, sort_max):
    logits, o = _TIE_CASES[case]
    want = set(_expected(logits, o))
    assert len(want) == 3
    assert set(_draws(logits, o, 40, sort_max=sort_max)) == want


# ---- the distribution --------------------------------------------------------------------------

_LOGITS = np.array([2.0, -1, 3.1, 0.5, 3.1, 1.7, -6, 2.6, 0.1, -2, 2.2, 1.0, -9, 0.8, 1.2, 2.9] * 3, np.float32)
_LOGITS[16:] -= 4  # 48 tokens: top_k=40 cuts, and ties at the top (3.1 twice)

_CASES = {
    "default": (SamplingOptions(repeat_penalty=1.0), 1024),
    "top_p_no_top_k": (_opts(top_k=0, top_p=0.8, temperature=3.0), 1024),
    "min_p": (_opts(top_k=0, min_p=0.2, temperature=0.4), 1024),
    "top_k_radix_top_p": (_opts(top_k=6, top_p=0.9, temperature=3.0), 2),
    "tiny_temperature": (_opts(top_k=10, temperature=1e-300), 1024),
    "huge_temperature_top_p": (_opts(top_k=0, top_p=0.5, temperature=1e300), 1024),
}


@pytest.mark.parametrize("threads", [4, pytest.param(1024, marks=_GPU_ONLY)])
@pytest.mark.parametrize("case", list(_CASES))
def test_draws_are_distributed_as_the_cpus(case, threads):
    o, sort_max = _CASES[case]
    expected = _expected(_LOGITS, o)
    assert len(expected) >= 2  # a real draw, not a forced token
    _chi2_ok(_draws(_LOGITS, o, 120, threads=threads, sort_max=sort_max), expected)


def test_reference_matches_the_cpu_sampler():
    """The test's reference is checked against the CPU Sampler the same way (a sanity check of
    _expected and _chi2_ok, not of the kernel)."""
    o = _CASES["top_p_no_top_k"][0]
    s = Sampler(SamplingOptions(**{**_fields(o), "seed": 3}))
    _chi2_ok([s.sample(_LOGITS, []) for _ in range(400)], _expected(_LOGITS, o))


# ---- independence, seeds, non-finite rows, growth -----------------------------------------------

def test_a_slots_tokens_do_not_depend_on_the_batch():
    rng = np.random.default_rng(2)
    steps = [rng.normal(size=(4, 64)).astype(np.float32) * 2 for _ in range(3)]
    o = _opts(seed=42, top_k=20, top_p=0.9, repeat_penalty=1.2)
    alone = SamplerSlots(1, 4)
    a = alone.assign(o, [1, 2, 3], 50)
    batch = SamplerSlots(4, 4)
    others = [batch.assign(_opts(seed=s, temperature=0.5 + s, top_k=0), [s], 50) for s in range(2)]
    b = batch.assign(o, [1, 2, 3], 50)
    others.append(batch.assign(_opts(temperature=0.0, repeat_penalty=1.5), [0], 50))
    got_alone, got_batch = [], []
    for logits in steps:
        got_alone.append(int(sample(logits[2:3].copy(), [a], alone, threads=4)[0][0]))
        rows = [others[0], others[1], b, others[2]]
        got_batch.append(int(sample(logits, rows, batch, threads=4)[0][2]))
    assert got_alone == got_batch


def test_same_seed_same_tokens_other_seed_differs():
    logits = np.linspace(0, 1.5, 32).astype(np.float32)  # a flat distribution: seeds show
    pool = SamplerSlots(3, 4)
    slots = [pool.assign(_opts(seed=s, top_k=0), [], 50) for s in (7, 7, 8)]
    runs = [[], [], []]
    for _ in range(8):
        tokens, _ = sample(np.tile(logits, (3, 1)), slots, pool, threads=4)
        for r in range(3):
            runs[r].append(int(tokens[r]))
    assert runs[0] == runs[1]
    assert runs[0] != runs[2]


@pytest.mark.parametrize("chunk", [2048, 4])
def test_non_finite_row_is_flagged_alone_and_padding_rows_are_left_alone(chunk):
    rng = np.random.default_rng(3)
    logits = rng.normal(size=(4, 50)).astype(np.float32)
    logits[1, 17] = np.nan
    logits[2, 3] = -np.inf  # in row 2's history: the penalty must not make it finite
    pool = SamplerSlots(4, 4)
    o = _opts(temperature=0.0, repeat_penalty=1.5, repeat_last_n=8)
    slots = [pool.assign(o, h, 50) for h in ([1, 2], [1, 2], [3, 2])]
    before = pool.ringpos.copy_to_host()
    tokens, flags = sample(logits, slots[:3] + [-1], pool, threads=4, chunk=chunk)
    assert flags.tolist() == [0, 1, 1, 0]
    assert tokens[0] == Sampler(o).sample(logits[0], [1, 2])
    after = pool.ringpos.copy_to_host()
    assert after[slots[0]].tolist() == [3, 3]  # the sampled token joined the history
    assert after[slots[1]].tolist() == before[slots[1]].tolist() == [2, 2]  # untouched
    assert after[slots[2]].tolist() == before[slots[2]].tolist()


def test_growth_bumps_generation_and_keeps_existing_state():
    rng = np.random.default_rng(4)
    V = 30
    o = _opts(temperature=0.0, repeat_penalty=2.0, repeat_last_n=3)
    pool = SamplerSlots(1, 3)
    a = pool.assign(o, [4, 4, 6, 8], 100)
    cpu, history = Sampler(o), [4, 4, 6, 8]
    gens = [pool.generation]

    def step():
        logits = rng.integers(0, 4, size=V).astype(np.float32)
        logits[[4, 6, 8]] += 3
        want = cpu.sample(logits, history)
        history.append(want)
        assert int(sample(logits[None], [a], pool, threads=4)[0][0]) == want

    step()
    b = pool.assign(_opts(seed=1), [1], 100)  # N grows: 1 -> 2
    gens.append(pool.generation)
    assert pool._chunk[0].shape == (2, 1)  # phase 1's scratch follows N at once (not in a launch)
    step()
    c = pool.assign(_opts(temperature=0.0, repeat_penalty=1.5, repeat_last_n=10), [2] * 12, 100)  # W grows
    gens.append(pool.generation)
    step()
    step()
    assert gens == [0, 1, 2] and pool.capacity >= 2 and pool.width >= 10
    assert len({a, b, c}) == 3
    pool.release(b)
    assert pool.assign(_opts(), [], 10) == b  # a free slot is reused: no growth
    assert pool.generation == 2
    sample(np.zeros((1, V), np.float32), [a], pool, threads=4, chunk=8)  # other phase-1 scratch
    assert pool.generation == 3
    with pytest.raises(ValueError):
        pool.release(99)


def test_bad_arguments_are_refused():
    pool = SamplerSlots(1, 1)
    logits = cuda.to_device(np.zeros((2, 8), np.float32))
    slots = cuda.to_device(np.zeros(2, np.int32))
    out = cuda.device_array(2, np.int32)
    with pytest.raises(ValueError):
        sample_rows(logits, slots, pool, out, out, threads=48)
    with pytest.raises(ValueError):
        sample_rows(logits, cuda.to_device(np.zeros(3, np.int32)), pool, out, out)
    with pytest.raises(ValueError):
        sample_rows(logits, slots, pool, cuda.device_array(1, np.int32), out)
    for chunk in (1, 12, 4096):
        with pytest.raises(ValueError):
            sample_rows(logits, slots, pool, out, out, chunk=chunk)
    with pytest.raises(ValueError):
        sample_rows(logits, slots, pool, out, out, chunk_threads=100)


@cuda.jit
def _scan_kernel(ints, floats, out_i, out_f):
    tid = cuda.threadIdx.x
    nt = cuda.blockDim.x
    buf_i = cuda.shared.array(96, np.int64)
    buf_f = cuda.shared.array(96, np.float64)
    e, i, t = _scan(ints[tid], buf_i, tid, nt)
    out_i[tid, 0], out_i[tid, 1], out_i[tid, 2] = e, i, t
    e, i, t = _scan(floats[tid], buf_f, tid, nt)
    out_f[tid, 0], out_f[tid, 1], out_f[tid, 2] = e, i, t


@pytest.mark.parametrize("nt", [5, 64])
def test_block_scan_over_warps(nt):
    """The scan's two levels (within warps of 32, then over their totals): integers exact, and in
    float64 a thread's inclusive is the next one's exclusive, bit for bit."""
    rng = np.random.default_rng(7)
    ints = rng.integers(0, 1 << 40, size=nt)
    floats = rng.random(nt) * 10.0 ** rng.integers(-8, 8, size=nt)
    out_i = np.zeros((nt, 3), np.int64)
    out_f = np.zeros((nt, 3), np.float64)
    _scan_kernel[1, nt](ints, floats, out_i, out_f)
    cum = np.cumsum(ints)
    assert out_i[:, 1].tolist() == cum.tolist()
    assert out_i[:, 0].tolist() == [0] + cum[:-1].tolist()
    assert (out_i[:, 2] == cum[-1]).all()
    assert out_f[0, 0] == 0 and (out_f[1:, 0] == out_f[:-1, 1]).all() and out_f[-1, 1] == out_f[0, 2]
    assert np.allclose(out_f[:, 1], np.cumsum(floats), rtol=1e-12)


@cuda.jit
def _best_kernel(keys, idx, U, out_k, out_x):
    tid = cuda.threadIdx.x
    nt = cuda.blockDim.x
    P = keys.shape[0]
    sh_k = cuda.shared.array(64, np.uint32)
    sh_x = cuda.shared.array(64, np.int32)
    for i in range(tid, P, nt):
        sh_k[i] = keys[i]
        sh_x[i] = idx[i]
    cuda.syncthreads()
    _best_sorted(sh_k, sh_x, P, U, tid, nt)
    for i in range(tid, U, nt):
        out_k[i] = sh_k[i]
        out_x[i] = sh_x[i]


@pytest.mark.parametrize("P, U, nt", [(64, 1, 4), (64, 4, 8), (32, 8, 4), (64, 16, 2), (16, 16, 4), (64, 32, 32)])
def test_bitonic_top_k_is_the_best_u_in_order(P, U, nt):
    rng = np.random.default_rng(P * U + nt)
    keys = rng.integers(1, 6, size=P).astype(np.uint32)  # ties everywhere: the index decides
    idx = rng.permutation(1000)[:P].astype(np.int32)
    out_k = np.zeros(U, np.uint32)
    out_x = np.zeros(U, np.int32)
    _best_kernel[1, nt](keys, idx, U, out_k, out_x)
    want = sorted(zip((-keys.astype(np.int64)).tolist(), idx.tolist()))[:U]
    assert list(zip((-out_k.astype(np.int64)).tolist(), out_x.tolist())) == want


# ---- phase 1 over several chunks a row (chunks made small for the simulator) ---------------------

def test_chunked_greedy_and_penalty_across_chunks():
    V = 37  # chunks of 4: ten, the last of one logit
    logits = np.random.default_rng(5).integers(-3, 3, size=(5, V)).astype(np.float32)
    logits[0, 36] = 9  # the maximum in the last chunk
    logits[1, [3, 4, 11]] = 9  # equal maxima across a chunk boundary: the first, 3
    logits[2, [6, 30]] = [8, 7]  # the penalty moves the maximum to another chunk
    logits[3, :] = -0.0
    logits[3, 20] = 0.0  # -0.0 ties +0.0: the first, 0
    logits[4, :] = -2.5  # the penalty (1 / 40) on every token of a window spanning chunks
    histories = [[36, 36, 1], [3, 35], [6, 6, 6, 29], [20], list(range(5, 35))]
    opts = [_opts(temperature=0.0, repeat_penalty=p, repeat_last_n=n) for p, n in
            ((1.5, 64), (1.0, 0), (4.0, 3), (2.0, 64), (1 / 40, 64))]
    pool = SamplerSlots(5, 4)
    slots = [pool.assign(o, h, 100) for o, h in zip(opts, histories)]
    want = [Sampler(o).sample(logits[r], histories[r]) for r, o in enumerate(opts)]
    assert want[:4] == [36, 3, 30, 0]
    want_logits = [Sampler(o)._penalized(logits[r], histories[r]) if o.repeat_last_n else logits[r]
                   for r, o in enumerate(opts)]
    d_logits = cuda.to_device(logits)
    tokens, flags = sample(d_logits, slots, pool, threads=4, chunk=4)
    assert tokens.tolist() == want and not flags.any()
    assert np.array_equal(d_logits.copy_to_host().view(np.uint32), np.array(want_logits).view(np.uint32))


# ties of the top-k boundary split over chunks of 4 (boundaries at 4, 8, 12, ...), the best last
_SPLIT = np.array([1, 3, 2, 3, 3, 0, 2, 3, 2, 1, 2, 3, -1, 2, 0, 2, 3, 1, 2, 0, 2, 5], np.float32)


@pytest.mark.parametrize("k, threads", [(1, 4), (3, 4), (9, 4), pytest.param(6, 1024, marks=_GPU_ONLY)])
def test_chunked_top_k_is_the_cpus_first_k_with_ties_across_chunks(k, threads):
    o = _opts(top_k=k, temperature=1e300)  # uniform over the candidates: the draws show the set
    first_k = sorted(range(len(_SPLIT)), key=lambda i: (-_SPLIT[i], i))[:k]
    got = set(_draws(_SPLIT, o, 6 * k + 10, threads=threads, chunk=4))
    assert got == set(first_k), (k, got, first_k)


_CHUNKED = {  # over chunks of 16 (48 logits: 3 chunks), each giving min(k, 16) candidates
    "top_k_top_p": _opts(top_k=3, top_p=0.9, temperature=2.0),
    "top_k_min_p": _opts(top_k=7, min_p=0.1, temperature=0.7),  # (exactly: the same-tokens test)
}
_CHUNKED_SIM = ["top_k_top_p"]  # the simulator runs one: each costs ~10 s there


@pytest.mark.parametrize("threads", [4, pytest.param(1024, marks=_GPU_ONLY)])
@pytest.mark.parametrize("case", [c if c in _CHUNKED_SIM else pytest.param(c, marks=_GPU_ONLY) for c in _CHUNKED])
def test_chunked_draws_are_distributed_as_the_cpus(case, threads):
    o = _CHUNKED[case]
    expected = _expected(_LOGITS, o)
    assert len(expected) >= 2
    _chi2_ok(_draws(_LOGITS, o, 120, threads=threads, chunk=16), expected)


def test_chunked_and_one_block_kernels_draw_the_same_tokens():
    """The same candidates in the same order, the same sums in the same order and the same seeded
    uniform: bit for bit the same tokens, on the top-k path and the others."""
    rng = np.random.default_rng(6)
    logits = rng.integers(-6, 6, size=(6, 45)).astype(np.float32) * np.float32(0.5)
    opts = [_opts(top_k=4), _opts(top_k=9, top_p=0.8, temperature=0.6), _opts(top_k=2, min_p=0.3),
            SamplingOptions(), _opts(top_k=0, top_p=0.7), _opts(temperature=0.0, repeat_penalty=1.3)]
    runs = []
    for chunk, single in ((4, False), (8, False), (2048, True)):
        pool = SamplerSlots(6, 4)
        slots = [pool.assign(SamplingOptions(**{**_fields(o), "seed": 10 + r}), [1, 2, 3], 64)
                 for r, o in enumerate(opts)]
        got = []
        for _ in range(3):
            tokens, flags = sample(logits, slots, pool, threads=4, chunk=chunk, single=single)
            assert not flags.any()
            got.append(tokens.tolist())
        runs.append(got)
    assert runs[0] == runs[1] == runs[2]


def test_too_many_candidates_fall_back_to_the_one_block_path(monkeypatch):
    from daemon.kernels.cuda import sample as sample_mod

    monkeypatch.setattr(sample_mod, "CAND_MAX", 8)  # 6 chunks x min(3, 4) = 18 candidates do not fit
    o = _opts(top_k=3, temperature=1e300)
    first_k = sorted(range(len(_SPLIT)), key=lambda i: (-_SPLIT[i], i))[:3]
    assert set(_draws(_SPLIT, o, 40, chunk=4)) == set(first_k)


# ---- grammar masks (daemon.grammar's layout: bit t % 32 of word t // 32) ------------------------

def _pack(ids, V):
    words = np.zeros(-(-V // 32), np.uint32)
    for t in ids:
        words[t // 32] |= np.uint32(1) << np.uint32(t % 32)
    return words.view(np.int32)


def test_a_grammar_mask_limits_the_draw_and_leaves_other_rows_alone():
    rng = np.random.default_rng(3)
    V = 150
    logits = rng.normal(size=(4, V)).astype(np.float32) * 3
    allowed = [[3, 77, 140], None, rng.choice(V, 20, replace=False).tolist(), [5]]
    options = [_opts(temperature=0.0, repeat_penalty=1.3, repeat_last_n=8), _opts(temperature=0.0),
               _opts(temperature=1.0, seed=7), _opts(temperature=0.0)]
    history = rng.integers(0, V, size=12).tolist() + [3, 77]
    pool = SamplerSlots(4, 16)
    slots = [pool.assign(o, history, 200) for o in options]
    for slot, ids in zip(slots, allowed):
        pool.set_mask(slot, None if ids is None else _pack(ids, V))
    tokens, flags = sample(logits, slots, pool, threads=32)
    assert not flags.any()
    for r in (0, 1, 3):  # greedy: the CPU sampler's token under the same mask (it masks after the penalty)
        mask = None if allowed[r] is None else _pack(allowed[r], V)
        assert tokens[r] == Sampler(options[r]).sample(logits[r], history, mask)
    assert tokens[0] in allowed[0] and tokens[3] == 5 and tokens[2] in allowed[2]
    draws = _masked_draws(logits[2], allowed[2], V, 64)
    assert set(draws) <= set(allowed[2]) and len(set(draws)) > 3
    pool.release(slots[3])  # a slot given back loses its mask
    again = pool.assign(options[3], [], 200)
    assert again == slots[3]
    tokens, _ = sample(logits[3:4], [again], pool, threads=32)
    assert tokens[0] == int(np.argmax(logits[3]))


def _masked_draws(logits, ids, V, n):
    pool = SamplerSlots(n, 4)
    slots = [pool.assign(_opts(temperature=1.0, seed=100 + s), [], 64) for s in range(n)]
    for slot in slots:
        pool.set_mask(slot, _pack(ids, V))
    tokens, flags = sample(np.tile(logits, (n, 1)), slots, pool, threads=32)
    assert not flags.any()
    return tokens.tolist()


_MASK_CASES = {  # (options, sort_max, chunk, CAND_MAX): top-k above and below the allowed count, each path
    "chunked_k_above_allowed": (_opts(top_k=9, temperature=2.0), 1024, 16, 16384),
    "chunked_k_below_allowed": (_opts(top_k=3, top_p=0.95, temperature=2.0), 1024, 16, 16384),
    "sorted_k_above_allowed": (_opts(top_k=12, min_p=0.05, temperature=1.5), 1024, 16, 8),  # no room: one block
    "radix_k_above_allowed": (_opts(top_k=9, top_p=0.9, temperature=2.0), 2, 2048, 16384),
}
_MASK_SIM = ["chunked_k_above_allowed", "radix_k_above_allowed"]


@pytest.mark.parametrize("case", [c if c in _MASK_SIM else pytest.param(c, marks=_GPU_ONLY) for c in _MASK_CASES])
def test_masked_draws_with_top_k_are_distributed_as_the_cpus(case, monkeypatch):
    """A top-k larger than the mask allows stops at the allowed tokens (the masked ties weigh 0):
    the draws are the CPU's distribution over the masked row, on the chunked, sorted and radix paths."""
    from daemon.kernels.cuda import sample as sample_mod

    o, sort_max, chunk, cand_max = _MASK_CASES[case]
    monkeypatch.setattr(sample_mod, "CAND_MAX", cand_max)
    V = _LOGITS.shape[0]
    ids = [1, 4, 6, 11, 17, 30, 41][:5 if o.top_k > 5 else 7]
    masked = np.full(V, np.float32(-1e30))  # daemon.grammar.MASKED
    masked[ids] = _LOGITS[ids]
    expected = _expected(masked, o)
    assert len(expected) >= 2 and set(expected) <= set(ids)
    n = 120
    pool = SamplerSlots(n, 4)
    slots = [pool.assign(SamplingOptions(**{**_fields(o), "seed": 500 + s}), [], 64) for s in range(n)]
    for slot in slots:
        pool.set_mask(slot, _pack(ids, V))
    tokens, flags = sample(np.tile(_LOGITS, (n, 1)), slots, pool, threads=4, sort_max=sort_max, chunk=chunk)
    assert not flags.any()
    _chi2_ok(tokens.tolist(), expected)
