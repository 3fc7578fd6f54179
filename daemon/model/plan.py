"""The layer plan: a step as a list of stages, built once per model and run by both the per-op walk
(Transformer._layers, the readable reference and the GPU's eager path) and the CPU's compiled step
(kernels/decode_step.py, which reads the same list as an int array). Each stage ends in a fusion
group, and an FFN's group crosses into the next layer:

  MIXER il  the layer's mixer (attention, or a recurrent layer in the hybrids), then the residual
            add and the layer's FFN norm. Where the stage may trim (the last layer, unless the
            family keeps every row), a step that wants only each sequence's last row keeps those
            rows from here on, as llama.cpp does.
  FFN il    the routed experts (or the dense FFN), then the mix, the residual add and the next
            stage's input norm: the next layer's attention norm, or the output norm before HEAD.
  HEAD      the output projection over the rows kept.

The first stage's input is the embedded rows, normed by its layer's attention norm.

Legend: L = layers, G = stages (2L + 1).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np

MIXER, FFN, HEAD = 0, 1, 2  # stage kinds
COL_KIND, COL_LAYER, COL_TRIM = 0, 1, 2  # columns of LayerPlan.stages


@dataclass(frozen=True)
class LayerPlan:
    stages: np.ndarray  # int64 [G, 3]: kind, layer (-1 for HEAD), may trim (MIXER stages)

    @classmethod
    def of(cls, n_layer: int, last_layer_all_rows: bool = False) -> LayerPlan:
        rows = []
        for il in range(n_layer):
            rows.append((MIXER, il, int(il == n_layer - 1 and not last_layer_all_rows)))
            rows.append((FFN, il, 0))
        rows.append((HEAD, -1, 0))
        return cls(np.array(rows, np.int64).reshape(-1, 3))

    @cached_property
    def _rows(self) -> tuple[tuple[int, int, int], ...]:
        return tuple(map(tuple, self.stages.tolist()))

    def __iter__(self):
        """(kind, layer, may trim) of each stage, as Python ints."""
        return iter(self._rows)

    def ffn_stage(self, layer: int) -> int:
        """The index of the layer's FFN stage (where a compiled step resumes after reading experts)."""
        return int(np.flatnonzero((self.stages[:, COL_KIND] == FFN) & (self.stages[:, COL_LAYER] == layer))[0])

    def next_layer(self, stage: int) -> int:
        """The layer whose input the stage's fusion group norms: the next stage's layer (-1: HEAD's
        output norm)."""
        return int(self.stages[stage + 1, COL_LAYER])
