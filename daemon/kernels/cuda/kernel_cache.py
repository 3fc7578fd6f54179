"""Compiled kernels on disk, so a new process loads the cubin a kernel needs instead of compiling it.

numba's own `cache=True` misses in every new process for kernels built in closures around
device functions and `@intrinsic`s: it keys an entry on a pickle of the closure, and those objects
pickle differently in each process. Here an entry's key is derived from what determines the code:

    the kernel's identity  its function's code, closure values and the globals it names, recursively
                           through the device functions and intrinsics it calls (`fingerprint`);
                           objects are named by module and qualified name, never by address
    the arguments          the numba types of the launch's arguments (what picks the overload)
    the target             the device's compute capability
    the toolchain          versions of numba-cuda, numba, llvmlite, cuda-bindings, Python; NUMBA_* env
    the sources            a digest of every daemon/kernels/cuda/*.py (`source_digest`): an edited
                           helper anywhere in the package misses rather than loads a stale kernel

An entry is one file, <key>.cubin, in a 0700 directory, 0600, written to a temporary file and
renamed into place; it holds the key it was written for, the kernel's mangled entry name, the cubin
and the cubin's sha256 (msgpack). An entry that cannot be read, is truncated, is for another key or
fails its checksum is ignored (the kernel compiles, and a good entry replaces it) with a DEBUG log;
launch.py turns any failure here (an uncacheable kernel, a bad setting) into a compile, never an
error.

MOED_KERNEL_CACHE (daemon/config.py): on = $XDG_CACHE_HOME/moed/kernels (default), off, or an
absolute directory. Only launch.py's fast path uses it; the simulator never does.
"""

from __future__ import annotations

import hashlib
import logging
import os
import stat
import sys
import tempfile
import types as pytypes
from pathlib import Path

import msgspec
import numpy as np

log = logging.getLogger(__name__)

FORMAT = "moed-kernel-cache/1"
_DISTS = ("numba-cuda", "numba", "llvmlite", "cuda-bindings")


class Uncacheable(Exception):
    """The kernel reaches an object whose identity cannot be named across processes."""


class Entry(msgspec.Struct, frozen=True):
    format: str
    key: str
    entry_name: str  # the kernel's mangled name in the cubin
    cubin: bytes
    sha256: str  # of cubin


# -- where ---------------------------------------------------------------------------------------


def cache_dir(env=None) -> Path | None:
    """The directory MOED_KERNEL_CACHE names (None: off)."""
    from ...config import Settings

    value = Settings.env_value("kernel_cache", env)
    if value == "off":
        return None
    if value == "on":
        env = os.environ if env is None else env
        base = env.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        return Path(base) / "moed" / "kernels"
    return Path(value)


def _private_dir(path: Path) -> bool:
    """Make `path` (0700) if missing; True when it is ours and no one else may write in it (a
    cubin found there is code the GPU will run)."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = path.stat()
    return stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid() and not st.st_mode & 0o022


# -- the key -------------------------------------------------------------------------------------


def source_digest(directory: Path | None = None) -> str:
    """sha256 over the names and bytes of the kernel package's *.py files."""
    directory = Path(__file__).parent if directory is None else directory
    h = hashlib.sha256()
    for p in sorted(directory.glob("*.py")):
        h.update(p.name.encode() + b"\0" + p.read_bytes() + b"\0")
    return h.hexdigest()


def toolchain() -> str:
    """Versions that change the generated code, and the NUMBA_* environment."""
    from importlib import metadata

    parts = [f"python={sys.version_info[0]}.{sys.version_info[1]}"]
    for dist in _DISTS:
        try:
            parts.append(f"{dist}={metadata.version(dist)}")
        except metadata.PackageNotFoundError:
            parts.append(f"{dist}=-")
    parts += sorted(f"{k}={v}" for k, v in os.environ.items() if k.startswith("NUMBA_"))
    return ";".join(parts)


