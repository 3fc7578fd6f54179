import random

import msgspec
import numpy as np
import pytest

from daemon.errors import ModelError, RequestError
from daemon.sampling import Sampler, SamplingOptions, StopMatcher, sampling_options


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
    with pytest.raises(ValueError):  # the wire struct's check: bad_request when decoded
        SamplingOptions(**bad)
    with pytest.raises(RequestError):  # in process
        sampling_options(**bad)


def test_the_options_are_the_wire_struct_and_keep_their_messages():
    from ipc import protocol

    assert SamplingOptions is protocol.SamplingOptions
    with pytest.raises(RequestError, match=r"top_p must be in \(0, 1\]"):
        sampling_options(top_p=2.0)
    assert sampling_options(seed=3) == SamplingOptions(seed=3)


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


# -- stop strings by automaton (issue 25, item 2): the same text as the naive scan --------------

class _NaiveStops:
    """The matcher's semantics, written plainly (StopMatcher scanned every stop this way on every
    feed before issue 25): cut before the stop string that begins first in the text held back
    plus the new text; else hold back the longest tail that begins a stop string."""

    def __init__(self, stops):
        self.stops = [s for s in stops if s]
        self.pending = ""
        self.stopped = False

    def feed(self, text):
        self.pending += text
        starts = [self.pending.find(s) for s in self.stops if s in self.pending]
        if starts:
            self.stopped = True
            out, self.pending = self.pending[:min(starts)], ""
            return out
        hold = max((n for s in self.stops for n in range(1, len(s)) if self.pending.endswith(s[:n])), default=0)
        cut = len(self.pending) - hold
        out, self.pending = self.pending[:cut], self.pending[cut:]
        return out

    def flush(self):
        out, self.pending = self.pending, ""
        return out


@pytest.mark.parametrize("seed", range(4))
def test_stop_matcher_gives_what_the_naive_scan_gives(seed):
    rng = random.Random(seed)
    for _ in range(400):
        alphabet = rng.sample("ab☃é😀", rng.randint(1, 5))  # 1- to 4-byte characters in UTF-8
        word = lambda n: "".join(rng.choice(alphabet) for _ in range(n))  # noqa: E731
        stops = [word(rng.randint(0, 6)) for _ in range(rng.randint(0, 6))]  # "" and duplicates too
        feeds = [word(rng.randint(0, 5)) for _ in range(rng.randint(0, 14))]
        got, ref = StopMatcher(stops), _NaiveStops(stops)
        for text in feeds:  # and on after a stop, as the matcher allows
            assert (got.feed(text), got.stopped) == (ref.feed(text), ref.stopped), (stops, feeds)
        assert got.flush() == ref.flush()


def test_stop_matcher_multibyte_stop_spanning_feeds():
    m = StopMatcher(["☃😀☃", "é!"])  # ☃😀 is released when é breaks it; é is held for é!
    assert [m.feed(t) for t in ["x☃", "😀", "é", "!y"]] == ["x", "", "☃😀", ""] and m.stopped
    m = StopMatcher(["☃😀☃"])
    assert [m.feed(t) for t in ["x☃", "😀", "☃y"]] == ["x", "", ""] and m.stopped


def test_stop_matcher_cuts_before_the_stop_that_begins_first_not_the_one_that_ends_first():
    m = StopMatcher(["c", "abcd"])
    assert m.feed("ab") == ""  # could begin abcd
    assert m.feed("cd") == "" and m.stopped  # abcd begins before c
    m = StopMatcher(["c", "abcd"])
    assert m.feed("abce") == "ab" and m.stopped


class _CountedStr(str):
    uses = 0  # calls of len, slicing or iteration on any instance

    def __len__(self):
        _CountedStr.uses += 1
        return super().__len__()

    def __getitem__(self, key):
        _CountedStr.uses += 1
        return super().__getitem__(key)

    def __iter__(self):
        _CountedStr.uses += 1
        return super().__iter__()


def test_stop_matcher_feed_does_not_walk_the_stop_list():
    # Before issue 25 every feed scanned every stop (38.9 s for another stream's 30 tokens beside a
    # million stops); the automaton is built once, and a feed only steps through its own text.
    m = StopMatcher([_CountedStr("☃%07d" % k) for k in range(1000)])
    _CountedStr.uses = 0
    out = "".join(m.feed(t) for t in ["a☃", "00", "0 and", " ☃12", "3"] * 20) + m.flush()
    assert out == "a☃000 and ☃123" * 20 and not m.stopped
    assert _CountedStr.uses == 0

# -- totality: extreme but valid options never raise (issue 9, defect 1) -------------------------

EXTREME_OPTIONS = [
    dict(temperature=0.7, repeat_penalty=1e-300),  # the reported crash: a penalty overflows float32
    dict(temperature=0.7, repeat_penalty=1e-38),
    dict(temperature=0.7, repeat_penalty=1e300),
    dict(temperature=0.0, repeat_penalty=1e-300),
    dict(temperature=1e-300),
    dict(temperature=1e300),
    dict(top_p=1e-300),
    dict(min_p=1.0),
    dict(top_k=10**9, top_p=1.0, min_p=0.0, temperature=1e-300, repeat_penalty=1e-300),
    dict(top_k=1, repeat_penalty=1e300, repeat_last_n=10**9),
]

F32_MAX = float(np.finfo(np.float32).max)
EXTREME_LOGITS = [
    _logits(3),
    np.array([F32_MAX, -F32_MAX, F32_MAX, 0.0, -1e-45, 1e-45], np.float32),
    np.full(7, -F32_MAX, np.float32),
    np.full(7, F32_MAX, np.float32),
    np.zeros(5, np.float32),
    np.array([1e30, -1e30, 3.0], np.float32),
]


