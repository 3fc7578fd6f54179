"""Host time of one kernel launch and of the array work around it, on a GPU.

    python benchmarks/gpu_launch.py [--n 2000]

Per call, in microseconds of host time (median of 5 rounds of --n calls; the GPU is kept ahead
by the queue, so the wall time of a round is the host's): a launch of RMSNorm (4 arguments), of
the expert GEMV (17 arguments) and of the tiled expert matmul (16 arguments, 106 parameters once
flattened; small shapes, so the GPU keeps up) through numba's dispatcher and through launch.py's
fast path; a cuda.device_array allocation, a slice and a reshape of a device array, and
the same through the backend's pooled op arrays (daemon/backend/cuda_arrays.py); an event record. Prints a table, and checks first that both launch paths give the same bits.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def per_call_us(fn, n: int, sync) -> float:
    rounds = []
    for _ in range(5):
        sync()
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        rounds.append((time.perf_counter() - t0) / n * 1e6)
        sync()
    return statistics.median(rounds)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=2000)
    args = ap.parse_args()
    from numba import cuda

    from daemon.backend.cuda_graphs import nonblocking_stream
    from daemon.kernels.cuda import launch, mmvq, norm
    from daemon.kernels.cuda.layout import repack
    from daemon.kernels.cuda.quantize import quantize_q8_1
    from daemon.kernels.quants import Q8_0
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    stream = nonblocking_stream()  # makes the context
    rng = np.random.default_rng(0)
    T, D, E, A, F = 1, 2048, 16, 8, 768
    x = cuda.to_device(rng.standard_normal((T, D)).astype(np.float32))
    w = cuda.to_device(rng.standard_normal(D).astype(np.float32))
    out = cuda.device_array((T, D), np.float32)
    raw = quantize(rng.standard_normal((E * F, D)).astype(np.float32), GGMLQuantizationType.Q8_0)
    stack = repack(raw, Q8_0).reshape(E, F, -1)
    stack = cuda.to_device(stack)
    q8 = mmvq.Q8(*quantize_q8_1(x, stream=stream))
    ids = cuda.to_device(rng.permutation(E)[:A].reshape(1, A).astype(np.int32))
    slot_of = cuda.to_device(np.arange(E, dtype=np.int32))
    gout = cuda.device_array((T, A, F), np.float32)
    sync = stream.synchronize
    from daemon.kernels.cuda import grouping, mmq

    Tt, Dt, Et, Ft = 32, 256, 4, 64  # the tiled matmul: a few microseconds of GPU a launch
    raw_t = quantize(rng.standard_normal((Et * Ft, Dt)).astype(np.float32), GGMLQuantizationType.Q8_0)
    stack_t = cuda.to_device(repack(raw_t, Q8_0).reshape(Et, Ft, -1))
    q8_t = mmvq.Q8(*quantize_q8_1(cuda.to_device(rng.standard_normal((Tt, Dt)).astype(np.float32)), stream=stream))
    ids_t = cuda.to_device(np.stack([rng.permutation(Et)[:2] for _ in range(Tt)]).astype(np.int32))
    slots_t = cuda.to_device(np.arange(Et, dtype=np.int32))
    groups_t = grouping.group_by_expert(ids_t, Et, stream=stream)
    tout = cuda.device_array((Tt, 2, Ft), np.float32)

    def rms():
        norm.rms_norm(x, w, 1e-6, out, stream=stream)

    def gemv():
        mmvq.mul_mat_vec_ids(stack, Q8_0, D, q8, ids, slot_of, out=gout, stream=stream)

    def tiled():
        mmq.mul_mat_q_ids(stack_t, Q8_0, Dt, q8_t, ids_t, slots_t, groups_t, out=tout, stream=stream)

    results = {}
    for mode in ("dispatcher", "fast"):
        launch.FAST = mode == "fast"
        rms(), gemv(), tiled(), sync()
        results[mode] = (out.copy_to_host(), gout.copy_to_host(), tout.copy_to_host())
        results[f"rms_norm launch, {mode}"] = per_call_us(rms, args.n, sync)
        results[f"expert GEMV launch (17 args), {mode}"] = per_call_us(gemv, args.n, sync)
        results[f"tiled expert matmul launch (16 args), {mode}"] = per_call_us(tiled, args.n, sync)
    launch.FAST = True
    same = all(np.array_equal(a, b) for a, b in zip(results.pop("dispatcher"), results.pop("fast")))
    print(f"fast and dispatcher launches give the same bits: {same}")
    results["cuda.device_array((1, 2048), f32)"] = per_call_us(lambda: cuda.device_array((T, D), np.float32), args.n, sync)
    big = cuda.device_array((64, D), np.float32)
    results["device array slice a[3:9]"] = per_call_us(lambda: big[3:9], args.n, sync)
    results["device array reshape"] = per_call_us(lambda: big.reshape(8, 8, D), args.n, sync)
    from daemon.backend.cuda_arrays import OpArrays

    pool = OpArrays()
    results["OpArrays.empty((1, 2048), f32)"] = per_call_us(lambda: pool.empty((T, D), np.float32), args.n, sync)
    pooled = pool.empty((64, D), np.float32)
    results["OpArray slice a[3:9]"] = per_call_us(lambda: pooled[3:9], args.n, sync)
    results["OpArray reshape"] = per_call_us(lambda: pooled.reshape(8, 8, D), args.n, sync)
    ev = cuda.event(timing=False)
    results["event record"] = per_call_us(lambda: ev.record(stream), args.n, sync)
    print(f"{'host time per call':48s} {'us':>8s}")
    for k, v in results.items():
        print(f"{k:48s} {v:8.1f}")


if __name__ == "__main__":
    main()
