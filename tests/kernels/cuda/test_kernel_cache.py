"""kernel_cache.py and launch.py's use of it: keys, the file format, atomic writes, bad entries.

No GPU: kernels, overloads and cuda.core are fakes with the attributes the code reads; the
cross-process check imports the real kernel modules in subprocesses (numba-cuda without the
simulator builds dispatchers without a driver; nothing compiles)."""

import logging
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from numba.cuda import types

from daemon.errors import ConfigError
from daemon.kernels.cuda import kernel_cache as kc
from daemon.kernels.cuda import launch as launch_mod

PKG = Path(kc.__file__).parent
ROOT = PKG.parents[2]


class FakeDispatcher:
    """What fingerprint() reads of a numba CUDADispatcher."""

    def __init__(self, fn, **opts):
        self.py_func = fn
        self.targetoptions = {"debug": 0, "opt": True, "link": (), **opts}


class FakeIntrinsic:
    def __init__(self, name, defn):
        self._name = name
        self._defn = defn


def make_kernel(width, helper=None):
    """A kernel built in a closure, as mmvq._build does: `width` a compile-time constant."""
    helper = helper or make_device(1)

    def kernel(out):
        for i in range(width):
            out[i] = helper(i)

    return FakeDispatcher(kernel)


def make_device(scale):
    def helper(i):
        return i * scale

    return FakeDispatcher(helper, device=True)


def _intrinsic_defn(typingctx, a):
    return a


# -- the key -------------------------------------------------------------------------------------


def test_same_build_same_fingerprint_and_closure_constants_count():
    assert kc.fingerprint(make_kernel(4)) == kc.fingerprint(make_kernel(4))
    assert kc.fingerprint(make_kernel(4)) != kc.fingerprint(make_kernel(8))


def test_a_device_functions_closure_counts():
    assert kc.fingerprint(make_kernel(4, make_device(2))) != kc.fingerprint(make_kernel(4, make_device(3)))
    assert kc.fingerprint(make_kernel(4, make_device(2))) == kc.fingerprint(make_kernel(4, make_device(2)))


def test_target_options_and_intrinsics_count():
    k = make_kernel(4)
    fast = FakeDispatcher(k.py_func, fastmath=True)
    assert kc.fingerprint(k) != kc.fingerprint(fast)
    a = FakeIntrinsic("dp4a", _intrinsic_defn)
    b = FakeIntrinsic("prmt", _intrinsic_defn)
    assert kc.fingerprint(make_kernel(4, a)) != kc.fingerprint(make_kernel(4, b))


GLOBAL_SCALE = 3


def _reads_global(out):
    out[0] = GLOBAL_SCALE


def test_a_named_global_counts(monkeypatch):
    before = kc.fingerprint(FakeDispatcher(_reads_global))
    monkeypatch.setattr(sys.modules[__name__], "GLOBAL_SCALE", 4)
    assert kc.fingerprint(FakeDispatcher(_reads_global)) != before


consts = type(sys)("tests.fake_consts")  # a module of ours whose attribute a kernel reads
consts.WIDTH = 4


def _reads_module_attr(out):
    out[0] = consts.WIDTH


def test_a_module_attribute_counts(monkeypatch):
    before = kc.fingerprint(FakeDispatcher(_reads_module_attr))
    monkeypatch.setattr(consts, "WIDTH", 8)
    assert kc.fingerprint(FakeDispatcher(_reads_module_attr)) != before


def test_an_object_known_only_by_address_is_uncacheable():
    class Opaque:
        pass

    thing = Opaque()

    def kernel(out):
        out[0] = thing

    with pytest.raises(kc.Uncacheable):
        kc.fingerprint(FakeDispatcher(kernel))
    with pytest.raises(kc.Uncacheable):  # linked files: their contents are not in the key
        kc.fingerprint(FakeDispatcher(make_kernel(1).py_func, link=("f.cu",)))


