"""A model file that changes, or is not what it seems, while moed uses it.

Nothing moed touches per request may be a mapping of a file that can change (touching a page past
a truncated end raises SIGBUS, which kills the process): truncating, rewriting or replacing a
loaded model must fail the request with ModelFileChanged, never crash it or silently change the
output. The truncation cases run in a child process, so a SIGBUS fails the test instead of killing
pytest. Also here: a FIFO as the model (or pack) path, a file that is not a GGUF (the error must not
echo its bytes), and an expert tensor whose name was corrupted."""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

from daemon.engine import Engine
from daemon.errors import GGUFError, ModelError, ModelFileChanged
from daemon.model.transformer import Transformer
from daemon.storage import pack
from daemon.storage.cache import ExpertCache
from daemon.storage.gguf import GGUFFile
from daemon.storage.store import ExpertStore, expert_layouts
from tests.fixtures.build import fixture_path
from tests.storage.rewrite import rewrite_gguf

REPO = Path(__file__).resolve().parents[2]
TINY_CACHE_MB = 0.01  # no slot at all: every step reads its experts from the file
PROMPT, NEXT = [1, 2, 3, 4, 5, 6], [7, 8, 9, 10]


@pytest.fixture(scope="module")
def output_last(tmp_path_factory, fixture_dir) -> Path:
    """A qwen3moe fixture whose last tensor is a resident one (output.weight), so a truncation hits
    weights that are used on every step, not only experts."""
    src = fixture_path("qwen3moe", "Q8_0", fixture_dir)
    return rewrite_gguf(src, tmp_path_factory.mktemp("changes") / "output-last.gguf", last=["output.weight"])


@pytest.fixture
def model(tmp_path, output_last):
    """A private copy of the output-last fixture (the tests change it)."""
    path = tmp_path / "m.gguf"
    shutil.copyfile(output_last, path)
    return path


def _load(path, **kw) -> Engine:
    return Engine.load(path, **{"expert_cache_limit_mb": TINY_CACHE_MB, "expert_pack": False, **kw})


# --------------------------------------------------------------------------- truncation (child process)

CHILD = r"""
import os, sys
from daemon.engine import Engine
from daemon.errors import ModelFileChanged
path, cut = sys.argv[1], int(sys.argv[2])
with Engine.load(path, expert_cache_limit_mb=float(sys.argv[3]), expert_pack=False) as engine:
    engine.forward([1, 2, 3, 4, 5, 6])
    os.truncate(path, cut)
    for what, run in (("forward", lambda: engine.forward([7, 8, 9, 10])),
                      ("forward again", lambda: engine.forward([7, 8, 9, 10])),
                      ("tensor_data", lambda: engine.gguf.tensor_data("output.weight").sum())):
        try:
            run()
        except ModelFileChanged as e:
            print(f"{what}: ModelFileChanged: {e}", flush=True)
        else:
            print(f"{what}: no error", flush=True)
"""


@pytest.mark.parametrize("cut", ["4KiB", "half"])
def test_truncated_model_fails_the_request_not_the_process(model, cut):
    size = model.stat().st_size
    new_size = size - 4096 if cut == "4KiB" else size // 2
    r = subprocess.run([sys.executable, "-c", CHILD, str(model), str(new_size), str(TINY_CACHE_MB)],
                       capture_output=True, text=True, timeout=300, cwd=REPO)
    assert r.returncode == 0, f"child died with {r.returncode} (-7 is SIGBUS)\n{r.stdout}\n{r.stderr[-3000:]}"
    lines = r.stdout.splitlines()
    assert len(lines) == 3, r.stdout
    for line in lines:
        assert "ModelFileChanged: model file changed on disk: " + str(model) in line, r.stdout
        assert f"truncated from {size} to {new_size} bytes" in line, r.stdout


# --------------------------------------------------------------------------- in-place changes

def _overwrite(path, offset, data, bump_mtime=True):
    """Write data at offset, in place (same inode, same size). The mtime is moved on by a second
    explicitly, as the write itself would on a clock finer than the file system's timestamps."""
    st = os.stat(path)
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)
    if bump_mtime:
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    assert os.stat(path).st_size == st.st_size


