"""moed synth: full-size plans match the published models; small files load and run in moed and
llama.cpp with finite logits, bit-identical in both; bad input leaves nothing behind."""

from __future__ import annotations

import errno
import hashlib

import numpy as np
import pytest

import gguf
from daemon import Engine
from daemon.cli import main
from daemon.errors import SynthError
from daemon.synth import PRESETS, plan, synth
from daemon.synth import writer
from daemon.synth.presets import metadata, use_more_bits

SMALL = {  # widths for quick files: multiples of 256 (K-quants), heads keep the GQA ratio
    "gpt-oss-20b": dict(n_embd=256, n_ff_exp=256, n_head=8),
    "gpt-oss-120b": dict(n_embd=256, n_ff_exp=256, n_head=8),
    "qwen3-30b-a3b": dict(n_embd=256, n_ff_exp=256, n_head=4),
    "mixtral-8x7b": dict(n_embd=256, n_ff_exp=256, n_head=2),
    # 2 query heads of 256, 1 KV head; the delta net: 2 key and 4 value heads of 128
    "qwen3-next-80b": dict(n_embd=256, n_ff_exp=256, n_head=2),
    "qwen3.5-35b-a3b": dict(n_embd=256, n_ff_exp=256, n_head=2),
}
HYBRIDS = [name for name, p in PRESETS.items() if p.hybrid]
# the small files' depth: the hybrids need a full-attention layer (every 4th; llama.cpp aborts without one)
SMALL_LAYERS = {name: 4 if name in HYBRIDS else 2 for name in PRESETS}
VARIANTS = [(name, t) for name, p in PRESETS.items() for t in p.types]

# llama-bench's "size" column for the published GGUFs (tensor data, GiB). qwen3-next-80b: a published
# Q4_K_M of the older ssm_in layout with F16 routers (llama.cpp's log: "45.08 GiB", 807 tensors, 55 of
# them Q6_K); qwen3.5-35b-a3b: unsloth's Q8_0, 36.9 GB.
PUBLISHED_GIB = {("gpt-oss-20b", "MXFP4"): 11.27, ("gpt-oss-120b", "MXFP4"): 59.02,
                 ("qwen3-30b-a3b", "Q4_K_M"): 17.28, ("qwen3-30b-a3b", "Q8_0"): 30.25,
                 ("mixtral-8x7b", "Q4_K_M"): 26.49, ("qwen3-next-80b", "Q4_K_M"): 45.08,
                 ("qwen3.5-35b-a3b", "Q8_0"): 36.9e9 / 2**30}
# the hybrids' counts are the current converter's layout (attn_qkv + attn_gate; no MTP block): a
# published Qwen3-Coder-Next GGUF has 843 tensors
PUBLISHED_TENSORS = {"gpt-oss-20b": 459, "gpt-oss-120b": 687, "qwen3-30b-a3b": 579, "mixtral-8x7b": 323,
                     "qwen3-next-80b": 843, "qwen3.5-35b-a3b": 733}
CHAT_START = {"gpt-oss-20b": 200006, "gpt-oss-120b": 200006, "qwen3-30b-a3b": 151644, "mixtral-8x7b": 1,
              "qwen3-next-80b": 151644, "qwen3.5-35b-a3b": 248045}
PROMPT = "The quick brown fox jumps over the lazy dog"


def quiet(*_):
    pass


def load(path, name):
    """Engine.load(path): every preset, the hybrids included, must load (an UnsupportedError fails)."""
    return Engine.load(path)


# -- full size, without writing the data ------------------------------------------------------

@pytest.mark.parametrize("name,qtype", VARIANTS)
def test_full_size_plan_matches_the_published_model(name, qtype):
    pl = plan(name, qtype)
    assert pl.n_params == pytest.approx(PRESETS[name].published_params, rel=0.01)
    if (name, qtype) in PUBLISHED_GIB:
        assert pl.data_bytes / 2**30 == pytest.approx(PUBLISHED_GIB[name, qtype], rel=0.02)
    assert len(pl.tensors) == PUBLISHED_TENSORS[name]


def test_published_param_counts_are_the_announced_ones():
    announced = {"gpt-oss-20b": 20.9, "gpt-oss-120b": 116.8, "qwen3-30b-a3b": 30.5, "mixtral-8x7b": 46.7,
                 "qwen3-next-80b": 80, "qwen3.5-35b-a3b": 35}
    for name, billions in announced.items():
        assert plan(name).n_params / 1e9 == pytest.approx(billions, rel=0.03)


