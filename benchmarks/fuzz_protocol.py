"""Protocol fuzzer: the real daemon (`moed serve` in a subprocess) against valid-but-absurd requests.

    python benchmarks/fuzz_protocol.py [--requests 10000] [--seed 0] [--minutes 30] [--connections 4]
                                       [--window 4] [--deadline 120] [--json OUT] [--log OUT]
    python benchmarks/fuzz_protocol.py --seed S --only I[,J...]   # replay cases alone, on a fresh daemon

The daemon serves a tiny fixture (tests/fixtures/build.py, qwen3moe Q8_0) under two paths, a
relative name and a symlink; a copy stands in for the demo model (XDG_CACHE_HOME points into the
scratch directory), so `model=None` is served fast. It runs with MOE_N_CTX=128 and one thread, so
any max_tokens, however absurd, ends within 128 tokens; most cases ask for 0..16 tokens.

Case I depends only on --seed and I (benchmarks/_fuzz/cases.py draws it). Each is one request of
a type the protocol knows (Hello, Load, Unload, Generate, Chat, Cancel, Ps, Stats, Health) with
field values drawn from the absurd
(huge, negative, zero, NaN and inf numbers; empty, enormous, NUL-laden and template-like strings;
long lists; unknown, daemon-only and out-of-range settings; model names that are empty, "/", a
directory, a FIFO, /dev/zero, a non-GGUF file, a truncated GGUF, missing, NUL-laden, too long), or
a connection-level scene on a connection of its own: undecodable bodies, invalid UTF-8, deep
nesting, unknown tags, extra fields, wrong types, requests before Hello, a wrong protocol version
and requests after the daemon closed, a huge length prefix, a truncated frame, a half-closed
socket, a disconnect mid-stream, a duplicate id, a flood of generations on one connection.
Shutdown is sent once, at the end. --connections long-lived connections each keep up to --window
cases in flight (the replay of one case, --only, is exact; a run's interleaving is not).

Path settings name only paths in the scratch dir, except the replay trace's (only read): a trace
output is renamed over its path, and over /dev/null it would replace the device for the machine.

Every case is classified by its final reply: `ok` (the documented success reply), or the Error's
code (bad_request, busy, not_found, model_error, cancelled, ...: expected), or a defect:

    internal    an Error with code "internal" (a bug in the daemon), or a model_error that wraps a
                Python error a bug raises (TypeError, KeyError, MemoryError, ...: BUG_IN_LOAD)
    crash       the daemon process exited
    hang        no final reply within --deadline seconds (the daemon must then still answer
                Health and Ps on a fresh connection, else the run stops: `unresponsive`)
    protocol    a reply of the wrong type, an unknown error code, a reply for no open request, a
                connection closed that should have stayed open, a reply that does not decode
    accepted    a request the protocol says is invalid (negative max_tokens, NaN sampling options,
                empty messages, an unknown setting, ...) answered with success
    log         the daemon logged an exception no reply carried (an asyncio task or callback
                error) or a compute thread that stopped by itself
    leak        after the run, Ps shows sequences still active, or, once every model is unloaded,
                the daemon holds more threads than at start (beyond --thread-margin)
    memory      daemon RSS (/proc/PID/status, sampled every 0.5 s) grows over the last half of
                the run by more than --max-growth MB per 1000 requests (judged only when that half
                spans at least 1000 requests; glibc arenas make shorter runs noisy), or peaks
                above --max-rss-mb (2048) at any time
    shutdown    Shutdown did not end open streams with "shutdown", or the daemon did not exit 0

It prints progress, a summary (cases by type and outcome, memory), and every defect with its
minimal reproduction: the request as sent and the `--only` command line. --json writes it all.
Exit status 1 if there is any defect.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import re
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
if str(ROOT / "benchmarks") not in sys.path:  # appended: a test that loads this file must not
    sys.path.append(str(ROOT / "benchmarks"))  # have benchmarks/*.py shadow other modules

from _fuzz.cases import FIXTURE, N_CTX, SCENE_MSG, Case, Pools, encode, frame, make_case  # noqa: E402
from ipc.framing import HEADER  # noqa: E402
from ipc.protocol import PROTOCOL_VERSION, Chunk, Error, Progress, decode_reply  # noqa: E402

EXECUTOR_THREADS = min(32, (os.cpu_count() or 1) + 4)  # asyncio's default executor's idle threads stay
CODES = {"bad_frame", "bad_request", "bad_version", "busy", "not_found", "model_error", "cancelled",
         "shutdown", "forbidden", "internal"}
SUCCESS = {"G": "Done", "C": "Done", "L": "Loaded", "U": "Ok", "P": "PsReply", "S": "StatsReply",
           "H": "HealthReply", "V": "HealthReply"}
STREAMING = {"G": (Chunk, Progress), "C": (Chunk, Progress), "L": (Progress,)}
DEFECTS = ("internal", "crash", "hang", "unresponsive", "protocol", "accepted", "log", "leak", "memory",
           "shutdown")
# A load that fails with an exception the reader did not name is wrapped as model_error
# ("loading PATH failed: TypeError: ...", daemon/scheduler/models.py _error_for_load): these types
# are bugs (or, for MemoryError, a read without a bound), whatever the code says.
BUG_IN_LOAD = re.compile(r"failed: (TypeError|AttributeError|NameError|KeyError|IndexError|ZeroDivisionError|"
                         r"AssertionError|UnboundLocalError|ValueError|OverflowError|MemoryError|RecursionError|"
                         r"RuntimeError|NotImplementedError|UnicodeError|UnicodeDecodeError|UnicodeEncodeError):")


# ------------------------------------------------------------------------------------ the daemon


class Daemon:
    """`python -m daemon.cli serve` on a socket in the scratch dir, its log in a file."""

    def __init__(self, scratch: Path, mem_gb: float, env_extra: dict[str, str]):
        self.sock = str(scratch / "d.sock")
        self.log_path = scratch / "daemon.log"
        self.log = open(self.log_path, "wb")
        env = {**os.environ, "MOED_SOCKET": self.sock, "MOE_N_THREADS": "1", "MOE_N_CTX": str(N_CTX),
               "XDG_CACHE_HOME": str(scratch / "cache"),
               "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
               **env_extra}
        env.pop("NUMBA_ENABLE_CUDASIM", None)  # device=cuda must fail fast, not run simulated
        limit = int(mem_gb * 2**30)

        def cap():  # a forged size must fail as MemoryError, not take the machine
            import resource
            resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

        self.proc = subprocess.Popen([sys.executable, "-m", "daemon.cli", "serve", "--socket", self.sock],
                                     stdout=self.log, stderr=subprocess.STDOUT, env=env, cwd=scratch,
                                     preexec_fn=cap if mem_gb > 0 else None)
        self.pid = self.proc.pid

    def status(self, key: str) -> int | None:
        """A number from /proc/PID/status: VmRSS (kB), Threads."""
        try:
            for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
                if line.startswith(key + ":"):
                    return int(line.split()[1])
        except OSError:
            return None
        return None

    def threads(self) -> str:
        """Each thread's name and what the kernel says it waits in (wchan), counted."""
        seen: Counter = Counter()
        for task in Path(f"/proc/{self.pid}/task").glob("*"):
            try:
                seen[f"{(task / 'comm').read_text().strip()} in {(task / 'wchan').read_text().strip() or '-'}"] += 1
            except OSError:
                pass
        return ", ".join(f"{n}x {k}" for k, n in seen.most_common())

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        self.log.close()


