"""Copy a GGUF file with changes (metadata values, tensor names, tensor order), through
gguf.GGUFWriter, to make the malformed or unusual models the loader tests need."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import gguf
import numpy as np

from daemon.storage.gguf import GGUFFile


def rewrite_gguf(src: str | Path, dst: str | Path, *, set_keys: Mapping[str, tuple[Any, Any]] = (),
                 rename: Mapping[str, str] = (), last: Sequence[str] = (), drop: Sequence[str] = ()) -> Path:
    """Write `src` to `dst` with set_keys {key: (GGUFValueType, value)} added or replaced, the keys
    in `drop` left out, tensors renamed ({old: new}), and the tensors named in `last` moved to the
    end of the data section."""
    set_keys, rename = dict(set_keys), dict(rename)
    with GGUFFile(src) as g:
        w = gguf.GGUFWriter(str(dst), g.architecture)
        for key, value in g.metadata.items():
            if key == "general.architecture" or key.startswith("GGUF.") or key in set_keys or key in drop:
                continue
            vtype, sub = g.value_type(key)
            if vtype == gguf.GGUFValueType.ARRAY:
                w.add_key_value(key, value.tolist() if isinstance(value, np.ndarray) else list(value), vtype,
                                sub_type=sub)
            else:
                w.add_key_value(key, value, vtype)
        for key, (vtype, value) in set_keys.items():
            w.add_key_value(key, value, vtype)
        names = [n for n in g.tensors if n not in last] + [n for n in last if n in g.tensors]
        for name in names:
            info = g.tensors[name]
            data = np.asarray(g.tensor_data(name)).reshape(*info.shape[:-1], -1)  # byte shape
            w.add_tensor(rename.get(name, name), data, raw_dtype=info.ggml_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return Path(dst)
