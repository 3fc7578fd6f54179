"""The expert pack: a model's experts rewritten so that one read fetches one expert.

`moed pack MODEL` writes MODEL.moepack beside the model. Each (layer, expert)'s gate|up|down slices
are adjacent and start at a 4 KiB-aligned offset, stored raw or as one zstd frame when that saves
at least `min_saving` (10%) of the raw size. The engine uses the pack automatically when it is
present and valid (`open_pack`); a stale or corrupt pack is ignored with a warning, and the experts
are then read from the GGUF file as usual.

Layout (little-endian; the header is packed with `struct`, fixed-size so its length is known before
the experts are compressed):

    0    8s   magic b"MOEPACK\\0"
    8    u32  format version (1)
    12   u32  n entries
    16   u64  source: GGUF file size
    24   32s  source: blake2b-256 of the GGUF header region (bytes before the tensor data)
    56   32s  source: blake2b-256 of a sample of the data region (see `source_identity`)
    88   i32  zstd level used (informative)
    92   u32  reserved (0)
    96   n x entry, 40 bytes each, in (layer, expert) order:
             u32 layer | u32 expert | u64 offset | u64 stored bytes | u64 raw bytes |
             u8 codec (0 raw, 1 zstd) | 3x pad | u32 crc32 of the raw gate|up|down bytes
    ...  u32  crc32 of everything above (the header checksum)
    pad to 4096, then the expert blobs, each at a multiple of 4096

The source identity is the file size plus two hashes that cost a few hundred small reads, not a
reread of the model: the whole GGUF header (metadata and tensor table) and a sample of the data:
64 evenly spaced 4 KiB blocks plus the first and last 4 KiB of every expert tensor. mtime is not
part of it, so a copied model keeps its pack. A change elsewhere in the data goes unnoticed by the
identity; the per-expert crc32 only guards the pack's own bytes. Once a pack is in use, both it and
the model are checked at each read batch (inode, size, mtime, as recorded at load): a change to
either fails the read with ModelFileChanged (store.py).
"""

from __future__ import annotations

import hashlib
import logging
import os
import struct
import tempfile
import time
import zlib
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from ..errors import ConfigError, ModelError, StorageError
from .experts import PROJECTIONS, ExpertLayout
from .gguf import GGUFFile, ggml_type_name
from .identity import FileIdentity, open_regular
from .store import ExpertLocation, ExpertStore, expert_layouts

__all__ = ["PACK_SUFFIX", "PackError", "PackReport", "TypeStats", "open_pack", "out_path", "pack_path",
           "read_pack", "source_identity", "write_pack"]

log = logging.getLogger("moed.pack")

MAGIC = b"MOEPACK\0"
VERSION = 1
PACK_SUFFIX = ".moepack"
ALIGN = 4096
SAMPLE_BLOCK = 4096
SAMPLE_COUNT = 64

_PREFIX = struct.Struct("<8sIIQ32s32siI")  # 96 bytes
_ENTRY = struct.Struct("<IIQQQB3xI")  # 40 bytes
_CRC = struct.Struct("<I")
_CODECS = ("raw", "zstd")


class PackError(StorageError):
    """The pack cannot be used; the message says why."""


def pack_path(model_path) -> str:
    return os.fspath(model_path) + PACK_SUFFIX


def out_path(model_path, out=None) -> str:
    """Where a pack of model_path goes: `out`, or beside the model; never the model itself."""
    out = os.fspath(out) if out is not None else pack_path(model_path)
    if os.path.isdir(out):  # checked before the work: os.replace would fail only at the end
        example = os.path.join(out, os.path.basename(pack_path(model_path)))
        raise ConfigError(f"{out} is a directory; name the pack file (e.g. {example})")
    if os.path.abspath(out) == os.path.abspath(model_path) or (
            os.path.exists(out) and os.path.samefile(out, model_path)):
        raise ConfigError(f"{out}: the pack would overwrite the model")
    return out


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _header_size(n_entries: int) -> int:
    return _PREFIX.size + n_entries * _ENTRY.size + _CRC.size


