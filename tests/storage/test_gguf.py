"""Tests of the validated GGUF reader: a round trip through gguf.GGUFWriter, then one malformed
file per class of defect (each must be a GGUFError naming the problem), every truncation of a
small file, and seeded random byte flips in the header."""

from __future__ import annotations

import os
import random
import struct
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT
from gguf import GGUFValueType as VT

from daemon.errors import GGUFError, ModelError
from daemon.storage.gguf import (
    GGML_TYPE_NAMES,
    MAX_ARRAY_LEN,
    GGUFFile,
    TensorInfo,
    ggml_type_block_size,
)

# --------------------------------------------------------------------------- a valid file, via GGUFWriter

F32_DATA = np.arange(12, dtype=np.float32).reshape(3, 4)
F16_DATA = (np.arange(16, dtype=np.float16) / 4).reshape(2, 8)
Q8_BYTES = np.random.default_rng(0).integers(0, 256, size=(2, 2 * 34), dtype=np.uint8)  # ne = [64, 2]

SCALARS = {
    "t.u8": (VT.UINT8, 200),
    "t.i8": (VT.INT8, -100),
    "t.u16": (VT.UINT16, 60000),
    "t.i16": (VT.INT16, -30000),
    "t.u32": (VT.UINT32, 4_000_000_000),
    "t.i32": (VT.INT32, -2_000_000_000),
    "t.u64": (VT.UINT64, 2**64 - 1),
    "t.i64": (VT.INT64, -(2**63)),
    "t.f32": (VT.FLOAT32, 0.5),
    "t.f64": (VT.FLOAT64, 1e-300),
    "t.bool": (VT.BOOL, True),
    "t.str": (VT.STRING, "héllo ✓ wörld"),
    "llama.block_count": (VT.UINT32, 2),
    "llama.rope.freq_base": (VT.FLOAT32, 10000.0),
}
TOKENS = ["<s>", "</s>", "", "a", "Ġthe", "日本", "\n", "x" * 300]
ARRAYS = {
    "tokenizer.ggml.tokens": (VT.STRING, TOKENS),
    "t.arr_i32": (VT.INT32, [1, -2, 3, 2**31 - 1]),
    "t.arr_u8": (VT.UINT8, [0, 255, 7]),
    "t.arr_f32": (VT.FLOAT32, [0.25, -1.5, 3.0]),
    "t.arr_f64": (VT.FLOAT64, [1e100, -2.5]),
    "t.arr_u64": (VT.UINT64, [2**64 - 1, 0]),
    "t.arr_bool": (VT.BOOL, [True, False, True]),
}
NP_DTYPES = {VT.INT32: np.int32, VT.UINT8: np.uint8, VT.FLOAT32: np.float32, VT.FLOAT64: np.float64,
             VT.UINT64: np.uint64, VT.BOOL: np.bool_}


