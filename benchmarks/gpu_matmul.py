"""GPU matmul kernels (daemon/kernels/cuda): achieved bandwidth and per-launch latency.

    python benchmarks/gpu_matmul.py [--quick] [--json PATH] [--budget SECONDS] [--smoke]
    python benchmarks/gpu_matmul.py --table [--shape D,F,E,A] [--json PATH]
    python benchmarks/gpu_matmul.py --mmq [--shape D,F,E,A] [--json PATH]
    python benchmarks/gpu_matmul.py --grouped [--json PATH]

--table prints only issue 30's per-type table: for Q8_0, Q4_K, Q5_K, Q6_K, MXFP4 and F16 at 1, 4
and 16 tokens, one expert's gate matrix [F, D] (a dense launch) and a layer's routed experts in
one launch each (gate + up fused, and down), against the device copy measured in the same run.

--mmq prints only the tiled prefill kernels at 512 and 4096 tokens, for Q8_0, Q4_K, Q6_K and
MXFP4: the tensor-core kernel (experts: with 64- and with 32-token tiles) against the dp4a one.

--decode prints only a one-token decode step's GEMVs (qwen3-30b-a3b Q8_0 and Q4_K experts, its
Q8_0 q/k/v and o; gpt-oss-20b's MXFP4 experts and Q8_0 q/k/v and o) under each launch shape:
lanes per row (choose_lpr's and twice it) and chunks in flight a lane (unroll 1, 2, 4).

--grouped prints only the experts' GEMV at 16 tokens: a block a pair against the pairs grouped
by expert (each expert read once for runs of 2 or 4 of its pairs, under several launch bounds), on qwen3-30b-a3b's layer (Q8_0,
Q4_K) and gpt-oss-20b's (MXFP4), with the grouping kernel's own time.

Prints, on the GPU it finds:
  * the device-to-device copy bandwidth (bytes read + written / time), the ceiling to compare with;
  * GEMV (mmvq) GB/s of weight bytes read per launch, per weight type, on
      - expert slices of a Qwen3-30B-A3B-shaped layer (D 2048, F 768, 128 experts, 8 selected):
        gate (one launch over all token x expert pairs), fused gate+up+SwiGLU, down;
      - a dense 4096 x 4096 matrix;
    at 1 token, and at 4 and 16 tokens for Q8_0, Q4_K, Q6_K and MXFP4 (expert GB/s count each
    distinct expert's bytes once);
  * per launch: device time (launches queued behind a sleeping kernel so that they run back to
    back: kernel time plus the gap between kernels) and host time of the Python launch call;
  * a few launch shapes (lanes per row, unroll, warps) for Q8_0, Q4_K and MXFP4;
  * the host time of the numba dispatcher alone (prebuilt arguments) next to the launcher's;
  * the tiled prefill kernel (mmq) at 512 tokens: TOPS (2 T N K / time), dense and experts.
Every result is checked against a float64 product on the host first (relative error printed;
for Q4_0/Q4_1/Q5_0/Q5_1 it includes llama.cpp's use of the q8_1 block sums for the offsets,
up to ~1e-2 of the result, the rest ~1e-7). Device ceilings measured in the same run: the
device-to-device copy (bytes read + written) and a 128-bit read kernel.
Weights are rotated over more than 200 MB so that L2 (50 MB) does not serve them.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import warnings
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from numba import cuda  # noqa: E402

from daemon.kernels import quants as Q  # noqa: E402
from daemon.kernels.cuda import grouping, mmq, mmvq  # noqa: E402
from daemon.kernels.cuda.layout import repack  # noqa: E402
from daemon.kernels.cuda.mmvq import Q8, Tuning  # noqa: E402
from daemon.kernels.cuda.ptx import ldg_v4  # noqa: E402
from daemon.kernels.cuda.quantize import quantize_q8_1  # noqa: E402

# the sleeping kernel and the grouping kernel are one block by design
warnings.filterwarnings("ignore", message=".*will likely result in GPU under-utilization.*")

MAIN = [Q.Q8_0, Q.Q4_K, Q.Q6_K, Q.MXFP4]
OTHER = [Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q5_K]
FLOATS = [Q.F16, Q.BF16, Q.F32]
TABLE = [Q.Q8_0, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.MXFP4, Q.F16]  # issue 30's per-type table
F16_FIELDS = {Q.Q8_0: (0,), Q.Q4_0: (0,), Q.Q5_0: (0,), Q.Q4_1: (0, 2), Q.Q5_1: (0, 2),
              Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,)}
ROTATE_BYTES = 200 << 20
N_LAUNCH = 100
SIMULATED = cuda.jit.__module__.startswith("numba.cuda.simulator")


def random_rows(qt: int, shape: tuple[int, ...], k: int, rng) -> np.ndarray:
    """Raw ggml rows uint8 [*shape, row_bytes]: random codes, small finite scales."""
    if qt in FLOATS:
        x = rng.standard_normal(shape + (k,), dtype=np.float32) * np.float32(0.05)
        if qt == Q.F32:
            return x.view(np.uint8)
        if qt == Q.F16:
            return x.astype(np.float16).view(np.uint8)
        return (x.view(np.uint32) >> np.uint32(16)).astype(np.uint16).view(np.uint8)
    qk, bb = Q.block_size(qt)
    raw = rng.integers(0, 256, size=shape + (k // qk, bb), dtype=np.uint8)
    for o in F16_FIELDS.get(qt, ()):
        v = rng.uniform(1e-3, 1e-2, raw.shape[:-1]).astype(np.float16)
        raw[..., o:o + 2] = v.view(np.uint8).reshape(raw.shape[:-1] + (2,))
    if qt == Q.MXFP4:
        raw[..., 0] = rng.integers(118, 124, raw.shape[:-1], dtype=np.uint8)
    return raw.reshape(shape + (k // qk * bb,))


@cuda.jit
def _sleep(n):
    if cuda.threadIdx.x == 0:
        for _ in range(n):
            cuda.nanosleep(1000)


def timed(launch, n=N_LAUNCH):
    """(device µs per launch, host µs per launch call). The n launches are queued behind a
    kernel that sleeps three times as long as queueing them takes, so that they then run back
    to back: events around them time the device (kernel time plus the gap between kernels)."""
    launch(0)
    cuda.synchronize()
    if SIMULATED:
        n = 1
    h0 = time.perf_counter()
    for i in range(3):
        launch(i)
    host = (time.perf_counter() - h0) / 3
    cuda.synchronize()
    e0, e1 = cuda.event(), cuda.event()
    if not SIMULATED:
        _sleep[1, 32](int(max(20e3, 3 * n * host * 1e6)))  # µs (nanosleep(1000) each)
    e0.record()
    h0 = time.perf_counter()
    for i in range(n):
        launch(i)
    h1 = time.perf_counter()
    e1.record()
    e1.synchronize()
    return e0.elapsed_time(e1) * 1e3 / n, (h1 - h0) * 1e6 / n


@cuda.jit
def _read(buf, nbytes, out):
    # every thread xors 16-byte words of buf [nbytes] at a grid stride: a pure read
    i = cuda.grid(1)
    step = cuda.gridsize(1) * 16
    o = i * 16
    acc = np.uint32(0)
    while o < nbytes:
        w = ldg_v4(buf, o)
        acc ^= w[0] ^ w[1] ^ w[2] ^ w[3]
        o += step
    out[i] = acc


def read_bandwidth() -> float:
    """GB/s of a 1 GiB read with 128-bit loads: the ceiling a GEMV can approach."""
    n = 1 << 20 if SIMULATED else 1 << 30
    buf = cuda.to_device(np.ones(n, np.uint8))
    blocks, threads = (1, 32) if SIMULATED else (132 * 16, 256)
    out = cuda.device_array(blocks * threads, np.uint32)
    _read[blocks, threads](buf, n, out)
    times = []
    for _ in range(5):
        e0, e1 = cuda.event(), cuda.event()
        e0.record()
        _read[blocks, threads](buf, n, out)
        e1.record()
        e1.synchronize()
        times.append(e0.elapsed_time(e1) * 1e-3)
    return n / np.median(times) / 1e9


def copy_bandwidth() -> float:
    n = 1 << 20 if SIMULATED else 1 << 30
    a = cuda.device_array(n, np.uint8)
    b = cuda.device_array(n, np.uint8)
    b.copy_to_device(a)
    times = []
    for _ in range(5):
        e0, e1 = cuda.event(), cuda.event()
        e0.record()
        b.copy_to_device(a)
        e1.record()
        e1.synchronize()
        times.append(e0.elapsed_time(e1) * 1e-3)
    return 2 * n / np.median(times) / 1e9


def dequant(raw: np.ndarray, qt: int) -> np.ndarray:
    return Q.dequantize(raw, qt).astype(np.float64)


def activation(qt: int, x: np.ndarray):
    """-> (the device activations for weights of type qt, their values as float64 [R, K]: x, or
    its q8_1 quantization for quantized weights, so that err measures the kernel alone)."""
    d = cuda.to_device(x)
    if qt in FLOATS:
        return d, x.astype(np.float64)
    qs, ds = quantize_q8_1(d)
    q = qs.copy_to_host().astype(np.float64)
    scale = ds.copy_to_host()[..., 0].astype(np.float64)
    return Q8(qs, ds), (q.reshape(q.shape[0], -1, 32) * scale[..., None]).reshape(q.shape)


def rel_err(got: np.ndarray, want: np.ndarray) -> float:
    if not np.all(np.isfinite(got)):
        return float("nan")
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


def bench_dense(qt: int, n: int, k: int, t: int, rng, tuning=mmvq.DEFAULT) -> dict:
    raw = random_rows(qt, (n,), k, rng)
    packed = repack(raw, qt)
    copies = max(1, min(32, -(-ROTATE_BYTES // packed.nbytes)))
    ws = [cuda.to_device(packed) for _ in range(copies)]
    x = rng.standard_normal((t, k), dtype=np.float32)
    act, xv = activation(qt, x)
    out = cuda.to_device(np.full((t, n), np.nan, np.float32))
    mmvq.mul_mat_vec(ws[0], qt, k, act, out=out, tuning=tuning)
    err = rel_err(out.copy_to_host(), xv @ dequant(raw, qt).T)
    dev_us, host_us = timed(lambda i: mmvq.mul_mat_vec(ws[i % copies], qt, k, act, out=out,
                                                        tuning=tuning))
    return dict(kind="dense", type=Q.type_name(qt), n=n, k=k, tokens=t, err=err, us=dev_us,
                host_us=host_us, gbs=packed.nbytes / dev_us / 1e3, tuning=list(tuning))


class ExpertLayer:
    """One MoE layer's stacks on the device: gate/up [E, F, stride(D)], down [E, D, stride(F)]."""

    def __init__(self, qt: int, d: int, f: int, e: int, rng):
        self.qt, self.d, self.f, self.e = qt, d, f, e
        self.raw = {"gate": random_rows(qt, (e, f), d, rng), "up": random_rows(qt, (e, f), d, rng),
                    "down": random_rows(qt, (e, d), f, rng)}
        self.dev = {p: cuda.to_device(repack(r, qt)) for p, r in self.raw.items()}
        self.slot_of = cuda.to_device(np.arange(e, dtype=np.int32))

    def slice_bytes(self, p: str) -> int:
        return self.dev[p].nbytes // self.e


