"""ExpertUsageTracer's JSON is written at the end, whatever the end: Engine.close, a normal process
exit (the engine still alive, or already garbage), the tracer collected; once per end, atomically."""

import gc
import json
import os
import subprocess
import sys

import pytest

from daemon.model.transformer import Transformer
from daemon.routing import tracer as tracer_mod
from daemon.routing.tracer import ExpertUsageTracer
from daemon.storage.gguf import GGUFFile
from tests.fixtures.build import fixture_path

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SCRIPTS = {
    # the engine is still referenced when the interpreter exits: atexit writes
    "kept": "import sys\nfrom daemon.engine import Engine\n"
            "engine = Engine.load(sys.argv[1])\nengine.forward([1, 2, 3])\n",
    # the engine is garbage before the exit (collected here): the tracer's finalizer writes
    "dropped": "import gc, sys\nfrom daemon.engine import Engine\n"
               "Engine.load(sys.argv[1]).forward([1, 2, 3])\ngc.collect()\n"
               "import os\nassert os.path.exists(os.environ['MOE_EXPERT_TRACE_OUTPUT'])\n",
}


@pytest.fixture(scope="module")
def model_path(fixture_dir) -> str:
    return str(fixture_path("qwen3moe", "Q8_0", fixture_dir))


@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_a_script_that_only_forwards_writes_the_json_at_exit(script, model_path, tmp_path):
    out = tmp_path / "usage.json"
    env = {**os.environ, "MOE_EXPERT_TRACE_OUTPUT": str(out), "MOE_N_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))}
    r = subprocess.run([sys.executable, "-c", SCRIPTS[script], model_path], env=env, cwd=ROOT,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    d = json.loads(out.read_text())
    assert d["total_tokens"] == 3 and d["forward_passes"] == 1
    assert d["activations"] == sum(d["per_layer"].values()) > 0
    assert os.listdir(tmp_path) == ["usage.json"]  # no temp file left


@pytest.fixture()
def model(model_path):
    with GGUFFile(model_path) as g:
        yield Transformer(g)


def forward(model, ids=(1, 2, 3)):
    model.forward(list(ids), model.new_cache(8))


def test_close_writes_once_and_the_exit_does_not_rewrite(model, tmp_path):
    out = tmp_path / "usage.json"
    tr = ExpertUsageTracer(output=out).attach(model)
    forward(model)
    tr.close()
    assert json.loads(out.read_text())["total_tokens"] == 3 and model.trace is None
    out.write_text("sentinel")  # a rewrite would show
    tr.close()  # twice is harmless
    tracer_mod._write_at_exit()
    del tr
    gc.collect()
    assert out.read_text() == "sentinel"


def test_the_exit_writes_once_and_close_after_it_does_not_rewrite(model, tmp_path):
    out = tmp_path / "usage.json"
    tr = ExpertUsageTracer(output=out).attach(model)
    forward(model)
    tracer_mod._write_at_exit()
    assert json.loads(out.read_text())["total_tokens"] == 3
    out.write_text("sentinel")
    tr.close()  # nothing new since the exit's write
    assert out.read_text() == "sentinel"


def test_new_counts_after_a_write_are_written_at_the_end(model, tmp_path):
    out = tmp_path / "usage.json"
    tr = ExpertUsageTracer(output=out).attach(model)
    forward(model)
    tr.write()  # as after a generation
    forward(model, [4])
    tr.close()
    assert json.loads(out.read_text())["total_tokens"] == 4


def test_a_collected_tracer_writes(model_path, tmp_path):
    out = tmp_path / "usage.json"
    with GGUFFile(model_path) as g:
        m = Transformer(g)
        ExpertUsageTracer(output=out).attach(m)  # held only by the model: a cycle with it
        forward(m)
        del m
        gc.collect()
    assert json.loads(out.read_text())["total_tokens"] == 3


def test_an_unattached_tracer_writes_nothing_at_the_end(tmp_path):
    out = tmp_path / "usage.json"
    ExpertUsageTracer(output=out)  # e.g. built from settings and never used
    gc.collect()
    tracer_mod._write_at_exit()
    assert not out.exists()


def test_a_failed_end_write_is_reported_not_raised(model, tmp_path, capsys):
    out = tmp_path / "missing-dir" / "usage.json"
    tr = ExpertUsageTracer(output=out).attach(model)
    forward(model)
    tracer_mod._write_at_exit()
    assert f"could not write the expert usage to {out}" in capsys.readouterr().err
    tr.close()  # the same counts are not tried again
    assert capsys.readouterr().err == ""