async def _read_reply(reader: asyncio.StreamReader):
    """The next reply; None at EOF; ("undecodable", detail) for a reply that does not decode."""
    try:
        head = await reader.readexactly(HEADER.size)
        (n,) = HEADER.unpack(head)
        body = await reader.readexactly(n)
    except (asyncio.IncompleteReadError, ConnectionError):
        return None
    try:
        return decode_reply(body)
    except Exception as e:  # noqa: BLE001 - a defect, reported as such
        return ("undecodable", f"{type(e).__name__}: {e}; body {body[:80]!r}")


async def _open(sock: str, hello: bool = True, timeout: float = 30.0):
    reader, writer = await asyncio.open_unix_connection(sock, limit=64 * 2**20)
    if hello:
        writer.write(frame(encode(["V", 1, PROTOCOL_VERSION])))
        reply = await asyncio.wait_for(_read_reply(reader), timeout)
        if type(reply).__name__ != "HealthReply":
            writer.close()
            raise ConnectionError(f"Hello answered with {reply!r}")
    return reader, writer


# ------------------------------------------------------------------------------------ the results


@dataclass
class Result:
    index: int
    kind: str
    outcome: str  # "ok", an error code, "none" (no reply expected), or a defect kind
    defect: str = ""  # the defect kind, if any
    detail: str = ""
    request: str = ""
    secs: float = 0.0


@dataclass
class Run:
    seed: int
    results: list[Result] = field(default_factory=list)
    extra: list[Result] = field(default_factory=list)  # defects of the run itself (crash, log, leak, ...)
    rss: list[tuple[float, int, int, int]] = field(default_factory=list)  # (t, results so far, kB, threads)
    threads: dict[str, int] = field(default_factory=dict)  # at start, and after the models are unloaded
    wall_s: float = 0.0
    stopped_early: str = ""
    max_growth: float = 10.0

    def defects(self) -> list[Result]:
        return [r for r in self.results + self.extra if r.defect]

    def memory(self) -> dict:
        """RSS over the run and the least-squares slope over its last half (by requests and time)."""
        pts = self.rss
        out = {"samples": len(pts), "first_mb": pts[0][2] / 1024 if pts else None,
               "last_mb": pts[-1][2] / 1024 if pts else None, "peak_mb": max(p[2] for p in pts) / 1024 if pts else None}
        n = pts[-1][1] if pts else 0
        # the last half by requests, up to the first sample with every result in (later ones only
        # wait on hung requests, with no work to grow on)
        end = next((k for k, p in enumerate(pts) if p[1] >= n), len(pts) - 1)
        half = [p for p in pts[:end + 1] if p[1] >= n / 2]
        if len(half) >= 4:
            out["mb_per_1000_requests"] = _slope([p[1] for p in half], [p[2] / 1024 for p in half]) * 1000
            out["mb_per_minute"] = _slope([p[0] for p in half], [p[2] / 1024 for p in half]) * 60
            out["half_requests"] = half[-1][1] - half[0][1]
        out["judged"] = out.get("half_requests", 0) >= 1000
        return out


