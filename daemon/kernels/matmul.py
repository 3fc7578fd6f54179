"""Fused dequant x activation matmuls on the CPU (numba): out[T, N] = x[T, K] @ W[N, K].T

Legend: T = tokens (rows of x), K = input features (ggml ne[0]), N = output rows of W,
B = 32-value blocks per row (K/32), S = 256-value super-blocks per row (K/256).

W is never materialized: `raw` is the uint8 [N, row_bytes] block data (an mmap view is fine; it
is only read). Rows are split over threads with `prange` (contiguous chunks of rows); a thread
takes one weight row at a time and applies it to all T tokens, four tokens per pass over the
row (each block is decoded once for the four), so weight bytes come from memory once per call
whatever T is, and the row stays in L1 between passes.

Two numerics modes:

* ``"float32"`` (reference): each row is dequantized to float32 exactly as `quants.dequantize`
  (bit-identical to gguf.quants) and dotted with x in float64; the float64 sum is rounded to
  float32 once. This equals ``(x.astype(f64) @ dequantize(W).astype(f64).T).astype(f32)`` up to
  summation order in float64.

* ``"ggml"`` (default): llama.cpp's CPU backend (ggml-cpu, x86). x is first converted to the
  weight type's vec_dot_type (ggml-cpu.c type_traits_cpu):

      F32 -> F32       plain float32 dot (float32 accumulation)
      F16 -> F16       x rounded to fp16 (round-to-nearest-even, as F16C), float32 accumulation
      BF16 -> BF16     x rounded to bf16 (GGML_FP32_TO_BF16: RNE, NaN quieted), float32 acc.
      Q4_0, Q5_0, Q8_0, MXFP4 -> Q8_0    Q4_1, Q5_1 -> Q8_1    Q4_K, Q5_K, Q6_K -> Q8_K

  Q8_0/Q8_1 follow the x86 AVX/AVX2 `quantize_row_q8_0/q8_1` (not the scalar _ref):
  amax = max|x|, d = amax/127 (stored fp16), id = 127/amax (0 if amax == 0),
  q = round-half-to-even(x*id) (_mm256_round_ps(_MM_ROUND_NEAREST)); Q8_1 also stores
  s = fp16(d * sum(q)). The _ref versions use id = 1/d and roundf (half away from zero); they
  differ only at exact ties and by an ulp in id.
  Q8_K follows quantize_row_q8_K_ref (which the x86 build also uses): max = the first element
  of largest |x|, iscale = -127/max, q = min(127, nearest_int(iscale*x)) (nearest-even),
  d = 1/iscale (float32), bsums = sums of q over groups of 16.

  The dot products then reproduce llama.cpp's x86 (AVX2 + FMA) kernels bit for bit: the
  integer parts are exact, and the float32 products, FMAs and summation ORDER are ggml's, so
  the results are identical to llama.cpp's, not merely close (the 8-bit activation rounding of
  the next layer amplifies any last-bit difference). "Lanes of 4": lane r (0..7) holds the
  exact integer sum of the block's elements 4r..4r+3 (maddubs + madd); hsum8(l) =
  ((l0+l4)+(l2+l6)) + ((l1+l5)+(l3+l7)) (hsum_float_8, tinyBLAS hsum).

      Q8_0/Q4_0/Q5_0   (ggml_vec_dot_<w>_q8_0 and tinyBLAS_Q0_AVX, the same order)
                       lanes = fma(d_w*d_x, float(lanes of 4), lanes) block after block;
                       result hsum8(lanes)
      Q4_1/Q5_1        the same, plus summs = fma(m_w, s_x, summs) block after block;
                       result hsum8(lanes) + summs
      MXFP4            even blocks in one set of lanes, odd blocks in another
                       (scale d_x * e8m0_half(e)); result hsum8(acc1 + acc2); an odd last
                       block is added as fma(d, float(block sum), result)
      Q4_K/Q5_K/Q6_K   two paths, chosen as llama.cpp does by the op's number of rows (see
                       "Path choice"):
        vec_dot (< 8 rows): per super-block lanes of 4 weighted by the sub-block scales,
            summed as integers (Q6_K: unsigned codes, lane r minus
            32*(sc_2r bsum_2r + sc_2r+1 bsum_2r+1)); acc = fma(d_x*d_w, float(lanes), acc);
            Q4_K: four min lanes m_l = fma(-d_x*dmin, min_2l q8s_2l + min_2l+1 q8s_2l+1, m_l),
            result hsum8(acc) + ((m0+m2)+(m1+m3)); Q5_K: summs = fma(-d_x*dmin,
            sum_g min_g q8s_g, summs), result hsum8(acc) + summs; Q6_K: hsum8(acc)
            (q8s_g = bsum_2g + bsum_2g+1).
        tiled (ggml-cpu/tiled, >= 8 rows): per super-block the integers s1 = sum_g scale_g
            sum_j w_j q_j and s2 = sum_g min_g q8s_g; res = fma(-dmin, s2, d_w*s1) (Q6_K:
            d_w*s1); out = fma(res, d_x, out) super-block after super-block.
      F32/F16/BF16     tinyBLAS (llamafile_sgemm) for ordinary matmuls with >= 2 rows,
                       N % 4 == 0 and K % 8 == 0: lane k % 8 = fma(w_k, x_k, lane), hsum8.
                       Otherwise ggml_vec_dot_f32/f16/bf16: four 8-lane FMA accumulators over
                       steps of 32, (a0+a2)+(a1+a3), then two hadd (F32, F16) or hsum8 (BF16);
                       the K % 32 leftovers in float32 with FMA (F32) or in double (F16/BF16).
                       (F16/BF16 products are exact in float32, so FMA = multiply + add.)

  Path choice and batch invariance: llama.cpp's own result for a token depends, for some
  types, on how many rows the op has, and this module mirrors it:
    * K-quants: tiled when the op has >= 8 rows (ggml_tiled_min_batch): all tokens of an
      ordinary matmul, or, for MoE experts (MUL_MAT_ID), the tokens routed to that expert;
      vec_dot otherwise. Since moe.py calls linear once per expert with exactly its routed
      tokens, "rows" is always the T of the call.
    * F32/F16/BF16: tinyBLAS only for ordinary matmuls (not MUL_MAT_ID, which has no sgemm
      path: pass expert=True) with T >= 2, N % 4 == 0, K % 8 == 0; vec_dot otherwise.
    * the 32-value block types use one order in all paths: batch invariant.
  So with "ggml" numerics a token's output can legitimately differ (in the last bits) between
  a call with T < 8 and one with T >= 8 (K-quants), or T = 1 and T >= 2 (float weights), just
  as in llama.cpp (e.g. prompt processing vs one-token decoding). `solo=True` picks the paths of
  a one-row call for every row: a decode batch of independent sequences then gives each one
  exactly its solo result (batch invariance; Transformer.forward_batch). Within one path a token's
  result never depends on the other tokens (the four-token kernels only share the weight
  decoding). The "float32" numerics are fully batch invariant.

  Not emulated: llama.cpp's optional CPU "extra" buffer types (repacked Q4_0x8/Q4_Kx8 with
  AMX or the aarch64 repack), AVX512/VNNI builds, other tinyBLAS variants (e.g. ARM).

The row loops are SIMD code emitted as LLVM IR by numba intrinsics: portable vector IR with
llvm.fma, plus the AVX2 vpmaddwd/vpshufb intrinsics where the CPU has AVX2, and with AVX512-VNNI
two tokens per 512-bit vector in the multi-token block kernels (same results either way; tests
check both). Each kernel is compiled per weight type on first use, and cached by numba.

Files: this module is the API (path choice, checks, the benchmark); the work is in
  matmul_types.py        the supported weight types: kernel family, vec_dot_type, block bytes
  matmul_activations.py  Prepared and prepare: the activation conversions above
  matmul_blocks.py       LLVM IR block decoders (a ggml block -> int8 vectors and scales)
  matmul_quant.py        the quantized row intrinsics and grouped kernels (32-value blocks, K-quants)
  matmul_float.py        the F32/F16/BF16 row intrinsic and kernel ("ggml" numerics)
  matmul_reference.py    the "float32" numerics kernels
  simd_ir.py             the LLVM vector IR building blocks they share

Speed: `python -m daemon.kernels.matmul [threads]` prints GB/s of weight bytes processed and
GOP/s for 2048x2048 matrices at T=1 and T=32 (and a larger, memory-bound case).

Threading: the kernels run numba parallel regions; with numba's "workqueue" threading layer
they must not be called from two Python threads at once (the "omp" and "tbb" layers allow it).
"""

