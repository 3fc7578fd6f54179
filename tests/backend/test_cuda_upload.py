"""The fast load (daemon/backend/cuda_upload.py): pieces planned in file order, and the bytes it
places in VRAM equal to the host repack's (layout.repack, the old load path) byte for byte, for
matrices, stacks cut across pieces, small tensors read together and every fixture expert stack.
Runs on a GPU or under numba's simulator (small sizes: every device thread runs in Python there).
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.fixtures.build import fixture_path

from .conftest import CUDA_SKIP_REASON

pytestmark = pytest.mark.skipif(CUDA_SKIP_REASON is not None, reason=str(CUDA_SKIP_REASON))


def _rng():
    return np.random.default_rng(7)


@pytest.fixture
def on_device(monkeypatch):
    """The device repack, under the simulator too (where loads repack on the host by default)."""
    from daemon.backend import cuda_upload

    monkeypatch.setattr(cuda_upload, "REPACK_ON_DEVICE", True)


# -- planning (no device) -----------------------------------------------------------------------

class _T:  # a Target's planning fields
    def __init__(self, name, offset, rows, rb):
        self.name, self.offset, self.rows, self.rb = name, offset, rows, rb
        self.nbytes = rows * rb


def _parts(pieces):
    return [(p.offset, p.nbytes, [(t.name, r0, n, at) for t, r0, n, at in p.parts]) for p in pieces]


def test_a_large_target_is_cut_into_runs_of_whole_rows():
    from daemon.backend.cuda_upload import plan

    big = _T("big", 1000, 10, 34)  # 340 bytes; chunk 100 -> 2 rows (68 bytes) a piece
    assert _parts(plan([big], chunk=100)) == [
        (1000, 68, [("big", 0, 2, 0)]), (1068, 68, [("big", 2, 2, 0)]), (1136, 68, [("big", 4, 2, 0)]),
        (1204, 68, [("big", 6, 2, 0)]), (1272, 68, [("big", 8, 2, 0)])]


def test_a_row_longer_than_the_chunk_is_a_piece_alone():
    from daemon.backend.cuda_upload import plan

    assert _parts(plan([_T("wide", 0, 2, 300)], chunk=100)) == [(0, 300, [("wide", 0, 1, 0)]),
                                                                (300, 300, [("wide", 1, 1, 0)])]


def test_small_targets_share_a_read_in_file_order():
    from daemon.backend.cuda_upload import plan

    a, b, c = _T("a", 0, 1, 40), _T("b", 64, 1, 30), _T("c", 96, 2, 20)  # given out of order below
    far = _T("far", 5000, 1, 10)  # more than `gap` past c
    assert _parts(plan([c, far, a, b], chunk=200, gap=100)) == [
        (0, 136, [("a", 0, 1, 0), ("b", 0, 1, 64), ("c", 0, 2, 96)]), (5000, 10, [("far", 0, 1, 0)])]
    # the chunk bounds a shared read: c would end at 136 > 120
    assert _parts(plan([a, b, c], chunk=120, gap=100)) == [
        (0, 94, [("a", 0, 1, 0), ("b", 0, 1, 64)]), (96, 40, [("c", 0, 2, 0)])]


# -- bytes on the device --------------------------------------------------------------------------

def _types():
    from daemon.kernels.quants import F16, MXFP4, Q4_K, Q6_K, Q8_0

    # (type, raw row bytes): Q8_0 of 32 values pads its 34-byte row to 48
    return [(Q8_0, 34), (Q8_0, 68), (MXFP4, 34), (Q4_K, 144), (Q6_K, 210), (F16, 64)]


@pytest.mark.parametrize("case", range(6))
def test_upload_matrix_is_the_host_repack(case, on_device):
    from daemon.backend.cuda_weights import upload_matrix
    from daemon.kernels.cuda.layout import repack

    qt, rb = _types()[case]
    raw = _rng().integers(0, 256, (3, 5, rb), dtype=np.uint8)  # a stack [E, N, RB]
    got = upload_matrix(raw, qt).copy_to_host()
    want = repack(raw, qt)
    assert got.shape == want.shape and got.dtype == want.dtype
    assert np.array_equal(got, want)


@pytest.mark.parametrize("device", [True, False], ids=["device-repack", "host-repack"])
def test_uploader_places_every_target_as_the_host_repack(tmp_path, monkeypatch, device):
    """Targets at scattered offsets of a file, a small chunk so that one is cut into pieces and
    others share a read, two buffers so that each is reused."""
    from numba import cuda

    from daemon.backend import cuda_upload
    from daemon.backend.cuda_upload import Target, Uploader, device_matrix
    from daemon.kernels.cuda.layout import repack
    from daemon.kernels.quants import MXFP4, Q4_K, Q8_0

    monkeypatch.setattr(cuda_upload, "REPACK_ON_DEVICE", device)
    blob = _rng().integers(0, 256, 4000, dtype=np.uint8)
    path = tmp_path / "blob"
    blob.tofile(path)
    specs = [("a", 0, 6, 34, Q8_0), ("b", 210, 1, 144, Q4_K), ("c", 400, 3, 34, MXFP4),
             ("d", 700, 20, 68, Q8_0), ("e", 2100, 1, 34, Q8_0)]
    stream = cuda.stream()
    targets = [Target(n, off, rows, rb, qt, device_matrix(rows, rb, qt, stream)) for n, off, rows, rb, qt in specs]

    class File:  # GGUFFile's read_into over the blob
        def read_into(self, offset, out, what):
            out[:] = blob[offset:offset + out.nbytes]

    seen = []
    timing = Uploader(File(), stream, chunk=400, buffers=3, readers=2).run(targets, lambda d, t: seen.append((d, t)))
    for (n, off, rows, rb, qt), t in zip(specs, targets):
        want = repack(blob[off:off + rows * rb].reshape(rows, rb), qt)
        assert np.array_equal(t.dst.copy_to_host(), want), n
    # pieces: a and b read together (354 bytes, the 6 between them too), c alone (b's read would
    # pass 400 bytes), d as 4 runs of 5 rows, e alone
    assert timing.pieces == len(seen) == 7
    assert timing.bytes == 354 + 102 + 1360 + 34 and seen[-1] == (timing.bytes, timing.bytes)


def test_a_failed_read_fails_the_load(tmp_path):
    from numba import cuda

    from daemon.backend.cuda_upload import Target, Uploader, device_matrix
    from daemon.errors import StorageError
    from daemon.kernels.quants import Q8_0

    stream = cuda.stream()
    targets = [Target(f"t{i}", 100 * i, 1, 34, Q8_0, device_matrix(1, 34, Q8_0, stream)) for i in range(3)]

    class File:
        def read_into(self, offset, out, what):
            if offset == 100:
                raise StorageError(f"cannot read {what}")
            out[:] = 0

    with pytest.raises(StorageError, match="t1"):
        Uploader(File(), stream, chunk=34, buffers=2, readers=2).run(targets)


def test_read_into_reads_what_tensor_data_reads(fixture_dir):
    from daemon.storage.gguf import GGUFFile

    with GGUFFile(fixture_path("qwen3moe", "Q8_0", fixture_dir, n_layer=1)) as g:
        name = "blk.0.ffn_gate_exps.weight"
        info = g.tensor_info(name)
        out = np.full(info.nbytes, 7, np.uint8)
        g.read_into(info.offset, out, name)
        assert np.array_equal(out, g.tensor_data(name))


def test_device_experts_hold_the_host_repack_of_every_stack(fixture_dir, monkeypatch, on_device):
    """The fixture's expert stacks loaded as the engine loads them (chunks small enough that a
    stack spans several) against the old path: each stack read whole and repacked on the host."""
    from numba import cuda

    from daemon.backend import cuda_upload
    from daemon.backend.cuda_experts import DeviceExperts
    from daemon.kernels.cuda.layout import repack
    from daemon.model.weights import TensorSource
    from daemon.storage.experts import PROJECTIONS
    from daemon.storage.gguf import GGUFFile

    monkeypatch.setattr(cuda_upload, "CHUNK", 5000)
    with GGUFFile(fixture_path("qwen3moe", "Q8_0", fixture_dir, n_layer=1, n_embd=64, n_ff_exp=64,
                               n_expert=4, n_expert_used=2)) as g:
        noted = {}
        dev = DeviceExperts.from_gguf(g, lambda n, b: noted.__setitem__(n, b), cuda.stream())
        src = TensorSource(g)
        lay = dev.layout(0)
        batch = dev._batches[0]
        for p in PROJECTIONS:
            k, n = (lay.n_ff, lay.n_embd) if p == "down" else (lay.n_embd, lay.n_ff)
            raw, qt = src.stacked(f"blk.0.ffn_{p}_exps.weight", k, n, lay.n_expert)
            want = repack(raw, qt)  # [E, N, stride]
            got = getattr(batch, p).copy_to_host()
            assert got.shape == want.shape and np.array_equal(got, want), p
            assert noted[f"blk.0.ffn_{p}_exps.weight"] == want.nbytes


def test_engine_load_reports_the_upload_bytes_as_part_of_its_step(fixture_dir):
    """Engine.load onto the CUDA backend with a Progress (as the daemon's load_engine passes it):
    the expert upload's bytes are reported between the "uploading experts" step and the next."""
    from daemon.engine import Engine
    from daemon.progress import Progress

    reports = []
    bar = Progress("load", 4, report=lambda *r: reports.append(r))
    path = fixture_path("qwen3moe", "Q8_0", fixture_dir, n_layer=1, n_embd=64, n_ff_exp=64, n_expert=4,
                        n_expert_used=2)
    with Engine.load(path, device="cuda", progress=bar):
        pass
    notes = [r for r in reports if "GB" in r[2]]
    assert notes, reports
    assert [r[2] for r in reports[1:3]] == [f"reading {path}", "uploading experts to cuda:0"]
    assert all(50.0 < pct <= 75.0 and note.startswith("uploading experts ") for _, pct, note in notes)
    assert notes[-1][1] == 75.0 and reports[len(notes) + 3][2] == "building qwen3moe model"
