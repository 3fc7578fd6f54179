"""The backends every op test runs on (test-backend-ops style): each available backend, each of
its numerics. A GPU backend adds itself to BACKENDS when its device is usable."""

from __future__ import annotations

import pytest

from daemon.backend import CPUBackend

BACKENDS = {
    "cpu-ggml": lambda: CPUBackend("ggml"),
    "cpu-float32": lambda: CPUBackend("float32"),
}


@pytest.fixture(params=sorted(BACKENDS), scope="module")
def backend(request):
    return BACKENDS[request.param]()