def bench_experts(layer: ExpertLayer, proj: str, t: int, a: int, rng, tuning=mmvq.DEFAULT,
                  grouped: bool = False):
    """grouped: the launch over pairs grouped by expert (tuning.group_cols a block); the
    grouping kernel's own time is reported apart (group_us)."""
    qt, d, f = layer.qt, layer.d, layer.f
    id_sets = [np.stack([rng.choice(layer.e, a, replace=False) for _ in range(t)]).astype(np.int32)
               for _ in range(32)]
    ids = [cuda.to_device(s) for s in id_sets]
    groups = [grouping.group_by_expert(i, layer.e) if grouped else None for i in ids]
    k = f if proj == "down" else d
    rows = t * a if proj == "down" else t
    act, x = activation(qt, rng.standard_normal((rows, k), dtype=np.float32))
    n = d if proj == "down" else f
    out = cuda.to_device(np.full((t, a, n), np.nan, np.float32))
    per_pair = proj == "down"

    def launch(i):
        if proj == "glu":
            mmvq.mul_mat_vec_glu_ids(layer.dev["gate"], layer.dev["up"], qt, k, act,
                                     ids[i % 32], layer.slot_of, out=out, tuning=tuning,
                                     groups=groups[i % 32])
        else:
            mmvq.mul_mat_vec_ids(layer.dev[proj], qt, k, act, ids[i % 32], layer.slot_of,
                                 out=out, act_per_pair=per_pair, tuning=tuning,
                                 groups=groups[i % 32])

    launch(0)
    got = out.copy_to_host()
    s = id_sets[0]
    if proj == "glu":
        g = np.stack([x[ti] @ dequant(layer.raw["gate"][s[ti, ai]], qt).T
                      for ti in range(t) for ai in range(a)])
        u = np.stack([x[ti] @ dequant(layer.raw["up"][s[ti, ai]], qt).T
                      for ti in range(t) for ai in range(a)])
        want = (g * 0.5 * (1 + np.tanh(g / 2)) * u).reshape(t, a, n)  # silu(g) u, no overflow
    else:
        want = np.stack([x[ti * a + ai if per_pair else ti]
                         @ dequant(layer.raw[proj][s[ti, ai]], qt).T
                         for ti in range(t) for ai in range(a)]).reshape(t, a, n)
    err = rel_err(got, want)
    dev_us, host_us = timed(launch)
    raw_us = None
    if proj == "gate" and t == 1 and tuning == mmvq.DEFAULT:  # the numba dispatcher alone
        kern, grid, block, args = mmvq.mul_mat_vec_ids(
            layer.dev[proj], qt, k, act, ids[0], layer.slot_of, out=out, prepare_only=True)
        raw_us = timed(lambda i: kern[grid, block](*args), n=30)[1]
    distinct = np.mean([len(np.unique(z)) for z in id_sets])
    nbytes = distinct * layer.slice_bytes("gate" if proj == "glu" else proj) * (
        2 if proj == "glu" else 1)
    group_us = None
    if grouped:
        group_us = timed(lambda i: grouping.group_by_expert(ids[i % 32], layer.e, out=groups[i % 32]),
                         n=20)[0]
    return dict(kind=f"experts/{proj}" + ("/grouped" if grouped else ""), type=Q.type_name(qt),
                n=n, k=k, tokens=t, experts=a, err=err, us=dev_us, host_us=host_us,
                gbs=nbytes / dev_us / 1e3, tuning=list(tuning), raw_host_us=raw_us,
                group_us=group_us, distinct=float(distinct))


