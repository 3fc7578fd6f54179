"""A decode step's input tokens, taken on the device from the step before's sampled ids.

The serving loop launches step N+1 before the host has seen step N's tokens (daemon/scheduler/
batcher.py): a sequence that goes on reads its input from step N's sampled ids, a sequence that
just joined (its first token came from its prefill) from the host.

Legend: S = sequences of the step, S' = sequences of the step before.
"""

from __future__ import annotations

from numba import cuda

from .launch import launch

_THREADS = 128


@cuda.jit
def _fed_tokens(out, src_and_host, prev):
    """out [S] int32: prev[src[s]] if src[s] >= 0 else host[s]; src_and_host: int32 [2*S], src
    then host; prev: int32 [S']."""
    s = cuda.grid(1)
    S = out.shape[0]
    if s < S:
        r = src_and_host[s]
        out[s] = prev[r] if r >= 0 else src_and_host[S + s]


def fed_tokens(out, src_and_host, prev, stream=0) -> None:
    S = out.shape[0]
    launch(_fed_tokens, (S + _THREADS - 1) // _THREADS, _THREADS, stream, out, src_and_host, prev)
