"""`moed serve` in a subprocess, for the benchmarks that measure through the socket."""

from __future__ import annotations

import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def start_daemon(sock: str, *args: str, timeout: float = 120) -> subprocess.Popen:
    """A daemon serving on `sock` (extra `moed serve` arguments: args), once it answers Health;
    SystemExit if it exits or does not answer within `timeout` seconds (its stderr is dropped)."""
    from ipc import Client, NotRunning

    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))}
    proc = subprocess.Popen([sys.executable, "-m", "daemon.cli", "serve", "--socket", sock, *args],
                            env=env, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + timeout
    while True:
        try:
            with Client(sock) as c:
                c.health()
            return proc
        except NotRunning:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise SystemExit("the daemon did not start") from None
            time.sleep(0.05)
