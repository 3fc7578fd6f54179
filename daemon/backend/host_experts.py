"""The experts' host tier: the streaming expert cache (daemon/storage/cache.py) over the model's
expert pack, or the GGUF itself. Each backend builds its expert provider on it
(`Backend.expert_provider`): the CPU computes from it, the GPU copies from it into its VRAM cache."""

from __future__ import annotations

from collections.abc import Callable

import numba

from ..config import Settings
from ..model.weights import TensorSource
from ..storage.cache import ExpertCache
from ..storage.experts import expert_biases
from ..storage.gguf import GGUFFile
from ..storage.store import ExpertStore, expert_layouts


def host_expert_cache(gguf: GGUFFile, cfg: Settings, say: Callable[[str], None],
                      allocate=None) -> ExpertCache | None:
    """The streaming expert cache over the model's expert pack (when valid) or the GGUF itself;
    None for a model without experts. allocate(shape, dtype): its slots' memory (pinned for a GPU)."""
    layouts = expert_layouts(gguf)
    if not layouts:
        return None
    store = None
    if cfg.expert_pack:
        from ..storage.pack import open_pack

        store = open_pack(gguf.path, gguf, layouts)
    store = store or ExpertStore.from_gguf(gguf, layouts)
    src = TensorSource(gguf)
    biases = {il: tuple(expert_biases(src, il, lay.n_embd, lay.n_ff, lay.n_expert)) for il, lay in layouts.items()}
    limit = f"{cfg.expert_cache_limit_mb:g} MB, {cfg.expert_cache_policy}" if cfg.expert_cache_limit_mb else "no limit"
    say(f"streaming experts from the {store.kind} ({limit})")
    return ExpertCache(store, cfg.expert_cache_limit_mb, cfg.io_depth, biases, demand_reads(cfg), allocate,
                       cfg.expert_cache_policy)


def demand_reads(cfg: Settings) -> str:
    """MOE_DEMAND_READS=auto: the compute threads when there are at least as many as reads the I/O
    pool keeps in flight (16 cores: 4.6x the I/O pool's decode with a bounded cache), else the I/O
    pool (2 cores, cold: its 8 reads in flight beat 2 threads' preads, prefill 1.4 vs 1.0 tok/s)."""
    if cfg.demand_reads != "auto":
        return cfg.demand_reads
    return "compute" if numba.get_num_threads() >= cfg.io_depth else "io"


def bytes_note(progress, what: str):
    """on_bytes(done, total) for a progress callback with a part(fraction, note) (daemon.progress.
    Progress: `moed run` draws the upload's bytes); None for a plain callback."""
    part = getattr(progress, "part", None)
    if part is None:
        return None

    def on_bytes(done: int, total: int) -> None:
        part(done / max(total, 1), f"{what} {done / 1e9:.1f}/{total / 1e9:.1f} GB")

    return on_bytes
