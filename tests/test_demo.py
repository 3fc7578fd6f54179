"""The demo MoE built from SmolLM2-135M-Instruct: structure, equivalence with the dense model at
k = E, and logits against llama.cpp on the MoE file (it is a llama-with-experts GGUF)."""

from __future__ import annotations

import numpy as np
import pytest

from daemon import Engine
from daemon.demo import _assign_balanced, balanced_kmeans, build_demo_model, find_source_model, fit_router
from daemon.storage.gguf import GGUFFile
from tests.fixtures.reference import reference_greedy, reference_logits

TEXT = ("The history of the printing press begins in the fifteenth century, when Johannes Gutenberg "
        "combined movable metal type with an oil-based ink and a wooden press. Within decades, "
        "printers across Europe were producing books faster and more cheaply than ever before.")


def test_balanced_assignment_fills_every_cluster_exactly():
    sim = np.random.default_rng(0).normal(size=(48, 6))
    labels = _assign_balanced(sim, 8)
    assert np.bincount(labels, minlength=6).tolist() == [8] * 6


def test_balanced_kmeans_recovers_planted_groups():
    rng = np.random.default_rng(1)
    centers = rng.normal(size=(4, 50)) * 5
    truth = np.repeat(np.arange(4), 10)
    feats = centers[truth] + rng.normal(size=(40, 50))
    labels = balanced_kmeans(feats, 4)
    assert np.bincount(labels).tolist() == [10] * 4
    for c in range(4):  # each found cluster is exactly one planted group
        assert len(set(truth[labels == c])) == 1


def test_fit_router_recovers_linear_map():
    rng = np.random.default_rng(2)
    x = rng.normal(size=(500, 8))
    w = rng.normal(size=(3, 8))
    assert np.allclose(fit_router(x, x @ w.T, ridge=1e-8), w, atol=1e-5)


@pytest.fixture(scope="module")
def demo_models(smollm2, tmp_path_factory):
    """E=16 with k=16 (must equal the dense model) and k=12 (the default demo), built on a
    smaller calibration set than `moed demo-model` uses, to keep the test short."""
    out = tmp_path_factory.mktemp("demo")
    assert find_source_model() == smollm2
    full = build_demo_model(smollm2, out / "e16k16.gguf", 16, 16, n_prompts=3, n_new=32)
    k12 = build_demo_model(smollm2, out / "e16k12.gguf", 16, 12, n_prompts=3, n_new=32)
    return full, k12


def test_demo_file_is_an_moe(demo_models):
    with GGUFFile(demo_models[1]) as g:
        assert g.get("llama.expert_count", int) == 16
        assert g.get("llama.expert_used_count", int) == 12
        assert g.get("llama.feed_forward_length", int) == 1536 // 16
        assert g.tensor_info("blk.0.ffn_gate_exps.weight").shape == (16, 96, 576)
        assert g.tensor_info("blk.0.ffn_down_exps.weight").shape == (16, 576, 96)
        assert "blk.0.ffn_gate.weight" not in g.tensors
        assert "tokenizer.chat_template" in g.metadata


def test_all_experts_reproduce_the_dense_model(demo_models, smollm2):
    """k = E: every neuron is used with weight ~1/k times its k-scaled down projection."""
    with Engine.load(smollm2, numerics="float32") as dense, Engine.load(demo_models[0], numerics="float32") as moe:
        ids = dense.tokenize(TEXT)
        a, b = dense.forward(ids), moe.forward(ids)
    agreement = (a.argmax(1) == b.argmax(1)).mean()
    assert agreement >= 0.9


def test_top12_of_16_keeps_most_predictions(demo_models, smollm2):
    with Engine.load(smollm2) as dense, Engine.load(demo_models[1]) as moe:
        ids = dense.tokenize(TEXT)
        agreement = (dense.forward(ids).argmax(1) == moe.forward(ids).argmax(1)).mean()
    assert agreement >= 0.5


@pytest.mark.llamacpp
def test_demo_logits_identical_to_llamacpp(demo_models, needs_llamacpp):
    """Every prompt row, then 16 greedy decode steps (each step's last row only, as a
    generation computes it, in both), bit for bit."""
    path = demo_models[1]
    with Engine.load(path) as e:
        ids = e.tokenize(TEXT)[:64]
        ours = e.forward(ids)
        model = e.model
        cache = model.new_cache(len(ids) + 16)
        logits = model.forward(ids, cache)[-1]
        tokens, rows = [], []
        for _ in range(16):
            rows.append(logits)
            tokens.append(int(np.argmax(logits)))
            logits = model.forward([tokens[-1]], cache)[-1]
    np.testing.assert_array_equal(ours, reference_logits(path, ids))
    ref_tokens, ref_rows = reference_greedy(path, ids, 16, return_logits=True, logits_all=False)
    assert tokens == ref_tokens
    np.testing.assert_array_equal(np.stack(rows), ref_rows)
