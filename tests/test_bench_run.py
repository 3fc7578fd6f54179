"""benchmarks/run.py: the --quick smoke run (a 2-layer synthetic model, moed and llama.cpp rows in
one JSON) and its clear errors for bad input."""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "run.py"
COLUMNS = ("load_s", "prefill_tps", "decode_tps", "ttft_s", "disk_bytes", "disk_mb_s", "of_dd", "max_rss_mb",
           "tokens", "routing_label")


def _run(*argv: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *argv], capture_output=True, text=True, timeout=timeout,
                          cwd=ROOT)


@pytest.fixture(scope="module")
def quick(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("bench") / "quick.json"
    p = _run("--quick", "--json", str(out))
    assert p.returncode == 0, p.stderr[-2000:]
    assert "prefill t/s" in p.stdout and "x llama dec" in p.stdout  # the one table was printed
    return json.loads(out.read_text())


def _finite_positive(v) -> bool:
    return isinstance(v, (int, float)) and math.isfinite(v) and v > 0


def test_quick_runs_the_minimal_matrix_with_sane_values(quick):
    moed = [r for r in quick["rows"] if r["engine"] == "moed"]
    assert [(r["cache_mb"], bool(r["replay"])) for r in moed] == [(0.0, False), (0.0, True), (4.0, False),
                                                                  (4.0, True)]
    assert quick["dd"]["bytes_per_s"] > 0 and quick["dd"]["bytes"] > 0
    for r in moed:
        assert "error" not in r, r.get("error")
        assert all(k in r for k in COLUMNS), sorted(set(COLUMNS) - set(r))
        assert _finite_positive(r["prefill_tps"]) and _finite_positive(r["decode_tps"])
        assert 0 < r["ttft_s"] < r["timed_s"]
        assert 0.0 <= r["hit_rate"] <= 1.0
        assert r["threads"] == 2 and r["numba_threads"] == 2
        assert r["max_rss_mb"] > 10
        assert ("replay " in r["routing_label"]) == bool(r["replay"])
    unlimited, limited = moed[0], moed[2]
    assert unlimited["hit_rate"] == 1.0  # every expert stays after the untimed pass
    assert limited["hit_rate"] < 1.0 and limited["expert_bytes"] > 0  # a 4 MB cache streams experts


@pytest.mark.llamacpp
def test_quick_has_llama_rows_and_ratios(quick, needs_llamacpp):
    llama = [r for r in quick["rows"] if r["engine"] == "llama.cpp"]
    assert len(llama) == 1 and "error" not in llama[0], llama
    assert _finite_positive(llama[0]["prefill_tps"]) and _finite_positive(llama[0]["decode_tps"])
    assert "replay n/a" in llama[0]["routing_label"]
    for r in quick["rows"]:
        if r["engine"] == "moed":
            assert _finite_positive(r["ratio_prefill"]) and _finite_positive(r["ratio_decode"])
            assert r["ratio_prefill"] == pytest.approx(r["prefill_tps"] / llama[0]["prefill_tps"])
            assert len(r["generated"]) == len(llama[0]["generated"]) == quick["decode_tokens"]
            assert ("same_tokens_as_llama" in r) == (not r["replay"])


def test_missing_model_file_is_a_clear_error(tmp_path):
    p = _run(str(tmp_path / "nope.gguf"), "--no-llama")
    assert p.returncode == 2 and "no model file at" in p.stderr and "nope.gguf" in p.stderr


def test_a_file_that_is_no_model_is_a_clear_error(tmp_path):
    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    p = _run(str(tmp_path / "m.gguf"), "--no-llama")
    assert p.returncode == 2 and "error: cannot read" in p.stderr and "Traceback" not in p.stderr, p.stderr


@pytest.mark.parametrize("option, value, says", [
    ("--routing", "fastest", "one of"), ("--threads", "two", "'two' is not a positive integer"),
    ("--threads", "0", "positive integer"), ("--cache-mb", "-1", ">= 0"), ("--prompt-tokens", "0", "integer >= 1"), ("--replay", "no/such.jsonl", "no routing trace"),
])
def test_unknown_option_values_are_clear_errors(tmp_path, option, value, says):
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    p = _run(str(model), option, value)
    assert p.returncode == 2 and says in p.stderr, p.stderr


def _module():
    spec = importlib.util.spec_from_file_location("bench_run", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_without_llama_cpp_python_rows_say_not_installed_and_llama_makes_it_an_error(tmp_path, monkeypatch, capsys):
    run = _module()
    args = run.parser().parse_args([str(tmp_path / "m.gguf"), "--threads", "1,2"])
    rows = run.llama_rows(args, {"model": "m.gguf"}, installed=False)
    assert [r["error"] for r in rows] == ["not installed (pip install llama-cpp-python)"] * 2
    run.add_derived(rows, 1e9)  # rows with errors get no figures, and no exception
    assert "not installed" in run.table.render(rows)
    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    monkeypatch.setattr(run, "llama_installed", lambda: False)
    assert run.main([str(tmp_path / "m.gguf"), "--llama"]) == 2
    assert "llama-cpp-python is not installed" in capsys.readouterr().err
