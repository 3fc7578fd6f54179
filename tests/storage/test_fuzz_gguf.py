"""The GGUF mutation fuzzer (benchmarks/fuzz_gguf.py): its layout parser and mutators, that it
tells a crash, a hang and a stray exception from a clean error, and a 200-mutant run that must end
with no crash, no hang and every failure a MoedError."""

from __future__ import annotations

import struct

import gguf
import pytest

from tests.bench_script import load_script
from tests.fixtures.build import fixture_path

fuzz = load_script("fuzz_gguf")
SEEDS = ["qwen3moe:Q8_0", "gpt-oss:MXFP4", "llama-moe:Q4_K"]


@pytest.fixture(scope="module")
def seeds(fixture_dir):
    return fuzz.load_seeds(SEEDS, fixture_dir)


def test_layout_matches_gguf_py(fixture_dir):
    """Every field offset the mutators use points where gguf-py's reader found that field."""
    path = fixture_path("gpt-oss", "MXFP4", fixture_dir)
    data = path.read_bytes()
    lay = fuzz.parse_layout(data)
    ref = gguf.GGUFReader(path)
    assert [t.name for t in lay.tensors] == [t.name for t in ref.tensors]
    assert [k.key for k in lay.kvs] == list(ref.fields)[3:]  # gguf-py adds 3 header pseudo-fields
    assert lay.data_offset == ref.data_offset
    for t, r in zip(lay.tensors, ref.tensors):
        assert data[t.name_off:t.name_off + len(t.name)] == t.name.encode()
        assert struct.unpack_from("<I", data, t.ndims_off)[0] == len(r.shape)
        assert [struct.unpack_from("<q", data, o)[0] for o in t.ne_offs] == [int(d) for d in r.shape]
        assert struct.unpack_from("<I", data, t.type_off)[0] == int(r.tensor_type)
        assert lay.tensor_range(t) == (int(r.data_offset), int(r.data_offset) + int(r.n_bytes))
    for k in lay.kvs:
        f = ref.fields[k.key]
        assert k.vtype == int(f.types[0])
        if k.arr_len_off is not None:
            assert struct.unpack_from("<Q", data, k.arr_len_off)[0] == len(f.data)


def test_every_mutator_changes_the_file(seeds):
    for name, _, mutate in fuzz.MUTATORS:
        for i in range(20):
            seed = seeds[i % len(seeds)]
            m = fuzz.Mutant(bytearray(seed.data), seed.layout, fuzz.random.Random(f"{name}:{i}"), seed.data)
            mutate(m)
            assert m.notes, name
            if bytes(m.buf) != seed.data:
                break
        else:
            pytest.fail(f"{name} never changed the file in 20 tries")


def test_mutants_are_reproducible(seeds):
    a, b = fuzz.make_mutant(7, 3, seeds), fuzz.make_mutant(7, 3, seeds)
    assert (a.data, a.description, a.limit_mb) == (b.data, b.description, b.limit_mb)
    assert fuzz.make_mutant(8, 3, seeds).description != a.description or fuzz.make_mutant(8, 3, seeds).data != a.data


def test_crash_hang_and_stray_exception_are_told_apart(seeds):
    """The 0-crash, 0-hang assertion below means something only if these are seen."""
    kinds = ["crash", "hang", "other", "clean", "ok"]
    seed = seeds[0]

    def spec(i: int):
        return fuzz.MutantSpec(i, seed, 2.0, ["selftest"], f"selftest {kinds[i]}", b"", path_kind="devnull",
                               selftest=kinds[i])

    opts = fuzz.RunOptions(jobs=1, timeout=3, slow_timeout=3)
    results = fuzz.Runner(opts, warm=[]).run(spec, len(kinds), progress=None)
    assert [r.kind for r in results] == kinds
    assert results[0].type == "killed by SIGSEGV"
    assert results[2].type == "KeyError"


@pytest.mark.slow
def test_200_mutants_fail_only_with_moed_errors(fixture_dir, tmp_path):
    opts = fuzz.RunOptions(jobs=2, timeout=30, slow_timeout=120, keep=tmp_path / "failing")
    report = fuzz.run_fuzz(200, run_seed=2024, opts=opts, fixture_dir=fixture_dir, progress=None)
    summary = report.summary()
    print(summary)
    assert len(report.results) == 200
    assert report.count("ok") > 0 and report.count("clean") > 0, summary  # the run did something
    assert report.count("crash") == 0, summary
    assert report.count("hang") == 0, summary
    assert report.count("other") == 0, summary
