"""Resident (non-expert) weights, copied out of the GGUF file at load.

They are copies, not views of a mapping: a mapped file that another process truncates kills the
process with SIGBUS on the next step, and these weights are resident anyway. A QWeight is a matrix
in its file encoding: raw uint8 rows of ggml blocks, never dequantized as a whole.
Legend: N = output rows, K = input length (ggml ne[0]), E = experts.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..errors import GGUFError
from ..kernels.quants import dequantize, row_bytes
from ..storage.gguf import GGUFFile


@dataclass(frozen=True)
class QWeight:
    raw: np.ndarray  # uint8 [N, row_bytes]
    ggml_type: int
    n_in: int  # K
    n_out: int  # N


class TensorSource:
    """Typed access to a GGUF file's tensors, checking each shape the model expects."""

    def __init__(self, gguf: GGUFFile):
        self.gguf = gguf

    def has(self, name: str) -> bool:
        return name in self.gguf.tensors

    def _check(self, name: str, expect: tuple[int | None, ...]):
        info = self.gguf.tensor_info(name)
        ne = tuple(info.ne) + (1,) * (len(expect) - len(info.ne))
        if len(ne) != len(expect) or any(e is not None and e != n for e, n in zip(expect, ne)):
            want = ", ".join("?" if e is None else str(e) for e in expect)
            raise GGUFError(f"tensor {name!r}: ne {list(info.ne)}, expected [{want}]")
        return info

    def matrix(self, name: str, n_in: int, n_out: int | None = None) -> QWeight:
        """A 2-D weight with ne = [n_in, n_out]."""
        info = self._check(name, (n_in, n_out))
        n_out = info.ne[1] if len(info.ne) > 1 else 1
        raw = self.gguf.tensor_data(name).reshape(n_out, row_bytes(info.ggml_type, n_in))
        return QWeight(raw, info.ggml_type, n_in, n_out)

    def stacked(self, name: str, n_in: int, n_out: int, n_expert: int) -> tuple[np.ndarray, int]:
        """A 3-D expert tensor with ne = [n_in, n_out, E] -> (uint8 [E, N, row_bytes], ggml type)."""
        info = self._check(name, (n_in, n_out, n_expert))
        raw = self.gguf.tensor_data(name).reshape(n_expert, n_out, row_bytes(info.ggml_type, n_in))
        return raw, info.ggml_type

    def stacked_info(self, name: str, n_in: int, n_out: int, n_expert: int):
        """stacked's checks without the read -> the tensor's TensorInfo (where its bytes lie)."""
        return self._check(name, (n_in, n_out, n_expert))

    def vector(self, name: str, n: int | None = None, *, shape: tuple[int, ...] | None = None) -> np.ndarray:
        """A small tensor (norm, bias, sinks) dequantized to float32; shape in numpy order."""
        info = self.gguf.tensor_info(name)
        expect = tuple(reversed(shape)) if shape else (n,)
        self._check(name, expect)
        k = info.ne[0]
        data = self.gguf.tensor_data(name).reshape(-1, row_bytes(info.ggml_type, k))
        out = dequantize(data, info.ggml_type, k)
        return np.ascontiguousarray(out.reshape(shape) if shape else out.reshape(-1))

    def optional_vector(self, name: str, n: int | None = None, **kw) -> np.ndarray | None:
        return self.vector(name, n, **kw) if self.has(name) else None
