"""The validated GGUF reader.

GGUF parsing is an attack surface (see DESIGN.md): llama.cpp has had CVEs for count overflows,
string/array lengths, dims and nbytes overflow, offsets beyond the file, bad alignment and
duplicate keys or names. This reader trusts nothing in the header. Every count, length, type,
dimension, offset and data range is checked against the file before it is used, so a malformed
file gives a GGUFError naming the field, never a crash, hang, over-read or huge allocation.

Layout (little-endian, versions 2 and 3):

    magic "GGUF" | u32 version | u64 n_tensors | u64 n_kv
    n_kv x      (string key, u32 value type, value)
    n_tensors x (string name, u32 n_dims, n_dims x i64 ne, u32 ggml type, u64 offset)
    padding to `general.alignment` (default 32)
    tensor data; each tensor's offset is relative to the start of this section

A string is a u64 byte length followed by that many UTF-8 bytes. An array value is a u32 element
type, a u64 count and the elements. Arrays of arrays are rejected (llama.cpp rejects them too).

Nothing is memory-mapped: a mapping of a file that another process truncates raises SIGBUS when a
page past the new end is touched, which no Python code can recover from. The header is read with
positional reads into a buffer that grows as the parser needs it (so a file cut while it loads is
a GGUFError too), metadata values are decoded into Python objects (numeric arrays into numpy
arrays), and `tensor_data` / `read_range` return copies read with pread, their length checked.

The file is opened only if it is a regular file, and without blocking (a FIFO or device at the
path is refused before it is opened: identity.py). Its identity (device, inode, size, mtime, ctime,
and a content fingerprint: fingerprint.py) is recorded at open (`FileIdentity`); every later read checks
it, so a model file truncated, rewritten or replaced while loaded gives ModelFileChanged instead
of other bytes than were validated (a new ctime alone: only if the sampled content differs).

No error message contains bytes read from a file that is not known to be a GGUF file: a
daemon's error text must not disclose the start of whatever file a client names.
"""

from __future__ import annotations

import os
import struct
import weakref
from dataclasses import dataclass
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

from daemon.errors import GGUFError, ModelError, StorageError

from .fingerprint import Fingerprint, sample_ranges
from .identity import FileIdentity, open_regular  # re-exported: the reader opens files with them

__all__ = [
    "FileIdentity",
    "GGUFFile",
    "TensorInfo",
    "GGML_TYPE_NAMES",
    "GGUF_VALUE_TYPE_NAMES",
    "ggml_type_block_size",
    "ggml_type_name",
    "open_regular",
]

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
GGML_MAX_DIMS = 4
GGML_MAX_NAME = 64  # llama.cpp rejects tensor names of 64 bytes or more
INT64_MAX = (1 << 63) - 1

# Sanity limits. Real files are far below them; they exist so a forged header cannot make
# the reader allocate memory out of proportion to what a model needs.
MAX_KEY_LEN = 1 << 16  # metadata key bytes
MAX_STRING_LEN = 1 << 26  # 64 MiB for one string value (chat templates are tens of KiB)
MAX_ARRAY_LEN = 1 << 24  # 16.7M elements; vocabularies are < 300k

# Minimal on-disk sizes, used to bound n_kv and n_tensors by the bytes left in the file.
_MIN_KV_BYTES = 8 + 4 + 1  # empty key, value type, 1-byte value
_MIN_TENSOR_INFO_BYTES = 8 + 4 + 8 + 4 + 8  # empty name, n_dims, one ne, type, offset
_HEADER_BYTES = 4 + 4 + 8 + 8
_READ_CHUNK = 1 << 20  # the header is read in chunks of at least this size, doubling

GGML_TYPE_NAMES: dict[int, str] = {int(t): t.name for t in GGML_QUANT_SIZES}
GGUF_VALUE_TYPE_NAMES: dict[int, str] = {int(t): t.name.lower() for t in GGUFValueType}

