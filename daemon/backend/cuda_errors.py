"""numba-cuda's exception classes, which the CUDA backend turns into DeviceError (a ModelError: the
request fails, the daemon goes on) at its boundary."""

from __future__ import annotations

import importlib


def _cuda_errors() -> tuple[type[BaseException], ...]:
    """numba-cuda's driver-side exception classes (the simulator has a few of them)."""
    found = []
    for mod, names in (("numba.cuda.cudadrv.driver", ("CudaAPIError", "LinkerError", "DeadMemoryError")),
                       ("numba.cuda.cudadrv.error", ("CudaDriverError", "CudaRuntimeError", "CudaSupportError",
                                                     "NvvmError", "NvrtcError"))):
        try:
            m = importlib.import_module(mod)
        except ImportError:
            continue
        found += [getattr(m, n) for n in names if isinstance(getattr(m, n, None), type)]
    return tuple(found)


CUDA_ERRORS = _cuda_errors()
