"""`moed serve` in a subprocess, for the benchmarks that measure through the socket."""

from __future__ import annotations

import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def start_daemon(sock: str, *args: str, timeout: float = 120) -> subprocess.Popen:
    """A daemon serving on `sock` (extra `moed serve` arguments: args), once it answers Health;
    SystemExit if it exits or does not answer within `timeout` seconds. Its stderr is dropped, or
    appended to the file MOED_BENCH_DAEMON_LOG names (with `-v`: moed's debug records too)."""
    from ipc import Client, NotRunning

    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))}
    log = os.environ.get("MOED_BENCH_DAEMON_LOG")
    err = open(log, "ab") if log else subprocess.DEVNULL  # noqa: SIM115 - the child holds it
    if log:
        args = (*args, "-v")
    proc = subprocess.Popen([sys.executable, "-m", "daemon.cli", "serve", "--socket", sock, *args],
                            env=env, stderr=err)
    if log:
        err.close()
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
