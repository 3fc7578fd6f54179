"""A sequence's state across layers: one cache object per layer (mlx-lm's make_cache idea).

A backend makes the layer caches (`Backend.new_cache`): f32 KV arrays on the CPU, device KV on a
GPU, conv + recurrent state for a hybrid family's linear-attention layers. The model only counts
positions (n_past) and asks for room (reserve); each layer cache owns its storage and its update.
"""

from __future__ import annotations

from typing import Protocol, Sequence

from ..errors import RequestError


class LayerCache(Protocol):
    """One layer's state for one sequence."""

    @property
    def capacity(self) -> int:
        """Positions it can hold without growing (a fixed-size recurrent state: any number)."""
        ...

    def reserve(self, n: int) -> None:
        """Make room for positions 0..n-1 (n <= the sequence's n_ctx, checked by the caller)."""
        ...


class SequenceCache:
    """One sequence: `layers[il]` is layer il's cache; positions 0..n_past-1 are stored.

    n_ctx bounds the positions; asking for more is a RequestError ("context full")."""

    def __init__(self, layers: Sequence[LayerCache], n_ctx: int):
        self.layers = list(layers)
        self.n_ctx = n_ctx
        self.n_past = 0
        self._room = min((layer.capacity for layer in self.layers), default=n_ctx)

    def grows(self, n: int) -> bool:
        """Whether reserve(n) may have to grow a layer's storage."""
        return n > self._room

    def reserve(self, n: int) -> None:
        """Room for positions 0..n-1 in every layer."""
        if n > self.n_ctx:
            raise RequestError(f"context full: {n} positions requested, n_ctx is {self.n_ctx}")
        if n <= self._room:  # the decode hot path: one compare
            return
        for layer in self.layers:
            layer.reserve(n)
        self._room = min(layer.capacity for layer in self.layers)
