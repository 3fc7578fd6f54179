"""The text side of the serving loop: Sequence.text (detokenize, stop strings, replies) for every
step, in step order, on a thread of its own beside the compute thread.

    compute thread                           text thread
    put(step, events)  ──────────────────▶   seq.text(event) for each; the replies of the batch
    wait_upto(step)    (before a launch:     handed to the event loop in one call
                        stops seen)

Where nothing runs beside the compute thread (the CPU, whose step is computed in that thread)
`inline` makes put() do the work at once instead: a hand-over would only add its cost.

Batches are tagged with the number of the decode step whose tokens they hold (prefills: the last
step launched), so tags never decrease; wait_upto(n) returns once every batch tagged <= n is done.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable

log = logging.getLogger("moed.scheduler")


class TextThread:
    def __init__(self, name: str, post: Callable[[list], None]):
        self._post = post  # called with [(sequence, replies), ...] once per batch
        self._cv = threading.Condition()
        self._queue: deque[tuple[int, list]] = deque()
        self._busy: int | None = None  # the tag of the batch being worked on
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=f"moed-text:{name}", daemon=True)
        self._thread.start()

    inline = False  # the text work runs in put()'s caller: where no step runs beside it (the CPU)

    def put(self, tag: int, events: list) -> None:
        """events: Sequence.text events (None entries are skipped)."""
        events = [e for e in events if e is not None]
        if not events:
            return
        if self.inline:
            self.wait_upto(tag)  # what was queued before goes out first
            self._work(events)
            return
        with self._cv:
            self._queue.append((tag, events))
            self._cv.notify_all()

    def wait_upto(self, tag: int) -> None:
        """Until every batch tagged <= tag is done."""
        with self._cv:
            while (self._queue and self._queue[0][0] <= tag) or (self._busy is not None and self._busy <= tag):
                self._cv.wait()

    def close(self) -> None:
        """Finish every batch put so far, then end the thread."""
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        if threading.current_thread() is not self._thread:
            self._thread.join()

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._queue and not self._closed:
                    self._cv.wait()
                if not self._queue:
                    return
                tag, events = self._queue.popleft()
                self._busy = tag
            self._work(events)
            with self._cv:
                self._busy = None
                self._cv.notify_all()

    def _work(self, events: list) -> None:
        out = []
        for event in events:
            seq = event[0]
            try:
                replies = seq.text(event)
            except Exception as e:  # noqa: BLE001 - a bug in the text work: this sequence fails
                log.error("request %s: its text failed", seq.id, exc_info=e)
                replies = seq.fail_with(e)
            if replies:
                out.append((seq, replies))
        if out:
            self._post(out)
