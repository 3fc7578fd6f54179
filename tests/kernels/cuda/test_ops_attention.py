"""Device attention over the f16 KV cache (append, decode rows, prefill rows; GQA, sliding window,
sinks) against float64 numpy on the f16 values the cache holds."""

import numpy as np
import pytest
from numba import cuda

from daemon.errors import UnsupportedError
from daemon.kernels.cuda.attention import CHUNK, KV_BLOCK, AttentionWork, attention, new_kv_cache
from tests.kernels.cuda.kv_cells import blocks, filled_cache

# three chunks (whole blocks of cells); Dv != Dh; two 16-byte key loads a cell
S, HKV, G, DH, DV, C = 3, 2, 2, 16, 6, 2 * CHUNK + 2 * KV_BLOCK
H = HKV * G


def _ref(q, kc, vc, slots, positions, scale, window, sinks):
    """float64 attention of each row over cells lo..p of its slot. kc: [C, S, Hkv, Dh] values."""
    R = q.shape[0]
    out = np.zeros((R, H, DV))
    for r in range(R):
        p, s = positions[r], slots[r]
        lo = max(0, p - window + 1) if window > 0 else 0
        for h in range(H):
            k = kc[lo:p + 1, s, h // G].astype(np.float64)
            v = vc[lo:p + 1, s, h // G].astype(np.float64)
            z = k @ q[r, h].astype(np.float64) * scale
            m = z.max() if sinks is None else max(z.max(), sinks[h])
            e = np.exp(z - m)
            den = e.sum() + (0.0 if sinks is None else np.exp(sinks[h] - m))
            out[r, h] = e @ v / den
    return out


def _setup(rng, slots, positions):
    return filled_cache(rng, (C, S, HKV, DH, DV), slots, positions)


def test_kv_append_writes_only_its_cells():
    rng = np.random.default_rng(0)
    slots, positions = [2, 0, 2], [0, CHUNK + 3, 7]
    kc, vc, dk, dv, _, _ = _setup(rng, slots, positions)
    assert np.array_equal(dk.copy_to_host(), blocks(kc)) and np.array_equal(dv.copy_to_host(), blocks(vc))


# one chunk / three chunks, windows inside one chunk and across a chunk boundary, with and without sinks
DECODE = [
    dict(window=0, sinks=False),
    dict(window=CHUNK + 5, sinks=True),
    dict(window=3, sinks=True),
]


@pytest.mark.parametrize("case", DECODE, ids=[f"w{c['window']}-{'sinks' if c['sinks'] else 'nosinks'}" for c in DECODE])
def test_attention_decode_rows(case):
    rng = np.random.default_rng(case["window"] + case["sinks"])
    slots, positions = [2, 0, 1], [5, 2 * CHUNK + 3, CHUNK + 1]  # each sequence its own length
    kc, vc, dk, dv, ds, dp = _setup(rng, slots, positions)
    q = rng.standard_normal((3, H, DH)).astype(np.float32)
    sinks = rng.standard_normal(H).astype(np.float32) if case["sinks"] else None
    scale = 1 / np.sqrt(DH)
    out = cuda.to_device(np.full((3, H, DV), np.nan, np.float32))
    work = AttentionWork(4, H, C, DV)
    attention(cuda.to_device(q), dk, dv, ds, dp, scale, case["window"], None if sinks is None else cuda.to_device(sinks),
              out, work, max(positions) + 1)
    got = out.copy_to_host()
    attention(cuda.to_device(q), dk, dv, ds, dp, scale, case["window"], None if sinks is None else cuda.to_device(sinks),
              out, work, max(positions) + 1)
    assert np.array_equal(out.copy_to_host(), got)  # the same bits on a second run (no atomics)
    ref = _ref(q, kc, vc, slots, positions, scale, case["window"], sinks)
    # float32 dot products of 16 terms, float32 exps (<= 2 ulp) and sums over <= 260 cells: relative
    # errors ~1e-6; outputs are averages of unit-scale values, so 2e-5 absolute is tight.
    np.testing.assert_allclose(got, ref, rtol=0, atol=2e-5)


@pytest.mark.parametrize("tiled", [False, True], ids=["rows", "tiles"])
def test_attention_prefill_rows_are_causal_and_batch_invariant(tiled):
    rng = np.random.default_rng(9)
    T = 3
    positions = list(range(CHUNK - 2, CHUNK - 2 + T))  # a prompt continuing a cached prefix, across a chunk boundary
    slots = [1] * T
    kc, vc, dk, dv, ds, dp = _setup(rng, slots, positions)
    q = rng.standard_normal((T, H, DH)).astype(np.float32)
    sinks = rng.standard_normal(H).astype(np.float32)
    scale = 0.3
    work = AttentionWork(T, H, C, DV)
    out = cuda.to_device(np.full((T, H, DV), np.nan, np.float32))
    # tiles of 2 rows: one full tile and one with a padding row
    attention(cuda.to_device(q), dk, dv, ds, dp, scale, 0, cuda.to_device(sinks), out, work, C, one_slot=tiled,
              tile_rows=2)
    got = out.copy_to_host()
    np.testing.assert_allclose(got, _ref(q, kc, vc, slots, positions, scale, 0, sinks), rtol=0, atol=2e-5)
    # row 1 alone, in a one-row call with a smaller grid: the same bits (a row's chunks and their
    # arithmetic do not depend on the other rows or on the tiling)
    alone = cuda.to_device(np.zeros((1, H, DV), np.float32))
    attention(cuda.to_device(q[1:2]), dk, dv, cuda.to_device(np.array([1], np.int32)),
              cuda.to_device(np.array(positions[1:2], np.int32)), scale, 0, cuda.to_device(sinks), alone, work,
              positions[1] + 1)
    assert np.array_equal(alone.copy_to_host()[0], got[1])


@pytest.mark.parametrize("dh,dv", [(16, 32), (64, 64), (128, 128)])
def test_one_row_calls_give_the_tiled_bits_at_real_value_sizes(dh, dv):
    """A one-row tile of few heads loads its values with its keys when its group of cells is
    small (Dv 32, 64), a tile of rows in rounds after the softmax (and both at Dv 128): the same
    sums in the same order, so the same bits."""
    if dv > 2 * CHUNK:
        pytest.skip(f"Dv {dv} needs CHUNK >= {dv // 2} (the simulator's is {CHUNK})")
    rng = np.random.default_rng(dv)
    T, hkv, g = 2, 1, 2
    positions = [CHUNK + 3, CHUNK + 4]  # two chunks, the second partly visible
    cells = 2 * CHUNK
    kc, vc, dk, dvc, ds, dp = filled_cache(rng, (cells, 1, hkv, dh, dv), [0] * T, positions)
    q = rng.standard_normal((T, hkv * g, dh)).astype(np.float32)
    work = AttentionWork(T, hkv * g, cells, dv)
    tiled = cuda.to_device(np.full((T, hkv * g, dv), np.nan, np.float32))
    attention(cuda.to_device(q), dk, dvc, ds, dp, 0.25, 0, None, tiled, work, cells, one_slot=True, tile_rows=2)
    rows = cuda.to_device(np.full((T, hkv * g, dv), np.nan, np.float32))
    attention(cuda.to_device(q), dk, dvc, ds, dp, 0.25, 0, None, rows, work, cells)
    assert np.array_equal(rows.copy_to_host(), tiled.copy_to_host())
    ref = np.zeros((T, hkv * g, dv))
    for r, p in enumerate(positions):
        for h in range(hkv * g):
            z = kc[:p + 1, 0, h // g].astype(np.float64) @ q[r, h].astype(np.float64) * 0.25
            e = np.exp(z - z.max())
            ref[r, h] = e @ vc[:p + 1, 0, h // g].astype(np.float64) / e.sum()
    np.testing.assert_allclose(rows.copy_to_host(), ref, rtol=0, atol=2e-5)


def test_attention_checks_shapes_and_limits():
    k, v = new_kv_cache(1, 1, 16, 8, 8)
    ones = cuda.to_device(np.zeros(1, np.int32))
    work = AttentionWork(1, 1, 16, 8)
    with pytest.raises(ValueError):  # more cells than the work area holds
        attention(cuda.device_array((1, 1, 8), np.float32), k, v, ones, ones, 1.0, 0, None,
                  cuda.device_array((1, 1, 8), np.float32), work, 10 * CHUNK)
    k, v = new_kv_cache(1, 1, 16, 8, 8)
    with pytest.raises(UnsupportedError):  # 64 query heads per KV head
        attention(cuda.device_array((1, 64, 8), np.float32), k, v, ones, ones, 1.0, 0, None,
                  cuda.device_array((1, 64, 8), np.float32), AttentionWork(1, 64, 16, 8), 1)


@pytest.mark.parametrize("tiled", [False, True], ids=["rows", "tiles"])
def test_heads_per_block_do_not_change_the_bits(tiled, monkeypatch):
    """A block takes one query head of a KV head (small grids: decode) or all G of them: each
    (row, head)'s sums run in the same order either way."""
    import daemon.kernels.cuda.attention as attn_mod

    rng = np.random.default_rng(4)
    slots, positions = ([1, 1], [CHUNK + 1, CHUNK + 2]) if tiled else ([2, 0], [CHUNK + 9, 4])
    kc, vc, dk, dv, ds, dp = _setup(rng, slots, positions)
    q = cuda.to_device(rng.standard_normal((2, H, DH)).astype(np.float32))
    sinks = cuda.to_device(rng.standard_normal(H).astype(np.float32))
    work = AttentionWork(2, H, C, DV)
    outs = []
    for few in (10**6, 0):  # one head per block, then all G
        monkeypatch.setattr(attn_mod, "_FEW_BLOCKS", few)
        out = cuda.to_device(np.full((2, H, DV), np.nan, np.float32))
        attention(q, dk, dv, ds, dp, 0.5, 0, sinks, out, work, max(positions) + 1, one_slot=tiled)
        outs.append(out.copy_to_host())
    assert np.array_equal(outs[0], outs[1])
    np.testing.assert_allclose(outs[0], _ref(q.copy_to_host(), kc, vc, slots, positions, 0.5, 0, sinks.copy_to_host()),
                               rtol=0, atol=2e-5)


FUSED = [  # decode rows (sinks, a window across a chunk edge), then a prefill's tiles (one with a padding row)
    dict(slots=[2, 0], positions=[5, CHUNK + 3], window=CHUNK - 2, one_slot=False),
    dict(slots=[1, 1, 1], positions=[CHUNK - 2, CHUNK - 1, CHUNK], window=0, one_slot=True),
]


@pytest.mark.parametrize("case", FUSED, ids=["decode", "prefill-tiles"])
def test_fused_combine_gives_the_two_launch_bits(case):
    """The chunk kernel's last block combining the chunks is the combine kernel's arithmetic: the
    same bits (and its ticket counters are back at zero after the launch)."""
    rng = np.random.default_rng(21)
    slots, positions = case["slots"], case["positions"]
    kc, vc, dk, dv, ds, dp = _setup(rng, slots, positions)
    R = len(slots)
    q = cuda.to_device(rng.standard_normal((R, H, DH)).astype(np.float32))
    sinks = cuda.to_device(rng.standard_normal(H).astype(np.float32))
    work = AttentionWork(R, H, C, DV)
    outs = []
    for fused in (False, True):
        out = cuda.to_device(np.full((R, H, DV), np.nan, np.float32))
        attention(q, dk, dv, ds, dp, 0.4, case["window"], sinks, out, work, max(positions) + 1,
                  one_slot=case["one_slot"], tile_rows=2, fused=fused)
        outs.append(out.copy_to_host())
        assert not work.done.copy_to_host().any()
    assert not np.isnan(outs[0]).any() and np.array_equal(outs[1], outs[0])
    np.testing.assert_allclose(outs[0], _ref(q.copy_to_host(), kc, vc, slots, positions, 0.4, case["window"],
                                             sinks.copy_to_host()), rtol=0, atol=2e-5)


@pytest.mark.parametrize("case", FUSED, ids=["decode", "prefill-tiles"])
def test_a_combine_writing_q8_1_gives_quantize_q8_1s_bits(case):
    """The fused combine's q8_1 blocks (the o projection's input) are quantize_q8_1 of its output,
    bit for bit, and the output is the plain launch's; value heads of 64 make two blocks a head."""
    from daemon.kernels.cuda.quantize import quantize_q8_1

    dv = 64
    rng = np.random.default_rng(22)
    slots, positions = case["slots"], case["positions"]
    _, _, dk, dvc, ds, dp = filled_cache(rng, (C, S, HKV, DH, dv), slots, positions)
    R = len(slots)
    q = cuda.to_device(rng.standard_normal((R, H, DH)).astype(np.float32))
    sinks = cuda.to_device(rng.standard_normal(H).astype(np.float32))
    work = AttentionWork(R, H, C, dv)
    outs = []
    for q8 in (None, (cuda.device_array((R, H * dv), np.int8), cuda.device_array((R, H * dv // 32, 2), np.float32))):
        out = cuda.to_device(np.full((R, H, dv), np.nan, np.float32))
        attention(q, dk, dvc, ds, dp, 0.4, case["window"], sinks, out, work, max(positions) + 1,
                  one_slot=case["one_slot"], tile_rows=2, q8=q8)
        outs.append(out.copy_to_host())
    assert not np.isnan(outs[0]).any() and np.array_equal(outs[1].view(np.uint32), outs[0].view(np.uint32))
    qs, dsc = q8
    ref_qs, ref_ds = quantize_q8_1(cuda.to_device(outs[0].reshape(R, H * dv)))
    assert np.array_equal(qs.copy_to_host(), ref_qs.copy_to_host())
    assert np.array_equal(dsc.copy_to_host().view(np.uint32), ref_ds.copy_to_host().view(np.uint32))
    assert np.abs(qs.copy_to_host()).max() == 127  # not all zero: a block's largest value is 127
    with pytest.raises(UnsupportedError):  # the two-launch form has no combine to write them
        attention(q, dk, dvc, ds, dp, 0.4, 0, sinks, out, work, max(positions) + 1, fused=False, q8=q8)
