"""benchmarks/run.py: the --quick smoke run (a 2-layer synthetic model, moed and llama.cpp rows in
one JSON) and its clear errors for bad input; --device cuda without a GPU: the --n-cpu-moe sized to
each VRAM budget, a fake llama-bench's JSON parsed (and its failure as an error row), option errors."""

from __future__ import annotations

import importlib.util
import json
import math
import os
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
            if r["replay"]:  # a replayed routing is not llama.cpp's router: no comparison
                assert "same_tokens_as_llama" not in r
            else:  # its own router: llama.cpp's greedy tokens (docs/benchmarks.md, `same_tokens_as_llama`)
                assert r["same_tokens_as_llama"] is True, (r["generated"], llama[0]["generated"])


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


# --device cuda: the VRAM expert cache next to llama.cpp's CUDA build (llama-bench). No GPU and no real
# llama-bench here: the N sizing is checked on a synthesized file, llama-bench is a fake script.

SYNTH_SMALL = {"n_layer": 6, "n_embd": 64, "n_ff_exp": 64, "n_head": 2, "n_expert": 8, "n_expert_used": 2}
FAKE_LLAMA_BENCH = '''#!{python}
import json, sys
a = sys.argv[1:]
log = {log!r}
with open(log, "a") as f:
    f.write(json.dumps(a) + "\\n")
if {fail!r}:
    print("ggml_cuda_init: failed to initialize CUDA: no CUDA-capable device is detected", file=sys.stderr)
    sys.exit(1)
opt = {{k: v for k, v in zip(a[::2], a[1::2])}}
want = ["-m", "-ngl", "-ncmoe", "-p", "-n", "-r", "-t", "-o"]
assert a[::2] == want and opt["-ngl"] == "99" and opt["-r"] == "3" and opt["-o"] == "json", a
n, gen, pp = int(opt["-ncmoe"]), int(opt["-n"]), int(opt["-p"])
test = {{"build_commit": "fake", "backends": "CUDA", "gpu_info": "fake GPU", "model_filename": opt["-m"],
        "n_threads": int(opt["-t"]), "n_gpu_layers": 99, "n_cpu_moe": n, "avg_ns": 1, "stddev_ns": 0,
        "samples_ns": [1, 1, 1]}}
tests = [dict(test, n_prompt=pp, n_gen=0, avg_ts=1000.0 + n, stddev_ts=5.0)] if pp else []  # llama-bench: pp first
tests.append(dict(test, n_prompt=0, n_gen=gen, avg_ts=100.0 + n, stddev_ts=0.5, samples_ts=[99.5, 100.0, 100.5]))
print(json.dumps(tests, indent=2))
'''


@pytest.fixture(scope="module")
def small_model(tmp_path_factory) -> Path:
    from daemon.synth import synth

    path = tmp_path_factory.mktemp("gpu") / "qwen3-small.gguf"
    synth(path, "qwen3-30b-a3b", type="Q8_0", report=lambda *_: None, **SYNTH_SMALL)
    return path


def _fake_llama_bench(tmp_path: Path, fail: bool = False) -> tuple[Path, Path]:
    exe, log = tmp_path / ("llama-bench-fail" if fail else "llama-bench"), tmp_path / "argv.jsonl"
    exe.write_text(FAKE_LLAMA_BENCH.format(python=sys.executable, log=str(log), fail=fail))
    exe.chmod(0o755)
    return exe, log


