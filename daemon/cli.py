"""The moed command line.

    moed generate [MODEL] PROMPT [--chat]   stream a completion (the demo MoE when no MODEL)
    moed demo-model [--experts E --used K]  build the demo MoE from SmolLM2-135M-Instruct
    moed settings                           list every setting and its environment variable
    moed trace replay TRACE --cache-experts N  simulate expert-cache policies on a routing trace
    moed trace record MODEL PROMPT --out PATH  generate greedily and record the routing per token
    moed pack [MODEL] [--level N] [--force]  write the expert pack beside the model (the demo MoE by default)
    moed serve [--socket PATH] [--log PATH] run the daemon in the foreground (logs to stderr, or PATH)
    moed run [MODEL] [PROMPT]               generate through the daemon (started if none runs);
                                            an interactive chat without PROMPT. MODEL: a name from
                                            the models directory (`demo` is the demo MoE), or a path
    moed list | moed show MODEL | moed import PATH [--name NAME]   the models directory (MOED_MODELS)
    moed ps | moed stats [MODEL] [--json] | moed stop   loaded models, expert-cache stats, stop the daemon
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys

from . import cli_models
from .catalog import is_path
from .config import Settings, allowed_uid_set, span
from .errors import MoedError


def _add_sampling(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.8, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=40)
    p.add_argument("--top-p", type=float, default=0.95)
    p.add_argument("--min-p", type=float, default=0.05)
    p.add_argument("--repeat-penalty", type=float, default=1.1)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--numerics", choices=("ggml", "float32"), default=None)
    p.add_argument("--threads", type=int, default=None)


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="moed", description="Run Mixture-of-Experts GGUF models locally.")
    sub = ap.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="generate text from a prompt")
    g.add_argument("args", nargs="+", metavar="[MODEL] PROMPT")
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    g.add_argument("--system", default=None, help="system message (with --chat)")
    _add_sampling(g)
    d = sub.add_parser("demo-model", help="build (once) the demo MoE and print its path")
    d.add_argument("--experts", type=int, default=16)
    d.add_argument("--used", type=int, default=12)
    d.add_argument("--force", action="store_true", help="rebuild even if cached")
    sub.add_parser("settings", help="list settings and their environment variables")
    _add_trace(sub)
    _add_pack(sub)
    _add_synth(sub)
    _add_daemon(sub)
    cli_models.add_parsers(sub)
    return ap


def _add_pack(sub) -> None:
    pk = sub.add_parser("pack", help="write the expert pack (one read per expert, zstd where it pays)")
    pk.add_argument("model", nargs="?", default=None, metavar="MODEL", help="GGUF file (default: the demo MoE)")
    pk.add_argument("--level", type=int, default=3, help="zstd level 1..22 (default 3)")
    pk.add_argument("--min-saving", type=float, default=0.10,
                    help="compress an expert only if zstd saves at least this fraction (default 0.10)")
    pk.add_argument("--out", default=None, help="pack path (default: MODEL.moepack)")
    pk.add_argument("--force", action="store_true", help="rewrite an up-to-date pack")


def _add_trace(sub) -> None:
    t = sub.add_parser("trace", help="record or replay expert-routing traces")
    tsub = t.add_subparsers(dest="trace_command", required=True)
    r = tsub.add_parser("replay", help="simulate expert-cache policies on a trace; print hit rates")
    r.add_argument("trace", metavar="TRACE", help="jsonl trace (.jsonl or .jsonl.zst)")
    cap = r.add_mutually_exclusive_group(required=True)
    cap.add_argument("--cache-experts", type=int, help="cache capacity in experts per MoE layer")
    cap.add_argument("--cache-mb", type=float, help="total cache budget in MiB, split over the MoE layers")
    size = r.add_mutually_exclusive_group()
    size.add_argument("--expert-mb", type=float, help="size of one expert in MiB (with --cache-mb)")
    size.add_argument("--model", help="GGUF file giving the expert size per layer (with --cache-mb)")
    r.add_argument("--policy", default="lru,belady,lfu-decay",
                   help="comma-separated policies: lru, belady, lfu-decay, lru2, lfru (every miss inserted); "
                   "lfru-admit, opt-bypass (a miss may bypass the cache) (default lru,belady,lfu-decay)")
    r.add_argument("--json", action="store_true", help="print the results as JSON")
    rec = tsub.add_parser("record", help="generate greedily and record each token's routing")
    rec.add_argument("model", metavar="MODEL")
    rec.add_argument("prompt", metavar="PROMPT")
    rec.add_argument("--out", required=True, help="output path (.jsonl, or .jsonl.zst to compress)")
    rec.add_argument("--max-tokens", type=int, default=64)
    rec.add_argument("--threads", type=int, default=None)


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args, extra = parser.parse_known_args(argv)
    # Positionals may come after options ("generate MODEL --chat PROMPT"): collect them.
    unknown = [a for a in extra if a.startswith("-")]
    if unknown or (extra and args.command not in ("generate", "run")):
        parser.error(f"unrecognized arguments: {' '.join(unknown or extra)}")
    if extra:
        args.args += extra
    try:
        _check_utf8(args)
        if args.command == "generate":
            return _generate(args)
        if args.command == "demo-model":
            from .demo import demo_model_path
            print(demo_model_path(args.experts, args.used, force=args.force))
            return 0
        if args.command == "trace":
            return _trace(args, parser)
        if args.command == "pack":
            with _exit_on_signals():
                return _pack(args)
        if args.command == "synth":
            with _exit_on_signals():
                return _synth(args)
        if args.command in DAEMON_COMMANDS:
            return _daemon_command(args)
        if args.command in cli_models.COMMANDS:
            return cli_models.run(args, Settings.load())
        if args.command == "settings":
            bounds, rows = Settings.bounds(), Settings.describe()
            w_env, w_name = (max(len(r[i]) for r in rows) for i in (1, 0))  # aligned however long
            for name, env, default, doc in rows:
                rng = f"; range {span(bounds[name])}" if name in bounds else ""  # out of it: refused
                print(f"{env:<{w_env}} {name:<{w_name}} default {default!r:<10} {doc}{rng}")
            return 0
    except MoedError as e:
        print(f"moed: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130
    except _Signalled as e:
        print(f"\nmoed: stopped by signal {e.signum}", file=sys.stderr)
        return 128 + e.signum
    return 2


def _check_utf8(args) -> None:
    """Refuse an argument that is not valid UTF-8 (a file name from a Latin-1 disk arrives with
    surrogates): the wire, the tokenizer and the GGUF strings all take UTF-8."""
    for value in vars(args).values():
        for v in value if isinstance(value, list) else [value]:
            if isinstance(v, str):
                try:
                    v.encode("utf-8")
                except UnicodeEncodeError:
                    shown = v.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
                    raise MoedError(f"'{shown}' is not valid UTF-8; moed takes UTF-8 names and text "
                                    f"(rename the file)") from None


class _Signalled(BaseException):
    """SIGTERM or SIGHUP arrived: like KeyboardInterrupt, it unwinds through every `finally`."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