def _slope(xs: list[float], ys: list[float]) -> float:
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    var = sum((x - mx) ** 2 for x in xs)
    return 0.0 if var == 0 else sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var


def classify(case: Case, msg: list, replies: list, eof: bool, hung: bool, secs: float) -> Result:
    """The outcome of a one-request case from every reply it got (Progress and Chunks included)."""
    res = Result(case.index, case.kind, "", request=case.describe(msg), secs=secs)
    tag = msg[0]
    final = None
    for i, rep in enumerate(replies):
        if isinstance(rep, tuple):
            return _defect(res, "protocol", f"a reply does not decode: {rep[1]}")
        if isinstance(rep, STREAMING.get(tag, ())):
            if final is not None:
                return _defect(res, "protocol", f"{type(rep).__name__} after the final reply")
            continue
        if final is not None:
            return _defect(res, "protocol", f"a second final reply {rep!r}")
        final = rep
    if final is None:
        if hung:
            return _defect(res, "hang", f"no final reply within {secs:.0f} s ({len(replies)} replies before)")
        return _defect(res, "protocol", "the connection closed before the final reply" if eof else "no final reply")
    if isinstance(final, Error):
        if final.code not in CODES:
            return _defect(res, "protocol", f"unknown error code {final.code!r}: {final.message[:200]}")
        if final.code == "internal":
            return _defect(res, "internal", final.message[:500])
        if final.code == "model_error" and BUG_IN_LOAD.search(final.message):
            return _defect(res, "internal", f"a bug reported as model_error: {final.message[:500]}")
        res.outcome = final.code
        res.detail = final.message[:200]
        return res
    name = type(final).__name__
    if name != SUCCESS[tag]:
        return _defect(res, "protocol", f"answered {name}, expected {SUCCESS[tag]} or Error")
    if case.must_fail:
        return _defect(res, "accepted", f"answered {name}, but the request is invalid: {case.must_fail}")
    res.outcome = "ok"
    return res


def _defect(res: Result, kind: str, detail: str) -> Result:
    res.outcome = res.defect = kind
    res.detail = detail
    return res


# -------------------------------------------------------------------------------- shared connections


class Conn:
    """A long-lived connection: requests routed by id, several in flight."""

    def __init__(self, reader, writer, run: Run, name: str):
        self.reader, self.writer, self.run, self.name = reader, writer, run, name
        self.pending: dict[int, tuple[list, asyncio.Future]] = {}
        self.finished: set[int] = set()
        self.next_id = 100
        self.closed = asyncio.get_running_loop().create_future()
        self.task = asyncio.create_task(self._route())

    async def _route(self) -> None:
        while True:
            rep = await _read_reply(self.reader)
            if rep is None:
                break
            rid = None if isinstance(rep, tuple) else rep.id
            if rid in self.pending:
                replies, fut = self.pending[rid]
                replies.append(rep)
                if not isinstance(rep, (Chunk, Progress, tuple)) and not fut.done():
                    fut.set_result(None)
            else:  # a reply for no open request
                why = "after its final reply" if rid in self.finished else "for no request sent"
                self.run.extra.append(Result(-1, "stray", "protocol", "protocol",
                                             f"on connection {self.name}: {rep!r}"[:400] + f" ({why})"))
        if not self.closed.done():
            self.closed.set_result(None)
        for _, fut in self.pending.values():
            if not fut.done():
                fut.set_result(None)

    def take_id(self, weird: int | None) -> int:
        if weird is not None and weird not in self.pending and weird not in self.finished:
            return weird
        self.next_id += 1
        return self.next_id

    async def play(self, case: Case, deadline: float) -> Result:
        msg = list(case.msg)
        if case.kind == "X":  # no reply: the id is one nobody uses on this connection
            self.writer.write(frame(encode(msg)))
            return Result(case.index, case.kind, "none", request=case.describe(msg))
        rid = self.take_id(case.weird_id)
        msg[1] = rid
        replies: list = []
        fut = asyncio.get_running_loop().create_future()
        self.pending[rid] = (replies, fut)
        t0 = time.monotonic()
        self.writer.write(frame(encode(msg)))
        if case.cancel_after is not None:
            await asyncio.sleep(case.cancel_after)
            self.writer.write(frame(encode(["X", rid])))
        hung = False
        try:
            await asyncio.wait_for(asyncio.shield(fut), deadline)
        except TimeoutError:
            hung = True
        del self.pending[rid]
        self.finished.add(rid)
        return classify(case, msg, replies, self.closed.done(), hung, time.monotonic() - t0)

    async def close(self) -> None:
        self.writer.close()
        self.task.cancel()
        await asyncio.gather(self.task, return_exceptions=True)


