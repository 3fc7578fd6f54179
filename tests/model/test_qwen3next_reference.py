"""The tiny qwen3next fixtures (Gated DeltaNet + gated full attention + shared expert) load and
run in llama.cpp, the reference for issue 14. Only the reference side: moed does not run
qwen3next yet. docs/qwen3next.md describes what llama.cpp computes."""

from __future__ import annotations

import numpy as np
import pytest

import gguf

from tests.fixtures.build import fixture_config, fixture_path
from tests.fixtures.reference import LlamaReferenceError, reference_greedy, reference_logits

N_VOCAB = 512


def text_tokens(seed: int = 7, n: int = 48) -> list[int]:
    return np.random.default_rng(seed).integers(0, 509, n).tolist()  # 509.. are special tokens


def test_fixture_layer_mix_and_shapes(fixture_dir):
    """Layers 0-2 are delta-net layers, layer 3 gated full attention (interval 4); ggml ne
    order as in docs/qwen3next.md."""
    c = fixture_config("qwen3next")
    assert [c.is_recurrent(i) for i in range(c.n_layer)] == [True, True, True, False]
    r = gguf.GGUFReader(fixture_path("qwen3next", "Q8_0", fixture_dir))
    t = {x.name: x for x in r.tensors}
    D, Dk, Hk, Hv, Kc = c.n_embd, c.ssm_state_size, c.ssm_group_count, c.ssm_time_step_rank, c.ssm_conv_kernel
    C = 2 * Hk * Dk + Hv * Dk
    assert list(t["blk.0.attn_qkv.weight"].shape) == [D, C]
    assert list(t["blk.0.attn_gate.weight"].shape) == [D, Hv * Dk]
    assert list(t["blk.0.ssm_ba.weight"].shape) == [D, 2 * Hv]
    assert list(t["blk.0.ssm_conv1d.weight"].shape) == [Kc, C]
    assert t["blk.0.ssm_conv1d.weight"].tensor_type == gguf.GGMLQuantizationType.F32
    assert list(t["blk.0.ssm_out.weight"].shape) == [Hv * Dk, D]
    assert (np.asarray(t["blk.0.ssm_a"].data) < 0).all()  # -exp(A_log)
    assert list(t["blk.3.attn_q.weight"].shape) == [D, 2 * c.n_head * c.head_dim]  # query + gate
    assert "blk.3.attn_qkv.weight" not in t and "blk.0.attn_q.weight" not in t
    assert list(t["blk.1.ffn_gate_inp_shexp.weight"].shape) == [D]
    f = r.fields
    assert f["qwen3next.ssm.inner_size"].contents() == Hv * Dk
    assert f["qwen3next.full_attention_interval"].contents() == 4
    assert f["qwen3next.rope.dimension_count"].contents() == c.rope_dim < c.head_dim


@pytest.mark.parametrize("wtype", ["F32", "F16", "Q8_0", "Q4_K"])
def test_fixture_types(wtype, fixture_dir):
    """Matrices have the fixture's type; ssm_conv1d (asserted by llama.cpp), the router and every
    1-D tensor stay F32. The default widths (256-wide rows) let every matrix be a K-quant."""
    r = gguf.GGUFReader(fixture_path("qwen3next", wtype, fixture_dir))
    for t in r.tensors:
        f32 = len(t.shape) == 1 or "ssm_conv1d" in t.name or t.name.endswith("ffn_gate_inp.weight")
        assert t.tensor_type.name == ("F32" if f32 else wtype), t.name


@pytest.mark.llamacpp
@pytest.mark.parametrize("wtype", ["F32", "F16", "Q8_0", "Q4_K"])
def test_llama_cpp_runs_qwen3next(wtype, fixture_dir, needs_llamacpp):
    """llama.cpp accepts the file (it rejects files with tensors it did not ask for, so the
    layer kinds it derives from the metadata match ours) and gives finite, deterministic,
    non-degenerate logits."""
    path = fixture_path("qwen3next", wtype, fixture_dir)
    tokens = text_tokens()
    a = reference_logits(path, tokens)
    b = reference_logits(path, tokens)
    assert a.shape == (len(tokens), N_VOCAB) and a.dtype == np.float32
    assert np.isfinite(a).all()
    assert np.array_equal(a, b)
    assert a.std(axis=1).min() > 0.3
    assert len({int(i) for i in a.argmax(axis=1)}) > 4


@pytest.mark.llamacpp
@pytest.mark.parametrize(
    "overrides",
    [dict(full_attention_interval=2), dict(n_layer=5), dict(ssm_group_count=4)],
    ids=["interval2", "5layers", "Hk=Hv"],
)
def test_llama_cpp_runs_qwen3next_mixes(overrides, fixture_dir, needs_llamacpp):
    path = fixture_path("qwen3next", "Q8_0", fixture_dir, **overrides)
    logits = reference_logits(path, text_tokens(n=24))
    assert np.isfinite(logits).all() and logits.std(axis=1).min() > 0.3


@pytest.mark.llamacpp
def test_llama_cpp_rejects_all_attention_qwen3next(fixture_dir, needs_llamacpp):
    """full_attention_interval=1 leaves no recurrent layer; llama.cpp 0.3.36 aborts
    (GGML_ASSERT(buffer) allocating the empty recurrent cache) instead of running it."""
    path = fixture_path("qwen3next", "Q8_0", fixture_dir, full_attention_interval=1)
    with pytest.raises(LlamaReferenceError):
        reference_logits(path, text_tokens(n=8))


@pytest.mark.llamacpp
@pytest.mark.parametrize("arch", ["qwen3next", "qwen35moe"])
def test_llama_cpp_rejects_a_hybrid_without_attention_layer(arch, fixture_dir, needs_llamacpp):
    """n_layer < full_attention_interval leaves only recurrent layers; llama.cpp 0.3.36 aborts
    (GGML_ASSERT(buffer) allocating the empty KV cache), as for the all-attention case."""
    path = fixture_path(arch, "Q8_0", fixture_dir, n_layer=3)
    with pytest.raises(LlamaReferenceError, match=r"GGML_ASSERT\(buffer\)"):
        reference_logits(path, text_tokens(n=8))


@pytest.mark.llamacpp
@pytest.mark.parametrize("wtype,atol", [("Q8_0", 0.0), ("F32", 1e-4)])
def test_llama_cpp_decode_matches_prefill(wtype, atol, fixture_dir, needs_llamacpp):
    """Decoding one token per step (conv and recurrent state carried in llama.cpp's cache)
    agrees with one prefill over the same tokens: bit for bit with Q8_0 weights, to float
    rounding with F32 ones (the F32 mul_mat sums in another order for a batch)."""
    path = fixture_path("qwen3next", wtype, fixture_dir)
    prompt = text_tokens(seed=11, n=8)
    gen, step_logits = reference_greedy(path, prompt, 8, return_logits=True)
    full = reference_logits(path, prompt + gen[:-1])[len(prompt) - 1 :]
    np.testing.assert_allclose(step_logits, full, atol=atol, rtol=0)
    assert full.argmax(axis=1).tolist() == gen
