"""Progress of long work as (phase, percent, message) reports, and the one way moed draws them.

    report(phase, percent, message)   percent in 0..100, or None when unknown; a Report is any
                                      such callable (a Renderer, the daemon's Relay, a test's list)
    Renderer(stream)                  draws reports: on a terminal one line redrawn in place (\\r),
                                      a new line per phase; otherwise plain lines (a phase's first
                                      report, every 10 %, its end, each new message of a phase
                                      without a percent)
    Progress(label, total)            counts the steps of one phase and reports them (to a
                                      Renderer on stderr unless given a report); called with a
                                      note it is one step (Engine.load's `progress`), and
                                      `part(fraction, note)` reports how far the running step is
    Relay(loop)                       hands reports from any thread to listeners on the event loop

`moed generate` (in process) and `moed run` (from the daemon's Progress replies) both draw with a
Renderer; the daemon feeds its Relay from the same reports (demo build, model load, kernel compile).
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
import threading
import time
from collections.abc import Callable

Report = Callable[[str, "float | None", str], None]

LABELS = {"download": "downloading", "build": "building demo MoE", "load": "loading", "compile": "compiling"}
COMPILE_NOTICE_S = 1.0  # a warm-up forward slower than this is compiling kernels (a fresh machine)
COMPILING = "compiling kernels, first run only"


class Renderer:
    def __init__(self, stream=None):
        self.stream = stream or sys.stderr
        self.tty = _isatty(self.stream)
        self.phase: str | None = None
        self._t0 = time.monotonic()
        self._open = False  # a terminal line is drawn and not ended
        self._tenth = -1  # the last 10 % step printed (plain lines)
        self._message = ""

    def __call__(self, phase: str, percent: float | None, message: str = "") -> None:
        if phase != self.phase:
            self.close()
            self.phase, self._t0, self._tenth, self._message = phase, time.monotonic(), -1, None
        pct = None if percent is None else max(0, min(100, int(percent)))
        (self._draw if self.tty else self._line)(LABELS.get(phase, phase), pct, message)
        self._message = message
        self.stream.flush()

    def close(self) -> None:
        """End a line left open on a terminal (before other output follows)."""
        if self._open:
            self.stream.write("\n")
            self.stream.flush()
            self._open = False

    def _draw(self, phase: str, pct: int | None, message: str) -> None:
        if pct is None:
            self.stream.write(f"\r{phase} {message[:60]:<60}")
            self._open = True
            return
        bar = "#" * (pct * 30 // 100)
        self.stream.write(f"\r{phase} [{bar:<30}] {pct:3d}% {message[:30]:<30}")
        self._open = pct < 100
        if not self._open:
            self.stream.write(f" {time.monotonic() - self._t0:.1f}s\n")

    def _line(self, phase: str, pct: int | None, message: str) -> None:
        if pct is None:
            if message != self._message:
                self.stream.write(f"{phase}: {message}\n")
            return
        tenth = pct // 10
        if tenth > self._tenth:
            self.stream.write(f"{phase}: {pct}% {message}".rstrip() + "\n")
            self._tenth = tenth


class Progress:
    """The steps of one phase, reported as percent done (to a Renderer on `stream` by default)."""

    def __init__(self, label: str, total: int, stream=None, report: Report | None = None):
        self.label = label
        self.total = max(total, 1)
        self.done = 0
        self._renderer = None if report is not None else Renderer(stream)
        self.report = report or self._renderer
        self.report(label, 0.0, "")

    def advance(self, n: int = 1, note: str = "") -> None:
        self.done = min(self.total, self.done + n)
        self.report(self.label, 100 * self.done / self.total, note)

    def step(self, note: str = "") -> None:
        """One step done (a callback of one argument, as Engine.load's `progress`)."""
        self.advance(1, note)

    __call__ = step

    def part(self, fraction: float, note: str = "") -> None:
        """The step begun last (its `step` call) is `fraction` (0..1) done: reported between
        it and the next, without counting a step (the bytes of Engine.load's expert upload)."""
        f = min(max(float(fraction), 0.0), 1.0)
        self.report(self.label, 100 * min(self.done + f, self.total) / self.total, note)

    def close(self) -> None:
        if self.done < self.total:
            self.done = self.total
            self.report(self.label, 100.0, "")
        if self._renderer is not None:
            self._renderer.close()


class Relay:
    """Reports from any thread, delivered on the event loop to every listener. Never blocks the
    reporting thread: it keeps only the latest report and posts one delivery at a time (a report
    that arrives before its delivery replaces the older one). `latest` is for a late listener."""

    def __init__(self, loop: asyncio.AbstractEventLoop | None = None):
        self.loop = loop or asyncio.get_running_loop()
        self.listeners: set[Report] = set()
        self.latest: tuple[str, float | None, str] | None = None
        self._lock = threading.Lock()
        self._pending: tuple[str, float | None, str] | None = None

    def __call__(self, phase: str, percent: float | None, message: str = "") -> None:
        with self._lock:
            post = self._pending is None
            self._pending = (phase, percent, message)
        if post:
            try:
                self.loop.call_soon_threadsafe(self._deliver)
            except RuntimeError:  # the loop is closed: nobody is listening
                pass

    @contextlib.contextmanager
    def listening(self, listener: Report | None):
        """Deliver to `listener` inside the block (the latest report first)."""
        if listener is None:
            yield
            return
        if self.latest is not None:
            listener(*self.latest)
        self.listeners.add(listener)
        try:
            yield
        finally:
            self.listeners.discard(listener)

    def _deliver(self) -> None:
        with self._lock:
            report, self._pending = self._pending, None
        self.latest = report
        for listener in list(self.listeners):
            listener(*report)


@contextlib.contextmanager
def reported_if_slow(report: Report, phase: str, message: str, after: float = COMPILE_NOTICE_S):
    """Report (phase, None, message) if the block is still running `after` seconds in (from a
    timer thread): numba compiles on first use only, so a fast warm-up says nothing."""
    timer = threading.Timer(after, report, (phase, None, message))
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


def _isatty(stream) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # no isatty, or closed
        return False