def bench_mmq_dense(qt: int, n: int, k: int, t: int, rng) -> dict:
    raw = random_rows(qt, (n,), k, rng)
    w = cuda.to_device(repack(raw, qt))
    act, x = activation(qt, rng.standard_normal((t, k), dtype=np.float32))
    out = cuda.to_device(np.full((t, n), np.nan, np.float32))
    mmq.mul_mat_q(w, qt, k, act, out=out)
    got = out.copy_to_host()
    err = rel_err(got[:8], x[:8] @ dequant(raw, qt).T) if np.isfinite(got).all() else np.nan
    dev_us, host_us = timed(lambda i: mmq.mul_mat_q(w, qt, k, act, out=out), n=20)
    return dict(kind="mmq/dense", type=Q.type_name(qt), n=n, k=k, tokens=t, err=err, us=dev_us,
                host_us=host_us, tops=2 * t * n * k / dev_us / 1e6)


def bench_mmq_experts(layer: ExpertLayer, t: int, a: int, rng) -> dict:
    qt, d, f = layer.qt, layer.d, layer.f
    s = np.stack([rng.choice(layer.e, a, replace=False) for _ in range(t)]).astype(np.int32)
    ids = cuda.to_device(s)
    act, x = activation(qt, rng.standard_normal((t, d), dtype=np.float32))
    out = cuda.to_device(np.full((t, a, f), np.nan, np.float32))
    groups = grouping.group_by_expert(ids, layer.e)
    mmq.mul_mat_q_ids(layer.dev["gate"], qt, d, act, ids, layer.slot_of, groups, out=out)
    got = out.copy_to_host()
    want = np.stack([x[ti] @ dequant(layer.raw["gate"][s[ti, ai]], qt).T
                     for ti in range(4) for ai in range(a)]).reshape(4, a, f)
    err = rel_err(got[:4], want) if np.isfinite(got).all() else np.nan
    g_us, _ = timed(lambda i: grouping.group_by_expert(ids, layer.e, out=groups), n=20)
    dev_us, host_us = timed(lambda i: mmq.mul_mat_q_ids(layer.dev["gate"], qt, d, act, ids,
                                                        layer.slot_of, groups, out=out), n=20)
    return dict(kind="mmq/experts/gate", type=Q.type_name(qt), n=f, k=d, tokens=t, experts=a,
                err=err, us=dev_us, host_us=host_us, group_us=g_us,
                tops=2 * t * a * f * d / dev_us / 1e6)