def test_n_cpu_moe_keeps_at_most_the_budget_of_experts_in_vram(small_model):
    gpu = _module().gpu
    blocks = gpu.model_info(str(small_model))["blocks"]
    # computed here from the shapes: 3 Q8_0 matrices (34 bytes a block of 32) of E x F x D per layer
    E, F, D = SYNTH_SMALL["n_expert"], SYNTH_SMALL["n_ff_exp"], SYNTH_SMALL["n_embd"]
    per_layer = 3 * E * F * D // 32 * 34
    assert blocks == {b: per_layer for b in range(SYNTH_SMALL["n_layer"])}
    layers = SYNTH_SMALL["n_layer"]
    for budget in (0, per_layer - 1, per_layer, int(2.5 * per_layer), layers * per_layer - 1, layers * per_layer,
                   10 * layers * per_layer):
        want = max(0, layers - budget // per_layer)
        assert gpu.n_cpu_moe(blocks, budget) == want, budget
        assert gpu.on_gpu(blocks, want) == (layers - want, (layers - want) * per_layer)
    # uneven layers and a dense first block: the smallest N whose blocks N.. fit
    uneven = {1: 300, 2: 100, 3: 200}
    assert [gpu.n_cpu_moe(uneven, b) for b in (0, 199, 200, 299, 300, 599, 600)] == [4, 4, 3, 3, 2, 2, 0]


@pytest.mark.parametrize("argv, says", [
    (["--device", "cuda", "--no-llama"], "needs --gpu-cache-mb"),
    (["--device", "cuda", "--gpu-cache-mb", "100"], "needs --llama-bench PATH"),
    (["--device", "cuda", "--gpu-cache-mb", "0", "--no-llama"], "'0' is not a size in MB > 0"),
    (["--device", "cuda", "--gpu-cache-mb", "100", "--min-batch", "some", "--no-llama"], "'some' is not auto"),
    (["--device", "cuda", "--gpu-cache-mb", "100", "--llama-ncmoe", "-1", "--no-llama"], "'-1' is not an integer"),
    (["--device", "cuda", "--gpu-cache-mb", "100", "--llama-bench", "/no/such/llama-bench"],
     "no llama-bench executable at /no/such/llama-bench"),
    (["--device", "cuda", "--gpu-cache-mb", "100", "--no-llama", "--cache-mb", "300"], "--cache-mb is for the CPU"),
    (["--device", "cuda", "--gpu-cache-mb", "100", "--no-llama", "--concurrency", "2"], "--concurrency is for the CPU"),
    (["--device", "cuda", "--gpu-cache-mb", "100", "--no-llama", "--cold"], "--cold is for the CPU"),
    (["--gpu-cache-mb", "100"], "--gpu-cache-mb is for --device cuda"),
    (["--min-batch", "0"], "--min-batch is for --device cuda"),
    (["--llama-ncmoe", "0"], "--llama-ncmoe is for --device cuda"),
])
def test_gpu_option_errors_are_clear(tmp_path, capsys, argv, says):
    with pytest.raises(SystemExit) as e:
        _module().main([str(tmp_path / "m.gguf"), *argv])
    assert e.value.code == 2
    assert says in capsys.readouterr().err


def test_gpu_mode_sizes_llama_bench_to_the_vram_budget(small_model, tmp_path):
    exe, log = _fake_llama_bench(tmp_path)
    E, F, D = SYNTH_SMALL["n_expert"], SYNTH_SMALL["n_ff_exp"], SYNTH_SMALL["n_embd"]
    per_layer_mb = 3 * E * F * D // 32 * 34 / 2**20
    budgets = [f"{1.5 * per_layer_mb:.6f}", f"{4.2 * per_layer_mb:.6f}"]  # 1 and 4 of the 6 layers fit
    out = tmp_path / "gpu.json"
    p = subprocess.run([sys.executable, str(SCRIPT), str(small_model), "--device", "cuda", "--gpu-cache-mb",
                        ",".join(budgets), "--min-batch", "0", "--decode-tokens", "4", "--warmup", "1",
                        "--prompt-tokens", "4", "--threads", "3", "--llama-bench", str(exe), "--llama-ncmoe", "0",
                        "--json", str(out)], capture_output=True, text=True, timeout=120, cwd=ROOT,
                       env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})  # no GPU, even on a machine with one
    res = json.loads(out.read_text())
    moed = [r for r in res["rows"] if r["engine"] == "moed"]
    llama = [r for r in res["rows"] if r["engine"] == "llama.cpp"]
    assert [r["routing_label"] for r in moed] == ["uniform", "uniform"]  # a synthesized file's own router
    for r in moed:  # the engine's own error, as the row's
        assert "MOE_DEVICE=cuda" in r["error"] and "ratio_decode" not in r, r
    assert p.returncode == 1 and "x llama dec" in p.stdout and "MOE_DEVICE=cuda" in p.stdout
    assert [(r["gpu_cache_mb"], r["n_cpu_moe"], r["expert_layers_gpu"]) for r in llama] == [
        (float(budgets[0]), 5, 1), (float(budgets[1]), 2, 4), (None, 0, 6)]
    for r in llama:
        assert "error" not in r, r
        assert r["decode_tok_s"] == 100.0 + r["n_cpu_moe"] and r["decode_tok_s_stddev"] == 0.5
        assert r["n_gen"] == 4 and r["n_threads"] == 3 and r["n_cpu_moe_run"] == r["n_cpu_moe"]
        assert r["prefill_tok_s"] == 1000.0 + r["n_cpu_moe"]  # its prefill test of the same prompt length
    calls = [json.loads(ln) for ln in log.read_text().splitlines()]
    assert calls == [["-m", str(small_model), "-ngl", "99", "-ncmoe", str(n), "-p", "4", "-n", "4", "-r", "3",
                      "-t", "3", "-o", "json"] for n in (5, 2, 0)]
    assert "105.00" in p.stdout and "0.50" in p.stdout  # llama.cpp's mean and stddev in the table