def write_valid(path: Path, alignment: int | None = None) -> Path:
    w = gguf.GGUFWriter(path, "llama")
    if alignment is not None:
        w.add_custom_alignment(alignment)
    for key, (vt, val) in SCALARS.items():
        w.add_key_value(key, val, vt)
    for key, (vt, val) in ARRAYS.items():
        w.add_key_value(key, val, VT.ARRAY, sub_type=vt)
    w.add_tensor("w.f32", F32_DATA)
    w.add_tensor("w.f16", F16_DATA)
    w.add_tensor("w.q8_0", Q8_BYTES, raw_dtype=QT.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def valid_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_valid(tmp_path_factory.mktemp("gguf") / "valid.gguf")


@pytest.fixture(scope="module")
def valid_bytes(valid_path: Path) -> bytes:
    return valid_path.read_bytes()


def test_round_trip(valid_path: Path) -> None:
    with GGUFFile(valid_path) as g:
        assert g.version == 3
        assert g.alignment == 32
        assert g.file_size == valid_path.stat().st_size
        assert g.architecture == "llama"
        assert g.data_offset % 32 == 0
        for key, (vt, val) in SCALARS.items():
            got = g.metadata[key]
            assert type(got) is type(val), key
            if vt == VT.FLOAT32:
                assert got == pytest.approx(val)
            else:
                assert got == val, key
            assert g.value_type(key) == (vt, None)
        assert g.metadata["tokenizer.ggml.tokens"] == TOKENS
        for key, (vt, val) in ARRAYS.items():
            if vt == VT.STRING:
                continue
            got = g.metadata[key]
            assert isinstance(got, np.ndarray) and got.dtype == NP_DTYPES[vt], key
            np.testing.assert_array_equal(got, np.array(val, dtype=NP_DTYPES[vt]))
            assert got.flags.writeable  # a copy, not a view of the mapping
        assert list(g.metadata)[: len(SCALARS) + 1] == ["general.architecture", *SCALARS]

        assert list(g.tensors) == ["w.f32", "w.f16", "w.q8_0"]
        expect = {
            "w.f32": (QT.F32, (4, 3), F32_DATA.tobytes()),
            "w.f16": (QT.F16, (8, 2), F16_DATA.tobytes()),
            "w.q8_0": (QT.Q8_0, (64, 2), Q8_BYTES.tobytes()),
        }
        for name, (qt, ne, data) in expect.items():
            ti = g.tensor_info(name)
            assert isinstance(ti, TensorInfo)
            assert ti.ggml_type == qt and ti.type_name == qt.name
            assert ti.ne == ne and ti.shape == tuple(reversed(ne))
            assert ti.nbytes == len(data)
            assert ti.offset % 32 == 0 and ti.offset >= g.data_offset
            arr = g.tensor_data(name)
            assert arr.dtype == np.uint8 and arr.ndim == 1 and not arr.flags.writeable
            assert arr.tobytes() == data
        f32 = g.tensor_data("w.f32").view(np.float32).reshape(g.tensors["w.f32"].shape)
        np.testing.assert_array_equal(f32, F32_DATA)
        with pytest.raises(GGUFError, match="no tensor named 'nope'"):
            g.tensor_data("nope")
        with pytest.raises(GGUFError, match="no tensor named"):
            g.tensor_info("nope")
        view = g.tensor_data("w.f16")
    # arrays (copies) outlive close(); new ones cannot be read
    assert view.tobytes() == F16_DATA.tobytes()
    with pytest.raises(ModelError, match="closed"):
        g.tensor_data("w.f16")


def test_custom_alignment_round_trip(tmp_path: Path) -> None:
    with GGUFFile(write_valid(tmp_path / "a.gguf", alignment=256)) as g:
        assert g.alignment == 256 and g.metadata["general.alignment"] == 256
        assert g.data_offset % 256 == 0
        assert all(t.offset % 256 == 0 for t in g.tensors.values())
        assert g.tensor_data("w.q8_0").tobytes() == Q8_BYTES.tobytes()


def test_get_kinds(valid_path: Path) -> None:
    with GGUFFile(valid_path) as g:
        for key in ("t.u8", "t.i8", "t.u16", "t.i16", "t.u32", "t.i32", "t.u64", "t.i64"):
            assert g.get(key, int) == SCALARS[key][1]
            assert g.get(key, float) == float(SCALARS[key][1])
        assert g.get("t.f32", float) == 0.5
        assert isinstance(g.get("t.u32", float), float)
        assert g.get("t.bool", bool) is True
        assert g.get("t.str", str) == SCALARS["t.str"][1]
        assert g.get("tokenizer.ggml.tokens", list) == TOKENS
        assert g.get("t.arr_f32", np.ndarray).dtype == np.float32
        assert g.get("t.str", (int, str)) == SCALARS["t.str"][1]
        assert g.get("t.u8") == 200
        assert g.get("llama.expert_count", int, default=None) is None
        assert g.get("llama.expert_count", int, 8) == 8
        with pytest.raises(GGUFError, match=r"missing metadata key 'llama\.expert_count'"):
            g.get("llama.expert_count", int)
        with pytest.raises(GGUFError, match=r"wrong-typed metadata.*'t\.bool'.*bool.*expected int"):
            g.get("t.bool", int)
        with pytest.raises(GGUFError, match=r"'t\.f32'.*float32.*expected int"):
            g.get("t.f32", int)
        with pytest.raises(GGUFError, match=r"'t\.arr_i32'.*array of int32.*expected string array"):
            g.get("t.arr_i32", list)
        with pytest.raises(GGUFError, match=r"'tokenizer\.ggml\.tokens'.*array of string.*numeric array"):
            g.get("tokenizer.ggml.tokens", np.ndarray)
        # a present key of the wrong type is an error even with a default
        with pytest.raises(GGUFError, match=r"'t\.str'.*expected int or float"):
            g.get("t.str", (int, float), default=3)


def test_helpers() -> None:
    assert ggml_type_block_size(QT.Q4_K) == (256, 144)
    assert ggml_type_block_size(int(QT.F32)) == (1, 4)
    assert GGML_TYPE_NAMES[int(QT.Q8_0)] == "Q8_0"
    with pytest.raises(GGUFError, match="tensor 'x': unknown ggml type 99"):
        ggml_type_block_size(99, "tensor 'x'")


def test_open_errors(tmp_path: Path) -> None:
    with pytest.raises(ModelError, match="cannot open model file"):
        GGUFFile(tmp_path / "missing.gguf")
    with pytest.raises(ModelError, match="cannot open model file"):
        GGUFFile(tmp_path)
    (tmp_path / "empty.gguf").write_bytes(b"")
    with pytest.raises(GGUFError, match="file too small"):
        GGUFFile(tmp_path / "empty.gguf")
    with pytest.raises(ModelError, match="cannot open model file"):
        GGUFFile(str(tmp_path / "a\0b.gguf"))


def test_file_cut_while_its_header_is_read(valid_path: Path, tmp_path: Path, monkeypatch) -> None:
    """The header is read with positional reads, not mapped: a file cut after it was opened is a
    GGUFError, not a SIGBUS."""
    import daemon.storage.gguf as gguf_module

    path = tmp_path / "cut.gguf"
    path.write_bytes(valid_path.read_bytes())
    real_open = gguf_module.open_regular

    def open_then_cut(p):
        fd, st = real_open(p)
        os.truncate(p, 100)  # inside the metadata
        return fd, st
    monkeypatch.setattr(gguf_module, "open_regular", open_then_cut)
    with pytest.raises(GGUFError, match="the file shrank while it was being read"):
        GGUFFile(path)


# --------------------------------------------------------------------------- hand-built files

def u32(v: int) -> bytes:
    return struct.pack("<I", v)


def u64(v: int) -> bytes:
    return struct.pack("<Q", v)


def i64(v: int) -> bytes:
    return struct.pack("<q", v)


def gstr(s: str | bytes) -> bytes:
    b = s.encode() if isinstance(s, str) else s
    return u64(len(b)) + b


def kv(key: str | bytes, vtype: int, payload: bytes) -> bytes:
    return gstr(key) + u32(vtype) + payload


def kv_u32(key: str, v: int) -> bytes:
    return kv(key, VT.UINT32, u32(v))


def kv_str(key: str, v: str | bytes) -> bytes:
    return kv(key, VT.STRING, gstr(v))


def ti(name: str | bytes, ne: list[int], ggml_type: int = QT.F32, offset: int = 0) -> bytes:
    return gstr(name) + u32(len(ne)) + b"".join(i64(d) for d in ne) + u32(ggml_type) + u64(offset)


ARCH = kv_str("general.architecture", "llama")


def build(
    kvs: list[bytes] = (),  # type: ignore[assignment]
    tensors: list[bytes] = (),  # type: ignore[assignment]
    data: bytes = b"",
    *,
    version: int = 3,
    n_kv: int | None = None,
    n_tensors: int | None = None,
    alignment: int = 32,
) -> bytes:
    kvs, tensors = list(kvs), list(tensors)
    head = b"GGUF" + u32(version)
    head += u64(len(tensors) if n_tensors is None else n_tensors)
    head += u64(len(kvs) if n_kv is None else n_kv)
    body = head + b"".join(kvs) + b"".join(tensors)
    if data:
        body += b"\0" * (-len(body) % alignment)
    return body + data


@pytest.fixture
def parse(tmp_path: Path):
    def _parse(blob: bytes) -> GGUFFile:
        p = tmp_path / "t.gguf"
        p.write_bytes(blob)
        return GGUFFile(p)

    return _parse


def test_builder_sanity(parse) -> None:
    for version in (2, 3):
        g = parse(build([ARCH, kv_u32("llama.block_count", 4)],
                        [ti("a", [4, 2]), ti("b", [8], QT.F16, 32)], bytes(64), version=version))
        assert g.version == version and g.get("llama.block_count", int) == 4
        assert g.tensors["a"].nbytes == 32 and g.tensors["b"].offset == g.tensors["a"].offset + 32
        assert g.tensors["b"].shape == (8,)
        g.close()
    g = parse(build([ARCH]))  # no tensors at all: fine
    assert g.tensors == {} and g.architecture == "llama"
    g.close()
    g = parse(build([ARCH], [ti("z", [0, 4])], bytes(32)))  # a zero-size tensor is allowed
    assert g.tensors["z"].nbytes == 0
    g.close()


MALFORMED: dict[str, tuple[bytes, str]] = {
    "bad magic": (b"GGML" + build([ARCH])[4:], r"not a GGUF file \(it does not start with the GGUF magic\)$"),
    "version 1": (build([ARCH], version=1), r"unsupported version 1\b"),
    "version huge": (build([ARCH], version=0x7FFFFFFF), r"unsupported version 2147483647"),
    "big-endian": (b"GGUF" + struct.pack(">I", 3) + build([ARCH])[8:], r"big-endian"),
    "n_tensors 2^63": (build([ARCH], n_tensors=2**63), r"n_tensors = 9223372036854775808 cannot fit"),
    "n_tensors 2^64-1": (build([ARCH], n_tensors=2**64 - 1), r"n_tensors = 18446744073709551615 cannot fit"),
    "n_kv 2^63": (build([ARCH], n_kv=2**63), r"n_kv = 9223372036854775808 cannot fit"),
    "n_kv too many": (build([ARCH], n_kv=2), r"truncated file: metadata key #1 length"),
    "key length past EOF": (build([u64(1000) + b"general"]), r"metadata key #0: string length 1000 .*runs past end of file"),
    "key length 2^64-1": (build([u64(2**64 - 1) + b"general.architecture" + bytes(8)]),
                          r"metadata key #0: string length 18446744073709551615 exceeds the limit"),
    "value length past EOF": (build([kv("general.name", VT.STRING, u64(500) + b"abc")]),
                              r"'general\.name': value: string length 500 .*runs past end of file"),
    "array length huge": (build([kv("t.a", VT.ARRAY, u32(VT.UINT32) + u64(2**62) + bytes(16))]),
                          r"'t\.a': array length 4611686018427387904 exceeds the limit"),
    "array length past EOF": (build([kv("t.a", VT.ARRAY, u32(VT.FLOAT32) + u64(1000) + bytes(16))]),
                              r"'t\.a': array length 1000 x 4 bytes runs past end of file"),
    "string array length past EOF": (
        build([kv("t.s", VT.ARRAY, u32(VT.STRING) + u64(10_000) + gstr("a") * 3)]),
        r"'t\.s': array length 10000 strings runs past end of file"),
    "string array element past EOF": (
        build([kv("t.s", VT.ARRAY, u32(VT.STRING) + u64(3) + gstr("a") + u64(400) + bytes(20))]),
        r"'t\.s': element 1: string length 400 .*runs past end of file"),
    "nested array": (build([kv("t.n", VT.ARRAY, u32(VT.ARRAY) + u64(1) + u32(VT.UINT8) + u64(1) + b"\1")]),
                     r"'t\.n': nested arrays"),
    "unknown value type": (build([kv("t.x", 13, bytes(8))]), r"'t\.x': unknown value type 13"),
    "unknown array element type": (build([kv("t.x", VT.ARRAY, u32(77) + u64(1) + bytes(8))]),
                                   r"'t\.x': unknown array element type 77"),
    "duplicate key": (build([ARCH, kv_u32("llama.block_count", 1), kv_u32("llama.block_count", 2)]),
                      r"duplicate metadata key 'llama\.block_count'"),
    "invalid utf-8 key": (build([kv(b"general.\xff\xfename", VT.UINT8, b"\1")]),
                          r"metadata key #0: invalid utf-8"),
    "invalid utf-8 value": (build([kv_str("general.name", b"ab\xc3(")]), r"'general\.name': value: invalid utf-8"),
    "invalid utf-8 in string array": (
        build([kv("tokenizer.ggml.tokens", VT.ARRAY, u32(VT.STRING) + u64(2) + gstr("ok") + gstr(b"\xed\xa0\x80"))]),
        r"'tokenizer\.ggml\.tokens': element 1: invalid utf-8"),
    "duplicate tensor name": (build([ARCH], [ti("w", [8]), ti("w", [8], offset=32)], bytes(64)),
                              r"duplicate tensor name 'w'"),
    "tensor name too long": (build([ARCH], [ti("x" * 64, [8])], bytes(32)),
                             r"tensor #0 name: string length 64 exceeds the limit of 63"),
    "tensor name invalid utf-8": (build([ARCH], [ti(b"w\x80", [8])], bytes(32)), r"tensor #0 name: invalid utf-8"),
    "n_dims 5": (build([ARCH], [ti("w", [1, 1, 1, 1, 8])], bytes(32)), r"tensor 'w': n_dims = 5 is out of range 1\.\.4"),
    "n_dims 0": (build([ARCH], [ti("w", [])], bytes(32)), r"tensor 'w': n_dims = 0 is out of range"),
    "n_dims huge": (build([ARCH], [gstr("w") + u32(2**32 - 1) + bytes(64)]), r"tensor 'w': n_dims = 4294967295"),
    "ne overflow": (build([ARCH], [ti("w", [2**32, 2**32])], bytes(32)),
                    r"tensor 'w': ne \[4294967296, 4294967296\] has 18446744073709551616 elements, which overflows int64"),
    "ne overflow 4 dims": (build([ARCH], [ti("w", [2**62, 2, 2, 2])], bytes(32)), r"tensor 'w': .*overflows int64"),
    "nbytes overflow": (build([ARCH], [ti("w", [2**62], QT.F32)], bytes(32)),
                        r"tensor 'w': size 18446744073709551616 bytes overflows int64"),
    "negative ne": (build([ARCH], [ti("w", [8, -1])], bytes(32)), r"tensor 'w': ne\[1\] = -1 is negative"),
    "unknown ggml type": (build([ARCH], [ti("w", [8], 99)], bytes(32)), r"tensor 'w': unknown ggml type 99"),
    "removed ggml type 4": (build([ARCH], [ti("w", [32], 4)], bytes(32)), r"tensor 'w': unknown ggml type 4"),
    "ne0 not multiple of block": (build([ARCH], [ti("w", [33, 2], QT.Q8_0)], bytes(96)),
                                  r"tensor 'w': ne\[0\] = 33 is not a multiple of the Q8_0 block size 32"),
    "offset past EOF": (build([ARCH], [ti("blk.0.attn_q.weight", [8], offset=2**20)], bytes(32)),
                        r"tensor 'blk\.0\.attn_q\.weight': offset \d+ \+ 32 bytes runs past end of file \(size \d+\)"),
    "offset 2^64-32": (build([ARCH], [ti("w", [8], offset=2**64 - 32)], bytes(32)), r"tensor 'w': offset \d+ .*past end of file"),
    "misaligned offset": (build([ARCH], [ti("w", [4]), ti("v", [4], offset=20)], bytes(64)),
                          r"tensor 'v': offset 20 is not a multiple of the alignment 32"),
    "truncated data": (build([ARCH], [ti("w", [4, 4]), ti("v", [16], offset=64)], bytes(100)),
                       r"tensor 'v': offset \d+ \+ 64 bytes runs past end of file"),
    "overlap": (build([ARCH], [ti("w", [16]), ti("v", [8], offset=32)], bytes(64)),
                r"tensor 'v': data .* overlaps tensor 'w'"),
    "alignment 3": (build([ARCH, kv_u32("general.alignment", 3)]), r"general\.alignment = 3 is not a nonzero power of two"),
    "alignment 0": (build([ARCH, kv_u32("general.alignment", 0)]), r"general\.alignment = 0 is not a nonzero power of two"),
    "alignment 48": (build([ARCH, kv_u32("general.alignment", 48)]), r"general\.alignment = 48 is not"),
    "alignment wrong type": (build([ARCH, kv("general.alignment", VT.UINT64, u64(32))]),
                             r"'general\.alignment' has type uint64, expected uint32"),
    "truncated header": (build([ARCH, kv_u32("llama.block_count", 4)])[:-2], r"truncated file: metadata key 'llama\.block_count': value"),
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_malformed(case: str, parse) -> None:
    blob, pattern = MALFORMED[case]
    with pytest.raises(GGUFError, match=pattern):
        parse(blob)


def test_wrong_typed_metadata_the_model_needs(parse) -> None:
    with parse(build([ARCH, kv_str("llama.block_count", "24")])) as g:
        with pytest.raises(GGUFError, match=r"wrong-typed metadata: key 'llama\.block_count' has type string, expected int"):
            g.get("llama.block_count", int)
    with parse(build([kv_u32("general.architecture", 1)])) as g:
        with pytest.raises(GGUFError, match=r"'general\.architecture' has type uint32, expected str"):
            g.architecture
    with parse(build([kv_u32("llama.block_count", 1)])) as g:
        with pytest.raises(GGUFError, match=r"missing metadata key 'general\.architecture'"):
            g.architecture


def test_patched_writer_file(valid_bytes: bytes, parse) -> None:
    """Defects patched into a real GGUFWriter file, at the offsets the parser reports."""
    with parse(valid_bytes) as g:
        info = g.tensors["w.q8_0"]
        data_offset = g.data_offset
    # the ggml type field is 12 bytes before the end of the last tensor info
    # (name, n_dims, ne[2], type u32, offset u64), and the header ends before the padding
    needle = gstr("w.q8_0") + u32(2) + i64(64) + i64(2) + u32(QT.Q8_0)
    pos = valid_bytes.index(needle)
    assert pos + len(needle) + 8 <= data_offset
    b = bytearray(valid_bytes)
    b[pos + len(needle) - 4 : pos + len(needle)] = u32(99)
    with pytest.raises(GGUFError, match=r"tensor 'w\.q8_0': unknown ggml type 99"):
        parse(bytes(b))
    b = bytearray(valid_bytes)
    b[pos + len(needle) : pos + len(needle) + 8] = u64(info.offset - data_offset + 2**30)
    with pytest.raises(GGUFError, match=r"tensor 'w\.q8_0': offset \d+ \+ 136 bytes runs past end of file"):
        parse(bytes(b))
    b = bytearray(valid_bytes)
    b[8:16] = u64(2**63)
    with pytest.raises(GGUFError, match="n_tensors = 9223372036854775808 cannot fit"):
        parse(bytes(b))
    with pytest.raises(GGUFError, match=r"tensor 'w\.q8_0': offset \d+ \+ 136 bytes runs past end of file"):
        parse(valid_bytes[: info.offset + info.nbytes - 1])


# --------------------------------------------------------------------------- truncation and fuzzing

def test_every_truncation_raises(tmp_path: Path) -> None:
    """Every prefix of a small file that cuts the header or any tensor's data is a GGUFError."""
    w = gguf.GGUFWriter(tmp_path / "small.gguf", "llama")
    w.add_uint32("llama.block_count", 2)
    w.add_float32("llama.rope.freq_base", 10000.0)
    w.add_key_value("tokenizer.ggml.tokens", ["a", "bc", ""], VT.ARRAY, sub_type=VT.STRING)
    w.add_key_value("tokenizer.ggml.scores", [0.5, 1.0, -1.0], VT.ARRAY, sub_type=VT.FLOAT32)
    w.add_bool("t.flag", False)
    w.add_tensor("a", np.ones(8, dtype=np.float32))
    w.add_tensor("b", np.ones((2, 4), dtype=np.float16))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    full = (tmp_path / "small.gguf").read_bytes()
    with GGUFFile(tmp_path / "small.gguf") as g:
        end = max(t.offset + t.nbytes for t in g.tensors.values())
    p = tmp_path / "cut.gguf"
    for cut in range(end):
        p.write_bytes(full[:cut])
        with pytest.raises(GGUFError):
            GGUFFile(p)
    p.write_bytes(full[:end])  # up to the end of the last tensor's data: valid
    GGUFFile(p).close()


def test_random_header_byte_flips(valid_bytes: bytes, tmp_path: Path) -> None:
    """Seeded random corruption of the header: the reader parses or raises GGUFError, nothing else,
    and whatever it accepts is self-consistent."""
    with open_blob(valid_bytes, tmp_path) as g:
        header_end = g.data_offset
    rng = random.Random(1234)
    p = tmp_path / "flip.gguf"
    outcomes = {"ok": 0, "error": 0}
    for _ in range(400):
        b = bytearray(valid_bytes)
        for _ in range(rng.choice((1, 1, 2, 3))):
            i = rng.randrange(header_end)
            b[i] = rng.randrange(256) if rng.random() < 0.5 else b[i] ^ (1 << rng.randrange(8))
        p.write_bytes(b)
        try:
            g = GGUFFile(p)
        except GGUFError:
            outcomes["error"] += 1
            continue
        outcomes["ok"] += 1
        with g:
            assert g.alignment & (g.alignment - 1) == 0
            for t in g.tensors.values():
                assert 1 <= len(t.ne) <= 4 and all(d >= 0 for d in t.ne)
                assert g.data_offset <= t.offset and t.offset + t.nbytes <= g.file_size
                assert len(g.tensor_data(t.name)) == t.nbytes
    assert outcomes["ok"] > 0 and outcomes["error"] > 0


def open_blob(blob: bytes, tmp_path: Path) -> GGUFFile:
    p = tmp_path / "orig.gguf"
    p.write_bytes(blob)
    return GGUFFile(p)


def test_array_limit_constant() -> None:
    # vocabularies (<= ~300k entries) are far below the sanity limit on array lengths
    assert MAX_ARRAY_LEN >= 1 << 20