@pytest.mark.parametrize("name,expected", [("qwen3-next-80b", 79_674_391_296), ("qwen3.5-35b-a3b", 34_660_610_688)])
def test_hybrid_parameter_counts_from_the_configs(name, expected):
    """The count from the HF config, term by term: Qwen3-Next's model card says 80B total and 79B
    without the embeddings (here 79.05e9); unsloth lists Qwen3.5-35B-A3B's GGUF at 34.7B."""
    p = PRESETS[name]
    D, L, E, F, Fs, V = p.n_embd, p.n_layer, p.n_expert, p.n_ff_exp, p.n_ff_shexp, p.n_vocab
    n_lin = sum(p.is_recurrent(i) for i in range(L))
    Dk, Hk, Hv, Kc = p.ssm_state_size, p.ssm_group_count, p.ssm_time_step_rank, p.ssm_conv_kernel
    C, Vd = 2 * Hk * Dk + Hv * Dk, Hv * Dk
    ffn = 2 * D + E * D + 3 * E * F * D + D + 3 * Fs * D  # norms, router, experts, shared gate + expert
    lin = D * C + D * Vd + 2 * Hv * D + Kc * C + 2 * Hv + Dk + Vd * D  # qkv, z, b/a, conv, dt, A, norm, out
    q, kv = p.n_head * p.head_dim, p.n_head_kv * p.head_dim
    att = 2 * q * D + 2 * kv * D + q * D + 2 * p.head_dim
    total = 2 * V * D + D + L * ffn + n_lin * lin + (L - n_lin) * att
    assert (n_lin, L - n_lin) == ((36, 12) if L == 48 else (30, 10))
    assert total == expected == plan(name).n_params
    assert (total - 2 * V * D) / 1e9 == pytest.approx(79.05 if L == 48 else 33.64, abs=0.01)


def test_quant_mixes():
    def types(pl, role):
        return [t.type for t in pl.tensors if f".{t.name}".endswith(f".{role}.weight")]

    oss = plan("gpt-oss-20b")
    assert set(types(oss, "ffn_gate_exps") + types(oss, "ffn_down_exps")) == {"MXFP4"}
    assert set(types(oss, "attn_q") + types(oss, "token_embd") + types(oss, "output")) == {"Q8_0"}
    assert set(types(oss, "ffn_gate_inp") + types(oss, "attn_sinks")) == {"F32"}
    qwen = plan("qwen3-30b-a3b")
    more = [use_more_bits(i, 48) for i in range(48)]
    assert sum(more) == 24
    assert types(qwen, "ffn_down_exps") == ["Q6_K" if m else "Q4_K" for m in more]
    assert types(qwen, "attn_v") == ["Q6_K" if m else "Q4_K" for m in more]
    assert set(types(qwen, "ffn_up_exps") + types(qwen, "attn_q") + types(qwen, "token_embd")) == {"Q4_K"}
    assert types(qwen, "output") == ["Q6_K"]
    assert {t.type for t in plan("qwen3-30b-a3b", "Q8_0").tensors} == {"Q8_0", "F32"}
    mix = plan("mixtral-8x7b")
    assert set(types(mix, "attn_k") + types(mix, "attn_v")) == {"Q8_0"}
    assert set(types(mix, "attn_output")) == {"Q5_K"}


