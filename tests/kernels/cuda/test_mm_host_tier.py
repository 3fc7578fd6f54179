"""The expert kernels' host tier (mmvq.py's module doc): a miss read in place from pinned host
memory mapped into the device (zero-copy) gives the bits of the same expert read from a VRAM slot,
in the GEMV (mmvq), the fused gate/up/GLU, and the tiled prefill kernel (mmq). Under the
simulator a mapped array is host memory the kernels index directly; on a GPU, reads go over PCIe.

Layout of every case: E = 5 experts, all of them in the resident stack (slot e = expert e, the
reference run); split: VRAM slots hold experts 3 and 0, the host tier holds every expert, expert
4 is nowhere (its outputs are left as they were).
"""

from __future__ import annotations

import numpy as np
import pytest
from numba import cuda

from daemon.kernels import quants as Q
from daemon.kernels.cuda import grouping, mmq, mmvq
from daemon.kernels.cuda.layout import repack
from tests.kernels.cuda import refs
from tests.kernels.cuda.test_mm_mmvq import _act, _k

E = 5
RESIDENT = np.arange(E, dtype=np.int32)
SPLIT = np.array([1, -2 - 1, -2 - 2, 0, -1], np.int32)  # 0, 3: VRAM slots 1, 0; 1, 2: host rows
VRAM_EXPERTS = [3, 0]  # slot s holds expert VRAM_EXPERTS[s]
TYPES = [Q.Q8_0, Q.Q4_K, Q.MXFP4, Q.F16]
SENTINEL = 7.0


def _mapped(stack: np.ndarray):
    """A repacked stack in page-locked host memory mapped into the device."""
    m = cuda.mapped_array(stack.shape, np.uint8)
    m[...] = stack
    return m


def _tiers(raw, qt):
    """(resident stack, VRAM slots, host tier) of raw [E, N, rb]."""
    packed = repack(raw, qt)
    return cuda.to_device(packed), cuda.to_device(packed[VRAM_EXPERTS]), _mapped(packed)


def _out(T, A, N):
    return cuda.to_device(np.full((T, A, N), SENTINEL, np.float32))


def _check_split(ids, want, got):
    """Every pair of a held expert bit-identical to the resident run; expert 4's left alone."""
    T, A = ids.shape
    for t in range(T):
        for a in range(A):
            if ids[t, a] == 4:
                assert np.all(got[t, a] == SENTINEL)
            else:
                assert np.array_equal(got[t, a], want[t, a]), (t, a, ids[t, a])


IDS = np.array([[3, 1], [2, 4], [0, 2]], np.int32)  # [T, A]: every tier, twice for some


@pytest.mark.parametrize("per_pair", [False, True], ids=["per_token", "per_pair"])
@pytest.mark.parametrize("qt", TYPES, ids=lambda t: refs.NAMES[t])
def test_gemv_reads_misses_in_place_with_the_bits_of_a_slot(qt, per_pair):
    rng = np.random.default_rng(100 + qt)
    k = _k(qt)
    raw = refs.weights(qt, (E, 3), k, rng)  # [E, N, rb]
    T, A = IDS.shape
    x = rng.standard_normal((T * A if per_pair else T, k)).astype(np.float32)
    bias = cuda.to_device(rng.standard_normal((E, raw.shape[1])).astype(np.float32))
    act, _ = _act(qt, x)
    resident, slots, host = _tiers(raw, qt)
    ids = cuda.to_device(IDS)
    want = mmvq.mul_mat_vec_ids(resident, qt, k, act, ids, cuda.to_device(RESIDENT), bias=bias,
                                act_per_pair=per_pair).copy_to_host()
    got = mmvq.mul_mat_vec_ids(slots, qt, k, act, ids, cuda.to_device(SPLIT), bias=bias,
                               act_per_pair=per_pair, w_host=host,
                               out=_out(T, A, raw.shape[1])).copy_to_host()
    _check_split(IDS, want, got)


@pytest.mark.parametrize("qt", [Q.Q8_0, Q.MXFP4], ids=lambda t: refs.NAMES[t])
def test_fused_glu_reads_misses_in_place_with_the_bits_of_a_slot(qt):
    rng = np.random.default_rng(120 + qt)
    k = _k(qt)
    gate, up = (refs.weights(qt, (E, 4), k, rng) for _ in range(2))
    T, A = IDS.shape
    x = (rng.standard_normal((T, k)) * 4).astype(np.float32)
    act, _ = _act(qt, x)
    (g_res, g_slots, g_host), (u_res, u_slots, u_host) = _tiers(gate, qt), _tiers(up, qt)
    ids = cuda.to_device(IDS)
    for glu in ("swiglu", "swiglu_oai"):
        want = mmvq.mul_mat_vec_glu_ids(g_res, u_res, qt, k, act, ids, cuda.to_device(RESIDENT),
                                        glu).copy_to_host()
        got = mmvq.mul_mat_vec_glu_ids(g_slots, u_slots, qt, k, act, ids, cuda.to_device(SPLIT), glu,
                                       host_gate=g_host, host_up=u_host,
                                       out=_out(T, A, gate.shape[1])).copy_to_host()
        _check_split(IDS, want, got)


@pytest.mark.parametrize("qt", [Q.Q8_0, Q.Q4_K], ids=lambda t: refs.NAMES[t])
def test_tiled_prefill_reads_misses_in_place_with_the_bits_of_a_slot(qt):
    rng = np.random.default_rng(140 + qt)
    k = _k(qt)
    raw = refs.weights(qt, (E, 5), k, rng)
    ids_h = np.array([[t % E, (t * 3 + 1) % E] for t in range(20)], np.int32)  # [T, A]
    T, A = ids_h.shape
    x = rng.standard_normal((T, k)).astype(np.float32)
    act, _ = _act(qt, x)
    resident, slots, host = _tiers(raw, qt)
    ids = cuda.to_device(ids_h)
    groups = grouping.group_by_expert(ids, E)
    want = mmq.mul_mat_q_ids(resident, qt, k, act, ids, cuda.to_device(RESIDENT), groups).copy_to_host()
    got = mmq.mul_mat_q_ids(slots, qt, k, act, ids, cuda.to_device(SPLIT), groups, w_host=host,
                            out=_out(T, A, raw.shape[1])).copy_to_host()
    _check_split(ids_h, want, got)


def test_a_host_tier_must_match_the_weights():
    rng = np.random.default_rng(160)
    qt = Q.Q8_0
    k = _k(qt)
    raw = refs.weights(qt, (E, 3), k, rng)
    act, _ = _act(qt, rng.standard_normal((1, k)).astype(np.float32))
    resident, slots, host = _tiers(raw, qt)
    ids, slot_of = cuda.to_device(IDS[:1]), cuda.to_device(SPLIT)
    other_rows = _mapped(repack(refs.weights(qt, (E, 4), k, rng), qt))
    with pytest.raises(ValueError, match="host tier"):
        mmvq.mul_mat_vec_ids(slots, qt, k, act, ids, slot_of, w_host=other_rows)
    with pytest.raises(ValueError, match="host tier"):  # gate's host stack without up's
        mmvq.mul_mat_vec_glu_ids(slots, slots, qt, k, act, ids, slot_of, host_gate=host)
    with pytest.raises(ValueError):
        mmq.mul_mat_q_ids(slots, qt, k, act, ids, slot_of, grouping.group_by_expert(ids, E), w_host=other_rows)
