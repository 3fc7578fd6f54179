"""The tiny qwen35moe (Qwen3.5 MoE) fixtures load and run in llama.cpp, the reference for issue 14,
and llama.cpp computes on them what docs/qwen3next.md says: the qwen3next function with split
b/a projections, tiled value heads and IMRoPE.

A qwen35moe fixture is the qwen3next fixture of the same seed laid out as Qwen3.5's converter
lays it out (tests/fixtures/build.py), so the two files must give the same logits; with one key
head per value head (no reordering) bit for bit, which pins IMRoPE == NEOX on text tokens."""

from __future__ import annotations

import numpy as np
import pytest

import gguf

from tests.fixtures.build import fixture_config, fixture_path, tiled_order
from tests.fixtures.reference import reference_greedy, reference_logits

N_VOCAB = 512


def text_tokens(seed: int = 7, n: int = 48) -> list[int]:
    return np.random.default_rng(seed).integers(0, 509, n).tolist()  # 509.. are special tokens


def _tensors(path) -> dict[str, gguf.ReaderTensor]:
    return {t.name: t for t in gguf.GGUFReader(path).tensors}


def test_fixture_layer_mix_shapes_and_metadata(fixture_dir):
    c = fixture_config("qwen35moe")
    assert [c.is_recurrent(i) for i in range(c.n_layer)] == [True, True, True, False]
    assert c.ssm_time_step_rank > c.ssm_group_count  # the head pairing matters
    path = fixture_path("qwen35moe", "Q8_0", fixture_dir)
    r = gguf.GGUFReader(path)
    t = {x.name: x for x in r.tensors}
    D, Dk, Hk, Hv, Kc = c.n_embd, c.ssm_state_size, c.ssm_group_count, c.ssm_time_step_rank, c.ssm_conv_kernel
    C = 2 * Hk * Dk + Hv * Dk
    assert list(t["blk.0.attn_qkv.weight"].shape) == [D, C]
    assert list(t["blk.0.attn_gate.weight"].shape) == [D, Hv * Dk]
    assert list(t["blk.0.ssm_beta.weight"].shape) == [D, Hv]
    assert list(t["blk.0.ssm_alpha.weight"].shape) == [D, Hv]
    assert "blk.0.ssm_ba.weight" not in t
    assert list(t["blk.0.ssm_conv1d.weight"].shape) == [Kc, C]
    assert t["blk.0.ssm_conv1d.weight"].tensor_type == gguf.GGMLQuantizationType.F32
    assert list(t["blk.0.ssm_norm.weight"].shape) == [Dk]
    assert (np.asarray(t["blk.0.ssm_a"].data) < 0).all()  # -exp(A_log)
    assert list(t["blk.3.attn_q.weight"].shape) == [D, 2 * c.n_head * c.head_dim]  # query + gate
    assert "blk.3.attn_qkv.weight" not in t and "blk.0.attn_q.weight" not in t
    f = r.fields
    assert f["general.architecture"].contents() == "qwen35moe"
    assert f["qwen35moe.rope.dimension_sections"].contents() == [3, 3, 2, 0]
    assert sum(c.rope_sections) == c.rope_dim // 2  # as the converter's [11, 11, 10, 0] for 64 dims
    assert f["qwen35moe.ssm.inner_size"].contents() == Hv * Dk
    assert f["qwen35moe.expert_shared_feed_forward_length"].contents() == c.n_ff_shexp


