"""cuda_arrays: pooled op outputs behave as numba's device arrays, and a buffer is reused only once
nothing refers to it. GPU only (numba's driver classes do not exist under the simulator)."""

import gc

import numpy as np
import pytest
from numba import cuda

from daemon.kernels.cuda.ptx import SIMULATOR

pytestmark = pytest.mark.skipif(SIMULATOR, reason="numba's driver classes are absent under the simulator")


@pytest.fixture
def arrays():
    from daemon.backend.cuda_arrays import OpArrays

    return OpArrays()


def _filled(arrays, host):
    a = arrays.empty(host.shape, host.dtype)
    a.copy_to_device(host)
    return a


def test_views_and_reshapes_match_numba(arrays):
    rng = np.random.default_rng(0)
    host = rng.standard_normal((6, 4, 8)).astype(np.float32)
    a = _filled(arrays, host)
    ref = cuda.to_device(host)
    cases = [lambda x: x[1:4], lambda x: x[5:], lambda x: x[3:3], lambda x: x[:, 1:3], lambda x: x[2],
             lambda x: x.reshape(24, 8), lambda x: x.reshape(6, -1), lambda x: x[1:5].reshape(2, 2, 32),
             lambda x: x[:, 1:3].reshape(6, 2, 8)]
    for f in cases:
        got, want = f(a), f(ref)
        assert got.shape == want.shape and got.strides == want.strides
        np.testing.assert_array_equal(got.copy_to_host(), want.copy_to_host())
    with pytest.raises(ValueError):
        a.reshape(5, 5)


def test_a_buffer_is_reused_only_when_no_view_holds_it(arrays):
    a = _filled(arrays, np.arange(64, dtype=np.float32))
    view = a[8:16]
    ptr = int(a.gpu_data.device_pointer)
    del a
    gc.collect()
    b = arrays.empty(64, np.float32)  # the view keeps a's buffer: another one
    b_ptr = int(b.gpu_data.device_pointer)
    assert b_ptr != ptr
    np.testing.assert_array_equal(view.copy_to_host(), np.arange(8, 16, dtype=np.float32))
    del view, b
    gc.collect()
    c = arrays.empty(64, np.float32)  # both free now: one of them comes back
    assert int(c.gpu_data.device_pointer) in (ptr, b_ptr)
    held = arrays.held
    for _ in range(50):  # a steady state allocates nothing new
        arrays.empty(64, np.float32)
    assert arrays.held == held


def test_trim_frees_only_unused_buffers(arrays):
    kept = _filled(arrays, np.arange(1000, dtype=np.float32))
    dropped = [arrays.empty(5000, np.float32) for _ in range(3)]
    assert arrays.held >= 4 * 4000
    del dropped
    gc.collect()
    arrays.trim()
    assert arrays.held == 4096  # kept's buffer (4000 bytes, in 256-byte steps)
    np.testing.assert_array_equal(kept.copy_to_host(), np.arange(1000, dtype=np.float32))
    again = arrays.empty(5000, np.float32)  # allocates anew after a trim
    assert arrays.held == 4096 + 20224


def test_kernels_read_pooled_arrays():
    from daemon.backend.cuda_graphs import nonblocking_stream
    from daemon.kernels.cuda.glu import add

    from daemon.backend.cuda_arrays import OpArrays

    pool = OpArrays()
    stream = nonblocking_stream()
    rng = np.random.default_rng(1)
    x, y = (rng.standard_normal((5, 32)).astype(np.float32) for _ in range(2))
    outs = []
    for _ in range(3):  # buffers come back and go out again between the launches
        a, b = _filled(pool, x), _filled(pool, y)
        out = pool.empty((5, 32))
        add(a, b, out, stream=stream)
        outs.append(out.copy_to_host(stream=stream))
        stream.synchronize()
        del a, b, out
    for o in outs:
        np.testing.assert_array_equal(o, x + y)
