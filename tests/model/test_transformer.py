"""Model behaviour: KV-cache and batch invariance (decode steps also against llama.cpp's
same steps), input checks, loader errors."""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from daemon.errors import GGUFError, RequestError, UnsupportedError
from daemon.model.transformer import Transformer
from daemon.storage.gguf import GGUFFile
from tests.fixtures.build import fixture_path
from tests.fixtures.reference import reference_steps

ARCHS = ["llama", "llama-moe", "qwen3moe", "qwen2moe", "olmoe", "gpt-oss"]


SPLIT = [7] + [1] * 13  # a 7-token prefill, then 13 one-token decode steps


def _in_steps(model, tokens, steps=SPLIT):
    cache = model.new_cache(32)
    parts, a = [], 0
    for n in steps:
        parts.append(model.forward(tokens[a:a + n], cache, all_logits=True))
        a += n
    assert cache.n_past == len(tokens)
    return np.concatenate(parts)


@pytest.mark.parametrize("arch", ARCHS)
def test_incremental_decode_equals_one_pass_float32(arch, fixture_dir):
    """Prefill then one token at a time gives the logits of one pass over the whole sequence,
    bit for bit, in "float32" numerics: their kernels sum in one order whatever the step's row
    count, so any difference is a KV cell or position gone wrong. (In "ggml" numerics the
    split changes the last bits as in llama.cpp: the next test compares those exactly.)"""
    tokens = np.random.default_rng(3).integers(0, 509, 20).tolist()
    with GGUFFile(fixture_path(arch, "Q8_0", fixture_dir)) as g:
        model = Transformer(g, numerics="float32")
        full = model.forward(tokens, model.new_cache(32), all_logits=True)
        steps = _in_steps(model, tokens)
    np.testing.assert_array_equal(steps, full)


@pytest.mark.llamacpp
@pytest.mark.parametrize("arch,wtype", [(a, ("Q4_K", "F16")[i % 2]) for i, a in enumerate(ARCHS)])
def test_incremental_decode_bit_identical_to_llamacpp(arch, wtype, fixture_dir, needs_llamacpp):
    """In "ggml" numerics the same split in llama.cpp (one llama_decode per step) gives the same
    logits, every row, bit for bit. F16 and K-quant weights are the types whose summation order
    depends on the step's row count (tinyBLAS / tiled kernels), so a row here can differ from
    one pass over the whole sequence in its last bits, as llama.cpp's does."""
    tokens = np.random.default_rng(3).integers(0, 509, 20).tolist()
    path = fixture_path(arch, wtype, fixture_dir)
    with GGUFFile(path) as g:
        steps = _in_steps(Transformer(g), tokens)
    np.testing.assert_array_equal(steps, reference_steps(path, tokens, SPLIT))


def test_same_steps_are_deterministic(fixture_dir):
    tokens = np.random.default_rng(4).integers(0, 509, 12).tolist()
    with GGUFFile(fixture_path("gpt-oss", "MXFP4", fixture_dir)) as g:
        model = Transformer(g)
        runs = []
        for _ in range(2):
            cache = model.new_cache(16)
            runs.append([model.forward(tokens[:5], cache)] + [model.forward([t], cache) for t in tokens[5:]])
    assert all(np.array_equal(a, b) for a, b in zip(*runs))


@pytest.mark.parametrize("numerics", ["ggml", "float32"])
def test_moe_routing_is_observable_and_sane(numerics, fixture_dir):
    seen = []
    with GGUFFile(fixture_path("qwen3moe", "Q8_0", fixture_dir)) as g:
        model = Transformer(g, numerics=numerics)
        model.trace = lambda layer, ids: seen.append((layer, ids.copy()))
        model.forward([1, 2, 3, 4], model.new_cache(8), all_logits=True)
        hp = model.hp
    assert [layer for layer, _ in seen] == list(range(hp.n_layer))
    for _, ids in seen:
        assert ids.shape == (4, hp.n_expert_used)
        assert all(len(set(row)) == hp.n_expert_used for row in ids.tolist())
        assert ids.min() >= 0 and ids.max() < hp.n_expert


