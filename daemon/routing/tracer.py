"""Expert usage tracer: which experts the router really used, counted, named and written out.

`ExpertUsageTracer` hooks `Transformer.trace` (called by the MoE block once per MoE layer per
forward pass with the exact routing, `(layer, ids [T, A])`), chaining any hook already there.

Counting. Every row of `ids` is one token's use of A experts of that layer: each (row, expert) pair
is one activation, counted in `per_expert[layer][expert]`. A layer may route fewer rows than the
pass has tokens (without `all_logits` the last layer runs its FFN on the output row only), so
per-layer totals count what was routed, not T x A. `total_tokens` counts each evaluated token once
per forward pass: the number of rows of the pass's widest MoE call, which is the first MoE layer's
(it sees all T rows unless it is also the model's last layer). A pass begins when the hook sees a
layer index not above the previous one.

Settings (daemon/config.py): MOE_EXPERT_TRACE_STATS -> `stats` (report() prints summary()),
MOE_EXPERT_TRACE_PER_LAYER -> `per_layer` (adds the per-layer breakdown; implies the report),
MOE_EXPERT_TRACE_NAMES -> `names`, MOE_EXPERT_TRACE_OUTPUT -> `output` (write() target).

Names lines (`names=True`), one per activation, written to `log` as the routing happens:

    tok 12 blk.5 expert 3: blk.5.ffn_gate_exps.weight[3] blk.5.ffn_up_exps.weight[3] blk.5.ffn_down_exps.weight[3]

`tok` is the 0-based index of the token among all tokens evaluated since attach; the tensors are
the stacked GGUF tensors the expert is sliced from (as `ResidentExperts` reads them), `[e]` the slice
along the expert dimension. Lines of one row are in the router's top-k order.

JSON (`as_dict()`, `write()`; a `.zst` path is zstandard-compressed), cumulative since creation:

    {"format": "moed-expert-usage/1", "total_tokens": int, "forward_passes": int,
     "activations": int, "moe_layers": [layer indices], "n_expert": int, "n_expert_used": int|null,
     "per_expert": {"<layer>": [count per expert]}, "per_layer": {"<layer>": activations},
     "per_layer_tokens": {"<layer>": rows routed},
     "skew": {"<layer>": {"max_over_mean": f, "entropy": f, "unused": int}},
     "top_experts": [{"layer": L, "expert": e, "count": c}, ...]}

Written at the end, whatever the end: once attached, a tracer with an `output` writes its JSON when
it is closed (`close()`, as `Engine.close` does), when the process exits normally (atexit: still
attached), and when it is garbage-collected (its engine dropped unclosed); each end writes only
counts not yet written, so a close after the exit's write (or the other way round) rewrites
nothing. A failed end write is reported on stderr, not raised. SIGKILL or a crash writes nothing;
since every write is a rename of a complete temp file, the file is never left half-written.
The output path must be nothing yet or a regular file (not a symbolic link): anything else (a
FIFO, a device, a directory) is refused with ConfigError when the tracer is made (a Load's settings)
and again at each write, since a rename would replace it. The file is private (0600).

Skew: max_over_mean is the busiest expert's count over the mean count (1.0 = perfectly even);
entropy is the Shannon entropy of the layer's expert distribution over log(n_expert) (1.0 = even,
0.0 = one expert takes all); unused counts experts never chosen.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import stat
import sys
import tempfile
import threading
import weakref
from collections.abc import Callable
from typing import TextIO

import numpy as np

from ..errors import ConfigError

PROJECTIONS = ("gate", "up", "down")
TOP_N = 10


def tensor_names(layer: int, expert: int) -> list[str]:
    """The stacked GGUF tensors holding the expert's weights, with its slice."""
    return [f"blk.{layer}.ffn_{w}_exps.weight[{expert}]" for w in PROJECTIONS]