from __future__ import annotations

import functools
import time

import numba
import numpy as np

from daemon.errors import UnsupportedError
from daemon.kernels import matmul_reference as reference
from daemon.kernels import quants as Q
from daemon.kernels.matmul_activations import NUMERICS, Prepared, prepare
from daemon.kernels.matmul_float import float_kernel
from daemon.kernels.matmul_quant import block32_kernel, kquant_kernel
from daemon.kernels.matmul_types import FLOAT, KQUANT, TYPES, VEC_DOT_TYPE

__all__ = ["NUMERICS", "VEC_DOT_TYPE", "Prepared", "prepare", "linear", "linear_prepared", "linear_selected",
           "linear_grouped", "tiled_kquant", "tinyblas_float", "bench"]


def _nchunks(n: int) -> int:
    return max(1, min(n, 4 * _threads()))


@functools.cache
def _threads() -> int:
    # numba.get_num_threads() costs microseconds per call; the chunk count only balances work
    # across threads (results do not depend on it), so the first value serves.
    return numba.get_num_threads()


def _weight_view(raw: np.ndarray, ggml_type: int, k: int) -> np.ndarray:
    raw = np.asarray(raw)
    if raw.dtype != np.uint8 or raw.ndim != 2:
        raise TypeError(f"raw must be a 2-D uint8 array, got {raw.dtype} {raw.shape}")
    rb = Q.row_bytes(ggml_type, k)
    if raw.shape[1] != rb:
        raise ValueError(
            f"{Q.type_name(ggml_type)} rows of {k} values are {rb} bytes, raw has {raw.shape[1]}"
        )
    if not raw.flags.c_contiguous:
        raw = np.ascontiguousarray(raw)  # only for odd strided views; slices stacked[e] are not
    if ggml_type == Q.F32:
        raw = raw.view(np.uint32)
    elif ggml_type in (Q.F16, Q.BF16):
        raw = raw.view(np.uint16)
    return Q._readonly(raw)