@contextlib.contextmanager
def _exit_on_signals():
    """SIGTERM and SIGHUP raise _Signalled, as SIGINT raises KeyboardInterrupt, so that the
    writers' `finally` blocks remove their partial output (synth's OUT.part, pack's .tmp)."""
    import signal

    sigs = (signal.SIGTERM, signal.SIGHUP)

    def stop(signum, frame):
        for sig in sigs:
            signal.signal(sig, signal.SIG_IGN)  # once: let the clean-up finish
        raise _Signalled(signum)

    handlers = {sig: signal.signal(sig, stop) for sig in sigs}
    try:
        yield
    finally:
        for sig, old in handlers.items():
            signal.signal(sig, old)


def _generate(args) -> int:
    from .engine import Engine
    from .progress import Renderer
    from .scheduler.models import load_engine

    if len(args.args) > 2:
        raise MoedError("generate takes [MODEL] PROMPT (quote the prompt)")
    render = Renderer()  # the daemon's load reports the same steps; `moed run` draws them alike
    if len(args.args) == 2:
        model_path, prompt = args.args
    else:
        from .demo import demo_model_path
        model_path, prompt = demo_model_path(progress=render), args.args[0]
    engine = load_engine(Engine.load, model_path, {"numerics": args.numerics, "n_threads": args.threads}, render)
    render.close()
    sampling = dict(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
                    repeat_penalty=args.repeat_penalty, seed=args.seed)
    if args.chat:
        messages = ([{"role": "system", "content": args.system}] if args.system else [])
        messages.append({"role": "user", "content": prompt})
        pieces = engine.chat(messages, max_tokens=args.max_tokens, stop=args.stop, **sampling)
    else:
        pieces = engine.generate(prompt, max_tokens=args.max_tokens, stop=args.stop, **sampling)
    for piece in pieces:
        sys.stdout.write(piece)
        sys.stdout.flush()
    sys.stdout.write("\n")
    s = engine.last_stats
    if s.eval_count:
        print(f"[{s.prompt_eval_count} prompt tokens in {s.prompt_eval_duration / 1e9:.2f}s, "
              f"{s.eval_count} tokens at {s.eval_count / max(s.eval_duration, 1) * 1e9:.1f} tok/s, "
              f"stop: {s.done_reason}]", file=sys.stderr)
    return 0


