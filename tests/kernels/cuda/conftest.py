"""The CUDA kernel tests run on a real GPU when the driver reports one, else under numba's CUDA
simulator (CI has no GPU), and are skipped when numba-cuda cannot run at all.

numba-cuda reads NUMBA_ENABLE_CUDASIM once, when numba.cuda is first imported, so the choice is made
here, before any test module imports it:
- NUMBA_ENABLE_CUDASIM set by the caller: honoured (1 = simulator, 0 = the GPU);
- unset: the GPU if libcuda loads and counts at least one device, else the simulator.
The variable is set only for that import and then restored, so that subprocesses (daemons started by
other tests) do not inherit the simulator and mistake it for a GPU.
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
import sys


def _gpu_count() -> int:
    """Devices the CUDA driver reports, without importing numba.cuda (0 without a driver)."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
        if lib.cuInit(0) != 0:
            return 0
        n = ctypes.c_int(0)
        return n.value if lib.cuDeviceGetCount(ctypes.byref(n)) == 0 else 0
    except (OSError, AttributeError):
        return 0


def _select() -> str | None:
    """Import numba.cuda in the chosen mode. -> None when usable, else why the tests are skipped."""
    if importlib.util.find_spec("numba_cuda") is None:
        return "numba-cuda is not installed (pip install -e '.[gpu]')"
    if "numba.cuda" not in sys.modules:
        given = os.environ.get("NUMBA_ENABLE_CUDASIM")
        if given is None and _gpu_count() == 0:
            os.environ["NUMBA_ENABLE_CUDASIM"] = "1"
        try:
            import numba.cuda  # noqa: F401  (latches the mode)
        finally:
            if given is None:
                os.environ.pop("NUMBA_ENABLE_CUDASIM", None)
    from numba import cuda

    if not cuda.is_available():
        return "NUMBA_ENABLE_CUDASIM=0 but no usable GPU"
    return None


SKIP_REASON = _select()
if SKIP_REASON is not None:
    collect_ignore_glob = ["test_*.py"]