# ---------------------------------------------------------------------------------------- scenes


async def _collect(reader, until, timeout: float) -> tuple[list, bool, bool]:
    """Replies until `until(replies)` is true or EOF: (replies, eof, timed out)."""
    replies: list = []
    try:
        async with asyncio.timeout(timeout):
            while not until(replies):
                rep = await _read_reply(reader)
                if rep is None:
                    return replies, True, False
                replies.append(rep)
    except TimeoutError:
        return replies, False, True
    return replies, False, False


def _codes(replies) -> list[str]:
    return [r.code for r in replies if isinstance(r, Error)]


def _is_final(r) -> bool:
    return not isinstance(r, (Chunk, Progress, tuple))


async def play_scene(case: Case, sock: str, deadline: float) -> Result:
    res = Result(case.index, case.kind, "ok", request=case.describe())
    t0 = time.monotonic()
    m = case.msg
    writer = None
    try:
        if case.kind == "before_hello":
            reader, writer = await _open(sock, hello=False)
            writer.write(frame(encode(["P", 3])) + frame(encode(["V", 4, PROTOCOL_VERSION])) + frame(encode(["P", 5])))
            reps, eof, hung = await _collect(reader, lambda r: len(r) >= 3, deadline)
            want = ["Error", "HealthReply", "PsReply"]
            got = [type(r).__name__ for r in reps]
            if got != want or _codes(reps) != ["bad_request"]:
                return _scene_defect(res, reps, eof, hung, f"expected {want} (bad_request first), got {reps!r}")
            return _scene_ok(res, "bad_request")
        if case.kind == "bad_version":
            reader, writer = await _open(sock, hello=False)
            writer.write(frame(encode(["V", 9, m[0]])))
            reps, eof, hung = await _collect(reader, lambda r: len(r) >= 1, deadline)
            if m[0] == PROTOCOL_VERSION:
                ok = [type(r).__name__ for r in reps] == ["HealthReply"]
                return _scene_ok(res, "ok") if ok else _scene_defect(res, reps, eof, hung, f"got {reps!r}")
            if _codes(reps) != ["bad_version"]:
                return _scene_defect(res, reps, eof, hung, f"expected Error bad_version, got {reps!r}")
            # requests after the daemon closed: nothing more may come but EOF
            with _quiet():
                writer.write(frame(encode(["P", 10])) * 3)
                await writer.drain()
            more, eof, hung = await _collect(reader, lambda r: False, 10)
            if more or not eof:
                return _scene_defect(res, more, eof, hung, f"after bad_version: {more!r}, eof={eof}")
            return _scene_ok(res, "bad_version")
        reader, writer = await _open(sock)
        if case.kind in ("garbage", "bad_utf8", "wrong"):
            body = m[0] if case.kind == "garbage" else encode(m[0] if case.kind == "wrong" else m)
            writer.write(frame(body) + frame(encode(["H", 99])))
            reps, eof, hung = await _collect(reader, lambda r: any(getattr(x, "id", 0) == 99 for x in r), deadline)
            errors = [r for r in reps if isinstance(r, Error)]
            healthy = any(type(r).__name__ == "HealthReply" for r in reps)
            if any(e.code == "internal" for e in errors):
                return _scene_defect(res, reps, eof, hung, "internal", kind="internal")
            if not healthy:
                return _scene_defect(res, reps, eof, hung, "the connection did not go on after the bad frame")
            if case.kind != "bad_utf8" and not errors:
                return _scene_defect(res, reps, eof, hung, "an invalid request was not refused", kind="accepted")
            return _scene_ok(res, errors[0].code if errors else "ok")
        if case.kind in ("huge_prefix", "truncated"):
            if case.kind == "huge_prefix":
                writer.write(HEADER.pack(m[0]) + b"\x91")
            else:
                writer.write(HEADER.pack(1000)[:m[0]] if m[0] < 4 else HEADER.pack(1000) + b"\x92" * m[0])
                writer.write_eof()
            reps, eof, hung = await _collect(reader, lambda r: False, deadline)
            if _codes(reps) != ["bad_frame"] or not eof:
                return _scene_defect(res, reps, eof, hung,
                                     f"expected Error bad_frame then EOF, got {reps!r}, eof={eof}")
            return _scene_ok(res, "bad_frame")
        if case.kind == "half_close":
            writer.write(frame(encode(m)))
            writer.write_eof()
            reps, eof, hung = await _collect(reader, lambda r: False, deadline)
            if hung or any(c == "internal" for c in _codes(reps)):
                return _scene_defect(res, reps, eof, hung, "after a half-close")
            return _scene_ok(res, "closed")
        if case.kind == "disconnect":
            writer.write(frame(encode(m)))
            reps, eof, hung = await _collect(reader, lambda r: any(isinstance(x, Chunk) or _is_final(x) for x in r),
                                             deadline)
            if any(c == "internal" for c in _codes(reps)) or hung:
                return _scene_defect(res, reps, eof, hung, "before the disconnect")
            sock_ = writer.get_extra_info("socket")
            if sock_ is not None and case.index % 2:  # an abortive close (RST) half of the time
                sock_.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            writer.transport.abort()
            writer = None
            return _scene_ok(res, "disconnected")
        if case.kind == "dup_id":
            dup = ["P", 7]
            writer.write(frame(encode(m)) + frame(encode(dup)))
            reps, eof, hung = await _collect(
                reader, lambda r: sum(_is_final(x) for x in r) >= 2, deadline)
            finals = [r for r in reps if _is_final(r)]
            if len(finals) < 2 or any(c == "internal" for c in _codes(reps)):
                return _scene_defect(res, reps, eof, hung, f"expected two final replies for id 7, got {finals!r}")
            in_use = [r for r in finals if isinstance(r, Error) and "already in use" in r.message]
            return _scene_ok(res, "bad_request" if in_use else "ok")
        if case.kind == "flood":
            n, model = m
            msgs = [["G", 1000 + k, model, None, [1, 2, 3], 4, None, [], None, False] for k in range(n)]
            writer.write(b"".join(frame(encode(x)) for x in msgs))
            reps, eof, hung = await _collect(reader, lambda r: sum(_is_final(x) for x in r) >= n, deadline)
            finals = [r for r in reps if _is_final(r)]
            if len(finals) < n or any(c == "internal" for c in _codes(reps)):
                return _scene_defect(res, reps, eof, hung, f"{len(finals)} of {n} final replies")
            if len({r.id for r in finals}) != n:
                return _scene_defect(res, reps, eof, hung, "a request got two final replies")
            return _scene_ok(res, "busy" if "busy" in _codes(finals) else "ok")
        raise AssertionError(case.kind)
    except (ConnectionError, OSError) as e:
        return _defect(res, "protocol", f"{type(e).__name__}: {e}")
    finally:
        res.secs = time.monotonic() - t0
        if writer is not None:
            writer.close()