def _add_synth(sub) -> None:
    from .synth.presets import PRESETS
    sy = sub.add_parser("synth", help="write a full-size model with random weights, shaped like a real one")
    sy.add_argument("out", metavar="OUT.gguf")
    sy.add_argument("--like", required=True, metavar="NAME", help="one of: " + ", ".join(PRESETS))
    sy.add_argument("--type", default=None, help="quant mix where the model has several (qwen3-30b-a3b: Q4_K_M, Q8_0)")
    sy.add_argument("--layers", type=int, default=None, help="number of layers (default: the model's)")
    sy.add_argument("--experts", type=int, default=None, help="experts per layer")
    sy.add_argument("--used", type=int, default=None, help="experts used per token")
    sy.add_argument("--hidden", type=int, default=None, help="hidden size (small test files)")
    sy.add_argument("--ff", type=int, default=None, help="expert FFN width (small test files)")
    sy.add_argument("--heads", type=int, default=None, help="attention heads (kv heads keep the model's ratio)")
    sy.add_argument("--routing", choices=["uniform"], default="uniform",
                    help="how the random routers choose: uniform = spread over all experts, the worst case "
                         "for an expert cache (the only mode; for realistic routing in benchmarks, replay a "
                         "trace: MOE_ROUTING_REPLAY)")
    sy.add_argument("--seed", type=int, default=0)
    sy.add_argument("--force", action="store_true", help="overwrite OUT")


def _synth(args) -> int:
    import time

    from .synth import synth

    t0 = time.monotonic()
    pl = synth(args.out, args.like, type=args.type, seed=args.seed, force=args.force, n_layer=args.layers,
               n_expert=args.experts, n_expert_used=args.used, n_embd=args.hidden, n_ff_exp=args.ff,
               n_head=args.heads)
    dt = time.monotonic() - t0
    print(f"{args.out}: {pl.name} {pl.type}, {pl.preset.n_layer} layers, {pl.preset.n_expert} experts "
          f"(top {pl.preset.n_expert_used}), {pl.n_params / 1e9:.2f}B parameters, "
          f"{pl.data_bytes / 1e9:.2f} GB in {dt:.1f}s ({pl.data_bytes / 1e6 / max(dt, 1e-9):.0f} MB/s)")
    return 0


def _pack(args) -> int:
    from .storage import pack
    from .storage.gguf import GGUFFile
    from .storage.store import expert_layouts

    if args.model is None:
        from .demo import demo_model_path
        args.model = demo_model_path()
    out = pack.out_path(args.model, args.out)
    if os.path.exists(out) and not args.force:
        with GGUFFile(args.model) as g:
            try:
                pack.read_pack(out, g, expert_layouts(g))
            except pack.PackError as e:
                print(f"moed: replacing {out}: {e}", file=sys.stderr)
            else:
                raise MoedError(f"{out} is an up-to-date pack of {args.model} (--force rewrites it)")
    r = pack.write_pack(args.model, out, level=args.level, min_saving=args.min_saving, progress=True)
    print(r.table())
    print(f"{out}: {r.file_size / 1e6:.2f} MB, {r.total.raw / 1e6:.2f} MB of experts packed in "
          f"{r.elapsed:.1f}s ({r.throughput / 1e6:.0f} MB/s)")
    return 0