MMQ_VARIANTS = {  # name: mmq settings (USE_MMA, pairs an expert below which tiles are narrow)
    "mma": (True, None), "mma-wide": (True, 0), "mma-narrow": (True, 10**9), "dp4a": (False, None)}


def with_mmq(variant: str, fn, *a):
    """fn(*a) with mmq set to `variant` (MMQ_VARIANTS, or "WM,WN,TM,TN": every tensor-core launch
    in that tile shape), its result tagged with it."""
    saved = mmq.USE_MMA, mmq._NARROW_BELOW, mmq.MMA_WIDE, mmq.MMA_NARROW
    if variant in MMQ_VARIANTS:
        use, below = MMQ_VARIANTS[variant]
        mmq.USE_MMA = use
        if below is not None:
            mmq._NARROW_BELOW = below
    else:
        mmq.USE_MMA = True
        mmq.MMA_WIDE = mmq.MMA_NARROW = mmq.Shape(*(int(v) for v in variant.split(",")))
    try:
        return dict(fn(*a), variant=variant)
    finally:
        mmq.USE_MMA, mmq._NARROW_BELOW, mmq.MMA_WIDE, mmq.MMA_NARROW = saved


def fmt(r: dict) -> str:
    extra = f"{r['gbs']:8.0f} GB/s" if "gbs" in r else f"{r['tops']:7.2f} TOPS"
    if r.get("group_us") is not None:
        extra += f"  (grouping {r['group_us']:.1f} µs)"
    if r.get("distinct") is not None and r["tokens"] > 1:
        extra += f"  ({r['distinct']:.0f} distinct)"
    if r.get("raw_host_us"):
        extra += f"  (dispatcher alone: host {r['raw_host_us']:.1f} µs)"
    tun = f"  {tuple(r['tuning'])}" if r.get("tuning") and r["tuning"] != list(mmvq.DEFAULT) else ""
    tun += f"  [{r['variant']}]" if "variant" in r else ""
    return (f"{r['kind']:18s} {r['type']:6s} N={r['n']:5d} K={r['k']:5d} T={r['tokens']:4d}"
            f"{' A=' + str(r['experts']) if 'experts' in r else '    '}  {r['us']:8.1f} µs/launch"
            f"  host {r['host_us']:5.1f} µs  {extra}  err {r['err']:.1e}{tun}")


