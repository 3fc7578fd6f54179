"""Host-to-device copy throughput by path (issue 13: which path reaches the pinned peak).

    python benchmarks/gpu_h2d.py [--sizes-mb 1,5,64] [--total-mb 2048]

For each size, --total-mb worth of copies queued on one non-blocking stream, timed with events:
- numba copy_to_device from a numba pinned array (cuda.pinned_array);
- numba copy_to_device from pageable numpy memory;
- cuMemcpyHtoDAsync (cuda.bindings) from the same pinned array;
- the same from page-locked memory of cuMemHostAlloc;
plus the host time each call costs. Prints GB/s (10^9 bytes per second).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes-mb", default="1,5,64")
    ap.add_argument("--total-mb", type=int, default=2048)
    args = ap.parse_args()
    from cuda.bindings import driver as drv
    from numba import cuda

    from daemon.backend.cuda_graphs import _check, nonblocking_stream

    stream = nonblocking_stream()
    h = int(stream.handle)
    print(f"{'size MB':>8s} {'path':44s} {'GB/s':>8s} {'host us/call':>13s}")
    for mb in (float(v) for v in args.sizes_mb.split(",")):
        n = int(mb * 1e6)
        reps = max(4, int(args.total_mb * 1e6 // n))
        dev = cuda.device_array(n, np.uint8)
        pinned = cuda.pinned_array(n, np.uint8)
        pinned[:] = np.random.default_rng(0).integers(0, 256, n, dtype=np.uint8)
        pageable = np.array(pinned)
        host_ptr = _check(drv.cuMemHostAlloc(n, 0))
        dptr = int(dev.gpu_data.device_pointer)
        paths = {
            "numba copy_to_device, pinned": lambda: dev.copy_to_device(pinned, stream=stream),
            "numba copy_to_device, pageable": lambda: dev.copy_to_device(pageable, stream=stream),
            "cuMemcpyHtoDAsync, numba pinned array": lambda: _check(
                drv.cuMemcpyHtoDAsync(dptr, pinned.ctypes.data, n, h)),
            "cuMemcpyHtoDAsync, cuMemHostAlloc": lambda: _check(drv.cuMemcpyHtoDAsync(dptr, host_ptr, n, h)),
        }
        for name, fn in paths.items():
            fn()
            stream.synchronize()
            start, end = cuda.event(), cuda.event()
            t0 = time.perf_counter()
            start.record(stream)
            for _ in range(reps):
                fn()
            end.record(stream)
            host_us = (time.perf_counter() - t0) / reps * 1e6
            end.synchronize()
            ms = cuda.event_elapsed_time(start, end)
            print(f"{mb:8.1f} {name:44s} {n * reps / ms / 1e6:8.1f} {host_us:13.1f}", flush=True)
        _check(drv.cuMemFreeHost(host_ptr))


if __name__ == "__main__":
    main()