class _quiet:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return exc[0] is not None and issubclass(exc[0], (ConnectionError, OSError))


def _scene_ok(res: Result, outcome: str) -> Result:
    res.outcome = outcome
    return res


def _scene_defect(res: Result, reps, eof, hung, detail: str, kind: str | None = None) -> Result:
    if kind is None:
        kind = "hang" if hung else ("internal" if "internal" in _codes(reps) else "protocol")
    internal = [r.message for r in reps if isinstance(r, Error) and r.code == "internal"]
    return _defect(res, kind, (detail + (f"; internal: {internal[0][:300]}" if internal else ""))[:600])


# ------------------------------------------------------------------------------------------- run


async def _alive(sock: str, timeout: float = 30.0) -> str:
    """"" if the daemon answers Health and Ps on a fresh connection, else why not."""
    try:
        async with asyncio.timeout(timeout):
            reader, writer = await _open(sock)
            writer.write(frame(encode(["H", 2])) + frame(encode(["P", 3])))
            reps = [await _read_reply(reader), await _read_reply(reader)]
            writer.close()
    except (TimeoutError, ConnectionError, OSError) as e:
        return f"{type(e).__name__}: {e}"
    names = [type(r).__name__ for r in reps]
    return "" if names == ["HealthReply", "PsReply"] else f"answered {names}"


