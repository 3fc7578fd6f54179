"""Every setting of moed in one typed registry.

Each setting has a type, a default, an environment variable and a one-line meaning. `Settings.load`
merges, in increasing priority: defaults, environment, explicit keyword overrides (CLI flags or
`Engine.load(path, **settings)`). Unknown keyword settings are an error (a typo must not pass
silently); unknown environment variables are ignored.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from .errors import ConfigError
from .experts.policies import LIVE_POLICIES

NUMERICS = ("ggml", "float32")
ROUTING = ("auto", "exact", "approx", "speculative", "all")


def _meta(env: str, doc: str, choices: tuple[str, ...] | None = None, *, path: bool = False,
          daemon: bool = False, pattern: str | None = None, bounds: tuple[float, float] | None = None,
          check: Callable[[str], str | None] | None = None) -> dict[str, Any]:
    """path: the value names a file the daemon writes or reads (a client of another user may not
    set it); daemon: a setting of the daemon itself, never of one model; pattern: a regular
    expression a string value must match whole (choices with a parameter, e.g. cuda:N); bounds:
    (min, max), inclusive, of a number (for a string setting: of its value when it is a number,
    e.g. not auto); every numeric setting has them, so no value can ask for unbounded work; check:
    a validator of a string value -> what is wrong with it, or None."""
    return {"env": env, "doc": doc, "choices": choices, "path": path, "daemon": daemon, "pattern": pattern,
            "bounds": bounds, "check": check}


UID_MAX = 2**32 - 2  # uid_t is 32 bits and (uid_t)-1 means "no user"


def _check_uids(spec: str) -> str | None:
    # ASCII digits only: int() would also take "1_000", "-1" and other scripts' digits ("\u0660" is 0).
    if not re.fullmatch(r" *[0-9]{1,10} *(?:, *[0-9]{1,10} *)*", spec):  # 10 digits: uid_t's, and int() can take them
        return "expected user ids (ASCII digits) separated by commas, e.g. 1000,1001"
    bad = [u for u in spec.split(",") if int(u) > UID_MAX]
    return f"{bad[0].strip()} is not a user id (at most {UID_MAX})" if bad else None


def _check_kernel_cache(spec: str) -> str | None:
    if spec in ("on", "off") or os.path.isabs(spec):
        return None
    return "expected on, off or an absolute directory"


def allowed_uid_set(spec: str) -> frozenset[int]:
    """The user ids MOED_ALLOWED_UIDS names (empty: none besides the daemon's own user, whom the
    server always admits); ConfigError if the spec is not a comma-separated list of them."""
    if not spec:
        return frozenset()
    why = _check_uids(spec)
    if why:
        raise ConfigError(f"MOED_ALLOWED_UIDS: {spec!r}: {why}")
    return frozenset(int(u) for u in spec.split(","))


@dataclass(frozen=True)
class Settings:
    numerics: str = field(default="ggml", metadata=_meta(
        "MOE_NUMERICS", "ggml: quantize activations and round like llama.cpp's CPU backend; "
        "float32: dequantize and compute in float32 (reference mode)", NUMERICS))
    n_ctx: int = field(default=4096, metadata=_meta(
        "MOE_N_CTX", "context length (KV cache size) per sequence; 0 = the model's own, which also caps it",
        # 16 Mi positions: above any model's trained context (the cap applies anyway)
        bounds=(0, 2**24)))
    device: str = field(default="auto", metadata=_meta(
        "MOE_DEVICE", "where the model computes: cpu, cuda (GPU 0), cuda:N, or auto = a CUDA GPU when "
        "numba-cuda finds one and the model fits in its free memory, else the CPU (the log says which "
        "and why)", pattern=r"auto|cpu|cuda(:[0-9]+)?"))
    cpu_step: str = field(default="1", metadata=_meta(
        "MOE_CPU_STEP", "on the CPU, run a step (a decode batch or prompts) as one compiled call (every "
        "layer, no Python between kernels) where the model allows: the shared decoder's layers (under a "
        "cache limit, steps that may choose no more experts in a layer than its slots). 1 = compiled "
        "in the background from the second decode step, the "
        "per-op path serving until it is ready (a first compile takes about 55 s of one core, then "
        "numba's disk cache loads it in about 1 s); wait = the first step waits for it (benchmarks); "
        "0 = the per-op path only. The same tokens either way", ("1", "wait", "0")))
    cuda_graphs: bool = field(default=True, metadata=_meta(
        "MOE_CUDA_GRAPHS", "on a GPU, replay decode steps as CUDA graphs (one launch a step instead of "
        "one per kernel; the same results); 0 = launch every kernel from Python"))
    n_threads: int = field(default=0, metadata=_meta(
        "MOE_N_THREADS", "numba threads for the CPU kernels; 0 = all cores while the machine is otherwise idle, "
        "fewer while other processes keep cores busy (looked at every 0.25 s: a spin-waiting pool beside a busy "
        "competitor loses most of its speed)", bounds=(0, 1024)))
    expert_cache_limit_mb: float = field(default=0.0, metadata=_meta(
        "EXPERT_CACHE_LIMIT_MB", "host memory for expert slices across all MoE layers, split evenly per "
        "layer; 0 = unlimited", bounds=(0, 2**30)))  # 1 PiB: a limit, never allocated beyond the model
    expert_cache_policy: str = field(default="lru", metadata=_meta(
        "EXPERT_CACHE_POLICY", "with EXPERT_CACHE_LIMIT_MB: which cached expert a miss evicts: lru, lfu-decay "
        "(frequency with a decay) or lfru (a fast-decaying count for recency plus a slow one for frequency; "
        "experts/policies.py); moed trace replay compares them on real traces", LIVE_POLICIES))
    gpu_cache_mb: str = field(default="auto", metadata=_meta(
        "MOE_GPU_CACHE_MB", "on a GPU whose memory cannot hold every expert: VRAM for the expert cache, "
        "split evenly per MoE layer; auto = what is free after the weights, KV caches and a margin (moed ps "
        "shows it). Experts that fit in it all stay resident", pattern=r"auto|[0-9]+(\.[0-9]*)?",
        bounds=(0, 2**20)))  # 1 TiB: more than any GPU holds
    gpu_host_tier: bool = field(default=False, metadata=_meta(
        "MOE_GPU_HOST_TIER", "on a GPU whose memory cannot hold every expert: 1 = every expert in pinned "
        "host memory that the GPU reads in place (zero-copy), the most used MOE_GPU_CACHE_MB share also in "
        "VRAM (promoted between steps); no host work in a step (one CUDA graph), the same tokens. With "
        "EXPERT_CACHE_LIMIT_MB the host holds that share; a step that needs another expert runs again, "
        "reading it from the file first. 0 = the VRAM expert cache"))
    gpu_host_tier_moves: int = field(default=4, metadata=_meta(
        "MOE_GPU_HOST_TIER_MOVES", "with MOE_GPU_HOST_TIER: experts a layer may move into VRAM slots at "
        "each promotion (every 4 steps, off the step's path); 0 = the first experts stay", bounds=(0, 1024)))
    gpu_host_tier_cpu_mb: float = field(default=0.0, metadata=_meta(
        "MOE_GPU_HOST_TIER_CPU_MB", "with MOE_GPU_HOST_TIER: host RAM for a copy of experts in the file's "
        "layout that a CPU worker computes when a decode step misses them in VRAM, beside the GPU "
        "(hybrid compute: DRAM bandwidth added to PCIe's; results within tolerance, not bit-identical); "
        "0 = off", bounds=(0, 2**30)))
    gpu_host_tier_cpu: str = field(default="auto", metadata=_meta(
        "MOE_GPU_HOST_TIER_CPU", "with MOE_GPU_HOST_TIER_CPU_MB: missed experts a layer the CPU takes in a "
        "decode step (of at most 16 rows); auto = tuned on the measured step time, 0 when the CPU does "
        "not pay; N = always N", pattern=r"auto|[0-9]+"))
    gpu_cache_policy: str = field(default="lru", metadata=_meta(
        "MOE_GPU_CACHE_POLICY", "which VRAM expert is evicted for a miss: lru, lfu-decay (frequency "
        "with a decay), or lfru (a fast-decaying count for recency plus a slow one for frequency; "
        "experts/policies.py); moed trace replay compares them on real traces", LIVE_POLICIES))
    postfetch_enable: bool = field(default=True, metadata=_meta(
        "MOE_POSTFETCH_ENABLE", "copy a layer's missing experts to VRAM on the fetch stream while the "
        "resident ones compute, the copied ones' work waiting on the layer's copies; 0 = copy, wait, then compute"))
    postfetch_block_on_miss: bool = field(default=True, metadata=_meta(
        "MOE_POSTFETCH_BLOCK_ON_MISS", "1: a missing expert's work waits for its copy; 0: an expert not yet "
        "in VRAM is computed on the CPU (when hybrid compute is on: MOE_OFFLOAD_MIN_BATCH not 0)"))
    postfetch_max_transfers: int = field(default=4, metadata=_meta(
        "MOE_POSTFETCH_MAX_TRANSFERS", "expert copies issued per layer per step beyond the step's own "
        "misses: predicted experts and the admission of experts computed on the CPU",
        bounds=(0, 4096)))  # more than any model's experts per layer (512 at most today)
    postfetch_scratchpad_mb: float = field(default=0.0, metadata=_meta(
        "MOE_POSTFETCH_SCRATCHPAD_MB", "VRAM staging for raw expert bytes on their way into the cache "
        "(repacked on the GPU); 0 = room for eight experts' gate and up of the largest layer",
        bounds=(0, 2**20)))  # 1 TiB: more than any GPU holds
    postfetch_force_cpu: bool = field(default=False, metadata=_meta(
        "MOE_POSTFETCH_FORCE_CPU", "compute every routed expert on the CPU from host memory (llama.cpp's "
        "--cpu-moe); attention and the rest stay on the GPU"))
    postfetch_use_dedicated_streams: bool = field(default=True, metadata=_meta(
        "MOE_POSTFETCH_USE_DEDICATED_STREAMS", "expert copies on a stream of their own (overlapping "
        "compute); 0 = on the compute stream"))
    postfetch_debug: bool = field(default=False, metadata=_meta(
        "MOE_POSTFETCH_DEBUG", "log one line per MoE layer and step: hits, copies, CPU experts, bytes"))
    offload_min_batch: str = field(default="auto", metadata=_meta(
        "MOE_OFFLOAD_MIN_BATCH", "hybrid compute of experts missing from VRAM: N = on the CPU when fewer "
        "than N of the step's tokens route to it, else copied; 0 = never on the CPU (bit-identical "
        "tokens whatever the caches); auto = a cost model from bandwidths measured at load (logged)",
        pattern=r"auto|[0-9]+", bounds=(0, 2**31)))
    routing: str = field(default="auto", metadata=_meta(
        "MOE_ROUTING", "which experts load ahead of use: exact (on demand from the router only), approx "
        "(+ Path A: token embeddings x routers), speculative (+ next layer's router on the current "
        "hidden state), all (both); auto = exact, except on the CPU without a cache limit for a model the "
        "compiled decode step does not serve (MOE_CPU_STEP=0, the hybrids, shared experts): there "
        "speculative while the cache still reads experts (a cold start: 1.9-12x exact op by op), exact once "
        "it holds every expert or 8 passes in a row read nothing new (docs/benchmarks.md, issue 28)",
        ROUTING))
    routing_verbose: bool = field(default=False, metadata=_meta(
        "MOE_ROUTING_VERBOSE", "log each token's experts per layer and per-layer cache stats lines"))
    io_depth: int = field(default=8, metadata=_meta(
        "MOE_IO_DEPTH", "expert reads in flight at once",
        # each is a thread and a task of the I/O loop: 300000 took 4.6 s and 315 MB to start (issue 25)
        bounds=(1, 1024)))
    demand_reads: str = field(default="auto", metadata=_meta(
        "MOE_DEMAND_READS", "who reads the experts a step misses: compute = the compute threads, in "
        "one parallel pread while the step waits anyway; io = the I/O thread pool; auto = compute "
        "when the compute threads are at least MOE_IO_DEPTH, else io (docs/benchmarks.md, issue 11)",
        ("auto", "compute", "io")))
    expert_pack: bool = field(default=True, metadata=_meta(
        "MOE_EXPERT_PACK", "read experts from the expert pack beside the model when it is present and "
        "valid (moed pack)"))
    expert_trace_stats: bool = field(default=False, metadata=_meta(
        "MOE_EXPERT_TRACE_STATS", "count expert activations; printed at the end of each generation"))
    expert_trace_names: bool = field(default=False, metadata=_meta(
        "MOE_EXPERT_TRACE_NAMES", "log one line per expert use, naming its tensors and slice"))
    expert_trace_per_layer: bool = field(default=False, metadata=_meta(
        "MOE_EXPERT_TRACE_PER_LAYER", "break the activation counts down per layer"))
    expert_trace_output: str = field(default="", metadata=_meta(
        "MOE_EXPERT_TRACE_OUTPUT", "write the activation counts as JSON to this path (.zst: compressed)",
        path=True))
    routing_replay: str = field(default="", metadata=_meta(
        "MOE_ROUTING_REPLAY", "benchmarks only: each MoE layer uses the experts of this routing trace "
        "(jsonl or .jsonl.zst, as moed trace record writes; e.g. benchmarks/data/traces), mapped onto the "
        "model's layers and experts, instead of its router's top-k; the router still weighs them. The "
        "outputs are no longer the model's", path=True))
    kernel_cache: str = field(default="on", metadata=_meta(
        "MOED_KERNEL_CACHE", "compiled GPU kernels kept on disk, so a later load does not compile them: "
        "on = $XDG_CACHE_HOME/moed/kernels (else ~/.cache/moed/kernels), off, or an absolute directory; "
        "read from the environment once per process", path=True, daemon=True, check=_check_kernel_cache))
    # -- the daemon (moed serve) -------------------------------------------------------------------
    models: str = field(default="", metadata=_meta(
        "MOED_MODELS", "the models directory: a GGUF file or a symbolic link to one in it is a model "
        "named by its stem (`moed list`, `moed import`); empty = $XDG_DATA_HOME/moed/models, else "
        "~/.local/share/moed/models", path=True, daemon=True))
    http_host: str = field(default="127.0.0.1:11434", metadata=_meta(
        "MOED_HTTP_HOST", "where the HTTP server (Ollama's and OpenAI's APIs) listens: host:port; off = no "
        "TCP (HTTP stays on the unix socket beside MOED_SOCKET). A busy default port leaves TCP off "
        "with a warning; a non-loopback address needs MOED_API_KEY", daemon=True))
    api_key: str = field(default="", metadata=_meta(
        "MOED_API_KEY", "a secret HTTP clients send as `Authorization: Bearer KEY`: required over TCP to "
        "copy or delete models, and for everything when MOED_HTTP_HOST is not loopback", daemon=True))
    socket: str = field(default="", metadata=_meta(
        "MOED_SOCKET", "the daemon's unix socket (clients use it too); empty = $XDG_RUNTIME_DIR/moed.sock, "
        "else /tmp/moed-<uid>/moed.sock", daemon=True))
    max_frame: int = field(default=16 * 2**20, metadata=_meta(
        "MOED_MAX_FRAME", "largest IPC frame body the daemon reads and writes, bytes", daemon=True,
        # min: every reply must fit (10 bytes failed them all as "reply too large"); the largest
        # unsized one, stats, is ~70 KB per large model (94 layers x 3 tables); max: a frame is
        # buffered whole
        bounds=(2**20, 2**30)))
    queue_size: int = field(default=64, metadata=_meta(
        "MOED_QUEUE_SIZE", "generation requests and loads the daemon holds at once (decoding + waiting); "
        "more get a busy error at once", daemon=True, bounds=(1, 65536)))
    max_batch: int = field(default=16, metadata=_meta(
        "MOED_MAX_BATCH", "sequences of one model decoded together in one step (continuous batching)",
        daemon=True, bounds=(1, 1024)))
    keep_alive: float = field(default=300.0, metadata=_meta(
        "MOED_KEEP_ALIVE", "seconds an idle model stays loaded (requests may override; a request's "
        "negative value = forever); 0 = unload when idle", daemon=True,
        bounds=(0, 10**9)))  # ~31 years: keeps the timer arithmetic sane
    max_loaded_models: int = field(default=0, metadata=_meta(
        "MOED_MAX_LOADED_MODELS", "models loaded at once; one more unloads the least recently used idle "
        "one (never one kept with a negative keep-alive), or waits in the queue while all are busy; "
        "0 = 3 per GPU, or 3 without one (as Ollama)", daemon=True, bounds=(0, 1024)))
    allowed_uids: str = field(default="", metadata=_meta(
        "MOED_ALLOWED_UIDS", "comma-separated user ids (ASCII digits) that may connect besides the "
        "daemon's own user, who always may (SO_PEERCRED); empty = only the daemon's own user",
        daemon=True, check=_check_uids))
    max_prompt_bytes: int = field(default=4 * 2**20, metadata=_meta(
        "MOED_MAX_PROMPT_BYTES", "largest prompt, in UTF-8 bytes, after the chat template is applied "
        "(raw prompts too); checked before tokenizing", daemon=True,
        bounds=(1, 2**30)))  # a prompt comes in one frame: at most MOED_MAX_FRAME's max
    template_timeout: float = field(default=5.0, metadata=_meta(
        "MOED_TEMPLATE_TIMEOUT", "seconds a chat template may take to render before the request fails",
        daemon=True, bounds=(0.01, 3600)))  # 0 would fail every chat
    max_connections: int = field(default=256, metadata=_meta(
        "MOED_MAX_CONNECTIONS", "client connections the daemon holds open at once; more are refused "
        "with a busy error", daemon=True, bounds=(1, 65536)))  # the descriptor limit bounds it anyway
    max_requests_per_connection: int = field(default=16, metadata=_meta(
        "MOED_MAX_REQUESTS_PER_CONNECTION", "generation requests one connection may have open at once "
        "(queued or decoding); more get a busy error, so one client cannot fill the queue", daemon=True,
        bounds=(1, 65536)))
    frame_timeout: float = field(default=30.0, metadata=_meta(
        "MOED_FRAME_TIMEOUT", "seconds a client may take to finish sending a frame it has started; a "
        "slower one is disconnected; 0 = no limit", daemon=True, bounds=(0, 86400)))

    @classmethod
    def load(cls, env: Mapping[str, str] | None = None, **overrides: Any) -> Settings:
        env = os.environ if env is None else env
        known = {f.name: f for f in fields(cls)}
        values: dict[str, Any] = {}
        for name, f in known.items():
            raw = env.get(f.metadata["env"])
            if raw not in (None, ""):
                values[name] = _coerce(f, raw, source=f.metadata["env"])
        for name, value in overrides.items():
            if name not in known:
                raise ConfigError(f"unknown setting {name!r}; known: {', '.join(sorted(known))}")
            if value is not None:
                values[name] = _coerce(known[name], value, source=name)
        return cls(**values)

    @classmethod
    def env_value(cls, name: str, env: Mapping[str, str] | None = None) -> Any:
        """One setting from the environment alone (a process-wide switch read outside a load, where
        another setting's bad value is not this reader's error)."""
        env = os.environ if env is None else env
        f = {f.name: f for f in fields(cls)}[name]
        raw = env.get(f.metadata["env"])
        return f.default if raw in (None, "") else _coerce(f, raw, source=f.metadata["env"])

    @classmethod
    def daemon_settings(cls) -> frozenset[str]:
        """Settings of the daemon itself (rejected as per-model settings in a Load)."""
        return frozenset(f.name for f in fields(cls) if f.metadata["daemon"])

    @classmethod
    def path_settings(cls) -> frozenset[str]:
        """Settings whose value is a file path on the daemon's side."""
        return frozenset(f.name for f in fields(cls) if f.metadata["path"])

    @classmethod
    def bounds(cls) -> dict[str, tuple[float, float]]:
        """name -> (min, max), inclusive, of every setting that has a range (every numeric one)."""
        return {f.name: f.metadata["bounds"] for f in fields(cls) if f.metadata["bounds"] is not None}

    @classmethod
    def describe(cls) -> list[tuple[str, str, Any, str]]:
        """(name, env var, default, meaning) for every setting, for --help and the README."""
        return [(f.name, f.metadata["env"], f.default, f.metadata["doc"]) for f in fields(cls)]


