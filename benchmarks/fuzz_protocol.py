"""Protocol fuzzer: the real daemon (`moed serve` in a subprocess) against valid-but-absurd requests.

    python benchmarks/fuzz_protocol.py [--requests 10000] [--seed 0] [--minutes 30] [--connections 4]
                                       [--window 4] [--deadline 120] [--json OUT] [--log OUT]
    python benchmarks/fuzz_protocol.py --seed S --only I[,J...]   # replay cases alone, on a fresh daemon

The daemon serves a tiny fixture (tests/fixtures/build.py, qwen3moe Q8_0) under two paths, a
relative name and a symlink; a copy stands in for the demo model (XDG_CACHE_HOME points into the
scratch directory), so `model=None` is served fast. It runs with MOE_N_CTX=128 and one thread, so
any max_tokens, however absurd, ends within 128 tokens; most cases ask for 0..16 tokens.

Case I depends only on --seed and I. Each is one request of a type the protocol knows (Hello,
Load, Unload, Generate, Chat, Cancel, Ps, Stats, Health) with field values drawn from the absurd
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
import math
import os
import random
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

import msgspec  # noqa: E402

from daemon.config import Settings  # noqa: E402
from ipc.framing import HEADER  # noqa: E402
from ipc.protocol import PROTOCOL_VERSION, Chunk, Error, Progress, decode_reply  # noqa: E402

FIXTURE = ("qwen3moe", "Q8_0")
DEMO_NAME = "smollm2-135m-moe-e16k12.gguf"  # daemon/demo.py: the demo model's cache file name
N_CTX = 128
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
BAD_UTF8 = b"\xff\xfe\xed\xa0\x80\xc0\xafxyz"  # invalid UTF-8 of the marker's length
MARKER = "QBADUTF8QQ"  # replaced by BAD_UTF8 in the encoded body
assert len(MARKER.encode()) == len(BAD_UTF8)

INTS = (0, 1, -1, 2, 255, 256, 65535, 2**31 - 1, 2**31, 2**32, 2**53 + 1, 2**63 - 1, -(2**63), 2**64 - 1,
        10**9)
FLOATS = (math.nan, math.inf, -math.inf, 0.0, -0.0, -1.0, 1e-300, 5e-324, 1e308, -1e308, 1e30, 0.5, 1.0)
STRINGS = ("", "\0", "a\0b", "\n" * 50, "\u202e\u200b", "🙂" * 100, "<|im_start|>user", "{{ 7*7 }}",
           "{% for i in range(10**9) %}x{% endfor %}", "%s%n%x", "../../../../etc/passwd")


# -------------------------------------------------------------------------------------- the cases


@dataclass
class Case:
    index: int
    kind: str  # "G", "C", "L", ... for one request on a shared connection; a scene's name otherwise
    msg: list | None = None  # the request as a msgpack array, id at [1] (set when sent)
    must_fail: str = ""  # why the protocol says this request is invalid ("" = it may succeed)
    cancel_after: float | None = None  # a Generate/Chat cancelled this many seconds after it is sent
    weird_id: int | None = None  # the id to use, if free on the connection

    def describe(self, msg: list | None = None) -> str:
        return brief(msg if msg is not None else self.msg)


def brief(v, depth: int = 0):
    """A short, faithful repr of a request: long strings and lists are written as expressions."""
    if isinstance(v, str):
        if len(v) > 60:
            head = v[:20]
            if v == v[0] * len(v):
                return f"{v[0]!r}*{len(v)}"
            return f"({head!r} + <{len(v) - 20} more chars>)"
        return repr(v)
    if isinstance(v, list):
        if len(v) > 12:
            if all(x == v[0] for x in v):
                return f"[{brief(v[0], depth + 1)}]*{len(v)}"
            return "[" + ", ".join(brief(x, depth + 1) for x in v[:6]) + f", <{len(v) - 6} more>]"
        return "[" + ", ".join(brief(x, depth + 1) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{brief(k)}: {brief(x, depth + 1)}" for k, x in v.items()) + "}"
    if isinstance(v, float) and not math.isfinite(v):
        return f"float({str(v)!r})"
    return repr(v)


class Pools:
    """Model names: ones that load (`good`), and ones that must not (`bad`), in the scratch dir."""

    def __init__(self, scratch: Path, fixture: Path):
        self.scratch = scratch
        for name in ("a.gguf", "b.gguf", "c.gguf"):
            shutil.copyfile(fixture, scratch / name)
        demo = scratch / "cache" / "moed"
        demo.mkdir(parents=True)
        shutil.copyfile(fixture, demo / DEMO_NAME)
        os.symlink(scratch / "a.gguf", scratch / "link.gguf")
        os.mkfifo(scratch / "fifo")
        (scratch / "notgguf.txt").write_text("hello, I am not a GGUF file\n" * 100)
        (scratch / "trunc.gguf").write_bytes(fixture.read_bytes()[:4096])
        os.symlink(scratch / "loop1", scratch / "loop2")
        os.symlink(scratch / "loop2", scratch / "loop1")
        (scratch / "dir").mkdir()
        s = str(scratch)
        self.good = [f"{s}/a.gguf", f"{s}/b.gguf", "a.gguf", f"{s}/link.gguf"]  # "a.gguf": relative to the cwd
        self.settled = f"{s}/c.gguf"  # Loads with settings go here most often: less often busy with others
        self.bad = ["", "/", s, f"{s}/dir", f"{s}/fifo", "/dev/zero", "/dev/null", f"{s}/notgguf.txt",
                    f"{s}/trunc.gguf", f"{s}/missing.gguf", f"{s}/loop1", f"{s}/a.gguf\0x", "\0",
                    "x" * 5000, "/" + "a/" * 3000, ".", "~", "\n"]
        os.symlink("/dev/null", scratch / "null-link")
        # Path settings. A trace output is written by a rename over its path (daemon/routing/tracer.py),
        # so it only ever names paths in the scratch dir: renamed over /dev/null, it would replace the
        # device for the whole machine when the daemon runs as root. A replay trace is only read.
        self.write_paths = ["", s, f"{s}/fifo", f"{s}/null-link", f"{s}/notgguf.txt", f"{s}/missing.json",
                            f"{s}/out-%d.json", f"{s}/dir/x.json.zst", f"{s}/nodir/x.json", "\0"]
        self.read_paths = ["", "/", s, f"{s}/fifo", "/dev/null", "/dev/zero", f"{s}/notgguf.txt", f"{s}/a.gguf",
                           f"{s}/missing.json", f"{s}/null-link", "\0"]


def _ri(rng: random.Random) -> int:
    return rng.choice(INTS)


def _rf(rng: random.Random) -> float:
    return rng.choice(FLOATS)


def _rs(rng: random.Random, big: bool = True) -> str:
    r = rng.random()
    if r < 0.5:
        return rng.choice(STRINGS)
    if r < 0.9:
        return "".join(chr(rng.choice((rng.randrange(32, 127), rng.randrange(0x80, 0xD800),
                                       rng.randrange(0xE000, 0x110000)))) for _ in range(rng.randrange(1, 40)))
    n = rng.choice((100, 4096, 65536) + ((1_000_000, 4 * 2**20 + 1) if big else ()))  # UTF-8 bytes
    ch = rng.choice("xé🙂 \0")
    return ch * -(-n // len(ch.encode()))  # 4 MiB + 1: just over MOED_MAX_PROMPT_BYTES


def _prompt(rng: random.Random) -> str:
    return rng.choice(("Hello", "The quick brown fox", "hi", "1 2 3 4")) if rng.random() < 0.7 else _rs(rng)


def _options(rng: random.Random) -> tuple[dict | None, str]:
    """Sampling options as the wire's map, and why they are invalid ("" = valid)."""
    if rng.random() < 0.4:
        return None, ""
    valid = {"temperature": (0.0, 0.8, 1.5, 1e-30), "top_k": (0, 1, 40), "top_p": (1.0, 0.5, 1e-9),
             "min_p": (0.0, 0.05, 1.0), "repeat_penalty": (1.0, 1.1, 1e-30), "repeat_last_n": (0, 64, 1),
             "seed": (None, 0, 1, 2**64 - 1)}
    out, why = {}, ""
    for key in rng.sample(sorted(valid), rng.randrange(1, 4)):
        if rng.random() < 0.75:
            v = rng.choice(valid[key])
        else:
            v = rng.choice((_rf(rng), _ri(rng), "0.5", True, [1], None))
        out[key] = v
        bad = _option_invalid(key, v)
        why = why or bad
    if rng.random() < 0.05:
        out["no_such_option"] = 1  # SamplingOptions ignores unknown keys
    return out, why


