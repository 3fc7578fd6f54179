"""Write a synthetic model: the GGUF header, then every tensor streamed in chunks to OUT.part,
renamed to OUT at the end. Memory stays at one chunk (CHUNK_BYTES), whatever the model's size.

    synth(out, like, type=None, seed=0, force=False, report=None, **overrides) -> Plan

Errors (SynthError, nothing left on disk): an unknown preset or option, OUT existing without
`force`, too little free space (checked first; the message says how much is needed), a path that
cannot be written, the disk filling up during the write. An interrupt also removes OUT.part.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import time
import zlib
from pathlib import Path
from typing import Any

import numpy as np

import gguf
from gguf import GGMLQuantizationType as QT

from ..errors import SynthError
from ..progress import Progress, Report
from .blocks import random_blocks
from .presets import BLOCK, FILE_TYPE, Plan, Tensor, metadata, plan
from .vocab import family_vocab

CHUNK_BYTES = 16 << 20
HEADER_ALLOWANCE = 32 << 20  # metadata (a 200k-token vocabulary is ~5 MB) and tensor table
REPORT_EVERY_S = 0.25
NORM_JITTER, BIAS_STD, SINK_MEAN, SINK_STD = 0.1, 0.2, 1.0, 1.0
# Gated DeltaNet: dt_bias ~ N(-2, 0.5) and A log-uniform in [0.5, 4] (ssm_a = -A, the file holds
# -exp(A_log)): per-token decay exp(-A * softplus(a + dt_bias)) mostly 0.5..0.95, as the test fixtures
DT_MEAN, DT_STD, A_MIN, A_MAX = -2.0, 0.5, 0.5, 4.0


def synth(out: str | os.PathLike, like: str, type: str | None = None, seed: int = 0, force: bool = False,
          report: Report | None = None, **overrides: Any) -> Plan:
    """Write a random-weight model shaped like preset `like` to `out`; return its Plan."""
    pl = plan(like, type, **overrides)
    out = Path(out)
    part = out.with_name(out.name + ".part")
    if out.is_dir():
        raise SynthError(f"{out} is a directory")
    if out.exists() and not force:
        raise SynthError(f"{out} exists; pass --force to overwrite it")
    try:
        _create(part)  # first: a read-only or missing directory says so, not "no space" (statvfs)
        _check_space(out.parent, pl.data_bytes + HEADER_ALLOWANCE)
        _write(part, pl, seed, report)
        os.replace(part, out)
    except OSError as e:
        raise SynthError(_os_message(e, out, pl)) from e
    finally:
        with contextlib.suppress(OSError):  # also when the path never existed (no directory)
            part.unlink(missing_ok=True)
    return pl


def _create(part: Path) -> None:
    """Create (or empty) OUT.part now, so the real errno of an unwritable place is reported."""
    os.close(os.open(part, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NONBLOCK | os.O_CLOEXEC, 0o644))


def _check_space(directory: Path, need: int) -> None:
    try:
        free = shutil.disk_usage(directory).free
    except OSError as e:
        raise SynthError(f"cannot write to {directory}: {e.strerror or e}") from e
    if free < need:
        raise SynthError(f"not enough disk space in {directory}: the model needs {_gb(need)}, "
                         f"{_gb(free)} is free")


def _os_message(e: OSError, out: Path, pl: Plan) -> str:
    if e.errno == errno.ENOSPC:
        return f"disk full while writing {out} (the model needs {_gb(pl.data_bytes)}); nothing was kept"
    return f"cannot write {out}: {e.strerror or e}"


def _gb(n: int) -> str:
    return f"{n / 1e9:.1f} GB" if n >= 1e8 else f"{n / 1e6:.1f} MB"


def _write(path: Path, pl: Plan, seed: int, report: Report | None) -> None:
    w = _header(path, pl, seed)
    try:
        f = w.fout[0]
        _pad(f, w.data_alignment)
        progress = Progress("writing", pl.data_bytes, report=report)
        t0 = shown = time.monotonic()
        done = 0
        for t in pl.tensors:
            for chunk in _tensor_chunks(t, seed):
                f.write(chunk)
                done += chunk.nbytes
                now = time.monotonic()
                if now - shown >= REPORT_EVERY_S:  # not per tensor: thousands are tiny
                    rate = done / (now - t0) / 1e6
                    progress.advance(done - progress.done, f"{_gb(done)} of {_gb(pl.data_bytes)}, {rate:.0f} MB/s")
                    shown = now
            _pad(f, w.data_alignment)
        f.flush()
        os.fsync(f.fileno())
        progress.close()
    finally:
        w.close()


def _pad(f, alignment: int) -> None:
    f.write(bytes(-f.tell() % alignment))


def _header(path: Path, pl: Plan, seed: int) -> gguf.GGUFWriter:
    p = pl.preset
    vocab = family_vocab(p.family, p.n_vocab)
    fam = vocab.family
    w = gguf.GGUFWriter(None, p.arch, use_temp_file=False)
    w.add_name(f"moed-synth-{pl.name}-{pl.type}")
    w.add_description(f"random weights shaped like {pl.name} ({pl.type}), seed {seed}: moed synth")
    w.add_file_type(FILE_TYPE[pl.type])
    for key, kind, value in metadata(pl):
        {"u32": w.add_uint32, "f32": w.add_float32, "str": w.add_string, "i32s": w.add_array}[kind](key, value)
    w.add_string("tokenizer.ggml.model", "gpt2")
    w.add_string("tokenizer.ggml.pre", fam.pre)
    w.add_array("tokenizer.ggml.tokens", vocab.tokens)
    w.add_array("tokenizer.ggml.token_type", vocab.types)
    w.add_array("tokenizer.ggml.merges", vocab.merges)
    w.add_uint32("tokenizer.ggml.bos_token_id", fam.bos)
    w.add_uint32("tokenizer.ggml.eos_token_id", fam.eos)
    w.add_uint32("tokenizer.ggml.padding_token_id", fam.pad)
    w.add_bool("tokenizer.ggml.add_bos_token", fam.add_bos)
    w.add_bool("tokenizer.ggml.add_eos_token", False)
    w.add_string("tokenizer.chat_template", fam.template)
    for t in pl.tensors:
        w.add_tensor_info(t.name, t.shape, np.dtype(np.float32), t.nbytes, raw_dtype=QT[t.type])
    w.write_header_to_file(path)
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    return w


def _tensor_chunks(t: Tensor, seed: int):
    """The data of tensor `t` as C-contiguous arrays of at most CHUNK_BYTES (F32: one array)."""
    key = [seed, zlib.crc32(t.name.encode())]
    if t.type == "F32":
        yield _floats(t, np.random.default_rng(key))
        return
    bitgen = np.random.PCG64DXSM(key)
    elems, size = BLOCK[t.type]
    n_blocks = t.n_elements // elems
    std = t.gain / np.sqrt(t.shape[-1])
    step = max(1, CHUNK_BYTES // size)
    for start in range(0, n_blocks, step):
        yield random_blocks(t.type, min(step, n_blocks - start), std, bitgen)


def _floats(t: Tensor, rng: np.random.Generator) -> np.ndarray:
    z = rng.standard_normal(t.shape, dtype=np.float32)
    if t.init == "norm":
        return 1.0 + NORM_JITTER * z
    if t.init == "bias":
        return BIAS_STD * z
    if t.init == "sink":
        return SINK_MEAN + SINK_STD * z
    if t.init == "dt":
        return DT_MEAN + DT_STD * z
    if t.init == "ssm_a":
        return -np.exp(rng.uniform(np.log(A_MIN), np.log(A_MAX), t.shape)).astype(np.float32)
    return z * np.float32(t.gain / np.sqrt(t.shape[-1]))
