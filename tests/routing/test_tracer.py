"""ExpertUsageTracer on the qwen3moe fixture: counts equal the routing decisions, names lines name
real tensors, JSON output (plain and .zst), settings and hook chaining."""

import io
import json
import re
from types import SimpleNamespace

import numpy as np
import pytest
import zstandard

from daemon.config import Settings
from daemon.model.transformer import Transformer
from daemon.routing.tracer import ExpertUsageTracer
from daemon.storage.gguf import GGUFFile
from tests.fixtures.build import fixture_path


@pytest.fixture(scope="module")
def gguf(fixture_dir):
    return GGUFFile(fixture_path("qwen3moe", "Q8_0", fixture_dir))


@pytest.fixture()
def model(gguf):
    return Transformer(gguf)


def run(model, tracer):
    """Four passes (prefill with all_logits, decode, a 3-token prefill whose last layer routes only
    the output row, decode); returns what an independent hook chained under the tracer saw."""
    seen = []
    model.trace = lambda layer, ids: seen.append((layer, np.array(ids)))
    tracer.attach(model)
    try:
        cache = model.new_cache(32)
        model.forward([1, 2, 3, 4], cache, all_logits=True)
        model.forward([5], cache)
        model.forward([6, 7, 8], cache)
        model.forward([9], cache)
    finally:
        tracer.detach()
    return seen


def expected_counts(seen, n_expert):
    out = {}
    for layer, ids in seen:
        out[layer] = out.get(layer, 0) + np.bincount(ids.ravel(), minlength=n_expert)
    return out


def test_counts_equal_routing(model):
    log = io.StringIO()
    tr = ExpertUsageTracer(stats=True, per_layer=True, log=log)
    seen = run(model, tr)
    hp = model.hp
    assert tr.moe_layers == [0, 1]
    assert [layer for layer, _ in seen] == [0, 1] * 4
    assert [ids.shape[0] for _, ids in seen] == [4, 4, 1, 1, 3, 1, 1, 1]  # last layer: output row only
    expect = expected_counts(seen, hp.n_expert)
    d = tr.as_dict()
    assert json.loads(json.dumps(d)) == d
    assert d["total_tokens"] == 9 and d["forward_passes"] == 4
    assert d["n_expert"] == hp.n_expert and d["n_expert_used"] == hp.n_expert_used
    assert d["moe_layers"] == [0, 1]
    for layer in (0, 1):
        assert d["per_expert"][str(layer)] == expect[layer].tolist()
        assert d["per_layer"][str(layer)] == int(expect[layer].sum())
    assert d["per_layer"] == {"0": 9 * hp.n_expert_used, "1": 7 * hp.n_expert_used}
    assert d["per_layer_tokens"] == {"0": 9, "1": 7}
    assert d["activations"] == 16 * hp.n_expert_used
    top = d["top_experts"][0]
    assert top["count"] == max(int(c.max()) for c in expect.values())
    assert expect[top["layer"]][top["expert"]] == top["count"]
    for layer in (0, 1):
        s = d["skew"][str(layer)]
        c = expect[layer]
        assert s["unused"] == int((c == 0).sum())
        assert s["max_over_mean"] == pytest.approx(c.max() / c.mean(), abs=1e-3)
        assert 0.0 <= s["entropy"] <= 1.0

    tr.report()
    text = log.getvalue()
    assert text.startswith("expert usage: 9 tokens in 4 forward passes, 2 MoE layers x 8 experts")
    for layer in (0, 1):
        assert f"  blk.{layer}: {int(expect[layer].sum())} activations" in text
        assert "    counts: " + " ".join(map(str, expect[layer].tolist())) in text
    # without per_layer: the overall lines only
    assert "blk.0:" not in ExpertUsageTracer(stats=True).summary()


def test_names_lines(model, gguf):
    log = io.StringIO()
    tr = ExpertUsageTracer(names=True, log=log)
    seen = run(model, tr)
    lines = log.getvalue().splitlines()
    assert len(lines) == sum(ids.size for _, ids in seen) == tr.as_dict()["activations"]
    pat = re.compile(r"tok (\d+) blk\.(\d+) expert (\d+): (.+)")
    got = []
    for line in lines:
        m = pat.fullmatch(line)
        assert m, line
        tok, layer, e = int(m[1]), int(m[2]), int(m[3])
        got.append((tok, layer, e))
        names = m[4].split(" ")
        assert [n.split("[")[0] for n in names] == [f"blk.{layer}.ffn_{w}_exps.weight" for w in ("gate", "up", "down")]
        for n in names:
            tensor, sl = re.fullmatch(r"(.+)\[(\d+)\]", n).groups()
            assert tensor in gguf.tensors and int(sl) == e
            assert int(sl) < gguf.tensors[tensor].shape[-1]  # the expert dimension is the outermost
    # the same uses, in order; rows of the last layer are the pass's last tokens
    firsts = {0: 0, 2: 4, 4: 5, 6: 8}  # index in `seen` of each pass's first call -> its first token
    want = []
    for i, (layer, ids) in enumerate(seen):
        start = firsts[i - i % 2]
        T = seen[i - i % 2][1].shape[0]
        for r in range(ids.shape[0]):
            want += [(start + T - ids.shape[0] + r, layer, int(e)) for e in ids[r]]
    assert got == want
    assert {t for t, _, _ in got} == set(range(9))


