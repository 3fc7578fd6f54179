"""A cache tier's counters, and the log of requests that scores it against an oracle.

VRAMStats: what the VRAM expert cache counts per layer (backend/cuda_expert_cache.py).
RequestLog: each step's expert set of one layer, the newest LIMIT kept, replayed through a policy
and Belady at the tier's capacity (what an oracle would have hit on the same requests).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from .policies import LayerResult, simulate_layer


@dataclass
class VRAMStats:
    requests: int = 0  # experts asked for by steps (unique within a step's layer)
    hits: int = 0  # ... in VRAM (ready, or a copy in flight)
    misses: int = 0  # ... not in VRAM
    loads: int = 0  # experts copied in (demand, prefetch and admission)
    evictions: int = 0
    bytes_copied: int = 0
    copied_demand: int = 0  # misses copied for the step that asked
    cpu_hybrid: int = 0  # misses computed on the CPU by the offload policy's choice
    cpu_forced: int = 0  # experts computed on the CPU under MOE_POSTFETCH_FORCE_CPU
    fallbacks: int = 0  # experts computed on the CPU because the GPU could not serve them
    admitted: int = 0  # CPU-computed misses copied in the background
    prefetch_issued: int = 0
    prefetch_used: int = 0
    prefetch_wasted: int = 0
    tokens: int = 0  # rows routed through the first MoE layer (bytes per token)
    copy_ms: float = 0.0  # fetch-stream time of demand copies (timing events)
    stall_ms: float = 0.0  # compute-stream time spent waiting on them
    cpu_ms: float = 0.0  # host time computing CPU experts

    def add(self, other: VRAMStats) -> None:
        for k, v in asdict(other).items():
            setattr(self, k, getattr(self, k) + v)

    def summary(self) -> dict:
        d = asdict(self)
        routed = self.requests or 1
        d["hit_rate"] = round(self.hits / routed, 6)
        d["fallback_rate"] = round(self.fallbacks / routed, 6)
        d["overlap_pct"] = round(100.0 * (1.0 - self.stall_ms / self.copy_ms), 2) if self.copy_ms > 0 else None
        d["bytes_per_token"] = round(self.bytes_copied / self.tokens) if self.tokens else 0
        d["h2d_gbps"] = round(self.bytes_copied / (self.copy_ms * 1e6), 2) if self.copy_ms > 0 else None
        return d


@dataclass
class RequestLog:
    """One layer's expert sets, step by step. Past `limit` the older half goes (a replay runs in
    Python on every stats call: ~3 s for 48 layers of 512 steps); the whole log replays, so the
    replayed cache is as warm as the live one, but only steps since `counted_from` (the last
    reset) count."""

    limit: int = 512
    steps: list = field(default_factory=list)  # frozenset of expert ids per step (or `record`'s form)
    counted_from: int = 0
    record: object = frozenset  # what a step is kept as (the host tier keeps all layers' bool [L, E])

    def add(self, experts) -> None:
        self.steps.append(self.record(experts))
        if len(self.steps) > self.limit:  # keep the newer half
            cut = len(self.steps) // 2
            del self.steps[:cut]
            self.counted_from = max(0, self.counted_from - cut)

    def reset(self) -> None:
        self.counted_from = len(self.steps)

    @property
    def counted(self) -> int:
        return len(self.steps) - self.counted_from

    def replay(self, capacity: int, policy: str) -> LayerResult:
        """The counted steps' hits and misses under `policy` at `capacity` slots."""
        return simulate_layer(self.steps, capacity, policy, self.counted_from)
