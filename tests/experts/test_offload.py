"""The offload policy (daemon/experts/offload.py): which experts missing from VRAM compute on the
CPU. Pure Python, no GPU. Every expected value is worked out by hand in the comments.

Costs are chosen in powers of two so that the sums the list scheduler compares are exact."""

from __future__ import annotations

import pytest

from daemon.experts.offload import CPUCostFit, OffloadPolicy, parse_min_batch
from daemon.errors import ConfigError

MIB = 2**20
GIB = 2**30


# -- parse_min_batch ----------------------------------------------------------------------------

@pytest.mark.parametrize("value", ["auto", "AUTO", " Auto ", "auto\n"])
def test_auto_is_the_cost_model(value):
    assert parse_min_batch(value) is None


@pytest.mark.parametrize("value, want", [("0", 0), ("1", 1), ("16", 16), (" 32 ", 32), ("007", 7), (8, 8)])
def test_whole_numbers_are_a_token_threshold(value, want):
    assert parse_min_batch(value) == want


@pytest.mark.parametrize("value", ["", " ", "-1", "+2", "1.5", "1e3", "abc", "x8", "8x", "auto8", "0x10",
                                   "1 2", "None"])
def test_anything_else_is_a_config_error(value):
    with pytest.raises(ConfigError, match="MOE_OFFLOAD_MIN_BATCH"):
        parse_min_batch(value)


def test_a_non_ascii_digit_is_a_config_error_too():
    with pytest.raises(ConfigError):
        parse_min_batch("\u00b2")  # superscript two: isdigit() but not a number int() reads


# -- on_cpu: fixed thresholds -------------------------------------------------------------------

MISSES = {0: 1, 1: 2, 2: 3, 3: 5, 7: 1}  # expert -> tokens routed to it this step


@pytest.mark.parametrize("policy", [OffloadPolicy(0), OffloadPolicy(0, h2d_bytes_per_s=1.0, cpu_bytes_per_s=1e15)])
def test_min_batch_zero_never_computes_on_the_cpu(policy):
    assert not policy.hybrid
    assert policy.on_cpu(MISSES, MIB) == set()
    assert policy.on_cpu({5: 1}, 1) == set()


@pytest.mark.parametrize("n, want", [
    (1, set()),  # fewer than 1 token: none
    (2, {0, 7}),  # one token each
    (3, {0, 1, 7}),
    (5, {0, 1, 2, 7}),  # 5 tokens is not fewer than 5
    (6, {0, 1, 2, 3, 7}),
    (1000, {0, 1, 2, 3, 7}),
])
def test_min_batch_n_takes_experts_with_fewer_than_n_tokens(n, want):
    policy = OffloadPolicy(n)
    assert policy.hybrid
    assert policy.on_cpu(MISSES, MIB) == want


@pytest.mark.parametrize("policy", [OffloadPolicy(4), OffloadPolicy(None, GIB, GIB)])
def test_no_misses_nothing_to_place(policy):
    assert policy.on_cpu({}, MIB) == set()


# -- on_cpu: the cost model (min_batch None) ----------------------------------------------------

def test_costs_of_one_expert():
    p = OffloadPolicy(None, h2d_bytes_per_s=4 * GIB, cpu_bytes_per_s=GIB)
    assert p.copy_s(GIB) == 0.25  # 1 GiB at 4 GiB/s
    assert p.cpu_s(GIB, 1) == 1.0  # 1 GiB streamed once at 1 GiB/s
    assert p.cpu_s(GIB, 3) == 3.0  # a GEMV per token: three passes
    assert p.hybrid


def test_unmeasured_rates_never_pick_the_cpu():
    # no h2d figure: a copy costs nothing; no CPU figure: the CPU costs forever
    assert OffloadPolicy(None, 0.0, GIB).copy_s(MIB) == 0.0
    assert OffloadPolicy(None, GIB, 0.0).cpu_s(MIB, 1) == float("inf")
    singles = {0: 1, 1: 1, 2: 1}
    assert OffloadPolicy(None, 0.0, GIB).on_cpu(singles, MIB) == set()
    assert OffloadPolicy(None, GIB, 0.0).on_cpu(singles, MIB) == set()


