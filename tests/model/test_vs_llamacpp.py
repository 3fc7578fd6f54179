"""moed's logits and greedy tokens against llama.cpp on the same GGUF fixtures, per
architecture and quant type (default "ggml" numerics), and F32 fixtures against an independent
float64 numpy forward pass (llama-cpp-python 0.3.36 is not used for all-F32 MoE files)."""

from __future__ import annotations

import numpy as np
import pytest

from daemon.model.transformer import Transformer
from daemon.storage.gguf import GGUFFile
from tests.fixtures.build import fixture_path
from tests.fixtures.reference import reference_greedy, reference_logits
from tests.model.reference_numpy import Reference

ARCHS = ["llama", "llama-moe", "qwen3moe", "qwen2moe", "olmoe", "gpt-oss"]
N_TOKENS = 64
CASES = ([(a, "F16") for a in ARCHS] + [(a, "Q8_0") for a in ARCHS] + [(a, "Q4_K") for a in ARCHS]
         + [("gpt-oss", "MXFP4"), ("qwen3moe", "MXFP4")]
         + [("llama-moe", t) for t in ("Q4_0", "Q4_1", "Q5_K", "Q6_K")]
         + [("qwen2moe", "Q6_K"), ("olmoe", "Q4_1")])


def text_tokens(seed: int = 7, n: int = N_TOKENS) -> list[int]:
    return np.random.default_rng(seed).integers(0, 509, n).tolist()  # 509.. are special tokens


def moed_logits(path, tokens, numerics="ggml") -> np.ndarray:
    with GGUFFile(path) as g:
        model = Transformer(g, numerics=numerics)
        return model.forward(tokens, model.new_cache(len(tokens)), all_logits=True)


def rel_err(a, b) -> float:
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def top_token_agreement(ours: np.ndarray, ref: np.ndarray, tol: float = 0.01) -> float:
    """Fraction of positions where the reference's logit at our top token is within tol of its max."""
    top = ours.argmax(axis=1)
    return float((ref.max(axis=1) - ref[np.arange(len(ref)), top] <= tol).mean())


@pytest.mark.llamacpp
@pytest.mark.parametrize("arch,wtype", CASES)
def test_logits_match_llamacpp(arch, wtype, fixture_dir, needs_llamacpp):
    path = fixture_path(arch, wtype, fixture_dir)
    tokens = text_tokens()
    ref = reference_logits(path, tokens)
    ours = moed_logits(path, tokens)
    assert ours.shape == ref.shape
    limit = 1e-2 if wtype == "F16" else 5e-2
    assert rel_err(ours, ref) < limit
    assert top_token_agreement(ours, ref) >= 0.98


@pytest.mark.llamacpp
@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_tokens_match_llamacpp(arch, fixture_dir, needs_llamacpp):
    """32 greedy tokens, compared up to the first step where llama.cpp's own top-2 margin is a
    near-tie (< 1e-3), after which either choice is right."""
    path = fixture_path(arch, "Q8_0", fixture_dir)
    prompt = text_tokens(seed=11, n=8)
    ref_tokens, ref_logits = reference_greedy(path, prompt, 32, return_logits=True)
    with GGUFFile(path) as g:
        model = Transformer(g)
        cache = model.new_cache(64)
        logits = model.forward(prompt, cache)[-1]
        ours = []
        for _ in range(32):
            ours.append(int(np.argmax(logits)))
            logits = model.forward([ours[-1]], cache)[-1]
    ref_logits = np.asarray(ref_logits)
    n = 32
    for i, row in enumerate(ref_logits[-32:]):
        top2 = np.sort(row)[-2:]
        if top2[1] - top2[0] < 1e-3:
            n = i + 1
            break
    assert n >= 8, "fixture logits are near-ties too early to compare"
    assert ours[:n] == list(ref_tokens)[:n]


@pytest.mark.parametrize("arch", ARCHS)
def test_f32_fixture_matches_float64_reference(arch, fixture_dir):
    path = fixture_path(arch, "F32", fixture_dir)
    tokens = text_tokens(n=24)
    ref = Reference(path).logits(tokens)
    # F32 weights: no activation quantization in either mode, but "ggml" keeps the KV cache,
    # the queries and the attention weights in f16 as llama.cpp does.
    for numerics, limit in (("float32", 1e-4), ("ggml", 2e-3)):
        ours = moed_logits(path, tokens, numerics)
        assert rel_err(ours, ref) < limit, numerics
        assert (ours.argmax(1) == ref.argmax(1)).mean() >= 0.98