def _trace(args, parser) -> int:
    if args.trace_command == "record":
        return _trace_record(args)
    import json

    from .routing import replay

    tr = replay.load_trace(args.trace)
    if args.cache_experts is not None:
        if args.expert_mb is not None or args.model is not None:
            parser.error("--expert-mb/--model go with --cache-mb, not --cache-experts")
        if args.cache_experts < 0:
            parser.error("--cache-experts must be >= 0")
        capacity = args.cache_experts
    else:
        if args.expert_mb is None and args.model is None:
            parser.error("--cache-mb needs --expert-mb S or --model PATH")
        sizes = ([int(args.expert_mb * 2**20)] if args.expert_mb is not None
                 else replay.expert_bytes_per_layer(args.model))
        if min(sizes) <= 0:
            parser.error("--expert-mb must be > 0")
        capacity = replay.capacity_from_mb(args.cache_mb, sizes, len(tr))
        if len(set(capacity)) == 1:
            capacity = capacity[0]
    policies = [p.strip() for p in args.policy.split(",") if p.strip()]
    bad = [p for p in policies if p not in replay.SIMULATED]
    if bad or not policies:
        parser.error(f"unknown policy {', '.join(bad)} (choose from {', '.join(replay.SIMULATED)})")
    results = {p: replay.simulate(tr, capacity, p) for p in policies}
    if args.json:
        print(json.dumps({"capacity": capacity, "tokens": len(tr[0]),
                          "results": [r.to_dict() for r in results.values()]}))
        return 0
    print(f"{args.trace}: {len(tr[0])} tokens, {len(tr)} MoE layers, capacity "
          f"{capacity if isinstance(capacity, int) else '/'.join(map(str, capacity))} experts per layer")
    print(replay.format_table(results, capacity))
    return 0


def _trace_record(args) -> int:
    from .engine import Engine
    from .routing.trace import RoutingRecorder

    engine = Engine.load(args.model, n_threads=args.threads)
    rec = RoutingRecorder().attach(engine.model)
    try:
        for piece in engine.generate(args.prompt, max_tokens=args.max_tokens, temperature=0):
            sys.stdout.write(piece)
            sys.stdout.flush()
    finally:
        rec.detach()
    sys.stdout.write("\n")
    n = rec.write(args.out)
    print(f"[{n} tokens x {len(rec.moe_layers)} MoE layers of routing written to {args.out}]", file=sys.stderr)
    return 0


# -- the daemon and its clients ------------------------------------------------------------------

DAEMON_COMMANDS = ("serve", "run", "ps", "stats", "stop")


def _add_daemon(sub) -> None:
    def socket_arg(p):
        p.add_argument("--socket", default=None, metavar="PATH",
                       help="the daemon's socket (default: $MOED_SOCKET, else $XDG_RUNTIME_DIR/moed.sock)")

    s = sub.add_parser("serve", help="run the moed daemon in the foreground (logs to stderr)")
    socket_arg(s)
    s.add_argument("--queue-size", type=int, default=None, help="generation requests held at once (MOED_QUEUE_SIZE)")
    s.add_argument("--max-batch", type=int, default=None, help="sequences decoded together (MOED_MAX_BATCH)")
    s.add_argument("--keep-alive", type=float, default=None,
                   help="seconds an idle model stays loaded (MOED_KEEP_ALIVE; default 300)")
    s.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    s.add_argument("--log", default=None, metavar="PATH",
                   help="log to PATH instead of stderr (a private file; rotated to PATH.1 past 16 MiB)")
    r = sub.add_parser("run", help="generate through the daemon, starting one if none runs")
    r.add_argument("args", nargs="*", metavar="[MODEL] [PROMPT]",
                   help="a GGUF file (default: the demo MoE) and a prompt (default: interactive chat)")
    r.add_argument("--system", default=None, help="system message")
    r.add_argument("--keep-alive", type=float, default=None, help="seconds the model stays loaded when idle")
    r.add_argument("--raw", action="store_true", help="send the prompt without the chat template")
    r.add_argument("--verbose", action="store_true", help="print counts and speeds after each reply")
    r.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for each reply")
    _add_sampling(r)
    socket_arg(r)
    p = sub.add_parser("ps", help="list the models the daemon has loaded")
    socket_arg(p)
    st = sub.add_parser("stats", help="expert-cache and routing statistics per layer")
    st.add_argument("model", nargs="?", default=None, metavar="MODEL")
    st.add_argument("--json", action="store_true", help="print the daemon's statistics as JSON")
    socket_arg(st)
    sp = sub.add_parser("stop", help="stop the daemon (running generations end with an error)")
    socket_arg(sp)