# Fixed-size scalar value types: (struct format, numpy dtype).
_SCALARS: dict[int, tuple[str, np.dtype]] = {
    GGUFValueType.UINT8: ("<B", np.dtype("<u1")),
    GGUFValueType.INT8: ("<b", np.dtype("<i1")),
    GGUFValueType.UINT16: ("<H", np.dtype("<u2")),
    GGUFValueType.INT16: ("<h", np.dtype("<i2")),
    GGUFValueType.UINT32: ("<I", np.dtype("<u4")),
    GGUFValueType.INT32: ("<i", np.dtype("<i4")),
    GGUFValueType.FLOAT32: ("<f", np.dtype("<f4")),
    GGUFValueType.BOOL: ("<B", np.dtype("<u1")),
    GGUFValueType.UINT64: ("<Q", np.dtype("<u8")),
    GGUFValueType.INT64: ("<q", np.dtype("<i8")),
    GGUFValueType.FLOAT64: ("<d", np.dtype("<f8")),
}
_SCALAR_STRUCTS = {t: (struct.Struct(fmt), dt.itemsize) for t, (fmt, dt) in _SCALARS.items()}
_INT_TYPES = frozenset(
    {
        GGUFValueType.UINT8,
        GGUFValueType.INT8,
        GGUFValueType.UINT16,
        GGUFValueType.INT16,
        GGUFValueType.UINT32,
        GGUFValueType.INT32,
        GGUFValueType.UINT64,
        GGUFValueType.INT64,
    }
)
_FLOAT_TYPES = frozenset({GGUFValueType.FLOAT32, GGUFValueType.FLOAT64})

_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
_I64 = struct.Struct("<q")

_MISSING: Any = object()


def ggml_type_name(ggml_type: int) -> str:
    """The name of a ggml type ("Q4_K"), or "type<N>" for an unknown one."""
    return GGML_TYPE_NAMES.get(ggml_type, f"type{ggml_type}")


