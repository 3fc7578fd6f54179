"""Prefill attention on the f16 tensor cores (flash.py) against float64 numpy, and its bits
across tilings, sequences and runs."""

import numpy as np
import pytest
from numba import cuda

from daemon.errors import UnsupportedError
from daemon.kernels.cuda.attention import KV_BLOCK
from daemon.kernels.cuda.flash import NK, attention_flash, rows_per_tile, suits, supports, tiles_of
from tests.kernels.cuda.kv_cells import filled_cache

# G = 3: a tile's pairs do not fill the mma rows (a padding pair); cells: a step and part of a second.
# Small, because the simulator runs every thread in Python (each mma is a barrier of its warp).
S, HKV, G, DH, DV = 2, 1, 3, 16, 8
H = HKV * G
C = NK + 2 * KV_BLOCK


def _setup(rng, slots, positions):
    return filled_cache(rng, (C, S, HKV, DH, DV), slots, positions)


def _ref(q, kc, vc, slots, positions, scale, window, sinks):
    """float64 attention over cells lo..p of each row's slot, of the f16-rounded scaled queries
    the kernel multiplies."""
    qh = (q * np.float32(scale)).astype(np.float16).astype(np.float64)
    out = np.zeros((q.shape[0], H, DV))
    for r, (p, s) in enumerate(zip(positions, slots)):
        lo = max(0, p - window + 1) if window > 0 else 0
        for h in range(H):
            z = kc[lo:p + 1, s, h // G].astype(np.float64) @ qh[r, h]
            m = z.max() if sinks is None else max(z.max(), sinks[h])
            e = np.exp(z - m)
            den = e.sum() + (0.0 if sinks is None else np.exp(sinks[h] - m))
            out[r, h] = e @ vc[lo:p + 1, s, h // G].astype(np.float64) / den
    return out


def _run(q, dk, dv, ds, dp, tiles, scale, window, sinks, warps=None, fill=np.nan):
    out = cuda.to_device(np.full((q.shape[0], H, DV), fill, np.float32))
    kw = {} if warps is None else {"warps": warps}
    attention_flash(cuda.to_device(q), dk, dv, ds, dp, cuda.to_device(tiles), scale, window,
                    None if sinks is None else cuda.to_device(sinks), out, **kw)
    return out.copy_to_host()


# two sequences of one step: a prompt continuing a cached prefix across step boundaries, a fresh one
SLOTS = [1] * 6 + [0] * 4
POSITIONS = list(range(NK - 3, NK + 3)) + list(range(4))
OFFSETS = np.array([0, 6, 10])
CASES = [dict(window=0, sinks=False), dict(window=5, sinks=True), dict(window=NK + 1, sinks=False)]


@pytest.mark.parametrize("case", CASES, ids=[f"w{c['window']}-{'sinks' if c['sinks'] else 'nosinks'}" for c in CASES])
def test_flash_attention_matches_float64(case):
    rng = np.random.default_rng(case["window"])
    kc, vc, dk, dv, ds, dp = _setup(rng, SLOTS, POSITIONS)
    q = rng.standard_normal((len(SLOTS), H, DH)).astype(np.float32)
    sinks = rng.standard_normal(H).astype(np.float32) if case["sinks"] else None
    tiles = tiles_of(OFFSETS, rows_per_tile(H, HKV), [True, True])
    got = _run(q, dk, dv, ds, dp, tiles, 0.2, case["window"], sinks)
    # the weights P are rounded to f16 (2^-11 relative) before P V: outputs of unit-scale values
    # are off by up to ~1e-3; a wrong fragment layout or mask is off by O(1)
    np.testing.assert_allclose(got, _ref(q, kc, vc, SLOTS, POSITIONS, 0.2, case["window"], sinks), rtol=0, atol=2e-3)
    assert np.array_equal(_run(q, dk, dv, ds, dp, tiles, 0.2, case["window"], sinks), got)  # no atomics


@pytest.mark.parametrize("warps", [1, 2])
def test_a_rows_bits_do_not_depend_on_its_tile(warps):
    rng = np.random.default_rng(3)
    _, _, dk, dv, ds, dp = _setup(rng, SLOTS, POSITIONS)
    q = rng.standard_normal((len(SLOTS), H, DH)).astype(np.float32)
    sinks = rng.standard_normal(H).astype(np.float32)
    whole = _run(q, dk, dv, ds, dp, tiles_of(OFFSETS, rows_per_tile(H, HKV, warps), [True, True]), 0.3, 5, sinks,
                 warps)
    # rows alone in one-row tiles (the first and last of a tile, a row past a step boundary), and
    # the first sequence in tiles of two rows
    rows = [0, 3, 4, 9]
    alone = _run(q, dk, dv, ds, dp, np.array([(r, 1) for r in rows], np.int32), 0.3, 5, sinks, warps)
    pairs = _run(q, dk, dv, ds, dp, tiles_of(OFFSETS, 2, [True, False]), 0.3, 5, sinks, warps)
    assert np.array_equal(alone[rows], whole[rows])
    assert np.array_equal(pairs[:6], whole[:6])
    assert np.isnan(pairs[6:]).all()  # rows in no tile are left as they were


def test_tiles_of_cuts_the_sequences_it_takes():
    offsets = np.array([0, 3, 4, 12])
    assert tiles_of(offsets, 5, [True, False, True]).tolist() == [[0, 3], [4, 5], [9, 3]]
    assert tiles_of(offsets, 5, [False] * 3).shape == (0, 2)


def test_prompts_take_the_kernel_and_a_few_rows_after_a_long_prefix_do_not():
    assert suits(17, 17) and suits(512, 512) and suits(100, 400)
    assert not suits(16, 16)  # a GEMV's rows: not a prefill
    assert not suits(100, 30_000)  # a chat turn after a long history: the split-K kernel


def test_flash_attention_checks_heads_and_shapes():
    assert supports(64, 8, 64, 64, warps=4) and supports(32, 4, 128, 128, warps=4)
    assert not supports(16, 2, 256, 256, warps=4)  # qwen3-next's heads: attention.py's kernel
    assert not supports(8, 8, 72, 72, warps=4)  # not whole k16 steps
    rng = np.random.default_rng(0)
    _, _, dk, dv, ds, dp = _setup(rng, SLOTS, POSITIONS)
    tiles = cuda.to_device(np.zeros((1, 2), np.int32))
    R = len(SLOTS)
    q = cuda.to_device(np.zeros((R, H, DH), np.float32))
    with pytest.raises(UnsupportedError):  # more query heads a KV head than the warps' mma rows
        attention_flash(q, dk, dv, ds, dp, tiles, 1.0, 0, None, cuda.to_device(np.zeros((R, H, DV), np.float32)),
                        warps=0)
    with pytest.raises(ValueError):
        attention_flash(q, dk, dv, ds, dp, tiles, 1.0, 0, None, cuda.to_device(np.zeros((R, H, DH), np.float32)))
