"""benchmarks/serving.py: a smoke run on SmolLM2 (concurrency 1,2, a few tokens) with fake llama.cpp
binaries, its JSON's fields and sanity (counts add up, rates positive, ratios against the fakes'
known figures); the burst figures and llama-batched-bench's table on hand-made inputs; option errors."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "serving.py"

from tests.bench_script import load_script  # noqa: E402

serving = load_script("serving")  # puts benchmarks/ on sys.path, as the script does
from _bench.llama_cli import parse_batched  # noqa: E402

TOKENS, PROMPT = 6, 16
TG = 100.0  # the fake llama-bench's tg tok/s
FAKE_BENCH = '''#!{python}
import json, sys
a = sys.argv[1:]
opt = dict(zip(a[::2], a[1::2]))
assert opt["-p"] == "0" and opt["-o"] == "json", a
print(json.dumps([{{"n_prompt": 0, "n_gen": int(opt["-n"]), "avg_ts": {tg}, "stddev_ts": 1.0}}]))
'''
FAKE_BATCHED = '''#!{python}
import sys
a = sys.argv[1:]
opt = dict(zip(a[::2], a[1::2]))
pp, tg = int(opt["-npp"]), int(opt["-ntg"])
print("main: n_kv_max = 4096, n_batch = 2048")
print("|    PP |     TG |    B |   N_KV |   T_PP s | S_PP t/s |   T_TG s | S_TG t/s |      T s |    S t/s |")
print("|-------|--------|------|--------|----------|----------|----------|----------|----------|----------|")
for b in map(int, opt["-npl"].split(",")):  # S_TG = 50 per sequence
    print(f"| {{pp:5d}} | {{tg:6d}} | {{b:4d}} | {{b * (pp + tg):6d}} | 0.100 | 999.00 | 1.000 | {{50.0 * b:8.2f}} | 1.1 | 9.0 |")
'''


def _exe(path: Path, text: str) -> str:
    path.write_text(text)
    path.chmod(0o755)
    return str(path)


@pytest.fixture(scope="module")
def run(smollm2, tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("serving")
    bench = _exe(tmp / "llama-bench", FAKE_BENCH.format(python=sys.executable, tg=TG))
    batched = _exe(tmp / "llama-batched-bench", FAKE_BATCHED.format(python=sys.executable))
    out = tmp / "serving.json"
    p = subprocess.run([sys.executable, str(SCRIPT), str(smollm2), "--concurrency", "1,2", "--tokens", str(TOKENS),
                        "--prompt-tokens", str(PROMPT), "--bursts", "2", "--overhead-repeat", "1",
                        "--llama-bench", bench, "--llama-batched-bench", batched, "--json", str(out)],
                       capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert p.returncode == 0, p.stderr[-2000:]
    assert "TTFT p99 s" in p.stdout and "overhead" in p.stdout  # the table and the overhead line
    return json.loads(out.read_text())


def _pos(v) -> bool:
    return isinstance(v, (int, float)) and math.isfinite(v) and v > 0


def test_loads_are_timed_twice_on_the_cpu(run):
    assert run["load"]["device"] == "cpu"
    for which in ("first", "second"):
        assert _pos(run["load"][which]["wall_s"]) and _pos(run["load"][which]["load_duration_s"])
        assert run["load"][which]["load_duration_s"] <= run["load"][which]["wall_s"]


def test_every_burst_has_its_streams_counts_and_sane_figures(run):
    bursts = run["bursts"]
    assert [(b["streams"], b["mode"], b["burst"]) for b in bursts] == [
        (n, m, i) for n in (1, 2) for m in ("greedy", "default") for i in (0, 1)]
    for b in bursts:
        n = b["streams"]
        assert len(b["counts"]) == len(b["ttft_s"]) == len(b["per_stream_tps"]) == n
        assert b["tokens"] == sum(b["counts"]) and all(1 <= c <= TOKENS for c in b["counts"])
        if b["done_reasons"] == ["length"]:
            assert b["counts"] == [TOKENS] * n
        assert all(_pos(t) and t < b["wall_s"] for t in b["ttft_s"])
        assert b["ttft_p50_s"] <= b["ttft_p99_s"] == max(b["ttft_s"])
        assert b["wall_tps"] == pytest.approx(b["tokens"] / b["wall_s"])
        assert _pos(b["steady_tps"]) and _pos(b["per_stream_tps_median"])


def test_summary_keeps_the_first_burst_apart(run):
    rows = run["summary"]
    assert [(r["mode"], r["streams"]) for r in rows] == [("greedy", 1), ("default", 1), ("greedy", 2), ("default", 2)]
    for r in rows:
        first = next(b for b in run["bursts"] if (b["mode"], b["streams"], b["burst"]) == (r["mode"], r["streams"], 0))
        later = next(b for b in run["bursts"] if (b["mode"], b["streams"], b["burst"]) == (r["mode"], r["streams"], 1))
        assert r["later_bursts"] == 1
        assert r["first"]["steady_tps"] == first["steady_tps"] and r["later"]["steady_tps"] == later["steady_tps"]


def test_overhead_and_ratios_against_the_engine_and_the_fake_llama(run):
    o = run["overhead"]
    assert len(o["engine_ms"]) == len(o["step_ms"]) == len(o["client_ms"]) == len(o["daemon_ms"]) == 1
    assert _pos(o["engine_ms_best"]) and _pos(o["step_ms_best"]) and _pos(o["client_ms_best"])
    assert o["overhead_ms"] == pytest.approx(o["client_ms_best"] - o["engine_ms_best"])
    assert o["overhead_vs_step_ms"] == pytest.approx(o["client_ms_best"] - o["step_ms_best"])
    assert run["engine"]["decode_tps"] == pytest.approx(1e3 / o["step_ms_best"])  # the bare step
    assert run["llama"]["bench"]["decode_tok_s"] == TG
    assert {int(b): r["tg_tok_s"] for b, r in run["llama"]["batched"]["rows"].items()} == {1: 50.0, 2: 100.0}
    for r in run["summary"]:
        for fig in (r["first"], r["later"]):
            if r["streams"] == 1:
                assert fig["x_llama"] == pytest.approx(fig["per_stream_tps_median"] / TG)
                assert fig["x_engine"] == pytest.approx(fig["per_stream_tps_median"] / run["engine"]["decode_tps"])
            else:  # N streams: steady over S_TG at B=N; no engine batch rate on the CPU
                assert fig["x_llama"] == pytest.approx(fig["steady_tps"] / 100.0)
                assert fig["x_engine"] is None


def test_burst_figures_by_hand():
    # stream A: chunks at 1, 2, 3, 4 s (one token each); B: at 1.5 (1), 2.5 (2), 3.5 (1); sent at 0, wall 5 s
    a = [(1.0, 1), (2.0, 1), (3.0, 1), (4.0, 1)]
    b = [(1.5, 1), (2.5, 2), (3.5, 1)]
    f = serving.burst_figures(0.0, 5.0, [(a, 4, "length"), (b, 4, "length")])
    assert f["ttft_s"] == [1.0, 1.5] and f["ttft_p50_s"] == 1.0 and f["ttft_p99_s"] == 1.5
    assert f["per_stream_tps"] == [1.0, 1.5]  # A: 3 tokens in 3 s; B: 3 in 2 s
    assert f["steady_s"] == 2.0 and f["steady_tps"] == 2.5  # (1.5, 3.5]: A 2 tokens, B 3
    assert f["wall_tps"] == 1.6 and f["tokens"] == 8


def test_nearest_rank():
    values = list(range(100, 0, -1))
    assert serving.nearest_rank(values, 0.99) == 99 and serving.nearest_rank(values, 0.5) == 50
    assert serving.nearest_rank([3.0], 0.99) == 3.0


def test_parse_batched_reads_the_table_around_the_log():
    text = ("llama_model_load: done\n\nmain: n_kv_max = 3136\n\n"
            "|    PP |     TG |    B |   N_KV |   T_PP s | S_PP t/s |   T_TG s | S_TG t/s |      T s |    S t/s |\n"
            "|-------|--------|------|--------|----------|----------|----------|----------|----------|----------|\n"
            "|    64 |    128 |    1 |    192 |    0.108 |  1186.64 |    3.079 |    41.57 |    3.187 |    80.32 |\n"
            "|    64 |    128 |   16 |   3072 |    1.570 |  1304.68 |    8.455 |   242.23 |   10.024 |   408.60 |\n"
            "\nllama_perf_context_print: load time = 1.0 ms\n")
    rows = parse_batched(text)
    assert sorted(rows) == [1, 16]
    assert rows[16]["tg_tok_s"] == 242.23 and rows[16]["n_kv"] == 3072 and rows[1]["pp"] == 64
    assert parse_batched("no table here") == {}


@pytest.mark.parametrize("argv, says", [
    (["--concurrency", "0"], "not a list of positive integers"),
    (["--set", "MOE_NOPE=1"], "not a moed setting"),
    (["--set", "MOE_DEVICE=tpu"], "MOE_DEVICE"),
    (["--no-llama", "--llama-dir", "/nonexistent"], "contradict"),
])
def test_option_errors_are_clear(argv, says):
    p = subprocess.run([sys.executable, str(SCRIPT), *argv], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert p.returncode == 2 and says in p.stderr, p.stderr


def test_missing_model_file_is_a_clear_error(tmp_path):
    p = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path / "nope.gguf")], capture_output=True, text=True,
                       timeout=120, cwd=ROOT)
    assert p.returncode != 0 and "no model file at" in p.stderr


def test_ratios_take_the_engines_batch_step_and_batched_bench_at_the_same_size():
    # the GPU shape: gpu_decode.py's 1-sequence and batch-16 rates; llama-bench tg and batched-bench S_TG
    summary = [{"streams": 1, "first": {"per_stream_tps_median": 150.0, "steady_tps": 150.0}, "later": None},
               {"streams": 4, "first": {"per_stream_tps_median": 90.0, "steady_tps": 360.0}, "later": None},
               {"streams": 16, "first": {"per_stream_tps_median": 40.0, "steady_tps": 640.0},
                "later": {"per_stream_tps_median": 45.0, "steady_tps": 720.0}}]
    engine = {"decode_tps": 200.0, "batch": 16, "batch_tps": 800.0}
    llama = {"bench": {"decode_tok_s": 250.0}, "batched": {"rows": {1: {"tg_tok_s": 240.0}, 16: {"tg_tok_s": 500.0}}}}
    serving.ratios(summary, engine, llama)
    one, four, sixteen = summary
    assert (one["first"]["x_engine"], one["first"]["x_llama"]) == (0.75, 0.6)  # tg, not batched B=1
    assert (four["first"]["x_engine"], four["first"]["x_llama"]) == (None, None)  # no batch-4 figures
    assert (sixteen["first"]["x_engine"], sixteen["first"]["x_llama"]) == (0.8, 1.28)
    assert (sixteen["later"]["x_engine"], sixteen["later"]["x_llama"]) == (0.9, 1.44)
