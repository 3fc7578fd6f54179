"""How many models the daemon holds at once, and whether one more fits in host memory.

    default_max_loaded()     MOED_MAX_LOADED_MODELS=0: 3 per GPU, or 3 without one (as Ollama)
    mem_available()          MemAvailable of /proc/meminfo, bytes (None where there is none)
    host_need(path, settings) -> HostNeed | None
                             what a load that will compute on the CPU holds in host memory: its
                             resident (non-expert) tensors plus its expert cache limit (an unlimited
                             cache, EXPERT_CACHE_LIMIT_MB=0, counts as 0: it grows on demand). None
                             on a GPU, where the backend's VRAM estimate decides (backend/select.py).

Nothing here imports numba: the GPU count comes from libcuda alone, as select.py's probe does.
"""

from __future__ import annotations

import ctypes
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


def host_need(path: str, settings: Mapping[str, Any]) -> HostNeed | None:
    cfg = Settings.load(**settings)  # as Engine.load reads them: environment, then the Load's
    if not _on_cpu(cfg):
        return None
    from ..storage.gguf import GGUFFile  # the header only: no tensor data is read

    with GGUFFile(path) as gguf:
        resident = sum(t.nbytes for name, t in gguf.tensors.items() if "_exps." not in name)
    return HostNeed(resident, int(cfg.expert_cache_limit_mb * 2**20))
