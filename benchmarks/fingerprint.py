"""What the content fingerprint (daemon/storage/fingerprint.py) costs a load, and a re-check.

Prints, for a GGUF file: its size, the ranges and bytes hashed, and the time of Fingerprint.take
with the file in the page cache (warm) and with its pages dropped first (cold: posix_fadvise
DONTNEED, which drops clean pages), best of --repeat. A load pays one take; a re-check (after a
ctime change) pays one more.

    python benchmarks/fingerprint.py MODEL.gguf [--repeat 5]
    moed synth --like qwen3-30b-a3b --layers 8 /tmp/q.gguf   # a multi-GB file to try it on
"""

from __future__ import annotations

import argparse
import os
import time

from daemon.storage.fingerprint import Fingerprint, sample_ranges
from daemon.storage.gguf import GGUFFile


def drop_cache(fd: int) -> None:
    os.fsync(fd)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    with GGUFFile(args.model) as g:
        ranges = sample_ranges(g.file_size, g.data_offset, g.tensors.values())
        fp = g.identity.fingerprint
        n_exp = sum("_exps." in t for t in g.tensors)
        print(f"{args.model}: {g.file_size / 2**30:.2f} GiB, {len(g.tensors)} tensors ({n_exp} expert), "
              f"header {g.data_offset / 2**20:.2f} MiB")
        print(f"hashed: {len(fp.ranges)} ranges, {sum(n for _, n in fp.ranges) / 2**20:.2f} MiB "
              f"({len(ranges)} before merging)")
    fd = os.open(args.model, os.O_RDONLY)
    try:
        for label, before in (("warm", lambda: None), ("cold", lambda: drop_cache(fd))):
            times = []
            for _ in range(args.repeat):
                before()
                t0 = time.perf_counter()
                Fingerprint.take(fd, ranges)
                times.append(time.perf_counter() - t0)
            print(f"{label}: best {min(times) * 1e3:.2f} ms, median {sorted(times)[len(times) // 2] * 1e3:.2f} ms "
                  f"of {args.repeat}")
    finally:
        os.close(fd)


if __name__ == "__main__":
    main()
