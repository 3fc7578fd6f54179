"""Decode with experts that do not all fit in VRAM: the VRAM expert cache, Post-Fetch and hybrid compute.

    python benchmarks/gpu_offload.py MODEL.gguf --cache-mb 7400,14800 [--routing uniform,TRACE.jsonl]
        [--min-batch 0,auto] [--warmup 32] [--steps 32] [--prompt 16] [--profile N] [--json out.json]
        [--set KEY=VALUE ...]

For each (cache size, routing, MOE_OFFLOAD_MIN_BATCH) the model is loaded as the engine loads it on
cuda:0 (MOE_GPU_CACHE_MB = the cache size; the host cache unlimited, in pinned memory), a prompt is
prefilled (its experts read from the file: a cold host cache), --warmup tokens are decoded (the host
cache and the VRAM cache fill), the prompt is prefilled again into a fresh sequence (warm: its
experts in host memory), then --steps tokens are timed. Routing: `uniform` is the model's own
router (a synthesized file's routing is close to uniform); a trace path replays real routing (MOE_ROUTING_REPLAY). Printed per run: decode tok/s;
the VRAM tier's hit rate against a Belady replay of the same requests at the same capacity; bytes
copied per token and the bound they set at the copy bandwidth measured in the run; Post-Fetch
overlap and fallback rate; and the time split of a step: CPU expert compute (host), copies (fetch
stream), the compute stream's waits on them, and the rest (GPU compute and host work).
`measure()` is one run; `benchmarks/run.py --device cuda` calls it in a child process per row, next
to llama.cpp's CUDA build.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from daemon.engine import Engine  # noqa: E402


def _decode(model, cache, token: int, steps: int, marked=None) -> tuple[list[float], int]:
    """steps greedy decode steps -> (their wall times, the last token). marked: a list, told which
    steps launched one marked graph (cuda_graphs.HostClock.marks), by index."""
    times = []
    marks = model.backend.graphs.clock.marks
    for i in range(steps):
        n = len(marks) if marks is not None else 0
        t0 = time.perf_counter()
        logits = model.forward([token], cache)
        token = int(np.argmax(logits[-1]))
        times.append(time.perf_counter() - t0)
        if marked is not None and marks is not None and len(marks) == n + 1:
            marked.append(i)
    return times, token


def measure(path: str, cache_mb: str, routing: str, min_batch: str, *, prompt: int | list[int] = 16,
            warmup: int = 32, steps: int = 32, settings: dict | None = None, profile: int = 0,
            say=lambda m: print(m, flush=True)) -> dict:
    """One run (see the module doc) -> its figures. prompt: a count of random token ids, or the ids;
    settings: more keywords of Engine.load (daemon.config names); say: the loading progress lines.
    A cache size that holds every expert gets no VRAM cache: "experts" says so, and no cache figures."""
    settings = dict(device="cuda", gpu_cache_mb=str(cache_mb), offload_min_batch=str(min_batch), **(settings or {}))
    if routing != "uniform":
        settings["routing_replay"] = routing
    t0 = time.perf_counter()
    eng = Engine.load(path, progress=lambda m: say(f"  [{time.perf_counter() - t0:6.1f}s] {m}"), **settings)
    try:
        load_s = time.perf_counter() - t0
        model = eng.model
        if isinstance(prompt, int):
            prompt = np.random.default_rng(0).integers(100, model.hp.n_vocab - 100, prompt).tolist()
        cache = model.new_cache(len(prompt) + warmup + steps + 8)
        t1 = time.perf_counter()
        logits = model.forward(prompt, cache)
        prefill_s = time.perf_counter() - t1
        _, token = _decode(model, cache, int(np.argmax(logits[-1])), warmup)
        # the same prompt again into a fresh sequence: its experts now come from the host cache (and
        # partly VRAM), as llama.cpp's come from its warm mapping
        again = model.new_cache(len(prompt) + 8)
        t1 = time.perf_counter()
        model.forward(prompt, again)
        prefill_warm_s = time.perf_counter() - t1
        del again
        eng.reset_stats()
        clock = model.backend.graphs.clock
        busy0, blocked0 = clock.busy_s, clock.blocked_s
        clock.marks = []  # each replay's GPU time, start to end
        marked: list[int] = []
        with _CollectorPauses() as pauses:
            times, token = _decode(model, cache, token, steps, marked)
        host = {"busy_ms": 1e3 * (clock.busy_s - busy0), "blocked_ms": 1e3 * (clock.blocked_s - blocked0)}
        gpu = clock.gpu_ms()
        clock.marks = None
        stats = eng.stats()
        v, tier = stats["vram_cache"], stats["host_tier"]
        if profile:  # where the host's time goes in a decode step
            import cProfile
            import io
            import pstats

            prof = cProfile.Profile()
            prof.enable()
            _decode(model, cache, token, profile)
            prof.disable()
            buf = io.StringIO()
            pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(25)
            say("\n".join(buf.getvalue().splitlines()[:45]))
        wall_ms = 1e3 * sum(times)
        out = {"model": path, "cache_mb": cache_mb, "routing": "uniform" if routing == "uniform" else Path(routing).name,
               "min_batch": min_batch, "load_s": round(load_s, 1),
               "prefill_tok_s": round(len(prompt) / prefill_s, 1),
               "prefill_warm_tok_s": round(len(prompt) / prefill_warm_s, 1),
               "decode_tok_s": round(steps / (wall_ms / 1e3), 2) if steps else None,
               "step_ms_median": round(1e3 * float(np.median(times)), 2) if steps else None,
               "graph_replays": model.backend.graphs.replays,  # decode steps run as graph segments
               # steps run as one graph each: the GPU's time from the graph's start to its end, and
               # what a step costs beyond it (the host's share of a token: inputs, launch, read-back)
               **(_host_split([times[i] for i in marked], gpu) if gpu else {}),
               # steps over twice the median (where the mean and the median part ways), with their GPU
               # time where they ran as one graph, and the garbage collector's pauses in the timed steps
               "slow_steps": _slow_steps(times, dict(zip(marked, gpu or []))),
               "gc_pauses_ms": pauses.ms}
        if v is not None:
            return out | _cache_figures(v, steps, wall_ms, host)
        if tier is not None:
            return out | _tier_figures(tier, model, steps)
        return out | {"experts": "all resident in VRAM"}
    finally:
        eng.close()


def _cache_figures(v: dict, n: int, wall_ms: float, host: dict) -> dict:
    """The VRAM expert cache's figures of n timed steps (stats()["vram_cache"]; host: the graph
    replays' host time, busy and blocked on the GPU, cuda_graphs.HostClock).

    The split of a step, per token: CPU experts (host, inside the host points); copies (fetch
    stream) and the compute stream's waits on them; host work (the host points and segment
    launches of graph replays, CPU experts excluded); GPU compute the host waited for (its blocked
    time at host points less the waits on copies: a lower bound, as the GPU also runs while the
    host works); the rest (eager steps, the step's set-up and logits read-back)."""
    n = max(n, 1)
    bpt = v["bytes_per_token"]
    gbps = v["h2d_gbps"] or 0.0
    return {"experts": "VRAM expert cache",
            "hit_rate": v["hit_rate"], "belady_hit_rate": v["belady_hit_rate"],
            "bytes_per_token_mb": round(bpt / 2**20, 1), "h2d_gbps": gbps,
            "copy_bound_tok_s": round(gbps * 1e9 / bpt, 1) if bpt and gbps else None,
            "overlap_pct": v["overlap_pct"], "fallback_rate": v["fallback_rate"],
            "cpu_experts_per_token": round(v["cpu_hybrid"] / n, 2),
            "split_ms_per_token": {"cpu_experts": round(v["cpu_ms"] / n, 2), "copies": round(v["copy_ms"] / n, 2),
                                   "waits": round(v["stall_ms"] / n, 2),
                                   "host_work": round((host["busy_ms"] - v["cpu_ms"]) / n, 2),
                                   "gpu_compute_waited_for": round(max(host["blocked_ms"] - v["stall_ms"], 0.0) / n, 2),
                                   "rest": round((wall_ms - host["busy_ms"] - host["blocked_ms"]) / n, 2)},
            "slots_per_layer": sorted({lay["capacity"] for lay in v["layers"].values()}),
            "offload": v["offload"]}


def _slow_steps(times: list[float], gpu_of: dict[int, float]) -> list[dict]:
    med = float(np.median(times)) if times else 0.0
    return [{"step": i, "ms": round(1e3 * t, 1), "gpu_ms": round(gpu_of[i], 2) if i in gpu_of else None}
            for i, t in enumerate(times) if t > 2 * med]


class _CollectorPauses:
    """The cyclic garbage collector's pauses while the block runs (ms each, with its generation)."""

    def __enter__(self):
        self.ms: list[tuple[int, float]] = []
        self._t0 = 0.0
        gc.callbacks.append(self._on)
        return self

    def _on(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
        else:
            self.ms.append((info["generation"], round(1e3 * (time.perf_counter() - self._t0), 2)))

    def __exit__(self, *exc):
        gc.callbacks.remove(self._on)


def _host_split(times: list[float], gpu_ms: list[float]) -> dict:
    """Medians over the steps of their GPU time and of the rest of their wall time (ms)."""
    rest = [1e3 * t - g for t, g in zip(times, gpu_ms)]
    return {"gpu_ms_per_step": round(float(np.median(gpu_ms)), 2), "host_ms_per_token": round(float(np.median(rest)), 2)}


def _tier_figures(t: dict, model, n: int) -> dict:
    """The host tier's figures (stats()["host_tier"]) over the timed steps whose use counts were
    read: hit rate against Belady and opt-bypass, MB a token read in place over PCIe, promotions a
    step."""
    tokens = t["pairs"] / (model.hp.n_expert_used * len(model.moe_layers)) if t["pairs"] else 0
    return {"experts": "host tier", "hit_rate": t["hit_rate"], "belady_hit_rate": t["belady_hit_rate"],
            "opt_bypass_hit_rate": t["opt_bypass_hit_rate"], "slots_per_layer": t["slots_per_layer"],
            "read_in_place_mb_per_token": round(t["read_in_place_bytes"] / tokens / 2**20, 1) if tokens else None,
            "promotions_per_step": round(t["promotions"] / max(1, n), 2), "failed_moves": t["failed_moves"],
            # a host tier smaller than the model: steps run again for cold misses, experts read from the file
            "host_rows_per_layer": t["host_rows_per_layer"], "cold_runs_per_step": round(t["cold_steps"] / max(1, n), 3),
            "blocked_share": round(t["blocked_steps"] / max(1, n), 3),
            "cold_loads_per_token": round(t["cold_loads"] / max(1, n), 1),
            # hybrid compute beside the tier (MOE_GPU_HOST_TIER_CPU_MB): the count the tuner chose, the
            # median step time it measured at each count, the CPU's experts a token and its time a token
            **({"cpu_n": t["cpu_n"], "cpu_step_ms": t["cpu_step_ms"],
                "cpu_pairs_per_token": round(t["cpu_pairs"] / max(1, n), 1),
                "cpu_ms_per_token": round(t["cpu_ms"] / max(1, n), 2)} if "cpu_n" in t else {})}


def run(path: str, cache_mb: str, routing: str, min_batch: str, args) -> dict:
    out = measure(path, cache_mb, routing, min_batch, prompt=args.prompt, warmup=args.warmup, steps=args.steps,
                  settings=dict(args.set), profile=args.profile)
    print(json.dumps(out), flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--cache-mb", default="8192")
    ap.add_argument("--routing", default="uniform")
    ap.add_argument("--min-batch", default="0,auto")
    ap.add_argument("--prompt", type=int, default=16)
    ap.add_argument("--warmup", type=int, default=32)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--set", action="append", default=[], type=lambda kv: tuple(kv.split("=", 1)),
                    help="another setting of daemon.config, e.g. --set postfetch_enable=0")
    ap.add_argument("--profile", type=int, default=0, help="cProfile N more decode steps (host time by function)")
    ap.add_argument("--json")
    args = ap.parse_args()
    results = []
    for mb in args.cache_mb.split(","):
        for routing in args.routing.split(","):
            for mbatch in args.min_batch.split(","):
                results.append(run(args.model, mb, routing, mbatch, args))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
