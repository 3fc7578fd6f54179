"""Where a layer's experts missing from VRAM compute: copied to the GPU, or on the CPU from host memory.

A missed expert at a small batch is cheaper on the CPU, where its weights already are, than across
PCIe (Fiddler; llama.cpp computes MoE on the CPU below 32 tokens a step). Both run at once: the
GPU copies and computes its share while the CPU computes the rest, so a step's experts wait for
max(copy time, CPU time), and the plan balances the two.

MOE_OFFLOAD_MIN_BATCH:
- N > 0: an expert that fewer than N of the step's tokens route to runs on the CPU, else it is copied;
- 0: never on the CPU (hybrid compute off: tokens are bit-identical whatever the caches);
- auto: the cost model. Copying expert e takes bytes(e) / h2d (measured pinned host-to-device
  bandwidth); computing it on the CPU takes tokens(e) * bytes(e) / cpu (measured CPU expert
  throughput at the thread count in use: a decode GEMV reads the weights once per token), plus a
  fixed cost once a layer sends any expert there (measured too: the host's work to gather the
  pairs, call the kernels and send the results back, which the host thread spends instead of
  driving the GPU). Misses are taken most tokens first, each to whichever side would finish it
  first (list scheduling). The start-up figures only seed the CPU's cost: the steps' own CPU
  expert calls refit it as they run (`CPUCostFit`), since a call between GPU segments (threads
  woken from sleep, one or two experts) costs far more than the back-to-back calls of the start-up
  measurement (~1 ms against ~0.1 ms for a 3.3 MB expert on the H100 machine).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ..errors import ConfigError


def parse_min_batch(value: str) -> int | None:
    """'auto' -> None (the cost model); 'N' -> N."""
    v = str(value).strip().lower()
    if v == "auto":
        return None
    if v.isascii() and v.isdigit():
        return int(v)
    raise ConfigError(f"MOE_OFFLOAD_MIN_BATCH: {value!r} is not auto or a whole number")


@dataclass(frozen=True)
class OffloadPolicy:
    min_batch: int | None  # None: the cost model
    h2d_bytes_per_s: float = 0.0  # measured at load (auto)
    cpu_bytes_per_s: float = 0.0  # weight bytes a CPU expert GEMV streams per second, per token
    cpu_call_s: float = 0.0  # the fixed host cost of a layer's CPU experts (measured at load, auto)

    @property
    def hybrid(self) -> bool:
        """Whether any expert may run on the CPU by choice."""
        return self.min_batch != 0

    def copy_s(self, nbytes: int) -> float:
        return nbytes / self.h2d_bytes_per_s if self.h2d_bytes_per_s > 0 else 0.0

    def cpu_s(self, nbytes: int, tokens: int) -> float:
        return tokens * nbytes / self.cpu_bytes_per_s if self.cpu_bytes_per_s > 0 else float("inf")

    def on_cpu(self, misses: dict[int, int], nbytes: int) -> set[int]:
        """The experts of `misses` (expert -> tokens routed to it this step) to compute on the CPU;
        the rest are copied. nbytes: one expert's bytes (all of a layer's are the same size)."""
        if not misses or self.min_batch == 0:
            return set()
        if self.min_batch is not None:
            return {e for e, n in misses.items() if n < self.min_batch}
        gpu = cpu = 0.0
        chosen = set()
        for e, n in sorted(misses.items(), key=lambda kv: (-kv[1], kv[0])):
            on_gpu = gpu + self.copy_s(nbytes)
            on_cpu = cpu + self.cpu_s(nbytes, n) + (0.0 if chosen else self.cpu_call_s)
            if on_cpu < on_gpu:
                cpu = on_cpu
                chosen.add(e)
            else:
                gpu = on_gpu
        return chosen

    def describe(self) -> str:
        if self.min_batch == 0:
            return "hybrid CPU compute off (MOE_OFFLOAD_MIN_BATCH=0): every missed expert is copied"
        if self.min_batch is not None:
            return f"experts fewer than {self.min_batch} tokens route to compute on the CPU, others are copied"
        per_mb_copy = self.copy_s(2**20) * 1e6
        per_mb_cpu = self.cpu_s(2**20, 1) * 1e6
        return (f"cost model: pinned host-to-device {self.h2d_bytes_per_s / 1e9:.1f} GB/s ({per_mb_copy:.0f} us/MiB), "
                f"CPU experts {self.cpu_bytes_per_s / 1e9:.1f} GB/s per token ({per_mb_cpu:.0f} us/MiB a token) "
                f"+ {self.cpu_call_s * 1e6:.0f} us a layer; "
                f"a missed expert goes to whichever side finishes the step's misses first")


class CPUCostFit:
    """The CPU experts' cost as the steps measure it: seconds = fixed + weight / rate, where weight is
    the tokens x bytes of a layer's CPU experts (a decode GEMV reads an expert's bytes once a
    token). Least squares with exponential forgetting (half_life calls), so the fit follows the
    machine; until `least` calls were seen, or when the calls' weights barely differ, the line goes
    through the origin (all of a call's time counted per byte: the cautious side)."""

    def __init__(self, half_life: float = 32.0, least: int = 4):
        self.decay = 0.5 ** (1.0 / half_life)
        self.least = least
        self.calls = 0
        self._n = self._w = self._t = self._ww = self._wt = 0.0

    def observe(self, weight: float, seconds: float) -> None:
        if weight <= 0 or seconds <= 0:
            return
        k = self.decay
        self._n, self._w, self._t = k * self._n + 1.0, k * self._w + weight, k * self._t + seconds
        self._ww, self._wt = k * self._ww + weight * weight, k * self._wt + weight * seconds
        self.calls += 1

    def fit(self) -> tuple[float, float] | None:
        """(bytes per second a token, fixed seconds a call), or None before any call."""
        if not self.calls:
            return None
        mean_w, mean_t = self._w / self._n, self._t / self._n
        var = self._ww / self._n - mean_w * mean_w
        if self.calls >= self.least and var > 1e-6 * mean_w * mean_w:
            slope = (self._wt / self._n - mean_w * mean_t) / var  # seconds a byte
            fixed = mean_t - slope * mean_w
            if slope > 0 and fixed >= 0:
                return 1.0 / slope, fixed
        return self._w / self._t, 0.0

    def refit(self, policy: OffloadPolicy) -> OffloadPolicy:
        """policy with its CPU cost replaced by the fit (unchanged while there is none)."""
        got = self.fit()
        if got is None:
            return policy
        rate, fixed = got
        return replace(policy, cpu_bytes_per_s=rate, cpu_call_s=fixed)


class SplitTuner:
    """How many of a layer's missed experts the CPU computes beside the host tier (0 .. most),
    chosen by the step time measured, so hybrid compute is on only where it pays.

    Each count is timed over `window` steps (the median; the first `skip` after a change are
    dropped: a new count's graph is captured then). From 0 it tries 1 and climbs while a count
    beats the one below by more than `margin`, then keeps the fastest (the smaller count unless a
    larger one beats it by the margin). Every `recheck` steps it times its count and the two
    beside it again, since the machine's load changes. A fixed count (`fixed`) is never tuned."""

    def __init__(self, most: int, window: int = 16, margin: float = 0.03, recheck: int = 2048, skip: int = 2,
                 fixed: int | None = None):
        self.most = max(0, int(most))
        self.window, self.margin, self.recheck, self.skip = max(1, window), margin, max(1, recheck), skip
        self.fixed = fixed
        self.n = min(fixed, self.most) if fixed is not None else 0
        self.times: dict[int, float] = {}  # count -> median step seconds, of the current search
        self._queue: list[int] = [] if fixed is not None else [0, 1][:self.most + 1]
        self._samples: list[float] = []
        self._dropped = 0
        self._settled_for = 0
        if self._queue:
            self.n = self._queue.pop(0)

    def observe(self, seconds: float) -> int:
        """One step's time at the current count -> the count for the next step."""
        if self.fixed is not None or self.most == 0:
            return self.n
        if self._settled_for:
            self._settled_for += 1
            if self._settled_for > self.recheck:
                self._settled_for = 0
                self.times = {}
                best = self.n
                self._queue = [c for c in (best - 1, best + 1) if 0 <= c <= self.most]
                self._samples, self._dropped = [], 0
            return self.n
        if self._dropped < self.skip:
            self._dropped += 1
            return self.n
        self._samples.append(seconds)
        if len(self._samples) < self.window:
            return self.n
        self.times[self.n] = sorted(self._samples)[len(self._samples) // 2]
        self._samples, self._dropped = [], 0
        if not self._queue:
            top = max(self.times)
            if top < self.most and top - 1 in self.times and self._beats(top, top - 1) and self._best() == top:
                self._queue = [top + 1]  # still climbing
        if self._queue:
            self.n = self._queue.pop(0)
            return self.n
        self.n = self._best()
        self._settled_for = 1
        return self.n

    def _beats(self, a: int, b: int) -> bool:
        return self.times[a] < self.times[b] * (1.0 - self.margin)

    def _best(self) -> int:
        """The fastest count timed, preferring fewer CPU experts unless more beat it by the margin."""
        best = min(self.times)
        for c in sorted(self.times):
            if c > best and self._beats(c, best):
                best = c
        return best
