"""The moed command line, run as a subprocess."""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile

import pytest

from daemon.cli import _start_daemon, main
from daemon.errors import MoedError
from ipc import Client
from ipc.testing import MockServer
from tests.ipc.test_security import OTHER, as_root

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


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


def test_settings_states_the_ranges():
    out = moed("settings")
    assert out.returncode == 0, out.stderr
    rows = {line.split()[0]: line for line in out.stdout.splitlines() if line.strip()}
    assert "range 1..1024" in rows["MOE_IO_DEPTH"]
    assert "range 1048576..1073741824" in rows["MOED_MAX_FRAME"]
    assert "range 0.01..3600" in rows["MOED_TEMPLATE_TIMEOUT"]
    assert "range" not in rows["MOE_NUMERICS"]


def test_settings_columns_line_up():
    out = moed("settings")  # MOED_MAX_REQUESTS_PER_CONNECTION once pushed its row out of line
    assert len({line.index(" default ") for line in out.stdout.splitlines() if line.strip()}) == 1


# -- the daemon's log and socket path (`moed run` starts a daemon) -------------------------------

@pytest.fixture
def sticky_dir():
    d = tempfile.mkdtemp(prefix="moed-t-", dir="/tmp")  # sticky and open to all, as /tmp: the docs allow it
    os.chmod(d, 0o1777)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def test_run_refuses_a_fifo_at_the_log_path_without_blocking(sticky_dir):
    sock = os.path.join(sticky_dir, "moed.sock")
    os.mkfifo(os.path.join(sticky_dir, "moed.log"), 0o666)  # another user's trap: open() would block
    out = subprocess.run([sys.executable, "-m", "daemon.cli", "run", "hi"], capture_output=True, text=True,
                         timeout=60, env={**os.environ, "MOED_SOCKET": sock}, cwd=ROOT)
    assert out.returncode == 1 and "moed: error:" in out.stderr
    assert os.path.join(sticky_dir, "moed.log") in out.stderr and "MOED_SOCKET" in out.stderr
    assert "starting" not in out.stderr and not os.path.exists(sock)


class _Spawned(Exception):
    pass


def _no_spawn(monkeypatch) -> list:
    """Make _start_daemon's Popen record its call and raise, instead of starting a daemon."""
    calls = []

    def popen(cmd, **kw):
        calls.append((cmd, kw))
        raise _Spawned

    monkeypatch.setattr(subprocess, "Popen", popen)
    return calls


@pytest.mark.parametrize("plant", [pytest.param("foreign_0666", marks=as_root), "hard_link"])
def test_start_daemon_refuses_a_planted_log_file(sticky_dir, monkeypatch, plant):
    log = os.path.join(sticky_dir, "moed.log")
    with open(os.path.join(sticky_dir, "theirs"), "w") as f:
        f.write("planted\n")
    if plant == "foreign_0666":
        os.rename(os.path.join(sticky_dir, "theirs"), log)
        os.chmod(log, 0o666)
        os.chown(log, OTHER, OTHER)
    else:
        os.link(os.path.join(sticky_dir, "theirs"), log)
    calls = _no_spawn(monkeypatch)
    with pytest.raises(MoedError) as e:
        _start_daemon(os.path.join(sticky_dir, "moed.sock"), timeout=1)
    assert log in str(e.value) and "MOED_SOCKET" in str(e.value)
    assert calls == []
    with open(log) as f:
        assert f.read() == "planted\n"


