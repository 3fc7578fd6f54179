"""The real SmolLM2-135M-Instruct Q4_1 (dense llama, real BPE) against llama.cpp."""

from __future__ import annotations

import numpy as np
import pytest

from daemon import Engine
from tests.fixtures.reference import reference_greedy, reference_logits

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village by the sea,",
    "<|im_start|>user\nWhat is the boiling point of water?<|im_end|>\n<|im_start|>assistant\n",
]


@pytest.fixture(scope="module")
def engine(smollm2):
    with Engine.load(smollm2) as e:
        yield e


@pytest.fixture(scope="module")
def engine_f32(smollm2):
    with Engine.load(smollm2, numerics="float32") as e:
        yield e


def greedy(engine: Engine, ids: list[int], n: int, rows: list | None = None) -> list[int]:
    """n greedy tokens as a generation computes them (each step's last row only); `rows`
    collects the logits each token was chosen from."""
    model = engine.model
    cache = model.new_cache(len(ids) + n)
    logits = model.forward(ids, cache)[-1]
    out = []
    for _ in range(n):
        if rows is not None:
            rows.append(logits)
        out.append(int(np.argmax(logits)))
        logits = model.forward([out[-1]], cache)[-1]
    return out


@pytest.mark.llamacpp
@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_continuation_identical_to_llamacpp(engine, smollm2, prompt, needs_llamacpp):
    """32 greedy tokens and the logits of every decode step, bit for bit (llama.cpp also
    computing each step's last row only, as a generation does)."""
    ids = engine.tokenize(prompt)
    ref_tokens, ref_rows = reference_greedy(smollm2, ids, 32, return_logits=True, logits_all=False)
    rows = []
    assert greedy(engine, ids, 32, rows) == ref_tokens
    np.testing.assert_array_equal(np.stack(rows), ref_rows)


@pytest.mark.llamacpp
def test_generate_text_matches_llamacpp_greedy(engine, smollm2, needs_llamacpp):
    prompt = PROMPTS[2]
    ids = engine.tokenize(prompt)
    ref = reference_greedy(smollm2, ids, 24)
    text = "".join(engine.generate(prompt, max_tokens=24, temperature=0, repeat_penalty=1.0))
    eos = [i for i, t in enumerate(ref) if t in engine.tokenizer.eog_ids]
    assert text == engine.detokenize(ref[:eos[0]] if eos else ref)


@pytest.mark.llamacpp
def test_teacher_forced_top1_agreement_float32(engine, engine_f32, smollm2, needs_llamacpp):
    """float32 numerics differ from llama.cpp's rounding, but must agree on >= 97% of the
    top-1 predictions over 200 tokens of real text."""
    text = " ".join(engine.detokenize(greedy(engine, engine.tokenize(p), 60)) for p in PROMPTS[:3])
    ids = engine.tokenize(text)[:200]
    assert len(ids) >= 150
    ref = reference_logits(smollm2, ids)
    ours = engine_f32.forward(ids)
    agreement = float((ours.argmax(1) == ref.argmax(1)).mean())
    assert agreement >= 0.97
    assert np.linalg.norm(ours - ref) / np.linalg.norm(ref) < 5e-2


@pytest.mark.llamacpp
def test_default_numerics_logits_identical_to_llamacpp(engine, smollm2, needs_llamacpp):
    """Every prompt row, bit for bit."""
    ids = engine.tokenize(PROMPTS[0] + " Paris, and the capital of Germany is Berlin.")
    ref = reference_logits(smollm2, ids)
    ours = engine.forward(ids)
    np.testing.assert_array_equal(ours, ref)