def tiled_kquant(rows: int) -> bool:
    """Whether llama.cpp takes its tiled K-quant kernel (ggml-cpu/tiled) for an op with this many
    activation rows: all tokens of an ordinary matmul, the tokens routed to one expert for
    MUL_MAT_ID (ggml_tiled_min_batch: rows >= 8). Elementwise for an array of row counts."""
    return rows >= 8


def tinyblas_float(rows: int, n: int, k: int, expert: bool) -> bool:
    """Whether llama.cpp takes llamafile's tinyBLAS for F32/F16/BF16 weights (AVX2): ordinary
    matmuls (MUL_MAT_ID has no sgemm path) with >= 2 rows, N % 4 == 0 and K % 8 == 0."""
    return not expert and rows >= 2 and n % 4 == 0 and k % 8 == 0


_ONE_EXPERT = np.zeros(1, np.int64)


def linear_prepared(xp: Prepared, raw: np.ndarray, ggml_type: int, k: int, expert: bool = False,
                    solo: bool = False, groups: np.ndarray | None = None) -> np.ndarray:
    """out float32 [T, N] = x @ W.T for prepared activations xp and weight raw [N, row_bytes].

    expert: the call is one expert of a MUL_MAT_ID (MoE experts: x = the tokens routed to it);
    with "ggml" numerics it selects llama.cpp's path as that op does (see the module docstring).
    solo: the rows are independent one-token steps (a decode batch): each row is computed as a
    one-row call computes it, so a token's result does not depend on its batch.
    groups: row offsets [G+1] from 0 to T of independent sequences stacked in x (a batched
    prefill): each group is computed as a separate call on its rows computes it."""
    if ggml_type not in Q.SUPPORTED_TYPES:
        raise UnsupportedError(f"unsupported quant type {Q.type_name(ggml_type)}")
    if xp.K != k:
        raise ValueError(f"activations have K={xp.K}, weight has k={k}")
    if xp.numerics == "ggml" and VEC_DOT_TYPE[ggml_type] != xp.vec_dot_type:
        raise ValueError(
            f"activations were prepared as {Q.type_name(xp.vec_dot_type)}, "
            f"{Q.type_name(ggml_type)} needs {Q.type_name(VEC_DOT_TYPE[ggml_type])}"
        )
    w = _weight_view(raw, ggml_type, k)
    N = w.shape[0]
    T = xp.T
    out = np.empty((T, N), np.float32)
    if T == 0 or N == 0:
        return out
    nc = _nchunks(N)
    qt = int(ggml_type)
    family = TYPES[qt].family
    groups = _row_groups(T, solo, groups)
    counts = [1] if solo else np.diff(groups).tolist()  # the row counts that pick llama.cpp's path
    if xp.numerics == "float32":
        if family == FLOAT:
            reference.float_weights(w, qt, xp.x, out, nc)
        else:
            reference.block_weights(w, qt, k, xp.x, out, nc)
    elif family == FLOAT:
        kernel = float_kernel(qt)
        flags = [tinyblas_float(c, N, k, expert) for c in counts]
        if len(set(flags)) == 1:
            kernel(w, flags[0], xp.x, out, nc)
        else:  # sequences taking different paths: one call each
            for g, flag in enumerate(flags):
                r0, r1 = int(groups[g]), int(groups[g + 1])
                kernel(w, flag, xp.x[r0:r1], out[r0:r1], nc)
    elif family == KQUANT:  # rows of one path in one group ("expert" 0)
        tiled = [tiled_kquant(c) for c in counts]
        if len(set(tiled)) == 1:
            groups = np.array([0, T])
        kquant_kernel(qt)(np.array(tiled[:len(groups) - 1], dtype=np.uint8), w[None],
                          np.zeros(len(groups) - 1, np.int64), groups, xp.qs, xp.d, xp.bsums, out, nc)
    else:  # the row count does not matter to these kernels
        xs = xp.s if xp.s is not None else xp.d  # read only for Q8_1
        block32_kernel(qt)(w[None], _ONE_EXPERT, np.array([0, T]), xp.qs, xp.d, xs, out, nc)
    return out


