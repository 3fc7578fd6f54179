"""Expert kernels reading misses in place from pinned host memory (zero-copy), against copies.

    python benchmarks/gpu_zero_copy.py [--types Q8_0,Q4_K,MXFP4] [--tokens 1,4,16] [--json PATH]

Prints, on the GPU it finds:
  * the ceilings: host-to-device copy from pinned memory (GB/s), a 128-bit read kernel over mapped
    pinned memory (zero-copy, GB/s) and over VRAM;
  * per weight type, one Qwen3-30B-A3B-shaped MoE layer (D 2048, F 768, 128 experts, 8 routed a
    token) at T tokens: the fused gate+up+GLU launch and the down launch, device µs per layer,
      - every expert in VRAM (the resident stack),
      - every expert in the host tier (each routed expert read over PCIe),
      - a quarter of the experts in VRAM slots, the rest in the host tier (uniform routing),
    and the host tier's read rate: distinct routed experts' bytes read from the host / the time.
Each launch routes other experts (16 routings in turn), so few of them are in L2. Launches are
queued behind a sleeping kernel (gpu_matmul.timed), so they run back to back.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from numba import cuda  # noqa: E402

from benchmarks.gpu_matmul import SIMULATED, _read, random_rows, read_bandwidth, timed  # noqa: E402
from daemon.kernels import quants as Q  # noqa: E402
from daemon.kernels.cuda import mmvq  # noqa: E402
from daemon.kernels.cuda.layout import repack  # noqa: E402
from daemon.kernels.cuda.mmvq import Q8  # noqa: E402
from daemon.kernels.cuda.quantize import quantize_q8_1  # noqa: E402

D, F, E, A = (256, 128, 16, 4) if SIMULATED else (2048, 768, 128, 8)
ROUTINGS = 16


def _median_time(fn, n=5) -> float:
    times = []
    for _ in range(n):
        e0, e1 = cuda.event(), cuda.event()
        e0.record()
        fn()
        e1.record()
        e1.synchronize()
        times.append(e0.elapsed_time(e1) * 1e-3)
    return float(np.median(times))


def ceilings() -> dict:
    n = 1 << 20 if SIMULATED else 1 << 30
    pinned = cuda.pinned_array(n, np.uint8)
    pinned[:] = 1
    dev = cuda.device_array(n, np.uint8)
    copy = n / _median_time(lambda: dev.copy_to_device(pinned)) / 1e9
    mapped = cuda.mapped_array(n, np.uint8)
    mapped[:] = 1
    blocks, threads = (1, 32) if SIMULATED else (132 * 16, 256)
    out = cuda.device_array(blocks * threads, np.uint32)
    _read[blocks, threads](mapped, n, out)
    zero_copy = n / _median_time(lambda: _read[blocks, threads](mapped, n, out)) / 1e9
    return {"h2d_copy_gbs": copy, "zero_copy_read_gbs": zero_copy, "vram_read_gbs": read_bandwidth()}


def layer(qt: int, tokens: int, rng) -> dict:
    """Device µs per layer (glu + down) with the experts in VRAM, in the host tier, or split."""
    gate, up = (repack(random_rows(qt, (E, F), D, rng), qt) for _ in range(2))
    down = repack(random_rows(qt, (E, D), F, rng), qt)
    stacks = {"gate": gate, "up": up, "down": down}
    vram = {p: cuda.to_device(s) for p, s in stacks.items()}
    host = {}
    for p, s in stacks.items():
        host[p] = cuda.mapped_array(s.shape, np.uint8)
        host[p][...] = s
    quarter = rng.permutation(E)[:E // 4]
    slots = {p: cuda.to_device(s[quarter]) for p, s in stacks.items()}
    maps = {
        "vram": np.arange(E, dtype=np.int32),
        "host": -2 - np.arange(E, dtype=np.int32),
        "quarter": -2 - np.arange(E, dtype=np.int32),
    }
    maps["quarter"][quarter] = np.arange(len(quarter), dtype=np.int32)
    routings = [np.stack([rng.choice(E, A, replace=False) for _ in range(tokens)]).astype(np.int32)
                for _ in range(ROUTINGS)]
    ids = [cuda.to_device(r) for r in routings]
    x = rng.standard_normal((tokens, D)).astype(np.float32)
    qs, ds = quantize_q8_1(cuda.to_device(x))
    act = Q8(qs, ds)
    h = cuda.to_device(rng.standard_normal((tokens * A, F)).astype(np.float32))
    hq = Q8(*quantize_q8_1(h))
    g_out = cuda.device_array((tokens, A, F), np.float32)
    d_out = cuda.device_array((tokens, A, D), np.float32)
    res = {}
    for name, where in (("vram", vram), ("host", None), ("quarter", slots)):
        slot_of = cuda.to_device(maps[name])
        w = where or vram  # all-host: the VRAM stack is never read (every slot_of is a host row)
        hk = {} if name == "vram" else {"host_gate": host["gate"], "host_up": host["up"]}
        dk = {} if name == "vram" else {"w_host": host["down"]}

        def run(i, w=w, slot_of=slot_of, hk=hk, dk=dk):
            r = ids[i % ROUTINGS]
            mmvq.mul_mat_vec_glu_ids(w["gate"], w["up"], qt, D, act, r, slot_of, out=g_out, **hk)
            mmvq.mul_mat_vec_ids(w["down"], qt, F, hq, r, slot_of, out=d_out, act_per_pair=True, **dk)

        us, _ = timed(run)
        res[name] = us
    per_expert = sum(int(s[0].nbytes) for s in stacks.values())
    distinct = np.mean([len(np.unique(r)) for r in routings])
    host_share = np.mean([np.isin(np.unique(r), quarter, invert=True).mean() for r in routings])
    res["distinct_experts"] = float(distinct)
    res["host_read_gbs"] = distinct * per_expert / (res["host"] * 1e-6) / 1e9
    res["quarter_host_bytes"] = float(distinct * host_share * per_expert)
    res["vram_read_gbs"] = distinct * per_expert / (res["vram"] * 1e-6) / 1e9
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--types", default="Q8_0,Q4_K,MXFP4")
    ap.add_argument("--tokens", default="1,4,16")
    ap.add_argument("--json")
    args = ap.parse_args()
    names = {Q.type_name(t): t for t in (Q.Q8_0, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.MXFP4, Q.F16)}
    rng = np.random.default_rng(0)
    dev = "simulator" if SIMULATED else cuda.get_current_device().name
    dev = dev.decode() if isinstance(dev, bytes) else dev
    out = {"device": dev, "shape": {"D": D, "F": F, "E": E, "A": A}, "ceilings": ceilings(), "layers": []}
    c = out["ceilings"]
    print(f"{dev}: copy H2D from pinned {c['h2d_copy_gbs']:.1f} GB/s, zero-copy read "
          f"{c['zero_copy_read_gbs']:.1f} GB/s, VRAM read {c['vram_read_gbs']:.0f} GB/s")
    print(f"{'type':6} {'T':>3} {'experts':>7} {'VRAM us':>8} {'host us':>8} {'1/4 VRAM us':>11} "
          f"{'host GB/s':>9} {'VRAM GB/s':>9}")
    for tn in args.types.split(","):
        for t in (int(v) for v in args.tokens.split(",")):
            r = layer(names[tn], t, rng)
            out["layers"].append({"type": tn, "tokens": t, **r})
            print(f"{tn:6} {t:3d} {r['distinct_experts']:7.1f} {r['vram']:8.1f} {r['host']:8.1f} "
                  f"{r['quarter']:11.1f} {r['host_read_gbs']:9.1f} {r['vram_read_gbs']:9.0f}")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
