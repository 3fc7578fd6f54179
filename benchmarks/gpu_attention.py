"""Attention alone at gpt-oss-20b and qwen3-30b-a3b head shapes: device time a call.

    python benchmarks/gpu_attention.py [NAME CELLS ROWS]   (one case, e.g. for ncu: oss 128 1)
    python benchmarks/gpu_attention.py --prefill [512,4096]

Decode (the default): the chunk kernel and its combine, one row and 16 rows over 128, 1024 and
4096 cached cells. --prefill: a prompt of T rows from position 0 (gpt-oss's sliding-window and
full layers), the chunk kernel's row tiles against the tensor-core flash kernel (flash.py), with
TFLOPS counted over the causal cells (4 H T (T + 1) / 2 Dh flops, fewer for the window) and the
largest difference between their outputs.

Device time as gpu_ops.py takes it: the calls queued behind a spin kernel, timed with events.
The grid covers the next power of two of cells, as a graph-replayed decode step's does.
"""
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


if sys.argv[1:2] == ["--prefill"]:
    prefill([int(n) for n in (sys.argv[2] if len(sys.argv) > 2 else "512,4096").split(",")])
    sys.exit(0)
shapes = {"oss": (64, 8, 64, 128, True), "qwen3": (32, 4, 128, 0, False)}
only = sys.argv[1:]  # name cells B: one case (for ncu)
for name, (H, Hk, dh, window, sinks) in shapes.items():
    for cells in (128, 1024, 4096):
        for B in (1, 16):
            if only and (name, str(cells), str(B)) != tuple(only):
                continue
            C = 4096 + 64
            S = 16
            nb = -(-C // attn.KV_BLOCK)
            kc = cuda.to_device(rng.standard_normal((nb, S, Hk, attn.KV_BLOCK, dh)).astype(np.float16))
            vc = cuda.to_device(rng.standard_normal((nb, S, Hk, attn.KV_BLOCK, dh)).astype(np.float16))
            sk = cuda.to_device(rng.standard_normal(H).astype(np.float32)) if sinks else None
            work = attn.AttentionWork(16, H, C, dh)
            ds = cuda.to_device(np.arange(B, dtype=np.int32))
            dp = cuda.to_device(np.full(B, cells - 1, np.int32))
            q = cuda.to_device(rng.standard_normal((B, H, dh)).astype(np.float32))
            o = cuda.device_array((B, H, dh), np.float32)
            cap = 1 << (cells - 1).bit_length()
            fn = lambda: attn.attention(q, kc, vc, ds, dp, 0.125, window, sk, o, work, cap)
            host, dev = _time(fn, 200, False)
            print(f"{name} B={B} cells={cells} (grid cap {cap}): {dev:.2f} us device, {host:.1f} us host", flush=True)
