"""moed's logits and greedy tokens against llama.cpp on the same GGUF fixtures, per
architecture and quant type (default "ggml" numerics), bit for bit: every prompt row and every
decode step. F32 fixtures also against an independent float64 numpy forward pass."""

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
CASES = ([(a, t) for t in ("F32", "F16", "Q8_0", "Q4_K") for a in ARCHS]
         + [("gpt-oss", "MXFP4"), ("qwen3moe", "MXFP4")]
         + [("llama-moe", t) for t in ("BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q5_K", "Q6_K")]
         + [("qwen2moe", "Q6_K"), ("olmoe", "Q4_1"), ("qwen3moe", "Q5_0"), ("gpt-oss", "Q5_1"),
            ("gpt-oss", "BF16")])


def text_tokens(seed: int = 7, n: int = N_TOKENS) -> list[int]:
    return np.random.default_rng(seed).integers(0, 509, n).tolist()  # 509.. are special tokens


def moed_logits(path, tokens, numerics="ggml") -> np.ndarray:
    with GGUFFile(path) as g:
        model = Transformer(g, numerics=numerics)
        return model.forward(tokens, model.new_cache(len(tokens)), all_logits=True)


def rel_err(a, b) -> float:
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.mark.llamacpp
@pytest.mark.parametrize("arch,wtype", CASES)
def test_logits_bit_identical_to_llamacpp(arch, wtype, fixture_dir, needs_llamacpp):
    """Every row of a 64-token prefill, bit for bit."""
    path = fixture_path(arch, wtype, fixture_dir)
    tokens = text_tokens()
    ref = reference_logits(path, tokens)
    ours = moed_logits(path, tokens)
    assert ours.shape == ref.shape
    np.testing.assert_array_equal(ours, ref)


@pytest.mark.llamacpp
@pytest.mark.parametrize("arch,wtype", [(a, "Q8_0") for a in ARCHS] + [("qwen3moe", "Q4_K"), ("llama", "F16")])
def test_greedy_tokens_identical_to_llamacpp(arch, wtype, fixture_dir, needs_llamacpp):
    """A prompt, then 32 one-token decode steps as a generation runs them (the last row only):
    the same tokens from the same logits, bit for bit. llama.cpp is asked for the last row only
    too (logits_all=False); with every row, its output matmul for the prompt would take the
    many-row K-quant / tinyBLAS path and the prompt's last row would differ in the last bits."""
    path = fixture_path(arch, wtype, fixture_dir)
    prompt = text_tokens(seed=11, n=8)
    ref_tokens, ref_logits = reference_greedy(path, prompt, 32, return_logits=True, logits_all=False)
    with GGUFFile(path) as g:
        model = Transformer(g)
        cache = model.new_cache(64)
        logits = model.forward(prompt, cache)[-1]
        ours, rows = [], []
        for _ in range(32):
            rows.append(logits)
            ours.append(int(np.argmax(logits)))
            logits = model.forward([ours[-1]], cache)[-1]
    assert ours == list(ref_tokens)
    np.testing.assert_array_equal(np.stack(rows), np.asarray(ref_logits))


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
