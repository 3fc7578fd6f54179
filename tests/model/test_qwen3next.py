"""moed's qwen3next / qwen35moe (Gated DeltaNet hybrids) against llama.cpp on the tiny fixtures:
bit-identical logits and greedy tokens on the CPU ("ggml" numerics), several layer mixes, the
per-sequence state across split prefills and mixed batches, and metadata that cannot be run."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGUFValueType as VT

from daemon.errors import GGUFError
from daemon.model.transformer import Transformer
from daemon.storage.gguf import GGUFFile
from tests.fixtures.build import HYBRID_ARCHS, fixture_path
from tests.fixtures.reference import reference_greedy, reference_logits
from tests.storage.rewrite import rewrite_gguf

ARCHS = [a for a in ("qwen3next", "qwen35moe") if a in HYBRID_ARCHS]


def text_tokens(seed: int = 7, n: int = 48) -> list[int]:
    return np.random.default_rng(seed).integers(0, 509, n).tolist()  # 509.. are special tokens


def moed_logits(path, tokens) -> np.ndarray:
    with GGUFFile(path) as g:
        model = Transformer(g)
        return model.forward(tokens, model.new_cache(len(tokens)), all_logits=True)


@pytest.mark.llamacpp
@pytest.mark.parametrize("arch,wtype", [(a, w) for a in ARCHS for w in ("F32", "F16", "Q8_0", "Q4_K")])
def test_logits_bit_identical_to_llamacpp(arch, wtype, fixture_dir, needs_llamacpp):
    """Every position of a 48-token prefill, bit for bit: the conv, the delta rule, the gated
    norm and the gated attention in llama.cpp's CPU order (Q4_K: the K-quant fixtures are
    256 wide; qwen35moe: value heads paired with key heads h % Hk, IMRoPE as NEOX)."""
    path = fixture_path(arch, wtype, fixture_dir)
    tokens = text_tokens()
    ref = reference_logits(path, tokens)
    ours = moed_logits(path, tokens)
    assert ours.shape == ref.shape
    np.testing.assert_array_equal(ours, ref)


@pytest.mark.llamacpp
@pytest.mark.parametrize("overrides", [dict(full_attention_interval=2), dict(n_layer=5), dict(ssm_group_count=4)],
                         ids=["interval2", "5layers", "Hk=Hv"])
def test_layer_mixes_bit_identical_to_llamacpp(overrides, fixture_dir, needs_llamacpp):
    path = fixture_path("qwen3next", "Q8_0", fixture_dir, **overrides)
    tokens = text_tokens(n=24)
    np.testing.assert_array_equal(moed_logits(path, tokens), reference_logits(path, tokens))


@pytest.mark.llamacpp
@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_tokens_identical_to_llamacpp(arch, fixture_dir, needs_llamacpp):
    """A prompt, then 24 one-token decode steps: the same tokens from the same logits."""
    path = fixture_path(arch, "Q8_0", fixture_dir)
    prompt = text_tokens(seed=11, n=8)
    ref_tokens, ref_logits = reference_greedy(path, prompt, 24, return_logits=True)
    with GGUFFile(path) as g:
        model = Transformer(g)
        cache = model.new_cache(64)
        logits = model.forward(prompt, cache)[-1]
        ours, rows = [], []
        for _ in range(24):
            rows.append(logits)
            ours.append(int(np.argmax(logits)))
            logits = model.forward([ours[-1]], cache)[-1]
    assert ours == list(ref_tokens)
    np.testing.assert_array_equal(np.stack(rows), np.asarray(ref_logits)[-24:])


def _state(cache):
    return cache.states.conv.copy(), cache.states.ssm.copy()


@pytest.mark.parametrize("wtype", ["Q8_0", "F16"])
def test_split_prefill_gives_the_same_state(wtype, fixture_dir):
    """A prompt in one step, or in steps of 20, 1 and 27 rows: the recurrence is the same
    token-by-token loop either way, so with Q8_0 projections (batch-invariant) the conv and
    recurrent states and the logits are bit-identical. F16 projections are computed in
    llama.cpp's tinyBLAS order for steps of >= 2 rows and in vec_dot's for one row, so the
    1-row step's outputs differ in the last bits: the states agree to f32 rounding."""
    path = fixture_path("qwen3next", wtype, fixture_dir)
    tokens = text_tokens()
    with GGUFFile(path) as g:
        model = Transformer(g)
        whole = model.new_cache(64)
        one = model.forward(tokens, whole)[-1]
        split = model.new_cache(64)
        for a, b in ((0, 20), (20, 21), (21, 48)):
            last = model.forward(tokens[a:b], split)[-1]
    assert split.n_past == whole.n_past == 48
    (cw, sw), (cs, ss) = _state(whole), _state(split)
    assert np.abs(sw).max() > 0.1  # a state that moved
    if wtype == "Q8_0":
        np.testing.assert_array_equal(cs, cw)
        np.testing.assert_array_equal(ss, sw)
        np.testing.assert_array_equal(last, one)
    else:
        np.testing.assert_allclose(cs, cw, rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(ss, sw, rtol=1e-3, atol=1e-4)
        assert int(np.argmax(last)) == int(np.argmax(one))


def test_mixed_batches_give_each_sequence_its_solo_tokens(fixture_dir):
    """Three sequences of different lengths prefilled in one pass, then decoded together, one of
    them joining late: each sequence's logits are bit-identical to its run alone."""
    path = fixture_path("qwen3next", "Q8_0", fixture_dir)
    prompts = [text_tokens(seed=s, n=n) for s, n in ((1, 9), (2, 3), (3, 14))]
    with GGUFFile(path) as g:
        model = Transformer(g)

        def solo(prompt, steps):
            cache = model.new_cache(64)
            out = [model.forward(prompt, cache)[-1]]
            for _ in range(steps):
                out.append(model.forward([int(np.argmax(out[-1]))], cache)[-1])
            return out

        alone = [solo(p, 6) for p in prompts]
        caches = [model.new_cache(64) for _ in prompts]
        first = model.forward_many(prompts[:2], caches[:2])  # sequence 2 joins later
        got = [[first[0]], [first[1]], []]
        for step in range(6):
            live = [0, 1] + ([2] if step >= 1 else [])
            if step == 1:
                got[2].append(model.forward(prompts[2], caches[2])[-1])
            toks = [int(np.argmax(got[s][-1])) for s in live]
            rows = model.forward_batch(toks, [caches[s] for s in live])
            for s, row in zip(live, rows):
                got[s].append(row)
    for s in range(3):
        n = len(got[s])
        np.testing.assert_array_equal(np.stack(got[s]), np.stack(alone[s][:n]))


def test_fresh_sequences_start_from_zero_state(fixture_dir):
    path = fixture_path("qwen3next", "Q8_0", fixture_dir)
    with GGUFFile(path) as g:
        model = Transformer(g)
        a = model.new_cache(16)
        first = model.forward(text_tokens(n=4), a)
        b = model.new_cache(16)
        assert not b.states.ssm.any() and not b.states.conv.any()
        np.testing.assert_array_equal(model.forward(text_tokens(n=4), b), first)


# -- metadata that cannot be run ----------------------------------------------------------------


def _load(tmp_path, fixture_dir, set_keys=(), rename=(), drop=()):
    src = fixture_path("qwen3next", "Q8_0", fixture_dir)
    dst = rewrite_gguf(src, tmp_path / "m.gguf", set_keys=dict(set_keys), rename=dict(rename), drop=drop)
    with GGUFFile(dst) as g:
        return Transformer(g)


@pytest.mark.parametrize("key,value,named", [
    ("qwen3next.full_attention_interval", 0, r"qwen3next\.full_attention_interval must be positive"),
    ("qwen3next.ssm.state_size", 48, r"qwen3next\.ssm\.state_size = 48 must equal qwen3next\.ssm\.inner_size"),
    ("qwen3next.ssm.inner_size", 250, r"qwen3next\.ssm\.state_size = 64 must equal qwen3next\.ssm\.inner_size"),
    ("qwen3next.ssm.group_count", 3, r"qwen3next\.ssm\.group_count = 3 must divide"),
    ("qwen3next.ssm.conv_kernel", 0, r"qwen3next\.ssm\.conv_kernel must be positive"),
])
def test_inconsistent_ssm_metadata_is_refused_naming_the_field(tmp_path, fixture_dir, key, value, named):
    with pytest.raises(GGUFError, match=named):
        _load(tmp_path, fixture_dir, set_keys={key: (VT.UINT32, value)})


@pytest.mark.parametrize("key", ["ssm.conv_kernel", "ssm.inner_size", "ssm.state_size", "ssm.time_step_rank",
                                 "ssm.group_count"])
def test_missing_ssm_key_is_named(tmp_path, fixture_dir, key):
    with pytest.raises(GGUFError, match=rf"missing metadata key 'qwen3next\.{key.replace('.', '[.]')}'"):
        _load(tmp_path, fixture_dir, drop=[f"qwen3next.{key}"])


def test_missing_conv_tensor_is_named(tmp_path, fixture_dir):
    with pytest.raises(GGUFError, match=r"blk\.1\.ssm_conv1d\.weight"):
        _load(tmp_path, fixture_dir, rename={"blk.1.ssm_conv1d.weight": "blk.1.ssm_conv1d_old.weight"})


def test_wrong_conv_shape_is_named(tmp_path, fixture_dir):
    """A conv kernel the metadata does not describe (ssm.conv_kernel 5 against a {4, C} tensor)."""
    with pytest.raises(GGUFError, match=r"ssm_conv1d\.weight"):
        _load(tmp_path, fixture_dir, set_keys={"qwen3next.ssm.conv_kernel": (VT.UINT32, 5)})


@pytest.mark.parametrize("sections,ok", [([3, 3, 2, 0], True), ([1, 1, 1, 0], True), ([8, 0, 0, 0], False),
                                         ([2, 2, 2, 2], False), ([0, 0, 0, 4], False)])
def test_qwen35moe_rope_sections_outside_text_positions_are_refused(tmp_path, fixture_dir, sections, ok):
    """IMRoPE on text is NEOX only when every rotated pair is in the t, h or w section (the
    e section gets position 0 in llama.cpp): other sections are refused, naming the key."""
    from daemon.errors import UnsupportedError
    src = fixture_path("qwen35moe", "Q8_0", fixture_dir)
    dst = rewrite_gguf(src, tmp_path / "m.gguf",
                       set_keys={"qwen35moe.rope.dimension_sections": (VT.ARRAY, sections)})
    with GGUFFile(dst) as g:
        if ok:
            Transformer(g)
        else:
            with pytest.raises((UnsupportedError, GGUFError), match=r"qwen35moe\.rope\.dimension_sections"):
                Transformer(g)


@pytest.mark.llamacpp
def test_multi_token_prediction_blocks_are_not_run(tmp_path, fixture_dir, needs_llamacpp):
    """`nextn_predict_layers` blocks follow the trunk and the main pass skips them, as llama.cpp:
    the 8-layer fixture with its last block marked MTP gives the 7-layer fixture's logits (the
    builder draws each tensor from its own name's seed, so the first 7 blocks are the same)."""
    src = fixture_path("qwen3next", "Q8_0", fixture_dir, n_layer=8)
    dst = rewrite_gguf(src, tmp_path / "mtp.gguf", set_keys={"qwen3next.nextn_predict_layers": (VT.UINT32, 1)})
    tokens = text_tokens(n=24)
    with GGUFFile(dst) as g:
        assert Transformer(g).hp.n_layer == 7
    ref = reference_logits(fixture_path("qwen3next", "Q8_0", fixture_dir, n_layer=7), tokens)
    np.testing.assert_array_equal(moed_logits(dst, tokens), ref)