class ExpertUsageTracer:
    """Counts (and optionally names) every expert activation seen through `Transformer.trace`.

    tracer = ExpertUsageTracer(stats=True, output="usage.json").attach(model)
    ...generate...; tracer.report(); tracer.close()   # close: write what is new, detach
    """

    def __init__(self, stats: bool = False, names: bool = False, per_layer: bool = False,
                 output: str | os.PathLike = "", log: TextIO | None = None) -> None:
        self.stats, self.names, self.per_layer = bool(stats), bool(names), bool(per_layer)
        self.output = os.fspath(output) if output else ""
        if self.output:
            check_output_path(self.output)  # at load, not only at the end: a bad path fails the Load
        self._log = log
        self.moe_layers: list[int] | None = None  # known once attached to a model
        self.n_expert = 0
        self.n_expert_used: int | None = None
        self.counts: dict[int, np.ndarray] = {}  # layer -> int64 [n_expert]
        self.layer_rows: dict[int, int] = {}  # layer -> rows routed
        self.total_tokens = 0
        self.forward_passes = 0
        self._last_layer = -1
        self._pass_start = 0  # token index of the current pass's first token
        self._pass_rows = 0
        self._lock = threading.Lock()  # the engine may report/write from another thread
        self._write_lock = threading.RLock()  # one writer at a time: the newest snapshot lands last
        self._version = 0  # bumped by every routing call
        self._written: int | None = None  # the version last written to `output` (or tried at an end)
        self._armed = False  # attached with an output, not closed: its end writes
        self._prev: Callable | None = None
        self._model = None

    @classmethod
    def from_settings(cls, settings, log: TextIO | None = None) -> ExpertUsageTracer | None:
        """A tracer configured from `Settings`, or None when every expert_trace_* setting is off."""
        kw = {"stats": settings.expert_trace_stats, "names": settings.expert_trace_names,
              "per_layer": settings.expert_trace_per_layer, "output": settings.expert_trace_output}
        return cls(**kw, log=log) if any(kw.values()) else None

    @property
    def log(self) -> TextIO:
        return self._log if self._log is not None else sys.stderr  # resolved late: stderr may be swapped

    # -- hooking -------------------------------------------------------------------------------

    def attach(self, model) -> ExpertUsageTracer:
        """Set `model.trace` to this tracer, chaining any hook already there."""
        from ..model.transformer import MoE

        self.moe_layers = [il for il, layer in enumerate(model.layers) if isinstance(layer.ffn, MoE)]
        self.n_expert = max(self.n_expert, int(model.hp.n_expert or 0))
        self.n_expert_used = int(model.hp.n_expert_used or 0) or None
        for il in self.moe_layers:  # layers never routed still show in the output, as zeros
            self._grow(il, self.n_expert)
        self._prev = model.trace
        self._model = model
        model.trace = self
        if self.output:
            self._armed = True
            _at_exit.add(self)
        return self

    def detach(self) -> None:
        """Restore the hook that was there before attach."""
        if self._model is not None:
            self._model.trace = self._prev
            self._model = None
            self._prev = None

    def close(self) -> None:
        """The end of use: write what is not written yet (see the module docstring), then detach."""
        self._armed = False
        _at_exit.discard(self)
        self._write_at_end()
        self.detach()

    def __del__(self) -> None:  # dropped unclosed (e.g. its engine was): the end of use too
        if getattr(self, "_armed", False):  # False too when __init__ failed
            self._write_at_end()

    def _write_at_end(self) -> None:
        """write() unless this version was written (or tried) already; errors go to stderr."""
        with self._write_lock:
            version = self._version
            if not self.output or self._written == version:
                return
            try:
                self.write()
            except Exception as e:  # noqa: BLE001 - an exit or a collection has no caller to raise to
                self._written = version  # the same counts are not tried twice
                print(f"moed: could not write the expert usage to {self.output}: {e}", file=sys.stderr)

    def __call__(self, layer: int, ids: np.ndarray) -> None:
        a = np.atleast_2d(np.asarray(ids, dtype=np.int64))
        rows = a.shape[0]
        with self._lock:
            self._version += 1
            if layer <= self._last_layer or self.forward_passes == 0:  # a new forward pass
                self.forward_passes += 1
                self._pass_start = self.total_tokens
                self._pass_rows = 0
            self._last_layer = layer
            if rows > self._pass_rows:
                self.total_tokens += rows - self._pass_rows
                self._pass_rows = rows
            if a.size:
                bc = np.bincount(a.ravel(), minlength=self.n_expert)
                self._grow(layer, bc.size)
                self.counts[layer][:bc.size] += bc
            self.layer_rows[layer] = self.layer_rows.get(layer, 0) + rows
            if self.names and a.size:
                # a layer routing fewer rows ran on the pass's last rows (the output rows)
                first = self._pass_start + self._pass_rows - rows
                self.log.write("".join(
                    f"tok {first + r} blk.{layer} expert {e}: {' '.join(tensor_names(layer, e))}\n"
                    for r in range(rows) for e in a[r].tolist()))
        if self._prev is not None:
            self._prev(layer, ids)

    def reset(self) -> None:
        """Forget the counts so far (the daemon's warm-up pass at load is not the user's)."""
        with self._lock:
            self._version += 1
            for c in self.counts.values():
                c[:] = 0
            self.layer_rows = dict.fromkeys(self.layer_rows, 0)
            self.total_tokens = self.forward_passes = self._pass_rows = self._pass_start = 0
            self._last_layer = -1

    def _grow(self, layer: int, n: int) -> None:
        self.n_expert = max(self.n_expert, n)
        c = self.counts.get(layer)
        if c is None or c.size < self.n_expert:
            new = np.zeros(self.n_expert, np.int64)
            if c is not None:
                new[:c.size] = c
            self.counts[layer] = new
        self.layer_rows.setdefault(layer, 0)

    # -- results -------------------------------------------------------------------------------

    def as_dict(self) -> dict:
        """Everything counted so far, JSON-serialisable (format in the module docstring)."""
        with self._lock:
            counts = {il: np.pad(c, (0, self.n_expert - c.size)) for il, c in sorted(self.counts.items())}
            rows = dict(self.layer_rows)
            tokens, passes = self.total_tokens, self.forward_passes
        layers = sorted(set(self.moe_layers or []) | set(counts))
        top = sorted(((int(c[e]), il, e) for il, c in counts.items() for e in range(c.size) if c[e]),
                     key=lambda t: (-t[0], t[1], t[2]))[:TOP_N]
        return {
            "format": "moed-expert-usage/1",
            "total_tokens": tokens,
            "forward_passes": passes,
            "activations": int(sum(int(c.sum()) for c in counts.values())),
            "moe_layers": layers,
            "n_expert": self.n_expert,
            "n_expert_used": self.n_expert_used,
            "per_expert": {str(il): counts[il].tolist() for il in layers if il in counts},
            "per_layer": {str(il): int(counts[il].sum()) for il in layers if il in counts},
            "per_layer_tokens": {str(il): rows.get(il, 0) for il in layers},
            "skew": {str(il): _skew(counts[il]) for il in layers if il in counts},
            "top_experts": [{"layer": il, "expert": e, "count": n} for n, il, e in top],
        }

    def summary(self) -> str:
        """A human-readable report; per-layer lines when `per_layer`."""
        d = self.as_dict()
        k = f" (top-{d['n_expert_used']})" if d["n_expert_used"] else ""
        out = [(f"expert usage: {d['total_tokens']} tokens in {d['forward_passes']} forward passes, "
                f"{len(d['per_expert'])} MoE layers x {d['n_expert']} experts, "
                f"{d['activations']} activations{k}")]
        if d["top_experts"]:
            out.append("most used: " + ", ".join(
                f"blk.{t['layer']} expert {t['expert']}: {t['count']} "
                f"({100 * t['count'] / max(d['per_layer'][str(t['layer'])], 1):.1f}% of layer)"
                for t in d["top_experts"]))
        if self.per_layer:
            for il, counts in d["per_expert"].items():
                c = np.asarray(counts)
                order = np.argsort(-c, kind="stable")[:5]
                s = d["skew"][il]
                out.append(f"  blk.{il}: {d['per_layer'][il]} activations for {d['per_layer_tokens'][il]} routed tokens; "
                           f"top " + ", ".join(f"e{e} {c[e]}" for e in order if c[e]) +
                           f"; max/mean {s['max_over_mean']:.2f}, entropy {s['entropy']:.3f}, "
                           f"unused {s['unused']}")
                out.append("    counts: " + " ".join(str(v) for v in counts))
        return "\n".join(out)

    def report(self) -> None:
        """Write summary() to the log stream (when stats or per_layer is on)."""
        if self.stats or self.per_layer:
            self.log.write(self.summary() + "\n")
            self.log.flush()

    def write(self, path: str | os.PathLike | None = None) -> str | None:
        """Write as_dict() as JSON to `path` (default: `output`), atomically: a reader sees the old
        file or the new one, never a partial one. `.zst`: zstandard-compressed. Returns the path."""
        path = os.fspath(path) if path else self.output
        if not path:
            return None
        with self._write_lock:
            version = self._version  # read before the snapshot: a later count makes it stale, not lost
            _write_atomically(path, json.dumps(self.as_dict(), indent=1).encode("utf-8"))
            if path == self.output:
                self._written = version
        return path