def test_overwritten_expert_bytes_fail_the_request(model):
    with _load(model) as engine:
        before = engine.forward(PROMPT)
        ti = engine.gguf.tensor_info("blk.1.ffn_down_exps.weight")
        data = np.fromfile(model, np.uint8, ti.nbytes, offset=ti.offset)
        _overwrite(model, ti.offset, data[::-1].tobytes())
        for _ in range(2):  # and it stays failed: the model is no longer the one loaded
            with pytest.raises(ModelFileChanged, match="model file changed on disk: .*m.gguf .*modified") as ei:
                engine.forward(PROMPT)
            assert str(model) in str(ei.value)
    with _load(model) as engine:  # a fresh load takes the new bytes
        assert not np.array_equal(engine.forward(PROMPT), before)


def test_rewrite_that_restores_the_mtime_fails_the_request(model):
    """Issue 25: reverse an expert tensor's bytes in place and set the old mtime back. Only the
    ctime shows it; the content, checked against the fingerprint taken at load, decides."""
    with _load(model) as engine:
        engine.forward(PROMPT)
        st0 = os.stat(model)  # as loaded
        ti = engine.gguf.tensor_info("blk.1.ffn_down_exps.weight")
        data = np.fromfile(model, np.uint8, ti.nbytes, offset=ti.offset)
        _overwrite(model, ti.offset, data[::-1].tobytes(), bump_mtime=False)
        os.utime(model, ns=(st0.st_atime_ns, st0.st_mtime_ns))
        _wait_ctime_after(model, st0.st_ctime_ns)
        assert os.stat(model).st_mtime_ns == st0.st_mtime_ns
        for _ in range(2):
            with pytest.raises(ModelFileChanged, match=r"m\.gguf \(modified: its content changed"):
                engine.forward(PROMPT)


def test_rewrite_that_restores_the_mtime_under_a_pack_fails_the_request(model):
    """The same rewrite of the GGUF while its pack serves the experts: the pack's source check."""
    pack.write_pack(model)
    with _load(model, expert_pack=True) as engine:
        assert engine.stats()["cache"]["source"] == "pack"
        engine.forward(PROMPT)
        st0 = os.stat(model)
        ti = engine.gguf.tensor_info("blk.1.ffn_down_exps.weight")
        _overwrite(model, ti.offset, b"\0" * 64, bump_mtime=False)
        os.utime(model, ns=(st0.st_atime_ns, st0.st_mtime_ns))
        _wait_ctime_after(model, st0.st_ctime_ns)
        with pytest.raises(ModelFileChanged, match=r"m\.gguf \(modified: its content changed"):
            engine.forward(PROMPT)


def test_status_changes_with_the_same_content_keep_serving(model, tmp_path):
    """chmod, a hard link, a rename away and back, a touch that sets the times back: the ctime
    moves, the bytes do not, and the model keeps serving the same logits."""
    with _load(model) as engine:
        a = engine.forward(PROMPT)
        st = os.stat(model)
        for change in (lambda: os.chmod(model, 0o640), lambda: os.link(model, tmp_path / "link.gguf"),
                       lambda: os.utime(model, ns=(st.st_atime_ns, st.st_mtime_ns))):
            before = os.stat(model).st_ctime_ns
            change()
            _wait_ctime_after(model, before)
            assert np.array_equal(engine.forward(PROMPT), a)
        assert engine.gguf.identity.ctime_ns == os.stat(model).st_ctime_ns  # re-verified once, then cheap


def _wait_ctime_after(path, before):
    """Coarse file-system clocks may give a change the ctime of the one before it: touch again
    (a chmod to the same mode) until it moves, so the test sees a ctime change every time."""
    mode = os.stat(path).st_mode & 0o7777
    for _ in range(1000):
        if os.stat(path).st_ctime_ns != before:
            return
        os.chmod(path, mode)
    pytest.fail("the ctime did not move")


def test_replaced_file_fails_the_request(model, tmp_path):
    other = tmp_path / "other.gguf"
    shutil.copyfile(model, other)
    with _load(model) as engine:
        engine.forward(PROMPT)
        os.replace(other, model)  # same bytes, another inode
        with pytest.raises(ModelFileChanged, match="replaced"):
            engine.forward(PROMPT)


