"""Structure-aware GGUF mutation fuzzer: every mutant is loaded AND run in a capped child process.

    python benchmarks/fuzz_gguf.py [--mutants 10000] [--seed 0] [--jobs 2] [--timeout 30]
                                   [--keep DIR] [--json OUT] [--seeds ARCH:WTYPE|PATH ...]
    python benchmarks/fuzz_gguf.py --replay I [--seed S] --keep DIR   # write mutant I again

Seeds are small fixtures (tests/fixtures/build.py: a dense llama and five MoE architectures in
several quant types) or GGUF files given with --seeds. Each seed's layout is parsed once (header
fields; each key/value's key, type and value offsets; each tensor info's name, n_dims, ne, type
and offset fields; the data section), and mutants are made by in-place edits that know it:

- header bit flips, versions, huge/off-by-one n_tensors and n_kv;
- truncations at random points and at field boundaries;
- huge, zero and off-by-one string lengths, array lengths and array element types;
- tensor infos: n_dims, ne values (huge, negative, transposed), ggml types, offsets
  (huge, misaligned, overlapping), names (1-bit flips, expert tensors above all; duplicates; swaps);
- general.alignment (the same-length key general.file_type renamed to it, with odd values);
- metadata values: non-finite, zero and negative floats (rms epsilon, rope base, scaling factor),
  huge/zero/negative ints (block, expert, head counts, widths, context length, token ids),
  value type changes, token types, bit flips inside strings (architecture, vocabulary, merges);
- the data section: random byte flips, and NaN/inf written into norms, scales and weights.

One mutation in most mutants, two or three stacked in some (a truncation, if any, goes last).
A few mutants are not edits: the unmutated file changed on disk after it was loaded (truncated,
overwritten, replaced, extended, unlinked), or a model path that is no file (a FIFO, a directory,
/dev/null, missing, a NUL in it, a symlink loop, empty, too long).
Mutant I of a run depends only on --seed, I and the seed files, so `--replay I` rebuilds it.

Each mutant runs in a persistent worker process (numba's import and the cached kernels cost
seconds, paid once per worker) with an address-space cap (RLIMIT_AS, --mem-gb, 4 GiB: a worker
maps under 1 GiB, and a forged count that makes the loader allocate fails sooner): Engine.load
with a 2 MB expert cache (a quarter of them unlimited) and expert_pack=False, tokenize a short
text, forward 8 tokens, then three greedy and two sampled decode steps. A worker that dies is a
crash; one that does not answer in --timeout seconds is killed and the mutant retried once with
--slow-timeout (a kernel compiled on first use, for a mutated quant type, is slow, not hung); a
second timeout is a hang, and the worker's Python stacks (faulthandler) say where. Workers are
restarted after either. Outcomes:

    ok      the mutant loaded and ran
    clean   a daemon.errors.MoedError subclass (the promise: bad files give clear errors)
    other   any other exception: type, message, innermost frame in moed code
    crash   the worker died (signal or exit)
    hang    no answer within the timeouts

It prints progress with a rate, a summary table, and every non-clean failure grouped by (kind,
exception type, location) with one example mutation each. `--json OUT` writes every result.
Exit status 1 if there is any crash, hang or non-MoedError failure.
"""

from __future__ import annotations

import argparse
import dataclasses
import faulthandler
import json
import math
import os
import random
import re
import resource
import select
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]

DEFAULT_SEEDS = ("qwen3moe:Q8_0", "llama-moe:Q4_K", "gpt-oss:MXFP4", "qwen2moe:Q4_0", "olmoe:F16",
                 "llama:Q6_K")
SMALL_CACHE_MB = 2.0  # the bounded expert cache most mutants run with (0 = unlimited, for the rest)
UNLIMITED_SHARE = 0.25
TEXT = "The quick brown fox jumps over the lazy dog."
KINDS = ("ok", "clean", "other", "crash", "hang")
FAILURE_KINDS = ("other", "crash", "hang")

# GGUF value types (gguf.GGUFValueType) and ggml block layouts, written out: the layout parser and
# the mutators stand alone.
VT_U8, VT_I8, VT_U16, VT_I16, VT_U32, VT_I32, VT_F32, VT_BOOL, VT_STR, VT_ARR, VT_U64, VT_I64, VT_F64 = range(13)
SCALAR_FMT = {VT_U8: "<B", VT_I8: "<b", VT_U16: "<H", VT_I16: "<h", VT_U32: "<I", VT_I32: "<i",
              VT_F32: "<f", VT_BOOL: "<B", VT_U64: "<Q", VT_I64: "<q", VT_F64: "<d"}
INT_VTYPES = (VT_U8, VT_I8, VT_U16, VT_I16, VT_U32, VT_I32, VT_U64, VT_I64)
FLOAT_VTYPES = (VT_F32, VT_F64)
# ggml types: (name, values per block, bytes per block, offset of an f16 scale in the block or None)
GGML_TYPES = {0: ("F32", 1, 4, None), 1: ("F16", 1, 2, None), 2: ("Q4_0", 32, 18, 0), 3: ("Q4_1", 32, 20, 0),
              6: ("Q5_0", 32, 22, 0), 7: ("Q5_1", 32, 24, 0), 8: ("Q8_0", 32, 34, 0), 12: ("Q4_K", 256, 144, 0),
              13: ("Q5_K", 256, 176, 0), 14: ("Q6_K", 256, 210, 208), 20: ("IQ4_NL", 32, 18, 0),
              30: ("BF16", 1, 2, None), 39: ("MXFP4", 32, 17, None)}


# ---------------------------------------------------------------------------------------- layout


@dataclass
class KV:
    key: str
    key_len_off: int  # u64 key length
    vtype_off: int  # u32 value type
    vtype: int
    value_off: int  # scalar value, string length, or array element type
    value_end: int
    arr_len_off: int | None = None  # u64 array length
    arr_n: int = 0
    etype: int | None = None
    elem_offs: list[int] = field(default_factory=list)  # string arrays: each element's u64 length


@dataclass
class TensorField:
    name: str
    name_len_off: int  # u64 name length; the name bytes follow
    ndims_off: int
    n_dims: int
    ne_offs: list[int]
    ne: list[int]
    type_off: int
    ggml_type: int
    offset_off: int  # u64 offset relative to the data section
    rel_offset: int

    @property
    def name_off(self) -> int:
        return self.name_len_off + 8


@dataclass
class Layout:
    """Where every field of a well-formed GGUF file is. Offsets are absolute."""
    size: int
    kvs: list[KV]
    tensors: list[TensorField]
    header_end: int
    alignment: int
    data_offset: int
    boundaries: list[int]  # start of every field, and the ends of the header and of each tensor's data

    def kv(self, key: str) -> KV | None:
        return next((k for k in self.kvs if k.key == key), None)

    def tensor_range(self, t: TensorField) -> tuple[int, int]:
        """Absolute [start, end) of a tensor's data (end 0-sized for an unknown type)."""
        start = self.data_offset + t.rel_offset
        _, blk_values, blk_bytes, _ = GGML_TYPES.get(t.ggml_type, ("?", 1, 0, None))
        n = math.prod(t.ne)
        return start, start + n // blk_values * blk_bytes