def _row_groups(T: int, solo: bool, groups) -> np.ndarray:
    """Row offsets of independent groups: [0, T] by default; checked when given."""
    if groups is None or solo:
        return np.array([0, T], dtype=np.int64)
    groups = np.ascontiguousarray(groups, dtype=np.int64)
    if groups.ndim != 1 or groups.size < 2 or groups[0] != 0 or groups[-1] != T or np.any(np.diff(groups) <= 0):
        raise ValueError(f"groups must rise strictly from 0 to {T}")
    return groups


def linear_selected(xp: Prepared, stack: np.ndarray, sel: np.ndarray, xrow: np.ndarray,
                    ggml_type: int, k: int) -> np.ndarray:
    """Expert matmuls of one decode step in one call: out [A, N] with
    out[a] = W[sel[a]] @ x[xrow[a]], for stack uint8 [E, N, row_bytes] of expert weights.

    Each row is computed exactly as a one-token expert call of linear_prepared computes it: this is
    linear_grouped with one row per group, on the activation rows gathered. Quantized weights in
    "ggml" numerics only; other cases loop over linear_prepared."""
    sel = np.ascontiguousarray(sel, dtype=np.int64)
    xrow = np.ascontiguousarray(xrow, dtype=np.int64)
    A, N = sel.shape[0], stack.shape[1]
    if A and (sel.min() < 0 or sel.max() >= stack.shape[0] or xrow.min() < 0 or xrow.max() >= xp.T):
        raise ValueError("expert or activation row index out of range")
    if xp.numerics != "ggml" or ggml_type in Q.FLOAT_TYPES or not stack.flags.c_contiguous:
        out = np.empty((A, N), np.float32)
        for a in range(A):
            one = Prepared(xp.numerics, xp.vec_dot_type, *(None if v is None else v[xrow[a]:xrow[a] + 1]
                                                           for v in (xp.x, xp.qs, xp.d, xp.s, xp.bsums)))
            out[a] = linear_prepared(one, stack[sel[a]], ggml_type, k, expert=True)[0]
        return out
    if VEC_DOT_TYPE[ggml_type] != xp.vec_dot_type or xp.K != k:
        raise ValueError("activations were prepared for another weight type or length")
    if stack.dtype != np.uint8 or stack.ndim != 3 or stack.shape[2] != Q.row_bytes(ggml_type, k):
        raise ValueError(f"stack must be uint8 [E, N, {Q.row_bytes(ggml_type, k)}], got {stack.dtype} {stack.shape}")
    out = np.empty((A, N), np.float32)
    if A == 0 or N == 0:
        return out
    _grouped(xp.rows(xrow), Q._readonly(stack), sel, np.arange(A + 1, dtype=np.int64), ggml_type, True, out)
    return out


