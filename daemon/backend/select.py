"""Which backend a model runs on: MOE_DEVICE = auto | cpu | cuda | cuda:N.

auto takes the GPU when numba-cuda finds a real one (never its simulator) and the model's non-expert
weights fit in its free memory, else the CPU, and says which and why in one log line. Experts that
do not all fit (or more than MOE_GPU_CACHE_MB, when set) stream through a VRAM expert cache
(cuda_expert_cache.py) of MOE_GPU_CACHE_MB, by default what is free after the weights, the KV cache
of a sequence, prefill scratch and a margin of 1 GiB; `backend.expert_budget` is its size (None:
every expert resident). An explicit cuda[:N]
that cannot be had (no driver, no numba-cuda, no such GPU, the model does not fit) is a
DeviceError instead; under NUMBA_ENABLE_CUDASIM=1 an explicit cuda runs on the simulator (tests).

The fit check estimates VRAM before anything is uploaded: every tensor as it will be stored
(matrices repacked, rows padded to 16 bytes; vectors as float32), the KV cache of one sequence
of n_ctx positions (f16 keys and values), and scratch for a prefill pass.

numba.cuda is imported only when a GPU is asked for or auto probes for one: on a machine
without a driver, auto answers from a ctypes probe of libcuda alone.
"""

from __future__ import annotations

import ctypes
import importlib.util
import logging
import os
import sys
from dataclasses import dataclass

from ..errors import ConfigError, DeviceError
from .cpu import CPUBackend

log = logging.getLogger("moed.device")

PREFILL_ROWS = 512  # rows of the largest prefill pass (the scheduler's PREFILL_TOKENS)
MARGIN = 1 << 30  # VRAM left free beside an expert cache: CUDA context, op buffers, graphs, a KV pool's growth


def parse_device(value: str) -> tuple[str, int | None]:
    """"auto" / "cpu" -> (value, None); "cuda" -> ("cuda", 0); "cuda:N" -> ("cuda", N)."""
    v = value.strip().lower()
    if v in ("auto", "cpu"):
        return v, None
    if v == "cuda":
        return "cuda", 0
    if v.startswith("cuda:") and v[5:].isdigit():
        return "cuda", int(v[5:])
    raise ConfigError(f"MOE_DEVICE: {value!r} is not auto, cpu, cuda or cuda:N")


def _mb(n: float) -> str:
    return f"{n / 2**20:,.0f} MiB"


@dataclass(frozen=True)
class VRAMEstimate:
    weights: int  # non-expert tensors, as stored on the device
    experts: int
    kv_per_sequence: int  # one sequence of n_ctx positions
    scratch: int
    n_ctx: int

    @property
    def total(self) -> int:
        return self.weights + self.experts + self.kv_per_sequence + self.scratch

    def describe(self) -> str:
        return (f"{_mb(self.total)}: weights {_mb(self.weights)}, experts {_mb(self.experts)}, KV cache "
                f"{_mb(self.kv_per_sequence)} per sequence of {self.n_ctx} positions, scratch {_mb(self.scratch)}")


