"""How many models the daemon holds at once, and whether one more fits in host memory.

    default_max_loaded()     MOED_MAX_LOADED_MODELS=0: 3 per GPU, or 3 without one (as Ollama)
    mem_available()          MemAvailable of /proc/meminfo, bytes (None where there is none)
    host_need(path, settings, known) -> HostNeed | None
                             what a load that will compute on the CPU holds in host memory: its
                             resident (non-expert) tensors plus its expert cache limit (an unlimited
                             cache, EXPERT_CACHE_LIMIT_MB=0, counts as 0: it grows on demand). None
                             on a GPU, where the backend's VRAM estimate decides (backend/select.py).
                             The resident bytes come from `known` (ResidentBytes: files loaded or
                             read before, by identity) or from the GGUF header (about 0.25 s for a
                             49k-token vocabulary on a busy 2-core machine).
    check_model_file(path, known) -> resident bytes
                             the header check alone (raises as the load would), on CPU or GPU

Nothing here imports numba: the GPU count comes from libcuda alone, as select.py's probe does.
"""

from __future__ import annotations

import ctypes
import os
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..config import Settings
from ..errors import SchedulerError

MODELS_PER_DEVICE = 3


def gpu_count() -> int:
    """GPUs the CUDA driver reports; 0 without a driver."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return 0
    n = ctypes.c_int(0)
    if lib.cuInit(0) != 0 or lib.cuDeviceGetCount(ctypes.byref(n)) != 0:
        return 0
    return max(0, n.value)


def default_max_loaded(gpus: int | None = None) -> int:
    return MODELS_PER_DEVICE * max(1, gpu_count() if gpus is None else gpus)


def mem_available(meminfo: str = "/proc/meminfo") -> int | None:
    try:
        with open(meminfo) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024  # the kernel writes kB (KiB)
    except (OSError, ValueError, IndexError):
        pass
    return None


def _mib(n: int) -> str:
    return f"{n / 2**20:,.0f} MiB"


def _on_cpu(cfg: Settings) -> bool:
    if cfg.device == "cpu":
        return True
    return cfg.device == "auto" and gpu_count() == 0  # with a GPU, auto decides by VRAM at load


@dataclass(frozen=True)
class HostNeed:
    resident: int  # non-expert tensors, bytes
    cache: int  # the expert cache limit, bytes

    @property
    def total(self) -> int:
        return self.resident + self.cache

    def refusal(self, path: str, free: int) -> SchedulerError:
        return SchedulerError("model_error", f"{path} needs about {_mib(self.total)} of host memory (weights "
                                             f"{_mib(self.resident)}, expert cache limit {_mib(self.cache)}), "
                                             f"but {_mib(free)} is available; unload a model, or lower "
                                             f"EXPERT_CACHE_LIMIT_MB")


def resident_bytes(tensors: Mapping[str, Any]) -> int:
    """The non-expert tensors' bytes (name -> TensorInfo): what a CPU load holds whatever its cache."""
    return sum(t.nbytes for name, t in tensors.items() if "_exps." not in name)


class ResidentBytes:
    """resident_bytes of files already read, by identity (device, inode, size, mtime): a reload
    costs a stat instead of a header parse. Bounded; dict operations only, so threads may share it."""

    LIMIT = 256

    def __init__(self):
        self._known: OrderedDict[tuple, int] = OrderedDict()

    @staticmethod
    def key(st: os.stat_result) -> tuple[int, int, int, int]:
        return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns

    def get(self, st: os.stat_result) -> int | None:
        return self._known.get(self.key(st))

    def put(self, key: tuple[int, int, int, int], resident: int) -> None:
        self._known[key] = resident
        while len(self._known) > self.LIMIT:
            self._known.popitem(last=False)


def host_need(path: str, settings: Mapping[str, Any], known: ResidentBytes | None = None) -> HostNeed | None:
    cfg = Settings.load(**settings)  # as Engine.load reads them: environment, then the Load's
    if not _on_cpu(cfg):
        return None
    return HostNeed(check_model_file(path, known), int(cfg.expert_cache_limit_mb * 2**20))


def check_model_file(path: str, known: ResidentBytes | None = None) -> int:
    """The file's resident bytes, read from its GGUF header (or from `known`, a stat): raises as the
    load would (ModelError, GGUFError, OSError) for what is not a regular file, not GGUF, or a header
    or tensor data that runs past the file's end."""
    st = os.stat(path)
    resident = known.get(st) if known is not None else None
    if resident is None:
        from ..storage.gguf import GGUFFile  # the header only: no tensor data is read

        with GGUFFile(path) as gguf:
            resident = resident_bytes(gguf.tensors)
        if known is not None:
            known.put(known.key(st), resident)
    return resident
