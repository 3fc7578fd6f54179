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