def _coerce(f, value: Any, source: str) -> Any:
    kind = {"str": str, "int": int, "float": float, "bool": bool}[f.type] if isinstance(f.type, str) else f.type
    try:
        if kind is bool and isinstance(value, str):
            out = value.strip().lower() in ("1", "true", "yes", "on")
        elif kind in (int, float) and isinstance(value, str) and not re.fullmatch(_NUMBER[kind], value.strip(), re.I):
            raise ValueError(value)  # int()/float() also take "1_000" and other scripts' digits
        elif kind is int and isinstance(value, float) and not value.is_integer():
            raise ValueError(value)  # int() would cut 2.5 to 2 silently
        else:
            out = kind(value)
    except (TypeError, ValueError, OverflowError):
        raise ConfigError(f"{source}: expected {kind.__name__}, got {value!r}") from None
    if isinstance(out, float) and not math.isfinite(out):
        raise ConfigError(f"{source}: must be a finite number, got {value!r}")
    if isinstance(out, str) and "\0" in out:
        raise ConfigError(f"{source}: must not contain a NUL character")
    choices = f.metadata["choices"]
    if choices and out not in choices:
        raise ConfigError(f"{source}: {out!r} is not one of {', '.join(choices)}")
    pattern = f.metadata["pattern"]
    if pattern and not re.fullmatch(pattern, out):
        raise ConfigError(f"{source}: {out!r} does not match {pattern}")
    check = f.metadata["check"]
    why = check(out) if check and out else None
    if why:
        raise ConfigError(f"{source}: {out!r}: {why}")
    bounds = f.metadata["bounds"]  # every numeric setting has them (tests/test_config.py checks)
    number = float(out) if isinstance(out, str) and bounds and re.fullmatch(_NUMBER[float], out) else out
    if isinstance(number, (int, float)) and not isinstance(number, bool):
        lo, hi = bounds or (0, math.inf)
        if not lo <= number <= hi:
            raise ConfigError(f"{source}: {out!r} is out of range {span(bounds)}")
    return out


_NUMBER = {int: r"[+-]?[0-9]+",
           float: r"[+-]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]+)?|[+-]?(?:nan|inf|infinity)"}


def span(bounds: tuple[float, float] | None) -> str:
    """A range as moed settings and the errors show it: 1..1024."""
    if bounds is None:
        return ">= 0"
    return "..".join(str(n) if isinstance(n, int) else f"{n:g}" for n in bounds)