def ggml_type_block_size(ggml_type: int, what: str = "tensor") -> tuple[int, int]:
    """(values per block, bytes per block) of a ggml type.

    Raises GGUFError("<what>: unknown ggml type N") for a type without a known block layout.
    """
    try:
        return GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
    except (ValueError, KeyError):
        raise GGUFError(f"{what}: unknown ggml type {ggml_type}") from None


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of a GGUF file, validated against the file."""

    name: str
    ggml_type: int  # gguf.GGMLQuantizationType value
    ne: tuple[int, ...]  # ggml order: ne[0] is the contiguous row length
    offset: int  # absolute byte offset in the file
    nbytes: int

    @property
    def shape(self) -> tuple[int, ...]:
        """numpy order: reversed(ne)."""
        return tuple(reversed(self.ne))

    @property
    def type_name(self) -> str:
        return ggml_type_name(self.ggml_type)

    @property
    def n_elements(self) -> int:
        n = 1
        for d in self.ne:
            n *= d
        return n


def _kind_name(kind: type | tuple[type, ...]) -> str:
    if isinstance(kind, tuple):
        return " or ".join(_kind_name(k) for k in kind)
    if kind is np.ndarray:
        return "numeric array"
    if kind is list:
        return "string array"
    return getattr(kind, "__name__", str(kind))


class _Cursor:
    """Bounds-checked little-endian reads from the header. `buf` holds the file's first bytes,
    read with pread as the cursor needs them (`fill`); `size` is the file size at open."""

    __slots__ = ("fd", "buf", "pos", "size", "path")

    def __init__(self, fd: int, size: int, path: str) -> None:
        self.fd = fd
        self.buf = bytearray()
        self.pos = 0
        self.size = size
        self.path = path

    def fill(self, end: int) -> bytearray:
        """Make buf hold at least the file's first `end` bytes (end <= size); -> buf (the same
        object: references to it stay valid). Reads ahead in doubling chunks."""
        buf = self.buf
        if end <= len(buf):
            return buf
        want = min(self.size, max(end, 2 * len(buf), _READ_CHUNK))
        try:
            while len(buf) < want:
                chunk = os.pread(self.fd, want - len(buf), len(buf))
                if not chunk:
                    raise GGUFError(
                        f"{self.path}: the file shrank while it was being read: it ends at {len(buf)} bytes, "
                        f"it had {self.size} when opened"
                    )
                buf += chunk
        except OSError as e:
            raise ModelError(f"cannot read model file {self.path!r}: {e.strerror or e}") from None
        return buf

    def remaining(self) -> int:
        return self.size - self.pos

    def need(self, n: int, what: str) -> None:
        if n > self.size - self.pos:
            raise GGUFError(
                f"{self.path}: truncated file: {what} needs {n} bytes at offset {self.pos}, "
                f"but only {self.size - self.pos} remain (file size {self.size})"
            )
        if self.pos + n > len(self.buf):
            self.fill(self.pos + n)

    def u32(self, what: str) -> int:
        self.need(4, what)
        (v,) = _U32.unpack_from(self.buf, self.pos)
        self.pos += 4
        return v

    def u64(self, what: str) -> int:
        self.need(8, what)
        (v,) = _U64.unpack_from(self.buf, self.pos)
        self.pos += 8
        return v

    def i64(self, what: str) -> int:
        self.need(8, what)
        (v,) = _I64.unpack_from(self.buf, self.pos)
        self.pos += 8
        return v

    def raw_string(self, what: str, limit: int) -> bytes:
        n = self.u64(f"{what} length")
        if n > limit:
            raise GGUFError(f"{self.path}: {what}: string length {n} exceeds the limit of {limit} bytes")
        if n > self.size - self.pos:
            raise GGUFError(
                f"{self.path}: {what}: string length {n} at offset {self.pos - 8} runs past end of file "
                f"({self.size - self.pos} bytes remain, file size {self.size})"
            )
        self.need(n, what)
        b = bytes(self.buf[self.pos : self.pos + n])
        self.pos += n
        return b

    def string(self, what: str, limit: int = MAX_STRING_LEN) -> str:
        b = self.raw_string(what, limit)
        try:
            return b.decode("utf-8")
        except UnicodeDecodeError as e:
            raise GGUFError(f"{self.path}: {what}: invalid utf-8 in string ({e.reason} at byte {e.start})") from None


class GGUFFile:
    """A parsed, fully validated GGUF file, kept open (not mapped) for `tensor_data` reads.

    Attributes: path, version, alignment, data_offset (absolute start of the tensor data section:
    the end of the header rounded up to the alignment; it may lie past file_size in a file with no
    tensor data), file_size, identity (the file as opened: device, inode, size, mtime), metadata
    (key -> decoded value, in file order), tensors (name -> TensorInfo, in file order).
    """

    path: str
    version: int
    alignment: int
    data_offset: int
    file_size: int
    identity: FileIdentity
    metadata: dict[str, Any]
    tensors: dict[str, TensorInfo]

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = os.fspath(path)
        if isinstance(self.path, bytes):
            self.path = os.fsdecode(self.path)
        self._fd: int | None = None
        self.metadata = {}
        self._types: dict[str, tuple[int, int | None]] = {}  # key -> (value type, array element type)
        self.tensors = {}
        try:
            fd, st = open_regular(self.path)
        except (OSError, ValueError) as e:  # ValueError: a NUL in the path
            raise ModelError(f"cannot open model file {self.path!r}: {getattr(e, 'strerror', None) or e}") from None
        self._fd = fd
        self._closer = weakref.finalize(self, os.close, fd)  # an unclosed GGUFFile frees its descriptor
        self.identity = FileIdentity.of(self.path, st)
        self.file_size = st.st_size
        try:
            if self.file_size < _HEADER_BYTES:
                raise GGUFError(
                    f"{self.path}: file too small for a GGUF header ({self.file_size} bytes, need at least {_HEADER_BYTES})"
                )
            self._parse()
            self.identity.fingerprint = Fingerprint.take(fd, sample_ranges(self.file_size, self.data_offset,
                                                                           self.tensors.values()))
            self.identity.check(fd, "while its header was read")
        except BaseException:
            self.close()
            raise

    # ----------------------------------------------------------------------------------- parsing

    def _parse(self) -> None:
        assert self._fd is not None
        p = self.path
        cur = _Cursor(self._fd, self.file_size, p)

        # The bytes are not echoed: this may be any file the daemon can read (/etc/shadow).
        if cur.fill(len(GGUF_MAGIC))[: len(GGUF_MAGIC)] != GGUF_MAGIC:
            raise GGUFError(f"{p}: not a GGUF file (it does not start with the GGUF magic)")
        cur.pos = 4
        version = cur.u32("version")
        if version not in SUPPORTED_VERSIONS:
            swapped = int.from_bytes(version.to_bytes(4, "little"), "big")
            if swapped in (1, 2, 3):
                raise GGUFError(
                    f"{p}: unsupported version: the file is big-endian (version {swapped}); "
                    "only little-endian GGUF files are supported"
                )
            if version == 1:
                raise GGUFError(f"{p}: unsupported version 1 (GGUF v1 is obsolete; convert the file again)")
            raise GGUFError(f"{p}: unsupported version {version} (supported: 2, 3)")
        self.version = version

        n_tensors = cur.u64("n_tensors")
        n_kv = cur.u64("n_kv")
        rem = cur.remaining()
        if n_tensors > rem // _MIN_TENSOR_INFO_BYTES:
            raise GGUFError(
                f"{p}: n_tensors = {n_tensors} cannot fit in the {rem} bytes left in the file "
                f"(each tensor info needs at least {_MIN_TENSOR_INFO_BYTES} bytes)"
            )
        if n_kv > rem // _MIN_KV_BYTES:
            raise GGUFError(
                f"{p}: n_kv = {n_kv} cannot fit in the {rem} bytes left in the file "
                f"(each key/value needs at least {_MIN_KV_BYTES} bytes)"
            )
        if n_kv * _MIN_KV_BYTES + n_tensors * _MIN_TENSOR_INFO_BYTES > rem:
            raise GGUFError(
                f"{p}: n_kv = {n_kv} and n_tensors = {n_tensors} cannot fit in the {rem} bytes left in the file"
            )

        # -- key/value metadata
        for i in range(n_kv):
            key = cur.string(f"metadata key #{i}", MAX_KEY_LEN)
            if key in self.metadata:
                raise GGUFError(f"{p}: duplicate metadata key {key!r}")
            vtype = cur.u32(f"metadata key {key!r}: value type")
            value, etype = self._read_value(cur, vtype, key)
            self.metadata[key] = value
            self._types[key] = (vtype, etype)

        # -- alignment
        alignment = DEFAULT_ALIGNMENT
        if "general.alignment" in self.metadata:
            vtype, _ = self._types["general.alignment"]
            if vtype != GGUFValueType.UINT32:
                raise GGUFError(
                    f"{p}: metadata key 'general.alignment' has type {GGUF_VALUE_TYPE_NAMES[vtype]}, expected uint32"
                )
            alignment = self.metadata["general.alignment"]
            if alignment == 0 or alignment & (alignment - 1):
                raise GGUFError(f"{p}: general.alignment = {alignment} is not a nonzero power of two")
        self.alignment = alignment

        # -- tensor infos
        raw: list[tuple[str, int, tuple[int, ...], int]] = []
        names: set[str] = set()
        for i in range(n_tensors):
            name = cur.string(f"tensor #{i} name", GGML_MAX_NAME - 1)
            if name in names:
                raise GGUFError(f"{p}: duplicate tensor name {name!r}")
            names.add(name)
            t = f"tensor {name!r}"
            n_dims = cur.u32(f"{t}: n_dims")
            if not 1 <= n_dims <= GGML_MAX_DIMS:
                raise GGUFError(f"{p}: {t}: n_dims = {n_dims} is out of range 1..{GGML_MAX_DIMS}")
            ne = tuple(cur.i64(f"{t}: ne[{j}]") for j in range(n_dims))
            for j, d in enumerate(ne):
                if d < 0:
                    raise GGUFError(f"{p}: {t}: ne[{j}] = {d} is negative")
            ggml_type = cur.u32(f"{t}: ggml type")
            rel_offset = cur.u64(f"{t}: offset")
            raw.append((name, ggml_type, ne, rel_offset))

        header_end = cur.pos
        self.data_offset = -(-header_end // alignment) * alignment

        # -- tensor shapes, types and data ranges
        for name, ggml_type, ne, rel_offset in raw:
            t = f"tensor {name!r}"
            blk_values, blk_bytes = ggml_type_block_size(ggml_type, f"{p}: {t}")
            n_elements = 1
            for d in ne:
                n_elements *= d
            if n_elements > INT64_MAX:
                raise GGUFError(f"{p}: {t}: ne {list(ne)} has {n_elements} elements, which overflows int64")
            if ne[0] % blk_values:
                raise GGUFError(
                    f"{p}: {t}: ne[0] = {ne[0]} is not a multiple of the {ggml_type_name(ggml_type)} "
                    f"block size {blk_values}"
                )
            nbytes = n_elements // blk_values * blk_bytes
            if nbytes > INT64_MAX:
                raise GGUFError(f"{p}: {t}: size {nbytes} bytes overflows int64")
            if rel_offset % alignment:
                raise GGUFError(
                    f"{p}: {t}: offset {rel_offset} is not a multiple of the alignment {alignment}"
                )
            offset = self.data_offset + rel_offset
            if offset + nbytes > self.file_size:
                raise GGUFError(
                    f"{p}: {t}: offset {offset} + {nbytes} bytes runs past end of file (size {self.file_size})"
                )
            self.tensors[name] = TensorInfo(name, ggml_type, ne, offset, nbytes)

        # -- overlapping data ranges
        ranges = sorted((ti.offset, ti.offset + ti.nbytes, ti.name) for ti in self.tensors.values() if ti.nbytes)
        for (s0, e0, n0), (s1, e1, n1) in zip(ranges, ranges[1:]):
            if s1 < e0:
                raise GGUFError(
                    f"{p}: tensor {n1!r}: data [{s1}, {e1}) overlaps tensor {n0!r} data [{s0}, {e0})"
                )

    def _read_value(self, cur: _Cursor, vtype: int, key: str) -> tuple[Any, int | None]:
        """Read one value of type vtype; returns (value, array element type or None)."""
        p = self.path
        what = f"metadata key {key!r}"
        sc = _SCALAR_STRUCTS.get(vtype)
        if sc is not None:
            st, size = sc
            cur.need(size, f"{what}: value")
            (v,) = st.unpack_from(cur.buf, cur.pos)
            cur.pos += size
            if vtype == GGUFValueType.BOOL:
                v = v != 0
            return v, None
        if vtype == GGUFValueType.STRING:
            return cur.string(f"{what}: value"), None
        if vtype != GGUFValueType.ARRAY:
            raise GGUFError(f"{p}: {what}: unknown value type {vtype}")

        etype = cur.u32(f"{what}: array element type")
        n = cur.u64(f"{what}: array length")
        if n > MAX_ARRAY_LEN:
            raise GGUFError(f"{p}: {what}: array length {n} exceeds the limit of {MAX_ARRAY_LEN} elements")
        rem = cur.remaining()
        if etype in _SCALARS:
            dt = _SCALARS[etype][1]
            if n * dt.itemsize > rem:
                raise GGUFError(
                    f"{p}: {what}: array length {n} x {dt.itemsize} bytes runs past end of file "
                    f"({rem} bytes remain)"
                )
            if n:
                cur.need(n * dt.itemsize, f"{what}: array")
                arr = np.frombuffer(cur.buf, dtype=dt, count=n, offset=cur.pos).astype(dt.newbyteorder("="))
            else:
                arr = np.empty(0, dtype=dt.newbyteorder("="))
            cur.pos += n * dt.itemsize
            if etype == GGUFValueType.BOOL:
                arr = arr != 0
            return arr, etype
        if etype == GGUFValueType.STRING:
            if n * 8 > rem:
                raise GGUFError(
                    f"{p}: {what}: array length {n} strings runs past end of file ({rem} bytes remain)"
                )
            return self._read_string_array(cur, n, what), etype
        if etype == GGUFValueType.ARRAY:
            raise GGUFError(f"{p}: {what}: nested arrays (array of arrays) are not supported")
        raise GGUFError(f"{p}: {what}: unknown array element type {etype}")

    def _read_string_array(self, cur: _Cursor, n: int, what: str) -> list[str]:
        buf, size, pos = cur.buf, cur.size, cur.pos
        have = len(buf)  # bytes of the file in buf; fill() grows buf in place
        unpack = _U64.unpack_from
        out: list[str] = [""] * n
        try:
            for i in range(n):
                if pos + 8 > size:
                    cur.pos = pos
                    raise GGUFError(
                        f"{self.path}: {what}: element {i}: string length runs past end of file "
                        f"(offset {pos}, file size {size})"
                    )
                if pos + 8 > have:
                    have = len(cur.fill(pos + 8))
                (ln,) = unpack(buf, pos)
                pos += 8
                if ln > size - pos or ln > MAX_STRING_LEN:
                    raise GGUFError(
                        f"{self.path}: {what}: element {i}: string length {ln} at offset {pos - 8} "
                        f"runs past end of file (file size {size})"
                    )
                end = pos + ln
                if end > have:
                    have = len(cur.fill(end))
                out[i] = buf[pos:end].decode("utf-8")
                pos = end
        except UnicodeDecodeError as e:
            raise GGUFError(
                f"{self.path}: {what}: element {i}: invalid utf-8 in string ({e.reason} at byte {e.start})"
            ) from None
        cur.pos = pos
        return out

    # ------------------------------------------------------------------------------------ access

    def value_type(self, key: str) -> tuple[GGUFValueType, GGUFValueType | None]:
        """(GGUF value type, array element type or None) of a metadata key."""
        if key not in self._types:
            raise GGUFError(f"{self.path}: missing metadata key {key!r}")
        vt, et = self._types[key]
        return GGUFValueType(vt), (GGUFValueType(et) if et is not None else None)

    def _type_desc(self, key: str) -> str:
        vt, et = self._types[key]
        if vt == GGUFValueType.ARRAY:
            return f"array of {GGUF_VALUE_TYPE_NAMES[et]}"
        return GGUF_VALUE_TYPE_NAMES[vt]

    def _convert(self, key: str, kind: type) -> tuple[bool, Any]:
        vt, et = self._types[key]
        v = self.metadata[key]
        if kind is object:
            return True, v
        if kind is bool:
            return vt == GGUFValueType.BOOL, v
        if kind is int:
            return vt in _INT_TYPES, v
        if kind is float:
            if vt in _FLOAT_TYPES or vt in _INT_TYPES:
                return True, float(v)
            return False, None
        if kind is str:
            return vt == GGUFValueType.STRING, v
        if kind is list:
            return vt == GGUFValueType.ARRAY and et == GGUFValueType.STRING, v
        if kind is np.ndarray:
            return vt == GGUFValueType.ARRAY and et != GGUFValueType.STRING, v
        return isinstance(v, kind), v

    def get(self, key: str, kind: type | tuple[type, ...] = object, default: Any = _MISSING) -> Any:
        """A metadata value, checked to be of `kind`.

        kind: int (any GGUF integer type, not bool), float (float32/float64, or an integer type,
        returned as float), bool, str, list (array of strings), np.ndarray (array of numbers or
        bools), object (anything), or a tuple of these (the first that matches wins).
        A missing key returns `default`, or raises GGUFError without one. A present key of the
        wrong type raises GGUFError even with a default.
        """
        if key not in self.metadata:
            if default is not _MISSING:
                return default
            raise GGUFError(f"{self.path}: missing metadata key {key!r}")
        kinds = kind if isinstance(kind, tuple) else (kind,)
        for k in kinds:
            ok, v = self._convert(key, k)
            if ok:
                return v
        raise GGUFError(
            f"{self.path}: wrong-typed metadata: key {key!r} has type {self._type_desc(key)}, "
            f"expected {_kind_name(kind)}"
        )

    @property
    def architecture(self) -> str:
        return self.get("general.architecture", str)

    def tensor_info(self, name: str) -> TensorInfo:
        try:
            return self.tensors[name]
        except KeyError:
            raise GGUFError(f"{self.path}: no tensor named {name!r}") from None

    def tensor_data(self, name: str) -> np.ndarray:
        """The tensor's bytes: a read-only 1-D uint8 array, a copy read from the file.
        Raises ModelFileChanged if the file is no longer the one parsed, StorageError if the read
        comes up short or fails."""
        ti = self.tensor_info(name)
        return self._read(ti.offset, ti.nbytes, f"tensor {name!r}")

    def read_range(self, name: str, start: int, nbytes: int) -> np.ndarray:
        """Bytes [start, start + nbytes) of a tensor's data, as tensor_data (one expert's slice of a
        stacked tensor, without reading the rest)."""
        ti = self.tensor_info(name)
        if start < 0 or nbytes < 0 or start + nbytes > ti.nbytes:
            raise ValueError(f"tensor {name!r}: range [{start}, {start + nbytes}) is outside its {ti.nbytes} bytes")
        return self._read(ti.offset + start, nbytes, f"tensor {name!r}")

    def _read(self, offset: int, nbytes: int, what: str) -> np.ndarray:
        out = np.empty(nbytes, np.uint8)
        self.read_into(offset, out, what)
        out.flags.writeable = False
        return out

    def read_into(self, offset: int, out: np.ndarray, what: str) -> None:
        """File bytes [offset, offset + out.nbytes) into `out` (a C-contiguous array, e.g. a
        page-locked buffer), with tensor_data's checks. Callable from several threads at once."""
        fd = self._fd
        if fd is None:
            raise ModelError(f"{self.path}: file is closed")
        nbytes = int(out.nbytes)
        view = memoryview(out).cast("B")
        got = 0
        try:
            while got < nbytes:  # one read returns at most ~2 GiB
                n = os.preadv(fd, [view[got:]], offset + got)
                if n == 0:
                    break
                got += n
        except OSError as e:
            raise StorageError(f"{self.path}: cannot read {what}: {e.strerror or e}") from None
        # After the read: a change made before it (truncation, rewrite) shows in the identity.
        self.identity.check(fd, f"while reading {what}")
        if got != nbytes:
            raise StorageError(f"{self.path}: {what}: short read at offset {offset} ({got} of {nbytes} bytes): "
                               "is the file truncated?")

    def close(self) -> None:
        """Close the file. Arrays returned by tensor_data are copies: they stay valid."""
        self._fd = None
        closer = getattr(self, "_closer", None)
        if closer is not None:
            closer()  # closes the descriptor once

    def __enter__(self) -> GGUFFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"GGUFFile({self.path!r}, version={self.version}, tensors={len(self.tensors)}, "
            f"metadata={len(self.metadata)})"
        )
