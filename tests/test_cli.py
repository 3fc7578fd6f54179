"""The moed command line, run as a subprocess."""

from __future__ import annotations

import subprocess
import sys


def moed(*args, timeout=600):
    return subprocess.run([sys.executable, "-m", "daemon.cli", *args], capture_output=True, text=True, timeout=timeout)


def test_generate_streams_text(smollm2):
    out = moed("generate", str(smollm2), "The capital of France is", "--temperature", "0", "--max-tokens", "8")
    assert out.returncode == 0, out.stderr
    assert "Paris" in out.stdout
    assert "loading" in out.stderr and "tok/s" in out.stderr


def test_generate_chat(smollm2):
    out = moed("generate", str(smollm2), "--chat", "What is 2 + 2?", "--temperature", "0", "--max-tokens", "16")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip()


def test_missing_model_is_a_clear_error(tmp_path):
    out = moed("generate", str(tmp_path / "missing.gguf"), "hi")
    assert out.returncode == 1
    assert "moed: error:" in out.stderr and "missing.gguf" in out.stderr
    assert "Traceback" not in out.stderr


def test_settings_lists_env_vars():
    out = moed("settings")
    assert out.returncode == 0
    assert "MOE_NUMERICS" in out.stdout