def test_write_json(model, tmp_path):
    tr = ExpertUsageTracer(output=str(tmp_path / "usage.json"))
    assert tr.write() == str(tmp_path / "usage.json")  # before any routing: valid, all zeros
    assert json.loads((tmp_path / "usage.json").read_text())["total_tokens"] == 0
    seen = run(model, tr)
    expect = expected_counts(seen, model.hp.n_expert)
    for path in (tmp_path / "usage.json", tmp_path / "usage.json.zst"):
        tr.write(path)
        raw = path.read_bytes()
        if path.suffix == ".zst":
            raw = zstandard.ZstdDecompressor().stream_reader(io.BytesIO(raw)).read()
        d = json.loads(raw)
        assert d == tr.as_dict()
        assert d["total_tokens"] == 9 and d["n_expert"] == model.hp.n_expert and d["moe_layers"] == [0, 1]
        assert d["per_expert"] == {str(k): v.tolist() for k, v in expect.items()}
        assert d["per_layer"] == {str(k): int(v.sum()) for k, v in expect.items()}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["usage.json", "usage.json.zst"]  # no temp left
    assert ExpertUsageTracer().write() is None  # no output configured


def test_from_settings():
    assert ExpertUsageTracer.from_settings(Settings()) is None
    base = {"expert_trace_stats": False, "expert_trace_names": False, "expert_trace_per_layer": False,
            "expert_trace_output": ""}
    assert ExpertUsageTracer.from_settings(SimpleNamespace(**base)) is None
    tr = ExpertUsageTracer.from_settings(SimpleNamespace(**{**base, "expert_trace_output": "x.json.zst"}))
    assert tr is not None and tr.output == "x.json.zst" and not (tr.stats or tr.names or tr.per_layer)
    for key in ("expert_trace_stats", "expert_trace_names", "expert_trace_per_layer"):
        tr = ExpertUsageTracer.from_settings(SimpleNamespace(**{**base, key: True}))
        assert tr is not None and getattr(tr, key.removeprefix("expert_trace_"))


def test_detach_restores_previous_hook(model):
    assert model.trace is None
    tr = ExpertUsageTracer(stats=True).attach(model)
    assert model.trace is tr
    tr.detach()
    assert model.trace is None
    def prev(layer, ids):
        pass

    model.trace = prev
    tr2 = ExpertUsageTracer().attach(model)
    tr2.detach()
    assert model.trace is prev
    tr2.detach()  # twice is harmless
    assert model.trace is prev


def test_hook_without_model():
    tr = ExpertUsageTracer()
    tr(0, np.array([[3, 1], [2, 0]]))
    tr(2, np.array([[5, 4]]))
    tr(0, np.array([[1, 2]]))  # a new pass
    d = tr.as_dict()
    assert d["total_tokens"] == 3 and d["forward_passes"] == 2 and d["n_expert"] == 6
    assert d["per_expert"] == {"0": [1, 2, 2, 1, 0, 0], "2": [0, 0, 0, 0, 1, 1]}
    assert d["moe_layers"] == [0, 2] and d["n_expert_used"] is None



def test_reset_forgets_the_counts_so_far(model):
    """The daemon's warm-up pass at load calls engine.reset_stats(): it must not count as use."""
    tracer = ExpertUsageTracer(stats=True)
    run(model, tracer)
    assert tracer.forward_passes == 4
    tracer.reset()
    assert tracer.forward_passes == 0 and tracer.total_tokens == 0
    assert all(not c.any() for c in tracer.counts.values())
    seen = []
    model.trace = lambda layer, ids: seen.append((layer, np.array(ids)))
    tracer.attach(model)  # counts only what comes after the reset
    try:
        model.forward([5, 6], model.new_cache(8))
    finally:
        tracer.detach()
    assert tracer.forward_passes == 1 and tracer.total_tokens == 2
    want = expected_counts(seen, model.hp.n_expert)
    for layer, counts in tracer.counts.items():
        np.testing.assert_array_equal(counts, want[layer])