def test_removed_file_fails_the_request(model):
    with _load(model) as engine:
        engine.forward(PROMPT)
        model.unlink()
        with pytest.raises(ModelFileChanged, match="removed"):
            engine.forward(PROMPT)


def test_unchanged_file_keeps_working(model):
    """The checks see no change where there is none, including a read-only touch (atime)."""
    with _load(model) as engine, _load(model, expert_cache_limit_mb=0.0) as unlimited:
        a = engine.forward(PROMPT)
        st = os.stat(model)
        os.utime(model, ns=(st.st_atime_ns + 10**9, st.st_mtime_ns))
        assert np.array_equal(engine.forward(PROMPT), a)
        assert np.array_equal(unlimited.forward(PROMPT), a)


def test_fetch_raises_model_file_changed_itself(model):
    """The cache hands the caller of fetch the ModelFileChanged of the read, not a wrapper."""
    with GGUFFile(model) as g:
        store = ExpertStore.from_gguf(g, expert_layouts(g))
    with ExpertCache(store, TINY_CACHE_MB) as cache:
        with cache.fetch(0, [0, 1]):
            pass
        _overwrite(model, store.location(0, 1).segments[0][0], b"\0" * 16)
        with pytest.raises(ModelFileChanged) as ei, cache.fetch(0, [0, 1]):
            pass
        assert type(ei.value) is ModelFileChanged and "layer 0" in str(ei.value)


def test_pack_change_fails_the_request(model):
    pack.write_pack(model)
    with _load(model, expert_pack=True) as engine:
        assert engine.stats()["cache"]["source"] == "pack"
        engine.forward(PROMPT)
        os.truncate(pack.pack_path(model), os.path.getsize(pack.pack_path(model)) - 4096)
        with pytest.raises(ModelFileChanged, match=r"\.moepack \(truncated"):
            engine.forward(PROMPT)
    with _load(model, expert_pack=True) as engine:  # the GGUF changes under a pack that is in use
        assert engine.stats()["cache"]["source"] == "gguf"  # the truncated pack was ignored
    pack.write_pack(model)
    with _load(model, expert_pack=True) as engine:
        assert engine.stats()["cache"]["source"] == "pack"
        engine.forward(PROMPT)
        ti = engine.gguf.tensor_info("blk.1.ffn_down_exps.weight")
        _overwrite(model, ti.offset, b"\0" * 64)
        with pytest.raises(ModelFileChanged, match=r"m\.gguf \(modified"):
            engine.forward(PROMPT)


# --------------------------------------------------------------------------- tensor data

def test_tensor_data_is_a_copy_and_read_range_a_part_of_it(model):
    with GGUFFile(model) as g:
        ti = g.tensor_info("blk.0.ffn_up_exps.weight")
        whole = g.tensor_data(ti.name)
        raw = np.fromfile(model, np.uint8, ti.nbytes, offset=ti.offset)
        assert np.array_equal(whole, raw) and not whole.flags.writeable
        assert np.array_equal(g.read_range(ti.name, 1000, 5000), raw[1000:6000])
        assert g.read_range(ti.name, ti.nbytes, 0).size == 0
        for start, n in ((-1, 4), (ti.nbytes - 3, 4), (0, ti.nbytes + 1)):
            with pytest.raises(ValueError, match="outside"):
                g.read_range(ti.name, start, n)
        _overwrite(model, ti.offset, b"\xff" * 64)
        assert np.array_equal(whole, raw)  # a copy: what was read stays as it was
        with pytest.raises(ModelFileChanged, match="modified"):
            g.tensor_data(ti.name)


# --------------------------------------------------------------------------- not a model file

def _within(seconds, fn, unblock):
    """fn() run on a thread: -> its exception (or None). Fails if it takes longer than `seconds`;
    unblock() then frees the thread."""
    out: list = []

    def run():
        try:
            out.append(fn())
        except BaseException as e:  # noqa: BLE001 - handed to the test
            out.append(e)
    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(seconds)
    if t.is_alive():
        unblock()
        t.join(5)
        pytest.fail(f"still blocked after {seconds} s")
    return out[0]


