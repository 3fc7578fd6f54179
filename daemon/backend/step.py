"""What one forward pass computes: rows of tokens, grouped by sequence.

A decode batch is S sequences of one row each; one sequence's prefill is S = 1; a batched prefill
is S sequences of several rows. Backends read the grouping to keep every sequence's result
independent of the others in the step (batch invariance).

Legend: T = rows (tokens) in the step, S = sequences.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from .cache import SequenceCache


@dataclass(eq=False)
class Step:
    """Rows offsets[s]..offsets[s+1]-1 belong to sequence s and are appended to caches[s] from its
    n_past on (positions[t] is row t's position). all_logits: logits of every row are wanted,
    else of each sequence's last row. memo: what a backend derives once per step (its RoPE
    table, its handles on the step's caches), private to the backend."""

    tokens: np.ndarray  # [T] int64
    positions: np.ndarray  # [T] int64
    offsets: np.ndarray  # [S+1] int64, rising strictly from 0 to T
    caches: Sequence[SequenceCache]  # [S]
    all_logits: bool = True
    memo: dict = field(default_factory=dict)
    # decode steps of the serving loop (a backend that samples on the device):
    samplers: np.ndarray | None = None  # [S] int32: each sequence's sampler slot; the step samples
    feed: tuple | None = None  # (src [S] int32, prev [S'] device int32): src[s] >= 0 takes sequence
    #                            s's input token from prev[src[s]] (the step before's sampled ids)
    variant: object = None  # what else its computation depends on (a graph is made per variant)
    hidden: bool = False  # the step returns the final normed hidden states [T, D], not logits (embeddings)
    deferred: bool = False  # with samplers: the layers now, the sampling when the caller asks (grammar masks)
    T: int = field(init=False)  # rows
    S: int = field(init=False)  # sequences
    one_row_each: bool = field(init=False)  # every sequence has exactly one row (a decode step)

    def __post_init__(self):  # plain attributes: read by every op of the step
        self.T = int(self.offsets[-1])
        self.S = len(self.offsets) - 1
        self.one_row_each = self.T == self.S

    @classmethod
    def append(cls, tokens: Sequence[np.ndarray], caches: Sequence[SequenceCache], all_logits: bool) -> Step:
        """tokens[s] ([T_s] int64, T_s >= 1) appended to caches[s] after its n_past positions."""
        S = len(tokens)
        if all(t.size == 1 for t in tokens):  # a decode batch: the hot path
            flat = np.concatenate(tokens) if S > 1 else tokens[0]
            positions = np.array([c.n_past for c in caches], dtype=np.int64)
            return cls(flat, positions, np.arange(S + 1, dtype=np.int64), caches, all_logits)
        counts = [t.size for t in tokens]
        offsets = np.zeros(S + 1, np.int64)
        np.cumsum(counts, out=offsets[1:])
        positions = np.concatenate([np.arange(c.n_past, c.n_past + n, dtype=np.int64) for c, n in zip(caches, counts)])
        return cls(np.concatenate(tokens), positions, offsets, caches, all_logits)

    @classmethod
    def rows(cls, T: int) -> Step:
        """T rows of one sequence, with no cache (for ops that only need the grouping)."""
        return cls(np.zeros(T, np.int64), np.arange(T, dtype=np.int64), np.array([0, T], np.int64), ())

    def padded(self, n: int) -> Step:
        """This decode step with rows S..n-1 added as copies of row 0 (its token, position and
        cache): a captured graph of n rows serves it. A copy computes row 0's values bit for bit
        (every kernel computes a row alone) and writes them where row 0 does, so it changes
        nothing and reads no expert row 0 does not. Not for recurrent layers, whose state a
        copy would update twice."""
        extra = n - self.S
        if extra <= 0:
            return self
        zeros = np.zeros(extra, np.int64)
        samplers = None if self.samplers is None else np.concatenate([self.samplers, np.full(extra, -1, np.int32)])
        feed = None if self.feed is None else (np.concatenate([self.feed[0], self.feed[0][zeros]]), self.feed[1])
        return Step(np.concatenate([self.tokens, self.tokens[zeros]]),
                    np.concatenate([self.positions, self.positions[zeros]]),
                    np.arange(n + 1, dtype=np.int64), [*self.caches, *[self.caches[0]] * extra],
                    self.all_logits, samplers=samplers, feed=feed,  # padding: sampled by no slot
                    deferred=self.deferred)

    def last_rows(self) -> np.ndarray:
        """[S] the index of each sequence's last row."""
        return self.offsets[1:] - 1

    def outputs(self) -> Step:
        """This step restricted to each sequence's last row: the rows whose logits are wanted
        when not all_logits (as llama.cpp, the last layer's FFN runs on those rows only)."""
        last = self.last_rows()
        return Step(self.tokens[last], self.positions[last], np.arange(self.S + 1, dtype=np.int64), self.caches,
                    True)
