"""Decode steps that sample on the device (Transformer.decode_sampled / prefill_sampled, the CUDA
backend's `sample`, daemon/model/decoding.py), on a one-layer fixture, under the simulator in CI
and on the GPU: greedy tokens are the argmax of the same step's logits; a step fed on the device
from the step before's sampled ids equals one fed from the host; a step padded with copies of
row 0 gives its real rows the same tokens and moves each cache once."""

from __future__ import annotations

import numpy as np
import pytest

from daemon.model.transformer import Transformer
from daemon.storage.gguf import GGUFFile
from ipc.protocol import SamplingOptions
from tests.fixtures.build import fixture_path

from .conftest import CUDA_SKIP_REASON

pytestmark = pytest.mark.skipif(CUDA_SKIP_REASON is not None, reason=str(CUDA_SKIP_REASON))

TINY = dict(n_embd=64, n_head=4, n_head_kv=2, head_dim=16, n_ff=64, n_ff_exp=64, n_expert=4, n_expert_used=2,
            n_layer=1)
GREEDY = SamplingOptions(temperature=0.0, repeat_penalty=1.0)
PROMPTS = [[5, 9, 13], [7, 2], [11, 4, 6, 8]]


@pytest.fixture(scope="module")
def model(fixture_dir):
    from daemon.backend.cuda import CUDABackend

    gguf = GGUFFile(fixture_path("qwen3moe", "Q8_0", fixture_dir, **TINY))
    backend = CUDABackend(0)
    yield Transformer(gguf, experts=backend.resident_experts(gguf), backend=backend)
    gguf.close()


def _host(backend, arrays):
    return [np.asarray(a) for a in backend.readback(arrays).wait()]


def test_sampled_on_the_device_fed_on_the_device_and_padded(model):
    """Greedy: the prefill's sampled first tokens are the argmax of forward_many's logits; the next
    step, fed those ids on the device and padded to 4 rows with copies of row 0, samples the argmax
    of forward_batch's logits for its real rows, and moves each cache by one position."""
    B = model.backend
    slots = B.sampler_slots()
    plain = [model.new_cache(32) for _ in PROMPTS]
    sampled = [model.new_cache(32) for _ in PROMPTS]
    ids = [slots.assign(GREEDY, p, 32) for p in PROMPTS]
    try:
        want = np.argmax(model.forward_many(PROMPTS, plain), axis=-1)  # [S]
        out, flags = model.prefill_sampled(PROMPTS, sampled, ids)
        first, bad = _host(B, (out, flags))
        assert list(first) == list(want) and not bad.any()
        logits = model.forward_batch(list(want), plain)  # [S, V]
        src = np.array([0, 1, -1], np.int32)  # the third row's input from the host (a joining sequence)
        out2, flags2 = model.decode_sampled([0, 0, int(want[2])], sampled, ids, feed=(src, out), pad=4)
        second, bad = _host(B, (out2, flags2))
        assert second.shape == (4,) and not bad[:3].any()
        assert list(second[:3]) == list(np.argmax(logits, axis=-1))
        assert [c.n_past for c in sampled] == [c.n_past for c in plain] == [len(p) + 1 for p in PROMPTS]
    finally:
        for s in ids:
            slots.release(s)