def entry_key(kernel_fp: str, argtypes, cc, toolchain_id: str, sources: str) -> str:
    """The file name (hex sha256) of one (kernel, argument types, target) entry."""
    text = "\n".join([FORMAT, kernel_fp, ",".join(str(t) for t in argtypes), f"sm_{cc[0]}{cc[1]}",
                      toolchain_id, sources])
    return hashlib.sha256(text.encode()).hexdigest()


_SCALARS = (type(None), bool, int, float, complex, str, bytes)


def fingerprint(kernel) -> str:
    """sha256 of what a kernel's code depends on (see the module doc); Uncacheable if it reaches
    an object that has no name stable across processes. `kernel`: a numba dispatcher (py_func),
    or a plain function."""
    fn = getattr(kernel, "py_func", kernel)
    root = (getattr(fn, "__module__", None) or "").split(".")[0]
    out: list[str] = []
    _fp(kernel, out, set(), root)
    return hashlib.sha256("\n".join(out).encode()).hexdigest()


def _name(obj) -> str:
    return f"{getattr(obj, '__module__', '?')}:{getattr(obj, '__qualname__', getattr(obj, '__name__', '?'))}"


def _fp(obj, out: list, seen: set, root: str) -> None:
    """Append obj's canonical text to out. seen: ids of the functions, dispatchers and intrinsics
    already written (one called from several places is written once, then named), and of the
    containers being written (a cycle is cut)."""
    if isinstance(obj, _SCALARS):
        out.append(f"{type(obj).__name__}:{obj!r}")
        return
    if isinstance(obj, np.generic):
        out.append(f"np:{obj.dtype.str}:{obj.tobytes().hex()}")
        return
    if isinstance(obj, np.dtype):
        out.append(f"dtype:{obj.str}")
        return
    if isinstance(obj, pytypes.ModuleType):
        out.append(f"module:{obj.__name__}")
        return
    if id(obj) in seen:
        out.append(f"ref:{_name(getattr(obj, 'py_func', obj))}")
        return
    seen.add(id(obj))
    if isinstance(obj, (tuple, list, set, frozenset, dict)):
        _container(obj, out, seen, root)
        seen.discard(id(obj))  # a cycle guard only: an equal container elsewhere is written in full
    elif isinstance(obj, np.ndarray):  # a global array is frozen into the kernel as a constant
        digest = hashlib.sha256(np.ascontiguousarray(obj).tobytes()).hexdigest()
        out.append(f"ndarray:{obj.dtype.str}:{obj.shape}:{digest}")
    elif hasattr(obj, "py_func") and hasattr(obj, "targetoptions"):  # a numba dispatcher
        opts = dict(obj.targetoptions)
        if opts.get("link"):
            raise Uncacheable(f"{_name(obj.py_func)} links files")
        out.append(f"dispatcher:{type(obj).__name__}")
        _fp(opts, out, seen, root)
        _fp(obj.py_func, out, seen, root)
    elif hasattr(obj, "_defn") and hasattr(obj, "_name"):  # a numba @intrinsic
        out.append(f"intrinsic:{obj._name}")  # noqa: SLF001
        _fp(obj._defn, out, seen, root)  # noqa: SLF001
    elif isinstance(obj, pytypes.FunctionType):
        module = getattr(obj, "__module__", None) or ""
        out.append(f"function:{_name(obj)}")
        if module.split(".")[0] == root:  # our code: by content; a library's: by name and version
            _code(obj.__code__, out, seen, root)
            _fp(obj.__defaults__, out, seen, root)
            for cell in obj.__closure__ or ():
                _fp(cell.cell_contents, out, seen, root)
            g = obj.__globals__
            names = _global_names(obj.__code__)
            for n in names:
                if n in g:
                    out.append(f"global:{n}")
                    _fp(g[n], out, seen, root)
                    if isinstance(g[n], pytypes.ModuleType) and g[n].__name__.split(".")[0] == root:
                        for a in names:  # module.attr, as numba freezes it (any name the code uses)
                            if a in vars(g[n]):
                                out.append(f"attr:{a}")
                                _fp(vars(g[n])[a], out, seen, root)
    elif isinstance(obj, (type, pytypes.BuiltinFunctionType)):
        out.append(f"named:{_name(obj)}")
    else:
        out.append(f"object:{_text(obj)}")


