"""Model names (issue 29, item 4): the models directory, where a GGUF file, or a symbolic link to
one, is a model named by its file's stem.

A reference is a path when it contains "/" (the CLI makes it absolute; only the unix sockets take
paths). Otherwise it is a name, with an optional tag as Ollama writes them: "qwen3" and
"qwen3:latest" are one model, the file `qwen3.gguf` (or `qwen3:latest.gguf`); "qwen3:30b" is the file
`qwen3:30b.gguf`. `demo` is the demo MoE, built on first use, unless the directory has its own.
`import_model` links a file in under a name (a symbolic link: never a copy of a 30 GB file).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from .errors import RequestError, SchedulerError

SUFFIX = ".gguf"
LATEST = "latest"
DEMO = "demo"
# a name: letters, digits and . _ - (not first), then an optional :tag of the same
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}(?::[A-Za-z0-9][A-Za-z0-9._-]{0,127})?")


def default_models_dir() -> Path:
    """$XDG_DATA_HOME/moed/models, else ~/.local/share/moed/models."""
    base = os.environ.get("XDG_DATA_HOME") or os.path.join(os.path.expanduser("~"), ".local", "share")
    return Path(base) / "moed" / "models"


def is_path(ref: str) -> bool:
    """Whether a model reference is a file path rather than a name."""
    return "/" in ref


def split_tag(name: str) -> tuple[str, str]:
    """"qwen3" -> ("qwen3", "latest"); "qwen3:30b" -> ("qwen3", "30b"). RequestError for anything
    that is not a name."""
    if is_path(name) or not _NAME.fullmatch(name):
        raise RequestError(f"{name!r} is not a model name (letters, digits, '.', '_' and '-', with an "
                           "optional ':tag')")
    base, _, tag = name.partition(":")
    return base, tag or LATEST


def full_name(name: str) -> str:
    """The name with its tag: "qwen3" -> "qwen3:latest"."""
    base, tag = split_tag(name)
    return f"{base}:{tag}"


@dataclass(frozen=True)
class ModelEntry:
    name: str  # with its tag, as /api/tags lists it
    path: Path  # the file in the directory (a link stays a link)
    size: int  # bytes of the file it names
    modified: float  # seconds since the epoch, of that file


class Catalog:
    """The models in one directory (it need not exist: then it lists none)."""

    def __init__(self, directory: str | os.PathLike):
        self.directory = Path(directory)

    @classmethod
    def of(cls, settings) -> Catalog:
        """The directory Settings.models names (MOED_MODELS), else default_models_dir()."""
        return cls(Path(settings.models).expanduser() if settings.models else default_models_dir())

    def _file(self, base: str, tag: str) -> Path | None:
        candidates = [f"{base}:{tag}{SUFFIX}"] + ([f"{base}{SUFFIX}"] if tag == LATEST else [])
        for c in candidates:
            p = self.directory / c
            if p.is_file():  # follows a link: a dangling one is no model
                return p
        return None

    def resolve(self, name: str) -> Path:
        """The file a name names. SchedulerError "not_found" when the directory has none (`demo`
        is the caller's to build)."""
        base, tag = split_tag(name)
        p = self._file(base, tag)
        if p is None:
            raise SchedulerError("not_found", f"model {full_name(name)!r} not found in {self.directory} "
                                f"(`moed list` shows the models; `moed import PATH` adds one)")
        return p

    def entries(self) -> list[ModelEntry]:
        """Every model, by name. Links whose target is gone are left out."""
        out = {}
        try:
            files = sorted(self.directory.iterdir())
        except FileNotFoundError:
            return []
        for p in files:
            if p.suffix != SUFFIX or not _NAME.fullmatch(p.stem):
                continue
            try:
                st = p.stat()  # the target's
            except OSError:
                continue
            name = full_name(p.stem)
            out.setdefault(name, ModelEntry(name, p, st.st_size, st.st_mtime))
        return sorted(out.values(), key=lambda e: e.name)

    def import_model(self, path: str | os.PathLike, name: str | None = None) -> ModelEntry:
        """A symbolic link to the GGUF file at `path`, named `name` (default: the file's stem).
        RequestError for a bad name, a name taken, or no file at `path`."""
        src = Path(path).expanduser().resolve()
        if not src.is_file():
            raise RequestError(f"{src}: no such file")
        base, tag = split_tag(name if name is not None else src.name.removesuffix(SUFFIX))
        stem = base if tag == LATEST else f"{base}:{tag}"
        if self._file(base, tag) is not None:
            raise RequestError(f"a model named {base}:{tag} exists in {self.directory} (choose another with --name)")
        self.directory.mkdir(parents=True, exist_ok=True)
        link = self.directory / f"{stem}{SUFFIX}"
        link.symlink_to(src)
        st = link.stat()
        return ModelEntry(f"{base}:{tag}", link, st.st_size, st.st_mtime)

    def remove(self, name: str) -> None:
        """Remove a model's symbolic link (an import, or a copy made by /api/copy). A regular file
        is left alone: RequestError (moed never deletes a model's data)."""
        p = self.resolve(name)
        if not p.is_symlink():
            raise RequestError(f"{p} is a file, not a link: moed does not delete model files; remove it yourself")
        p.unlink()