# columns a block and launch bounds (min_blocks 0: none) for the grouped experts' GEMV
GROUP_TUNINGS = [Tuning(group_cols=c, min_blocks=mb, unroll=u)
                 for c, mb, u in ((2, 0, 1), (2, 0, 2), (2, 0, 4), (2, 1, 2), (2, 4, 2), (2, 4, 1), (4, 1, 2),
                                  (4, 4, 2), (4, 0, 2), (4, 8, 2), (4, 4, 1))]
PAIR_UNROLLS = (1, 2, 4)  # a block a pair: the chunks a lane has in flight


# (model, expert type, D, F, E, A; dense type, q/k/v rows, o's K)
DECODE_MODELS = [("qwen3-30b-a3b", Q.Q8_0, 2048, 768, 128, 8, Q.Q8_0, 5120, 4096),
                 ("qwen3-30b-a3b", Q.Q4_K, 2048, 768, 128, 8, None, 0, 0),
                 ("gpt-oss-20b", Q.MXFP4, 2880, 2880, 32, 4, Q.Q8_0, 5120, 4096)]


def decode_shapes(run, rng, smoke: bool) -> None:
    """Each one-token GEMV of a decode layer under lanes per row x unroll; the best per shape."""
    models = [("smoke", Q.Q8_0, 256, 256, 2, 1, Q.Q8_0, 64, 256)] if smoke else DECODE_MODELS
    for model, qt, d, f, e, a, dqt, qkv_rows, o_k in models:
        layer = ExpertLayer(qt, d, f, e, rng)
        cases = [("experts gate+up", lambda tun: run(bench_experts, layer, "glu", 1, a, rng, tun), d),
                 ("experts down", lambda tun: run(bench_experts, layer, "down", 1, a, rng, tun), f)]
        if dqt is not None:
            cases += [("q/k/v", lambda tun: run(bench_dense, dqt, qkv_rows, d, 1, rng, tun), d),
                      ("o", lambda tun: run(bench_dense, dqt, d, o_k, 1, rng, tun), o_k)]
        for name, bench, k in cases:
            base = mmvq.choose_lpr(k)
            got = []
            for lpr in (base,) if smoke else (base, min(32, 2 * base)):
                for unroll in (1, 2, 4):
                    r = bench(Tuning(lpr=lpr, unroll=unroll))
                    if r is not None:
                        got.append((r["us"], lpr, unroll))
            if got:
                us, lpr, unroll = min(got)
                print(f"== {model} {Q.type_name(qt if name.startswith('experts') else dqt)} {name}: best "
                      f"{us:.2f} us at lpr {lpr}, unroll {unroll}", flush=True)
        del layer


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="Q8_0 and Q4_K only")
    ap.add_argument("--json", type=Path, help="also write the results here")
    ap.add_argument("--budget", type=float, default=0,
                    help="seconds: skip the sections not started by then (0: no limit)")
    ap.add_argument("--smoke", action="store_true",
                    help="tiny shapes, to check the script (e.g. under NUMBA_ENABLE_CUDASIM=1)")
    ap.add_argument("--table", action="store_true",
                    help="only the per-type table: one expert's matrix and a layer's routed "
                         "experts at 1, 4 and 16 tokens, for " + ", ".join(Q.type_name(t) for t in TABLE))
    ap.add_argument("--mmq", action="store_true",
                    help="only the tiled prefill kernels: tensor cores against dp4a, dense and experts")
    ap.add_argument("--mma-shapes", default="",
                    help="with --mmq, only these tensor-core tile shapes, 'WM,WN,TM,TN;...', on the prefill's "
                         "shapes (dense 4096 and 512 rows, the experts' gate) at 512 tokens")
    ap.add_argument("--bounds", action="store_true",
                    help="only the multi-column dense GEMV at 2-16 tokens under each launch bound "
                         "(Tuning.min_blocks 0, 1, 3), Q8_0, Q4_K, Q6_K, F16, 4096 x 2048")
    ap.add_argument("--grouped", action="store_true",
                    help="only the experts' GEMV at 2-16 tokens, a block a pair against pairs grouped by "
                         "expert (group_cols 2-16), qwen3-30b-a3b's layer (Q8_0, Q4_K) and gpt-oss-20b's (MXFP4)")
    ap.add_argument("--types", default="", help="--grouped: only these expert types (Q8_0,Q4_K,MXFP4)")
    ap.add_argument("--decode", action="store_true",
                    help="only a one-token decode step's GEMVs (qwen3-30b-a3b, gpt-oss-20b) under each "
                         "lanes-per-row and unroll")
    ap.add_argument("--shape", default="2048,768,128,8",
                    help="D,F,E,A of the expert layer (default Qwen3-30B-A3B; gpt-oss-20b is 2880,2880,32,4)")
    args = ap.parse_args()
    if not SIMULATED:
        dev = cuda.get_current_device()
        name = dev.name.decode() if isinstance(dev.name, bytes) else dev.name
        print(f"device: {name}, cc {dev.compute_capability}", flush=True)
    rng = np.random.default_rng(0)
    results: list[dict] = []
    copy = copy_bandwidth()
    read = read_bandwidth()
    print(f"device copy: {copy:.0f} GB/s (read + write); 128-bit read kernel: {read:.0f} GB/s",
          flush=True)

    def run(fn, *a, **kw):
        t0 = time.perf_counter()
        try:
            r = fn(*a, **kw)
        except Exception as e:  # keep measuring the rest; the failure is printed
            print(f"FAILED {fn.__name__} {Q.type_name(getattr(a[0], 'qt', a[0]))} "
                  f"{a[1:3]}: {type(e).__name__}: {e}", flush=True)
            return None
        r["first_call_s"] = round(time.perf_counter() - t0, 2)
        r["of_copy"] = r["gbs"] / copy if "gbs" in r else None
        r["of_read"] = r["gbs"] / read if "gbs" in r else None
        results.append(r)
        if args.json:  # after every result: a killed run keeps what it measured
            args.json.write_text(json.dumps(dict(copy_gbs=copy, read_gbs=read, results=results),
                                            indent=1))
        print(fmt(r) + (f"  {100 * r['of_copy']:.0f}% of copy, {100 * r['of_read']:.0f}% of read"
                        if r["of_copy"] else ""), flush=True)
        return r

    main_types = [Q.Q8_0] if args.smoke else [Q.Q8_0, Q.Q4_K] if args.quick else MAIN
    other_types = [] if args.quick or args.smoke else OTHER + FLOATS
    # smoke: the smallest shapes the types allow (the simulator runs threads in Python)
    d, f, e, a = (256, 256, 2, 1) if args.smoke else tuple(int(v) for v in args.shape.split(","))
    counts = [1] if args.smoke else [1, 4, 16]
    if args.table:
        for qt in main_types if args.smoke else TABLE:
            layer = ExpertLayer(qt, d, f, e, rng)
            for t in counts:
                run(bench_dense, qt, f, d, t, rng)  # one expert's gate matrix [F, D]
                run(bench_experts, layer, "glu", t, a, rng)  # gate + up of every routed pair
                run(bench_experts, layer, "down", t, a, rng)
            del layer
        return 0
    if args.decode:
        decode_shapes(run, rng, args.smoke)
        return 0
    if args.grouped:
        shapes = [(Q.Q8_0, (d, f, e, a))] if args.smoke else [
            (Q.Q8_0, (2048, 768, 128, 8)), (Q.Q4_K, (2048, 768, 128, 8)), (Q.MXFP4, (2880, 2880, 32, 4))]
        if args.types:
            shapes = [(qt, shape) for qt, shape in shapes if Q.type_name(qt) in args.types.split(",")]
        for qt, (gd, gf, ge, ga) in shapes:
            layer = ExpertLayer(qt, gd, gf, ge, rng)
            for t in [2] if args.smoke else [1, 16]:
                for proj in ("glu", "down"):
                    run(bench_experts, layer, proj, t, ga, rng)
                    for u in () if args.smoke else PAIR_UNROLLS:
                        run(bench_experts, layer, proj, t, ga, rng, Tuning(unroll=u))
                    for tun in [Tuning(group_cols=2)] if args.smoke or t == 1 else GROUP_TUNINGS:
                        run(bench_experts, layer, proj, t, ga, rng, tun, True)
            del layer
        if not SIMULATED:  # registers a thread of each expert kernel built (the launch bounds' effect)
            for key, kern in mmvq._KERNELS.items():
                if key[4]:
                    print(f"{kern.__name__} min_blocks={key[9]} unroll={key[7]}: "
                          f"{sorted(set(kern.get_regs_per_thread().values()))} registers", flush=True)
        return 0
    if args.bounds:
        for qt in main_types[:1] if args.smoke else [Q.Q8_0, Q.Q4_K, Q.Q6_K, Q.F16]:
            for t in [2] if args.smoke else [2, 4, 8, 16]:
                for mb in (0, 1, 3):
                    run(bench_dense, qt, 256 if args.smoke else 4096, d, t, rng,
                        tuning=Tuning(min_blocks=mb))
        return 0
    dn = 256 if args.smoke else 4096
    pt = 4 if args.smoke else 512
    if args.mmq and args.mma_shapes:
        for qt in main_types if args.smoke else [Q.Q8_0, Q.MXFP4]:
            layer = ExpertLayer(qt, d, f, e, rng)
            for v in args.mma_shapes.split(";"):
                run(with_mmq, v, bench_mmq_experts, layer, pt, a, rng)
                for rows in (dn, dn // 8):
                    run(with_mmq, v, bench_mmq_dense, qt, rows, d, pt, rng)
            del layer
        return 0
    if args.mmq:
        for qt in main_types if args.smoke else [Q.Q8_0, Q.Q4_K, Q.Q6_K, Q.MXFP4]:
            layer = ExpertLayer(qt, d, f, e, rng)
            for t in [pt] if args.smoke else [512, 4096]:
                for v in ("mma", "mma-wide", "mma-narrow", "dp4a"):
                    run(with_mmq, v, bench_mmq_experts, layer, t, a, rng)
                for v in ("mma", "dp4a"):
                    run(with_mmq, v, bench_mmq_dense, qt, dn, dn, t, rng)
            del layer
        return 0
    start = time.perf_counter()

    def over_budget(section: str) -> bool:
        if args.budget and time.perf_counter() - start > args.budget:
            print(f"(time budget spent: skipped {section})", flush=True)
            return True
        return False

    # the kernels that decode needs, for the main types, first
    for qt in main_types:
        if over_budget(f"{Q.type_name(qt)} experts"):
            break
        layer = ExpertLayer(qt, d, f, e, rng)
        for t in counts:
            run(bench_experts, layer, "gate", t, a, rng)
        run(bench_experts, layer, "glu", 1, a, rng)
        run(bench_experts, layer, "down", 1, a, rng)
        run(bench_mmq_experts, layer, pt, a, rng)
        del layer
    for qt in main_types:
        if over_budget(f"{Q.type_name(qt)} dense"):
            break
        for t in counts:
            run(bench_dense, qt, dn, dn, t, rng)
        run(bench_mmq_dense, qt, dn, dn, pt, rng)
    print("launch shapes (lanes per row, warps, unroll):", flush=True)
    variants = [Tuning(unroll=1), Tuning(warps=8), Tuning(warps=2), Tuning(lpr=16), Tuning(lpr=8)]
    for qt in main_types[:1] if args.smoke else [Q.Q8_0, Q.Q4_K, Q.MXFP4]:
        if over_budget(f"{Q.type_name(qt)} launch shapes"):
            break
        layer = ExpertLayer(qt, d, f, e, rng)
        for tun in variants[:1] if args.smoke else variants:
            run(bench_experts, layer, "gate", 1, a, rng, tuning=tun)
            run(bench_experts, layer, "down", 1, a, rng, tuning=tun)
            run(bench_dense, qt, dn, dn, 1, rng, tuning=tun)
        del layer
    for qt in other_types:
        if over_budget(f"{Q.type_name(qt)}"):
            break
        if qt not in FLOATS:
            layer = ExpertLayer(qt, d, f, e, rng)
            run(bench_experts, layer, "gate", 1, a, rng)
            run(bench_experts, layer, "down", 1, a, rng)
            del layer
        run(bench_dense, qt, dn, dn, 1, rng)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
