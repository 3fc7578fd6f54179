"""Work on the backend's stream is seen by copies made outside it: SamplerSlots grows without
losing a draw still in flight.

The backend's stream is non-blocking: the legacy default stream, which plain copies use, does not
wait for it (nor it for them). Here the backend's stream is kept busy by a sleeping kernel to open
that window. On an H200 the test failed before SamplerSlots waited for the device
([26, 9, 9, 16, ...] against [26, 9, 16, ...]: the grown pool got the RNG state from before the
draw in flight). GPU only: the simulator runs everything in order.
"""

import numpy as np
import pytest
from numba import cuda

from daemon.kernels.cuda.ptx import SIMULATOR

pytestmark = pytest.mark.skipif(SIMULATOR, reason="stream ordering needs a GPU (the simulator runs in order)")

BUSY_MS = 200


@cuda.jit
def _busy(ms):
    """One thread sleeps about `ms` milliseconds (nanosleep is approximate: 1 us steps)."""
    if cuda.threadIdx.x == 0 and cuda.blockIdx.x == 0:
        for _ in range(ms * 1000):
            cuda.nanosleep(1000)


def _nonblocking():
    from daemon.backend.cuda_graphs import nonblocking_stream

    return nonblocking_stream()


def test_growing_the_sampler_pool_keeps_a_draw_still_in_flight():
    from daemon.kernels.cuda.sample import SamplerSlots, sample_rows
    from daemon.sampling import SamplingOptions

    V, draws = 64, 6
    logits = np.random.default_rng(3).normal(size=(1, V)).astype(np.float32)
    seeded = SamplingOptions(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=11)

    def tokens(wait_before_growing: bool) -> list[int]:
        nb = _nonblocking()
        pool = SamplerSlots(1, 4, stream=nb)
        slot = pool.assign(seeded, [], 64, stream=nb)
        slots = cuda.to_device(np.array([slot], np.int32), stream=nb)
        outs = []
        for i in range(draws):
            if i == 1:
                _busy[1, 32, nb](BUSY_MS)  # draw 1 still queued when the pool grows
            tok, flag = cuda.device_array(1, np.int32), cuda.device_array(1, np.int32)
            sample_rows(cuda.to_device(logits, stream=nb), slots, pool, tok, flag, stream=nb)
            outs.append(tok)
            if i == 1:
                if wait_before_growing:
                    nb.synchronize()
                pool.assign(seeded, [], 64, stream=nb)  # no free slot: every pool is made again
        nb.synchronize()
        return [int(t.copy_to_host()[0]) for t in outs]

    assert tokens(wait_before_growing=False) == tokens(wait_before_growing=True)