def estimate_vram(gguf, hp, n_ctx: int) -> VRAMEstimate:
    """What the CUDA backend will hold for this model (see the module doc)."""
    weights = experts = 0
    for ti in gguf.tensors.values():
        n_values = 1
        for d in ti.ne:
            n_values *= d
        if len(ti.ne) >= 2 and not ti.name.endswith(".bias"):  # a matrix: repacked rows
            rows = n_values // ti.ne[0]
            size = rows * (-(-(ti.nbytes // max(rows, 1)) // 16) * 16)
        else:  # norms, biases, sinks: float32
            size = 4 * n_values
        if "_exps." in ti.name:
            experts += size
        else:
            weights += size
    n_recurrent = sum(hp.recurrent)  # hybrids: KV only in the attention layers, fixed f32 states in the others
    kv = (hp.n_layer - n_recurrent) * hp.n_head_kv * (hp.head_dim + hp.head_dim_v) * 2 * n_ctx
    if n_recurrent:
        m = hp.ssm
        kv += n_recurrent * 4 * (m.conv_channels * (m.conv_kernel - 1) + m.n_v_head * m.head_v * m.head_k)
    rows = PREFILL_ROWS
    attention = rows * hp.n_head * (-(-n_ctx // 128)) * (hp.head_dim_v + 2) * 4
    widest = max(hp.n_embd, hp.n_ff, hp.n_ff_exp * max(hp.n_expert_used, 1), hp.n_head * hp.head_dim)
    scratch = attention + rows * 8 * widest * 4 + rows * hp.n_vocab * 4
    return VRAMEstimate(weights, experts, kv, scratch, n_ctx)


def _driver_gpus() -> tuple[int, str]:
    """(GPUs the CUDA driver reports, why none) through libcuda alone."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError as e:
        return 0, f"no CUDA driver ({e})"
    rc = lib.cuInit(0)
    if rc != 0:
        return 0, f"the CUDA driver failed to start (cuInit error {rc})"
    n = ctypes.c_int(0)
    if lib.cuDeviceGetCount(ctypes.byref(n)) != 0 or n.value == 0:
        return 0, "the CUDA driver reports no GPU"
    return n.value, ""


def cuda_unusable(index: int, allow_simulator: bool) -> str | None:
    """None when numba-cuda can run on GPU `index`, else why not."""
    if importlib.util.find_spec("numba_cuda") is None:
        return "numba-cuda is not installed (pip install -e '.[gpu]')"
    sim_env = os.environ.get("NUMBA_ENABLE_CUDASIM", "0") not in ("", "0")
    if "numba.cuda" not in sys.modules and not sim_env:
        count, why = _driver_gpus()  # cheap: no numba.cuda import on a machine without a GPU
        if count == 0:
            return why
    try:
        from numba import cuda

        from ..kernels.cuda.device import SIM
    except Exception as e:  # a broken install: missing bindings, bad CUDA toolkit
        return f"numba-cuda cannot start ({type(e).__name__}: {e})"
    if SIM and not allow_simulator:
        return "numba-cuda runs its simulator (NUMBA_ENABLE_CUDASIM=1), not a GPU"
    try:
        if not cuda.is_available():
            return "numba-cuda finds no usable GPU"
        count = len(cuda.gpus)
    except Exception as e:
        return f"numba-cuda cannot use the GPU ({type(e).__name__}: {e})"
    if index >= count:
        return f"there is no GPU {index} (numba-cuda sees {count})"
    return None


def _free_memory(index: int) -> tuple[float, float, str]:
    """(free bytes, total bytes, device name) of GPU `index`."""
    from numba import cuda

    cuda.select_device(index)
    free, total = cuda.current_context().get_memory_info()
    try:
        name = cuda.gpus[index].name
        name = name.decode() if isinstance(name, bytes) else str(name)
    except Exception:
        name = "GPU"
    return float(free), float(total), name


def select_backend(settings, gguf):
    """The backend settings.device asks for (see the module doc)."""
    kind, index = parse_device(settings.device)
    if kind == "cpu":
        log.info("device: cpu (MOE_DEVICE=cpu)")
        return CPUBackend(settings.numerics)
    idx = 0 if index is None else index
    explicit = kind == "cuda"
    why = cuda_unusable(idx, allow_simulator=explicit)
    if why is None:
        from ..model.family import family_for

        hp = family_for(gguf.architecture).read_hparams(gguf)
        n_ctx = min(settings.n_ctx, hp.n_ctx_train) if settings.n_ctx else hp.n_ctx_train
        need = estimate_vram(gguf, hp, n_ctx)
        try:
            free, total, name = _free_memory(idx)
        except Exception as e:
            why = f"cuda:{idx} cannot be opened ({type(e).__name__}: {e})"
        else:
            budget, short = _expert_budget(settings.gpu_cache_mb, need, free)
            if short:
                why = f"{short}; cuda:{idx} ({name}) has {_mb(free)} free of {_mb(total)}"
    if why is not None:
        if explicit:
            raise DeviceError(f"MOE_DEVICE={settings.device}: {why}")
        log.info("device: cpu (MOE_DEVICE=auto: %s)", why)
        return CPUBackend(settings.numerics)
    from .cuda import CUDABackend

    held = need.total if budget is None else need.total - need.experts + budget
    experts = "every expert resident" if budget is None else f"an expert cache of {_mb(budget)} in VRAM"
    if free == float("inf"):  # the simulator: no memory to speak of
        room = 4
        line = f"device: cuda:{idx} (numba-cuda simulator); VRAM needed about {need.describe()}; {experts}"
    else:
        room = max(1, int((free - held - (0 if budget is None else MARGIN)) // max(need.kv_per_sequence, 1)) + 1)
        line = (f"device: cuda:{idx} ({name}); VRAM needed about {need.describe()}; {_mb(free)} free of "
                f"{_mb(total)}; {experts}; room for about {room} full-length sequences")
    log.info("%s", line)
    backend = CUDABackend(idx, max_slots=max(1, min(settings.max_batch, room)), graphs=settings.cuda_graphs)
    backend.estimate = need
    backend.expert_budget = budget
    return backend


def _expert_budget(setting: str, need: VRAMEstimate, free: float) -> tuple[int | None, str]:
    """(VRAM for the expert cache, None = every expert resident; why the GPU cannot be used, or "")."""
    asked = None if setting == "auto" else int(float(setting) * 2**20)
    if asked is None and need.total <= free:
        return None, ""
    if asked is not None and asked >= need.experts and need.total <= free:
        return None, ""
    room = free - (need.total - need.experts) - MARGIN
    if room <= 0:
        return None, (f"the model needs about {need.describe()}, and {_mb(need.total - need.experts + MARGIN)} "
                      f"without its experts (margin included)")
    if asked is None:
        return int(room), ""
    if asked > room:
        log.warning("MOE_GPU_CACHE_MB=%s is more than the %s free beside the weights: the expert cache gets %s",
                    setting, _mb(room), _mb(room))
        return int(room), ""
    return asked, ""