def _container(obj, out: list, seen: set, root: str) -> None:
    if isinstance(obj, (tuple, list)):
        out.append(f"{type(obj).__name__}:{len(obj)}")
        for x in obj:
            _fp(x, out, seen, root)
    elif isinstance(obj, dict):
        out.append(f"dict:{len(obj)}")
        for k in sorted(obj, key=repr):
            _fp(k, out, seen, root)
            _fp(obj[k], out, seen, root)
    else:  # a set's iteration order follows string hashes, which differ per process
        parts = []
        for x in obj:
            part: list[str] = []
            _fp(x, part, seen, root)
            parts.append("\n".join(part))
        out.append(f"set:{len(obj)}")
        out += sorted(parts)


def _text(obj) -> str:
    """repr, when it names the value rather than an address."""
    text = repr(obj)
    if " at 0x" in text or " object at " in text:
        raise Uncacheable(f"{type(obj).__name__} has no stable name: {text[:80]}")
    return f"{type(obj).__module__}.{type(obj).__qualname__}:{text}"


def _code(co, out: list, seen: set, root: str) -> None:
    out.append(f"code:{co.co_name}:{co.co_argcount}:{co.co_code.hex()}:{co.co_names}:{co.co_varnames}")
    for c in co.co_consts:
        if isinstance(c, pytypes.CodeType):
            _code(c, out, seen, root)
        else:
            _fp(c, out, seen, root)


def _global_names(co) -> list[str]:
    names = list(co.co_names)
    for c in co.co_consts:
        if isinstance(c, pytypes.CodeType):
            names += _global_names(c)
    return sorted(set(names))


# -- the files -----------------------------------------------------------------------------------

_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(Entry)


def read(directory: Path, key: str) -> Entry | None:
    """The entry for key, or None (missing, unreadable, corrupt or foreign: DEBUG-logged)."""
    path = directory / f"{key}.cubin"
    try:
        st = path.stat()
        if st.st_uid != os.getuid() or st.st_mode & 0o022:
            log.debug("kernel cache: %s is not private to this user; ignored", path)
            return None
        entry = _DECODER.decode(path.read_bytes())
    except FileNotFoundError:
        return None
    except (OSError, msgspec.DecodeError, msgspec.ValidationError) as e:
        log.debug("kernel cache: %s unreadable (%s); recompiling", path, e)
        return None
    if entry.format != FORMAT or entry.key != key:
        log.debug("kernel cache: %s is for another key or format; recompiling", path)
        return None
    if hashlib.sha256(entry.cubin).hexdigest() != entry.sha256:
        log.debug("kernel cache: %s fails its checksum; recompiling", path)
        return None
    return entry


def write(directory: Path, key: str, entry_name: str, cubin: bytes) -> bool:
    """Store an entry atomically (a temporary file renamed over the name); False, DEBUG-logged, if
    the directory is not private or the write fails."""
    tmp = None
    try:
        if not _private_dir(directory):
            log.debug("kernel cache: %s is not a directory private to this user; not written", directory)
            return False
        if not isinstance(cubin, (bytes, bytearray, memoryview)):
            raise TypeError(f"a cubin as {type(cubin).__name__}")
        cubin = bytes(cubin)
        data = _ENCODER.encode(Entry(FORMAT, key, entry_name, cubin, hashlib.sha256(cubin).hexdigest()))
        fd, tmp = tempfile.mkstemp(dir=directory, prefix=".tmp-", suffix=".cubin")  # 0600
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, directory / f"{key}.cubin")
        tmp = None
        return True
    except (OSError, TypeError, ValueError) as e:  # TypeError: a cubin that is not bytes
        log.debug("kernel cache: writing %s failed (%s)", key, e)
        return False
    finally:
        if tmp is not None:
            try:
                os.unlink(tmp)
            except OSError:
                pass


__all__ = ["Entry", "Uncacheable", "cache_dir", "entry_key", "fingerprint", "read", "source_digest",
           "toolchain", "write"]