def test_entry_key_changes_with_each_part():
    f32 = types.Array(types.float32, 2, "C")
    base = ("fp", (f32, types.int32), (9, 0), "tools", "src")
    key = kc.entry_key(*base)
    assert len(key) == 64 and key == kc.entry_key(*base)
    variants = [("fp2", *base[1:]), (base[0], (types.Array(types.float32, 2, "A"), types.int32), *base[2:]),
                (*base[:2], (8, 9), *base[3:]), (*base[:3], "tools2", base[4]), (*base[:4], "src2")]
    assert len({kc.entry_key(*v) for v in variants} | {key}) == len(variants) + 1


def test_editing_a_kernel_source_changes_the_key(tmp_path):
    copy = tmp_path / "cuda"
    shutil.copytree(PKG, copy, ignore=shutil.ignore_patterns("__pycache__"))
    assert kc.source_digest(copy) == kc.source_digest(PKG)
    with open(copy / "vecdot.py", "a") as f:
        f.write("# an edit\n")
    edited = kc.source_digest(copy)
    assert edited != kc.source_digest(PKG)
    assert kc.entry_key("fp", (), (9, 0), "t", edited) != kc.entry_key("fp", (), (9, 0), "t", kc.source_digest(PKG))


_CROSS = """
import importlib, pkgutil
from numba.cuda.dispatcher import CUDADispatcher
import daemon.kernels.cuda as pkg
from daemon.kernels.cuda import kernel_cache as kc, mmvq, mmq
out = []
for m in pkgutil.iter_modules(pkg.__path__):
    mod = importlib.import_module("daemon.kernels.cuda." + m.name)
    for n, v in sorted(vars(mod).items()):
        if isinstance(v, CUDADispatcher) and not v.targetoptions.get("device"):
            out.append(m.name + "." + n + " " + kc.fingerprint(v))
out.append("mmvq8 " + kc.fingerprint(mmvq._build(8, 4, 32, 4, False, False, 0, 1)))
out.append("mmvq8ids " + kc.fingerprint(mmvq._build(8, 4, 32, 4, True, False, 0, 1)))
out.append("mmvq2 " + kc.fingerprint(mmvq._build(2, 4, 32, 4, False, False, 0, 1)))
out.append("mmq8 " + kc.fingerprint(mmq._build(8, 64, 64, False, False)[0]))
out.append("mmq8ids " + kc.fingerprint(mmq._build(8, 64, 64, True, False)[0]))
print("\\n".join(out))
"""


def test_real_kernels_fingerprint_the_same_in_two_processes():
    """numba's own cache misses here (a closure pickles differently per process); ours must not.
    Each process has its own string hash seed and object addresses."""
    env = {**os.environ, "NUMBA_ENABLE_CUDASIM": "0", "PYTHONHASHSEED": "random"}
    runs = [subprocess.run([sys.executable, "-c", _CROSS], cwd=ROOT, env=env, capture_output=True, text=True,
                           timeout=300) for _ in range(2)]
    for r in runs:
        assert r.returncode == 0, r.stderr[-2000:]
    assert runs[0].stdout == runs[1].stdout
    prints = dict(line.split() for line in runs[0].stdout.splitlines())
    assert len(prints) > 20  # every module-level kernel, none uncacheable
    assert len(set(prints.values())) == len(prints)  # distinct kernels, distinct keys


# -- the files -----------------------------------------------------------------------------------


def test_round_trip_and_permissions(tmp_path):
    d = tmp_path / "kernels"
    assert kc.write(d, "k1", "_Z6kernel", b"\x7fELF cubin bytes")
    e = kc.read(d, "k1")
    assert (e.entry_name, e.cubin) == ("_Z6kernel", b"\x7fELF cubin bytes")
    assert stat.S_IMODE(d.stat().st_mode) == 0o700
    assert stat.S_IMODE((d / "k1.cubin").stat().st_mode) == 0o600
    assert kc.read(d, "k2") is None
    assert [p.name for p in d.iterdir()] == ["k1.cubin"]  # no temporary left


