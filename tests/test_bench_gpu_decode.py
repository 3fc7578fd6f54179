"""benchmarks/gpu_decode.py's split of a profiled GPU's idle time: gaps inside a step against the
host's time between steps."""

from __future__ import annotations

import pytest

from tests.bench_script import load_script


def test_idle_split_parts_node_gaps_from_the_host_between_steps():
    gpu_decode = load_script("gpu_decode")
    # two steps of three kernels (us): gaps of 2 and 3 inside each, 400 of host between them; the
    # second step's last two kernels overlap (no gap)
    spans = [(0, 10), (12, 20), (23, 30), (430, 440), (442, 460), (455, 470)]
    got = gpu_decode.idle_split(spans, 2)
    assert got["within_ms"] == pytest.approx((2 + 3 + 2) / 1e3 / 2)
    assert got["gaps"] == pytest.approx(1.5)
    assert got["median_gap_us"] == 2
    assert got["between_ms"] == pytest.approx(400 / 1e3 / 2)
    assert gpu_decode.idle_split([], 1)["within_ms"] == 0
