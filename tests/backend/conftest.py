"""The backends every op test runs on (test-backend-ops style): each available backend, each of
its numerics. The CUDA backend joins when numba-cuda can run: on a GPU, else under numba's CUDA
simulator (tests/kernels/cuda/conftest.py makes that choice before numba.cuda is imported).

The simulator runs every device thread in Python (about a millisecond each on 2 cores), so there
the CUDA backend runs the subset SIMULATOR_SUBSET of these tests (its kernels are tested one by
one in tests/kernels/cuda, under the simulator too); on a GPU it runs them all."""

from __future__ import annotations

import fnmatch

import pytest

# first: it picks the GPU or the simulator as numba.cuda is imported, and numba reads the
# simulator flag when numba itself is first imported (daemon.backend imports numba)
from tests.kernels.cuda.conftest import SKIP_REASON as CUDA_SKIP_REASON  # isort: skip

from daemon.backend import CPUBackend


def _cuda():
    from daemon.backend.cuda import CUDABackend

    return CUDABackend(0)


BACKENDS = {
    "cpu-ggml": lambda: CPUBackend("ggml"),
    "cpu-float32": lambda: CPUBackend("float32"),
}
if CUDA_SKIP_REASON is None:
    BACKENDS["cuda"] = _cuda


@pytest.fixture(params=sorted(BACKENDS), scope="module")
def backend(request):
    return BACKENDS[request.param]()


def simulated(backend) -> bool:
    """The backend is the CUDA one under numba's simulator."""
    return bool(getattr(backend, "simulator", False))


# test name -> the ids (fnmatch patterns, after "cuda-") of its CUDA cases run under the simulator:
# one case per op and kernel path, each taking seconds there. Test files named test_cuda_* pick
# their own simulator cases.
SIMULATOR_SUBSET = {
    "test_embed": ["*"],
    "test_linear": ["1-*", "9-F16"],  # the tiled matmul: test_cuda_backend, tests/kernels/cuda
    "test_linear_computes_each_sequence_as_alone": ["Q8_0"],
    "test_prepared_activations_serve_weights_of_several_types": ["*"],
    "test_rms_norm": ["*"], "test_rope": ["*"], "test_glu": ["*"], "test_sigmoid_gate_add_take_rows": ["*"],
    "test_upload_keeps_what_a_weight_computes": ["*"],
    "test_linears_of_an_upload_group": ["*"], "test_add_rms_norm_is_add_then_norm": ["*"], "test_rope_qk": ["*"],
    "test_router": ["softmax_weight-False-0.0"], "test_route_of_a_router_weight": ["F32"],
    "test_experts_and_mix": ["one-Q8_0-Q8_0", "one-MXFP4-MXFP4", "one-F16-F16",
                             "decode-Q8_0-Q8_0"],  # + test_cuda_backend
    "test_prefill_then_decode_batches": ["dv-differs"],
    "test_attention_into_a_linear_gives_the_plain_bits": ["*one-row*Q8_0*", "*Q8_0*one-row*"],
    "test_sliding_window_hides_old_cells": ["*"], "test_attention_with_rope_is_rope_qk_then_attention": ["norm+rope"],
    "test_mix_then_add_and_norm": ["*"],
    "test_new_cache_has_a_layer_cache_per_layer": ["*"], "test_context_full_is_a_request_error": ["*"],
    "test_growth_keeps_the_cells": ["*"], "test_layers_and_sequences_are_independent": ["*"],
}


def pytest_collection_modifyitems(config, items):
    if CUDA_SKIP_REASON is not None:
        return
    from daemon.kernels.cuda.device import SIM

    if not SIM:
        return
    skip = pytest.mark.skip(reason="CUDA backend under the simulator: this case runs on a GPU")
    for item in items:
        spec = getattr(item, "callspec", None)
        if spec is None or spec.params.get("backend") != "cuda" or item.path.name.startswith("test_cuda_"):
            continue
        name, _, ids = item.name.partition("[")
        case = ids.rstrip("]").removeprefix("cuda-").removeprefix("cuda")
        keep = SIMULATOR_SUBSET.get(name, [])
        if not any(fnmatch.fnmatchcase(case, p) for p in keep):
            item.add_marker(skip)