def _option_invalid(key: str, v) -> str:
    """ipc/protocol.py SamplingOptions' rules, written out."""
    if key == "seed":
        ok = v is None or (type(v) is int and 0 <= v < 2**64)
    elif key in ("top_k", "repeat_last_n"):
        ok = type(v) is int and v >= 0
    elif type(v) not in (int, float):
        ok = False
    elif not math.isfinite(v):
        ok = False
    else:
        ok = {"temperature": v >= 0, "top_p": 0 < v <= 1, "min_p": 0 <= v <= 1, "repeat_penalty": v > 0}[key]
    return "" if ok else f"options[{key!r}]={brief(v)}"


def _model(rng: random.Random, pools: Pools, none: bool) -> str | None:
    r = rng.random()
    if none and r < 0.2:
        return None
    return rng.choice(pools.good) if r < 0.75 else rng.choice(pools.bad)


def _max_tokens(rng: random.Random) -> int:
    if rng.random() < 0.85:
        return rng.choice((0, 1, 2, 4, 8, 16))
    return rng.choice((-1, 2**63 - 1, 2**64 - 1, -(2**63), 10**9, 200))


def _stop(rng: random.Random) -> list:
    r = rng.random()
    if r < 0.6:
        return []
    if r < 0.85:
        return [_rs(rng, big=False) for _ in range(rng.randrange(1, 5))]
    n = rng.choice((64, 65, 1000, 20_000))
    return [f"☃{k:07d}" for k in range(n)] if rng.random() < 0.7 else ["x" * 5000] * rng.choice((1, 10))