@pytest.mark.parametrize("name", HYBRIDS)
def test_hybrid_quant_mix(name):
    """llama_tensor_get_type's Q4_K_M for the hybrids (presets.py): attn_qkv counts as attn_v, one per
    layer; ffn_down_exps and ffn_down_shexp get more bits in the same layers; the rest Q4_K; conv,
    router, norms, ssm_a, ssm_dt and the shared-expert gate stay F32."""
    pl = plan(name)
    t = {x.name: x.type for x in pl.tensors}
    L = pl.preset.n_layer
    more = [use_more_bits(i, L) for i in range(L)]
    v_like = [t.get(f"blk.{i}.attn_qkv.weight") or t[f"blk.{i}.attn_v.weight"] for i in range(L)]
    assert v_like == ["Q6_K" if m else "Q4_K" for m in more]
    for role in ("ffn_down_exps", "ffn_down_shexp"):
        assert [t[f"blk.{i}.{role}.weight"] for i in range(L)] == ["Q6_K" if m else "Q4_K" for m in more]
    ba = ["ssm_ba"] if name == "qwen3-next-80b" else ["ssm_beta", "ssm_alpha"]
    for role in ["attn_gate", "ssm_out", "ffn_gate_exps", "ffn_up_shexp"] + ba:
        assert t[f"blk.0.{role}.weight"] == "Q4_K", role
    for role in ["attn_q", "attn_k", "attn_output"]:
        assert t[f"blk.3.{role}.weight"] == "Q4_K", role
    for n in ["blk.0.ssm_conv1d.weight", "blk.0.ssm_a", "blk.0.ssm_dt.bias", "blk.0.ssm_norm.weight",
              "blk.0.ffn_gate_inp.weight", "blk.0.ffn_gate_inp_shexp.weight", "blk.3.attn_q_norm.weight"]:
        assert t[n] == "F32", n
    assert (t["output.weight"], t["token_embd.weight"]) == ("Q6_K", "Q4_K")
    assert {x.type for x in plan(name, "Q8_0").tensors} == {"Q8_0", "F32"}
    # the 8-expert rules reach attn_qkv too (attn_v-like)
    eight = {x.name: x.type for x in plan(name, n_expert=8, n_expert_used=2).tensors}
    assert (eight["blk.0.attn_qkv.weight"], eight["blk.3.attn_v.weight"], eight["blk.3.attn_output.weight"]) == \
        ("Q8_0", "Q8_0", "Q5_K")


def test_overrides_change_depth_experts_and_widths():
    pl = plan("qwen3-30b-a3b", n_layer=3, n_expert=16, n_expert_used=2, n_embd=512, n_ff_exp=256, n_head=8)
    p = pl.preset
    assert (p.n_layer, p.n_expert, p.n_expert_used, p.n_embd, p.n_ff_exp, p.n_head, p.n_head_kv) == \
        (3, 16, 2, 512, 256, 8, 1)
    gate = next(t for t in pl.tensors if t.name == "blk.2.ffn_gate_exps.weight")
    assert gate.shape == (16, 256, 512)
    assert not any(t.name.startswith("blk.3.") for t in pl.tensors)


