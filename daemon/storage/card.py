"""What a model file says about itself, from its GGUF header alone (no tensor read): what
`moed show`, /api/show, /api/tags and /api/ps report.

    card(path) -> Card      cached per file (path, size, mtime): listing a directory of 30 GB
                            files parses each header once
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Card:
    path: str
    arch: str
    quantization: str  # "Q4_K_M", "Q8_0", ... (general.file_type), "?" when the file does not say
    parameters: int  # elements of every tensor
    size: int  # bytes of the file
    context_length: int  # the trained context (0: not said)
    experts: int  # 0 for a dense model
    experts_used: int
    chat_template: str
    metadata: dict[str, Any] = field(default_factory=dict)  # scalars and strings only (no vocab arrays)

    @property
    def parameter_size(self) -> str:
        """As Ollama writes it: "30.5B", "135M"."""
        n = self.parameters
        return f"{n / 1e9:.1f}B" if n >= 1e9 else f"{n / 1e6:.0f}M"


def card(path: str | os.PathLike) -> Card:
    """The card of the GGUF file at `path` (ModelError if it cannot be read)."""
    st = os.stat(path)
    return _card(os.path.realpath(path), st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=256)
def _card(path: str, size: int, mtime_ns: int) -> Card:
    from gguf import LlamaFileType

    from .gguf import GGUFFile

    with GGUFFile(path) as g:
        arch = g.get("general.architecture", str, "?")
        ftype = g.get("general.file_type", int, None)
        try:
            quant = LlamaFileType(ftype).name.removeprefix("MOSTLY_") if ftype is not None else "?"
        except ValueError:
            quant = f"file type {ftype}"
        meta = {k: v for k, v in g.metadata.items()
                if isinstance(v, (int, float, str, bool)) and not k.startswith("tokenizer.")}
        return Card(path=path, arch=arch, quantization=quant,
                    parameters=sum(t.n_elements for t in g.tensors.values()), size=size,
                    context_length=g.get(f"{arch}.context_length", int, 0),
                    experts=g.get(f"{arch}.expert_count", int, 0),
                    experts_used=g.get(f"{arch}.expert_used_count", int, 0),
                    chat_template=g.get("tokenizer.chat_template", str, ""), metadata=meta)
