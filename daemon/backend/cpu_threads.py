"""How many threads the CPU kernels use for the next step: every core while the machine is idle,
fewer while other processes keep cores busy.

numba's OpenMP pool spin-waits between parallel regions. Beside a busy competitor that is a cliff:
on 2 cores with two CPU-burning processes beside it, a 2-thread decode fell from 114 to 27-30
tok/s, while 1 thread kept 62 (docs/benchmarks.md, "Threads under load"). A passive wait policy
avoids the cliff but halves the idle speed (51-54), and OMP_WAIT_POLICY is fixed when the pool
starts. The thread count is not: numba.set_num_threads applies to the calling thread's next
parallel region. So with MOE_N_THREADS=0 (all cores) the CPU backend asks a ThreadGovernor before
each step; it looks again at most every INTERVAL_S, from /proc/stat (the machine's busy time) less
this process's own CPU time, and uses the cores the others leave idle (at least one). An explicit
MOE_N_THREADS is kept as given.
"""

from __future__ import annotations

import os
import time

INTERVAL_S = 0.25  # how often the load is read again (two small file reads)


def machine_busy_s() -> float | None:
    """CPU seconds the whole machine has spent busy since boot (every core), or None where
    /proc/stat cannot be read."""
    try:
        with open("/proc/stat", "rb") as f:
            fields = f.readline().split()[1:]
    except OSError:
        return None
    ticks = [int(v) for v in fields]
    idle = ticks[3] + (ticks[4] if len(ticks) > 4 else 0)  # idle + iowait
    return (sum(ticks[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def own_cpu_s() -> float:
    t = os.times()
    return t.user + t.system


class ThreadGovernor:
    """threads() -> the thread count for the next step: `most` while the rest of the machine is
    idle, the cores it leaves idle otherwise (1 at least). Readers are injectable for tests."""

    def __init__(self, most: int, cores: int | None = None, interval_s: float = INTERVAL_S,
                 busy=machine_busy_s, own=own_cpu_s, clock=time.monotonic):
        self.most = max(1, most)
        self.cores = cores or len(os.sched_getaffinity(0))
        self.interval_s = interval_s
        self._busy, self._own, self._clock = busy, own, clock
        self._at = None  # (wall, machine busy, own cpu) at the last look
        self._threads = self.most

    def threads(self) -> int:
        now = self._clock()
        if self._at is not None and now - self._at[0] < self.interval_s:
            return self._threads
        busy, own = self._busy(), self._own()
        if busy is None:  # no /proc/stat: as configured
            return self._threads
        if self._at is not None:
            wall = now - self._at[0]
            others = max(0.0, (busy - self._at[1]) - (own - self._at[2])) / wall  # cores busy elsewhere
            self._threads = max(1, min(self.most, int(self.cores - others + 0.5)))
        self._at = (now, busy, own)
        return self._threads
