"""daemon/catalog.py: the models directory, names with Ollama's tags, and imports as links."""

from __future__ import annotations

import os

import pytest

from daemon.catalog import Catalog, default_models_dir, full_name, is_path, split_tag
from daemon.errors import RequestError, SchedulerError


def _gguf(path, size=10):
    path.write_bytes(b"GGUF" + b"\0" * (size - 4))
    return path


def test_a_name_without_a_tag_is_latest_and_a_slash_makes_a_path():
    assert split_tag("qwen3") == ("qwen3", "latest") and split_tag("qwen3:30b") == ("qwen3", "30b")
    assert full_name("qwen3") == "qwen3:latest"
    assert is_path("./m.gguf") and is_path("/models/m.gguf") and not is_path("m")
    for bad in ("", ":latest", "a b", "a:b:c", "../m", "-x", "x:" , "x\0"):
        with pytest.raises(RequestError):
            split_tag(bad)


def test_files_and_links_are_models_named_by_their_stem(tmp_path):
    other = tmp_path / "elsewhere"
    other.mkdir()
    models = tmp_path / "models"
    models.mkdir()
    _gguf(models / "small.gguf", 12)
    _gguf(models / "qwen3:30b.gguf", 20)
    (models / "linked.gguf").symlink_to(_gguf(other / "big.gguf", 30))
    (models / "gone.gguf").symlink_to(other / "missing.gguf")  # dangling: no model
    (models / "notes.txt").write_text("not a model")
    cat = Catalog(models)
    assert [(e.name, e.size) for e in cat.entries()] == [("linked:latest", 30), ("qwen3:30b", 20),
                                                        ("small:latest", 12)]
    assert cat.resolve("small") == cat.resolve("small:latest") == models / "small.gguf"
    assert cat.resolve("qwen3:30b") == models / "qwen3:30b.gguf"
    assert os.path.realpath(cat.resolve("linked")) == str(other / "big.gguf")
    for missing in ("qwen3", "gone", "small:7b"):
        with pytest.raises(SchedulerError) as e:
            cat.resolve(missing)
        assert e.value.code == "not_found" and "moed list" in str(e.value)


def test_an_import_is_a_link_never_a_copy_and_names_are_not_overwritten(tmp_path):
    src = _gguf(tmp_path / "Qwen3-30B-A3B-Q4_K_M.gguf", 40)
    cat = Catalog(tmp_path / "new" / "models")  # made on the first import
    e = cat.import_model(src)
    assert e.name == "Qwen3-30B-A3B-Q4_K_M:latest" and e.path.is_symlink() and e.size == 40
    assert os.readlink(e.path) == str(src.resolve())
    assert cat.import_model(src, name="qwen3:q4").path.name == "qwen3:q4.gguf"
    with pytest.raises(RequestError, match="exists"):
        cat.import_model(src, name="qwen3:q4")
    with pytest.raises(RequestError):
        cat.import_model(src, name="../escape")
    with pytest.raises(RequestError, match="no such file"):
        cat.import_model(tmp_path / "absent.gguf")
    assert [x.name for x in cat.entries()] == ["Qwen3-30B-A3B-Q4_K_M:latest", "qwen3:q4"]


def test_a_missing_directory_lists_nothing_and_the_default_follows_xdg(tmp_path, monkeypatch):
    assert Catalog(tmp_path / "absent").entries() == []
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path))
    assert default_models_dir() == tmp_path / "moed" / "models"


def test_the_cli_imports_lists_and_shows_a_model(tmp_path, monkeypatch, capsys, fixture_dir):
    from daemon.cli import main
    from tests.fixtures.build import fixture_path

    monkeypatch.setenv("MOED_MODELS", str(tmp_path / "models"))
    src = fixture_path("qwen3moe", "Q8_0", fixture_dir)
    assert main(["import", str(src), "--name", "tiny:q8"]) == 0
    assert main(["import", str(src), "--name", "tiny:q8"]) == 1  # taken: a clear error, not a traceback
    assert main(["list"]) == 0
    assert main(["show", "tiny:q8"]) == 0
    out = capsys.readouterr()
    assert "tiny:q8" in out.out and "exists" in out.err
    assert "architecture     qwen3moe" in out.out and "quantization     Q8_0" in out.out
    assert main(["show", "absent"]) == 1 and "not found" in capsys.readouterr().err


def test_remove_takes_a_link_away_never_a_file(tmp_path):
    target = tmp_path / "m.gguf"
    target.write_bytes(b"GGUF")
    cat = Catalog(tmp_path / "models")
    cat.import_model(target, "linked")
    (cat.directory / "real.gguf").write_bytes(b"GGUF")
    cat.remove("linked:latest")
    assert not (cat.directory / "linked.gguf").exists() and target.exists()
    with pytest.raises(RequestError, match="not a link"):
        cat.remove("real")
    assert (cat.directory / "real.gguf").exists()
    with pytest.raises(SchedulerError):
        cat.remove("linked")
