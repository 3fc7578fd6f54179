"""Hyper-parameters the file states but cannot back: counts larger than its tensors, and float
values that are not finite, or not positive where the model divides by them or takes their log.
Each must be a GGUFError naming the key, at load, and never a MemoryError, a math error or a
model that computes NaNs."""

from __future__ import annotations

import pytest
from gguf import GGUFValueType as VT

from daemon.errors import GGUFError
from daemon.model.transformer import Transformer
from daemon.storage.gguf import GGUFFile
from tests.fixtures.build import fixture_path
from tests.storage.rewrite import rewrite_gguf

NAN, INF = float("nan"), float("inf")


def _load_with(tmp_path, fixture_dir, arch, wtype, **keys):
    """Transformer over a copy of the fixture with metadata keys replaced: a__b=(type, value) sets
    `{arch}.a.b`."""
    src = fixture_path(arch, wtype, fixture_dir)
    set_keys = {f"{arch}.{k.replace('__', '.')}": v for k, v in keys.items()}
    dst = rewrite_gguf(src, tmp_path / "m.gguf", set_keys=set_keys)
    with GGUFFile(dst) as g:
        return Transformer(g)


@pytest.mark.parametrize("arch,wtype", [("qwen3moe", "Q8_0"), ("gpt-oss", "MXFP4"), ("llama", "Q8_0")])
@pytest.mark.parametrize("count", [2**31 - 1, 3, 2**32 - 1])
def test_block_count_beyond_the_tensors(tmp_path, fixture_dir, arch, wtype, count):
    with pytest.raises(GGUFError, match=rf"{arch}\.block_count = {count}.* 2 blocks"):
        _load_with(tmp_path, fixture_dir, arch, wtype, block_count=(VT.UINT32, count))


FLOATS = {  # key -> bad values
    "attention.layer_norm_rms_epsilon": [NAN, INF, -INF, 0.0, -1e-5],
    "rope.freq_base": [NAN, INF, 0.0, -10000.0],
    "expert_weights_scale": [NAN, INF],
}


@pytest.mark.parametrize("key,value", [(k, v) for k, vs in FLOATS.items() for v in vs])
def test_bad_float_metadata_is_named(tmp_path, fixture_dir, key, value):
    with pytest.raises(GGUFError, match=rf"qwen3moe\.{key.replace('.', '[.]')}"):
        _load_with(tmp_path, fixture_dir, "qwen3moe", "Q8_0", **{key.replace(".", "__"): (VT.FLOAT32, value)})


def test_float64_that_overflows_float32_is_refused(tmp_path, fixture_dir):
    """The model computes in float32: 1e300 is finite as a float64 but infinite there."""
    with pytest.raises(GGUFError, match=r"layer_norm_rms_epsilon"):
        _load_with(tmp_path, fixture_dir, "qwen3moe", "Q8_0", attention__layer_norm_rms_epsilon=(VT.FLOAT64, 1e300))


@pytest.mark.parametrize("key,vtype,value", [
    ("rope.scaling.factor", VT.FLOAT32, NAN),
    ("rope.scaling.factor", VT.FLOAT32, INF),
    ("rope.scaling.factor", VT.FLOAT32, -2.0),
    ("rope.scaling.factor", VT.FLOAT64, 1e-300),  # 0 as a float32, and 1 / it infinite
    ("rope.scaling.attn_factor", VT.FLOAT32, NAN),
    ("rope.scaling.attn_factor", VT.FLOAT32, 0.0),
    ("rope.freq_base", VT.FLOAT32, 1.0),  # YaRN divides by log(base)
])
def test_bad_yarn_metadata_is_named(tmp_path, fixture_dir, key, vtype, value):
    with pytest.raises(GGUFError, match=rf"gpt-oss\.{key.replace('.', '[.]')}"):
        _load_with(tmp_path, fixture_dir, "gpt-oss", "MXFP4", **{key.replace(".", "__"): (vtype, value)})


def test_context_length_zero_is_refused(tmp_path, fixture_dir):
    with pytest.raises(GGUFError, match=r"qwen3moe\.context_length"):
        _load_with(tmp_path, fixture_dir, "qwen3moe", "Q8_0", context_length=(VT.UINT32, 0))


def test_good_values_still_load(tmp_path, fixture_dir):
    model = _load_with(tmp_path, fixture_dir, "qwen3moe", "Q8_0", rope__freq_base=(VT.FLOAT64, 5e5),
                       attention__layer_norm_rms_epsilon=(VT.FLOAT32, 1e-6))
    assert model.hp.rope.freq_base == 5e5 and model.hp.n_layer == 2
