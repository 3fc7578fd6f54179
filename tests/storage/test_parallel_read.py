"""The compute thread's parallel expert reads (daemon/storage/parallel_read.py)."""

from __future__ import annotations

import os
import shutil

import numpy as np
import pytest

from daemon.errors import ModelFileChanged, StorageError
from daemon.storage import parallel_read
from daemon.storage.experts import PROJECTIONS
from daemon.storage.gguf import GGUFFile
from daemon.storage.parallel_read import ParallelReader
from daemon.storage.store import ExpertStore, expert_layouts
from tests.fixtures.build import fixture_path


def _store(path):
    with GGUFFile(path) as g:
        layouts = expert_layouts(g)
        return ExpertStore.from_gguf(g, layouts), layouts


def _expected(path, layer, expert, layout):
    """The expert's bytes, straight from the file with numpy (not through the reader)."""
    store, _ = _store(path)
    loc = store.location(layer, expert)
    blob = b"".join(open(path, "rb").read()[o:o + n] for o, n in loc.segments)
    sizes = [layout.nbytes(p) for p in PROJECTIONS]
    return [np.frombuffer(blob[sum(sizes[:i]):sum(sizes[:i + 1])], np.uint8) for i in range(3)]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return fixture_path("qwen3moe", "Q8_0", tmp_path_factory.mktemp("pread-fx"))


def _dests(layout, n):
    return [tuple(np.full(layout.shape(p), 0xAB, np.uint8) for p in PROJECTIONS) for _ in range(n)]


@pytest.mark.parametrize("chunk", [parallel_read.CHUNK, 1000, 64])  # experts split into many chunks
def test_reads_every_byte(model, monkeypatch, chunk):
    monkeypatch.setattr(parallel_read, "CHUNK", chunk)
    store, layouts = _store(model)
    r = ParallelReader(store)
    try:
        for layer, lay in layouts.items():
            experts = list(range(lay.n_expert))[::-1]
            dests = _dests(lay, len(experts))
            results = r.read(layer, experts, dests)
            assert results == [(lay.expert_nbytes, None)] * len(experts)
            for e, d in zip(experts, dests):
                for got, want in zip(d, _expected(model, layer, e, lay)):
                    assert np.array_equal(got.reshape(-1), want), (layer, e)
    finally:
        r.close()


def test_a_truncated_copy_fails_the_experts_past_the_end(model, tmp_path):
    path = tmp_path / "copy.gguf"
    shutil.copy(model, path)
    store, layouts = _store(path)
    layer, lay = next(iter(layouts.items()))
    last = store.location(layer, lay.n_expert - 1).segments[-1]
    os.truncate(path, last[0] + last[1] // 2)  # cuts the last expert's down slice
    store.identity = None  # a changed identity is tested below; here: the short read itself
    r = ParallelReader(store)
    try:
        results = r.read(layer, [0, lay.n_expert - 1], _dests(lay, 2))
    finally:
        r.close()
    assert results[0] == (lay.expert_nbytes, None)
    n, err = results[1]
    assert n == 0 and isinstance(err, StorageError)
    assert f"layer {layer} expert {lay.n_expert - 1}" in str(err) and "short read" in str(err)


def test_a_changed_file_fails_the_whole_batch(model, tmp_path):
    path = tmp_path / "copy.gguf"
    shutil.copy(model, path)
    store, layouts = _store(path)
    layer, lay = next(iter(layouts.items()))
    r = ParallelReader(store)
    try:
        assert r.read(layer, [1], _dests(lay, 1)) == [(lay.expert_nbytes, None)]
        with open(path, "ab") as f:  # grown: no longer the file that was validated
            f.write(b"\0" * 64)
        results = r.read(layer, [1, 2], _dests(lay, 2))
    finally:
        r.close()
    assert all(n == 0 and isinstance(err, ModelFileChanged) for n, err in results)


def test_a_missing_file_is_a_storage_error(model, tmp_path):
    path = tmp_path / "copy.gguf"
    shutil.copy(model, path)
    store, layouts = _store(path)
    os.unlink(path)
    layer, lay = next(iter(layouts.items()))
    r = ParallelReader(store)
    results = r.read(layer, [0], _dests(lay, 1))
    r.close()
    (n, err), = results
    assert n == 0 and isinstance(err, StorageError) and "copy.gguf" in str(err)