def test_bad_tokens_and_full_context_are_request_errors(fixture_dir):
    with GGUFFile(fixture_path("llama", "Q8_0", fixture_dir)) as g:
        model = Transformer(g)
        with pytest.raises(RequestError, match="out of range"):
            model.forward([model.hp.n_vocab], model.new_cache(8))
        with pytest.raises(RequestError, match="out of range"):
            model.forward([-1], model.new_cache(8))
        with pytest.raises(RequestError, match="no tokens"):
            model.forward([], model.new_cache(8))
        cache = model.new_cache(4)
        model.forward([1, 2, 3], cache)
        with pytest.raises(RequestError, match="context full"):
            model.forward([4, 5], cache)


def _rewrite(src_path, dst_path, drop_tensor=None, arch=None, drop_key=None):
    """Copy a fixture, dropping a tensor or a metadata key, or renaming the architecture."""
    src = GGUFFile(src_path)
    w = gguf.GGUFWriter(str(dst_path), arch or src.architecture)
    for key, value in src.metadata.items():
        if key in ("general.architecture", drop_key) or key.startswith("GGUF."):
            continue
        vtype, sub = src.value_type(key)
        if arch and key.startswith(src.architecture + "."):
            key = arch + key[len(src.architecture):]
        if vtype == gguf.GGUFValueType.ARRAY:
            w.add_key_value(key, value.tolist() if isinstance(value, np.ndarray) else list(value), vtype, sub_type=sub)
        else:
            w.add_key_value(key, value, vtype)
    for name, info in src.tensors.items():
        if name != drop_tensor:
            w.add_tensor(name, np.asarray(src.tensor_data(name)).reshape(*info.shape[:-1], -1), raw_dtype=info.ggml_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst_path


def test_unsupported_architecture(fixture_dir, tmp_path):
    path = _rewrite(fixture_path("llama", "Q8_0", fixture_dir), tmp_path / "m.gguf", arch="mamba")
    with GGUFFile(path) as g, pytest.raises(UnsupportedError, match="mamba"):
        Transformer(g)


def test_missing_tensor_is_named(fixture_dir, tmp_path):
    path = _rewrite(fixture_path("qwen3moe", "Q8_0", fixture_dir), tmp_path / "m.gguf",
                    drop_tensor="blk.1.ffn_up_exps.weight")
    with GGUFFile(path) as g, pytest.raises(GGUFError, match="blk.1.ffn_up_exps.weight"):
        Transformer(g)


def test_missing_hyperparameter_is_named(fixture_dir, tmp_path):
    path = _rewrite(fixture_path("olmoe", "Q8_0", fixture_dir), tmp_path / "m.gguf",
                    drop_key="olmoe.attention.head_count")
    with GGUFFile(path) as g, pytest.raises(GGUFError, match="olmoe.attention.head_count"):
        Transformer(g)


BATCH_CASES = [("qwen3moe", "Q4_K"), ("qwen3moe", "F16"), ("gpt-oss", "MXFP4"), ("llama", "Q6_K"),
               ("qwen2moe", "Q5_K"), ("llama-moe", "Q8_0")]


@pytest.mark.parametrize("compiled_step", ["wait", "off"])
@pytest.mark.parametrize("arch,wtype", BATCH_CASES)
def test_forward_batch_is_batch_invariant(arch, wtype, compiled_step, fixture_dir):
    """A decode step of 9 sequences (at different positions) gives each sequence exactly the
    logits of its own one-token step, for two steps in a row; 9 >= 8 rows would take the tiled
    K-quant and tinyBLAS paths in an ordinary matmul. On the CPU's compiled step (where it serves
    the model) and on the per-op path."""
    rng = np.random.default_rng(11)
    B = 9
    with GGUFFile(fixture_path(arch, wtype, fixture_dir)) as g:
        model = Transformer(g)
        model.backend.compiled_step = compiled_step
        V = model.hp.n_vocab
        prompts = [rng.integers(0, V, int(rng.integers(1, 6))).tolist() for _ in range(B)]
        steps = rng.integers(0, V, (2, B)).tolist()
        solo = []
        for b, p in enumerate(prompts):
            c = model.new_cache(16)
            model.forward(p, c)
            solo.append([model.forward([steps[0][b]], c)[0], model.forward([steps[1][b]], c)[0]])
        caches = [model.new_cache(16) for _ in prompts]
        for p, c in zip(prompts, caches):
            model.forward(p, c)
        batched = [model.forward_batch(steps[0], caches), model.forward_batch(steps[1], caches)]
        assert [c.n_past for c in caches] == [len(p) + 2 for p in prompts]
        program = model.backend._programs.get(model)
        if compiled_step == "wait" and arch != "qwen2moe":  # (shared experts: op by op)
            assert program.clock.any()  # the compiled step served
    for b in range(B):
        for s in range(2):
            assert np.array_equal(batched[s][b], solo[b][s]), (b, s)


@pytest.mark.parametrize("arch,wtype", BATCH_CASES)
def test_forward_many_prefills_like_separate_forwards(arch, wtype, fixture_dir):
    """Several prompts in one pass give each sequence exactly the logits and the KV cache of its
    own prefill: prompts of 1 to 12 tokens, so that alone some take the one-row paths, some the
    tiled K-quant (>= 8 rows) or tinyBLAS (>= 2) paths, while together they are 40 rows; the next
    decode step from those caches matches too."""
    rng = np.random.default_rng(12)
    with GGUFFile(fixture_path(arch, wtype, fixture_dir)) as g:
        model = Transformer(g)
        V = model.hp.n_vocab
        prompts = [rng.integers(0, V, n).tolist() for n in (12, 1, 9, 3, 2, 1, 8, 4)]
        alone, solo_caches = [], []
        for p in prompts:
            c = model.new_cache(32)
            alone.append(model.forward(p, c)[-1])
            solo_caches.append(c)
        caches = [model.new_cache(32) for _ in prompts]
        together = model.forward_many(prompts, caches)
        assert together.shape == (len(prompts), V)
        for b, (c, sc) in enumerate(zip(caches, solo_caches)):
            assert np.array_equal(together[b], alone[b]), b
            assert c.n_past == sc.n_past == len(prompts[b])
            assert np.array_equal(c.k[:, :c.n_past], sc.k[:, :sc.n_past]) and np.array_equal(c.v, sc.v)
        nxt = rng.integers(0, V, len(prompts)).tolist()
        step = model.forward_batch(nxt, caches)
        for b, sc in enumerate(solo_caches):
            assert np.array_equal(step[b], model.forward([nxt[b]], sc)[0]), b
        with pytest.raises(RequestError):
            model.forward_many(prompts[:2], [caches[0], caches[0]])


def test_forward_batch_needs_solo_rows(fixture_dir):
    """The check above can fail: without per-row paths a 9-row K-quant step sums differently."""
    from daemon.kernels.matmul import linear_prepared, prepare

    with GGUFFile(fixture_path("qwen3moe", "Q4_K", fixture_dir)) as g:
        w = Transformer(g).layers[0].mixer.wq
    x = np.random.default_rng(2).standard_normal((9, w.n_in)).astype(np.float32)
    xp = prepare(x, w.ggml_type)
    tiled = linear_prepared(xp, w.raw, w.ggml_type, w.n_in)
    solo = linear_prepared(xp, w.raw, w.ggml_type, w.n_in, solo=True)
    one = np.concatenate([linear_prepared(prepare(x[i:i + 1], w.ggml_type), w.raw, w.ggml_type, w.n_in)
                          for i in range(9)])
    assert np.array_equal(solo, one)
    assert not np.array_equal(tiled, one)


def test_forward_batch_rejects_bad_input(fixture_dir):
    with GGUFFile(fixture_path("qwen3moe", "Q8_0", fixture_dir)) as g:
        model = Transformer(g)
        c = model.new_cache(4)
        with pytest.raises(RequestError):
            model.forward_batch([1, 2], [c])
        with pytest.raises(RequestError):
            model.forward_batch([1, 2], [c, c])
