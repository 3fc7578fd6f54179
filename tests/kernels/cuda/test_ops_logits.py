"""Copying back only the sampled rows of the logits."""

import numpy as np
import pytest
from numba import cuda

from daemon.kernels.cuda.logits import RowReader, rows_to_host


@pytest.mark.parametrize("rows", [[4], [1, 2, 3], [5, 0, 3], [2, 2]], ids=["one", "slice", "scattered", "repeated"])
def test_rows_to_host(rows):
    logits = np.random.default_rng(0).standard_normal((6, 100)).astype(np.float32)
    got = rows_to_host(cuda.to_device(logits), rows)
    assert np.array_equal(got, logits[rows])


def test_rows_to_host_fills_a_given_buffer_and_checks_rows():
    logits = np.arange(12, dtype=np.float32).reshape(3, 4)
    out = np.zeros((2, 4), np.float32)
    assert rows_to_host(cuda.to_device(logits), [2, 0], out=out) is out
    assert np.array_equal(out, logits[[2, 0]])
    with pytest.raises(ValueError):
        rows_to_host(cuda.to_device(logits), [3])
    assert rows_to_host(cuda.to_device(logits), []).shape == (0, 4)


def test_row_reader_reuses_its_buffers():
    rng = np.random.default_rng(1)
    reader = RowReader(4, 100)
    for rows in ([3], [0, 1, 2, 3], [5, 1], [], [2, 2, 0]):
        logits = rng.standard_normal((6, 100)).astype(np.float32)
        got = reader.read(cuda.to_device(logits), rows)
        assert np.array_equal(got, logits[rows])
    with pytest.raises(ValueError):  # more rows than the reader holds
        reader.read(cuda.to_device(logits), [0, 1, 2, 3, 4])
