"""Latency of the non-matmul CUDA kernels (daemon/kernels/cuda/: embed, norm, rope, attention,
router, glu, logits) at the shapes of a decode step and a prefill, launched through the numba
dispatcher as the launchers do today.

    python benchmarks/gpu_ops.py [--quick] [--repeats 200] [--only NAME]

Needs a GPU (under NUMBA_ENABLE_CUDASIM it would time the simulator). Per kernel and shape it prints:
- launch us: host wall time per call of the Python launcher, for `repeats` calls back to back and
  one synchronize at the end (argument checks + numba dispatch + the driver's launch; when the
  kernel is shorter than that, this is what a step pays per launch);
- kernel us: device time per launch with the launch cost hidden: a spin kernel first holds the
  stream busy while `repeats` launches are queued behind it, then CUDA events around the queued
  launches time them back to back on the device (the kernels plus the device's own gap between
  kernels, ~1 us). For rows_to_host, which synchronizes, it is the host time;
- GB/s: bytes the kernel must move over the kernel time, where meaningful (attention: the keys and
  values each row reads, as a one-row block reads them; tiles read fewer).

Shapes: qwen3-30b-a3b (D 2048, H 32, Hkv 4, Dh 128, E 128, A 8, F 768, V 151936) and gpt-oss-20b
attention (H 64, Hkv 8, Dh 64, sinks, window 128); decode at B = 1 and 16 sequences of 1024 cached
cells, prefill of 512 rows; the fused router also at qwen3-next's 512 experts and gpt-oss's 32.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import numpy as np
from numba import cuda

from daemon.kernels import quants as Q
from daemon.kernels.cuda import attention as attn
from daemon.kernels.cuda import glu, logits, norm, rope, router
from daemon.kernels.cuda.device import SIM
from daemon.kernels.cuda.embed import embed
from daemon.kernels.cuda.layout import repack


@cuda.jit
def _spin(n, out):
    """A dependent chain of n float multiply-adds on one thread: holds the stream for ~n * 4 cycles."""
    x = out[0]
    for _ in range(n):
        x = x * np.float32(0.999999) + np.float32(1e-6)
    out[0] = x


_SPIN_OUT = []
_SPIN_NS_PER_ITER = []


def _spin_for(us: float) -> None:
    """Enqueue a spin of about `us` microseconds on the default stream."""
    if not _SPIN_OUT:
        _SPIN_OUT.append(cuda.to_device(np.ones(1, np.float32)))
        n = 1 << 20
        _spin[1, 1](n, _SPIN_OUT[0])  # compile
        start, stop = cuda.event(), cuda.event()
        start.record()
        _spin[1, 1](n, _SPIN_OUT[0])
        stop.record()
        stop.synchronize()
        _SPIN_NS_PER_ITER.append(max(start.elapsed_time(stop) * 1e6 / n, 1e-3))
    _spin[1, 1](int(us * 1e3 / _SPIN_NS_PER_ITER[0]) + 1, _SPIN_OUT[0])


def _time(fn, repeats: int, blocking: bool) -> tuple[float, float]:
    """(host us per launch back to back, device us per launch with the launch cost hidden)."""
    fn()  # compile and warm up
    cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(repeats):
        fn()
    cuda.synchronize()
    host = (time.perf_counter() - t0) / repeats * 1e6
    if blocking:
        return host, host
    n = max(3, min(repeats, int(20000 / host)))  # at most ~20 ms of queuing
    dev = []
    for _ in range(3):
        start, stop = cuda.event(), cuda.event()
        _spin_for(2 * host * n + 1000)  # longer than queuing the launches takes
        start.record()
        for _ in range(n):
            fn()
        stop.record()
        stop.synchronize()
        dev.append(start.elapsed_time(stop) * 1e3 / n)
    return host, statistics.median(dev)


def _dev(rng, shape, scale=1.0, dtype=np.float32):
    return cuda.to_device((rng.standard_normal(shape) * scale).astype(dtype))


QWEN3 = dict(D=2048, H=32, Hkv=4, Dh=128, E=128, A=8, F=768, V=151936, prefill=512, cells=1024, vocab_rows=32000,
             oss=(64, 8, 64, 128))


def cases(quick: bool, dims: dict = QWEN3):
    """(name, shape text, callable, bytes moved or 0). dims: the model shapes (tiny ones let the
    script itself be checked under the simulator)."""
    rng = np.random.default_rng(0)
    D, H, Hkv, Dh, E, A, F, V = (dims[k] for k in ("D", "H", "Hkv", "Dh", "E", "A", "F", "V"))
    prefill, cells, nv = dims["prefill"], dims["cells"], dims["vocab_rows"]
    batches = (1, 16) if quick else (1, 4, 16)
    out = []

    # embedding: Q8_0 and Q4_K tables of 32k rows (the time does not depend on V)
    for qt, name in ((Q.Q8_0, "Q8_0"), (Q.Q4_K, "Q4_K")):
        rb = Q.row_bytes(qt, D)
        raw = cuda.to_device(rng.integers(0, 256, (nv, rb), dtype=np.uint8))
        for T in (1, prefill):
            tok = cuda.to_device(rng.integers(0, nv, T).astype(np.int32))
            x = cuda.device_array((T, D), np.float32)
            out.append((f"embed {name}", f"T={T} D={D}", lambda raw=raw, qt=qt, tok=tok, x=x: embed(raw, qt, tok, x),
                        T * (rb + 4 * D)))

    w = cuda.to_device(np.ones(D, np.float32))
    wh = cuda.to_device(np.ones(Dh, np.float32))
    for T in batches + (prefill,):
        x, dx, h = _dev(rng, (T, D)), _dev(rng, (T, D)), cuda.device_array((T, D), np.float32)
        out.append(("rms_norm", f"T={T} D={D}", lambda x=x, h=h, w=w: norm.rms_norm(x, w, 1e-6, h), 8 * T * D))
        out.append(("add_rms_norm", f"T={T} D={D}", lambda x=x, dx=dx, h=h, w=w: norm.add_rms_norm(x, dx, w, 1e-6, h),
                    16 * T * D))
        q8 = (cuda.device_array((T, D), np.int8), cuda.device_array((T, D // 32, 2), np.float32))
        out.append(("add_rms_norm q8_1", f"T={T} D={D}",
                    lambda x=x, dx=dx, h=h, q8=q8, w=w: norm.add_rms_norm(x, dx, w, 1e-6, h, q8=q8), 18 * T * D))
        q, k = _dev(rng, (T, H, Dh)), _dev(rng, (T, Hkv, Dh))
        out.append(("rms_norm heads", f"T={T} H={H} Dh={Dh}", lambda q=q, wh=wh: norm.rms_norm(q, wh, 1e-6, q), 8 * q.size))
        pos = cuda.to_device(np.arange(cells, cells + T, dtype=np.int32))
        cache = cuda.device_array((T, Dh // 2, 2), np.float32)
        out.append(("rope_cache yarn", f"T={T} P={Dh // 2}",
                    lambda pos=pos, cache=cache: rope.rope_cache(pos, Dh, 1e6, 0.25, 1.0, 1.0, (10.0, 40.0), cache), 0))
        out.append(("apply_rope_qk", f"T={T} H={H}+{Hkv}",
                    lambda q=q, k=k, cache=cache: rope.apply_rope_qk(q, k, cache, True), 8 * (q.size + k.size)))

    # attention: decode rows of B sequences over `cells` cells each; a prefill continuing a prefix
    for label, (Hq, Hk, dh, window, sinks) in {"qwen3": (H, Hkv, Dh, 0, False),
                                                "gpt-oss swa": dims["oss"] + (True,)}.items():
        C = 2 * cells
        S = 16
        nb = C // attn.KV_BLOCK  # the cache's block-major layout [NB, S, Hkv, B, D]
        kc = cuda.to_device(rng.standard_normal((nb, S, Hk, attn.KV_BLOCK, dh)).astype(np.float16))
        vc = cuda.to_device(rng.standard_normal((nb, S, Hk, attn.KV_BLOCK, dh)).astype(np.float16))
        sk = _dev(rng, Hq) if sinks else None
        work = attn.AttentionWork(max(prefill, *batches), Hq, C, dh)
        for B, is_prefill in [(b, False) for b in batches] + [(prefill, True)]:
            if is_prefill:
                rows_label = f"prefill T={B} after {cells // 2}"
                slots = np.zeros(B, np.int32)
                positions = np.arange(cells // 2, cells // 2 + B, dtype=np.int32)
            else:
                rows_label = f"decode B={B} cells={cells}"
                slots = np.arange(B, dtype=np.int32)
                positions = np.full(B, cells - 1, np.int32)
            ds, dp = cuda.to_device(slots), cuda.to_device(positions)
            q = _dev(rng, (B, Hq, dh))
            kn, vn = _dev(rng, (B, Hk, dh)), _dev(rng, (B, Hk, dh))
            o = cuda.device_array((B, Hq, dh), np.float32)
            visible = np.minimum(positions + 1, window if window else 1 << 30)
            kv_bytes = int(visible.sum()) * Hk * dh * 2 * 2
            out.append((f"kv_append {label}", rows_label,
                        lambda kn=kn, vn=vn, ds=ds, dp=dp, kc=kc, vc=vc: attn.kv_append(kn, vn, ds, dp, kc, vc), 0))
            tiles = [(False, None)] if not is_prefill else [(False, None), (True, 2), (True, None)]
            for one_slot, tile_rows in tiles:
                tag = "" if not one_slot else f" tiles of {tile_rows or 'max'}"
                out.append((f"attention {label}{tag}", rows_label,
                            lambda q=q, kc=kc, vc=vc, ds=ds, dp=dp, sk=sk, o=o, work=work, pos=positions,
                            window=window, one_slot=one_slot, tile_rows=tile_rows:
                            attn.attention(q, kc, vc, ds, dp, 0.125, window, sk, o, work, int(pos.max()) + 1,
                                           one_slot=one_slot, tile_rows=tile_rows), kv_bytes))

    for T in batches + (prefill,):
        lg = _dev(rng, (T, E))
        ids = cuda.device_array((T, A), np.int32)
        wts = cuda.device_array((T, A), np.float32)
        out.append(("router softmax+norm", f"T={T} E={E} A={A}",
                    lambda lg=lg, ids=ids, wts=wts: router.route(lg, "softmax", True, 0.0, ids, wts), 0))
        for n_exp, K, used, gating, with_bias in ((128, 2048, 8, "softmax", False), (512, 2048, 10, "softmax", False),
                                                  (32, 2880, 4, "softmax_weight", True)):
            w = cuda.to_device(repack(rng.standard_normal((n_exp, K)).astype(np.float32).view(np.uint8), Q.F32))
            x = _dev(rng, (T, K))
            lgk = cuda.device_array((T, n_exp), np.float32)
            idk = cuda.device_array((T, used), np.int32)
            wtk = cuda.device_array((T, used), np.float32)
            bias = _dev(rng, (n_exp,)) if with_bias else None
            done = cuda.to_device(np.zeros(1, np.int32))
            out.append(("router fused (GEMV + top-k)", f"T={T} K={K} E={n_exp} A={used}",
                        lambda w=w, x=x, bias=bias, gating=gating, lgk=lgk, idk=idk, wtk=wtk, done=done:
                        router.route_fused(w, Q.F32, x, bias, gating, True, 0.0, lgk, idk, wtk, done), 4 * n_exp * K))
        P = T * A
        g, u, hh = _dev(rng, (P, F)), _dev(rng, (P, F)), cuda.device_array((P, F), np.float32)
        out.append(("glu silu", f"P={P} F={F}", lambda g=g, u=u, hh=hh: glu.glu(g, u, hh, "silu"), 12 * P * F))
        gb, ub = _dev(rng, (E, F)), _dev(rng, (E, F))
        flat = cuda.to_device(rng.integers(0, E, P).astype(np.int32))
        out.append(("glu oai+bias", f"P={P} F={F}",
                    lambda g=g, u=u, hh=hh, gb=gb, ub=ub, flat=flat:
                    glu.glu(g, u, hh, "oai", 1.702, 7.0, gate_bias=gb, up_bias=ub, ids=flat), 20 * P * F))
        y = _dev(rng, (P, D))
        mixed = cuda.device_array((T, D), np.float32)
        out.append(("moe_mix", f"T={T} A={A} D={D}", lambda y=y, wts=wts, mixed=mixed: glu.moe_mix(y, wts, mixed),
                    4 * (P * D + T * D)))
        z, ys = _dev(rng, (T, 1)), _dev(rng, (T, D))
        out.append(("sigmoid_gate acc", f"T={T} D={D}",
                    lambda ys=ys, z=z, mixed=mixed: glu.sigmoid_gate(ys, z, mixed, accumulate=True), 12 * T * D))

    lgts = _dev(rng, (16, V))
    pinned = cuda.pinned_array((16, V), np.float32)
    reader = logits.RowReader(16, V)
    for rows in ([15], list(range(16)), [0, 5, 9, 15]):
        buf = pinned[:len(rows)]
        out.append(("logits rows_to_host", f"{len(rows)} of 16 rows, V={V}",
                    lambda rows=rows, buf=buf: logits.rows_to_host(lgts, rows, out=buf), 4 * len(rows) * V))
        out.append(("logits RowReader", f"{len(rows)} of 16 rows, V={V}",
                    lambda rows=rows: reader.read(lgts, rows), 4 * len(rows) * V))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer batch sizes")
    ap.add_argument("--repeats", type=int, default=200)
    ap.add_argument("--only", default="", help="time only the kernels whose name contains this")
    args = ap.parse_args(argv)
    if SIM or not cuda.is_available():
        print("gpu_ops: no GPU (or the simulator is on); nothing timed", file=sys.stderr)
        return 2
    dev = cuda.get_current_device()
    print(f"device: {dev.name.decode() if isinstance(dev.name, bytes) else dev.name}, "
          f"cc {dev.compute_capability}, repeats {args.repeats}")
    rows = []
    for name, shape, fn, nbytes in cases(args.quick):
        if args.only not in name:
            continue
        host, kern = _time(fn, args.repeats, blocking=name.startswith("logits"))
        gbs = f"{nbytes / kern / 1e3:8.1f}" if nbytes and kern > 0 else "       -"
        rows.append((name, shape, host, kern, gbs))
        print(f"{name:36s} {shape:30s} launch {host:8.1f} us   kernel {kern:8.1f} us   GB/s {gbs}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