async def fuzz(opts) -> Run:
    run = Run(opts.seed, max_growth=opts.max_growth)
    scratch = Path(tempfile.mkdtemp(prefix="moed-pfuzz-"))
    from tests.fixtures.build import fixture_path

    fixture = fixture_path(*FIXTURE, opts.fixture_dir)
    pools = Pools(scratch, fixture)
    daemon = Daemon(scratch, opts.mem_gb, {})
    t0 = time.monotonic()
    try:
        await _start(daemon, opts.start_timeout)
        run.threads["start"] = daemon.status("Threads")
        indices = opts.only if opts.only else range(opts.requests)
        todo = iter(indices)
        total = len(indices)
        stop = asyncio.Event()
        end_at = t0 + opts.minutes * 60

        async def worker(w: int) -> None:
            conn = Conn(*await _open(daemon.sock), run, f"w{w}")
            inflight: set[asyncio.Task] = set()
            try:
                while not stop.is_set():
                    if time.monotonic() > end_at:
                        run.stopped_early = run.stopped_early or f"--minutes {opts.minutes} reached"
                        break
                    i = next(todo, None)
                    if i is None:
                        break
                    case = make_case(i, opts.seed, pools)
                    if case.kind in SCENE_MSG:
                        res = await play_scene(case, daemon.sock, opts.deadline)
                        await _record(res)
                        continue
                    if conn.closed.done():
                        run.extra.append(Result(-1, "conn", "protocol", "protocol",
                                                f"the daemon closed connection {conn.name}"))
                        conn = Conn(*await _open(daemon.sock), run, f"w{w}")
                    while len(inflight) >= opts.window:
                        _, inflight = await asyncio.wait(inflight, return_when=asyncio.FIRST_COMPLETED)
                    inflight.add(asyncio.create_task(_play(conn, case)))
                    await asyncio.sleep(0)
                if inflight:
                    await asyncio.wait(inflight)
            finally:
                await conn.close()

        async def _play(conn: Conn, case: Case) -> None:
            await _record(await conn.play(case, opts.deadline))

        async def _record(res: Result) -> None:
            run.results.append(res)
            if res.defect in ("hang", "protocol") and daemon.proc.poll() is None:
                why = await _alive(daemon.sock)
                if why:
                    run.extra.append(Result(res.index, res.kind, "unresponsive", "unresponsive",
                                            f"after case {res.index}: {why}", res.request))
                    stop.set()

        async def monitor() -> None:
            last = time.monotonic()
            while True:
                rc = daemon.proc.poll()
                if rc is not None:
                    recent = [r.request for r in run.results[-8:]]
                    run.extra.append(Result(-1, "daemon", "crash", "crash",
                                            f"exit status {rc}; log tail:\n{daemon.log_text()[-3000:]}",
                                            "last cases: " + " | ".join(recent)))
                    stop.set()
                    return
                kb, threads = daemon.status("VmRSS"), daemon.status("Threads")
                if kb and threads:
                    run.rss.append((time.monotonic() - t0, len(run.results), kb, threads))
                if opts.progress and time.monotonic() - last >= opts.progress:
                    last = time.monotonic()
                    print(_progress(run, total, last - t0), flush=True)
                await asyncio.sleep(0.5)

        mon = asyncio.create_task(monitor())
        workers = [asyncio.create_task(worker(w)) for w in range(opts.connections)]
        done, _ = await asyncio.wait(workers, return_when=asyncio.FIRST_EXCEPTION)
        stop.set()
        await asyncio.gather(*workers, return_exceptions=True)
        for t in done:  # a bug of the fuzzer, unless the daemon died under it
            if t.exception() is not None and daemon.proc.poll() is None:
                raise t.exception()
        if daemon.proc.poll() is None:
            await _settle(run, daemon, opts.thread_margin)
        mon.cancel()  # before our own Shutdown: its exit 0 is no crash (_shutdown judges it)
        await asyncio.gather(mon, return_exceptions=True)
        if daemon.proc.poll() is None:
            await _shutdown(run, daemon, pools, opts.deadline)
        if daemon.proc.poll() not in (None, 0) and not any(r.defect == "crash" for r in run.extra):
            run.extra.append(Result(-1, "daemon", "crash", "crash", f"exit status {daemon.proc.poll()}"))
    finally:
        daemon.stop()
        run.wall_s = time.monotonic() - t0
        _scan_log(run, daemon.log_text())
        if opts.log:
            shutil.copyfile(daemon.log_path, opts.log)
        shutil.rmtree(scratch, ignore_errors=True)
    mem = run.memory()
    if mem["samples"] and mem["peak_mb"] > opts.max_rss_mb:
        at = max(run.rss, key=lambda p: p[2])
        run.extra.append(Result(-1, "daemon", "memory", "memory",
                                f"RSS peaked at {mem['peak_mb']:.0f} MB (limit --max-rss-mb {opts.max_rss_mb:g}) "
                                f"after {at[1]} cases; the cases around then: see the JSON results"))
    if mem["judged"] and mem["mb_per_1000_requests"] > opts.max_growth:
        run.extra.append(Result(-1, "daemon", "memory", "memory",
                                f"RSS grew {mem['mb_per_1000_requests']:.1f} MB per 1000 requests over the last "
                                f"half ({mem['mb_per_minute']:.1f} MB/min; limit {opts.max_growth} MB/1000)"))
    return run