def test_a_relative_socket_path_is_made_absolute_before_spawning(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    calls = _no_spawn(monkeypatch)
    with pytest.raises(_Spawned):
        _start_daemon("rel.sock", timeout=1)  # the daemon runs in "/": it would bind /rel.sock
    (cmd, kw), = calls
    assert kw["cwd"] == "/"
    assert cmd[cmd.index("--socket") + 1] == str(tmp_path / "rel.sock")
    assert cmd[cmd.index("--log") + 1] == str(tmp_path / "rel.log")
    assert (tmp_path / "rel.log").exists()


def test_socket_paths_from_the_environment_and_flags_are_absolute(tmp_path, monkeypatch):
    from daemon.cli import _socket

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MOED_SOCKET", "env.sock")
    assert _socket(argparse.Namespace(socket=None)) == str(tmp_path / "env.sock")
    assert _socket(argparse.Namespace(socket="flag.sock")) == str(tmp_path / "flag.sock")
    assert Client().socket == str(tmp_path / "env.sock")


# -- arguments that are not UTF-8 ----------------------------------------------------------------

BAD = b"bad\xff.gguf"


@pytest.mark.parametrize("argv", [
    ["run", "--socket", "{sock}", "{bad}", "hi"],
    ["run", "--socket", "{sock}", "{model}", "caf\xe9 {badtext}"],
    ["generate", "{bad}", "hi"],
    ["pack", "{bad}"],
    ["pack", "{model}", "--out", "{bad}"],
    ["synth", "{bad}", "--like", "mixtral-8x7b", "--layers", "1", "--experts", "2", "--used", "1",
     "--hidden", "256", "--ff", "256", "--heads", "2"],
    ["trace", "record", "{bad}", "hi", "--out", "{tmp}/t.jsonl"],
    ["trace", "replay", "{bad}", "--cache-experts", "2"],
])
def test_a_non_utf8_argument_is_a_clear_error(tmp_path, argv, capsys):
    bad = os.fsdecode(os.path.join(os.fsencode(tmp_path), BAD))  # as argv arrives: with a surrogate
    with open(os.fsencode(bad), "wb") as f:
        f.write(b"GGUF")
    model = str(tmp_path / "m.gguf")
    with open(model, "wb") as f:
        f.write(b"GGUF")
    sock = os.path.join(tempfile.mkdtemp(prefix="moed-"), "moed.sock")
    fill = {"bad": bad, "model": model, "sock": sock, "tmp": str(tmp_path), "badtext": os.fsdecode(b"\xff")}
    requests = []
    with MockServer(lambda req: requests.append(req) or [], sock).in_thread():
        assert main([a.format(**fill) for a in argv]) == 1
    err = capsys.readouterr().err
    assert "moed: error:" in err and "not valid UTF-8" in err and "\\xff" in err
    assert requests == []  # refused before anything was sent
    assert sorted(os.listdir(tmp_path)) == sorted([os.fsdecode(BAD), "m.gguf"])  # nothing written


def test_a_non_utf8_file_name_is_no_traceback(tmp_path):
    bad = os.path.join(os.fsencode(tmp_path), BAD)
    open(bad, "wb").close()
    out = subprocess.run([os.fsencode(sys.executable), b"-m", b"daemon.cli", b"generate", bad, b"hi"],
                         capture_output=True, timeout=120, cwd=ROOT)
    assert out.returncode == 1 and b"Traceback" not in out.stderr
    assert b"moed: error:" in out.stderr and b"not valid UTF-8" in out.stderr


@pytest.mark.parametrize("verbose", [False, True])
def test_the_daemons_log_keeps_other_libraries_at_warning(verbose):
    """`moed serve`: moed's records at INFO, numba-cuda's per-free INFO records dropped (issue 26,
    item 5); -v lets everything through at DEBUG."""
    import logging

    from daemon.cli import configure_logging

    root, ours = logging.getLogger(), logging.getLogger("moed")
    saved = root.level, ours.level, list(root.handlers)
    seen: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = seen.append
    try:
        configure_logging(handler, verbose)
        if handler not in root.handlers:  # pytest's own handlers made basicConfig a no-op
            root.addHandler(handler)
        logging.getLogger("numba.cuda.cudadrv.driver").info("add pending dealloc")
        logging.getLogger("numba.cuda.cudadrv.driver").warning("a warning still shows")
        logging.getLogger("moed.scheduler").info("loaded")
        logging.getLogger("moed.scheduler").debug("step")
    finally:
        root.setLevel(saved[0])
        ours.setLevel(saved[1])
        for h in list(root.handlers):
            if h not in saved[2]:
                root.removeHandler(h)
    messages = [r.getMessage() for r in seen]
    if verbose:
        assert messages == ["add pending dealloc", "a warning still shows", "loaded", "step"]
    else:
        assert messages == ["a warning still shows", "loaded"]
