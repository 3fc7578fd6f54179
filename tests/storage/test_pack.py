"""The expert pack: bit-exact round trips (zstd and raw), alignment, the report, and every way a
pack can be unusable (stale, corrupt, truncated), which must give None and a warning, never a raise."""

from __future__ import annotations

import io
import logging
import os
import shutil

import numpy as np
import pytest

from daemon.errors import ConfigError, ModelError, StorageError
from daemon.storage import pack
from daemon.storage.experts import PROJECTIONS
from daemon.storage.gguf import GGUFFile
from daemon.storage.store import StoreReader, expert_layouts
from tests.fixtures.build import fixture_path


@pytest.fixture
def model(fixture_dir, tmp_path):
    """A private copy of a fixture (tests write packs beside it and rewrite it)."""
    def make(arch="qwen3moe", wtype="Q8_0", name="m.gguf", **kw):
        dst = tmp_path / name
        shutil.copyfile(fixture_path(arch, wtype, fixture_dir, **kw), dst)
        return dst
    return make


def _open(model_path, **kw):
    g = GGUFFile(model_path)
    return g, expert_layouts(g), pack.open_pack(model_path, g, expert_layouts(g), **kw)


def _slice(g, layer, p, e, n):
    return g.tensor_data(f"blk.{layer}.ffn_{p}_exps.weight")[e * n:(e + 1) * n].tobytes()


async def _read_all(store, g):
    """Reads every expert through the store and compares it with the GGUF's own slices."""
    reader = StoreReader(store)
    await reader.open()
    try:
        for il, lay in store.layouts.items():
            for e in range(lay.n_expert):
                bufs = [np.full(lay.nbytes(p), 0xAA, np.uint8) for p in PROJECTIONS]
                got = await reader.read_into(il, e, [memoryview(b) for b in bufs])
                assert got == store.location(il, e).nbytes
                for p, b in zip(PROJECTIONS, bufs):
                    assert b.tobytes() == _slice(g, il, p, e, lay.nbytes(p)), (il, e, p)
    finally:
        await reader.close()


@pytest.mark.parametrize("arch,wtype,min_saving,codec", [
    ("qwen3moe", "F16", 0.0, "zstd"),  # F16 compresses a little: forced
    ("qwen3moe", "Q4_K", 1.0, "raw"),  # nothing saves 100%: forced raw
    ("olmoe", "Q8_0", 0.10, None),
    ("gpt-oss", "MXFP4", 0.0, None),
    ("qwen3moe", "Q6_K", 0.10, None),
])
async def test_round_trip_bit_exact(model, arch, wtype, min_saving, codec):
    path = model(arch, wtype)
    report = pack.write_pack(path, min_saving=min_saving)
    assert report.path == pack.pack_path(path) == str(path) + ".moepack"
    g, layouts, store = _open(path)
    assert store is not None and store.kind == "pack" and store.path == report.path
    locs = [loc for il in layouts for loc in store.locations[il]]
    assert len(locs) == sum(lay.n_expert for lay in layouts.values())
    for loc in locs:
        (off, _), = loc.segments
        assert off % 4096 == 0 and loc.checksum is not None
        if codec:
            assert loc.codec == codec
    await _read_all(store, g)
    g.close()


def test_report_adds_up(model):
    path = model("qwen3moe", "F16")
    report = pack.write_pack(path, min_saving=0.05)
    g, layouts, store = _open(path)
    t = report.total
    assert t.experts == sum(lay.n_expert for lay in layouts.values())
    assert t.raw == sum(lay.expert_nbytes * lay.n_expert for lay in layouts.values())
    locs = [loc for il in layouts for loc in store.locations[il]]
    assert t.stored == sum(loc.nbytes for loc in locs)
    assert t.compressed == sum(loc.codec == "zstd" for loc in locs) > 0
    for il in layouts:  # a compressed expert saved at least min_saving
        for loc in store.locations[il]:
            raw = layouts[il].expert_nbytes
            assert loc.nbytes == raw if loc.codec == "raw" else loc.nbytes <= raw * 0.95
    for f in ("raw", "stored", "compressed", "experts"):
        assert getattr(t, f) == sum(getattr(s, f) for s in report.types.values())
    assert set(report.types) == {"F16"}
    assert t.stored < t.raw and 0.05 <= t.saving < 1
    assert report.file_size == os.path.getsize(report.path) and report.elapsed > 0 and report.throughput > 0
    assert "F16" in report.table() and "total" in report.table()
    g.close()


def test_zstd_only_where_it_saves():
    zeros, noise = bytes(65536), np.random.default_rng(0).bytes(65536)
    assert pack._encode(zeros, 3, 0.10)[0] == 1
    assert pack._encode(noise, 3, 0.0) == (0, noise)  # incompressible: raw even at 0%
    half = zeros[:32768] + noise[:32768]  # saves about half
    assert pack._encode(half, 3, 0.4)[0] == 1
    assert pack._encode(half, 3, 0.6) == (0, half)


def test_progress_and_no_leftovers(model, tmp_path):
    path = model()
    out = tmp_path / "sub" / "x.pack"
    out.parent.mkdir()
    stream = io.StringIO()
    pack.write_pack(path, out, progress=stream)
    assert "packing" in stream.getvalue() and "100%" in stream.getvalue()
    assert os.listdir(out.parent) == ["x.pack"]  # the temp file was renamed
    g, _, store = _open(path, path=out)
    assert store is not None and store.path == str(out)
    g.close()


def test_absent_pack_is_silent(model, caplog):
    path = model()
    with caplog.at_level(logging.WARNING, "moed"):
        g, _, store = _open(path)
    assert store is None and not caplog.records
    g.close()


