"""cuda.bindings' driver, imported on first use (the simulator has none), and its error check:
shared by the launches (launch.py) and the backend's streams, events, copies and memory maps."""

from __future__ import annotations

_driver = None


def drv():
    global _driver
    if _driver is None:
        from cuda.bindings import driver

        _driver = driver
    return _driver


def check(result):
    """cuda.bindings returns (CUresult, values...): raise numba's CudaAPIError on failure (the
    backend turns it into a DeviceError), else the values."""
    err, *rest = result if isinstance(result, tuple) else (result,)
    d = drv()
    if err != d.CUresult.CUDA_SUCCESS:
        from numba.cuda.cudadrv.driver import CudaAPIError

        _, name = d.cuGetErrorName(err)
        raise CudaAPIError(int(err), name.decode() if isinstance(name, bytes) else str(name))
    return rest[0] if len(rest) == 1 else tuple(rest)