def _daemon_command(args) -> int:
    from ipc.errors import ClientError

    if args.command == "serve":
        return _serve(args)
    try:
        return {"run": _run, "ps": _ps, "stats": _stats, "stop": _stop}[args.command](args)
    except ClientError as e:
        print(f"moed: error: {e}", file=sys.stderr)
        return 1


def _serve(args) -> int:
    import logging

    from . import service

    handler = logging.StreamHandler(sys.stderr)
    if args.log is not None:  # stdout and stderr go to the log, rotated past LOG_MAX_BYTES
        from .logfile import RotatingStderr, open_log

        fd = open_log(args.log)
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
        handler = RotatingStderr(args.log)
    configure_logging(handler, args.verbose)
    overrides = {"queue_size": args.queue_size, "max_batch": args.max_batch, "keep_alive": args.keep_alive}
    settings = Settings.load(**overrides)
    return service.serve(settings, _socket(args))


def configure_logging(handler, verbose: bool) -> None:
    """moed's own records (loggers "moed.*") at INFO; other libraries' at WARNING, so that
    numba-cuda's per-free INFO records ("add pending dealloc": ~20,000 lines a run on a GPU) stay out
    of the log. -v: everything at DEBUG."""
    import logging

    logging.basicConfig(handlers=[handler], format="%(asctime)s moed[%(process)d] %(levelname)s %(message)s")
    logging.getLogger().setLevel(logging.DEBUG if verbose else logging.WARNING)
    logging.getLogger("moed").setLevel(logging.DEBUG if verbose else logging.INFO)


def _socket(args) -> str:
    from ipc.client import default_socket_path

    # Absolute: the daemon runs in "/" and `moed stop` may run from another directory.
    return os.path.abspath(args.socket or Settings.load().socket or default_socket_path())


def _start_daemon(path: str, reply_timeout: float | None = None, timeout: float = 60.0):
    """A Client connected to the daemon on `path`, starting `moed serve` in the background first if
    nothing answers there."""
    import subprocess
    import time

    from ipc.client import Client
    from ipc.errors import NotRunning, Timeout
    from ipc.server import prepare_socket_dir

    from .logfile import open_log

    path = os.path.abspath(path)  # the daemon runs in "/": a relative path would bind there
    client = Client(path, timeout=reply_timeout)
    try:
        client.connect()
        return client
    except NotRunning:
        pass
    log_path = os.path.splitext(path)[0] + ".log"
    # Before the log goes there: no other user may write in it.
    prepare_socket_dir(path, allowed_uid_set(Settings.load().allowed_uids))
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # so `-m daemon.cli` imports from "/"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    log_fd = open_log(log_path)  # never a planted link, FIFO or file of another user
    print(f"moed: starting the daemon on {path} (log: {log_path})", file=sys.stderr)
    with os.fdopen(log_fd, "ab") as log:
        proc = subprocess.Popen([sys.executable, "-m", "daemon.cli", "serve", "--socket", path, "--log", log_path],
                                stdin=subprocess.DEVNULL, stdout=log, stderr=log, cwd="/", env=env,
                                start_new_session=True, close_fds=True)
    deadline = time.monotonic() + timeout
    while True:
        try:
            client.connect()
            return client
        except (NotRunning, Timeout):
            if proc.poll() is not None:
                tail = _tail(log_path)
                raise MoedError(f"the daemon exited with status {proc.returncode}{tail}") from None
            if time.monotonic() > deadline:
                raise MoedError(f"the daemon did not answer on {path} within {timeout:.0f}s (see {log_path})") from None
            time.sleep(0.05)