@pytest.mark.parametrize("options", EXTREME_OPTIONS)
@pytest.mark.parametrize("logits", EXTREME_LOGITS, ids=range(len(EXTREME_LOGITS)))
def test_extreme_options_and_logits_always_give_a_token(options, logits):
    s = Sampler(SamplingOptions(seed=1, **options))
    n = len(logits)
    for history in ([], [0], [0, 1, 2], list(range(n)), [n + 5, -3, 1]):  # also ids the logits lack
        token = s.sample(logits, history)
        assert isinstance(token, int) and 0 <= token < n


def test_tiny_penalty_boosts_and_huge_penalty_buries_repeated_tokens():
    logits = np.array([3.0, 2.0, 1.0, -1.0], np.float32)
    boost = Sampler(SamplingOptions(temperature=0.7, repeat_penalty=1e-300, seed=0))
    assert {boost.sample(logits, [1]) for _ in range(50)} == {1}  # 2 / 1e-300 dwarfs the rest
    bury = Sampler(SamplingOptions(temperature=0, repeat_penalty=1e300))
    assert bury.sample(logits, [0, 1, 2]) == 0  # positives shrink to ~0, still above -1e300
    assert bury.sample(logits, [0, 3]) == 1


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_non_finite_logits_are_a_model_error(bad, temperature):
    logits = _logits(4)
    logits[17] = bad
    with pytest.raises(ModelError, match="the model produced non-finite values"):
        Sampler(SamplingOptions(temperature=temperature, seed=0)).sample(logits, [1, 2])


# -- seeds (issue 9, defect 7) -------------------------------------------------------------------

@pytest.mark.parametrize("seed", [-1, 2**64, -(2**63)])
def test_seed_out_of_range_is_a_request_error(seed):
    with pytest.raises(ValueError, match="seed"):
        SamplingOptions(seed=seed)


def test_seed_range_ends_are_usable():
    for seed in (0, 2**64 - 1):
        assert 0 <= Sampler(SamplingOptions(seed=seed)).sample(_logits(), []) < 200


def test_negative_seed_on_the_wire_is_bad_request():
    from ipc.errors import ProtocolError
    from ipc.protocol import Generate, decode_request

    fields = msgspec.to_builtins(Generate(1, "m", prompt="hi", options=SamplingOptions(seed=5)))
    options = next(f for f in fields if isinstance(f, dict) and f.get("seed") == 5)
    options["seed"] = -1
    body = msgspec.msgpack.encode(fields)
    with pytest.raises(ProtocolError) as e:
        decode_request(body)
    assert e.value.code == "bad_request" and "seed" in str(e.value)


class _FullSortSampler(Sampler):
    """The oracle: _draw as it was before the partial top-k (a stable sort of the vocabulary)."""

    def _draw(self, logits):
        o = self.options
        order = np.argsort(-logits, kind="stable")
        if o.top_k:
            order = order[:o.top_k]
        cand = logits[order].astype(np.float64)
        with np.errstate(over="ignore", under="ignore"):
            probs = np.exp(cand - cand[0])
            probs /= probs.sum()
            if o.top_p < 1.0:
                keep = int(np.searchsorted(np.cumsum(probs), o.top_p) + 1)
                order, cand, probs = order[:keep], cand[:keep], probs[:keep]
            if o.min_p > 0:
                keep = probs >= o.min_p * probs[0]
                order, cand = order[keep], cand[keep]
            p = np.exp((cand - cand[0]) / o.temperature)
        p /= p.sum()
        return int(order[self.rng.choice(len(order), p=p)])


@pytest.mark.parametrize("case", range(40))
def test_partial_top_k_draws_what_the_full_sort_drew(case):
    rng = np.random.default_rng(1000 + case)
    v = int(rng.integers(2, 400))
    top_k = int(rng.choice([1, 2, 3, 5, 40, v - 1, v, v + 7, int(rng.integers(1, v + 1))]))
    opts = SamplingOptions(seed=case, temperature=float(rng.choice([0.1, 0.7, 1.0, 3.0, 1e300])),
                           top_k=top_k, top_p=float(rng.choice([1.0, 0.9, 0.3, 1e-9])),
                           min_p=float(rng.choice([0.0, 0.05, 0.5, 1.0])),
                           repeat_penalty=float(rng.choice([1.0, 1.3])))
    new, old = Sampler(opts), _FullSortSampler(opts)
    history = rng.integers(0, v, size=10).tolist()
    got, want = [], []
    for _ in range(30):
        spread = int(rng.choice([2, 4, 50]))  # few distinct values: many ties at the k-th value
        logits = rng.integers(-spread, spread + 1, size=v).astype(np.float32)
        if rng.random() < 0.3:
            logits[rng.integers(0, v, size=v // 3)] = -0.0  # -0.0 ties +0.0 in both orders
        got.append(new.sample(logits, history))
        want.append(old.sample(logits, history))
        history.append(want[-1])
    assert got == want


def test_partial_top_k_order_is_the_full_sorts_prefix():
    from daemon.sampling import _best_first

    rng = np.random.default_rng(5)
    for _ in range(200):
        v = int(rng.integers(1, 300))
        logits = rng.integers(-3, 4, size=v).astype(np.float32)
        k = int(rng.integers(0, v + 3))
        full = np.argsort(-logits, kind="stable")
        assert _best_first(logits, k).tolist() == (full[:k] if k else full).tolist()
