"""daemon/grammar.py: JSON schemas enforced through token masks (llguidance), so that even a
random-weight model's sampled output is valid against its schema, on the fixture's tokenizer and
on SmolLM2's real one; the mask's bit layout; bad formats."""

from __future__ import annotations

import json

import jsonschema
import numpy as np
import pytest

from daemon.engine import Engine
from daemon.errors import RequestError
from daemon.grammar import MASKED, allowed, apply_mask, compile_format, schema_of
from tests.fixtures.build import fixture_path

SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                      "age": {"type": "integer", "minimum": 0, "maximum": 150}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "properties": {"ok": {"type": "boolean"}, "kind": {"enum": ["cat", "dog", "fish"]},
                                      "score": {"type": "number", "minimum": 0, "maximum": 1},
                                      "note": {"anyOf": [{"type": "null"}, {"type": "string", "maxLength": 5}]}},
     "required": ["ok", "kind", "score", "note"], "additionalProperties": False},
    {"type": "array", "items": {"type": "object", "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 9}},
                                "required": ["id"], "additionalProperties": False},
     "minItems": 1, "maxItems": 3},
]


@pytest.fixture(scope="module")
def tiny(fixture_dir):
    with Engine.load(str(fixture_path("qwen3moe", "Q8_0", fixture_dir)), n_threads=1) as engine:
        yield engine


@pytest.mark.parametrize("schema", SCHEMAS, ids=["object", "enums-null", "array"])
def test_sampled_output_of_a_random_model_is_valid(tiny, schema):
    for seed in range(12):  # a model with random weights, sampled: only the grammar makes it valid
        text = "".join(tiny.generate(f"Prompt number {seed}:", max_tokens=300, format=schema, temperature=1.0,
                                     seed=seed, top_k=0, top_p=1.0, min_p=0.0))
        jsonschema.validate(json.loads(text), schema)
        assert tiny.last_stats.done_reason == "stop"


def test_greedy_chat_output_is_valid_on_a_real_tokenizer(smollm2):
    schema = SCHEMAS[0]
    with Engine.load(str(smollm2), n_threads=1) as engine:
        for who in ("a pirate", "a cat", "Ada Lovelace"):
            text = "".join(engine.chat([{"role": "user", "content": f"Describe {who} as JSON."}], max_tokens=120,
                                       format=schema, temperature=0))
            jsonschema.validate(json.loads(text), schema)


def test_the_mask_allows_what_the_matcher_accepts(tiny):
    g = compile_format(json.dumps(SCHEMAS[0]), tiny.tokenizer).matcher()
    mask = g.mask()
    V = tiny.model.hp.n_vocab
    ok = allowed(mask, V)
    assert mask.dtype == np.int32 and mask.shape == ((V + 31) // 32,)
    brace = tiny.tokenizer.encode("{", add_special=False)
    assert len(brace) == 1 and ok[brace[0]]  # a JSON object starts with "{"
    letter = tiny.tokenizer.encode("a", add_special=False)[0]
    assert not ok[letter]
    logits = np.arange(V, dtype=np.float32)
    masked = apply_mask(logits, mask)
    assert np.array_equal(masked[ok], logits[ok]) and (masked[~ok] == MASKED).all()
    assert ((mask.view(np.uint32)[brace[0] // 32] >> np.uint32(brace[0] % 32)) & 1) == 1  # bit t%32 of word t//32
    g.consume(brace[0])
    with pytest.raises(RequestError, match="does not fit"):
        g.consume(letter)


def test_bad_formats_are_request_errors(tiny):
    assert schema_of("json") == {"type": "object"}
    for bad in ("yaml", "[1, 2]", "{not json"):
        with pytest.raises(RequestError, match="format"):
            schema_of(bad)
    with pytest.raises(RequestError, match="format"):
        compile_format(json.dumps({"type": "no-such-type"}), tiny.tokenizer)