def test_a_slow_cpu_copies_everything():
    # copy: 1 MiB / 1 GiB/s = 2**-10 s; CPU: 1 MiB / 1 MiB/s = 1 s a token. Each miss in turn:
    # gpu 2**-10, 2*2**-10, ... always far below 1 s on the CPU.
    p = OffloadPolicy(None, h2d_bytes_per_s=GIB, cpu_bytes_per_s=MIB)
    assert p.on_cpu({e: 1 for e in range(8)}, MIB) == set()
    assert p.on_cpu({0: 1, 1: 4, 2: 16}, MIB) == set()


def test_a_fast_cpu_takes_every_single_token_expert():
    # copy: 1 MiB / 1 MiB/s = 1 s each; CPU: 1 MiB / 1 GiB/s = 2**-10 s a token. Eight singles on
    # the CPU add up to 8 * 2**-10 s, still below the first copy's 1 s.
    p = OffloadPolicy(None, h2d_bytes_per_s=MIB, cpu_bytes_per_s=GIB)
    assert p.on_cpu({e: 1 for e in range(8)}, MIB) == set(range(8))


def test_equal_costs_split_the_misses_between_the_two_sides():
    # copy = CPU for one token = 2**-10 s. Most tokens first, then by id: e0 -> gpu (1 vs 1: a tie
    # stays on the GPU), e1 -> cpu (gpu 2 vs cpu 1), e2 -> gpu (2 vs 2), e3 -> cpu (3 vs 2) (units of 2**-10 s)
    p = OffloadPolicy(None, h2d_bytes_per_s=GIB, cpu_bytes_per_s=GIB)
    assert p.on_cpu({0: 1, 1: 1, 2: 1, 3: 1}, MIB) == {1, 3}
    # the same with ids out of order in the dict: the order is by (-tokens, id)
    assert p.on_cpu({3: 1, 1: 1, 2: 1, 0: 1}, MIB) == {1, 3}


def test_experts_with_more_tokens_are_placed_first_and_weigh_more_on_the_cpu():
    # copy 1 unit, CPU 1 unit a token. Order: e5 (4 tokens), then e1, e2 (1 each).
    # e5: gpu 1 vs cpu 4 -> gpu (1); e1: gpu 2 vs cpu 1 -> cpu (1); e2: gpu 2 vs cpu 2 -> gpu (2)
    p = OffloadPolicy(None, h2d_bytes_per_s=GIB, cpu_bytes_per_s=GIB)
    assert p.on_cpu({1: 1, 2: 1, 5: 4}, MIB) == {1}


def test_a_cpu_three_times_faster_than_the_copy_gets_three_of_four():
    # units of 2**-10 s: copy 3 (3 MiB at 1 GiB/s), CPU 1 a token (3 MiB at 3 GiB/s).
    # e0: gpu 3 vs cpu 1 -> cpu (1); e1: gpu 3 vs 2 -> cpu (2); e2: gpu 3 vs 3 -> gpu (3);
    # e3: gpu 6 vs cpu 3 -> cpu (3)
    p = OffloadPolicy(None, h2d_bytes_per_s=GIB, cpu_bytes_per_s=3 * GIB)
    assert p.on_cpu({0: 1, 1: 1, 2: 1, 3: 1}, 3 * MIB) == {0, 1, 3}


def test_a_big_batch_expert_is_copied_while_single_tokens_go_to_the_cpu():
    # copy 4 units, CPU 1 unit a token. e9 (32 tokens): gpu 4 vs cpu 32 -> gpu (4); then the
    # singles e0..e3: cpu 1, 2, 3, 4 each below gpu 8 -> all cpu; e4: gpu 8 vs cpu 5 -> cpu (5)
    p = OffloadPolicy(None, h2d_bytes_per_s=GIB, cpu_bytes_per_s=4 * GIB)
    assert p.on_cpu({9: 32, 0: 1, 1: 1, 2: 1, 3: 1, 4: 1}, 4 * MIB) == {0, 1, 2, 3, 4}