def test_a_failing_llama_bench_gives_an_error_row_and_ratios_only_where_measured(tmp_path, small_model):
    run = _module()
    exe, _ = _fake_llama_bench(tmp_path, fail=True)
    args = run.parser().parse_args([str(small_model), "--device", "cuda", "--gpu-cache-mb", "0.2",
                                    "--llama-bench", str(exe), "--decode-tokens", "8"])
    run.check_device(run.parser(), args)
    blocks = run.gpu.model_info(str(small_model))["blocks"]
    (row,) = run.gpu_llama_rows(args, str(small_model), blocks)
    assert row["error"].startswith("llama-bench failed (exit status 1)") and "no CUDA-capable device" in row["error"]
    moed = {"engine": "moed", "threads": 2, "gpu_cache_mb": 0.2, "decode_tok_s": 50.0, "routing_label": "uniform",
            "min_batch": "0"}
    rows = [dict(moed), row]
    run.add_gpu_derived(rows)
    assert "ratio_decode" not in rows[0]
    ok = {"engine": "llama.cpp", "threads": 2, "gpu_cache_mb": 0.2, "n_cpu_moe": 4, "decode_tok_s": 40.0,
          "routing_label": "own router"}
    rows = [dict(moed), ok]
    run.add_gpu_derived(rows)
    assert rows[0]["ratio_decode"] == pytest.approx(1.25)
    assert "ratio_prefill" not in rows[0]  # neither side measured a prefill
    rows = [moed | {"prefill_tok_s": 30.0, "prefill_warm_tok_s": 90.0}, ok | {"prefill_tok_s": 60.0}]
    run.add_gpu_derived(rows)
    assert (rows[0]["ratio_prefill"], rows[0]["ratio_prefill_warm"]) == (pytest.approx(0.5), pytest.approx(1.5))
    text = run.table.render(rows + [row], run.table.GPU_COLUMNS, run.table.GPU_TEXT_COLUMNS)
    assert "1.25" in text and "llama-bench failed" in text


def test_llama_bench_output_without_the_decode_test_is_an_error(tmp_path):
    exe = tmp_path / "llama-bench"
    exe.write_text(f"#!{sys.executable}\nprint('[]')\n")
    exe.chmod(0o755)
    row = _module().gpu.llama_bench(str(exe), "m.gguf", 3, 16, 2)
    assert "printed no decode result (n_gen 16)" in row["error"]
    exe.write_text(f"#!{sys.executable}\nprint('[{{\"n_prompt\": 0, \"n_gen\": 16, \"avg_ts\": 9, \"stddev_ts\": 1}}]')\n")
    row = _module().gpu.llama_bench(str(exe), "m.gguf", 3, 16, 2, prompt=128)
    assert "printed no prefill result (n_prompt 128)" in row["error"]
