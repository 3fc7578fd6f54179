"""launch.py: the dispatcher-free launch picks the overload numba would and gives the same bits.

The layout rule runs everywhere (it is plain Python, checked against numpy's own flags); the
launches themselves only on a GPU (under the simulator launch() is the dispatcher)."""

import numpy as np
import pytest
from numba import cuda

from daemon.kernels.cuda import launch as launch_mod
from daemon.kernels.cuda import mmvq, norm
from daemon.kernels.cuda.ptx import SIMULATOR

gpu_only = pytest.mark.skipif(SIMULATOR, reason="the simulator launches through the dispatcher")


def _views():
    base = np.zeros((4, 6, 8), np.float32)
    yield base
    yield base[1:3]  # rows of a C array: contiguous
    yield base[:, 2:5]  # a middle-axis slice: not
    yield base[..., ::2]  # strided: not
    yield base[2:3, :, 1:4]  # leading size-1 axis: still not (last axis cut)
    yield base[2:3, 4:5, :]  # every axis but the last of one element: contiguous
    yield base.transpose(1, 0, 2)
    yield np.zeros((3, 0, 5), np.float32)  # empty: contiguous, as numpy says
    yield np.broadcast_to(np.zeros((1, 8), np.float32), (5, 8))  # 0 stride: never contiguous


@pytest.mark.parametrize("view", list(_views()), ids=lambda v: f"{v.shape}-{v.strides}")
def test_contiguity_rule_is_numpys(view):
    broadcast = 0 in view.strides and view.size != 0
    expected = bool(view.flags["C_CONTIGUOUS"]) and not broadcast
    assert launch_mod._c_contiguous(view.shape, view.strides, view.itemsize) == expected


@gpu_only
def test_fast_launch_matches_the_dispatcher():
    from daemon.backend.cuda_graphs import nonblocking_stream
    from daemon.kernels.cuda.quantize import quantize_q8_1

    stream = nonblocking_stream()
    rng = np.random.default_rng(3)
    x = cuda.to_device(rng.standard_normal((3, 64)).astype(np.float32))
    w = cuda.to_device(rng.uniform(0.5, 1.5, 64).astype(np.float32))
    results = []
    for fast in (False, True):
        launch_mod.FAST = fast
        try:
            out = cuda.to_device(np.full((3, 64), np.nan, np.float32))
            norm.rms_norm(x, w, 1e-5, out, stream=stream)
            # a non-contiguous output (every other row) takes the 'A'-layout overload both ways
            strided = cuda.to_device(np.full((6, 64), np.nan, np.float32))
            norm.rms_norm(x, w, 1e-5, strided[::2], stream=stream)
            q8 = mmvq.Q8(*quantize_q8_1(x, stream=stream))
            stream.synchronize()
            results.append((out.copy_to_host(), strided.copy_to_host(), q8.qs.copy_to_host(), q8.ds.copy_to_host()))
        finally:
            launch_mod.FAST = True
    for a, b in zip(*results):
        np.testing.assert_array_equal(a, b)
    assert not np.isnan(results[1][0]).any()
    assert np.isnan(results[1][1][1::2]).all() and not np.isnan(results[1][1][::2]).any()
