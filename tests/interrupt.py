"""A `moed` subcommand stopped by a signal while its output is half written (test_cli_pack.py,
test_cli_synth.py: the partial file must go on SIGTERM and SIGHUP, as on SIGINT)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def interrupt_mid_write(argv: list[str], started: Callable[[], bool], finished: Callable[[], bool],
                        sig: signal.Signals) -> str:
    """Run `python -m daemon.cli *argv`; once started() (its partial file exists), hold it with
    SIGSTOP, check it has not finished(), send `sig` and let it go on. Asserts that it died of the
    signal's exit status; returns its stderr."""
    proc = subprocess.Popen([sys.executable, "-m", "daemon.cli", *argv], cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 120
        while not started():
            assert proc.poll() is None, proc.stderr.read()
            assert time.monotonic() < deadline, "the partial output never appeared"
            time.sleep(0.001)
        proc.send_signal(signal.SIGSTOP)  # held mid-write: the signal surely finds the partial file
        assert started() and not finished()
        proc.send_signal(sig)
        proc.send_signal(signal.SIGCONT)
        assert proc.wait(60) == 128 + sig
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return proc.stderr.read().decode()
