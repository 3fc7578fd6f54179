"""The per-step descriptor: rows grouped by sequence."""

from __future__ import annotations

import numpy as np

from daemon.backend import Step
from daemon.backend.cpu_cache import KVCache


def _caches(n_past):
    out = []
    for p in n_past:
        c = KVCache(1, 1, 4, 4, 64)
        c.n_past = p
        out.append(c)
    return out


def test_decode_step_is_one_row_per_sequence():
    caches = _caches([3, 0, 7])
    step = Step.append([np.array([5]), np.array([6]), np.array([7])], caches, True)
    assert (step.T, step.S, step.one_row_each) == (3, 3, True)
    assert step.tokens.tolist() == [5, 6, 7] and step.positions.tolist() == [3, 0, 7]
    assert step.offsets.tolist() == [0, 1, 2, 3] and step.last_rows().tolist() == [0, 1, 2]


def test_prefill_steps_group_rows_by_sequence():
    caches = _caches([2, 0])
    step = Step.append([np.array([1, 2, 3]), np.array([4, 5])], caches, False)
    assert (step.T, step.S, step.one_row_each, step.all_logits) == (5, 2, False, False)
    assert step.positions.tolist() == [2, 3, 4, 0, 1] and step.offsets.tolist() == [0, 3, 5]
    assert step.last_rows().tolist() == [2, 4]
    out = step.outputs()
    assert (out.T, out.S, out.one_row_each, out.all_logits) == (2, 2, True, True)
    assert out.tokens.tolist() == [3, 5] and out.positions.tolist() == [4, 1] and list(out.caches) == caches
    one = Step.append([np.array([9, 8])], caches[:1], True)
    assert (one.S, one.one_row_each, one.positions.tolist()) == (1, False, [2, 3])


def test_rows_without_caches():
    step = Step.rows(4)
    assert (step.T, step.S, step.one_row_each, len(step.caches)) == (4, 1, False, 0)
    assert step.positions.tolist() == [0, 1, 2, 3]


def test_memo_is_per_step():
    a, b = Step.rows(2), Step.rows(2)
    a.memo["x"] = 1
    assert b.memo == {}