def _tail(path: str, n: int = 5) -> str:
    from .logfile import tail

    lines = tail(path, n)  # as carefully opened as the log itself: a FIFO must not hang us
    return ":\n" + "\n".join(lines) if lines else ""


def _run_model_and_prompt(words: list[str]) -> tuple[str | None, str | None]:
    if len(words) > 2:
        raise MoedError("run takes [MODEL] [PROMPT] (quote the prompt)")
    if len(words) == 2:
        return words[0], words[1]
    if len(words) == 1:
        w = words[0]
        if w.endswith(".gguf") or os.path.isfile(w) or _is_model_name(w):
            return w, None
        return None, w
    return None, None


def _is_model_name(word: str) -> bool:
    """Whether a lone word of `moed run` names a model (`demo`, or one in the models directory)
    rather than being a one-word prompt."""
    from .catalog import DEMO, Catalog, full_name

    try:
        name = full_name(word)
    except MoedError:
        return False
    return name == f"{DEMO}:latest" or any(e.name == name for e in Catalog.of(Settings.load()).entries())


def _run(args) -> int:
    from .progress import Renderer

    model, prompt = _run_model_and_prompt(args.args)
    if model is not None and (is_path(model) or os.path.exists(model)):  # else a name: the daemon resolves it
        if not os.path.exists(model):
            raise MoedError(f"no model file {model}")
        model = os.path.abspath(model)  # the daemon has its own working directory
    options = {"temperature": args.temperature, "top_k": args.top_k, "top_p": args.top_p, "min_p": args.min_p,
               "repeat_penalty": args.repeat_penalty, "seed": args.seed}
    load = {k: v for k, v in (("numerics", args.numerics), ("n_threads", args.threads)) if v is not None}
    if load and model is None:
        raise MoedError("--numerics/--threads are load settings: name the MODEL")
    client = _start_daemon(_socket(args), args.timeout)
    render = Renderer()  # the daemon's Progress replies (demo build, load, compile), as `moed generate` draws them
    kw = {"model": model, "max_tokens": args.max_tokens, "options": options, "stop": args.stop,
          "keep_alive": args.keep_alive, "on_progress": lambda p: render(p.phase, p.percent, p.message)}
    with client:
        if load:
            client.load(model, keep_alive=args.keep_alive, on_progress=kw["on_progress"], **load)
            render.close()
        if prompt is not None:
            if args.system and not args.raw:
                gen = client.chat([{"role": "system", "content": args.system}, {"role": "user", "content": prompt}],
                                  **kw)
            else:
                gen = client.generate(prompt, raw=args.raw, **kw)
            _stream(gen, args.verbose, render)
            return 0
        return _chat_loop(client, args, kw, render)


def _stream(gen, verbose: bool, render) -> str:
    parts = []
    try:
        with gen:
            for chunk in gen:
                render.close()  # the reply starts on a line of its own
                parts.append(chunk.text)
                sys.stdout.write(chunk.text)
                sys.stdout.flush()
    finally:
        render.close()  # also when the reply failed or was empty
    sys.stdout.write("\n")
    sys.stdout.flush()
    d = gen.done
    if verbose and d is not None:
        print(f"[load {d.load_duration / 1e9:.2f}s, prompt {d.prompt_eval_count} tokens in "
              f"{d.prompt_eval_duration / 1e9:.2f}s, {d.eval_count} tokens at "
              f"{d.eval_count / max(d.eval_duration, 1) * 1e9:.1f} tok/s, total {d.total_duration / 1e9:.2f}s, "
              f"stop: {d.done_reason}]", file=sys.stderr)
    return "".join(parts)