def check_output_path(path: str) -> None:
    """ConfigError unless `path` may be replaced by a rename: nothing there, or a regular file (not
    a symbolic link). A rename would swap a FIFO, a device (as root:
    /dev/null itself) or a link for our file. Checked when the setting is given and at each write."""
    def refuse(why: str) -> ConfigError:
        return ConfigError(f"MOE_EXPERT_TRACE_OUTPUT: {path} {why}; not writing the expert usage there")

    try:
        st = os.lstat(path)
    except FileNotFoundError:  # a missing directory fails the write, reported at the end
        return
    except OSError as e:
        raise refuse(f"cannot be checked ({e.strerror or e})") from None
    if stat.S_ISLNK(st.st_mode):
        raise refuse("is a symbolic link")
    if not stat.S_ISREG(st.st_mode):
        raise refuse("exists and is not a regular file")


def _write_atomically(path: str, data: bytes) -> None:
    """`data` (zstandard-compressed for a `.zst` path) to `path` via a temp file and a rename. The
    temp file is mkstemp's (same directory, O_EXCL|O_NOFOLLOW, 0600: the counts name the model's
    routing, private like the daemon's log)."""
    if path.endswith(".zst"):
        import zstandard

        data = zstandard.ZstdCompressor(level=10).compress(data)
    check_output_path(path)
    fd, tmp = tempfile.mkstemp(prefix=os.path.basename(path) + ".", suffix=".tmp",
                               dir=os.path.dirname(os.path.abspath(path)))
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            os.fsync(f.fileno())  # the rename must not land before the data (a system crash)
        check_output_path(path)  # again just before the rename: the window is the rename's alone
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


_at_exit: weakref.WeakSet[ExpertUsageTracer] = weakref.WeakSet()  # armed tracers; weak: engines stay collectable


@atexit.register
def _write_at_exit() -> None:
    """A normal exit is the end of use of every tracer still armed."""
    for tracer in list(_at_exit):
        tracer._write_at_end()


def _skew(c: np.ndarray) -> dict:
    n = int(c.sum())
    if n == 0 or c.size == 0:
        return {"max_over_mean": 0.0, "entropy": 0.0, "unused": int(c.size)}
    p = c[c > 0] / n
    ent = float(-(p * np.log(p)).sum() / np.log(c.size)) if c.size > 1 else 0.0
    return {"max_over_mean": round(float(c.max() * c.size / n), 4), "entropy": round(ent, 4),
            "unused": int((c == 0).sum())}
