"""The moed command line.

    moed generate [MODEL] PROMPT [--chat]   stream a completion (the demo MoE when no MODEL)
    moed demo-model [--experts E --used K]  build the demo MoE from SmolLM2-135M-Instruct
    moed settings                           list every setting and its environment variable
"""

from __future__ import annotations

import argparse
import sys

from .config import Settings
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
    return ap


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args, extra = parser.parse_known_args(argv)
    # Positionals may come after options ("generate MODEL --chat PROMPT"): collect them.
    unknown = [a for a in extra if a.startswith("-")]
    if unknown or (extra and args.command != "generate"):
        parser.error(f"unrecognized arguments: {' '.join(unknown or extra)}")
    if extra:
        args.args += extra
    try:
        if args.command == "generate":
            return _generate(args)
        if args.command == "demo-model":
            from .demo import demo_model_path
            print(demo_model_path(args.experts, args.used, force=args.force))
            return 0
        if args.command == "settings":
            for name, env, default, doc in Settings.describe():
                print(f"{env:<24} {name:<22} default {default!r:<10} {doc}")
            return 0
    except MoedError as e:
        print(f"moed: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130
    return 2


def _generate(args) -> int:
    from .engine import Engine
    from .progress import Progress

    if len(args.args) > 2:
        raise MoedError("generate takes [MODEL] PROMPT (quote the prompt)")
    if len(args.args) == 2:
        model_path, prompt = args.args
    else:
        from .demo import demo_model_path
        model_path, prompt = demo_model_path(), args.args[0]
    steps = ["reading", "building", "tokenizer", "warming kernels"]
    bar = Progress("loading", len(steps))
    engine = Engine.load(model_path, progress=lambda msg: bar.advance(note=msg),
                         numerics=args.numerics, n_threads=args.threads)
    engine.forward(engine.tokenize("warm", add_special=False) or [0])  # compiles the kernels once
    bar.close()
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


if __name__ == "__main__":
    sys.exit(main())
