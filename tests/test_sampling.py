import numpy as np
import pytest

from daemon.errors import RequestError
from daemon.sampling import Sampler, SamplingOptions, StopMatcher


def _logits(seed=0, n=200):
    return np.random.default_rng(seed).normal(size=n).astype(np.float32) * 3


def test_greedy_is_first_argmax():
    logits = np.array([1.0, 5.0, 5.0, -2.0], np.float32)
    assert Sampler(SamplingOptions(temperature=0)).sample(logits, []) == 1


def test_seed_reproducible_and_seeds_differ():
    opts = dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0)
    a = [Sampler(SamplingOptions(seed=7, **opts)).sample(_logits(i), []) for i in range(50)]
    b = [Sampler(SamplingOptions(seed=7, **opts)).sample(_logits(i), []) for i in range(50)]
    s = Sampler(SamplingOptions(seed=8, **opts))
    c = [s.sample(_logits(i), []) for i in range(50)]
    assert a == b
    assert a != c


def test_top_k_limits_candidates():
    logits = _logits(1)
    top3 = set(np.argsort(-logits)[:3].tolist())
    s = Sampler(SamplingOptions(seed=0, temperature=5.0, top_k=3, top_p=1.0, min_p=0.0))
    assert {s.sample(logits, []) for _ in range(300)} == top3


def test_top_p_and_min_p_cut_the_tail():
    logits = np.log(np.array([0.5, 0.3, 0.15, 0.05], np.float32))
    s = Sampler(SamplingOptions(seed=0, temperature=1.0, top_k=0, top_p=0.7, min_p=0.0))
    assert {s.sample(logits, []) for _ in range(300)} == {0, 1}
    s = Sampler(SamplingOptions(seed=0, temperature=1.0, top_k=0, top_p=1.0, min_p=0.2))
    assert {s.sample(logits, []) for _ in range(300)} == {0, 1, 2}


def test_temperature_sharpens():
    logits = np.log(np.array([0.4, 0.35, 0.25], np.float32))
    cold = Sampler(SamplingOptions(seed=0, temperature=0.005, top_k=0, top_p=1.0, min_p=0.0))
    assert all(cold.sample(logits, []) == 0 for _ in range(100))


def test_repeat_penalty_moves_greedy_choice():
    logits = np.array([3.0, 2.9, -1.0], np.float32)
    s = Sampler(SamplingOptions(temperature=0, repeat_penalty=1.5))
    assert s.sample(logits, [0]) == 1
    assert s.sample(logits, [2]) == 0


@pytest.mark.parametrize("bad", [dict(temperature=-1), dict(top_p=0), dict(top_p=1.5), dict(min_p=2),
                                 dict(top_k=-1), dict(repeat_penalty=0), dict(temperature=float("nan"))])
def test_bad_options_rejected(bad):
    with pytest.raises(RequestError):
        SamplingOptions(**bad)


def test_stop_matcher_holds_back_prefixes_and_cuts():
    m = StopMatcher(["</s>", "STOP"])
    out = [m.feed(t) for t in ["hel", "lo <", "/", "s> more"]]
    assert "".join(out) == "hello "
    assert m.stopped


def test_stop_matcher_releases_false_prefix():
    m = StopMatcher(["STOP"])
    assert m.feed("a ST") == "a "
    assert m.feed("ar") == "STar"
    assert not m.stopped