@pytest.mark.parametrize("damage", ["truncate", "garbage", "flip_cubin", "other_key", "other_format", "empty"])
def test_a_bad_entry_is_ignored_with_a_debug_log(tmp_path, caplog, damage):
    d = tmp_path / "kernels"
    kc.write(d, "k1", "_Z6kernel", b"A" * 64)
    path = d / "k1.cubin"
    data = path.read_bytes()
    if damage == "truncate":
        data = data[: len(data) // 2]
    elif damage == "garbage":
        data = os.urandom(len(data))
    elif damage == "flip_cubin":
        data = data.replace(b"A" * 64, b"A" * 63 + b"B")
    elif damage == "other_key":
        kc.write(d, "k9", "_Z6kernel", b"A" * 64)
        data = (d / "k9.cubin").read_bytes()
    elif damage == "other_format":
        data = data.replace(kc.FORMAT.encode(), b"moed-kernel-cache/0")
    else:
        data = b""
    path.write_bytes(data)
    with caplog.at_level(logging.DEBUG, logger=kc.__name__):
        assert kc.read(d, "k1") is None
    assert "kernel cache" in caplog.text


def test_an_entry_others_may_write_is_ignored(tmp_path):
    d = tmp_path / "kernels"
    kc.write(d, "k1", "n", b"x")
    os.chmod(d / "k1.cubin", 0o666)
    assert kc.read(d, "k1") is None
    os.chmod(d, 0o777)
    assert not kc.write(d, "k2", "n", b"x")  # nor is one written where others may plant files


def test_a_failed_write_leaves_the_old_entry_and_no_temporary(tmp_path, monkeypatch):
    d = tmp_path / "kernels"
    kc.write(d, "k1", "old", b"old cubin")

    def fail(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(kc.os, "replace", fail)
    assert not kc.write(d, "k1", "new", b"new cubin")
    monkeypatch.undo()
    assert kc.read(d, "k1").entry_name == "old"
    assert [p.name for p in d.iterdir()] == ["k1.cubin"]


def test_a_cubin_that_is_not_bytes_is_not_written(tmp_path):
    assert not kc.write(tmp_path / "k", "k1", "n", "a path, not a cubin")
    assert not kc.write(tmp_path / "k", "k1", "n", 7)
    assert kc.read(tmp_path / "k", "k1") is None


def test_the_setting(tmp_path):
    assert kc.cache_dir({"MOED_KERNEL_CACHE": "off"}) is None
    assert kc.cache_dir({"MOED_KERNEL_CACHE": str(tmp_path)}) == tmp_path
    assert kc.cache_dir({"XDG_CACHE_HOME": str(tmp_path)}) == tmp_path / "moed" / "kernels"
    assert kc.cache_dir({"XDG_CACHE_HOME": str(tmp_path), "MOED_KERNEL_CACHE": "on"}) == tmp_path / "moed" / "kernels"
    with pytest.raises(ConfigError, match="MOED_KERNEL_CACHE"):
        kc.cache_dir({"MOED_KERNEL_CACHE": "relative/dir"})


# -- launch.py: compile once, load after -----------------------------------------------------------


class FakeLibrary:
    def __init__(self, name):
        self._entry_name = f"_Z{len(name)}{name}"
        self._setup_functions = []
        self._linking_files = set()
        self.use_cooperative = False
        self.referenced_objects = {}
        self.name = name

    def get_cubin(self):
        return type("Code", (), {"code": f"cubin of {self.name}".encode()})()

    def get_cufunc(self):
        return type("Func", (), {"kernel": ("compiled", self.name)})()


class FakeKernel(FakeDispatcher):
    """A dispatcher that counts compiles; typeof_pyval as numba types the arguments."""

    def __init__(self, fn):
        super().__init__(fn)
        self.compiles = 0

    def typeof_pyval(self, a):
        return {int: types.int64, float: types.float64, bool: types.boolean}[type(a)]

    def compile(self, argtypes):
        self.compiles += 1
        return type("Overload", (), {"_codelibrary": FakeLibrary(self.py_func.__name__)})()


class FakeCore:
    class ObjectCode:
        @staticmethod
        def from_cubin(cubin):
            obj = FakeCore.ObjectCode()
            obj.cubin = cubin
            return obj

        def get_kernel(self, name):
            return ("loaded", self.cubin, name)


def _fresh_process(monkeypatch, env):
    """launch.py's state as a new process has it."""
    monkeypatch.setattr(launch_mod, "_disk", launch_mod._DiskCache())
    launch_mod._disk.context = ("tools", "src")
    monkeypatch.setattr(launch_mod._disk, "cc", lambda: CC["now"])  # no device to ask
    monkeypatch.setattr(launch_mod, "COUNTS", {"compiled": 0, "cached": 0})
    monkeypatch.setattr(launch_mod, "_core", FakeCore())
    for k, v in env.items():
        monkeypatch.setenv(k, v)


CC = {"now": (9, 0)}  # the compute capability the fake device reports


def _kernel_for_launch(out, n, x, flag):
    out[0] = n * x if flag else 0


def test_second_process_loads_instead_of_compiling(tmp_path, monkeypatch):
    env = {"MOED_KERNEL_CACHE": str(tmp_path / "k")}
    args = (3, 1.5, True)
    _fresh_process(monkeypatch, env)
    first = FakeKernel(_kernel_for_launch)
    got, conv, ndims = launch_mod._resolve(first, args)
    assert got == ("compiled", "_kernel_for_launch") and first.compiles == 1
    assert conv == ("q", "d", "?") and ndims == (0, 0, 0)
    assert launch_mod.COUNTS == {"compiled": 1, "cached": 0}
    assert len(list((tmp_path / "k").iterdir())) == 1

    _fresh_process(monkeypatch, env)
    second = FakeKernel(_kernel_for_launch)  # the same kernel, rebuilt
    got, conv2, _ = launch_mod._resolve(second, args)
    assert got == ("loaded", b"cubin of _kernel_for_launch", "_Z18_kernel_for_launch")
    assert second.compiles == 0 and conv2 == conv
    assert launch_mod.COUNTS == {"compiled": 0, "cached": 1}

    got = launch_mod._resolve(second, (3, 2, True))[0]  # other argument types: another overload
    assert got[0] == "compiled" and second.compiles == 1

    monkeypatch.setitem(CC, "now", (8, 9))  # another GPU: its own entries
    assert launch_mod._resolve(second, args)[0][0] == "compiled" and second.compiles == 2


def test_off_corrupt_and_uncacheable_compile(tmp_path, monkeypatch):
    args = (3, 1.5, True)
    _fresh_process(monkeypatch, {"MOED_KERNEL_CACHE": "off"})
    k = FakeKernel(_kernel_for_launch)
    launch_mod._resolve(k, args)
    _fresh_process(monkeypatch, {"MOED_KERNEL_CACHE": "off"})
    launch_mod._resolve(k, args)
    assert k.compiles == 2

    d = tmp_path / "k"
    _fresh_process(monkeypatch, {"MOED_KERNEL_CACHE": str(d)})
    launch_mod._resolve(FakeKernel(_kernel_for_launch), args)
    (entry,) = d.iterdir()
    entry.write_bytes(b"not an entry")
    _fresh_process(monkeypatch, {"MOED_KERNEL_CACHE": str(d)})
    k = FakeKernel(_kernel_for_launch)
    assert launch_mod._resolve(k, args)[0][0] == "compiled" and k.compiles == 1
    assert kc.read(d, entry.stem) is not None  # rewritten

    class Opaque:
        pass

    thing = Opaque()

    def odd(out):
        out[0] = thing

    _fresh_process(monkeypatch, {"MOED_KERNEL_CACHE": str(d)})
    launch_mod._resolve(FakeKernel(odd), args[:0])
    _fresh_process(monkeypatch, {"MOED_KERNEL_CACHE": str(d)})
    k = FakeKernel(odd)
    launch_mod._resolve(k, args[:0])
    assert k.compiles == 1 and launch_mod.COUNTS == {"compiled": 1, "cached": 0}


def test_a_bad_setting_turns_the_cache_off_without_failing(monkeypatch, caplog):
    _fresh_process(monkeypatch, {"MOED_KERNEL_CACHE": "relative"})
    k = FakeKernel(_kernel_for_launch)
    with caplog.at_level(logging.WARNING):
        assert launch_mod._resolve(k, (1,))[0][0] == "compiled"
    assert "MOED_KERNEL_CACHE" in caplog.text
