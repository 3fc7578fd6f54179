"""ExpertStore / StoreReader over GGUF fixtures: every expert's bytes equal the file's own stacked
slices, the layouts match the tensor table, and a truncated or missing file gives a StorageError
that says where and why."""

from __future__ import annotations

import os
import shutil

import numpy as np
import pytest

from daemon.errors import ModelFileChanged, StorageError
from daemon.storage.experts import PROJECTIONS
from daemon.storage.gguf import GGUFFile
from daemon.storage.store import ExpertStore, StoreReader, expert_layouts
from tests.fixtures.build import fixture_path

CASES = [("qwen3moe", "Q8_0"), ("gpt-oss", "MXFP4"), ("olmoe", "Q4_K"), ("qwen2moe", "F16")]


def _stacks(g: GGUFFile) -> dict[int, dict[str, np.ndarray]]:
    """layer -> projection -> uint8 [E, N, rb]: the stacked tensors as the file holds them, with
    the row length taken from the tensor's byte size (not from moed's quant tables)."""
    out: dict[int, dict[str, np.ndarray]] = {}
    il = 0
    while f"blk.{il}.attn_norm.weight" in g.tensors:
        name = f"blk.{il}.ffn_gate_exps.weight"
        if name in g.tensors:
            out[il] = {}
            for p in PROJECTIONS:
                ti = g.tensor_info(f"blk.{il}.ffn_{p}_exps.weight")
                n, e = ti.ne[1], ti.ne[2]
                data = np.array(g.tensor_data(ti.name))  # a copy: survives closing / truncating
                assert data.size % (e * n) == 0
                out[il][p] = data.reshape(e, n, data.size // (e * n))
        il += 1
    return out


@pytest.fixture(scope="module")
def fixtures(tmp_path_factory):
    d = tmp_path_factory.mktemp("store-fx")
    return {case: fixture_path(*case, d) for case in CASES}


def _bufs(lay, fill=0xAA):
    return [np.full(lay.nbytes(p), fill, np.uint8) for p in PROJECTIONS]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(c))
def test_layouts_match_the_file(fixtures, case):
    with GGUFFile(fixtures[case]) as g:
        layouts = expert_layouts(g)
        stacks = _stacks(g)
        assert sorted(layouts) == sorted(stacks) and len(layouts) == g.get(f"{g.architecture}.block_count", int)
        for il, lay in layouts.items():
            gate = g.tensor_info(f"blk.{il}.ffn_gate_exps.weight")
            up = g.tensor_info(f"blk.{il}.ffn_up_exps.weight")
            down = g.tensor_info(f"blk.{il}.ffn_down_exps.weight")
            assert lay.n_expert == g.get(f"{g.architecture}.expert_count", int) == gate.ne[2]
            assert (lay.n_embd, lay.n_ff) == (gate.ne[0], gate.ne[1]) == (down.ne[1], down.ne[0])
            assert (lay.gate_type, lay.up_type, lay.down_type) == (gate.ggml_type, up.ggml_type, down.ggml_type)
            for p, ti in zip(PROJECTIONS, (gate, up, down)):
                rows, rb = lay.shape(p)
                assert (rows, rb) == stacks[il][p].shape[1:]
                assert lay.nbytes(p) * lay.n_expert == ti.nbytes
            assert lay.expert_nbytes * lay.n_expert == gate.nbytes + up.nbytes + down.nbytes


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(c))
async def test_every_expert_reads_back_exactly(fixtures, case):
    with GGUFFile(fixtures[case]) as g:
        layouts = expert_layouts(g)
        stacks = _stacks(g)
        store = ExpertStore.from_gguf(g, layouts)
    assert store.kind == "gguf" and store.path == os.fspath(fixtures[case])
    reader = StoreReader(store)
    await reader.open()
    try:
        for il, lay in layouts.items():
            # one at a time
            for e in range(lay.n_expert):
                assert store.location(il, e).nbytes == lay.expert_nbytes
                bufs = _bufs(lay)
                n = await reader.read_into(il, e, [memoryview(b) for b in bufs])
                assert n == lay.expert_nbytes
                for p, b in zip(PROJECTIONS, bufs):
                    assert np.array_equal(b, stacks[il][p][e].reshape(-1)), (il, e, p)
            # several in one batch, out of order
            order = list(range(lay.n_expert))[::-1]
            got: dict[int, tuple] = {}
            bufs = {e: _bufs(lay, 0x55) for e in order}
            items = [(il, e, [memoryview(b) for b in bufs[e]], lambda n, err, e=e, got=got: got.__setitem__(e, (n, err)))
                     for e in order]
            await reader.read_batch(items)
            assert got == {e: (lay.expert_nbytes, None) for e in order}
            for e in order:
                for p, b in zip(PROJECTIONS, bufs[e]):
                    assert np.array_equal(b, stacks[il][p][e].reshape(-1)), (il, e, p)
    finally:
        await reader.close()


