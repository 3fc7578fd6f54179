"""RoutingRecorder: one record per token with the ids the trace hook saw, in both file formats."""

import json

import numpy as np
import pytest
import zstandard

from daemon.model.transformer import Transformer
from daemon.routing.replay import load_trace
from daemon.routing.trace import RoutingRecorder
from daemon.storage.gguf import GGUFFile
from tests.fixtures.build import fixture_path


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = fixture_path("qwen3moe", "Q8_0", tmp_path_factory.mktemp("fx"))
    return Transformer(GGUFFile(path))


def test_records_per_token(model, tmp_path):
    seen = []
    model.trace = lambda layer, ids: seen.append((layer, np.array(ids)))  # an existing hook is chained
    rec = RoutingRecorder().attach(model)
    try:
        cache = model.new_cache(16)
        model.forward([1, 2, 3], cache, all_logits=True)  # prefill: 3 tokens, every layer sees 3 rows
        model.forward([4], cache)
        model.forward([5, 6], cache)  # last layer runs on the output row only
    finally:
        rec.detach()
    assert model.trace is not rec and callable(model.trace)
    n_moe = sum(1 for layer in model.layers if type(layer.ffn).__name__ == "MoE")
    assert rec.moe_layers == [0, 1] and n_moe == 2
    assert len(rec.records) == 6
    assert all(len(r) == n_moe for r in rec.records)
    # the ids the hook saw, regrouped per token, in top-k order
    steps = [seen[0:2], seen[2:4], seen[4:6]]
    expect = []
    for step, T in zip(steps, (3, 1, 2)):
        for t in range(T):
            rows = []
            for layer, ids in step:
                r = t - (T - ids.shape[0])
                rows.append(ids[r].tolist() if r >= 0 else [])
            expect.append(rows)
    assert rec.records == expect
    assert rec.records[4][1] == [] and len(rec.records[5][1]) == model.hp.n_expert_used
    for path in (tmp_path / "r.jsonl", tmp_path / "r.jsonl.zst"):
        assert rec.write(path) == 6
        text = (zstandard.ZstdDecompressor().stream_reader(open(path, "rb")).read().decode()
                if path.suffix == ".zst" else path.read_text())
        lines = [json.loads(ln) for ln in text.splitlines()]
        assert [ln["tok"] for ln in lines] == [1, 2, 3, 4, 5, 6]
        assert [ln["layers"] for ln in lines] == expect
        tr = load_trace(path)
        assert len(tr) == n_moe and len(tr[0]) == 6
        assert tr[0][3] == frozenset(expect[3][0])


def test_hook_without_model():
    rec = RoutingRecorder()
    rec(0, np.array([[3, 1], [2, 0]]))
    rec(2, np.array([[5, 4], [1, 7]]))
    rec(0, np.array([[1, 2]]))  # a new step
    rec.flush()
    assert rec.records == [[[3, 1], [5, 4]], [[2, 0], [1, 7]], [[1, 2], []]]
