"""Attention alone at gpt-oss-20b and qwen3-30b-a3b head shapes: device time a call.

    python benchmarks/gpu_attention.py [NAME CELLS ROWS] [--v-loads 8,16,32] [--layers 48]
    python benchmarks/gpu_attention.py --prefill 512,4096

Decode (the default): the fused chunk kernel, one row and 16 rows over 128, 576, 1024 and 4096
cached cells, each call on the next of --layers caches as a decode step's layers are (one cache
stays in L2 and flatters the kernel), at each --v-loads (value words in flight after the softmax). --prefill: a prompt of T rows from position 0 (gpt-oss's sliding-window and
full layers), the chunk kernel's row tiles against the tensor-core flash kernel (flash.py), with
TFLOPS counted over the causal cells (4 H T (T + 1) / 2 Dh flops, fewer for the window) and the
largest difference between their outputs.

Device time as gpu_ops.py takes it: the calls queued behind a spin kernel, timed with events.
The grid covers the next power of two of cells, as a graph-replayed decode step's does.
"""
import argparse
import sys
from pathlib import Path

import numpy as np
from numba import cuda

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from daemon.kernels.cuda import attention as attn  # noqa: E402
from gpu_ops import _time  # noqa: E402

rng = np.random.default_rng(0)


def prefill(lengths):
    from daemon.kernels.cuda import flash

    for name, H, Hk, dh, window, sinks in [("oss", 64, 8, 64, 128, True), ("oss", 64, 8, 64, 0, True),
                                           ("qwen3", 32, 4, 128, 0, False)]:
        for T in lengths:
            nb = -(-T // attn.KV_BLOCK)
            kc = cuda.to_device((rng.standard_normal((nb, 1, Hk, attn.KV_BLOCK, dh)) * 0.5).astype(np.float16))
            vc = cuda.to_device(rng.standard_normal((nb, 1, Hk, attn.KV_BLOCK, dh)).astype(np.float16))
            sk = cuda.to_device(rng.standard_normal(H).astype(np.float32)) if sinks else None
            q = cuda.to_device(rng.standard_normal((T, H, dh)).astype(np.float32))
            ds = cuda.to_device(np.zeros(T, np.int32))
            dp = cuda.to_device(np.arange(T, dtype=np.int32))
            work = attn.AttentionWork(T, H, T, dh)
            tiles = cuda.to_device(flash.tiles_of(np.array([0, T]), flash.rows_per_tile(H, Hk), [True]))
            o_old, o_new = cuda.device_array((T, H, dh), np.float32), cuda.device_array((T, H, dh), np.float32)
            cells = sum(min(p + 1, window) if window else p + 1 for p in range(T))
            flops = 4 * H * dh * cells
            res = {}
            for kind, fn in (("chunk kernel", lambda: attn.attention(q, kc, vc, ds, dp, 0.125, window, sk, o_old,
                                                                     work, T, one_slot=True)),
                             ("flash", lambda: flash.attention_flash(q, kc, vc, ds, dp, tiles, 0.125, window, sk,
                                                                     o_new))):
                _, dev = _time(fn, 20, False)
                res[kind] = dev
            diff = float(np.abs(o_old.copy_to_host() - o_new.copy_to_host()).max())
            print(f"prefill {name} window={window} T={T}: " + ", ".join(
                f"{k} {us:.1f} us ({flops / us / 1e6:.1f} TFLOPS)" for k, us in res.items())
                + f"; {res['chunk kernel'] / res['flash']:.1f}x; max |difference| {diff:.2e}", flush=True)


def decode(only, v_loads, layers):
    shapes = {"oss": (64, 8, 64, 128, True), "qwen3": (32, 4, 128, 0, False)}
    for name, (H, Hk, dh, window, sinks) in shapes.items():
        for cells in (128, 576, 1024, 4096):
            for B in (1, 16):
                if only and (name, str(cells), str(B)) != tuple(only):
                    continue
                C = cells + 64
                nb = -(-C // attn.KV_BLOCK)
                # a cache a layer, as in a decode step: one call's keys and values are not in L2
                # from the call before (48 layers of 576 cells are 113 MB for qwen3)
                kv = rng.standard_normal((2, nb, B, Hk, attn.KV_BLOCK, dh)).astype(np.float16)
                caches = [(cuda.to_device(kv[0]), cuda.to_device(kv[1])) for _ in range(layers)]
                sk = cuda.to_device(rng.standard_normal(H).astype(np.float32)) if sinks else None
                ds = cuda.to_device(np.arange(B, dtype=np.int32))
                dp = cuda.to_device(np.full(B, cells - 1, np.int32))
                q = cuda.to_device(rng.standard_normal((B, H, dh)).astype(np.float32))
                o = cuda.device_array((B, H, dh), np.float32)
                cap = 1 << (cells - 1).bit_length()
                work = attn.AttentionWork(16, H, cap, dh)
                turn = [0]

                def fn():
                    kc, vc = caches[turn[0] % layers]
                    turn[0] += 1
                    attn.attention(q, kc, vc, ds, dp, 0.125, window, sk, o, work, cap)

                figures = []
                for n in v_loads:
                    attn._V_LOADS = n
                    attn._PARTIAL.clear()
                    host, dev = _time(fn, 200, False)
                    figures.append(f"v_loads {n}: {dev:.2f} us")
                print(f"{name} B={B} cells={cells} (grid cap {cap}, {layers} layers' caches): " + ", ".join(figures)
                      + f"; host {host:.1f} us", flush=True)
        del caches


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("case", nargs="*", help="NAME CELLS ROWS: one decode case (e.g. for ncu: oss 128 1)")
    ap.add_argument("--prefill", default=None, help="prompt lengths, e.g. 512,4096: the prefill comparison")
    ap.add_argument("--v-loads", default=str(attn._V_LOADS),
                    help="comma-separated values of attention._V_LOADS to time each decode case at")
    ap.add_argument("--layers", type=int, default=48, help="caches cycled through (1: one cache, kept in L2)")
    args = ap.parse_args()
    if args.prefill:
        prefill([int(n) for n in args.prefill.split(",")])
    else:
        decode(args.case, [int(n) for n in args.v_loads.split(",")], args.layers)