def _stop_invalid(stop: list) -> str:
    """The stop list's bound (issue 25, item 2; ipc/protocol.py "Limits"): 64 strings, 4 KiB in all."""
    if len(stop) > 64 or sum(len(x.encode()) for x in stop) > 4096:
        return f"a stop list of {len(stop)} strings, {sum(len(x.encode()) for x in stop)} bytes"
    return ""


def _keep_alive(rng: random.Random) -> float | None:
    return None if rng.random() < 0.5 else rng.choice((0.0, -1.0, 1e-9, 0.5, 300.0) + FLOATS)


SETTINGS = {f.name: f for f in dataclasses.fields(Settings)}
DAEMON_SETTINGS = Settings.daemon_settings()
PATH_SETTINGS = Settings.path_settings()


def _settings(rng: random.Random, pools: Pools) -> tuple[dict, str]:
    """Load settings, and why they are invalid ("" = maybe valid: ranges are the registry's)."""
    out, why = {}, ""
    if rng.random() < 0.45:
        return out, why
    for _ in range(1 if rng.random() < 0.6 else rng.randrange(2, 4)):
        r = rng.random()
        if r < 0.07:
            key, v = rng.choice(("n_ctxx", "", "\0", "N_CTX", "x" * 1000)), 1
            why = why or f"unknown setting {brief(key)}"
        elif r < 0.14:
            key = rng.choice(sorted(DAEMON_SETTINGS))
            v = rng.choice((1, "", 0.5))
            why = why or f"daemon setting {key}"
        else:
            key = rng.choice(sorted(PATH_SETTINGS) if rng.random() < 0.15 else sorted(set(SETTINGS) - DAEMON_SETTINGS))
            if key in PATH_SETTINGS:
                paths = pools.read_paths if key == "routing_replay" else pools.write_paths  # only it is read-only
                v = rng.choice(paths).replace("%d", str(rng.randrange(100)))
            else:
                v = _setting_value(rng, SETTINGS[key])
            bad = _setting_invalid(SETTINGS[key], v)
            why = why or bad
        out[key] = v
    return out, why


def _setting_value(rng: random.Random, f):
    r = rng.random()
    if r < 0.3:
        return f.default
    if f.type in ("int", int):
        return rng.choice(INTS + (10**7, -5, 3))
    if f.type in ("float", float):
        return rng.choice(FLOATS + (1e-3, 1e9))
    if f.type in ("bool", bool):
        return rng.choice((True, False, 0, 1, "yes", ""))
    choices = f.metadata["choices"]
    if choices and r < 0.6:
        return rng.choice(choices)
    return rng.choice(("", "auto", "cpu", "cuda", "cuda:99", "0", "1e9", "-1", "\0") + STRINGS[:6])


