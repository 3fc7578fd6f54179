"""`moed list`, `moed show NAME` and `moed import PATH [--name NAME]`: the models directory
(daemon/catalog.py, MOED_MODELS), read here without the daemon."""

from __future__ import annotations

import time
from pathlib import Path

from .catalog import Catalog, default_models_dir, is_path

COMMANDS = ("list", "show", "import")


def add_parsers(sub) -> None:
    sub.add_parser("list", help="list the models in the models directory (MOED_MODELS)")
    s = sub.add_parser("show", help="a model's architecture, quantization, size and context length")
    s.add_argument("model", metavar="NAME|PATH")
    i = sub.add_parser("import", help="add a GGUF file to the models directory as a symbolic link")
    i.add_argument("path", metavar="PATH")
    i.add_argument("--name", default=None, help="the model's name, NAME[:TAG] (default: the file's stem)")


def catalog(settings) -> Catalog:
    return Catalog(Path(settings.models).expanduser() if settings.models else default_models_dir())


def run(args, settings) -> int:
    cat = catalog(settings)
    if args.command == "list":
        rows = [(e.name, f"{e.size / 1e9:.1f} GB", time.strftime("%Y-%m-%d %H:%M", time.localtime(e.modified)))
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
    path = Path(args.model).expanduser().resolve() if is_path(args.model) else cat.resolve(args.model)
    for key, value in describe(path):
        print(f"{key:<16} {value}")
    return 0


def describe(path: Path) -> list[tuple[str, str]]:
    """What `moed show` prints of a GGUF file: its header's metadata, no tensor read."""
    from gguf import LlamaFileType

    from .storage.gguf import GGUFFile

    with GGUFFile(path) as g:
        arch = g.get("general.architecture", str, "?")
        ftype = g.get("general.file_type", int, None)
        try:
            quant = LlamaFileType(ftype).name.removeprefix("MOSTLY_") if ftype is not None else "?"
        except ValueError:
            quant = f"file type {ftype}"
        n_params = sum(t.n_elements for t in g.tensors.values())
        rows = [("path", str(path)), ("architecture", arch), ("quantization", quant),
                ("parameters", f"{n_params / 1e9:.2f}B"), ("size", f"{path.stat().st_size / 1e9:.2f} GB"),
                ("context length", str(g.get(f"{arch}.context_length", int, "?"))),
                ("experts", f"{g.get(f'{arch}.expert_count', int, 0)} (top {g.get(f'{arch}.expert_used_count', int, 0)})"),
                ("chat template", "yes" if g.get("tokenizer.chat_template", str, "") else "no")]
    return rows