# --- source identity -------------------------------------------------------------------------------

def source_identity(gguf: GGUFFile) -> tuple[int, bytes, bytes]:
    """(file size, blake2b of the header region, blake2b of a data sample) of the GGUF file.
    Raises OSError, or ModelFileChanged if the file is no longer the one `gguf` parsed."""
    fd, _ = open_regular(gguf.path)
    try:
        size = os.fstat(fd).st_size
        head_end = min(gguf.data_offset, size)
        head = hashlib.blake2b(digest_size=32)
        pos = 0
        while pos < head_end:  # chunked: a header with a big vocabulary runs to megabytes
            chunk = os.pread(fd, min(1 << 20, head_end - pos), pos)
            if not chunk:
                break
            head.update(chunk)
            pos += len(chunk)
        sample = hashlib.blake2b(digest_size=32)
        for off in _sample_offsets(gguf, head_end, size):
            sample.update(struct.pack("<Q", off))
            sample.update(os.pread(fd, SAMPLE_BLOCK, off))
        gguf.identity.check(fd, "while checking its expert pack")
        return size, head.digest(), sample.digest()
    finally:
        os.close(fd)


def _sample_offsets(gguf: GGUFFile, start: int, end: int) -> list[int]:
    offs = set()
    span = end - start
    if span > 0:
        offs.update(start + i * span // SAMPLE_COUNT for i in range(SAMPLE_COUNT))
    for ti in gguf.tensors.values():
        if "_exps." in ti.name and ti.nbytes:
            offs.add(ti.offset)
            offs.add(ti.offset + max(ti.nbytes - SAMPLE_BLOCK, 0))
    return sorted(o for o in offs if o < end)


# --- writing ---------------------------------------------------------------------------------------

@dataclass
class TypeStats:
    raw: int = 0  # bytes
    stored: int = 0
    compressed: int = 0  # experts stored as zstd
    experts: int = 0

    @property
    def saving(self) -> float:
        """Fraction of the raw size saved."""
        return 1 - self.stored / self.raw if self.raw else 0.0

    def add(self, raw: int, stored: int, compressed: bool) -> None:
        self.raw += raw
        self.stored += stored
        self.compressed += compressed
        self.experts += 1


@dataclass
class PackReport:
    path: str
    types: dict[str, TypeStats] = field(default_factory=dict)  # expert quant type(s) -> stats
    total: TypeStats = field(default_factory=TypeStats)
    elapsed: float = 0.0  # seconds
    file_size: int = 0  # bytes of the pack, with header and alignment padding

    @property
    def throughput(self) -> float:
        """Raw expert bytes packed per second."""
        return self.total.raw / self.elapsed if self.elapsed > 0 else 0.0

    def table(self) -> str:
        rows = [f"{'type':<16} {'experts':>8} {'raw MB':>10} {'stored MB':>10} {'zstd':>11} {'saving':>7}"]
        for name, s in [*sorted(self.types.items()), ("total", self.total)]:
            rows.append(f"{name:<16} {s.experts:>8} {s.raw / 1e6:>10.2f} {s.stored / 1e6:>10.2f} "
                        f"{f'{s.compressed}/{s.experts}':>11} {100 * s.saving:>6.1f}%")
        return "\n".join(rows)


def _type_key(lay: ExpertLayout) -> str:
    """The expert's quant type, or gate/up/down types joined when they differ."""
    names = [ggml_type_name(t) for t in (lay.gate_type, lay.up_type, lay.down_type)]
    return names[0] if len(set(names)) == 1 else "/".join(names)


def _encode(raw: bytes, level: int, min_saving: float) -> tuple[int, bytes]:
    """-> (codec, blob): zstd only when it saves at least min_saving of the raw size."""
    import zstandard

    z = zstandard.ZstdCompressor(level=level).compress(raw)
    if len(z) <= len(raw) * (1 - min_saving) and len(z) < len(raw):
        return 1, z
    return 0, raw


def write_pack(model_path, out=None, *, level: int = 3, min_saving: float = 0.10, progress=None,
               threads: int | None = None) -> PackReport:
    """Write the expert pack of `model_path` to `out` (default: beside the model), atomically.
    progress: None/False = silent, True = a bar on stderr, or a stream to draw it on."""
    if not 1 <= level <= 22:
        raise ConfigError(f"zstd level must be in 1..22, got {level}")
    if not 0.0 <= min_saving <= 1.0:
        raise ConfigError(f"min_saving must be in 0..1, got {min_saving}")
    out = out_path(model_path, out)
    t0 = time.monotonic()
    with GGUFFile(model_path) as gguf:
        layouts = expert_layouts(gguf)
        if not layouts:
            raise ModelError(f"{gguf.path}: no stacked expert tensors, nothing to pack")
        size, head_hash, sample_hash = source_identity(gguf)
        keys = [(il, e) for il in sorted(layouts) for e in range(layouts[il].n_expert)]
        report = PackReport(out)
        bar = None
        if progress:
            from ..progress import Progress
            bar = Progress("packing", sum(layouts[il].expert_nbytes for il, _ in keys),
                           stream=None if progress is True else progress)

        def encode(key):
            il, e = key
            lay = layouts[il]
            parts = []
            for p in PROJECTIONS:
                n = lay.nbytes(p)
                parts.append(gguf.read_range(f"blk.{il}.ffn_{p}_exps.weight", e * n, n))
            raw = b"".join(parts)
            return (*_encode(raw, level, min_saving), len(raw), zlib.crc32(raw))

        entries = []
        workers = threads or os.cpu_count() or 1
        tmp = None
        try:
            fd, tmp = tempfile.mkstemp(dir=os.path.dirname(os.path.abspath(out)),
                                       prefix=os.path.basename(out) + ".", suffix=".tmp")
            with os.fdopen(fd, "wb") as f, ThreadPoolExecutor(workers) as pool:
                os.fchmod(f.fileno(), 0o644)  # readable like the model beside it, not mkstemp's 0600
                offset = _align(_header_size(len(keys)))
                window = deque()  # zstd releases the GIL: compress ahead in the pool, write in order
                try:
                    for key in keys:
                        window.append((key, pool.submit(encode, key)))
                        if len(window) >= 2 * workers:
                            offset = _write_one(f, window.popleft(), offset, entries, layouts, report, bar)
                    while window:
                        offset = _write_one(f, window.popleft(), offset, entries, layouts, report, bar)
                except BaseException:  # an error, Ctrl-C or the CLI's SIGTERM: skip the queued work
                    pool.shutdown(cancel_futures=True)
                    raise
                f.seek(0)
                f.write(_header(size, head_hash, sample_hash, level, entries))
                f.flush()
                os.fsync(f.fileno())
                report.file_size = os.fstat(f.fileno()).st_size
            os.replace(tmp, out)
        except OSError as e:
            raise StorageError(f"cannot write {out}: {e.strerror or e}") from None
        finally:
            if tmp is not None and os.path.exists(tmp):
                os.unlink(tmp)
        if bar:
            bar.close()
    report.elapsed = time.monotonic() - t0
    return report


def _write_one(f, item, offset, entries, layouts, report, bar) -> int:
    (il, e), fut = item
    codec, blob, raw_n, crc = fut.result()
    f.seek(offset)
    f.write(blob)
    entries.append((il, e, offset, len(blob), raw_n, codec, crc))
    report.types.setdefault(_type_key(layouts[il]), TypeStats()).add(raw_n, len(blob), codec == 1)
    report.total.add(raw_n, len(blob), codec == 1)
    if bar:
        bar.advance(raw_n, note=f"layer {il}")
    return _align(offset + len(blob))


def _header(size, head_hash, sample_hash, level, entries) -> bytes:
    body = _PREFIX.pack(MAGIC, VERSION, len(entries), size, head_hash, sample_hash, level, 0)
    body += b"".join(_ENTRY.pack(*en) for en in entries)
    return body + _CRC.pack(zlib.crc32(body))


# --- reading ---------------------------------------------------------------------------------------

def read_pack(path, gguf: GGUFFile, layouts: dict[int, ExpertLayout]) -> ExpertStore:
    """The pack at `path` as an ExpertStore; raises PackError saying why it cannot be used."""
    path = os.fspath(path)
    try:
        fd, st = open_regular(path)  # a FIFO at the path must not block the load
        with open(fd, "rb") as f:
            identity = FileIdentity.of(path, st)
            file_size = st.st_size
            prefix = f.read(_PREFIX.size)
            if len(prefix) < _PREFIX.size:
                raise PackError("truncated header")
            magic, version, n, src_size, head_hash, sample_hash, _level, _ = _PREFIX.unpack(prefix)
            if magic != MAGIC:
                raise PackError("not an expert pack (bad magic)")
            if version != VERSION:
                raise PackError(f"format version {version}, this moed reads version {VERSION}")
            if _header_size(n) > file_size:
                raise PackError("truncated header")
            rest = f.read(_header_size(n) - _PREFIX.size)
    except OSError as e:
        raise PackError(f"cannot read it: {e.strerror or e}") from None
    if len(rest) != _header_size(n) - _PREFIX.size:
        raise PackError("truncated header")
    body, (crc,) = prefix + rest[:-_CRC.size], _CRC.unpack(rest[-_CRC.size:])
    if zlib.crc32(body) != crc:
        raise PackError("header checksum mismatch (corrupt header)")
    try:
        source = source_identity(gguf)
    except OSError as e:
        raise PackError(f"cannot read the model to check the pack against it: {e.strerror or e}") from None
    if src_size != source[0]:
        raise PackError(f"stale: made from a model of {src_size} bytes, this one has {source[0]}")
    if head_hash != source[1]:
        raise PackError("stale: the model's header (metadata or tensor table) differs")
    if sample_hash != source[2]:
        raise PackError("stale: the model's tensor data differs")

    want = [(il, e) for il in sorted(layouts) for e in range(layouts[il].n_expert)]
    if n != len(want):
        raise PackError(f"index holds {n} experts, the model has {len(want)}")
    locations: dict[int, list[ExpertLocation]] = {il: [] for il in layouts}
    end = _align(_header_size(n))
    for i, (il, e) in enumerate(want):
        layer, expert, off, stored, raw, codec, crc = _ENTRY.unpack_from(body, _PREFIX.size + i * _ENTRY.size)
        if (layer, expert) != (il, e) or raw != layouts[il].expert_nbytes:
            raise PackError(f"index entry {i} (layer {layer} expert {expert}, {raw} bytes) does not match "
                            f"the model (layer {il} expert {e}, {layouts[il].expert_nbytes} bytes)")
        if codec >= len(_CODECS) or stored <= 0 or (codec == 0 and stored != raw):
            raise PackError(f"index entry {i}: bad codec {codec} or size {stored}")
        if off % ALIGN or off < end:
            raise PackError(f"index entry {i}: offset {off} is misaligned or overlaps")
        if off + stored > file_size:
            raise PackError(f"truncated: layer {il} expert {e} ends at {off + stored}, "
                            f"the file has {file_size} bytes")
        end = off + stored
        locations[il].append(ExpertLocation(((off, stored),), _CODECS[codec], crc))
    return ExpertStore(path, layouts, locations, "pack", identity, gguf.identity)


def open_pack(model_path, gguf: GGUFFile, layouts: dict[int, ExpertLayout], *, path=None) -> ExpertStore | None:
    """The model's pack if there is one and it is valid; None if absent (silently) or unusable
    (with a warning on the "moed.pack" logger saying why)."""
    path = os.fspath(path) if path is not None else pack_path(model_path)
    if not os.path.exists(path):
        return None
    try:
        return read_pack(path, gguf, layouts)
    except PackError as e:
        log.warning("expert pack %s ignored, %s; reading experts from the GGUF file instead", path, e)
        return None
