"""cuda_transfer.Transfers.copy_many: rows of mapped host memory into VRAM slots (the host tier's
promotions), as one batched driver call or one call each, the bytes exact either way. Runs on a
GPU, or under numba's simulator (CI), where a mapped array is plain host memory."""

from __future__ import annotations

# first: it picks the GPU or the simulator as numba.cuda is imported
from tests.kernels.cuda.conftest import SKIP_REASON as CUDA_SKIP_REASON  # isort: skip

import numpy as np
import pytest
from numba import cuda

pytestmark = pytest.mark.skipif(CUDA_SKIP_REASON is not None, reason=str(CUDA_SKIP_REASON))


def _tiers(rows=5, slots=3, n=4, stride=32):
    """A host tier [rows, n, stride] of random bytes in mapped memory, and empty slots [slots, ...]."""
    from daemon.backend.cuda_upload import mapped_matrix
    from daemon.kernels.cuda.layout import Q8_0

    host = mapped_matrix(rows * n, 34 * stride // 32, Q8_0).reshape(rows, n, -1)
    want = np.random.default_rng(0).integers(0, 256, host.shape, dtype=np.uint8)
    if hasattr(host, "copy_to_device"):
        host.copy_to_device(want)
    else:
        host[...] = want
    return host, cuda.to_device(np.zeros((slots, *host.shape[1:]), np.uint8)), want


@pytest.mark.parametrize("batched", [True, False], ids=["batched", "one-by-one"])
def test_rows_land_in_their_slots(batched, monkeypatch):
    from daemon.backend import cuda_transfer
    from daemon.backend.cuda_transfer import Transfers

    if not batched:
        monkeypatch.setattr(cuda_transfer, "_batch_copy", False)  # as a driver without cuMemcpyBatchAsync
    host, slots, want = _tiers()
    tr = Transfers(cuda.stream())
    tr.copy_many([(slots[2], host[4]), (slots[0], host[1])])
    tr.fetch.synchronize()
    got = slots.copy_to_host()
    np.testing.assert_array_equal(got[2], want[4])
    np.testing.assert_array_equal(got[0], want[1])
    assert not got[1].any()  # a slot no copy names is untouched


def test_a_bad_copy_list_copies_nothing():
    from daemon.backend.cuda_transfer import Transfers

    host, slots, _ = _tiers()
    tr = Transfers(cuda.stream())
    with pytest.raises(ValueError, match="bytes into"):
        tr.copy_many([(slots[0], host[1]), (slots[1], host[2:4])])

    def fail():
        raise RuntimeError("injected")

    tr.fault = fail
    with pytest.raises(RuntimeError, match="injected"):
        tr.copy_many([(slots[0], host[1])])
    tr.fetch.synchronize()
    assert not slots.copy_to_host().any()