async def _start(daemon: Daemon, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        if daemon.proc.poll() is not None:
            raise RuntimeError(f"the daemon exited at start:\n{daemon.log_text()[-3000:]}")
        try:
            _, writer = await _open(daemon.sock, timeout=5)
            writer.close()
            return
        except (OSError, ConnectionError, TimeoutError):
            if time.monotonic() > deadline:
                raise RuntimeError(f"the daemon did not start within {timeout} s") from None
            await asyncio.sleep(0.1)


async def _settle(run: Run, daemon: Daemon, margin: int) -> None:
    """After the run: no sequence may stay active (a cancelled or orphaned one leaked)."""
    why = await _alive(daemon.sock)
    if why:
        run.extra.append(Result(-1, "daemon", "unresponsive", "unresponsive", f"after the run: {why}"))
        return
    for _ in range(40):
        reader, writer = await _open(daemon.sock)
        writer.write(frame(encode(["P", 2])))
        ps = await asyncio.wait_for(_read_reply(reader), 30)
        writer.close()
        active = {m.name: m.active for m in getattr(ps, "models", []) if m.active}
        if not active:
            break
        await asyncio.sleep(0.25)
    else:
        run.extra.append(Result(-1, "daemon", "leak", "leak", f"sequences still active 10 s after the run: {active}"))
        return
    # every model unloaded, the daemon holds the threads it started with (a blocked one leaks)
    reader, writer = await _open(daemon.sock)
    for k, m in enumerate(getattr(ps, "models", [])):
        writer.write(frame(encode(["U", 10 + k, m.name])))
        await asyncio.wait_for(_read_reply(reader), 60)
    writer.close()
    for _ in range(40):
        await asyncio.sleep(0.25)
        run.threads["end"] = daemon.status("Threads") or 0
        if run.threads["end"] <= run.threads["start"] + margin:
            return
    run.extra.append(Result(-1, "daemon", "leak", "leak", f"{run.threads['end']} threads once every model was "
                            f"unloaded, {run.threads['start']} at start (--thread-margin {margin}): "
                            f"{daemon.threads()}"))


async def _shutdown(run: Run, daemon: Daemon, pools: Pools, deadline: float) -> None:
    """Shutdown with a stream open on another connection: it ends with "shutdown"; the daemon exits 0."""
    r1, w1 = await _open(daemon.sock)
    w1.write(frame(encode(["G", 5, pools.good[0], None, [1, 2, 3], 2**63 - 1, None, [], None, False])))
    first, _, _ = await _collect(r1, lambda r: any(isinstance(x, Chunk) or _is_final(x) for x in r), deadline)
    r2, w2 = await _open(daemon.sock)
    w2.write(frame(encode(["Q", 6])))
    ack, _, _ = await _collect(r2, lambda r: len(r) >= 1, deadline)
    w2.write(frame(encode(["P", 7])))  # a request after Shutdown: refused or never read
    after, _, _ = await _collect(r2, lambda r: False, 30)
    rest, eof, hung = await _collect(r1, lambda r: any(_is_final(x) for x in r), deadline)
    finals = [r for r in first + rest if _is_final(r)]
    problems = []
    if [type(r).__name__ for r in ack] != ["Ok"]:
        problems.append(f"Shutdown answered {ack!r}")
    if finals and not (isinstance(finals[0], Error) and finals[0].code == "shutdown") \
            and type(finals[0]).__name__ != "Done":
        problems.append(f"the open stream ended with {finals[0]!r}")
    if any(isinstance(r, Error) and r.code == "internal" for r in after):
        problems.append(f"a request after Shutdown: {after!r}")
    try:
        rc = await asyncio.wait_for(asyncio.to_thread(daemon.proc.wait), 60)
        if rc != 0:
            problems.append(f"the daemon exited with status {rc}")
    except TimeoutError:
        problems.append("the daemon did not exit within 60 s of Shutdown")
    for w in (w1, w2):
        w.close()
    if problems:
        run.extra.append(Result(-1, "Q", "shutdown", "shutdown", "; ".join(problems),
                                "['Q', 6] with ['G', 5, a.gguf, None, [1, 2, 3], 2**63-1, ...] open"))


LOG_DEFECTS = ("Task exception was never retrieved", "Exception in callback", "its compute thread stopped",
               "Fatal Python error", "Traceback")


def _scan_log(run: Run, text: str) -> None:
    """Exceptions the log holds that no reply carried: a request's own failure is logged with
    'request X failed' / 'preparing request X failed' beside its internal Error, and is counted there."""
    blocks = text.split("\n")
    internal_logged = sum(1 for ln in blocks if "request" in ln and "failed" in ln and "ERROR" in ln)
    tracebacks = sum(1 for ln in blocks if ln.startswith("Traceback"))
    for marker in LOG_DEFECTS[:-1]:
        hits = [i for i, ln in enumerate(blocks) if marker in ln]
        if hits:
            i = hits[0]
            run.extra.append(Result(-1, "log", "log", "log",
                                    f"{len(hits)}x {marker!r}: " + "\n".join(blocks[i:i + 30])[:2000]))
    if tracebacks > internal_logged and not any(r.defect == "log" for r in run.extra):
        i = next(i for i, ln in enumerate(blocks) if ln.startswith("Traceback"))
        run.extra.append(Result(-1, "log", "log", "log", f"{tracebacks} tracebacks, {internal_logged} of them "
                                f"for internal errors; the first:\n" + "\n".join(blocks[max(0, i - 2):i + 30])[:2000]))


def _progress(run: Run, total: int, elapsed: float) -> str:
    n = len(run.results)
    d = Counter(r.defect for r in run.defects())
    rss = run.rss[-1][2] / 1024 if run.rss else 0
    return (f"[{n:>6}/{total}] {n / max(elapsed, 1e-9):5.1f}/s  rss {rss:.0f} MB  defects: "
            + (", ".join(f"{k} {v}" for k, v in d.items()) or "none"))


def summary(run: Run, opts) -> str:
    n = len(run.results)
    lines = [f"{n} cases (seed {run.seed}, {opts.connections} connections) in {run.wall_s:.1f} s "
             f"({n / max(run.wall_s, 1e-9):.1f}/s)"
             + (f"; stopped early: {run.stopped_early}" if run.stopped_early else "")]
    by: dict[str, Counter] = defaultdict(Counter)
    for r in run.results:
        by[r.kind][r.outcome] += 1
    outcomes = sorted({o for c in by.values() for o in c}, key=lambda o: (o in DEFECTS, o))
    lines.append(f"{'case':<13}" + "".join(f"{o[:11]:>12}" for o in outcomes))
    names = {"G": "Generate", "C": "Chat", "L": "Load", "U": "Unload", "X": "Cancel", "P": "Ps", "S": "Stats",
             "H": "Health", "V": "Hello"}
    for k in sorted(by):
        lines.append(f"{names.get(k, k):<13}" + "".join(f"{by[k][o]:>12}" for o in outcomes))
    mem = run.memory()
    if mem["samples"]:
        lines.append(f"daemon RSS: {mem['first_mb']:.0f} MB at start, {mem['last_mb']:.0f} MB at the end, peak "
                     f"{mem['peak_mb']:.0f} MB; last half: " + (
                         f"{mem['mb_per_1000_requests']:+.1f} MB per 1000 requests, {mem['mb_per_minute']:+.1f} MB/min"
                         if "mb_per_minute" in mem else "too few samples")
                     + ("" if mem["judged"] else " (not judged: the last half spans < 1000 requests)"))
        lines.append(f"daemon threads: {run.threads.get('start')} at start, peak {max(p[3] for p in run.rss)}, "
                     f"{run.threads.get('end', '?')} once every model was unloaded at the end")
    defects = run.defects()
    lines.append(f"defects: {len(defects)}" + (" (" + ", ".join(f"{k} {v}" for k, v in
                                                                Counter(r.defect for r in defects).items()) + ")"
                                                if defects else ""))
    groups: dict[tuple, list[Result]] = defaultdict(list)
    for r in defects:
        groups[(r.defect, r.kind, r.detail[:60])].append(r)
    for (kind, ck, _), rs in groups.items():
        ex = rs[0]
        lines.append(f"  [{len(rs)}x] {kind} in {names.get(ck, ck)}: {ex.detail[:800]}")
        if ex.request:
            lines.append(f"      request: {ex.request[:800]}")
        if ex.index >= 0:
            lines.append(f"      replay:  python benchmarks/fuzz_protocol.py --seed {run.seed} --only {ex.index}")
    return "\n".join(lines)


def to_json(run: Run, opts) -> dict:
    return {"seed": run.seed, "wall_s": run.wall_s, "connections": opts.connections, "window": opts.window,
            "stopped_early": run.stopped_early, "memory": run.memory(), "threads": run.threads,
            "rss_samples": run.rss,
            "counts": dict(Counter(r.outcome for r in run.results)),
            "defects": [dataclasses.asdict(r) for r in run.defects()],
            "results": [dataclasses.asdict(r) for r in run.results]}


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=10000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--minutes", type=float, default=30.0, help="stop starting cases after this long")
    ap.add_argument("--connections", type=int, default=4, help="long-lived connections, each a worker")
    ap.add_argument("--window", type=int, default=4, help="cases in flight per connection")
    ap.add_argument("--deadline", type=float, default=120.0, help="seconds for a final reply before a hang")
    ap.add_argument("--max-growth", type=float, default=10.0, help="MB of RSS per 1000 requests (last half)")
    ap.add_argument("--max-rss-mb", type=float, default=2048.0, help="the daemon's RSS may never exceed this")
    ap.add_argument("--thread-margin", type=int, default=EXECUTOR_THREADS + 2,
                    help="threads the daemon may hold, once every model is unloaded, beyond those at start "
                         "(default: asyncio's default executor, which keeps its idle threads, and 2)")
    ap.add_argument("--mem-gb", type=float, default=4.0, help="the daemon's address-space cap (0 = none)")
    ap.add_argument("--start-timeout", type=float, default=600.0)
    ap.add_argument("--fixture-dir", default=str(Path(tempfile.gettempdir()) / "moed-fuzz-fixtures"))
    ap.add_argument("--only", type=lambda s: [int(x) for x in s.split(",")], help="replay these cases only")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--log", help="copy the daemon's log here")
    ap.add_argument("--progress", type=float, default=10.0, help="seconds between progress lines (0 = none)")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    opts = parse_args(argv)
    if opts.only:
        opts.connections = 1
    run = asyncio.run(fuzz(opts))
    print(summary(run, opts))
    if opts.json:
        Path(opts.json).write_text(json.dumps(to_json(run, opts), indent=1, default=str))
    return 1 if run.defects() else 0


if __name__ == "__main__":
    sys.exit(main())
