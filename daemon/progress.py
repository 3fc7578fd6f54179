"""A small progress bar for long work, drawn on stderr (only when it is a terminal, else lines)."""

from __future__ import annotations

import sys
import time


class Progress:
    def __init__(self, label: str, total: int, stream=None):
        self.label = label
        self.total = max(total, 1)
        self.done = 0
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self.t0 = time.monotonic()
        self._last_pct = -1
        self._draw()

    def advance(self, n: int = 1, note: str = "") -> None:
        self.done = min(self.total, self.done + n)
        self._draw(note)

    def _draw(self, note: str = "") -> None:
        pct = int(100 * self.done / self.total)
        if self.tty:
            bar = "#" * (pct * 30 // 100)
            self.stream.write(f"\r{self.label} [{bar:<30}] {pct:3d}% {note[:30]:<30}")
            if self.done >= self.total:
                self.stream.write(f" {time.monotonic() - self.t0:.1f}s\n")
        elif pct // 10 != self._last_pct // 10 or self.done >= self.total:
            self.stream.write(f"{self.label}: {pct}% {note}\n")
        self._last_pct = pct
        self.stream.flush()

    def close(self) -> None:
        if self.done < self.total:
            self.done = self.total
            self._draw()
