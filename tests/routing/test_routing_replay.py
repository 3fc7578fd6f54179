"""MOE_ROUTING_REPLAY: each MoE layer's experts come from a recorded trace, mapped onto the model;
the router still weighs them. Bad traces fail the load with the file and line."""

import json
import logging
import re

import numpy as np
import pytest

from daemon.engine import Engine
from daemon.errors import ConfigError
from daemon.kernels.matmul import linear
from daemon.model.family import family_for
from daemon.model.moe import route
from daemon.model.transformer import Transformer
from daemon.routing.replay_routing import RoutingReplay, map_ids, trace_layer
from daemon.routing.trace import RoutingRecorder
from daemon.storage.gguf import GGUFFile
from tests.fixtures.build import fixture_path

E_TRACE, K_TRACE, L_TRACE, N_TOK = 16, 3, 4, 5


@pytest.fixture(scope="module")
def qwen3moe(tmp_path_factory):
    return fixture_path("qwen3moe", "Q8_0", tmp_path_factory.mktemp("fx"))  # 2 MoE layers, top-2 of 8


def _write(path, records):
    path.write_text("".join(json.dumps({"tok": n, "layers": r}) + "\n" for n, r in enumerate(records, 1)))
    return path


def _trace_records(seed=0):
    """N_TOK tokens x L_TRACE layers of K_TRACE ids of E_TRACE, each row mapping (e // 2 onto 8
    experts) to at least 2 distinct ids, so no row needs filling."""
    rng = np.random.default_rng(seed)
    recs = []
    for _ in range(N_TOK):
        rows = []
        for _ in range(L_TRACE):
            while True:
                row = [int(v) for v in rng.choice(E_TRACE, K_TRACE, replace=False)]
                if len({e // 2 for e in row[:2]}) == 2:
                    break
            rows.append(row)
        recs.append(rows)
    recs[0][0][0] = E_TRACE - 1 if E_TRACE - 1 not in recs[0][0] else recs[0][0][0]  # the trace's largest id
    return recs


def _expected(recs, model_moe_index, t, n_moe=2, e_model=8, k=2):
    """The documented mapping, written out: trace layer j * L / M, expert e * E / E_trace, the
    trace's first k distinct ids, token t modulo the trace's length."""
    row = recs[t % len(recs)][model_moe_index * L_TRACE // n_moe]
    return list(dict.fromkeys(e * e_model // E_TRACE for e in row))[:k]


def test_mapping_rules():
    assert [trace_layer(j, 48, 16) for j in (0, 1, 2, 3, 47)] == [0, 0, 0, 1, 15]
    assert [trace_layer(j, 2, 26) for j in (0, 1)] == [0, 13]
    # scaled ids in trace order, duplicates dropped, truncated to k
    assert map_ids([63, 0, 1, 40], n_expert_trace=64, n_expert=32, k=2) == [31, 0]
    # too few distinct ids: filled with each chosen id's next neighbours, in order, wrapping
    assert map_ids([0, 1, 62], n_expert_trace=64, n_expert=32, k=4) == [0, 31, 1, 2]  # 0+1, (31+1 taken), 0+2
    assert map_ids([6, 7], n_expert_trace=8, n_expert=8, k=4) == [6, 7, 0, 1]  # (6+1 taken), 7+1, (6+2 taken), 7+2
    assert map_ids([], n_expert_trace=8, n_expert=8, k=3) == [0, 1, 2]  # a row not computed (recorded [])
    assert map_ids([5, 9], n_expert_trace=16, n_expert=128, k=2) == [40, 72]


def test_tracer_sees_the_mapped_trace(qwen3moe, tmp_path, caplog):
    recs = _trace_records()
    path = _write(tmp_path / "t.jsonl", recs)
    with caplog.at_level(logging.WARNING):
        engine = Engine.load(qwen3moe, routing_replay=str(path))
    assert "no longer the model's" in caplog.text and str(path) in caplog.text
    with engine:
        rec = RoutingRecorder().attach(engine.model)
        engine.forward([1, 2, 3, 4, 5, 6, 7])  # 7 rows: wraps after the trace's 5 tokens
        rec.detach()
    assert len(rec.records) == 7
    for t, layers in enumerate(rec.records):
        assert layers == [_expected(recs, j, t) for j in range(2)], t


def test_each_sequence_has_its_own_cursor(qwen3moe, tmp_path):
    recs = _trace_records(1)
    path = _write(tmp_path / "t.jsonl", recs)
    with GGUFFile(qwen3moe) as g:
        model = Transformer(g)
        replay = RoutingReplay.load(path, model).attach(model)
        seen = []
        model.trace = lambda layer, ids: seen.append((layer, np.array(ids).tolist()))
        a, b = model.new_cache(16), model.new_cache(16)
        model.forward_many([[1, 2, 3], [4, 5, 6, 7, 8, 9]], [a, b])  # last layer: output rows only
        model.forward_batch([1, 2], [a, b])  # positions 3 and 6 (6 wraps to trace token 1)
        solo = model.new_cache(4)
        model.forward([9], solo)  # a new sequence starts at the trace's first token
        replay.detach()
        assert model.route_override is None
    by_layer = [[ids for layer, ids in seen[i:i + 2]] for i in range(0, len(seen), 2)]
    prefill, decode, fresh = by_layer
    assert prefill[0] == [_expected(recs, 0, t) for t in (0, 1, 2, 0, 1, 2, 3, 4, 5)]
    assert prefill[1] == [_expected(recs, 1, t) for t in (2, 5)]
    assert decode == [[_expected(recs, j, t) for t in (3, 6)] for j in range(2)]
    assert fresh == [[_expected(recs, j, 0)] for j in range(2)]


@pytest.mark.parametrize("arch", ["qwen3moe", "gpt-oss"])
def test_weights_are_the_routers_at_the_replayed_ids(arch, tmp_path):
    with GGUFFile(fixture_path(arch, "Q8_0", tmp_path)) as g:
        model = Transformer(g)
        moe = model.layers[0].ffn
        fam = family_for(g.architecture)
        x = np.random.default_rng(3).standard_normal((5, model.hp.n_embd)).astype(np.float32)
        A, E = moe.n_used, model.hp.n_expert
        chosen = np.array([[(t + i * 3) % E for i in range(A)] for t in range(5)], dtype=np.int64)
        ids, w = route(moe, fam, x, model.numerics, chosen=chosen)
        logits = linear(x, moe.router.raw, moe.router.ggml_type, moe.router.n_in, model.numerics).astype(np.float64)
        if moe.router_bias is not None:
            logits = logits + moe.router_bias
    at = np.take_along_axis(logits, chosen, axis=1)
    if fam.gating == "softmax_weight":  # gpt-oss: softmax over the k chosen logits
        want = np.exp(at - at.max(1, keepdims=True))
        want /= want.sum(1, keepdims=True)
    else:  # softmax over all experts, read at the chosen ids
        p = np.exp(logits - logits.max(1, keepdims=True))
        want = np.take_along_axis(p / p.sum(1, keepdims=True), chosen, axis=1)
    if fam.norm_topk:
        want /= want.sum(1, keepdims=True)
    if moe.weights_scale:
        want *= moe.weights_scale
    assert np.array_equal(ids, chosen)
    np.testing.assert_allclose(w, want, rtol=2e-5, atol=1e-7)


def test_default_routing_is_unchanged(qwen3moe):
    with GGUFFile(qwen3moe) as g:
        model = Transformer(g)
        x = np.random.default_rng(4).standard_normal((3, model.hp.n_embd)).astype(np.float32)
        moe = model.layers[0].ffn
        ids, w = route(moe, model.family, x, model.numerics)
        ids2, w2 = route(moe, model.family, x, model.numerics, chosen=ids)
    assert np.array_equal(ids, ids2) and np.array_equal(w, w2)


BAD = {
    "bad JSON": ('{"tok": 1, "layers": [[1, 2]]}\n{"tok": 2, "layers": [[1, 2]\n', ":2", "not valid JSON"),
    "no layers": ('{"tok": 1, "layers": [[1, 2]]}\n{"tok": 2}\n', ":2", "layers"),
    "ragged layers": ('{"tok": 1, "layers": [[1, 2], [3, 4]]}\n{"tok": 2, "layers": [[1, 2]]}\n', ":2", "1 layers"),
    "float ids": ('{"tok": 1, "layers": [[1, 2.5]]}\n', ":1", "integer"),
    "string ids": ('{"tok": 1, "layers": [["1", 2]]}\n', ":1", "integer"),
    "negative ids": ('{"tok": 1, "layers": [[-1, 2]]}\n', ":1", "integer"),
    "empty layers": ('{"tok": 1, "layers": []}\n', ":1", "empty"),
    "empty file": ("\n\n", "", "no tokens"),
    "no ids at all": ('{"tok": 1, "layers": [[]]}\n', "", "no expert ids"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_a_malformed_trace_fails_the_load(case, qwen3moe, tmp_path):
    text, line, what = BAD[case]
    path = tmp_path / "bad.jsonl"
    path.write_text(text)
    with pytest.raises(ConfigError) as e:
        Engine.load(qwen3moe, routing_replay=str(path))
    msg = str(e.value)
    assert "MOE_ROUTING_REPLAY" in msg and f"{path}{line}" in msg and what in msg, msg


def test_a_missing_or_unreadable_trace_fails_the_load(qwen3moe, tmp_path, monkeypatch):
    missing = tmp_path / "nope.jsonl"
    monkeypatch.setenv("MOE_ROUTING_REPLAY", str(missing))
    with pytest.raises(ConfigError, match=f"MOE_ROUTING_REPLAY.*{re.escape(str(missing))}"):
        Engine.load(qwen3moe)
    bad_zst = tmp_path / "t.jsonl.zst"
    bad_zst.write_bytes(b"not zstd")
    with pytest.raises(ConfigError, match=f"{re.escape(str(bad_zst))}.*zstd"):
        Engine.load(qwen3moe, routing_replay=str(bad_zst))
    with pytest.raises(ConfigError, match=re.escape(str(tmp_path))):
        Engine.load(qwen3moe, routing_replay=str(tmp_path))  # a directory


def test_the_shared_traces_load(qwen3moe):
    from pathlib import Path

    root = Path(__file__).resolve().parents[2] / "benchmarks" / "data" / "traces"
    for name, k, e in (("olmoe-1b-7b_top8of64_299tok.jsonl", 8, 64), ("kimi-linear-48b_top8of256_300tok.jsonl", 8, 256)):
        with GGUFFile(qwen3moe) as g:
            replay = RoutingReplay.load(root / name, Transformer(g))
        assert replay.n_expert_trace == e and replay.n_tokens >= 299
        for table in replay.tables.values():
            assert table.shape == (replay.n_tokens, 2) and table.min() >= 0 and table.max() < 8
            assert all(len(set(row)) == 2 for row in table.tolist())


def test_replay_is_a_path_setting():
    from daemon.config import Settings

    assert "routing_replay" in Settings.path_settings()
    assert Settings.load({"MOE_ROUTING_REPLAY": "/x.jsonl"}).routing_replay == "/x.jsonl"


def test_a_failed_load_releases_the_file_and_the_cache(qwen3moe, tmp_path, monkeypatch):
    from daemon.storage.cache import ExpertCache
    from daemon.storage.gguf import GGUFFile as File

    closed = []
    for cls in (ExpertCache, File):
        monkeypatch.setattr(cls, "close", lambda self, _close=cls.close: (closed.append(type(self)), _close(self))[1])
    with pytest.raises(ConfigError):
        Engine.load(qwen3moe, device="cpu", routing_replay=str(tmp_path / "missing.jsonl"))
    assert ExpertCache in closed and File in closed


def test_auto_routing_does_not_predict_from_the_real_router_under_replay(qwen3moe, tmp_path):
    """Predictors read the model's own router; under replay their guesses would be wasted reads."""
    path = _write(tmp_path / "t.jsonl", _trace_records())
    with Engine.load(qwen3moe, routing_replay=str(path)) as engine:
        assert engine.routing == "exact"
    with Engine.load(qwen3moe, routing_replay=str(path), routing="speculative") as engine:
        assert engine.routing == "speculative"  # asked for explicitly: kept
    with Engine.load(qwen3moe, cpu_step="0") as engine:
        assert engine.routing == "speculative"  # no limit, no replay, op by op: as before


def test_auto_routing_is_exact_where_the_compiled_decode_step_serves(qwen3moe, fixture_dir):
    """The speculative hooks keep every step op by op, which lost to the compiled step (issue 28);
    a model the step does not serve (shared experts) keeps the prediction while the cache reads."""
    from tests.fixtures.build import fixture_path

    with Engine.load(qwen3moe) as engine:
        assert engine.routing == "exact"
    with Engine.load(fixture_path("qwen2moe", "Q8_0", fixture_dir)) as engine:
        assert engine.routing == "speculative"
    with Engine.load(qwen3moe, expert_cache_limit_mb=1) as engine:
        assert engine.routing == "exact"
