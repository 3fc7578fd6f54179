"""moed synth: full-size plans match the published models; small files load and run in moed and
llama.cpp with finite logits; bad input leaves nothing behind."""

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
from daemon.synth.presets import use_more_bits

SMALL = {  # widths for quick files: multiples of 256 (K-quants), heads keep the GQA ratio
    "gpt-oss-20b": dict(n_embd=256, n_ff_exp=256, n_head=8),
    "gpt-oss-120b": dict(n_embd=256, n_ff_exp=256, n_head=8),
    "qwen3-30b-a3b": dict(n_embd=256, n_ff_exp=256, n_head=4),
    "mixtral-8x7b": dict(n_embd=256, n_ff_exp=256, n_head=2),
}
VARIANTS = [(name, t) for name, p in PRESETS.items() for t in p.types]

# llama-bench's "size" column for the published GGUFs (tensor data, GiB)
PUBLISHED_GIB = {("gpt-oss-20b", "MXFP4"): 11.27, ("gpt-oss-120b", "MXFP4"): 59.02,
                 ("qwen3-30b-a3b", "Q4_K_M"): 17.28, ("qwen3-30b-a3b", "Q8_0"): 30.25,
                 ("mixtral-8x7b", "Q4_K_M"): 26.49}
PUBLISHED_TENSORS = {"gpt-oss-20b": 459, "gpt-oss-120b": 687, "qwen3-30b-a3b": 579, "mixtral-8x7b": 323}
CHAT_START = {"gpt-oss-20b": 200006, "gpt-oss-120b": 200006, "qwen3-30b-a3b": 151644, "mixtral-8x7b": 1}
PROMPT = "The quick brown fox jumps over the lazy dog"


def quiet(*_):
    pass


# -- full size, without writing the data ------------------------------------------------------

@pytest.mark.parametrize("name,qtype", VARIANTS)
def test_full_size_plan_matches_the_published_model(name, qtype):
    pl = plan(name, qtype)
    assert pl.n_params == pytest.approx(PRESETS[name].published_params, rel=0.01)
    assert pl.data_bytes / 2**30 == pytest.approx(PUBLISHED_GIB[name, qtype], rel=0.02)
    assert len(pl.tensors) == PUBLISHED_TENSORS[name]


def test_published_param_counts_are_the_announced_ones():
    announced = {"gpt-oss-20b": 20.9, "gpt-oss-120b": 116.8, "qwen3-30b-a3b": 30.5, "mixtral-8x7b": 46.7}
    for name, billions in announced.items():
        assert plan(name).n_params / 1e9 == pytest.approx(billions, rel=0.03)


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


def test_overrides_change_depth_experts_and_widths():
    pl = plan("qwen3-30b-a3b", n_layer=3, n_expert=16, n_expert_used=2, n_embd=512, n_ff_exp=256, n_head=8)
    p = pl.preset
    assert (p.n_layer, p.n_expert, p.n_expert_used, p.n_embd, p.n_ff_exp, p.n_head, p.n_head_kv) == \
        (3, 16, 2, 512, 256, 8, 1)
    gate = next(t for t in pl.tensors if t.name == "blk.2.ffn_gate_exps.weight")
    assert gate.shape == (16, 256, 512)
    assert not any(t.name.startswith("blk.3.") for t in pl.tensors)


# -- small files: moed and llama.cpp run them --------------------------------------------------

@pytest.fixture(scope="module")
def small_files(tmp_path_factory):
    d = tmp_path_factory.mktemp("synth")
    out = {}
    for name in PRESETS:
        out[name] = d / f"{name}.gguf"
        synth(out[name], name, n_layer=2, report=quiet, **SMALL[name])
    return out


@pytest.mark.parametrize("name", list(PRESETS))
def test_small_file_has_the_preset_metadata(small_files, name):
    r = gguf.GGUFReader(small_files[name])
    p = PRESETS[name]
    arch = r.fields["general.architecture"].contents()
    assert arch == p.arch
    assert r.fields[f"{arch}.block_count"].contents() == 2
    assert r.fields[f"{arch}.expert_count"].contents() == p.n_expert
    assert r.fields[f"{arch}.expert_used_count"].contents() == p.n_expert_used
    assert len(r.fields["tokenizer.ggml.tokens"].contents()) == p.n_vocab
    assert r.fields["tokenizer.chat_template"].contents()
    assert not list(small_files[name].parent.glob("*.part"))


@pytest.mark.parametrize("name", list(PRESETS))
def test_moed_runs_a_small_file_with_finite_logits(small_files, name):
    with Engine.load(small_files[name]) as e:
        logits = e.forward(e.tokenize(PROMPT))
        assert np.isfinite(logits).all()
        assert 0.5 < logits.std() < 20  # realistic magnitude, not collapsed, not exploding
        # the family's template, its control tokens parsed as single tokens
        assert CHAT_START[name] in e.chat_ids([{"role": "user", "content": "Hello"}])
        assert len(list(e.chat([{"role": "user", "content": "Hello"}], max_tokens=4, temperature=0))) >= 1


@pytest.mark.llamacpp
@pytest.mark.parametrize("name", list(PRESETS))
def test_llamacpp_runs_a_small_file_as_moed_does(small_files, name, needs_llamacpp):
    from tests.fixtures.reference import reference_greedy, reference_logits

    path = small_files[name]
    with Engine.load(path) as e:
        ids = e.tokenize(PROMPT)
        ours = e.forward(ids)
    ref = reference_logits(path, ids)
    assert np.isfinite(ref).all()
    np.testing.assert_allclose(ours, ref, atol=1e-2 * float(np.abs(ref).max()))
    assert len(reference_greedy(path, ids, 3)) == 3


@pytest.mark.parametrize("name", ["qwen3-30b-a3b", "gpt-oss-120b", "mixtral-8x7b"])
def test_activations_stay_finite_through_every_layer(tmp_path, name):
    path = tmp_path / "deep.gguf"
    synth(path, name, n_expert=4, n_expert_used=2, report=quiet, **SMALL[name])  # full depth
    with Engine.load(path) as e:
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


def test_routing_spreads_over_the_experts_in_every_layer(tmp_path):
    # full depth and expert count, tiny widths: 64 distinct tokens should reach most of the
    # 128 experts in every layer (uniform top-8 choice: 126 expected), not a few favourites
    path = tmp_path / "route.gguf"
    synth(path, "qwen3-30b-a3b", type="Q8_0", n_embd=256, n_ff_exp=32, n_head=4, report=quiet)
    used: dict[int, set[int]] = {}
    with Engine.load(path) as e:
        e.model.trace = lambda layer, ids: used.setdefault(layer, set()).update(np.ravel(ids).tolist())
        e.forward(list(range(300, 364)))
    assert len(used) == 48
    assert min(len(s) for s in used.values()) >= 96
