"""Expert providers: (layer, expert ids) -> the weights of those experts, as stacks kernels index.

Model code never holds expert arrays; it asks a provider. `ResidentExperts` serves the stacked
tensors of the GGUF file, read whole into memory at load; `ExpertCache` (cache.py) streams experts
from disk into a bounded per-layer cache and serves its slots. Both hand out an `ExpertBatch`.

Legend: E = experts, S = slots of a stack, D = hidden size, F = expert FFN size,
rb(t, K) = bytes of one row of K values in ggml type t.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from typing import ContextManager, Protocol

import numpy as np

from ..errors import GGUFError
from ..kernels.quants import row_bytes

PROJECTIONS = ("gate", "up", "down")


@dataclass(frozen=True)
class ExpertLayout:
    """Shape and encoding of one MoE layer's experts."""
    n_expert: int  # E
    n_embd: int  # D
    n_ff: int  # F
    gate_type: int
    up_type: int
    down_type: int

    def shape(self, projection: str) -> tuple[int, int]:
        """(rows, bytes per row) of one expert's slice of a projection."""
        if projection == "down":
            return self.n_embd, row_bytes(self.down_type, self.n_ff)
        t = self.gate_type if projection == "gate" else self.up_type
        return self.n_ff, row_bytes(t, self.n_embd)

    def nbytes(self, projection: str) -> int:
        rows, rb = self.shape(projection)
        return rows * rb

    @property
    def expert_nbytes(self) -> int:
        """Bytes of one expert's three slices."""
        return sum(self.nbytes(p) for p in PROJECTIONS)


@dataclass(frozen=True)
class ExpertBatch:
    """The experts one layer needs for one step. `rows[e]` indexes expert e in the stacks.

    gate/up: uint8 [S, F, rb(type, D)]; down: uint8 [S, D, rb(type, F)].
    Biases are indexed by expert id: [E, F] / [E, D] f32, or None."""
    gate: np.ndarray
    up: np.ndarray
    down: np.ndarray
    rows: dict[int, int]
    gate_bias: np.ndarray | None = None
    up_bias: np.ndarray | None = None
    down_bias: np.ndarray | None = None


class ExpertProvider(Protocol):
    def layout(self, layer: int) -> ExpertLayout: ...

    def fetch(self, layer: int, ids: Sequence[int], routed: np.ndarray | None = None) -> ContextManager[ExpertBatch]:
        """The experts `ids` of `layer`, held (never evicted or overwritten) until the block exits.
        routed: the step's expert ids [T, A] (how many tokens each expert serves), when known.
        A provider that is `routing_free` (it serves every expert, wherever the kernels read it)
        is asked with ids None: the routing never reached the host."""
        ...

    def waves(self, layer: int, ids: Sequence[int]) -> list[list[int]]:
        """The fetches a step needing experts `ids` of `layer` makes, in order: [ids] when they fit
        at once, else waves that each fit, none evicting an expert a later wave needs."""
        ...


class ResidentExperts:
    """Serves the stacked tensors, copied into memory at load: every expert is always 'loaded'.
    (Tests and tools use it; the engine streams experts through an ExpertCache.)"""

    def __init__(self, source, moe_layers: Sequence[int], n_embd: int, n_ff: int, n_expert: int):
        self._batches: dict[int, ExpertBatch] = {}
        self._layouts: dict[int, ExpertLayout] = {}
        for il in moe_layers:
            p = f"blk.{il}."
            gate, gt = source.stacked(p + "ffn_gate_exps.weight", n_embd, n_ff, n_expert)
            up, ut = source.stacked(p + "ffn_up_exps.weight", n_embd, n_ff, n_expert)
            down, dt = source.stacked(p + "ffn_down_exps.weight", n_ff, n_embd, n_expert)
            self._batches[il] = ExpertBatch(gate, up, down, {e: e for e in range(n_expert)},
                                            *expert_biases(source, il, n_embd, n_ff, n_expert))
            self._layouts[il] = ExpertLayout(n_expert, n_embd, n_ff, gt, ut, dt)

    def layout(self, layer: int) -> ExpertLayout:
        if layer not in self._layouts:
            raise GGUFError(f"layer {layer} has no expert tensors")
        return self._layouts[layer]

    def fetch(self, layer: int, ids: Sequence[int] | None, routed=None) -> ContextManager[ExpertBatch]:
        if ids is not None:
            check_ids(layer, ids, self.layout(layer).n_expert)
        return nullcontext(self._batches[layer])

    def waves(self, layer: int, ids: Sequence[int]) -> list[list[int]]:
        return [list(ids)]

    def in_place(self, layer: int) -> ExpertBatch:
        """Every expert of the layer, where it stays (the CPU's compiled decode step reads them)."""
        return self._batches[layer]


def expert_biases(source, layer: int, n_embd: int, n_ff: int, n_expert: int) -> list[np.ndarray | None]:
    """Per-expert biases of a layer (gpt-oss), small enough to stay resident: gate, up, down.
    All three or none: GGUFError names a missing one."""
    names = [f"blk.{layer}.ffn_{w}_exps.bias" for w in PROJECTIONS]
    present = [source.has(n) for n in names]
    if any(present) and not all(present):
        missing = names[present.index(False)]
        raise GGUFError(f"no tensor named {missing!r} (layer {layer} has the other expert biases)")
    return [source.optional_vector(name, shape=(n_expert, n))
            for name, n in zip(names, (n_ff, n_ff, n_embd))]


def check_ids(layer: int, ids: Sequence[int], n_expert: int) -> None:
    for e in ids:
        if not 0 <= e < n_expert:
            raise GGUFError(f"layer {layer}: expert {e} out of range 0..{n_expert - 1}")