def test_the_cpu_fixed_cost_is_paid_once_a_layer():
    # units of 2**-10 s: copy 1, CPU 1/4 a token, fixed CPU cost 2. e0: gpu 1 vs cpu 2.25 -> gpu (1);
    # e1: gpu 2 vs 2.25 -> gpu (2); e2: gpu 3 vs 2.25 -> cpu (2.25); e3: gpu 3 vs 2.5 (no second fixed
    # cost) -> cpu; e4: gpu 3 vs 2.75 -> cpu; e5: gpu 3 vs 3 -> gpu (a tie stays on the GPU)
    unit = 2.0**-10
    p = OffloadPolicy(None, h2d_bytes_per_s=GIB, cpu_bytes_per_s=4 * GIB, cpu_call_s=2 * unit)
    assert p.on_cpu({e: 1 for e in range(6)}, MIB) == {2, 3, 4}
    # without it: e0, e1, e2 -> cpu (1/4, 1/2, 3/4 below the copy's 1); e3: 1 vs 1 -> gpu (1);
    # e4, e5: gpu 2 vs cpu 1, 5/4 -> cpu
    assert OffloadPolicy(None, h2d_bytes_per_s=GIB, cpu_bytes_per_s=4 * GIB).on_cpu({e: 1 for e in range(6)}, MIB) \
        == {0, 1, 2, 4, 5}
    # a fixed cost above every copy of the layer keeps all of it on the GPU
    assert OffloadPolicy(None, GIB, 4 * GIB, cpu_call_s=7 * unit).on_cpu({e: 1 for e in range(6)}, MIB) == set()


# -- describe -----------------------------------------------------------------------------------

def test_describe_names_the_mode():
    off = OffloadPolicy(0).describe()
    assert "off" in off and "MOE_OFFLOAD_MIN_BATCH=0" in off
    fixed = OffloadPolicy(4).describe()
    assert "fewer than 4 tokens" in fixed and "CPU" in fixed
    # 25e9 B/s: 2**20 / 25e9 s = 41.94 us a MiB; 5e9 B/s: 209.7 us a MiB and token
    auto = OffloadPolicy(None, h2d_bytes_per_s=25e9, cpu_bytes_per_s=5e9).describe()
    assert auto.startswith("cost model")
    assert "25.0 GB/s (42 us/MiB)" in auto
    assert "5.0 GB/s per token (210 us/MiB a token)" in auto
    assert "+ 30 us a layer" in OffloadPolicy(None, 25e9, 5e9, cpu_call_s=30e-6).describe()


# -- the CPU's cost, refit from the steps -------------------------------------------------------

def test_the_fit_recovers_a_fixed_cost_and_a_rate():
    fit = CPUCostFit()
    assert fit.fit() is None
    for w in [1, 2, 3, 4, 1, 3] * 3:  # calls of 1-4 MiB a token: 200 us + w / (2 GiB/s)
        fit.observe(w * MIB, 200e-6 + w * MIB / (2 * GIB))
    rate, fixed = fit.fit()
    assert rate == pytest.approx(2 * GIB, rel=1e-6) and fixed == pytest.approx(200e-6, rel=1e-6)


def test_calls_of_one_weight_or_too_few_count_every_second_per_byte():
    fit = CPUCostFit()
    fit.observe(MIB, 1e-3)
    assert fit.fit() == pytest.approx((MIB / 1e-3, 0.0))
    for _ in range(10):
        fit.observe(MIB, 1e-3)  # no spread in weight: nothing separates the fixed cost
    assert fit.fit() == pytest.approx((MIB / 1e-3, 0.0))