@numba.njit(cache=True)
def _group_problem(experts, offs, n_expert, n_rows):
    """0 when offs [J+1] rises from 0 to n_rows and every experts [J] is in 0..n_expert-1;
    1: bad offs, 2: bad expert. (One call: these checks cost more than the kernel in numpy.)"""
    J = experts.shape[0]
    if offs.shape[0] != J + 1 or offs[0] != 0 or offs[J] != n_rows:
        return 1
    for j in range(J):
        if offs[j + 1] < offs[j]:
            return 1
        if experts[j] < 0 or experts[j] >= n_expert:
            return 2
    return 0


def linear_grouped(xp: Prepared, stack: np.ndarray, experts: np.ndarray, offs: np.ndarray,
                   ggml_type: int, k: int, solo: bool = False) -> np.ndarray:
    """Every expert of a layer in one call: out [P, N] with out[p] = W[experts[j]] @ x[p] for p in
    offs[j]..offs[j+1] (activations gathered by expert), for stack uint8 [E, N, row_bytes].

    Each expert's rows are computed exactly as a separate expert call of linear_prepared on those
    rows computes them (solo: as one-row calls)."""
    experts = np.ascontiguousarray(experts, dtype=np.int64)
    offs = np.ascontiguousarray(offs, dtype=np.int64)
    J, N = experts.shape[0], stack.shape[1]
    problem = _group_problem(experts, offs, stack.shape[0], xp.T)
    if problem:
        raise ValueError(("", "offs must rise from 0 to the number of activation rows, one step per expert",
                          "expert index out of range")[problem])
    if xp.numerics != "ggml" or ggml_type in Q.FLOAT_TYPES or not stack.flags.c_contiguous:
        out = np.empty((xp.T, N), np.float32)
        for j in range(J):
            r0, r1 = int(offs[j]), int(offs[j + 1])
            part = Prepared(xp.numerics, xp.vec_dot_type, *(None if v is None else v[r0:r1]
                                                             for v in (xp.x, xp.qs, xp.d, xp.s, xp.bsums)))
            out[r0:r1] = linear_prepared(part, stack[experts[j]], ggml_type, k, expert=True, solo=solo)
        return out
    if VEC_DOT_TYPE[ggml_type] != xp.vec_dot_type or xp.K != k:
        raise ValueError("activations were prepared for another weight type or length")
    if stack.dtype != np.uint8 or stack.ndim != 3 or stack.shape[2] != Q.row_bytes(ggml_type, k):
        raise ValueError(f"stack must be uint8 [E, N, {Q.row_bytes(ggml_type, k)}], got {stack.dtype} {stack.shape}")
    out = np.empty((xp.T, N), np.float32)
    if J == 0 or N == 0 or xp.T == 0:
        return out
    _grouped(xp, Q._readonly(stack), experts, offs, ggml_type, solo, out)
    return out


def _grouped(xp: Prepared, stack: np.ndarray, experts: np.ndarray, offs: np.ndarray, ggml_type: int,
             solo: bool, out: np.ndarray) -> None:
    """The grouped kernel of a quantized type on checked arguments (see linear_grouped)."""
    qt = int(ggml_type)
    nc = _nchunks(experts.shape[0] * stack.shape[1])
    if TYPES[qt].family == KQUANT:
        tiled = np.zeros(len(experts), np.uint8) if solo else tiled_kquant(np.diff(offs)).astype(np.uint8)
        kquant_kernel(qt)(tiled, stack, experts, offs, xp.qs, xp.d, xp.bsums, out, nc)
    else:
        xs = xp.s if xp.s is not None else xp.d  # read only for Q8_1
        block32_kernel(qt)(stack, experts, offs, xp.qs, xp.d, xs, out, nc)


