"""Record token-ordered routing sequences from a running model.

`RoutingRecorder` hooks `Transformer.trace` (the MoE block calls it with the exact routing of each
MoE layer: `(layer, ids [T, A])`) and regroups what it sees per token. A step (one `forward`) of T
tokens yields T records; record t holds row t of every MoE layer's ids.

The file format is the one of the real traces in ../shared/traces: one JSON object per line,

    {"tok": n, "layers": [[ids of MoE layer 0], [ids of MoE layer 1], ...]}

with `tok` counting from 1 and one list per MoE layer (in layer order, dense layers skipped). Unlike
the real traces, whose ids are sorted, moed keeps the router's top-k order (highest weight first), so
the rank is not lost; readers that want sets just ignore the order. A path ending in `.zst` is
compressed with zstandard.

Rows not computed for a layer are recorded as an empty list: without `all_logits`, the last layer
runs its FFN on the output row only, so for a prefill of T tokens the earlier T-1 tokens have `[]`
for that layer (only when the last layer is an MoE layer). Replay treats `[]` as "nothing requested".
"""

from __future__ import annotations

import io
import json
import os
from typing import Callable

import numpy as np


def _open_write(path: str | os.PathLike):
    path = os.fspath(path)
    if path.endswith(".zst"):
        import zstandard

        raw = open(path, "wb")
        return io.TextIOWrapper(zstandard.ZstdCompressor(level=10).stream_writer(raw, closefd=True),
                                encoding="utf-8")
    return open(path, "w", encoding="utf-8")


class RoutingRecorder:
    """Collects, per token, the expert ids chosen by every MoE layer.

    recorder = RoutingRecorder(); recorder.attach(model); ...generate...; recorder.write(path)
    """

    def __init__(self, moe_layers: list[int] | None = None) -> None:
        self.moe_layers = list(moe_layers) if moe_layers is not None else None
        self.records: list[list[list[int]]] = []  # [token][moe layer] -> ids in top-k order
        self._step: dict[int, np.ndarray] = {}
        self._last_layer = -1
        self._seen: set[int] = set()  # MoE layers seen so far (when not attached to a model)
        self._prev: Callable | None = None
        self._model = None

    # -- hooking -------------------------------------------------------------------------------

    def attach(self, model) -> "RoutingRecorder":
        """Set `model.trace` to this recorder, chaining any hook already there."""
        if self.moe_layers is None:
            from ..model.transformer import MoE

            self.moe_layers = [il for il, layer in enumerate(model.layers) if isinstance(layer.ffn, MoE)]
        self._prev = model.trace
        self._model = model
        model.trace = self
        return self

    def detach(self) -> None:
        """Finish the current step and restore the previous hook."""
        self.flush()
        if self._model is not None:
            self._model.trace = self._prev
            self._model = None

    def __call__(self, layer: int, ids: np.ndarray) -> None:
        if layer <= self._last_layer:  # a new forward pass began
            self.flush()
        self._step[layer] = np.array(ids, dtype=np.int64, copy=True).reshape(len(ids), -1)
        self._last_layer = layer
        self._seen.add(layer)
        if self._prev is not None:
            self._prev(layer, ids)

    def flush(self) -> None:
        """Turn the step seen so far into per-token records."""
        if not self._step:
            return
        layers = self.moe_layers if self.moe_layers is not None else sorted(self._seen)
        T = max(a.shape[0] for a in self._step.values())
        for t in range(T):
            rec = []
            for il in layers:
                a = self._step.get(il)
                # a layer that computed fewer rows ran on the last rows only (output rows)
                r = t - (T - a.shape[0]) if a is not None else -1
                rec.append([int(v) for v in a[r]] if r >= 0 else [])
            self.records.append(rec)
        self._step = {}
        self._last_layer = -1

    # -- output --------------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self.records) + (max((a.shape[0] for a in self._step.values()), default=0))

    def lines(self):
        self.flush()
        for n, rec in enumerate(self.records, 1):
            yield json.dumps({"tok": n, "layers": rec}, separators=(", ", ": "))

    def write(self, path: str | os.PathLike) -> int:
        """Write the records as jsonl (`.zst`: zstd-compressed); returns the number of tokens."""
        n = 0
        with _open_write(path) as f:
            for line in self.lines():
                f.write(line + "\n")
                n += 1
        return n
