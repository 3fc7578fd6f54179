"""Up to four projections of one activation row in one parallel region (issue 28): the q, k and v
of an attention layer, or the four input projections of a Gated DeltaNet layer, where separate
calls wake the thread pool once each. Each output row comes from the row intrinsic a one-row
call of matmul.linear_prepared uses (row_dot.py), so the bits are that call's. Quantized weights
of one type with "ggml" numerics only; the backend keeps the separate calls otherwise.

Legend: N_i = rows of weight i, K = input length.
"""

from __future__ import annotations

import functools

import numba
import numpy as np
from numba import prange

from daemon.kernels import quants as Q
from daemon.kernels.matmul import _nchunks
from daemon.kernels.matmul_activations import Prepared
from daemon.kernels.row_dot import QUANTIZED, SOURCES, aux_of, dot_row

MOST = 4


def supports(ggml_types: list[int], n_in: list[int]) -> bool:
    """Whether these weights go in one call: 2..4 of one quantized type and input length."""
    return 2 <= len(ggml_types) <= MOST and len(set(ggml_types)) == 1 and ggml_types[0] in QUANTIZED \
        and len(set(n_in)) == 1


@functools.cache
def linears_kernel(ggml_type: int):
    """kernel(w0, w1, w2, w3, xq, xd, xaux, out0, out1, out2, out3, nchunks) for one weight type:
    out_i [1, N_i] = w_i [1, N_i, row bytes] . x (an absent weight: N_i = 0)."""
    spec = (int(ggml_type), SOURCES)

    @numba.njit(cache=True, parallel=True)
    def one_row_linears(w0, w1, w2, w3, xq, xd, xaux, out0, out1, out2, out3, nchunks):
        kind = spec[0]
        e1 = w0.shape[1]
        e2 = e1 + w1.shape[1]
        e3 = e2 + w2.shape[1]
        total = e3 + w3.shape[1]
        for c in prange(nchunks):
            for i in range(c * total // nchunks, (c + 1) * total // nchunks):
                if i < e1:
                    w, out, n = w0, out0, i
                elif i < e2:
                    w, out, n = w1, out1, i - e1
                elif i < e3:
                    w, out, n = w2, out2, i - e2
                else:
                    w, out, n = w3, out3, i - e3
                out[0, n] = dot_row(kind, w, 0, n, xq, 0, xd, xaux)

    return one_row_linears


@functools.cache
def _absent(row_bytes: int) -> tuple[np.ndarray, np.ndarray]:
    return Q._readonly(np.zeros((1, 0, row_bytes), np.uint8)), np.zeros((1, 0), np.float32)


def linears(xp: Prepared, raws: list[np.ndarray], ggml_type: int) -> list[np.ndarray]:
    """[x @ W_i.T for each raw uint8 [N_i, row bytes] of ggml_type] -> [1, N_i] each, for one row
    prepared for that type."""
    if xp.T != 1 or not 1 <= len(raws) <= MOST:
        raise ValueError("one activation row and one to four weights")
    ws = [Q._readonly(np.ascontiguousarray(r))[None] for r in raws]  # [1, N_i, row bytes]
    outs = [np.empty((1, w.shape[1]), np.float32) for w in ws]
    gap_w, gap_out = _absent(ws[0].shape[2])
    pad = MOST - len(ws)
    linears_kernel(ggml_type)(*ws, *[gap_w] * pad, xp.qs, xp.d, aux_of(xp), *outs,
                                                 *[gap_out] * pad, _nchunks(sum(w.shape[1] for w in ws)))
    return outs
