"""The CPU backend's expert matmuls: which kernel computes each (row, expert) pair, as llama.cpp's
CPU MUL_MAT_ID does, so that results match it and each sequence's rows come out as they would
alone.

Two plans: one row (a one-token step) goes pair by pair through linear_selected; more rows are
grouped by expert (each expert's weights read once for all its rows) through linear_grouped.

Legend: T = rows, A = experts used per row, P = T*A pairs, J = groups of pairs, D = hidden size,
K = input length, N = output length.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..kernels import quants as Q
from ..kernels.matmul import Prepared, linear_grouped, linear_selected
from .step import Step


@dataclass(frozen=True, eq=False)
class PerTokenPlan:
    """Every pair in top-k order, each computed as a one-token expert call."""
    experts: np.ndarray  # [P] expert id of each pair
    slots: np.ndarray  # [P] its index in the stacks
    tokens: np.ndarray  # [P] its row of x
    slot_rows: np.ndarray  # [T, A] the pair (output row) of each (row, slot)
    pairs: np.ndarray | None = None  # a wave's part (plan(only=)): its rows in the whole plan's order


@dataclass(frozen=True, eq=False)
class GroupedPlan:
    """Pairs sorted by expert (and by sequence, where the kernel's path depends on row counts)."""
    experts: np.ndarray  # [P] expert id of each output row
    group_slots: np.ndarray  # [J] stack index of each group's expert
    offs: np.ndarray  # [J+1] each group's output rows
    tokens: np.ndarray  # [P] the row of x each output row reads
    slot_rows: np.ndarray  # [T, A] the output row of each (row, slot)
    solo: bool  # every row is its own one-token sequence
    pairs: np.ndarray | None = None  # a wave's part (plan(only=)): its rows in the whole plan's order


def plan(ids: np.ndarray, slots: dict[int, int], layout, step: Step | None,
         only: np.ndarray | None = None) -> PerTokenPlan | GroupedPlan:
    """ids [T, A] expert ids in top-k order; slots[e]: expert e's stack index. only: the pairs of
    these experts alone, each computed as in the whole plan (a wave of a step whose experts do
    not fit the cache at once); `pairs` says where its outputs go in the whole plan's."""
    (T, A) = ids.shape
    flat = ids.reshape(-1)  # [P] pairs (token, slot), token-major
    if only is not None:
        return _part(plan(ids, {int(e): 0 for e in np.unique(flat)}, layout, step), slots, only)
    if T == 1:
        pairs = np.arange(T * A, dtype=np.int64)
        return PerTokenPlan(flat, np.array([slots[int(e)] for e in flat], dtype=np.int64),
                            np.repeat(np.arange(T, dtype=np.int64), A), pairs.reshape(T, A))
    solo = step is not None and step.one_row_each and step.S > 1
    key = flat
    if step is not None and step.S > 1 and not solo and _path_depends_on_rows(layout):
        # a K-quant expert's path depends on how many of one sequence's rows it gets:
        # one group per (expert, sequence), as separate prefills would have
        seq = np.repeat(np.arange(step.S), np.diff(step.offsets) * A)  # [P]
        key = flat * step.S + seq
    order = np.argsort(key, kind="stable")  # [P] pairs grouped by expert (and sequence), rows ascending
    by_expert = flat[order]
    _, starts = np.unique(key[order], return_index=True)
    offs = np.append(starts, T * A)  # [J+1] each group's pairs
    group_slots = np.array([slots[int(e)] for e in by_expert[starts]], dtype=np.int64)  # [J]
    slot_rows = np.empty(T * A, dtype=np.int64)
    slot_rows[order] = np.arange(T * A)
    return GroupedPlan(by_expert, group_slots, offs, order // A, slot_rows.reshape(T, A), solo)


def _part(whole: PerTokenPlan | GroupedPlan, slots: dict[int, int], only: np.ndarray
          ) -> PerTokenPlan | GroupedPlan:
    """The pairs of `whole` whose expert is in `only`, with the wave's stack indices."""
    if isinstance(whole, PerTokenPlan):
        sel = np.flatnonzero(np.isin(whole.experts, only))  # [P_w]
        return PerTokenPlan(whole.experts[sel], np.array([slots[int(e)] for e in whole.experts[sel]], dtype=np.int64),
                            whole.tokens[sel], whole.slot_rows, sel)
    group_experts = whole.experts[whole.offs[:-1]]  # [J]
    groups = np.flatnonzero(np.isin(group_experts, only))  # [J_w] whole groups, in order
    sizes = whole.offs[groups + 1] - whole.offs[groups]
    sel = np.concatenate([np.arange(whole.offs[j], whole.offs[j + 1]) for j in groups])  # [P_w]
    return GroupedPlan(whole.experts[sel], np.array([slots[int(e)] for e in group_experts[groups]], dtype=np.int64),
                       np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64), whole.tokens[sel],
                       whole.slot_rows, whole.solo, sel)


def _path_depends_on_rows(layout) -> bool:
    """Whether an expert call's kernel path depends on its row count (K-quants: llama.cpp's tiled
    kernel from 8 rows); the other expert kernels compute each row alike."""
    return any(t in Q.KQUANT_TYPES for t in (layout.gate_type, layout.up_type, layout.down_type))


def expert_linear(xp: Prepared, stack: np.ndarray, ggml_type: int, k: int, p: PerTokenPlan | GroupedPlan,
                  per_token: bool) -> np.ndarray:
    """xp: prepared activations [T, K] (per_token) or [P, K] in p's pair order -> [P, N]."""
    if isinstance(p, PerTokenPlan):
        rows = p.tokens if per_token else np.arange(p.tokens.size, dtype=np.int64)
        return linear_selected(xp, stack, p.slots, rows, ggml_type, k)
    return linear_grouped(xp, stack, p.group_slots, p.offs, ggml_type, k, p.solo)
