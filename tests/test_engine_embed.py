"""Engine.embed (issue 29: /api/embed, /v1/embeddings): each text's final hidden states, mean-pooled
and L2-normalized, against llama.cpp's mean-pooled embeddings of the same file, per architecture;
batched input, truncation to the context."""

from __future__ import annotations

import numpy as np
import pytest

from daemon.engine import Engine
from daemon.errors import RequestError
from tests.conftest import needs_reference
from tests.fixtures.build import fixture_path
from tests.fixtures.reference import llama_cpp_available, reference_embedding

TEXTS = ["Hello world", "The quick brown fox jumps over the lazy dog."]


@pytest.fixture(scope="module", params=[("qwen3moe", "Q8_0"), ("qwen3next", "Q8_0"), ("llama", "Q8_0")],
                ids=lambda p: "-".join(p))
def model(request, fixture_dir) -> str:
    return str(fixture_path(*request.param, fixture_dir))


@pytest.mark.llamacpp
@needs_reference(llama_cpp_available(), "llama-cpp-python is not installed")
def test_embeddings_equal_llama_cpps(model):
    with Engine.load(model, n_threads=1) as engine:
        vectors, count = engine.embed(TEXTS)
        assert count == sum(len(engine.tokenize(t)) for t in TEXTS)
    assert vectors.shape == (2, vectors.shape[1]) and vectors.dtype == np.float32
    for text, v in zip(TEXTS, vectors):
        ref = reference_embedding(model, text)
        assert ref.shape == v.shape
        np.testing.assert_allclose(v, ref, rtol=0, atol=1e-6)


@pytest.mark.llamacpp
@needs_reference(llama_cpp_available(), "llama-cpp-python is not installed")
def test_smollm2_embeddings_equal_llama_cpps(smollm2):
    with Engine.load(str(smollm2), n_threads=1) as engine:
        vectors, _ = engine.embed(TEXTS)
    for text, v in zip(TEXTS, vectors):
        np.testing.assert_allclose(v, reference_embedding(str(smollm2), text), rtol=0, atol=1e-6)


def test_a_batch_is_each_text_alone_and_unit_length(fixture_dir):
    with Engine.load(str(fixture_path("qwen3moe", "Q8_0", fixture_dir)), n_threads=1) as engine:
        together, _ = engine.embed(TEXTS)
        alone = np.concatenate([engine.embed([t])[0] for t in TEXTS])
    assert np.array_equal(together, alone)
    np.testing.assert_allclose(np.linalg.norm(together, axis=1), 1.0, atol=1e-6)
    assert not np.allclose(together[0], together[1])


def test_a_text_longer_than_the_context_is_cut_or_refused(fixture_dir):
    text = "one two three four five six seven eight nine ten"
    with Engine.load(str(fixture_path("qwen3moe", "Q8_0", fixture_dir)), n_threads=1, n_ctx=4) as engine:
        ids = engine.tokenize(text)
        assert len(ids) > 4
        cut, count = engine.embed([text])
        assert count == 4
        with pytest.raises(RequestError, match="more than the context"):
            engine.embed([text], truncate=False)
        h = engine.model.hidden_states(ids[:4], engine.model.new_cache(4)).astype(np.float64).mean(0)
    np.testing.assert_allclose(cut[0], h / np.linalg.norm(h), atol=1e-7)