def test_older_calls_weigh_less():
    fit = CPUCostFit(half_life=4)
    for _ in range(50):
        fit.observe(MIB, 10e-3)  # a slow spell
    for _ in range(50):
        fit.observe(MIB, 1e-3)
    rate, _ = fit.fit()
    assert rate == pytest.approx(MIB / 1e-3, rel=1e-2)  # the slow spell weighs 2**-12.5 per call now


def test_a_refit_policy_sends_fewer_misses_to_a_cpu_slower_than_calibrated():
    # calibrated: the CPU 16x the copy rate, so six single-token misses mostly go to the CPU;
    # measured in the steps: 10 ms for a 1 MiB expert, ~10x its copy at 1 GiB/s: none go
    seeded = OffloadPolicy(None, h2d_bytes_per_s=GIB, cpu_bytes_per_s=16 * GIB)
    misses = {e: 1 for e in range(6)}
    assert len(seeded.on_cpu(misses, MIB)) >= 4
    fit = CPUCostFit()
    fit.observe(MIB, 10e-3)
    refit = fit.refit(seeded)
    assert refit.cpu_bytes_per_s == pytest.approx(MIB / 10e-3) and refit.h2d_bytes_per_s == GIB
    assert refit.on_cpu(misses, MIB) == set()
    assert CPUCostFit().refit(seeded) is seeded  # nothing seen: unchanged


# -- SplitTuner: how many missed experts a layer the CPU takes beside the host tier ----------


def _settled(seen: list[int]) -> int:
    """The count run most over the second half (rechecks probe the neighbours now and then)."""
    tail = seen[len(seen) // 2:]
    return max(set(tail), key=tail.count)


def _tune(cost, most: int = 8, steps: int = 600, **kw) -> list[int]:
    """The counts a tuner runs at, step by step, when a step at count n takes cost(n) seconds."""
    from daemon.experts.offload import SplitTuner

    t = SplitTuner(most, window=4, skip=1, recheck=100, **kw)
    seen = []
    for _ in range(steps):
        seen.append(t.n)
        t.observe(cost(t.n))
    return seen


def test_the_tuner_climbs_to_the_fastest_count():
    # each expert the CPU takes saves 1 s until the CPU becomes the slower side at 3
    seen = _tune(lambda n: 10.0 - n + 2.5 * max(0, n - 3))
    assert seen[0] == 0 and _settled(seen) == 3
    assert max(seen) <= 4  # it stopped one past the best


def test_the_tuner_turns_itself_off_when_the_cpu_never_pays():
    seen = _tune(lambda n: 10.0 + n)
    assert _settled(seen) == 0
    assert seen.count(1) < len(seen) // 10  # a probe now and then, not a share


def test_a_gain_within_the_margin_keeps_the_smaller_count():
    seen = _tune(lambda n: 10.0 - 0.01 * n)  # 0.1% a count: noise, not a gain
    assert _settled(seen) == 0


def test_the_tuner_follows_a_change_in_load():
    """The CPU pays at first (best 2), then a competitor makes it cost: a recheck steps down."""
    phase = {"busy": False}

    def cost(n):
        return 10.0 + n if phase["busy"] else 10.0 - n + 3.0 * max(0, n - 2)

    from daemon.experts.offload import SplitTuner

    t = SplitTuner(8, window=4, skip=1, recheck=50)
    seen = []
    for _ in range(200):
        seen.append(t.n)
        t.observe(cost(t.n))
    assert _settled(seen) == 2
    phase["busy"] = True
    seen = []
    for _ in range(600):
        seen.append(t.n)
        t.observe(cost(t.n))
    assert _settled(seen) == 0


def test_a_fixed_count_is_never_tuned():
    from daemon.experts.offload import SplitTuner

    t = SplitTuner(8, fixed=3)
    for _ in range(100):
        assert t.observe(100.0) == 3
    assert SplitTuner(2, fixed=5).n == 2  # at most a row's experts