def _chat_loop(client, args, kw, render) -> int:
    interactive = sys.stdin.isatty()
    messages = [{"role": "system", "content": args.system}] if args.system else []
    if interactive:
        print("moed: chatting (Ctrl-D or /bye to leave)", file=sys.stderr)
    while True:
        try:
            line = input(">>> " if interactive else "")
        except EOFError:
            break
        if line.strip() in ("/bye", "/exit", "/quit"):
            break
        if not line.strip():
            continue
        messages.append({"role": "user", "content": line})
        try:
            reply = _stream(client.chat(messages, **kw), args.verbose, render)
        except KeyboardInterrupt:  # stop this reply, keep chatting
            print(file=sys.stderr)
            messages.pop()
            continue
        messages.append({"role": "assistant", "content": reply})
    return 0


def _ps(args) -> int:
    import time

    from ipc.client import Client

    with Client(_socket(args)) as c:
        models = c.ps()
    print(f"{'NAME':<40} {'ARCH':<10} {'SIZE':>10} {'EXPERTS':>10} {'DEVICE':>7} {'VRAM':>10} {'GPU CACHE':>10} "
          f"{'ACTIVE':>6}  UNTIL")
    for m in models:
        until = ("forever" if m.expires_at is None else
                 f"{max(0.0, m.expires_at - time.time()):.0f}s from now")
        experts = _mb(m.expert_cache_bytes) + (f"/{_mb(m.expert_cache_limit_bytes)}" if m.expert_cache_limit_bytes else "")
        vram = _mb(m.vram_bytes) if m.vram_bytes else "-"
        gpu_cache = _mb(m.gpu_cache_bytes) if m.gpu_cache_bytes else "-"
        print(f"{m.name:<40} {m.arch:<10} {_mb(m.size_bytes):>10} {experts:>10} {m.device or '-':>7} {vram:>10} "
              f"{gpu_cache:>10} {m.active:>6}  {until}")
    return 0


def _mb(n: int) -> str:
    return f"{n / 2**20:.1f}MB"


def _stats(args) -> int:
    import json

    from ipc.client import Client

    model = os.path.abspath(args.model) if args.model and os.path.exists(args.model) else args.model
    with Client(_socket(args)) as c:
        stats = c.stats(model)
    if args.json:
        print(json.dumps(stats, indent=1, default=str))
        return 0
    if not stats:
        print("no model is loaded")
        return 0
    for name, s in stats.items():
        sch = s.get("scheduler") or {}
        print(f"{name}: {sch.get('steps', 0)} decode steps, {sch.get('step_tokens', 0)} tokens, "
              f"mean batch {sch.get('mean_batch', 0)}, peak {sch.get('peak_batch', 0)}")
        cache = s.get("cache")
        if not cache:
            print("  (no experts)")
            continue
        print(f"  experts from the {cache['source']} ({cache['path']}), limit "
              f"{cache['limit_mb'] or 'none'} MB, {_mb(cache['cached_bytes'])} cached")
        recall = ((s.get("routing") or {}).get("recall") or {})
        cols = ("requests", "hits", "misses", "hit_rate", "loads", "evictions", "bytes_read",
                "prefetch_used", "prefetch_wasted")
        print("  " + f"{'layer':>5} " + " ".join(f"{c:>15}" for c in cols) + f" {'path_a':>7} {'spec':>7}")
        rows = sorted(cache["layers"].items(), key=lambda kv: int(kv[0])) + [("total", cache["total"])]
        for layer, row in rows:
            a = ((recall.get("path_a") or {}).get("per_layer") or {})
            sp = ((recall.get("speculative") or {}).get("per_layer") or {})
            key = str(layer)
            ra = a.get(key, a.get(layer)) if layer != "total" else (recall.get("path_a") or {}).get("overall")
            rs = sp.get(key, sp.get(layer)) if layer != "total" else (recall.get("speculative") or {}).get("overall")
            print("  " + f"{layer!s:>5} " + " ".join(f"{_fmt(row.get(c)):>15}" for c in cols)
                  + f" {_fmt(ra):>7} {_fmt(rs):>7}")
    return 0


def _fmt(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.3f}"
    return str(v)


def _stop(args) -> int:
    from ipc.client import Client
    from ipc.errors import NotRunning

    path = _socket(args)
    try:
        with Client(path) as c:
            c.shutdown()
    except NotRunning:
        print(f"moed: no daemon is running on {path}", file=sys.stderr)
        return 1
    print(f"moed: stopped the daemon on {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
