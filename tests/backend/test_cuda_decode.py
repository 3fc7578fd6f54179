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

try:
    from daemon.kernels.cuda.device import SIM
except Exception:  # noqa: BLE001 - no numba-cuda: every test here is skipped anyway
    SIM = True

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


def _pack(ids, V):
    words = np.zeros(-(-V // 32), np.uint32)
    for t in ids:
        words[t // 32] |= np.uint32(1) << np.uint32(t % 32)
    return words.view(np.int32)


@pytest.mark.skipif(SIM, reason="minutes in the simulator (the mask kernel itself: tests/kernels/cuda/test_sample.py)")
def test_a_deferred_step_samples_under_the_masks_set_after_its_layers(model):
    """decode_sampled(deferred=True) launches the layers and returns the sampling: masks put in
    the slots between the two hold the draw to their tokens (greedy: the argmax over the allowed
    ones); a slot without a mask samples the plain step's token."""
    B = model.backend
    slots = B.sampler_slots()
    plain = [model.new_cache(32) for _ in PROMPTS]
    deferred = [model.new_cache(32) for _ in PROMPTS]
    ids = [slots.assign(GREEDY, p, 32) for p in PROMPTS]
    try:
        first = list(np.argmax(model.forward_many(PROMPTS, plain), axis=-1))
        model.forward_many(PROMPTS, deferred)
        logits = model.forward_batch(first, plain)  # [S, V]
        V = logits.shape[1]
        sample = model.decode_sampled(first, deferred, ids, pad=4, deferred=True)
        allowed = [[1, 2, 3], None, list(range(0, V, 7))]
        for slot, a in zip(ids, allowed):
            slots.set_mask(slot, None if a is None else _pack(a, V))
        got, bad = _host(B, sample())
        assert not bad[:3].any()
        for r, a in enumerate(allowed):
            want = int(np.argmax(logits[r])) if a is None else a[int(np.argmax(logits[r][a]))]
            assert got[r] == want
    finally:
        for s in ids:
            slots.release(s)