def linear(
    x: np.ndarray, raw: np.ndarray, ggml_type: int, k: int, numerics: str = "ggml", expert: bool = False,
    solo: bool = False, groups: np.ndarray | None = None,
) -> np.ndarray:
    """out float32 [T, N] = x [T, K] @ W.T, W given as ggml blocks raw uint8 [N, row_bytes].
    expert, solo, groups: as linear_prepared."""
    return linear_prepared(prepare(x, ggml_type, numerics), raw, ggml_type, k, expert, solo, groups)


# --------------------------------------------------------------------------------------------
# benchmark


def bench(
    types=("Q8_0", "Q4_0", "Q4_1", "Q5_0", "MXFP4", "Q4_K", "Q5_K", "Q6_K", "F16", "BF16", "F32"),
    n: int = 2048,
    k: int = 2048,
    tokens=(1, 32),
    numerics: str = "ggml",
    seconds: float = 0.5,
    working_set_mb: float = 0,
) -> list[tuple[str, int, float, float]]:
    """Time linear_prepared (activation preparation excluded) on n x k matrices of random
    blocks; print and return (type, T, ms per call, GB/s of weight bytes). With
    working_set_mb > 0 the calls cycle through enough distinct matrices to fill that much
    memory, so that weights come from DRAM rather than from the caches."""
    rng = np.random.default_rng(0)
    results = []
    print(f"threads={numba.get_num_threads()} N={n} K={k} numerics={numerics}"
          + (f" working set {working_set_mb:.0f} MB" if working_set_mb else ""))
    for name in types:
        qt = int(getattr(Q, name))
        rb = Q.row_bytes(qt, k)
        copies = max(1, int(np.ceil(working_set_mb * 1e6 / (n * rb))))
        raws = []
        for _ in range(copies):
            raw = rng.integers(0, 256, size=(n, rb), dtype=np.uint8)
            if qt in Q.FLOAT_TYPES:
                w = rng.standard_normal((n, k)).astype(np.float32)
                if qt == Q.F16:
                    w = w.astype(np.float16)
                elif qt == Q.BF16:
                    w = (w.view(np.uint32) >> np.uint32(16)).astype(np.uint16)
                raw = np.ascontiguousarray(w).view(np.uint8)
            else:
                _fix_scales(raw, qt, rng)
            raws.append(raw)
        for T in tokens:
            x = rng.standard_normal((T, k)).astype(np.float32)
            xp = prepare(x, qt, numerics)
            linear_prepared(xp, raws[0], qt, k)  # compile / warm
            reps, t0 = 0, time.perf_counter()
            best = float("inf")
            while time.perf_counter() - t0 < seconds or reps < 3:
                t1 = time.perf_counter()
                for raw in raws:
                    linear_prepared(xp, raw, qt, k)
                best = min(best, (time.perf_counter() - t1) / len(raws))
                reps += 1
            gbs = raws[0].nbytes / best / 1e9
            results.append((name, T, best * 1e3, gbs))
            print(f"{name:6s} T={T:4d} {best * 1e3:8.3f} ms  {gbs:6.2f} GB/s  "
                  f"{2 * T * n * k / best / 1e9:7.1f} GOP/s", flush=True)
    return results


def _fix_scales(raw: np.ndarray, qt: int, rng: np.random.Generator) -> None:
    """Overwrite the fp16 scale fields of random blocks with small finite values (in place)."""
    qk, bb = Q.block_size(qt)
    blk = raw.reshape(raw.shape[0], -1, bb)
    offs = {Q.Q8_0: (0,), Q.Q4_0: (0,), Q.Q5_0: (0,), Q.Q4_1: (0, 2), Q.Q5_1: (0, 2),
            Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,)}.get(qt, ())
    for o in offs:
        v = rng.uniform(1e-3, 1e-1, blk.shape[:-1]).astype(np.float16)
        blk[..., o:o + 2] = v.view(np.uint8).reshape(blk.shape[:-1] + (2,))
    if qt == Q.MXFP4:
        blk[..., 0] = rng.integers(118, 128, blk.shape[:-1], dtype=np.uint8)


if __name__ == "__main__":
    import sys

    nt = int(sys.argv[1]) if len(sys.argv) > 1 else numba.get_num_threads()
    numba.set_num_threads(nt)
    bench()
    bench(types=("Q8_0", "Q4_0", "Q4_1", "MXFP4", "Q4_K", "Q6_K", "BF16"), n=4096, k=4096,
          tokens=(1,), working_set_mb=512)
