"""The quantized row intrinsics on their own: the portable vector IR (no AVX2) and the AVX512-VNNI
token pairs must give the AVX2 path's results bit for bit. Kernels compiled here are not cached
(numba.njit without cache), so the CPU-feature switches take effect."""

import numba
import numpy as np
import pytest

from daemon.kernels import matmul as M
from daemon.kernels import quants as Q
from daemon.kernels import simd_ir
from daemon.kernels.matmul_quant import block32_rows, kquant_rows

from .test_matmul import K, N, activations, weights


def _rows_kernel(kind: int):
    """A kernel computing 5 tokens (four, then one) against every row of expert 0 of a stack
    [1, N, row_bytes] of one type."""
    if kind in Q.KQUANT_TYPES:
        @numba.njit
        def kquant(stack, xq, xd, xs, xbs, out):
            for n in range(stack.shape[1]):
                r = kquant_rows(kind, 4, 0, stack, 0, n, xq, 0, xd, xbs)
                for i in range(4):
                    out[i, n] = r[i]
                out[4, n] = kquant_rows(kind, 1, 0, stack, 0, n, xq, 4, xd, xbs)[0]
        return kquant

    @numba.njit
    def block32(stack, xq, xd, xs, xbs, out):
        for n in range(stack.shape[1]):
            r = block32_rows(kind, 4, stack, 0, n, xq, 0, xd, xs)
            for i in range(4):
                out[i, n] = r[i]
            out[4, n] = block32_rows(kind, 1, stack, 0, n, xq, 4, xd, xs)[0]
    return block32


def test_portable_simd_paths_match(monkeypatch):
    """Without AVX2 the SIMD kernels use portable vector IR only (MXFP4 lookup computed, integer
    lanes by multiply and pairwise adds instead of vpmaddwd): same results, bit for bit."""
    rng = np.random.default_rng(13)
    x = activations(5, rng)
    cases = [(Q.MXFP4, weights(Q.MXFP4, rng)), (Q.Q5_1, weights(Q.Q5_1, rng)),
             (Q.Q4_K, weights(Q.Q4_K, rng)), (Q.Q6_K, weights(Q.Q6_K, rng))]
    ref = {qt: M.linear(x, raw, qt, K) for qt, raw in cases}
    monkeypatch.setattr(simd_ir, "has_avx2", lambda context: False)
    for qt, raw in cases:
        xp = M.prepare(x, qt)
        out = np.empty((5, N), np.float32)
        xs = xp.s if xp.s is not None else xp.d
        xbs = xp.bsums if xp.bsums is not None else np.zeros((5, K // 16), np.int32)
        _rows_kernel(qt)(Q._readonly(raw)[None], xp.qs, xp.d, xs, xbs, out)  # compiled now: portable IR
        assert np.array_equal(out, ref[qt]), Q.type_name(qt)


def _cpu_has(*features) -> bool:
    import llvmlite.binding as llvm

    host = llvm.get_host_cpu_features()
    return all(host.get(f, False) for f in features)


@pytest.mark.skipif(not _cpu_has("avx512f", "avx512bw", "avx512vnni"), reason="needs AVX512-VNNI")
def test_avx512_token_pairs_match_the_avx2_path(monkeypatch):
    """With AVX512-VNNI the four-token block kernels run two tokens per 512-bit vector; the
    results must be bit-identical to the 256-bit (AVX2) code, for every block type and for
    weights with negative, zero and extreme codes."""
    rng = np.random.default_rng(14)
    x = activations(9, rng)
    x[3] = 0.0  # an all-zero activation row
    cases = [(qt, weights(qt, rng)) for qt in (Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.MXFP4)]
    raw8 = weights(Q.Q8_0, rng)
    q8 = raw8.reshape(N, -1, 34)
    q8[:, :, 2:] = rng.choice(np.array([-128, -127, -1, 0, 1, 127], np.int8), size=q8[:, :, 2:].shape).view(np.uint8)
    cases.append((Q.Q8_0, raw8))

    def run(kind, raw):
        @numba.njit  # compiled now, with whichever path the flags select
        def tiles(stack, xq, xd, xs, out):
            for n in range(stack.shape[1]):
                for t in range(0, 8, 4):
                    r = block32_rows(kind, 4, stack, 0, n, xq, t, xd, xs)
                    for i in range(4):
                        out[t + i, n] = r[i]

        xp = M.prepare(x, kind)
        out = np.empty((8, N), np.float32)
        tiles(Q._readonly(raw)[None], xp.qs, xp.d, xp.s if xp.s is not None else xp.d, out)
        return out

    pairs = [run(qt, raw) for qt, raw in cases]
    monkeypatch.setattr(simd_ir, "has_avx512_vnni", lambda context: False)
    for (qt, raw), got in zip(cases, pairs):
        want = run(qt, raw)
        assert np.array_equal(got, want), Q.type_name(qt)
        # and both are what one-token calls give
        assert np.array_equal(got, np.concatenate([M.linear(x[i:i + 1], raw, qt, K) for i in range(8)]))
