"""Replayed routing (MOE_ROUTING_REPLAY), for benchmarks only.

A model with a random router (`moed synth`) spreads its choices over all experts, which says
nothing about expert-cache hit rates on a real workload. RoutingReplay makes every MoE layer use
the experts a real model chose, from a recorded trace (benchmarks/data/traces, or any file of
`moed trace record`), while the model's router still weighs them (daemon.model.moe.route): compute
and I/O are those of a real workload; the outputs are no longer the model's.

How a trace of L layers, N tokens and ids below E_t (its largest id + 1: the format holds no
expert count) maps onto a model of M MoE layers, E experts, top-A:
- layer: the model's j-th MoE layer (j = 0..M-1, dense layers not counted) replays trace layer
  j * L // M, spread evenly (with fewer trace layers, neighbouring model layers share one);
- expert: id e becomes e * E // E_t, in the trace's order, an id that collides kept once;
- k: the first A of those; a shorter row (collisions, a trace of smaller k, or `[]`, a row that
  `moed trace record` did not compute) is filled with the chosen ids' neighbours: for step = 1,
  2, ..., (c + step) mod E of each chosen c in order, ids already taken skipped; an empty row
  becomes 0..A-1. The fill depends on the trace row alone, so the trace's reuse carries over;
- token: the row at position p of a sequence (prefill and decode rows alike) replays trace token
  p mod N. Each sequence has its own cursor, starting at the trace's first token, so its routing
  does not depend on the sequences batched with it.
"""

from __future__ import annotations

import logging
import os

import numpy as np

from ..errors import ConfigError, RequestError
from .replay import load_trace_ids

log = logging.getLogger("moed.routing")


def trace_layer(j: int, n_moe: int, n_trace: int) -> int:
    """The trace layer the model's j-th MoE layer (of n_moe) replays."""
    return j * n_trace // n_moe


def map_ids(ids: list[int], n_expert_trace: int, n_expert: int, k: int) -> list[int]:
    """A trace row's ids as k distinct ids of a model with n_expert experts (module docstring)."""
    out = list(dict.fromkeys(e * n_expert // n_expert_trace for e in ids))[:k]
    base = out or [n_expert - 1]
    taken = set(out)
    step = 1
    while len(out) < k:
        for c in base:
            e = (c + step) % n_expert
            if e not in taken and len(out) < k:
                out.append(e)
                taken.add(e)
        step += 1
    return out


class RoutingReplay:
    """A Transformer.route_override: `table` [L_moe, N, A], the trace's ids of each MoE layer per
    trace token; tables[layer]: one layer's [N, A]; called with (layer, positions [T]) -> its ids
    [T, A] at those positions."""

    def __init__(self, trace: list[list[list[int]]], moe_layers: list[int], n_expert: int, n_used: int,
                 source: str = "trace") -> None:
        self.source = source
        self.n_layers_trace = len(trace)
        self.n_tokens = len(trace[0])
        self.n_expert_trace = 1 + max((e for seq in trace for ids in seq for e in ids), default=-1)
        if self.n_expert_trace == 0:
            raise ConfigError(f"MOE_ROUTING_REPLAY: {source}: the trace holds no expert ids")
        self.n_expert, self.n_used = n_expert, n_used
        mapped: dict[int, np.ndarray] = {}  # trace layer -> its table (model layers may share one)
        self.tables: dict[int, np.ndarray] = {}
        for j, il in enumerate(moe_layers):
            lt = trace_layer(j, len(moe_layers), len(trace))
            if lt not in mapped:
                mapped[lt] = np.array([map_ids(ids, self.n_expert_trace, n_expert, n_used) for ids in trace[lt]],
                                      dtype=np.int64).reshape(self.n_tokens, n_used)
            self.tables[il] = mapped[lt]
        # every MoE layer's table in the model's order, as the backends gather it at a step's
        # positions (Backend.replay_routes): int32 [L_moe, N, A]
        self.table = np.stack([self.tables[il] for il in moe_layers]).astype(np.int32)
        self._model = None

    @classmethod
    def load(cls, path: str | os.PathLike, model) -> RoutingReplay:
        """The trace at path mapped onto model; ConfigError naming the file (and line) if it is
        missing, unreadable or malformed."""
        try:
            trace = load_trace_ids(path)
        except RequestError as e:
            raise ConfigError(f"MOE_ROUTING_REPLAY: {e}") from None
        return cls(trace, model.moe_layers, model.hp.n_expert, model.hp.n_expert_used, os.fspath(path))

    @classmethod
    def from_settings(cls, settings, model) -> RoutingReplay | None:
        """The replay MOE_ROUTING_REPLAY asks for, attached to model and announced by a warning;
        None when it is off or the model has no MoE layer."""
        if not settings.routing_replay or not model.moe_layers:
            return None
        replay = cls.load(settings.routing_replay, model).attach(model)
        log.warning("MOE_ROUTING_REPLAY: %s; outputs are no longer the model's (benchmarks only)", replay.describe())
        return replay

    def describe(self) -> str:
        return (f"experts replayed from {self.source} ({self.n_tokens} tokens, {self.n_layers_trace} layers, "
                f"ids < {self.n_expert_trace}) onto {len(self.tables)} MoE layers, top-{self.n_used} of "
                f"{self.n_expert}")

    def attach(self, model) -> RoutingReplay:
        model.route_override = self
        self._model = model
        return self

    def detach(self) -> None:
        if self._model is not None and self._model.route_override is self:
            self._model.route_override = None
        self._model = None

    def __call__(self, layer: int, positions: np.ndarray) -> np.ndarray:
        return self.tables[layer][positions % self.n_tokens]
