"""The kernels a decode layer launches on the CUDA backend (issue 30: fewer, fuller kernels), counted
on a one-row step of tiny fixtures: the launches between the inputs of layers 1 and 2 (layer 0 also
makes the step's RoPE table, and a new backend its attention scratch).

The count does not depend on the device (the same Python launches the same kernels on a GPU and
under the simulator), so CI checks it too; the simulator runs the qwen3moe fixture only.
"""

from __future__ import annotations

import numpy as np
import pytest

from daemon.model.transformer import Transformer
from daemon.storage.gguf import GGUFFile
from tests.fixtures.build import fixture_path

from .conftest import CUDA_SKIP_REASON

pytestmark = pytest.mark.skipif(CUDA_SKIP_REASON is not None, reason=str(CUDA_SKIP_REASON))

SMALL = dict(n_embd=64, n_head=4, n_head_kv=2, head_dim=16, n_ff=64, n_ff_exp=64, n_expert=4, n_expert_used=2,
             n_layer=3)
# (fixture, weight type, overrides, most launches a layer): 16 and 14 before attention's combine
# and the KV append were folded into their neighbours, 14 and 12 before the norms wrote the q8_1
# blocks of the attention's and the experts' input, 12 for qwen3moe before attention's combine
# wrote the o projection's (value heads of 32 or more; the gpt-oss fixture's attention weights
# are F16: no q8_1 launches for them). The MoE mix stays apart: fused with the norm it was slower.
CASES = [("qwen3moe", "Q8_0", dict(SMALL, head_dim=32), 11),
         ("gpt-oss", "MXFP4", dict(SMALL, head_dim=8, n_head=8), 11)]
UNFUSED = {"_attn_combine", "_kv_append"}  # each now folded into a neighbour


def _simulated() -> bool:
    if CUDA_SKIP_REASON is not None:
        return False
    from daemon.kernels.cuda.device import SIM

    return SIM


class _LayerMarks:
    """Step hooks that mark each layer's input in the launch record."""

    def __init__(self, record: list):
        self.record = record

    def begin(self, tokens) -> None:
        pass

    def layer_input(self, il: int, x) -> None:
        self.record.append(f"<layer {il}>")


@pytest.mark.parametrize("arch,wtype,overrides,most", CASES[:1] if _simulated() else CASES,
                         ids=[f"{a}-{w}" for a, w, _, _ in (CASES[:1] if _simulated() else CASES)])
def test_a_decode_layer_launches_at_most(arch, wtype, overrides, most, fixture_dir, monkeypatch):
    from daemon.backend.cuda import CUDABackend
    from daemon.kernels.cuda import launch

    with GGUFFile(fixture_path(arch, wtype, fixture_dir, **overrides)) as gguf:
        backend = CUDABackend(0, graphs=False)
        model = Transformer(gguf, experts=backend.resident_experts(gguf), backend=backend)
        record: list[str] = []
        monkeypatch.setattr(launch, "RECORD", record)
        model.step_hooks = _LayerMarks(record)
        logits = model.forward(np.array([1], np.int64), model.new_cache(8))
        assert np.isfinite(logits).all()
    layer = record[record.index("<layer 1>") + 1:record.index("<layer 2>")]
    assert len(layer) <= most, layer
    assert not UNFUSED & set(layer), layer