def _setting_invalid(f, v) -> str:
    """The registry's sure refusals (daemon/config.py _coerce): a negative or non-finite number,
    a NUL, a value that does not convert."""
    kind = f.type if isinstance(f.type, str) else f.type.__name__
    if kind in ("int", "float") and not isinstance(v, bool):
        try:
            x = int(v) if kind == "int" else float(v)
        except (TypeError, ValueError, OverflowError):
            return f"{f.name}={brief(v)} is not a number"
        if isinstance(x, float) and not math.isfinite(x):
            return f"{f.name}={brief(v)} is not finite"
        if x < 0:
            return f"{f.name}={brief(v)} is negative"
    if isinstance(v, str) and "\0" in v:
        return f"{f.name} has a NUL"
    return ""


def _messages(rng: random.Random) -> tuple[list, str]:
    r = rng.random()
    if r < 0.05:
        return [], "empty messages"
    n = 1 if r < 0.7 else rng.choice((2, 3, 50, 1000))
    roles = ("user", "system", "assistant", "tool")
    msgs = []
    for _ in range(n):
        role = rng.choice(roles) if rng.random() < 0.85 else _rs(rng, big=False)
        msgs.append([role, _prompt(rng) if n < 50 else rng.choice(STRINGS)])
    return msgs, ""


def make_case(index: int, seed: int, pools: Pools) -> Case:
    """Case `index` of run `seed`: a function of both only."""
    rng = random.Random(f"{seed}:{index}")
    case = Case(index, "")
    if rng.random() < 0.08:
        case.weird_id = rng.choice((0, -1, 2**63 - 1, 2**64 - 1, -(2**63), 2**32))
    r = rng.random()
    if r < 0.30:
        case.kind = "G"
        model = _model(rng, pools, none=True)
        how = rng.random()
        prompt = tokens = None
        why = ""
        if how < 0.55:
            prompt = _prompt(rng)
        elif how < 0.9:
            tokens = rng.choice(([1, 2, 3], [rng.randrange(200) for _ in range(rng.randrange(1, 60))], [],
                                 [-1], [2**63 - 1], [2**64 - 1], [-(2**63)], [0] * 100_000, [5] * N_CTX,
                                 [10**6]))
        elif how < 0.95:
            prompt, tokens, why = "hi", [1, 2], "both prompt and tokens"
        else:
            why = "neither prompt nor tokens"
        max_tokens = _max_tokens(rng)
        options, bad = _options(rng)
        stop = _stop(rng)
        why = why or bad or ("max_tokens < 0" if max_tokens < 0 else "") or _stop_invalid(stop)
        case.msg = ["G", 0, model, prompt, tokens, max_tokens, options, stop, _keep_alive(rng),
                    rng.random() < 0.3]
        case.must_fail = why
        if rng.random() < 0.15:
            case.cancel_after = rng.choice((0.0, 0.001, 0.01, 0.05, 0.2))
    elif r < 0.45:
        case.kind = "C"
        msgs, why = _messages(rng)
        max_tokens = _max_tokens(rng)
        options, bad = _options(rng)
        stop = _stop(rng)
        case.msg = ["C", 0, msgs, _model(rng, pools, none=True), max_tokens, options, stop, _keep_alive(rng)]
        case.must_fail = why or bad or ("max_tokens < 0" if max_tokens < 0 else "") or _stop_invalid(stop)
        if rng.random() < 0.1:
            case.cancel_after = rng.choice((0.0, 0.01, 0.1))
    elif r < 0.57:
        case.kind = "L"
        settings, why = _settings(rng, pools)
        model = pools.settled if settings and rng.random() < 0.6 else _model(rng, pools, none=False)
        case.msg = ["L", 0, model, settings, _keep_alive(rng)]
        case.must_fail = why
    elif r < 0.63:
        case.kind = "U"
        case.msg = ["U", 0, _model(rng, pools, none=False)]
    elif r < 0.68:
        case.kind = "X"  # a Cancel of an id nobody uses: no reply, nothing may happen
        case.msg = ["X", rng.choice((10**12 + index, -5, 2**64 - 1, -(2**63)))]
    elif r < 0.73:
        case.kind = "P"
        case.msg = ["P", 0]
    elif r < 0.78:
        case.kind = "S"
        case.msg = ["S", 0, _model(rng, pools, none=True)]
    elif r < 0.81:
        case.kind = "H"
        case.msg = ["H", 0]
    elif r < 0.83:
        case.kind = "V"  # Hello again, same version, on an open connection
        case.msg = ["V", 0, PROTOCOL_VERSION]
    else:
        case.kind = rng.choice(SCENES)
        case.msg = SCENE_MSG[case.kind](rng, pools)
    return case