def _unblock_fifo(path):
    def unblock():
        fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)  # a writer lets the blocked reader's open() return
        os.close(fd)
    return unblock


def test_fifo_model_path_is_refused_at_once(tmp_path):
    fifo = tmp_path / "model.gguf"
    os.mkfifo(fifo)
    err = _within(5, lambda: GGUFFile(fifo), _unblock_fifo(fifo))
    assert isinstance(err, ModelError) and "not a regular file" in str(err), err


def test_fifo_pack_path_is_ignored_at_once(model, caplog):
    os.mkfifo(pack.pack_path(model))
    with GGUFFile(model) as g, caplog.at_level(logging.WARNING, "moed"):
        layouts = expert_layouts(g)
        store = _within(5, lambda: pack.open_pack(model, g, layouts), _unblock_fifo(pack.pack_path(model)))
    assert store is None and "not a regular file" in caplog.text


@pytest.mark.parametrize("head", [b"root:$6$Xy12:19000:0:99999:7:::\n" * 4, b"GGU", b"\x7fELF" + bytes(60)])
def test_not_a_gguf_file_error_echoes_nothing(tmp_path, head):
    path = tmp_path / "secret"
    path.write_bytes(head)
    with pytest.raises(GGUFError) as ei:
        GGUFFile(path)
    msg = str(ei.value)
    assert "not a GGUF file" in msg or "too small" in msg, msg
    for token in (b"root", b"Xy12", b"ELF"):
        if token in head:
            assert token.decode() not in msg.replace(str(path), ""), msg


# --------------------------------------------------------------------------- corrupted tensor names

@pytest.mark.parametrize("name", ["blk.1.ffn_down_exps.weight", "blk.0.ffn_gate_exps.weight",
                                  "blk.1.ffn_up_exps.weight"])
def test_corrupted_expert_tensor_name_is_a_clean_load_error(tmp_path, fixture_dir, name):
    """One flipped bit in an expert tensor's name ('weight' -> 'weigh' + a different last byte
    keeps the length) must name the missing tensor at load, not raise KeyError on a layer."""
    src = fixture_path("qwen3moe", "Q8_0", fixture_dir)
    path = rewrite_gguf(src, tmp_path / "m.gguf", rename={name: name[:-1] + "u"})
    for limit in (0.0, TINY_CACHE_MB):
        with pytest.raises(GGUFError, match=name.replace(".", r"\.")):
            Engine.load(path, expert_cache_limit_mb=limit, expert_pack=False)


def test_router_without_expert_tensors_is_a_clean_load_error(tmp_path, fixture_dir):
    src = fixture_path("qwen3moe", "Q8_0", fixture_dir)
    names = [f"blk.1.ffn_{p}_exps.weight" for p in ("gate", "up", "down")]
    path = rewrite_gguf(src, tmp_path / "m.gguf", rename={n: n[:-1] + "u" for n in names})
    with pytest.raises(GGUFError, match=r"no tensor named 'blk\.1\.ffn_gate_exps\.weight' \(layer 1 has "
                                        r"'blk\.1\.ffn_gate_inp\.weight'\)"):
        Engine.load(path, expert_cache_limit_mb=TINY_CACHE_MB, expert_pack=False)


@pytest.mark.parametrize("bias", ["gate", "up", "down"])
def test_missing_expert_bias_is_a_clean_load_error(tmp_path, fixture_dir, bias):
    """gpt-oss has gate, up and down expert biases; a corrupted name leaves two of them."""
    src = fixture_path("gpt-oss", "MXFP4", fixture_dir)
    name = f"blk.1.ffn_{bias}_exps.bias"
    path = rewrite_gguf(src, tmp_path / "m.gguf", rename={name: name[:-1] + "r"})
    for limit in (0.0, TINY_CACHE_MB):
        with pytest.raises(GGUFError, match=rf"no tensor named '{name.replace('.', '[.]')}'"):
            Engine.load(path, expert_cache_limit_mb=limit, expert_pack=False)
    with GGUFFile(path) as g, pytest.raises(GGUFError, match=rf"no tensor named '{name.replace('.', '[.]')}'"):
        Transformer(g)
