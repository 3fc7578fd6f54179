"""`moed pack`: writes the pack and its table, refuses to redo an up-to-date pack without --force."""

from __future__ import annotations

import os
import shutil
import signal

import pytest

from daemon.cli import main
from tests.fixtures.build import fixture_path
from tests.interrupt import interrupt_mid_write


def test_pack_command(fixture_dir, tmp_path, capsys):
    model = tmp_path / "m.gguf"
    shutil.copyfile(fixture_path("qwen3moe", "F16", fixture_dir), model)
    out = str(model) + ".moepack"

    assert main(["pack", str(model), "--min-saving", "0.05"]) == 0
    cap = capsys.readouterr()
    assert "packing" in cap.err and "100%" in cap.err  # the progress bar
    lines = cap.out.splitlines()
    assert lines[0].split() == ["type", "experts", "raw", "MB", "stored", "MB", "zstd", "saving"]
    f16 = lines[1].split()
    assert f16[0] == "F16" and f16[4] == "16/16" and f16[5].endswith("%")
    assert lines[2].startswith("total") and out in lines[3]
    mtime = os.stat(out).st_mtime_ns

    assert main(["pack", str(model)]) == 1
    err = capsys.readouterr().err
    assert "up-to-date pack" in err and "--force" in err
    assert os.stat(out).st_mtime_ns == mtime

    assert main(["pack", str(model), "--force", "--min-saving", "1", "--level", "1"]) == 0
    assert "0/16" in capsys.readouterr().out

    with open(out, "r+b") as f:  # a corrupt pack is replaced without --force, saying why
        f.write(b"garbage!")
    assert main(["pack", str(model)]) == 0
    assert "replacing" in capsys.readouterr().err


def test_pack_command_errors(fixture_dir, tmp_path, capsys):
    model = fixture_path("qwen3moe", "Q8_0", fixture_dir)
    assert main(["pack", str(model), "--out", str(model)]) == 1
    assert "overwrite the model" in capsys.readouterr().err
    assert main(["pack", str(tmp_path / "missing.gguf"), "--out", str(tmp_path / "x")]) == 1
    assert "moed: error:" in capsys.readouterr().err
    assert main(["pack", str(model), "--out", str(tmp_path / "x"), "--level", "30"]) == 1
    assert "level" in capsys.readouterr().err


def test_pack_out_directory_is_refused_before_the_work(fixture_dir, tmp_path, capsys, monkeypatch):
    from daemon.storage import pack

    model = fixture_path("qwen3moe", "Q8_0", fixture_dir)
    encoded = []
    real = pack._encode
    monkeypatch.setattr(pack, "_encode", lambda *a: encoded.append(1) or real(*a))
    outdir = tmp_path / "packs"
    outdir.mkdir()
    assert main(["pack", str(model), "--out", str(outdir)]) == 1
    err = capsys.readouterr().err
    assert "moed: error:" in err and "is a directory" in err and "Is a directory" not in err
    assert encoded == []  # nothing was packed first
    assert os.listdir(outdir) == [] and sorted(os.listdir(tmp_path)) == ["packs"]


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_a_signal_mid_pack_removes_the_temporary_file(tmp_path, sig):
    from daemon.synth import synth

    model = tmp_path / "m.gguf"
    synth(model, "mixtral-8x7b", n_layer=1, n_expert=4, n_expert_used=2, n_embd=1024, n_ff_exp=4096, n_head=8,
          report=lambda *a: None)
    # ~28 MB of experts: long enough to catch it mid-pack
    interrupt_mid_write(["pack", str(model)], lambda: any(n.endswith(".tmp") for n in os.listdir(tmp_path)),
                        lambda: os.path.exists(str(model) + ".moepack"), sig)
    assert os.listdir(tmp_path) == ["m.gguf"]
