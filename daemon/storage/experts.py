"""Expert providers: (layer, expert ids) -> the weight slices of those experts.

Model code never holds expert arrays; it asks a provider. MappedExperts serves views straight
from the memory-mapped GGUF file; the streaming cache (SSD -> host LRU) implements the same
interface. Legend: E = experts, D = hidden size, F = expert FFN size.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

import numpy as np

from ..errors import GGUFError


@dataclass(frozen=True)
class ExpertSlices:
    """One expert's weights. gate/up: uint8 [F, row_bytes(D)]; down: uint8 [D, row_bytes(F)]."""
    gate: np.ndarray
    up: np.ndarray
    down: np.ndarray
    gate_bias: np.ndarray | None = None  # [F] f32
    up_bias: np.ndarray | None = None  # [F] f32
    down_bias: np.ndarray | None = None  # [D] f32


@dataclass(frozen=True)
class ExpertLayout:
    """Shape and encoding of one MoE layer's experts (what a provider serves)."""
    n_expert: int
    n_embd: int  # D
    n_ff: int  # F
    gate_type: int
    up_type: int
    down_type: int


class ExpertProvider(Protocol):
    def layout(self, layer: int) -> ExpertLayout: ...

    def experts(self, layer: int, ids: Sequence[int]) -> dict[int, ExpertSlices]: ...


class MappedExperts:
    """Serves expert slices as zero-copy views of the stacked tensors in the mapped file."""

    def __init__(self, source, moe_layers: Sequence[int], n_embd: int, n_ff: int, n_expert: int):
        self._stacks: dict[int, tuple] = {}
        self._layouts: dict[int, ExpertLayout] = {}
        for il in moe_layers:
            p = f"blk.{il}."
            gate, gt = source.stacked(p + "ffn_gate_exps.weight", n_embd, n_ff, n_expert)
            up, ut = source.stacked(p + "ffn_up_exps.weight", n_embd, n_ff, n_expert)
            down, dt = source.stacked(p + "ffn_down_exps.weight", n_ff, n_embd, n_expert)
            biases = [source.optional_vector(p + f"ffn_{w}_exps.bias", shape=(n_expert, n))
                      for w, n in (("gate", n_ff), ("up", n_ff), ("down", n_embd))]
            self._stacks[il] = (gate, up, down, *biases)
            self._layouts[il] = ExpertLayout(n_expert, n_embd, n_ff, gt, ut, dt)

    def layout(self, layer: int) -> ExpertLayout:
        return self._layouts[layer]

    def stacks(self, layer: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The layer's stacked gate, up, down weights: uint8 [E, N, row_bytes] each."""
        return self._stacks[layer][:3]

    def experts(self, layer: int, ids: Sequence[int]) -> dict[int, ExpertSlices]:
        gate, up, down, gb, ub, db = self._stacks[layer]
        n = gate.shape[0]
        out = {}
        for e in ids:
            if not 0 <= e < n:
                raise GGUFError(f"layer {layer}: expert {e} out of range 0..{n - 1}")
            out[int(e)] = ExpertSlices(gate[e], up[e], down[e],
                                       None if gb is None else gb[e],
                                       None if ub is None else ub[e],
                                       None if db is None else db[e])
        return out
