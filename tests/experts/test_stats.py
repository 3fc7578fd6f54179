"""The request log (daemon/experts/stats.py) that scores a live tier against a replay: kept
bounded, counted from the last reset, replayed warm."""

from __future__ import annotations

from daemon.experts.stats import RequestLog, VRAMStats


def test_the_replay_counts_steps_since_the_reset_with_the_earlier_ones_warming_the_cache():
    log = RequestLog()
    for step in ([1], [2], [3], [1]):
        log.add(step)
    # two slots: LRU evicts 1 for 3, then misses 1; Belady keeps 1 (used again) and hits it
    assert (log.replay(2, "lru").hits, log.replay(2, "lru").misses) == (0, 4)
    assert (log.replay(2, "belady").hits, log.replay(2, "belady").misses) == (1, 3)
    log.reset()
    assert log.counted == 0
    log.add([3, 1])  # both still cached by Belady's replay; LRU holds 1 and 3 after the last steps
    assert log.counted == 1
    assert (log.replay(2, "belady").hits, log.replay(2, "belady").misses) == (2, 0)


def test_past_its_limit_the_log_keeps_the_newer_half_and_its_counted_steps():
    log = RequestLog(limit=4)
    for e in range(3):
        log.add([e])
    log.reset()  # counts from the 4th step
    log.add([3])
    log.add([4])  # 5 > 4: the oldest 2 go
    assert [sorted(s) for s in log.steps] == [[2], [3], [4]]
    assert log.counted_from == 1 and log.counted == 2


def test_stats_add_and_summarize():
    a, b = VRAMStats(requests=4, hits=3, bytes_copied=100, tokens=2), VRAMStats(requests=4, hits=1, misses=3)
    a.add(b)
    s = a.summary()
    assert (s["requests"], s["hits"], s["hit_rate"], s["bytes_per_token"]) == (8, 4, 0.5, 50)
