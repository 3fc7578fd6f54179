"""Loading a model onto the GPU (issue 26 item 4: the 32 GB Q8_0 file in VRAM in 10 s or less from
the page cache, kernels from the disk cache).

    python benchmarks/gpu_load.py MODEL [--loads 2] [--processes 2] [--old] [--json PATH]
                                        [--chunk-mb 64] [--buffers 6] [--readers 4] [--staging 2]
                                        [--read-gb 8]

Rows of the table, in the order they run:
- load 1..N: Engine.load(MODEL, device="cuda") in this process, closed after each. The first is the
  first load of the process (its kernels compile or come from numba's disk cache; the page cache is
  as the machine has it); later ones are the "second load in a lease". Columns: seconds in total
  and per Engine.load phase (read header / experts / model = the other weights / tokenizer), the
  expert bytes and rate, and the Uploader's split: seconds the loading thread waited for the
  readers, and for a buffer's copy.
- process 1..N (--processes): the same load in a fresh `python gpu_load.py --child` each.
- old load (--old): a load through the old path (each tensor read whole, repacked by numpy,
  copied from pageable memory), for comparison in the same lease.
- read xT: --read-gb of the expert tensors read into page-locked buffers by T threads (no GPU).
- h2d: a --chunk-mb page-locked buffer copied with cuMemcpyHtoDAsync, timed by events.
- repack: the device repack of --chunk-mb of the file's largest expert tensor, timed by events.
GB = 10^9 bytes.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

PHASES = ("header", "experts", "model", "tokenizer")


def configure(args) -> None:
    from daemon.backend import cuda_upload

    cuda_upload.CHUNK = args.chunk_mb << 20
    cuda_upload.BUFFERS = args.buffers
    cuda_upload.READERS = args.readers
    cuda_upload.STAGING = args.staging


def one_load(model: str, label: str) -> dict:
    """Engine.load onto the GPU, timed by its progress messages; closed afterwards."""
    from daemon.backend import cuda_upload
    from daemon.engine import Engine

    cuda_upload.last_timing = None
    marks: list[float] = []
    t0 = time.perf_counter()
    engine = Engine.load(model, device="cuda", progress=lambda _msg: marks.append(time.perf_counter()))
    t1 = time.perf_counter()
    marks.append(t1)
    row = {"what": label, "total_s": t1 - t0}
    if len(marks) == len(PHASES) + 1:  # reading, uploading experts, building model, building tokenizer
        row.update({f"{p}_s": marks[i + 1] - marks[i] for i, p in enumerate(PHASES)})
    t = cuda_upload.last_timing
    if t is not None:
        row.update(expert_gb=t.bytes / 1e9, expert_gbps=t.bytes / 1e9 / max(t.total, 1e-9),
                   wait_read_s=t.wait_read, wait_copy_s=t.wait_copy, pieces=t.pieces)
    row["vram_gb"] = engine.model.backend.vram_bytes() / 1e9
    engine.close()
    del engine
    gc.collect()
    from numba import cuda

    pending = getattr(cuda.current_context(), "deallocations", None)  # none under the simulator
    if pending is not None:
        pending.clear()  # free its VRAM now, not at numba's leisure
    return row


def old_path():
    """Patch the loaders back to the old path: each tensor read whole, numpy repack, pageable copy."""
    from numba import cuda

    from daemon.backend import cuda as cuda_backend
    from daemon.backend import cuda_experts as cx
    from daemon.kernels.cuda.layout import repack
    from daemon.storage.experts import PROJECTIONS, ExpertBatch, expert_biases

    def upload_matrix(raw, qt, stream=None):
        return cuda.to_device(repack(np.ascontiguousarray(raw), qt))

    def from_gguf(cls, gguf, on_upload=None, stream=None, on_bytes=None):
        from daemon.model.weights import TensorSource
        from daemon.storage.store import expert_layouts

        src, layouts, batches = TensorSource(gguf), expert_layouts(gguf), {}
        note = on_upload or (lambda _name, _nbytes: None)
        for il, lay in layouts.items():
            stacks = []
            for p in PROJECTIONS:
                k, n = (lay.n_ff, lay.n_embd) if p == "down" else (lay.n_embd, lay.n_ff)
                raw, qt = src.stacked(f"blk.{il}.ffn_{p}_exps.weight", k, n, lay.n_expert)
                stacks.append(upload_matrix(raw, qt))
                note(p, stacks[-1].nbytes)
            biases = [None if b is None else cuda.to_device(b)
                      for b in expert_biases(src, il, lay.n_embd, lay.n_ff, lay.n_expert)]
            batches[il] = ExpertBatch(*stacks, cx.SlotMap({e: e for e in range(lay.n_expert)}, lay.n_expert), *biases)
        return cls(layouts, batches)

    saved = (cuda_backend.upload_matrix, cx.DeviceExperts.from_gguf)
    cuda_backend.upload_matrix = upload_matrix
    cx.DeviceExperts.from_gguf = classmethod(from_gguf)
    return lambda: (setattr(cuda_backend, "upload_matrix", saved[0]),
                    setattr(cx.DeviceExperts, "from_gguf", saved[1]))


def expert_tensors(model: str):
    from daemon.storage.gguf import GGUFFile
    from daemon.storage.store import expert_layouts

    g = GGUFFile(model)
    names = [f"blk.{il}.ffn_{p}_exps.weight" for il in expert_layouts(g) for p in ("gate", "up", "down")]
    return g, [g.tensor_info(n) for n in names]


def read_rate(model: str, threads: int, chunk: int, limit: int) -> dict:
    """Expert tensor bytes read into page-locked buffers by `threads` threads (one buffer each)."""
    from daemon.backend.cuda_transfer import pinned_empty

    g, infos = expert_tensors(model)
    jobs, total = [], 0
    for ti in infos:
        for at in range(0, ti.nbytes, chunk):
            n = min(chunk, ti.nbytes - at)
            if total + n > limit:
                break
            jobs.append((ti.offset + at, n))
            total += n
    bufs = [pinned_empty(chunk, np.uint8) for _ in range(threads)]

    def work(i):
        for off, n in jobs[i::threads]:
            g.read_into(off, bufs[i][:n], "bench")

    t0 = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(work, range(threads)))
    dt = time.perf_counter() - t0
    g.close()
    return {"what": f"read x{threads}", "total_s": dt, "expert_gb": total / 1e9, "expert_gbps": total / 1e9 / dt}


def h2d_rate(chunk: int, reps: int = 32) -> dict:
    from numba import cuda

    from daemon.backend.cuda_graphs import nonblocking_stream
    from daemon.backend.cuda_transfer import Event, Transfers, pinned_empty

    stream = nonblocking_stream()
    x = Transfers(stream, dedicated=False)
    host = pinned_empty(chunk, np.uint8)
    host[:] = 1
    dev = cuda.device_array(chunk, np.uint8)
    x.h2d(dev, host)
    stream.synchronize()
    a, b = Event(timing=True), Event(timing=True)
    x.record(a, stream)
    for _ in range(reps):
        x.h2d(dev, host)
    x.record(b, stream)
    x.synchronize(b)
    dt = x.elapsed_ms(a, b) / 1e3
    n = reps * chunk
    return {"what": "h2d pinned", "total_s": dt, "expert_gb": n / 1e9, "expert_gbps": n / 1e9 / max(dt, 1e-9)}


def repack_rate(model: str, chunk: int, reps: int = 16) -> dict:
    from numba import cuda

    from daemon.backend.cuda_graphs import nonblocking_stream
    from daemon.backend.cuda_transfer import Event, Transfers
    from daemon.backend.cuda_upload import device_matrix
    from daemon.kernels.cuda.layout import repack_device
    from daemon.kernels.quants import row_bytes

    g, infos = expert_tensors(model)
    ti = max(infos, key=lambda t: t.nbytes)
    g.close()
    rb = row_bytes(ti.ggml_type, ti.ne[0])
    rows = max(1, chunk // rb)
    stream = nonblocking_stream()
    x = Transfers(stream, dedicated=False)
    raw = cuda.to_device(np.random.default_rng(0).integers(0, 256, (rows, rb), dtype=np.uint8))
    out = device_matrix(rows, rb, ti.ggml_type, stream)
    repack_device(raw, out, ti.ggml_type, stream)  # compiles (or loads) the kernel
    stream.synchronize()
    a, b = Event(timing=True), Event(timing=True)
    x.record(a, stream)
    for _ in range(reps):
        repack_device(raw, out, ti.ggml_type, stream)
    x.record(b, stream)
    x.synchronize(b)
    dt = x.elapsed_ms(a, b) / 1e3
    n = reps * rows * rb
    return {"what": f"repack {ti.type_name}", "total_s": dt, "expert_gb": n / 1e9,
            "expert_gbps": n / 1e9 / max(dt, 1e-9)}


COLUMNS = [("what", 14, "s"), ("total_s", 8, ".2f"), ("header_s", 8, ".2f"), ("experts_s", 9, ".2f"),
           ("model_s", 8, ".2f"), ("tokenizer_s", 11, ".2f"), ("expert_gb", 9, ".2f"), ("expert_gbps", 11, ".2f"),
           ("wait_read_s", 11, ".2f"), ("wait_copy_s", 11, ".2f"), ("vram_gb", 7, ".1f")]


def table(rows: list[dict]) -> str:
    lines = [" ".join(f"{c:>{w}s}" for c, w, _ in COLUMNS)]
    for r in rows:
        cells = []
        for c, w, fmt in COLUMNS:
            v = r.get(c)
            cells.append(f"{'-' if v is None else format(v, fmt):>{w}s}")
        lines.append(" ".join(cells))
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--loads", type=int, default=2, help="Engine.load onto the GPU this many times in this process")
    ap.add_argument("--processes", type=int, default=0, help="and once in each of this many fresh processes")
    ap.add_argument("--old", action="store_true", help="and once through the old load path")
    ap.add_argument("--chunk-mb", type=int, default=64)
    ap.add_argument("--buffers", type=int, default=6)
    ap.add_argument("--readers", type=int, default=4)
    ap.add_argument("--staging", type=int, default=2, help="device staging buffers")
    ap.add_argument("--read-gb", type=float, default=8.0, help="bytes the read-rate rows read")
    ap.add_argument("--json", help="write the rows here")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    configure(args)
    if args.child:
        print(json.dumps(one_load(args.model, "process")), flush=True)
        return
    rows = []

    def add(row):
        rows.append(row)
        print(json.dumps(row), flush=True)

    for i in range(args.loads):
        add(one_load(args.model, f"load {i + 1}"))
    for i in range(args.processes):
        cmd = [sys.executable, __file__, args.model, "--child", "--chunk-mb", str(args.chunk_mb),
               "--buffers", str(args.buffers), "--readers", str(args.readers), "--staging", str(args.staging)]
        out = subprocess.run(cmd, capture_output=True, text=True, env=os.environ.copy())
        if out.returncode:
            add({"what": f"process {i + 1}", "error": out.stderr[-2000:]})
            continue
        add({**json.loads(out.stdout.strip().splitlines()[-1]), "what": f"process {i + 1}"})
    if args.old:
        restore = old_path()
        try:
            add(one_load(args.model, "old load"))
        finally:
            restore()
    chunk = args.chunk_mb << 20
    limit = int(args.read_gb * 1e9)
    for threads in sorted({1, args.readers}):
        add(read_rate(args.model, threads, chunk, limit))
    add(h2d_rate(chunk))
    add(repack_rate(args.model, chunk))
    print()
    print(table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
