"""The (token, expert) pairs of a layer grouped by expert, on the device, in one block.

The router's ids [T, A] name each pair's expert; the expert kernels that read an expert's weights
once for all of its tokens (mmq's tiles, mmvq's grouped GEMV) take the pairs in this order. The
order never depends on timing (no atomics), so neither do the results.

Legend: T = tokens, A = experts per token, P = T*A pairs (pair t*A + a is token t's a-th
expert), E = experts.
Shapes:
    ids      int32 [T, A]
    pairs    int32 [P]     pair indices grouped by expert, increasing within an expert; the
                           first starts[E] are filled (ids outside 0..E-1 are left out)
    starts   int32 [E+1]   expert e's pairs are pairs[starts[e]:starts[e+1]]
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
from numba import cuda

from ...errors import UnsupportedError
from .launch import launch
from .ptx import SIMULATOR, warp_barrier, warp_match

_MAX_EXPERTS = 1024
_GROUP_THREADS = 512  # 16 warps (at 122 registers a thread: 1024 would not fit an SM)
_HIST_WORDS = 8192  # shared [warps walking pairs, E] counts (32 KB)
_SIM_GROUP_THREADS = 64  # two warps (the simulator runs each thread in Python)


@cuda.jit
def _group_kernel(ids, n_pairs, n_expert, pairs, starts):
    # ids int32 [P] (the [T, A] ids, flat) -> pairs int32 [P]: the pair indices grouped by
    # expert, increasing within a group; starts int32 [E+1]. One block. Warp w < W walks
    # segment w of the pairs 32 at a time: lanes of one expert find each other (match.any),
    # the lowest adds their count to hist[w, e]; after a prefix over (e, w) in pair order, a
    # second walk writes each pair at its warp's next place plus its rank among its lanes. So
    # the order never depends on timing (no atomics). Ids outside 0..E-1 are left out.
    hist = cuda.shared.array(_HIST_WORDS, np.int32)  # [W, E]
    totals = cuda.shared.array(_MAX_EXPERTS, np.int32)  # [E]
    part = cuda.shared.array(32, np.int32)  # experts' totals, summed per lane's range
    tid = cuda.threadIdx.x
    nthreads = cuda.blockDim.x
    warp = tid // 32
    lane = tid - 32 * warp
    n_walk = min(nthreads // 32, _HIST_WORDS // n_expert)
    seg = (n_pairs + n_walk - 1) // n_walk
    seg = (seg + 31) // 32 * 32
    below = (np.uint32(1) << np.uint32(lane)) - np.uint32(1)  # the lanes before this one
    for i in range(tid, n_walk * n_expert, nthreads):
        hist[i] = 0
    cuda.syncthreads()
    for second in range(2):
        lo = warp * seg
        for base in range(0, seg, 32):  # every warp the same trips: the barriers need all threads
            p = lo + base + lane
            e = np.int32(-1)
            if warp < n_walk and p < n_pairs:
                e = ids[p]
                if e < 0 or e >= n_expert:
                    e = np.int32(-1)
            peers = warp_match(e)
            at = warp * n_expert + e
            if second and e >= 0:
                pairs[hist[at] + cuda.popc(peers & below)] = p
            warp_barrier()  # every lane has read hist[at] before its leader moves it
            if e >= 0 and (peers & below) == 0:
                hist[at] += cuda.popc(peers)
            warp_barrier()
        cuda.syncthreads()
        if second:
            break
        for e in range(tid, n_expert, nthreads):  # where each warp's pairs of e start, relative to e
            total = 0
            for w in range(n_walk):
                c = hist[w * n_expert + e]
                hist[w * n_expert + e] = total
                total += c
            totals[e] = total
        cuda.syncthreads()
        span = (n_expert + 31) // 32  # the experts' exclusive prefix: 32 threads, a range each
        if tid < 32:
            total = 0
            for e in range(tid * span, min(n_expert, tid * span + span)):
                total += totals[e]
            part[tid] = total
        cuda.syncthreads()
        if tid < 32:
            total = 0
            for i in range(tid):
                total += part[i]
            for e in range(tid * span, min(n_expert, tid * span + span)):
                starts[e] = total
                total += totals[e]
            if tid == 31:
                starts[n_expert] = total
        cuda.syncthreads()
        for i in range(tid, n_walk * n_expert, nthreads):  # absolute places
            hist[i] += starts[i % n_expert]  # (written before the barrier: visible to the block)
        cuda.syncthreads()


class Groups(NamedTuple):
    """The pairs of each expert (group_by_expert), shared by a layer's gate, up and down."""
    pairs: object  # int32 [P]
    starts: object  # int32 [E+1]
    n_expert: int


def group_by_expert(ids, n_expert: int, out: Groups | None = None, stream=0) -> Groups:
    """Group the (token, slot) pairs of ids int32 [T, A] by expert, on the device. `out`:
    buffers from an earlier call to reuse (pairs of at least T*A, starts of n_expert + 1)."""
    t, a = ids.shape
    if out is None:
        out = Groups(cuda.device_array(max(t * a, 1), np.int32, stream=stream),
                     cuda.device_array(n_expert + 1, np.int32, stream=stream), n_expert)
    elif out.n_expert != n_expert or out.pairs.shape[0] < t * a:
        raise ValueError(f"group buffers for {out.n_expert} experts and {out.pairs.shape[0]} "
                         f"pairs cannot hold {n_expert} experts and {t * a} pairs")
    if not 0 < n_expert <= _MAX_EXPERTS:
        raise UnsupportedError(f"grouping supports up to {_MAX_EXPERTS} experts, got {n_expert}")
    launch(_group_kernel, 1, _SIM_GROUP_THREADS if SIMULATOR else _GROUP_THREADS, stream,
        ids.reshape(t * a), t * a, n_expert, out.pairs, out.starts)
    return out
