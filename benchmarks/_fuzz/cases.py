"""The protocol fuzzer's cases (benchmarks/fuzz_protocol.py runs them): what the absurd values are,
how case I of a seed is drawn (make_case), the protocol's own view of which requests must fail,
and the connection-level scenes' messages. Nothing here talks to a daemon.
"""

from __future__ import annotations

import dataclasses
import math
import os
import random
import shutil
from dataclasses import dataclass
from pathlib import Path

import msgspec

from daemon.config import Settings
from ipc.framing import HEADER
from ipc.protocol import PROTOCOL_VERSION

FIXTURE = ("qwen3moe", "Q8_0")
DEMO_NAME = "smollm2-135m-moe-e16k12.gguf"  # daemon/demo.py: the demo model's cache file name
N_CTX = 128
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
    out: dict = {}
    reasons: dict = {}  # per key: a key drawn twice keeps only its last value, and that value's reason
    if rng.random() < 0.45:
        return out, ""
    for _ in range(1 if rng.random() < 0.6 else rng.randrange(2, 4)):
        r = rng.random()
        if r < 0.07:
            key, v = rng.choice(("n_ctxx", "", "\0", "N_CTX", "x" * 1000)), 1
            reasons[key] = f"unknown setting {brief(key)}"
        elif r < 0.14:
            key = rng.choice(sorted(DAEMON_SETTINGS))
            v = rng.choice((1, "", 0.5))
            reasons[key] = f"daemon setting {key}"
        else:
            key = rng.choice(sorted(PATH_SETTINGS) if rng.random() < 0.15 else sorted(set(SETTINGS) - DAEMON_SETTINGS))
            if key in PATH_SETTINGS:
                paths = pools.read_paths if key == "routing_replay" else pools.write_paths  # only it is read-only
                v = rng.choice(paths).replace("%d", str(rng.randrange(100)))
            else:
                v = _setting_value(rng, SETTINGS[key])
            reasons[key] = _setting_invalid(SETTINGS[key], v)
        out[key] = v
    return out, next((why for why in reasons.values() if why), "")


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