def test_fixture_is_qwen3next_with_tiled_value_heads(fixture_dir):
    """The float weights are qwen3next's: b/a split out of ssm_ba (grouped per key head) and
    value head n of the file is qwen3next's value head perm[n] (key head n % Hk)."""
    c = fixture_config("qwen35moe")
    Dk, Hk, Hv, D = c.ssm_state_size, c.ssm_group_count, c.ssm_time_step_rank, c.n_embd
    r, Kd = Hv // Hk, Hk * Dk
    perm = tiled_order(Hk, Hv)
    assert perm.tolist() == [0, 2, 1, 3]  # Hk=2, Hv=4: [k0_v0, k1_v1, k0_v2, k1_v3] in llama.cpp's notation
    assert ((perm // r) == np.arange(Hv) % Hk).all()
    nxt = _tensors(fixture_path("qwen3next", "F32", fixture_dir))
    q35 = _tensors(fixture_path("qwen35moe", "F32", fixture_dir))

    def a(ts, name):
        return np.asarray(ts[name].data)

    ba = a(nxt, "blk.1.ssm_ba.weight").reshape(Hk, 2, r, D)
    np.testing.assert_array_equal(a(q35, "blk.1.ssm_beta.weight"), ba[:, 0].reshape(Hv, D)[perm])
    np.testing.assert_array_equal(a(q35, "blk.1.ssm_alpha.weight"), ba[:, 1].reshape(Hv, D)[perm])
    for name in ("ssm_dt.bias", "ssm_a"):
        np.testing.assert_array_equal(a(q35, f"blk.1.{name}"), a(nxt, f"blk.1.{name}")[perm])
    heads = lambda x: x.reshape(Hv, Dk, -1)[perm].reshape(x.shape)  # noqa: E731
    qkv_n, qkv_q = a(nxt, "blk.1.attn_qkv.weight"), a(q35, "blk.1.attn_qkv.weight")
    np.testing.assert_array_equal(qkv_q[: 2 * Kd], qkv_n[: 2 * Kd])  # q and k are not reordered
    np.testing.assert_array_equal(qkv_q[2 * Kd :], heads(qkv_n[2 * Kd :]))
    np.testing.assert_array_equal(a(q35, "blk.1.attn_gate.weight"), heads(a(nxt, "blk.1.attn_gate.weight")))
    conv_n, conv_q = a(nxt, "blk.1.ssm_conv1d.weight"), a(q35, "blk.1.ssm_conv1d.weight")
    np.testing.assert_array_equal(conv_q[2 * Kd :], heads(conv_n[2 * Kd :]))
    out_n = a(nxt, "blk.1.ssm_out.weight").reshape(D, Hv, Dk)
    np.testing.assert_array_equal(a(q35, "blk.1.ssm_out.weight"), out_n[:, perm].reshape(D, Hv * Dk))
    for name in ("blk.3.attn_q.weight", "blk.2.ffn_up_exps.weight", "blk.0.ssm_norm.weight", "output.weight"):
        np.testing.assert_array_equal(a(q35, name), a(nxt, name))


@pytest.mark.parametrize("wtype", ["F32", "F16", "Q8_0", "Q4_K"])
def test_fixture_types(wtype, fixture_dir):
    r = gguf.GGUFReader(fixture_path("qwen35moe", wtype, fixture_dir))
    for t in r.tensors:
        f32 = len(t.shape) == 1 or "ssm_conv1d" in t.name or t.name.endswith("ffn_gate_inp.weight")
        assert t.tensor_type.name == ("F32" if f32 else wtype), t.name


@pytest.mark.parametrize("bad", [(4, 4), (0, 0, 0, 8), (3, 3, 2, -1), (40, 40, 0, 0)])
def test_bad_sections_are_rejected(bad):
    with pytest.raises(ValueError, match="rope_sections"):
        fixture_config("qwen35moe", rope_sections=bad)
    with pytest.raises(ValueError, match="qwen35moe"):
        fixture_config("qwen3next", rope_sections=(3, 3, 2, 0))


# ---------------------------------------------------------------------------- llama.cpp


@pytest.mark.llamacpp
@pytest.mark.parametrize("wtype", ["F32", "F16", "Q8_0", "Q4_K"])
def test_llama_cpp_runs_qwen35moe(wtype, fixture_dir, needs_llamacpp):
    """llama.cpp accepts the file (it rejects unexpected tensors, so its layer kinds match
    ours) and gives finite, deterministic, non-degenerate logits."""
    path = fixture_path("qwen35moe", wtype, fixture_dir)
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
def test_llama_cpp_runs_qwen35moe_mixes(overrides, fixture_dir, needs_llamacpp):
    path = fixture_path("qwen35moe", "Q8_0", fixture_dir, **overrides)
    logits = reference_logits(path, text_tokens(n=24))
    assert np.isfinite(logits).all() and logits.std(axis=1).min() > 0.3


@pytest.mark.llamacpp
@pytest.mark.parametrize("wtype,atol", [("Q8_0", 0.0), ("F32", 1e-4)])
def test_llama_cpp_decode_matches_prefill(wtype, atol, fixture_dir, needs_llamacpp):
    """One token per step (conv and recurrent state in llama.cpp's cache) agrees with one
    prefill: bit for bit with Q8_0 weights, to float rounding with F32 ones."""
    path = fixture_path("qwen35moe", wtype, fixture_dir)
    prompt = text_tokens(seed=11, n=8)
    gen, step_logits = reference_greedy(path, prompt, 8, return_logits=True)
    full = reference_logits(path, prompt + gen[:-1])[len(prompt) - 1 :]
    np.testing.assert_allclose(step_logits, full, atol=atol, rtol=0)
    assert full.argmax(axis=1).tolist() == gen


@pytest.mark.llamacpp
@pytest.mark.parametrize("wtype", ["F32", "Q8_0"])
def test_llama_cpp_qwen35moe_equals_qwen3next_one_key_head_per_value_head(wtype, fixture_dir, needs_llamacpp):
    """Hk == Hv: no value-head reordering, so the two files hold the same weights apart from
    ssm_ba vs ssm_beta/ssm_alpha, and llama.cpp gives bit-identical logits: IMRoPE with the
    sections [3, 3, 2, 0] (text: positions t = h = w = pos) rotates exactly as qwen3next's NEOX
    RoPE with n_rot = rope_dim, and the split b/a projections are qwen3next's grouped ones."""
    tokens = text_tokens()
    a = reference_logits(fixture_path("qwen3next", wtype, fixture_dir, ssm_group_count=4), tokens)
    b = reference_logits(fixture_path("qwen35moe", wtype, fixture_dir, ssm_group_count=4), tokens)
    assert np.array_equal(a, b)


@pytest.mark.llamacpp
def test_llama_cpp_qwen35moe_tiled_heads_equal_qwen3next_grouped_ones(fixture_dir, needs_llamacpp):
    """Hv = 2 Hk: llama.cpp pairs qwen35moe's value head n with key head n % Hk and qwen3next's
    value head h with key head h // 2, and the files' value heads are reordered accordingly.
    The only difference left is the order of ssm_out's sum over heads: with Q4_K weights and
    one 256-block per row (integer sums within a block) the logits are bit-identical; with F32
    they agree to rounding. (A grouped pairing for qwen35moe would be far off.)"""
    tokens = text_tokens()
    a = reference_logits(fixture_path("qwen3next", "Q4_K", fixture_dir), tokens)
    b = reference_logits(fixture_path("qwen35moe", "Q4_K", fixture_dir), tokens)
    assert np.array_equal(a, b)
    a = reference_logits(fixture_path("qwen3next", "F32", fixture_dir), tokens)
    b = reference_logits(fixture_path("qwen35moe", "F32", fixture_dir), tokens)
    np.testing.assert_allclose(a, b, atol=2e-3, rtol=0)
    assert (a.argmax(axis=1) == b.argmax(axis=1)).all()


@pytest.mark.llamacpp
def test_llama_cpp_imrope_rotates_the_pairs_the_sections_give_t_h_w(fixture_dir, needs_llamacpp):
    """For text, llama.cpp sets the t, h and w positions to the token's position and the fourth
    (e) to 0 (llm_graph_input_pos::set_input). ggml's IMRoPE gives rotated pair i (i < rope_dim/2)
    section s = i % sum(sections): t if s % 3 == 0 and s < 3*S0, h if s % 3 == 1 and s < 3*S1,
    w if s % 3 == 2 and s < 3*S2, else e, which rotates by position 0 (not at all).
    So the logits depend on the sections only through the set of pairs that land in t, h or w:
    every covering choice (the converter's [11, 11, 10, 0] among them) equals NEOX, and choices
    that rotate the same pairs give the same logits."""
    tokens = text_tokens(n=24)

    def run(sections):
        return reference_logits(
            fixture_path("qwen35moe", "Q8_0", fixture_dir, ssm_group_count=4, rope_sections=sections), tokens)

    neox = reference_logits(fixture_path("qwen3next", "Q8_0", fixture_dir, ssm_group_count=4), tokens)
    for covering in [(3, 3, 2, 0), (11, 11, 10, 0), (1, 1, 1, 0), (2, 2, 1, 0)]:
        assert np.array_equal(run(covering), neox), covering
    only_t = run((8, 0, 0, 0))  # pairs 0, 3, 6 rotate; the others are in e
    assert np.abs(only_t - neox).max() > 0.1
    for same_pairs in [(3, 0, 0, 5), (1, 0, 0, 2)]:
        assert np.array_equal(run(same_pairs), only_t), same_pairs
    assert np.abs(run((2, 2, 2, 2)) - neox).max() > 0  # pairs 6 and 7 fall in e