def test_segments_lie_inside_their_tensors(fixtures):
    with GGUFFile(fixtures[("qwen3moe", "Q8_0")]) as g:
        layouts = expert_layouts(g)
        store = ExpertStore.from_gguf(g, layouts)
        for il, lay in layouts.items():
            for e in range(lay.n_expert):
                loc = store.location(il, e)
                assert loc.codec == "raw" and loc.checksum is None and len(loc.segments) == 3
                for p, (off, n) in zip(PROJECTIONS, loc.segments):
                    ti = g.tensor_info(f"blk.{il}.ffn_{p}_exps.weight")
                    assert n == ti.nbytes // lay.n_expert
                    assert off == ti.offset + e * n and off + n <= ti.offset + ti.nbytes


async def test_truncated_file_names_file_layer_expert(fixtures, tmp_path):
    """Each read's own length check, which catches a truncation that races the check of the file
    (here the file check is off, as if the truncation came after it)."""
    path = tmp_path / "m.gguf"
    shutil.copyfile(fixtures[("qwen3moe", "Q8_0")], path)
    with GGUFFile(path) as g:
        layouts = expert_layouts(g)
        stacks = _stacks(g)
        store = ExpertStore.from_gguf(g, layouts)
        last = max(layouts)
        down = g.tensor_info(f"blk.{last}.ffn_down_exps.weight")
    store.identity = None
    cut_expert = 5
    per = down.nbytes // layouts[last].n_expert
    os.truncate(path, down.offset + cut_expert * per + per // 2)
    reader = StoreReader(store)
    await reader.open()
    try:
        lay = layouts[last]
        for e in range(cut_expert):  # wholly before the cut: still fine
            bufs = _bufs(lay)
            await reader.read_into(last, e, [memoryview(b) for b in bufs])
            assert np.array_equal(bufs[2], stacks[last]["down"][e].reshape(-1))
        for e in (cut_expert, lay.n_expert - 1):  # cut through, and wholly past the end
            with pytest.raises(StorageError) as ei:
                await reader.read_into(last, e, [memoryview(b) for b in _bufs(lay)])
            msg = str(ei.value)
            assert str(path) in msg and f"layer {last}" in msg and f"expert {e}" in msg
            assert "truncated" in msg
        # a batch reports the failure per expert and reads the others
        got = {}
        items = [(last, e, [memoryview(b) for b in _bufs(lay)], lambda n, err, e=e: got.__setitem__(e, (n, err)))
                 for e in (0, cut_expert)]
        await reader.read_batch(items)
        assert got[0] == (lay.expert_nbytes, None)
        assert got[cut_expert][0] == 0 and isinstance(got[cut_expert][1], StorageError)
    finally:
        await reader.close()


async def test_changed_file_fails_every_expert_of_the_batch(fixtures, tmp_path):
    path = tmp_path / "m.gguf"
    shutil.copyfile(fixtures[("qwen3moe", "Q8_0")], path)
    with GGUFFile(path) as g:
        layouts = expert_layouts(g)
        store = ExpertStore.from_gguf(g, layouts)
    lay = layouts[0]
    reader = StoreReader(store)
    await reader.open()
    try:
        await reader.read_into(0, 1, [memoryview(b) for b in _bufs(lay)])
        os.truncate(path, path.stat().st_size - 1)  # past every expert of layer 0: they still read whole
        got = {}
        items = [(0, e, [memoryview(b) for b in _bufs(lay)], lambda n, err, e=e: got.__setitem__(e, (n, err)))
                 for e in (0, 1, 2)]
        await reader.read_batch(items)
        for e in (0, 1, 2):
            n, err = got[e]
            assert n == 0 and isinstance(err, ModelFileChanged), got[e]
            assert str(err).startswith(f"model file changed on disk: {path} (truncated from ")
            assert f"layer 0 expert {e}" in str(err)
    finally:
        await reader.close()
    reader = StoreReader(store)  # a reader opened after the change fails at once
    with pytest.raises(ModelFileChanged, match="truncated"):
        await reader.open()


async def test_missing_file_fails_on_open(fixtures, tmp_path):
    path = tmp_path / "gone.gguf"
    shutil.copyfile(fixtures[("qwen3moe", "Q8_0")], path)
    with GGUFFile(path) as g:
        store = ExpertStore.from_gguf(g, expert_layouts(g))
    path.unlink()
    reader = StoreReader(store)
    with pytest.raises(StorageError, match="gone.gguf"):
        await reader.open()
    await reader.close()  # nothing was opened: a no-op
