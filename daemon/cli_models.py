"""`moed list`, `moed show NAME` and `moed import PATH [--name NAME]`: the models directory
(daemon/catalog.py, MOED_MODELS), read here without the daemon."""

from __future__ import annotations

import time
from pathlib import Path

from .catalog import Catalog, is_path

COMMANDS = ("list", "show", "import")


def add_parsers(sub) -> None:
    sub.add_parser("list", help="list the models in the models directory (MOED_MODELS)")
    s = sub.add_parser("show", help="a model's architecture, quantization, size and context length")
    s.add_argument("model", metavar="NAME|PATH")
    i = sub.add_parser("import", help="add a GGUF file to the models directory as a symbolic link")
    i.add_argument("path", metavar="PATH")
    i.add_argument("--name", default=None, help="the model's name, NAME[:TAG] (default: the file's stem)")


def run(args, settings) -> int:
    cat = Catalog.of(settings)
    if args.command == "list":
        rows = [(e.name, _size(e.size), time.strftime("%Y-%m-%d %H:%M", time.localtime(e.modified)))
                for e in cat.entries()]
        if not rows:
            print(f"no models in {cat.directory} (add one with `moed import PATH`)")
            return 0
        w = max(len(r[0]) for r in rows)
        print(f"{'NAME':<{w}}  {'SIZE':>8}  MODIFIED")
        for name, size, when in rows:
            print(f"{name:<{w}}  {size:>8}  {when}")
        return 0
    if args.command == "import":
        e = cat.import_model(args.path, args.name)
        print(f"{e.name} -> {Path(args.path).expanduser().resolve()} ({e.size / 1e9:.1f} GB)")
        return 0
    path = Path(args.model).expanduser().resolve() if is_path(args.model) else _named(cat, args.model)
    for key, value in describe(path):
        print(f"{key:<16} {value}")
    return 0


def _named(cat: Catalog, name: str) -> Path:
    """A name's file; `demo` is the demo MoE (built first if need be) unless the directory has one."""
    from .catalog import DEMO, full_name
    from .errors import SchedulerError

    try:
        return cat.resolve(name)
    except SchedulerError:
        if full_name(name) != f"{DEMO}:latest":
            raise
    from .demo import demo_model_path

    return Path(demo_model_path())


def describe(path: Path) -> list[tuple[str, str]]:
    """What `moed show` prints of a GGUF file: its header's metadata, no tensor read."""
    from .storage.card import card

    c = card(path)
    experts = f"{c.experts} (top {c.experts_used})" if c.experts else "none (dense)"
    return [("path", str(path)), ("architecture", c.arch), ("quantization", c.quantization),
            ("parameters", f"{c.parameters / 1e9:.2f}B"), ("size", f"{c.size / 1e9:.2f} GB"),
            ("context length", str(c.context_length or "?")), ("experts", experts),
            ("chat template", "yes" if c.chat_template else "no")]


def _size(n: int) -> str:
    return f"{n / 1e9:.1f} GB" if n >= 1e9 else f"{n / 1e6:.0f} MB"