@pytest.mark.parametrize("name", HYBRIDS)
@pytest.mark.parametrize("n_head", [1, 2, 4, 8, 16, 32])
def test_hybrid_overrides_keep_the_delta_net_consistent(name, n_head):
    """The delta net's key heads follow n_head, its value heads keep their ratio (2 per key head),
    its head size stays 128: inner_size / time_step_rank == state_size and time_step_rank %
    group_count == 0 hold, and its widths are multiples of 256 for the K-quants."""
    pl = plan(name, n_layer=5, n_embd=512, n_ff_exp=256, n_head=n_head)
    p = pl.preset
    assert p.ssm_group_count == max(1, n_head) and p.ssm_time_step_rank == 2 * p.ssm_group_count
    assert p.ssm_state_size == 128 and p.n_head_kv == max(1, n_head // 8) and p.n_ff_shexp == 256
    md = {k: v for k, _, v in metadata(pl)}
    a = p.arch
    assert md[f"{a}.ssm.inner_size"] // md[f"{a}.ssm.time_step_rank"] == md[f"{a}.ssm.state_size"]
    assert md[f"{a}.ssm.time_step_rank"] % md[f"{a}.ssm.group_count"] == 0
    t = {x.name: x for x in pl.tensors}
    C = 2 * p.ssm_group_count * 128 + p.ssm_time_step_rank * 128
    assert t["blk.0.attn_qkv.weight"].shape == (C, 512) and t["blk.0.ssm_conv1d.weight"].shape == (C, 4)
    assert t["blk.3.attn_q.weight"].shape == (2 * n_head * 256, 512)  # query + gate
    assert t["blk.4.ssm_out.weight"].shape == (512, p.ssm_time_step_rank * 128)
    assert t["blk.2.ffn_down_shexp.weight"].shape == (512, 256)
    assert not any(n.startswith("blk.5.") for n in t)



# -- small files: moed and llama.cpp run them --------------------------------------------------

@pytest.fixture(scope="module")
def small_files(tmp_path_factory):
    d = tmp_path_factory.mktemp("synth")
    out = {}
    for name in PRESETS:
        out[name] = d / f"{name}.gguf"
        synth(out[name], name, n_layer=SMALL_LAYERS[name], report=quiet, **SMALL[name])
    return out


@pytest.fixture(scope="module")
def small_reader(small_files):
    """GGUFReader of a small file, parsed once (a 200k-token vocabulary takes seconds)."""
    readers = {}

    def get(name):
        if name not in readers:
            readers[name] = gguf.GGUFReader(small_files[name])
        return readers[name]
    return get


@pytest.mark.parametrize("name", list(PRESETS))
def test_small_file_has_the_preset_metadata(small_files, small_reader, name):
    r = small_reader(name)
    p = PRESETS[name]
    arch = r.fields["general.architecture"].contents()
    assert arch == p.arch
    assert r.fields[f"{arch}.block_count"].contents() == SMALL_LAYERS[name]
    assert r.fields[f"{arch}.expert_count"].contents() == p.n_expert
    assert r.fields[f"{arch}.expert_used_count"].contents() == p.n_expert_used
    assert len(r.fields["tokenizer.ggml.tokens"].contents()) == p.n_vocab
    assert r.fields["tokenizer.chat_template"].contents()
    assert not list(small_files[name].parent.glob("*.part"))


@pytest.mark.parametrize("name", HYBRIDS)
def test_small_hybrid_file_has_the_delta_net_metadata_and_tensors(small_reader, name):
    r = small_reader(name)
    p = plan(name, n_layer=4, **SMALL[name]).preset
    a = p.arch
    f = {k: v.contents() for k, v in r.fields.items() if k.startswith(a + ".")}
    assert (f[f"{a}.ssm.conv_kernel"], f[f"{a}.ssm.state_size"], f[f"{a}.ssm.group_count"],
            f[f"{a}.ssm.time_step_rank"], f[f"{a}.ssm.inner_size"], f[f"{a}.full_attention_interval"]) == \
        (4, 128, 2, 4, 512, 4)
    assert (f[f"{a}.rope.dimension_count"], f[f"{a}.attention.key_length"], f[f"{a}.rope.freq_base"]) == (64, 256, 1e7)
    assert f[f"{a}.expert_shared_feed_forward_length"] == 256
    if a == "qwen35moe":
        assert f[f"{a}.rope.dimension_sections"] == [11, 11, 10, 0]
        assert r.fields[f"{a}.rope.dimension_sections"].types[-1] == gguf.GGUFValueType.INT32
        assert f"{a}.feed_forward_length" not in f
        assert r.fields["tokenizer.ggml.pre"].contents() == "qwen35"
        tokens = r.fields["tokenizer.ggml.tokens"].contents()
        assert tokens[248044:248047] == ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
        assert r.fields["tokenizer.ggml.eos_token_id"].contents() == 248046
    else:
        assert f[f"{a}.feed_forward_length"] == 5120
    t = {x.name: x for x in r.tensors}
    assert "blk.3.attn_qkv.weight" not in t and "blk.2.attn_q.weight" not in t
    assert list(t["blk.3.attn_q.weight"].shape) == [256, 2 * 2 * 256]
    assert t["blk.0.ssm_conv1d.weight"].tensor_type == gguf.GGMLQuantizationType.F32
    ssm_a = np.asarray(t["blk.1.ssm_a"].data)
    assert (ssm_a < -0.49).all() and (ssm_a > -4.01).all()  # -exp(A_log), A in [0.5, 4]
    dt = np.asarray(t["blk.1.ssm_dt.bias"].data)
    assert abs(dt.mean() + 2) < 1.0
    norm = np.asarray(t["blk.2.ssm_norm.weight"].data)
    assert norm.shape == (128,) and abs(norm.mean() - 1) < 0.1


@pytest.mark.parametrize("name", list(PRESETS))
def test_moed_runs_a_small_file_with_finite_logits(small_files, name):
    with load(small_files[name], name) as e:
        logits = e.forward(e.tokenize(PROMPT))
        assert np.isfinite(logits).all()
        assert 0.5 < logits.std() < 20  # realistic magnitude, not collapsed, not exploding
        # the family's template, its control tokens parsed as single tokens
        assert CHAT_START[name] in e.chat_ids([{"role": "user", "content": "Hello"}])
        assert len(list(e.chat([{"role": "user", "content": "Hello"}], max_tokens=4, temperature=0))) >= 1


@pytest.mark.llamacpp
@pytest.mark.parametrize("name", list(PRESETS))
def test_llamacpp_runs_a_small_file_as_moed_does(small_files, name, needs_llamacpp):
    from tests.fixtures.reference import reference_greedy, reference_logits, reference_tokenize

    path = small_files[name]
    ids = reference_tokenize(path, PROMPT)
    ref = reference_logits(path, ids)
    assert np.isfinite(ref).all() and 0.5 < ref.std() < 20
    ref_tokens, ref_rows = reference_greedy(path, ids, 3, return_logits=True, logits_all=False)
    with load(path, name) as e:
        ours = e.forward(ids)
        model = e.model
        cache = model.new_cache(len(ids) + 3)
        logits = model.forward(ids, cache)[-1]  # the last row only, as a generation (and llama.cpp here)
        tokens, rows = [], []
        for _ in range(3):
            rows.append(logits)
            tokens.append(int(np.argmax(logits)))
            logits = model.forward([tokens[-1]], cache)[-1]
    np.testing.assert_array_equal(ours, ref)  # every prompt row, bit for bit
    assert tokens == ref_tokens
    np.testing.assert_array_equal(np.stack(rows), ref_rows)


@pytest.mark.parametrize("name", ["qwen3-30b-a3b", "gpt-oss-120b", "mixtral-8x7b"] + HYBRIDS)
def test_activations_stay_finite_through_every_layer(tmp_path, name):
    path = tmp_path / "deep.gguf"
    synth(path, name, n_expert=4, n_expert_used=2, report=quiet, **SMALL[name])  # full depth
    with load(path, name) as e:
        logits = e.forward(e.tokenize(PROMPT))
    assert np.isfinite(logits).all() and 0.5 < logits.std() < 20


def test_same_seed_same_bytes_other_seed_differs(tmp_path):
    kw = dict(n_layer=1, n_expert=2, n_expert_used=1, report=quiet, **SMALL["mixtral-8x7b"])
    digest = lambda p: hashlib.sha256(p.read_bytes()).hexdigest()  # noqa: E731
    synth(tmp_path / "a.gguf", "mixtral-8x7b", seed=1, **kw)
    synth(tmp_path / "b.gguf", "mixtral-8x7b", seed=1, **kw)
    synth(tmp_path / "c.gguf", "mixtral-8x7b", seed=2, **kw)
    assert digest(tmp_path / "a.gguf") == digest(tmp_path / "b.gguf") != digest(tmp_path / "c.gguf")


def test_cli_writes_reports_progress_and_rate(tmp_path, capsys):
    out = tmp_path / "m.gguf"
    assert main(["synth", str(out), "--like", "mixtral-8x7b", "--layers", "1", "--experts", "2", "--used", "1",
                 "--hidden", "256", "--ff", "256", "--heads", "2"]) == 0
    cap = capsys.readouterr()
    assert out.exists() and "MB/s" in cap.out and "writing" in cap.err
    assert plan("mixtral-8x7b", n_layer=1, n_expert=2, n_expert_used=1, **SMALL["mixtral-8x7b"]).n_params / 1e9 \
        == pytest.approx(float(cap.out.split("B parameters")[0].split()[-1]), abs=0.01)


# -- bad input: a clear error and no partial file ----------------------------------------------

def _left(tmp_path):
    return sorted(p.name for p in tmp_path.iterdir())


def test_unknown_like_is_a_clear_error(tmp_path, capsys):
    assert main(["synth", str(tmp_path / "x.gguf"), "--like", "llama-7b"]) == 1
    err = capsys.readouterr().err
    assert "unknown model 'llama-7b'" in err and "qwen3-30b-a3b" in err
    assert _left(tmp_path) == []


@pytest.mark.parametrize("kw,msg", [
    (dict(type="Q4_0"), "--type Q4_0 is not available"),
    (dict(n_expert=4, n_expert_used=8), "exceeds"),
    (dict(n_embd=300), "not a multiple"),
    (dict(n_layer=0), "positive"),
])
def test_bad_options_are_clear_errors(tmp_path, kw, msg):
    with pytest.raises(SynthError, match=msg):
        synth(tmp_path / "x.gguf", "qwen3-30b-a3b", report=quiet, **kw)
    assert _left(tmp_path) == []


@pytest.mark.parametrize("name", HYBRIDS)
def test_hybrid_without_an_attention_layer_is_a_clear_error(tmp_path, name):
    """Fewer layers than full_attention_interval leave no attention layer: llama.cpp aborts on such a
    file (GGML_ASSERT(buffer) allocating the empty KV cache), so synth refuses to write it."""
    with pytest.raises(SynthError, match="at least 4 layers"):
        synth(tmp_path / "x.gguf", name, n_layer=3, report=quiet, **SMALL[name])
    assert _left(tmp_path) == []


def test_refuses_to_overwrite_without_force(tmp_path):
    out = tmp_path / "x.gguf"
    out.write_bytes(b"keep me")
    kw = dict(n_layer=1, n_expert=2, n_expert_used=1, report=quiet, **SMALL["mixtral-8x7b"])
    with pytest.raises(SynthError, match="exists; pass --force"):
        synth(out, "mixtral-8x7b", **kw)
    assert out.read_bytes() == b"keep me"
    synth(out, "mixtral-8x7b", force=True, **kw)
    assert out.read_bytes()[:4] == b"GGUF" and _left(tmp_path) == ["x.gguf"]


def test_too_little_space_reported_before_writing(tmp_path, monkeypatch):
    class Usage:
        free = 10 << 20

    monkeypatch.setattr(writer.shutil, "disk_usage", lambda _: Usage)
    with pytest.raises(SynthError, match=r"not enough disk space .* needs 12\.1 GB, 10\.5 MB is free"):
        synth(tmp_path / "x.gguf", "gpt-oss-20b", report=quiet)
    assert _left(tmp_path) == []


@pytest.mark.parametrize("exc,msg", [
    (OSError(errno.ENOSPC, "No space left on device"), "disk full while writing"),
    (KeyboardInterrupt(), None),
])
def test_failure_during_the_write_leaves_no_file(tmp_path, monkeypatch, exc, msg):
    calls = []

    def fail_later(*args):
        calls.append(1)
        if len(calls) == 5:
            raise exc
        return real(*args)

    real = writer.random_blocks
    monkeypatch.setattr(writer, "random_blocks", fail_later)
    with pytest.raises(SynthError if msg else KeyboardInterrupt, match=msg):
        synth(tmp_path / "x.gguf", "mixtral-8x7b", n_layer=2, report=quiet, **SMALL["mixtral-8x7b"])
    assert len(calls) == 5 and _left(tmp_path) == []


def test_unwritable_path_is_a_clear_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(SynthError, match="cannot write"):
        synth(blocker / "x.gguf", "mixtral-8x7b", n_layer=1, report=quiet, **SMALL["mixtral-8x7b"])
    with pytest.raises(SynthError, match="cannot write"):
        synth(tmp_path / "missing" / "x.gguf", "mixtral-8x7b", n_layer=1, report=quiet, **SMALL["mixtral-8x7b"])
    assert _left(tmp_path) == ["file"]


@pytest.mark.parametrize("name,least", [("qwen3-30b-a3b", 96), ("qwen3-next-80b", 270), ("qwen3.5-35b-a3b", 170)])
def test_routing_spreads_over_the_experts_in_every_layer(tmp_path, name, least):
    # full depth and expert count, tiny widths: 64 distinct tokens should reach most of the experts in
    # every layer, not a few favourites. Uniform top-k choice reaches E (1 - (1 - k/E)^64) on average:
    # 126 of 128 (top 8), 365 of 512 (top 10), 222 of 256 (top 8); `least` is about 3/4 of that
    path = tmp_path / "route.gguf"
    synth(path, name, type="Q8_0", n_embd=256, n_ff_exp=32, n_head=SMALL[name]["n_head"], report=quiet)
    used: dict[int, set[int]] = {}
    with load(path, name) as e:
        e.model.trace = lambda layer, ids: used.setdefault(layer, set()).update(np.ravel(ids).tolist())
        e.forward(list(range(300, 364)))
    assert len(used) == PRESETS[name].n_layer
    assert min(len(s) for s in used.values()) >= least
