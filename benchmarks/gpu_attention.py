"""Decode attention alone (the chunk kernel and its combine) at gpt-oss-20b and qwen3-30b-a3b
head shapes, one row and 16 rows over 128, 1024 and 4096 cached cells: device time a call.

    python benchmarks/gpu_attention.py [NAME CELLS ROWS]   (one case, e.g. for ncu: oss 128 1)

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