# Scenes: on a connection of their own. Each builds its message here (so --only replays it) and
# is played by Conn-less code in play_scene.
def _garbage_msg(rng, pools):
    return [rng.choice((b"", b"\xc1", b"\x91", bytes(rng.randrange(256) for _ in range(rng.randrange(1, 64))),
                        b"\xdd\xff\xff\xff\xff", b"\xdb\xff\xff\xff\xff" + b"x" * 10, b"\x91" * 100_000 + b"\xc0"))]


def _bad_utf8_msg(rng, pools):
    return rng.choice((["G", 7, pools.good[0], MARKER, None, 1, None, [], None, False],
                       ["L", 7, MARKER, {}, None], ["C", 7, [["user", MARKER]], None, 1, None, [], None],
                       ["L", 7, pools.good[0], {MARKER: 1}, None], ["G", 7, None, "hi", None, 1, None, [MARKER]]))


def _wrong_msg(rng, pools):
    return [rng.choice((["Z", 7], ["g", 7], [], ["G"], ["G", "7", None, "hi"], ["G", 7.5, None, "hi"], [7, "G"],
                       ["P", 7, "extra"], ["H", 7, None], ["L", 7], ["L", 7, None, {}, None],
                       ["L", 7, pools.good[0], {"n_ctx": None}, None], ["L", 7, pools.good[0], {"n_ctx": [1]}, None],
                       ["L", 7, pools.good[0], {1: 2}, None], ["C", 7, [{"role": "user", "content": "hi"}]],
                       ["C", 7, [["user"]]], ["C", 7, [["user", "hi", "extra"]]], ["G", 7, None, None, [1.5]],
                       ["G", 7, None, "hi", None, 1, {"temperature": "hot"}], ["G", 7, None, "hi", None, True],
                       ["X", None], ["V", 7], ["G", 2**64 - 1, None, "hi", None, -1], ["U", 7, None],
                       {"id": 7}, "G", None, ["G", 7, None, "hi", None, 1, None, "not a list"]))]


def _hello_msg(rng, pools):
    return [rng.choice((PROTOCOL_VERSION + 1, 0, 1, -1, 2**64 - 1, PROTOCOL_VERSION))]


def _gen_msg(rng, pools):
    return ["G", 7, rng.choice(pools.good + [None]), None, [1, 2, 3], rng.choice((8, 60, 2**63 - 1)),
            None, [], None, False]


SCENE_MSG = {"garbage": _garbage_msg, "bad_utf8": _bad_utf8_msg, "wrong": _wrong_msg,
             "before_hello": lambda rng, pools: ["P", 3], "bad_version": _hello_msg,
             "huge_prefix": lambda rng, pools: [rng.choice((2**32 - 1, 16 * 2**20 + 1, 2**31))],
             "truncated": lambda rng, pools: [rng.choice((1, 2, 3, 10, 100))],
             "half_close": _gen_msg, "disconnect": _gen_msg, "dup_id": _gen_msg,
             "flood": lambda rng, pools: [rng.choice((17, 40, 80)), rng.choice(pools.good)]}
SCENES = sorted(SCENE_MSG)


def encode(msg) -> bytes:
    body = msgspec.msgpack.encode(msg)
    marker = msgspec.msgpack.encode(MARKER)[1:]
    return body.replace(marker, BAD_UTF8)


def frame(body: bytes) -> bytes:
    return HEADER.pack(len(body)) + body


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
            await _shutdown(run, daemon, pools, opts.deadline)
        mon.cancel()
        await asyncio.gather(mon, return_exceptions=True)
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