def test_copied_model_keeps_its_pack(model, tmp_path):
    path = model()
    pack.write_pack(path)
    other = tmp_path / "copy"
    other.mkdir()
    for p in (path, pack.pack_path(path)):
        shutil.copyfile(p, other / os.path.basename(p))
    os.utime(other / "m.gguf", (1, 1))  # mtime is not part of the identity
    g, _, store = _open(other / "m.gguf")
    assert store is not None
    g.close()


def _warned(caplog, path, reason):
    """open_pack(path) returns None and warns once, naming `reason` and the fallback."""
    caplog.clear()
    with caplog.at_level(logging.WARNING, "moed"):
        g, _, store = _open(path)
    g.close()
    assert store is None
    msgs = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(msgs) == 1 and reason in msgs[0] and "GGUF file instead" in msgs[0], msgs
    return msgs[0]


def _patch(path, offset, data):
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


def _flip(path, offset, mask=0x01):
    """Flips bits of the byte at offset."""
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([b ^ mask]))


def test_stale_changed_expert_byte(model, caplog):
    path = model()
    pack.write_pack(path)
    with GGUFFile(path) as g:
        ti = g.tensor_info("blk.1.ffn_up_exps.weight")
        off = ti.offset + 100
    _flip(path, off)
    _warned(caplog, path, "stale: the model's tensor data differs")


def test_stale_other_model_same_path(model, caplog):
    path = model("qwen3moe", "Q8_0")
    pack.write_pack(path)
    model("qwen3moe", "Q8_0", seed=1)  # same size, same header, other weights
    _warned(caplog, path, "stale")
    model("olmoe", "Q8_0")
    _warned(caplog, path, "stale: made from a model of")


def test_stale_header(model, caplog):
    path = model()
    pack.write_pack(path)
    with GGUFFile(path) as g:
        key_pos = path.read_bytes()[:g.data_offset].index(b"general.architecture")
    _patch(path, key_pos, b"G")  # same size, metadata differs
    _warned(caplog, path, "stale: the model's header")


@pytest.mark.parametrize("what,reason", [
    ("magic", "bad magic"),
    ("version", "format version 7"),
    ("index", "header checksum mismatch"),
    ("crc", "header checksum mismatch"),
    ("short header", "truncated header"),
    ("empty", "truncated header"),
    ("truncated", "truncated: layer"),
])
def test_corrupt_pack(model, caplog, what, reason):
    path = model()
    pack.write_pack(path)
    pp = pack.pack_path(path)
    with GGUFFile(path) as g:
        n_hdr = pack._header_size(sum(lay.n_expert for lay in expert_layouts(g).values()))
    if what == "magic":
        _patch(pp, 0, b"NOTAPACK")
    elif what == "version":
        _patch(pp, 8, (7).to_bytes(4, "little"))
    elif what == "index":
        _patch(pp, pack._PREFIX.size + 9, b"\xff")  # an offset in the first entry
    elif what == "crc":
        _flip(pp, n_hdr - 1)
    else:
        size = {"short header": n_hdr - 10, "empty": 0, "truncated": os.path.getsize(pp) - 1}[what]
        os.truncate(pp, size)
    _warned(caplog, path, reason)


def test_index_not_matching_the_model(model, caplog):
    path = model()
    pack.write_pack(path)
    g = GGUFFile(path)
    layouts = expert_layouts(g)
    first = min(layouts)
    n_all, n_first = sum(lay.n_expert for lay in layouts.values()), layouts[first].n_expert
    with caplog.at_level(logging.WARNING, "moed"):
        assert pack.open_pack(path, g, {first: layouts[first]}) is None
    assert f"index holds {n_all} experts, the model has {n_first}" in caplog.text
    g.close()


@pytest.mark.parametrize("min_saving", [0.0, 1.0])  # zstd blob, raw blob
async def test_corrupt_blob_fails_the_read(model, min_saving):
    path = model("qwen3moe", "F16")
    pack.write_pack(path, min_saving=min_saving)
    g, layouts, store = _open(path)
    g.close()
    il = max(layouts)
    (off, n), = store.location(il, 3).segments
    _flip(store.path, off + n // 2, 0x10)  # corrupt on disk before the load (after it, the pack changed)
    g, layouts, store = _open(path)
    reader = StoreReader(store)
    await reader.open()
    lay = layouts[il]
    bufs = [memoryview(bytearray(lay.nbytes(p))) for p in PROJECTIONS]
    await reader.read_into(il, 2, bufs)  # its neighbour is intact
    with pytest.raises(StorageError, match="checksum mismatch|bad zstd frame"):
        await reader.read_into(il, 3, bufs)
    await reader.close()
    g.close()


def test_write_errors(model, fixture_dir, tmp_path):
    path = model()
    with pytest.raises(ConfigError, match="overwrite the model"):
        pack.write_pack(path, path)
    with pytest.raises(ConfigError, match="level"):
        pack.write_pack(path, level=0)
    with pytest.raises(ConfigError, match="min_saving"):
        pack.write_pack(path, min_saving=1.5)
    with pytest.raises(ModelError, match="no stacked expert tensors"):
        pack.write_pack(fixture_path("llama", "Q8_0", fixture_dir), tmp_path / "dense.pack")
    assert not os.path.exists(pack.pack_path(path))


def test_unwritable_destination(model, tmp_path):
    with pytest.raises(StorageError, match="cannot write"):
        pack.write_pack(model(), tmp_path / "no-such-dir" / "x.pack")