class _Reader:
    def __init__(self, buf: bytes):
        self.buf, self.pos, self.starts = buf, 0, []

    def take(self, fmt: str):
        self.starts.append(self.pos)
        (v,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return v

    def string(self) -> str:
        n = self.take("<Q")
        s = self.buf[self.pos:self.pos + n].decode("utf-8")
        self.pos += n
        return s


def parse_layout(buf: bytes) -> Layout:
    """The layout of a well-formed (seed) GGUF file."""
    r = _Reader(buf)
    if buf[:4] != b"GGUF":
        raise ValueError("not a GGUF file")
    r.starts.append(0)
    r.pos = 4
    r.take("<I")
    n_tensors, n_kv = r.take("<Q"), r.take("<Q")
    kvs = [_parse_kv(r) for _ in range(n_kv)]
    tensors = [_parse_tensor(r) for _ in range(n_tensors)]
    header_end = r.pos
    align_kv = next((k for k in kvs if k.key == "general.alignment"), None)
    alignment = struct.unpack_from("<I", buf, align_kv.value_off)[0] if align_kv else 32
    data_offset = -(-header_end // alignment) * alignment
    lay = Layout(len(buf), kvs, tensors, header_end, alignment, data_offset, [])
    ends = [header_end, data_offset] + [e for t in tensors for e in lay.tensor_range(t)]
    lay.boundaries = sorted(set(r.starts + ends))
    return lay


def _parse_kv(r: _Reader) -> KV:
    key_len_off = r.pos
    key = r.string()
    vtype_off = r.pos
    vtype = r.take("<I")
    kv = KV(key, key_len_off, vtype_off, vtype, r.pos, r.pos)
    if vtype in SCALAR_FMT:
        r.take(SCALAR_FMT[vtype])
    elif vtype == VT_STR:
        r.string()
    elif vtype == VT_ARR:
        kv.etype = r.take("<I")
        kv.arr_len_off = r.pos
        kv.arr_n = r.take("<Q")
        if kv.etype == VT_STR:
            for _ in range(kv.arr_n):
                kv.elem_offs.append(r.pos)
                n = struct.unpack_from("<Q", r.buf, r.pos)[0]  # element lengths are not boundaries
                r.pos += 8 + n
        else:
            r.starts.append(r.pos)
            r.pos += kv.arr_n * struct.calcsize(SCALAR_FMT[kv.etype])
    else:
        raise ValueError(f"seed has an unknown value type {vtype} at key {key!r}")
    kv.value_end = r.pos
    return kv


def _parse_tensor(r: _Reader) -> TensorField:
    name_len_off = r.pos
    name = r.string()
    ndims_off = r.pos
    n_dims = r.take("<I")
    ne_offs, ne = [], []
    for _ in range(n_dims):
        ne_offs.append(r.pos)
        ne.append(r.take("<q"))
    type_off = r.pos
    ggml_type = r.take("<I")
    offset_off = r.pos
    rel_offset = r.take("<Q")
    return TensorField(name, name_len_off, ndims_off, n_dims, ne_offs, ne, type_off, ggml_type, offset_off,
                       rel_offset)


# ------------------------------------------------------------------------------------- mutations


@dataclass
class Mutant:
    buf: bytearray
    lay: Layout
    rng: random.Random
    orig: bytes  # the seed: lengths are read from it, whatever earlier mutations wrote
    notes: list[str] = field(default_factory=list)

    def put(self, fmt: str, off: int, value) -> None:
        struct.pack_into(fmt, self.buf, off, value)

    def get(self, fmt: str, off: int):
        return struct.unpack_from(fmt, self.buf, off)[0]

    def seed_u64(self, off: int) -> int:
        return struct.unpack_from("<Q", self.orig, off)[0]


U32_EDGES = (0, 1, 2, 3, 4, 7, 8, 0x7F, 0x80, 0xFF, 0x100, 0xFFFF, 0x10000, 0x7FFFFFFF, 0x80000000,
             0xFFFFFFFE, 0xFFFFFFFF)
U64_EDGES = U32_EDGES + (1 << 32, (1 << 32) + 1, 1 << 40, 1 << 48, 1 << 62, (1 << 63) - 1, 1 << 63,
                         (1 << 64) - 2, (1 << 64) - 1)
I64_EDGES = (0, 1, -1, 2, 31, 32, 33, 255, 256, 257, (1 << 31) - 1, 1 << 31, 1 << 32, 1 << 40, 1 << 62,
             (1 << 63) - 1, -(1 << 63), -2)
FLOAT_EDGES = (math.nan, -math.nan, math.inf, -math.inf, 0.0, -0.0, -1.0, -1e-5, 1e-45, 1e-38, 1e-30,
               3.4e38, 1e30, 1e10, 1.0)
INT_RANGES = {"<B": (0, 0xFF), "<b": (-0x80, 0x7F), "<H": (0, 0xFFFF), "<h": (-0x8000, 0x7FFF),
              "<I": (0, 0xFFFFFFFF), "<i": (-(1 << 31), (1 << 31) - 1), "<Q": (0, (1 << 64) - 1),
              "<q": (-(1 << 63), (1 << 63) - 1)}
# Metadata the model reads: a mutation picks one of these more often than other keys.
HOT_KEY_SUFFIXES = (".block_count", ".expert_count", ".expert_used_count", ".embedding_length",
                    ".attention.head_count", ".attention.head_count_kv", ".context_length",
                    ".feed_forward_length", ".expert_feed_forward_length", ".expert_shared_feed_forward_length",
                    ".attention.key_length", ".attention.value_length", ".rope.dimension_count",
                    ".vocab_size", ".attention.sliding_window", ".rope.scaling.original_context_length",
                    ".attention.layer_norm_rms_epsilon", ".rope.freq_base", ".rope.scaling.factor",
                    "_token_id")


def edge_int(m: Mutant, fmt: str, old: int, edges=U64_EDGES) -> int:
    """An interesting integer for a field of struct format fmt that now holds `old`."""
    lo, hi = INT_RANGES[fmt]
    r = m.rng.random()
    if r < 0.3:
        v = m.rng.choice((old - 1, old + 1, old * 2, old // 2, old << 8, -old, old * 1000, old + 1000))
    elif r < 0.85:
        v = m.rng.choice(edges + (-1, -2, lo, hi))
    else:
        v = m.rng.randint(lo, hi)
    if v < lo or v > hi:  # wrap like a C cast: -1 becomes 0xFFFFFFFF in a u32
        v &= (hi - lo)
        if lo < 0 and v > hi:
            v -= hi - lo + 1
    return v


def _set_int(m: Mutant, fmt: str, off: int, what: str, edges=U64_EDGES) -> None:
    old = m.get(fmt, off)
    new = edge_int(m, fmt, old, edges)
    m.put(fmt, off, new)
    m.notes.append(f"{what}: {old} -> {new}")


def _flip_bit(m: Mutant, start: int, end: int, what: str) -> None:
    pos = m.rng.randrange(start, end)
    bit = m.rng.randrange(8)
    m.buf[pos] ^= 1 << bit
    m.notes.append(f"{what}: bit {bit} of byte {pos} flipped")


def _pick_kv(m: Mutant, want: Callable[[KV], bool]) -> KV | None:
    kvs = [k for k in m.lay.kvs if want(k)]
    if not kvs:
        return None
    hot = [k for k in kvs if k.key.endswith(HOT_KEY_SUFFIXES)]
    return m.rng.choice(hot if hot and m.rng.random() < 0.7 else kvs)


def mut_header_bitflip(m: Mutant) -> None:
    _flip_bit(m, 0, 24, "header (magic, version, counts)")


def mut_meta_bitflip(m: Mutant) -> None:
    _flip_bit(m, 24, m.lay.header_end, "metadata/tensor-info region")


def mut_version(m: Mutant) -> None:
    old = m.get("<I", 4)
    new = m.rng.choice((0, 1, 2, 4, 0x03000000, 0x02000000, 0xFFFFFFFF, m.rng.getrandbits(32)))
    m.put("<I", 4, new)
    m.notes.append(f"version: {old} -> {new}")


def mut_counts(m: Mutant) -> None:
    off, what = m.rng.choice(((8, "n_tensors"), (16, "n_kv")))
    _set_int(m, "<Q", off, what)


def mut_truncate_random(m: Mutant) -> None:
    if m.rng.random() < 0.5:
        n = m.rng.randrange(0, m.lay.header_end + 64)
    else:
        n = m.rng.randrange(0, m.lay.size)
    _truncate(m, n, "at a random point")


def mut_truncate_boundary(m: Mutant) -> None:
    n = max(0, m.rng.choice(m.lay.boundaries) + m.rng.choice((0, 0, 0, -1, 1)))
    _truncate(m, min(n, m.lay.size - 1), "at a field boundary")


def _truncate(m: Mutant, n: int, how: str) -> None:
    del m.buf[n:]
    m.notes.append(f"truncated to {n} of {m.lay.size} bytes {how}")


def mut_string_length(m: Mutant) -> None:
    """The u64 length of a key, a string value, a tensor name or one string of an array."""
    lay, rng = m.lay, m.rng
    choice = rng.randrange(4)
    if choice == 0:
        kv = rng.choice(lay.kvs)
        off, what = kv.key_len_off, f"length of key {kv.key!r}"
    elif choice == 1 and any(k.vtype == VT_STR for k in lay.kvs):
        kv = rng.choice([k for k in lay.kvs if k.vtype == VT_STR])
        off, what = kv.value_off, f"length of string value {kv.key!r}"
    elif choice == 2:
        t = rng.choice(lay.tensors)
        off, what = t.name_len_off, f"length of tensor name {t.name!r}"
    else:
        kv = rng.choice([k for k in lay.kvs if k.elem_offs])
        i = rng.randrange(len(kv.elem_offs))
        off, what = kv.elem_offs[i], f"length of {kv.key}[{i}]"
    _set_int(m, "<Q", off, what)


def mut_array_length(m: Mutant) -> None:
    kv = m.rng.choice([k for k in m.lay.kvs if k.arr_len_off is not None])
    _set_int(m, "<Q", kv.arr_len_off, f"array length of {kv.key!r}")


def mut_array_etype(m: Mutant) -> None:
    kv = m.rng.choice([k for k in m.lay.kvs if k.arr_len_off is not None])
    new = m.rng.choice(list(range(14)) + [0xFFFFFFFF, 100])
    m.notes.append(f"array element type of {kv.key!r}: {kv.etype} -> {new}")
    m.put("<I", kv.value_off, new)


def mut_value_type(m: Mutant) -> None:
    kv = _pick_kv(m, lambda k: True)
    same_size = {4: (VT_U32, VT_I32, VT_F32), 8: (VT_U64, VT_I64, VT_F64)}
    size = struct.calcsize(SCALAR_FMT[kv.vtype]) if kv.vtype in SCALAR_FMT else 0
    pool = same_size.get(size, ()) if m.rng.random() < 0.6 else tuple(range(14)) + (0xFFFFFFFF,)
    new = m.rng.choice([v for v in pool or range(14) if v != kv.vtype])
    m.notes.append(f"value type of {kv.key!r}: {kv.vtype} -> {new}")
    m.put("<I", kv.vtype_off, new)


def mut_metadata_int(m: Mutant) -> None:
    kv = _pick_kv(m, lambda k: k.vtype in INT_VTYPES)
    _set_int(m, SCALAR_FMT[kv.vtype], kv.value_off, f"{kv.key} ({_vt_name(kv.vtype)})")


def mut_metadata_float(m: Mutant) -> None:
    kv = _pick_kv(m, lambda k: k.vtype in FLOAT_VTYPES)
    if kv is None:
        return mut_metadata_int(m)
    fmt = SCALAR_FMT[kv.vtype]
    old = m.get(fmt, kv.value_off)
    new = m.rng.choice(FLOAT_EDGES + (-old, old * 1e10, old * 1e-10))
    m.put(fmt, kv.value_off, new)
    m.notes.append(f"{kv.key}: {old:g} -> {m.get(fmt, kv.value_off):g}")


def mut_metadata_bool(m: Mutant) -> None:
    kv = _pick_kv(m, lambda k: k.vtype == VT_BOOL)
    if kv is None:
        return mut_metadata_int(m)
    new = m.rng.choice((0, 1, 2, 0xFF))
    m.notes.append(f"{kv.key} (bool): {m.buf[kv.value_off]} -> {new}")
    m.buf[kv.value_off] = new


def mut_string_bytes(m: Mutant) -> None:
    """A bit flip inside a string: a key, a string value (architecture, tokenizer model) or one
    token or merge of the vocabulary."""
    rng = m.rng
    kv = rng.choice(m.lay.kvs)
    r = rng.random()
    if r < 0.3:
        n = m.seed_u64(kv.key_len_off)
        start, what = kv.key_len_off + 8, f"key {kv.key!r}"
    elif r < 0.6 and any(k.vtype == VT_STR for k in m.lay.kvs):
        kv = rng.choice([k for k in m.lay.kvs if k.vtype == VT_STR])
        n = m.seed_u64(kv.value_off)
        start, what = kv.value_off + 8, f"string value of {kv.key!r}"
    else:
        kv = rng.choice([k for k in m.lay.kvs if k.elem_offs])
        i = rng.randrange(len(kv.elem_offs))
        n = m.seed_u64(kv.elem_offs[i])
        start, what = kv.elem_offs[i] + 8, f"{kv.key}[{i}]"
    if n == 0:
        m.notes.append(f"{what}: empty, left as is")
        return
    _flip_bit(m, start, start + n, what)


def mut_numeric_array(m: Mutant) -> None:
    """Values inside a numeric array (token types): edge values, or all of them."""
    kv = m.rng.choice([k for k in m.lay.kvs if k.arr_len_off is not None and k.etype in SCALAR_FMT] or [None])
    if kv is None:
        return mut_metadata_int(m)
    fmt = SCALAR_FMT[kv.etype]
    size = struct.calcsize(fmt)
    base = kv.arr_len_off + 8
    if m.rng.random() < 0.3:
        v = edge_int(m, fmt, 1, U32_EDGES)
        for i in range(kv.arr_n):
            m.put(fmt, base + i * size, v)
        m.notes.append(f"every element of {kv.key!r} set to {v}")
        return
    i = m.rng.randrange(kv.arr_n)
    _set_int(m, fmt, base + i * size, f"{kv.key}[{i}]", U32_EDGES)


def mut_alignment(m: Mutant) -> None:
    """general.file_type has the length of general.alignment: rename it and give it a value."""
    kv = m.lay.kv("general.file_type") or m.lay.kv("general.alignment")
    if kv is None or len(kv.key) != len("general.alignment"):
        return mut_counts(m)
    m.buf[kv.key_len_off + 8:kv.key_len_off + 8 + len(kv.key)] = b"general.alignment"
    size = struct.calcsize(SCALAR_FMT.get(kv.vtype, "<I"))
    if kv.vtype in SCALAR_FMT and size == 4:
        new = m.rng.choice((0, 1, 2, 3, 8, 16, 31, 32, 64, 4096, 1 << 20, 1 << 31, 0xFFFFFFFF))
        if m.rng.random() < 0.2:
            vt = m.rng.choice((VT_I32, VT_F32))
            m.put("<I", kv.vtype_off, vt)
        m.put("<I", kv.value_off, new)
        m.notes.append(f"general.alignment added (in place of {kv.key}) = {new}")
    else:
        m.notes.append(f"general.alignment added (in place of {kv.key}), type {kv.vtype}")


def _pick_tensor(m: Mutant, experts_first: float = 0.3) -> TensorField:
    exps = [t for t in m.lay.tensors if "_exps" in t.name]
    if exps and m.rng.random() < experts_first:
        return m.rng.choice(exps)
    return m.rng.choice(m.lay.tensors)


def mut_tensor_ndims(m: Mutant) -> None:
    t = _pick_tensor(m)
    new = m.rng.choice((0, 1, 2, 3, 4, 5, 8, t.n_dims - 1, t.n_dims + 1, 0xFFFFFFFF, 0x80000000))
    new &= 0xFFFFFFFF
    m.put("<I", t.ndims_off, new)
    m.notes.append(f"tensor {t.name!r} n_dims: {t.n_dims} -> {new}")


def mut_tensor_ne(m: Mutant) -> None:
    t = _pick_tensor(m)
    if len(t.ne) >= 2 and m.rng.random() < 0.2:  # same element count, wrong shape
        a, b = m.rng.sample(range(len(t.ne)), 2)
        m.put("<q", t.ne_offs[a], t.ne[b])
        m.put("<q", t.ne_offs[b], t.ne[a])
        m.notes.append(f"tensor {t.name!r} ne[{a}] and ne[{b}] swapped: {t.ne}")
        return
    j = m.rng.randrange(len(t.ne))
    _set_int(m, "<q", t.ne_offs[j], f"tensor {t.name!r} ne[{j}] of {t.ne}", I64_EDGES)


def mut_tensor_type(m: Mutant) -> None:
    t = _pick_tensor(m)
    r = m.rng.random()
    if r < 0.5:  # another known type; the same block size passes the file checks
        same = [k for k, v in GGML_TYPES.items() if k != t.ggml_type and
                v[1:3] == GGML_TYPES.get(t.ggml_type, (None, -1, -1))[1:3]]
        new = m.rng.choice(same if same and m.rng.random() < 0.5 else list(GGML_TYPES))
    elif r < 0.8:
        new = m.rng.randrange(0, 42)
    else:
        new = m.rng.choice((0xFFFFFFFF, 0x80000000, 1000, m.rng.getrandbits(32)))
    m.put("<I", t.type_off, new)
    m.notes.append(f"tensor {t.name!r} type: {t.ggml_type} -> {new}")


def mut_tensor_offset(m: Mutant) -> None:
    t = _pick_tensor(m)
    lay, rng = m.lay, m.rng
    other = rng.choice(lay.tensors)
    data_len = lay.size - lay.data_offset
    new = rng.choice((0, other.rel_offset, t.rel_offset + lay.alignment, t.rel_offset - lay.alignment,
                      t.rel_offset + 1, data_len, data_len - lay.alignment, -(-data_len // 32) * 32,
                      (1 << 63) - 32, (1 << 64) - 32, (1 << 64) - 1, 1 << 62, rng.getrandbits(64)))
    new &= (1 << 64) - 1
    m.put("<Q", t.offset_off, new)
    m.notes.append(f"tensor {t.name!r} offset: {t.rel_offset} -> {new}")


def mut_tensor_name(m: Mutant) -> None:
    rng = m.rng
    t = _pick_tensor(m, experts_first=0.6)
    r = rng.random()
    same_len = [o for o in m.lay.tensors if o is not t and len(o.name) == len(t.name)]
    if r < 0.6 or not same_len:  # the 1-bit flip
        i, bit = rng.randrange(len(t.name)), rng.randrange(7)  # 7: stay ASCII (a bit 7 flip is meta_bitflip's)
        m.buf[t.name_off + i] ^= 1 << bit
        new = bytes(m.buf[t.name_off:t.name_off + len(t.name)]).decode("latin-1")
        m.notes.append(f"tensor name {t.name!r} -> {new!r} (bit {bit} of char {i})")
    elif r < 0.8:  # duplicate
        o = rng.choice(same_len)
        m.buf[t.name_off:t.name_off + len(t.name)] = o.name.encode()
        m.notes.append(f"tensor name {t.name!r} -> {o.name!r} (a duplicate)")
    else:  # swap
        o = rng.choice(same_len)
        m.buf[t.name_off:t.name_off + len(t.name)] = o.name.encode()
        m.buf[o.name_off:o.name_off + len(o.name)] = t.name.encode()
        m.notes.append(f"tensor names {t.name!r} and {o.name!r} swapped")


def mut_data_bytes(m: Mutant) -> None:
    lay, rng = m.lay, m.rng
    if lay.data_offset >= lay.size:
        return mut_meta_bitflip(m)
    k = rng.choice((1, 1, 2, 4, 16, 256))
    for _ in range(k):
        m.buf[rng.randrange(lay.data_offset, lay.size)] = rng.randrange(256)
    m.notes.append(f"{k} random byte(s) of the data section set to random values")


F16_SPECIAL = {"nan": 0x7E00, "inf": 0x7C00, "-inf": 0xFC00, "max": 0x7BFF}
F32_SPECIAL = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf, "max": 3.4e38}


def mut_data_nonfinite(m: Mutant) -> None:
    """NaN/inf/max into one value of a float tensor, or into the f16 scale of one block."""
    lay, rng = m.lay, m.rng
    cands = [t for t in lay.tensors if t.ggml_type in GGML_TYPES and lay.tensor_range(t)[1] > lay.tensor_range(t)[0]]
    t = rng.choice(cands)
    start, end = lay.tensor_range(t)
    name, blk_values, blk_bytes, scale_off = GGML_TYPES[t.ggml_type]
    special = rng.choice(tuple(F16_SPECIAL))
    n_blocks = (end - start) // blk_bytes
    b = rng.randrange(n_blocks) if rng.random() < 0.7 else 0
    pos = start + b * blk_bytes
    if name == "F32":
        m.put("<f", pos, F32_SPECIAL[special])
    elif name in ("F16",):
        m.put("<H", pos, F16_SPECIAL[special])
    elif name == "BF16":
        m.put("<H", pos, struct.unpack("<I", struct.pack("<f", F32_SPECIAL[special]))[0] >> 16)
    elif name == "MXFP4":
        m.buf[pos] = 0xFF  # the e8m0 exponent: NaN
        special = "nan (e8m0 0xFF)"
    else:
        m.put("<H", pos + scale_off, F16_SPECIAL[special])
    m.notes.append(f"tensor {t.name!r} ({name}) block {b}: {special} written")


# (name, weight, mutator)
MUTATORS: list[tuple[str, float, Callable[[Mutant], None]]] = [
    ("header_bitflip", 4, mut_header_bitflip),
    ("meta_bitflip", 8, mut_meta_bitflip),
    ("version", 1, mut_version),
    ("counts", 4, mut_counts),
    ("truncate_random", 5, mut_truncate_random),
    ("truncate_boundary", 6, mut_truncate_boundary),
    ("string_length", 6, mut_string_length),
    ("array_length", 3, mut_array_length),
    ("array_etype", 2, mut_array_etype),
    ("value_type", 4, mut_value_type),
    ("metadata_int", 10, mut_metadata_int),
    ("metadata_float", 8, mut_metadata_float),
    ("metadata_bool", 1, mut_metadata_bool),
    ("string_bytes", 5, mut_string_bytes),
    ("numeric_array", 3, mut_numeric_array),
    ("alignment", 3, mut_alignment),
    ("tensor_ndims", 3, mut_tensor_ndims),
    ("tensor_ne", 6, mut_tensor_ne),
    ("tensor_type", 5, mut_tensor_type),
    ("tensor_offset", 5, mut_tensor_offset),
    ("tensor_name", 6, mut_tensor_name),
    ("data_bytes", 5, mut_data_bytes),
    ("data_nonfinite", 6, mut_data_nonfinite),
]
_TRUNCATIONS = ("truncate_random", "truncate_boundary")


def _vt_name(vt: int) -> str:
    return {VT_U8: "u8", VT_I8: "i8", VT_U16: "u16", VT_I16: "i16", VT_U32: "u32", VT_I32: "i32",
            VT_F32: "f32", VT_BOOL: "bool", VT_STR: "str", VT_ARR: "arr", VT_U64: "u64", VT_I64: "i64",
            VT_F64: "f64"}.get(vt, str(vt))


@dataclass
class Seed:
    label: str  # arch:wtype or the file name
    path: Path
    data: bytes
    layout: Layout


@dataclass
class MutantSpec:
    index: int
    seed: Seed
    limit_mb: float
    ops: list[str]
    description: str
    data: bytes
    path_kind: str = "file"  # or one of PATH_KINDS: what the model path is instead of a file
    after_load: dict | None = None  # a change to the file between load and run (_live_change)
    selftest: str = ""  # tests of the fuzzer itself: the worker crashes, hangs or raises on purpose


# Changes made to the (unmutated) file after Engine.load and before the run: a loaded model's
# file is truncated, rewritten or replaced. The promise: a clear error or a correct run, never
# SIGBUS.
LIVE_SHARE = 0.04
PATH_SHARE = 0.01
PATH_KINDS = ("fifo", "directory", "devnull", "missing", "nul", "symlink_loop", "empty", "too_long")


def _live_change(rng: random.Random, seed: Seed) -> tuple[dict, str]:
    lay = seed.layout
    kind = rng.choice(("truncate", "truncate", "truncate", "overwrite", "replace", "append", "delete"))
    if kind == "truncate":
        size = rng.choice((lay.size - 2**20, lay.size - 4096, lay.size - 1, lay.data_offset, lay.header_end, 0,
                           rng.randrange(lay.data_offset, lay.size)))
        size = max(0, size)
        return {"action": kind, "size": size}, f"truncated to {size} of {lay.size} bytes while loaded"
    if kind == "overwrite":
        off = rng.randrange(lay.data_offset, lay.size - 64)
        data = bytes(rng.randrange(256) for _ in range(64)).hex()
        return {"action": kind, "offset": off, "data": data}, f"64 bytes at {off} overwritten in place while loaded"
    return {"action": kind}, {"replace": "replaced (renamed over) by a copy with one byte changed while loaded",
                              "append": "4 KiB appended while loaded",
                              "delete": "unlinked while loaded"}[kind]


def make_mutant(index: int, run_seed: int, seeds: list[Seed]) -> MutantSpec:
    """Mutant `index` of run `run_seed`: a pure function of both and the seed files."""
    rng = random.Random(f"{run_seed}:{index}")
    seed = rng.choice(seeds)
    limit = 0.0 if rng.random() < UNLIMITED_SHARE else SMALL_CACHE_MB
    head = f"{seed.label}, cache {'unlimited' if not limit else f'{limit:g} MB'}: "
    r = rng.random()
    if r < PATH_SHARE:
        kind = rng.choice(PATH_KINDS)
        return MutantSpec(index, seed, limit, [f"path_{kind}"], head + f"model path is {kind}", b"", path_kind=kind)
    if r < PATH_SHARE + LIVE_SHARE:
        change, what = _live_change(rng, seed)
        return MutantSpec(index, seed, limit, [f"live_{change['action']}"], head + what, seed.data, after_load=change)
    m = Mutant(bytearray(seed.data), seed.layout, rng, seed.data)
    n_ops = 1 if rng.random() < 0.8 else rng.choice((2, 3))
    names, weights = [n for n, _, _ in MUTATORS], [w for _, w, _ in MUTATORS]
    ops = rng.choices(names, weights, k=n_ops)
    ops.sort(key=lambda n: n in _TRUNCATIONS)  # truncate last: the others need the full layout
    ops = [op for i, op in enumerate(ops) if op not in _TRUNCATIONS or i == len(ops) - 1 or
           ops[i + 1] not in _TRUNCATIONS]
    table = {n: f for n, _, f in MUTATORS}
    for op in ops:
        table[op](m)
    return MutantSpec(index, seed, limit, ops, head + "; ".join(m.notes), bytes(m.buf))


def materialize(spec: MutantSpec, path: Path) -> str:
    """Put the mutant at (or near) `path`; the model path to load."""
    kind = spec.path_kind
    if kind == "file":
        path.write_bytes(spec.data)
    elif kind == "fifo":
        os.mkfifo(path)
    elif kind == "directory":
        path.mkdir()
    elif kind == "devnull":
        return os.devnull
    elif kind == "nul":
        path.write_bytes(spec.seed.data)
        return str(path) + "\0.gguf"
    elif kind == "symlink_loop":
        os.symlink(path.name, path)
    elif kind == "empty":
        path.write_bytes(b"")
    elif kind == "too_long":
        return str(path) + "x" * 5000
    return str(path)


def remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)
    Path(str(path) + ".new").unlink(missing_ok=True)


def change_file(path: str, change: dict) -> None:
    """Apply a LIVE change to a loaded model's file."""
    kind = change["action"]
    if kind == "truncate":
        os.truncate(path, change["size"])
    elif kind == "overwrite":
        with open(path, "r+b") as f:
            f.seek(change["offset"])
            f.write(bytes.fromhex(change["data"]))
    elif kind == "replace":
        data = bytearray(Path(path).read_bytes())
        data[len(data) // 2] ^= 0xFF
        Path(path + ".new").write_bytes(data)
        os.replace(path + ".new", path)
    elif kind == "append":
        with open(path, "ab") as f:
            f.write(bytes(4096))
    elif kind == "delete":
        os.unlink(path)


# ---------------------------------------------------------------------------------------- worker


def _moed_location(tb) -> tuple[str, str]:
    """(innermost frame in moed code, innermost frame overall) as 'path:line in func'."""
    frames = traceback.extract_tb(tb)
    def fmt(f):
        p = Path(f.filename)
        try:
            p = p.resolve().relative_to(ROOT)
        except ValueError:
            p = Path(*p.parts[-3:])
        return f"{p}:{f.lineno} in {f.name}"
    moed = [f for f in frames if Path(f.filename).resolve().is_relative_to(ROOT / "daemon") or
            Path(f.filename).resolve().is_relative_to(ROOT / "ipc")]
    return (fmt(moed[-1]) if moed else "?"), (fmt(frames[-1]) if frames else "?")


def run_model(path: str, limit_mb: float, after_load: dict | None = None) -> dict:
    """Load and run one model file (changed on disk after the load by `after_load`, if given);
    the outcome as a dict (kind ok/clean/other)."""
    import numpy as np

    from daemon.engine import Engine
    from daemon.errors import MoedError

    nonfinite = False
    try:
        eng = Engine.load(path, expert_cache_limit_mb=limit_mb, expert_pack=False)
        try:
            if after_load:
                change_file(path, after_load)
            ids = eng.tokenize(TEXT)
            logits = eng.forward(ids[:8])
            nonfinite = not bool(np.isfinite(logits).all())
            list(eng.generate(ids[:8], max_tokens=3, temperature=0))
            list(eng.generate(ids[:3], max_tokens=2, seed=0))  # the default sampler
        finally:
            eng.close()
    except MoedError as e:
        return {"kind": "clean", "type": type(e).__name__, "message": str(e)[:400]}
    except KeyboardInterrupt:
        raise
    except BaseException as e:  # noqa: BLE001 - the point is to catch what escapes the tree
        loc, inner = _moed_location(e.__traceback__)
        return {"kind": "other", "type": type(e).__name__, "message": str(e)[:400], "location": loc,
                "inner": inner}
    return {"kind": "ok", "nonfinite": nonfinite}


def _selftest(what: str) -> dict:
    """Misbehave on purpose, so that tests can see the parent classify it."""
    if what == "crash":
        os.kill(os.getpid(), signal.SIGSEGV)
    if what == "hang":
        time.sleep(3600)
    if what == "clean":  # (no daemon import: a slow import must not look like a hang)
        return {"kind": "clean", "type": "GGUFError", "message": "selftest"}
    if what == "other":
        try:
            {}["selftest"]
        except KeyError as e:
            loc, inner = _moed_location(e.__traceback__)
            return {"kind": "other", "type": "KeyError", "message": str(e), "location": loc, "inner": inner}
    return {"kind": "ok"}


def worker_main(mem_gb: float, warm: list[str]) -> None:
    """Answer one JSON line per request line ({"path", "limit_mb"}) on the original stdout."""
    cap = int(mem_gb * 2**30)
    resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
    faulthandler.enable(all_threads=True)  # a crash leaves its Python stack in the worker's log
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # and a hang, when the parent asks
    proto = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # prints from the code under test must not corrupt the protocol
    sys.path.insert(0, str(ROOT))
    warm_results = [run_model(p, lim) for p in warm for lim in (SMALL_CACHE_MB, 0.0)]
    proto.write(json.dumps({"ready": True, "warm": warm_results}) + "\n")
    proto.flush()
    for line in sys.stdin:
        job = json.loads(line)
        t0 = time.perf_counter()
        if job.get("selftest"):
            res = _selftest(job["selftest"])
        else:
            res = run_model(job["path"], job["limit_mb"], job.get("after_load"))
        res["secs"] = time.perf_counter() - t0
        proto.write(json.dumps(res) + "\n")
        proto.flush()


class Worker:
    """A worker process, and a line reader with a timeout on its answers."""

    def __init__(self, wid: int, mem_gb: float, threads: int, warm: list[str], log_dir: Path,
                 start_timeout: float):
        self.log_path = log_dir / f"worker{wid}.log"
        self.log = open(self.log_path, "ab")
        env = dict(os.environ, PYTHONPATH=str(ROOT), NUMBA_NUM_THREADS=str(threads))
        cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", "--mem-gb", str(mem_gb),
               *[a for p in warm for a in ("--warm", p)]]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log,
                                     env=env, cwd=ROOT)
        self.buf = b""
        hello = self.read(start_timeout)
        if not isinstance(hello, dict) or not hello.get("ready"):
            self.kill()
            raise RuntimeError(f"worker did not start ({hello}); see {self.log_path}:\n{self.log_tail()}")
        self.warm = hello["warm"]

    def ask(self, path: str, limit_mb: float, timeout: float, after_load: dict | None = None,
            selftest: str = ""):
        """The worker's answer, or "crash" / "hang"."""
        job = {"path": path, "limit_mb": limit_mb, "after_load": after_load, "selftest": selftest}
        try:
            self.proc.stdin.write((json.dumps(job) + "\n").encode())
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            return "crash"
        return self.read(timeout)

    def read(self, timeout: float):
        deadline = time.monotonic() + timeout
        fd = self.proc.stdout.fileno()
        while b"\n" not in self.buf:
            left = deadline - time.monotonic()
            if left <= 0:
                return "hang"
            ready, _, _ = select.select([fd], [], [], left)
            if not ready:
                continue
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                return "crash"
            self.buf += chunk
        line, self.buf = self.buf.split(b"\n", 1)
        return json.loads(line)

    def exit_status(self) -> str:
        rc = self.proc.wait(timeout=10)
        if rc < 0:
            try:
                return f"killed by {signal.Signals(-rc).name}"
            except ValueError:
                return f"killed by signal {-rc}"
        return f"exited with status {rc}"

    def log_size(self) -> int:
        return os.fstat(self.log.fileno()).st_size

    def log_tail(self, n: int = 1500, since: int = 0) -> str:
        try:
            data = self.log_path.read_bytes()[since:]
        except OSError:
            return ""
        return data[-n:].decode(errors="replace")

    def dump_stacks(self) -> None:
        """Ask a hung worker for its Python stacks (faulthandler, into its log)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGUSR1)
            time.sleep(1.0)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        self.log.close()


# ------------------------------------------------------------------------------------------ run


@dataclass
class Result:
    index: int
    seed: str
    ops: list[str]
    mutation: str
    kind: str
    type: str = ""
    message: str = ""
    location: str = ""
    inner: str = ""
    secs: float = 0.0
    nonfinite: bool = False
    slow: bool = False  # answered only on the retry with --slow-timeout
    kept: str = ""


@dataclass
class FuzzReport:
    results: list[Result]
    wall_s: float
    seeds: list[str]
    run_seed: int

    def counts(self) -> dict[str, int]:
        return {k: self.count(k) for k in KINDS}

    def count(self, kind: str) -> int:
        return sum(r.kind == kind for r in self.results)

    def failures(self) -> list[Result]:
        return [r for r in self.results if r.kind in FAILURE_KINDS]

    def groups(self) -> dict[tuple[str, str, str], list[Result]]:
        g: dict[tuple[str, str, str], list[Result]] = defaultdict(list)
        for r in self.failures():
            g[(r.kind, r.type, r.location)].append(r)
        return dict(sorted(g.items(), key=lambda kv: -len(kv[1])))

    def summary(self) -> str:
        n = len(self.results)
        lines = [f"{n} mutants of {len(self.seeds)} seeds (seed {self.run_seed}) in {self.wall_s:.1f} s "
                 f"({n / max(self.wall_s, 1e-9):.1f}/s)", ""]
        lines.append(f"{'mutator':<18}" + "".join(f"{k:>8}" for k in KINDS) + f"{'total':>8}")
        by_op: dict[str, Counter] = defaultdict(Counter)
        for r in self.results:
            by_op["+".join(r.ops) if len(r.ops) == 1 else "(stacked)"][r.kind] += 1
        for op in sorted(by_op):
            c = by_op[op]
            lines.append(f"{op:<18}" + "".join(f"{c[k]:>8}" for k in KINDS) + f"{sum(c.values()):>8}")
        total = Counter(r.kind for r in self.results)
        lines.append(f"{'TOTAL':<18}" + "".join(f"{total[k]:>8}" for k in KINDS) + f"{n:>8}")
        clean = Counter(r.type for r in self.results if r.kind == "clean")
        lines.append("")
        lines.append("clean errors: " + ", ".join(f"{t} {c}" for t, c in clean.most_common()) if clean
                     else "clean errors: none")
        nonfinite = sum(r.nonfinite for r in self.results if r.kind == "ok")
        lines.append(f"ran with non-finite logits and no error: {nonfinite}")
        slow = [r for r in self.results if r.slow and r.kind != "hang"]
        lines.append(f"answered only after the first timeout: {len(slow)}")
        for r in slow[:10]:
            lines.append(f"  mutant {r.index} ({r.secs:.0f} s, {r.kind} {r.type}): {r.mutation}")
        groups = self.groups()
        lines.append("")
        lines.append(f"non-clean failures: {len(self.failures())} in {len(groups)} group(s)")
        for (kind, typ, loc), rs in groups.items():
            ex = rs[0]
            lines.append(f"  [{len(rs)}x] {kind} {typ} at {loc}")
            if ex.message:
                lines.append(f"      message: {_headline(ex)}")
            if ex.inner and ex.inner != loc:
                lines.append(f"      raised in: {ex.inner}")
            lines.append(f"      e.g. mutant {ex.index}: {ex.mutation}")
            if ex.kept:
                lines.append(f"      kept: {ex.kept}")
        return "\n".join(lines)

    def to_json(self) -> dict:
        return {"run_seed": self.run_seed, "seeds": self.seeds, "wall_s": self.wall_s,
                "counts": dict(self.counts()),
                "groups": [{"kind": k, "type": t, "location": loc, "count": len(rs),
                            "example": dataclasses.asdict(rs[0])} for (k, t, loc), rs in self.groups().items()],
                "results": [dataclasses.asdict(r) for r in self.results]}


def load_seeds(specs: list[str], fixture_dir: Path) -> list[Seed]:
    """Seeds from `arch:wtype` fixture names (built on first use) or GGUF paths."""
    seeds = []
    for spec in specs:
        if os.path.exists(spec):
            path = Path(spec)
        else:
            arch, _, wtype = spec.partition(":")
            sys.path.insert(0, str(ROOT))
            from tests.fixtures.build import fixture_path

            path = fixture_path(arch, wtype, fixture_dir)
        data = path.read_bytes()
        seeds.append(Seed(spec if not os.path.exists(spec) else path.name, path, data, parse_layout(data)))
    return seeds


def _scratch_dir() -> Path:
    shm = Path("/dev/shm")
    base = shm if shm.is_dir() and os.access(shm, os.W_OK) and shutil.disk_usage(shm).free > 2**30 else None
    return Path(tempfile.mkdtemp(prefix="moed-fuzz-", dir=base))


@dataclass
class RunOptions:
    jobs: int = 2  # worker processes
    timeout: float = 30.0  # seconds per mutant before it is retried
    slow_timeout: float = 120.0  # seconds for the retry (a kernel compile); then it is a hang
    mem_gb: float = 4.0  # RLIMIT_AS of each worker
    threads: int = 1  # numba threads per worker
    start_timeout: float = 900.0  # a worker's start: a cold numba cache compiles for minutes
    keep: Path | None = None  # copy failing mutants here


class Runner:
    """Runs mutants on `jobs` worker threads, each driving one worker process (restarted after a
    crash or a hang). `warm`: model files each new worker runs first; they must run cleanly."""

    def __init__(self, opts: RunOptions, warm: list[str], run_seed: int = 0):
        self.opts, self.warm, self.run_seed = opts, warm, run_seed
        self.scratch = _scratch_dir()
        if opts.keep:
            Path(opts.keep).mkdir(parents=True, exist_ok=True)

    def start_worker(self, wid: int) -> Worker:
        o = self.opts
        w = Worker(wid, o.mem_gb, o.threads, self.warm, self.scratch, o.start_timeout)
        runs = [(p, lim) for p in self.warm for lim in (SMALL_CACHE_MB, 0.0)]
        bad = [(p, lim, r) for (p, lim), r in zip(runs, w.warm) if r["kind"] != "ok"]
        if bad:
            w.kill()
            raise RuntimeError(f"a seed does not run unmutated: {bad}")
        return w

    def run_one(self, w: Worker, spec: MutantSpec, wid: int) -> tuple[Worker, Result]:
        """Run one mutant; the worker to use next (a new one after a crash or hang) and the result."""
        path = self.scratch / f"w{wid}-{spec.index}.gguf"
        model_path = materialize(spec, path)
        res = Result(spec.index, spec.seed.label, spec.ops, spec.description, "hang")
        mark = w.log_size()
        answer = w.ask(model_path, spec.limit_mb, self.opts.timeout, spec.after_load, spec.selftest)
        if answer == "hang" and spec.path_kind == "file" and not spec.after_load:
            # maybe a kernel compiled on first use (a mutated type): once more, with time
            res.slow = True
            w.kill()
            w = self.start_worker(wid)
            mark = w.log_size()
            answer = w.ask(model_path, spec.limit_mb, self.opts.slow_timeout, None, spec.selftest)
        self._classify(w, answer, mark, res)
        if res.kind in ("hang", "crash"):
            w.kill()
            w = self.start_worker(wid)
        if res.kind in FAILURE_KINDS and self.opts.keep:
            self._keep(spec, res)
        remove(path)
        return w, res

    @staticmethod
    def _classify(w: Worker, answer, log_mark: int, res: Result) -> None:
        if isinstance(answer, dict):
            res.kind = answer["kind"]
            for k in ("type", "message", "location", "inner", "secs", "nonfinite"):
                if k in answer:
                    setattr(res, k, answer[k])
            return
        if answer == "hang":
            w.dump_stacks()
        else:
            res.kind, res.type = "crash", w.exit_status()
        res.message = w.log_tail(3000, since=log_mark)
        res.location = _dump_location(res.message)

    def _keep(self, spec: MutantSpec, res: Result) -> None:
        dest = Path(self.opts.keep) / f"mutant-{self.run_seed}-{spec.index}-{res.kind}.gguf"
        if spec.path_kind == "file":
            dest.write_bytes(spec.data)
        dest.with_suffix(".txt").write_text(spec.description + "\n")
        res.kept = str(dest)

    def run(self, make_spec: Callable[[int], MutantSpec], n: int,
            progress: Callable[[str], None] | None = print, progress_every: float = 10.0) -> list[Result]:
        """Results of specs make_spec(0..n-1), in index order."""
        next_index = iter(range(n))
        lock = threading.Lock()
        results: list[Result] = []
        errors: list[BaseException] = []

        def loop(wid: int) -> None:
            w = None
            try:
                w = self.start_worker(wid)
                while True:
                    with lock:
                        i = next(next_index, None)
                    if i is None:
                        return
                    w, res = self.run_one(w, make_spec(i), wid)
                    with lock:
                        results.append(res)
            except BaseException as e:  # noqa: BLE001 - re-raised by the caller
                errors.append(e)
            finally:
                if w is not None:
                    w.kill()

        t0 = last = time.perf_counter()
        threads = [threading.Thread(target=loop, args=(wid,), daemon=True) for wid in range(self.opts.jobs)]
        for t in threads:
            t.start()
        try:
            while any(t.is_alive() for t in threads):
                for t in threads:
                    t.join(timeout=0.5)
                if progress and time.perf_counter() - last >= progress_every:
                    last = time.perf_counter()
                    progress(_progress_line(results, n, last - t0))
        finally:
            shutil.rmtree(self.scratch, ignore_errors=True)
        if errors:
            raise errors[0]
        return sorted(results, key=lambda r: r.index)


def run_fuzz(n_mutants: int = 10000, run_seed: int = 0, opts: RunOptions | None = None,
             seed_specs: list[str] | None = None, fixture_dir: str | os.PathLike | None = None,
             progress: Callable[[str], None] | None = print, progress_every: float = 10.0) -> FuzzReport:
    """Make and run n_mutants mutants of the seeds; the report."""
    fixture_dir = Path(fixture_dir or Path(tempfile.gettempdir()) / "moed-fuzz-fixtures")
    seeds = load_seeds(list(seed_specs or DEFAULT_SEEDS), fixture_dir)
    t0 = time.perf_counter()
    runner = Runner(opts or RunOptions(), [str(s.path) for s in seeds], run_seed)
    results = runner.run(lambda i: make_mutant(i, run_seed, seeds), n_mutants, progress, progress_every)
    return FuzzReport(results, time.perf_counter() - t0, [s.label for s in seeds], run_seed)


def _headline(r: Result) -> str:
    """The message of an exception; for a crash or hang, the fatal-error line of the worker's log."""
    if r.kind in ("crash", "hang"):
        fatal = [ln for ln in r.message.splitlines() if ln.startswith("Fatal Python error")]
        return fatal[-1] if fatal else "(no fatal-error line in the worker's log)"
    return r.message[:300]


def _dump_location(log: str) -> str:
    """The innermost moed frame of the current thread in a faulthandler dump (most recent call
    first), as 'daemon/x.py:LINE in func'; '?' if there is none."""
    blocks = re.split(r"\n(?=(?:Current thread|Thread) 0x)", log)
    current = [b for b in blocks if b.lstrip().startswith("Current thread")]
    for block in current or blocks:
        for m in re.finditer(r'File "([^"]+)", line (\d+) in (\S+)', block):
            path = Path(m.group(1))
            if path.is_relative_to(ROOT / "daemon") or path.is_relative_to(ROOT / "ipc"):
                return f"{path.relative_to(ROOT)}:{m.group(2)} in {m.group(3)}"
    return "?"


def _progress_line(results: list[Result], total: int, elapsed: float) -> str:
    c = Counter(r.kind for r in list(results))
    done = sum(c.values())
    return (f"[{done:>6}/{total}] {done / max(elapsed, 1e-9):6.1f}/s  " +
            "  ".join(f"{k}={c[k]}" for k in KINDS))


def replay(index: int, run_seed: int, seed_specs: list[str], fixture_dir: Path, out_dir: Path) -> Path:
    seeds = load_seeds(seed_specs, fixture_dir)
    spec = make_mutant(index, run_seed, seeds)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"mutant-{run_seed}-{index}.gguf"
    path.write_bytes(spec.data)
    print(f"{path}\n{spec.description}\ncache limit: {spec.limit_mb:g} MB (0 = unlimited)")
    if spec.after_load or spec.path_kind != "file":
        print(f"not a file mutation: path {spec.path_kind}, change after load {spec.after_load}")
    return path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mutants", type=int, default=10000)
    ap.add_argument("--seed", type=int, default=0, help="run seed: mutant I depends only on it, I and the seeds")
    ap.add_argument("--jobs", type=int, default=2, help="worker processes")
    ap.add_argument("--timeout", type=float, default=30.0, help="seconds per mutant before it is retried")
    ap.add_argument("--slow-timeout", type=float, default=120.0, help="seconds for the retry; then a hang")
    ap.add_argument("--mem-gb", type=float, default=4.0,
                    help="address-space cap of each worker (RLIMIT_AS); one maps under 1 GiB")
    ap.add_argument("--threads", type=int, default=1, help="numba threads per worker")
    ap.add_argument("--keep", help="copy failing mutants (and their descriptions) here")
    ap.add_argument("--json", help="write every result here")
    ap.add_argument("--seeds", nargs="+", default=list(DEFAULT_SEEDS), help="arch:wtype fixtures or GGUF paths")
    ap.add_argument("--fixture-dir", default=str(Path(tempfile.gettempdir()) / "moed-fuzz-fixtures"))
    ap.add_argument("--replay", type=int, metavar="I", help="only write mutant I (to --keep, default .)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--warm", action="append", default=[], help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.worker:
        worker_main(a.mem_gb, a.warm)
        return 0
    if a.replay is not None:
        replay(a.replay, a.seed, a.seeds, Path(a.fixture_dir), Path(a.keep or "."))
        return 0
    opts = RunOptions(a.jobs, a.timeout, a.slow_timeout, a.mem_gb, a.threads,
                      keep=Path(a.keep) if a.keep else None)
    report = run_fuzz(a.mutants, a.seed, opts, a.seeds, a.fixture_dir)
    print(report.summary())
    if a.json:
        Path(a.json).write_text(json.dumps(report.to_json(), indent=1))
    return 1 if report.failures() else 0


if __name__ == "__main__":
    sys.exit(main())
