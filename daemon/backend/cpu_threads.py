"""How many threads the CPU kernels use for the next step: every core while the machine is idle,
fewer while other processes keep cores busy.

numba's OpenMP pool spin-waits between parallel regions. Beside a busy competitor that is a cliff:
on 2 cores with two CPU-burning processes beside it, a 2-thread decode fell from 114 to 27-30
tok/s, while 1 thread kept 62 (docs/benchmarks.md, "Threads under load"). A passive wait policy
avoids the cliff but halves the idle speed (51-54), and OMP_WAIT_POLICY is fixed when the pool
starts. The thread count is not: numba.set_num_threads applies to the calling thread's next
parallel region. So with MOE_N_THREADS=0 (all cores) the CPU backend asks a ThreadGovernor before
each step; it looks again at most every INTERVAL_S, from /proc/stat (the busy time of the CPUs this
process may run on) less this process's own CPU time, and uses the cores the others leave idle (at
least one). An explicit MOE_N_THREADS is kept as given.
"""

from __future__ import annotations

import os
import time

INTERVAL_S = 0.25  # how often the load is read again (two small file reads)


def machine_busy_s(cpus=None) -> float | None:
    """CPU seconds the machine's CPUs `cpus` (default: those this process may run on) have spent
    busy since boot, or None where /proc/stat cannot be read. Only those CPUs: in a container
    pinned to some cores, the host's load on the others competes with nothing of ours."""
    cpus = os.sched_getaffinity(0) if cpus is None else cpus
    busy = 0
    try:
        with open("/proc/stat", "rb") as f:
            for line in f:
                if not line.startswith(b"cpu"):
                    break
                name, *fields = line.split()
                if name == b"cpu" or int(name[3:]) not in cpus:
                    continue
                ticks = [int(v) for v in fields[:8]]
                busy += sum(ticks) - ticks[3] - (ticks[4] if len(ticks) > 4 else 0)  # less idle, iowait
    except (OSError, ValueError):
        return None
    return busy / os.sysconf("SC_CLK_TCK")


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
