"""The daemon as a process: `python -m daemon.cli serve` with SIGTERM mid-generation, and the CLI
path (`moed run` starting a background daemon, `moed ps`, `moed stats`, `moed stop`); the socket's
defences end to end (an impostor, an unsafe directory, MOED_ALLOWED_UIDS with another user)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

import stat

import pytest

from ipc import Client, NotRunning, ServerError
from tests.fixtures.build import fixture_path
from tests.ipc.test_security import OTHER, ImpostorListener, as_root, as_user, client_call

pytestmark = pytest.mark.usefixtures("warm_kernels")  # compile outside the time limits

T = 120  # seconds before a test fails rather than hangs (daemon start-up imports numba)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def model(fixture_dir) -> str:
    return str(fixture_path("qwen3moe", "Q8_0", fixture_dir))


@pytest.fixture
def sock(tmp_path) -> str:
    p = str(tmp_path / "moed.sock")
    return p if len(p) < 100 else os.path.join(tempfile.mkdtemp(prefix="moed-"), "moed.sock")


def env(sock: str) -> dict[str, str]:
    return {**os.environ, "MOED_SOCKET": sock, "MOE_N_THREADS": "1",
            "PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))}


def moed(sock: str, *args, timeout=T, input=None):
    return subprocess.run([sys.executable, "-m", "daemon.cli", *args], check=False, capture_output=True, text=True,
                          timeout=timeout, env=env(sock), cwd=ROOT, input=input)


def wait_for_daemon(sock: str, proc: subprocess.Popen | None = None) -> Client:
    deadline = time.monotonic() + T
    while True:
        try:
            c = Client(sock, timeout=T)
            c.connect()
            return c
        except NotRunning:
            if proc is not None and proc.poll() is not None:
                raise AssertionError(f"the daemon exited: {proc.stderr.read()}") from None
            assert time.monotonic() < deadline, "the daemon did not start"
            time.sleep(0.05)


def test_sigterm_during_generation_ends_the_stream_and_exits(sock, model):
    proc = subprocess.Popen([sys.executable, "-m", "daemon.cli", "serve", "--socket", sock],
                            stderr=subprocess.PIPE, text=True, env=env(sock), cwd=ROOT)
    try:
        with wait_for_daemon(sock, proc) as c:
            assert c.server.pid == proc.pid
            assert oct(os.stat(sock).st_mode & 0o777) == "0o600"
            c.load(model)
            gen = c.generate([1, 2, 3], model=model, max_tokens=3000)
            assert next(gen).tokens
            proc.send_signal(signal.SIGTERM)
            with pytest.raises(ServerError) as e:
                for _ in gen:
                    pass
            assert e.value.code == "shutdown"
        assert proc.wait(T) == 0
        assert not os.path.exists(sock)
        err = proc.stderr.read()
        assert "SIGTERM received" in err and "stopped" in err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_cli_run_starts_a_daemon_then_ps_stats_stop(sock, model):
    pid = None
    try:
        out = moed(sock, "run", model, "Hello world", "--max-tokens", "6", "--temperature", "0", "--verbose")
        assert out.returncode == 0, out.stderr
        assert "starting the daemon" in out.stderr and "tok/s" in out.stderr
        assert out.stdout.strip()
        with Client(sock) as c:
            pid = c.health().pid
        again = moed(sock, "run", model, "Hello world", "--max-tokens", "6", "--temperature", "0")
        assert again.returncode == 0 and "starting" not in again.stderr  # the same daemon answers
        assert again.stdout == out.stdout
        chat = moed(sock, "run", model, "--max-tokens", "4", input="hi\n/bye\n")
        assert chat.returncode == 0, chat.stderr
        ps = moed(sock, "ps")
        assert ps.returncode == 0 and model in ps.stdout and "qwen3moe" in ps.stdout
        stats = moed(sock, "stats")
        assert stats.returncode == 0 and "layer" in stats.stdout and "total" in stats.stdout
        js = json.loads(moed(sock, "stats", "--json").stdout)
        assert js[model]["scheduler"]["step_tokens"] > 0 and js[model]["cache"]["layers"]
        stop = moed(sock, "stop")
        assert stop.returncode == 0, stop.stderr
        deadline = time.monotonic() + T
        while _alive(pid):
            assert time.monotonic() < deadline, "the daemon did not exit"
            time.sleep(0.05)
        pid = None
        assert moed(sock, "ps").returncode == 1
        assert moed(sock, "stop").returncode == 1
    finally:
        if pid is not None and _alive(pid):
            os.kill(pid, signal.SIGKILL)


def test_cli_run_takes_a_model_name_and_a_relative_path(sock, model, tmp_path, monkeypatch):
    """`moed run NAME` resolves in the daemon's models directory; a relative path is made absolute
    by the CLI (the daemon runs in "/"); the same model either way gives the same greedy text."""
    models = tmp_path / "models"
    models.mkdir()
    (models / "tiny.gguf").symlink_to(model)
    monkeypatch.setenv("MOED_MODELS", str(models))
    args = ("Hello world", "--max-tokens", "6", "--temperature", "0")
    try:
        by_name = moed(sock, "run", "tiny", *args)
        assert by_name.returncode == 0, by_name.stderr
        by_path = subprocess.run([sys.executable, "-m", "daemon.cli", "run", "models/tiny.gguf", *args],
                                 capture_output=True, text=True, timeout=T, env=env(sock), cwd=tmp_path)
        assert by_path.returncode == 0, by_path.stderr
        assert by_name.stdout == by_path.stdout and by_name.stdout.strip()
        ps = moed(sock, "ps")
        assert "tiny:latest" in ps.stdout
        missing = moed(sock, "run", "nope", "Hi")
        assert missing.returncode == 1 and "'nope:latest' not found" in missing.stderr
    finally:
        moed(sock, "stop")


def test_second_daemon_on_a_live_socket_refuses(sock):
    proc = subprocess.Popen([sys.executable, "-m", "daemon.cli", "serve", "--socket", sock],
                            stderr=subprocess.PIPE, text=True, env=env(sock), cwd=ROOT)
    try:
        wait_for_daemon(sock, proc).close()
        out = moed(sock, "serve", "--socket", sock)
        assert out.returncode == 1 and "already serving" in out.stderr and f"pid {proc.pid}" in out.stderr
        with Client(sock) as c:
            assert c.health().pid == proc.pid
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            assert proc.wait(T) == 0
        finally:
            if proc.poll() is None:
                proc.kill()


def test_socket_of_a_killed_daemon_is_replaced(sock):
    serve = [sys.executable, "-m", "daemon.cli", "serve", "--socket", sock]
    first = subprocess.Popen(serve, stderr=subprocess.DEVNULL, env=env(sock), cwd=ROOT)
    wait_for_daemon(sock, first).close()
    first.kill()  # SIGKILL: no clean-up, the socket file stays
    first.wait()
    assert os.path.exists(sock)
    second = subprocess.Popen(serve, stderr=subprocess.PIPE, text=True, env=env(sock), cwd=ROOT)
    try:
        with wait_for_daemon(sock, second) as c:
            assert c.health().pid == second.pid
        second.send_signal(signal.SIGTERM)
        assert second.wait(T) == 0
        assert "removing the stale socket" in second.stderr.read()
    finally:
        if second.poll() is None:
            second.kill()
            second.wait()


def _alive(pid: int) -> bool:
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)  # not our child (run started it): reaped by init
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@as_root
def test_cli_refuses_an_impostor_on_the_socket(shared_dir):
    sock = os.path.join(shared_dir, "moed.sock")
    impostor = ImpostorListener(sock)  # another user, listening where the daemon should be
    try:
        out = moed(sock, "run", "a secret prompt")
        assert out.returncode == 1 and f"uid {OTHER}" in out.stderr and "starting" not in out.stderr
        assert impostor.bytes_received() == 0
    finally:
        impostor.kill()


def test_serve_refuses_a_world_writable_socket_directory(shared_dir):
    os.chmod(shared_dir, 0o777)
    sock = os.path.join(shared_dir, "moed.sock")
    out = moed(sock, "serve", "--socket", sock)
    assert out.returncode == 1 and "writable by group or others" in out.stderr
    assert not os.path.exists(sock) and not os.path.exists(sock + ".lock")


def test_run_does_not_follow_a_planted_log_symlink(shared_dir):
    sock = os.path.join(shared_dir, "moed.sock")
    target = os.path.join(shared_dir, "elsewhere")
    os.symlink(target, os.path.join(shared_dir, "moed.log"))
    out = moed(sock, "run", "hi")
    assert out.returncode == 1 and "log" in out.stderr
    assert not os.path.lexists(target)


@as_root
def test_allowed_uids_let_another_user_in(shared_dir):
    sock = os.path.join(shared_dir, "run", "moed.sock")
    proc = subprocess.Popen([sys.executable, "-m", "daemon.cli", "serve", "--socket", sock], stderr=subprocess.PIPE,
                            text=True, env={**env(sock), "MOED_ALLOWED_UIDS": str(OTHER)}, cwd=ROOT)
    try:
        deadline = time.monotonic() + T
        while not os.path.exists(sock):
            assert proc.poll() is None and time.monotonic() < deadline, "the daemon did not start"
            time.sleep(0.05)
        assert stat.S_IMODE(os.stat(os.path.dirname(sock)).st_mode) == 0o711
        assert stat.S_IMODE(os.stat(sock).st_mode) == 0o666
        assert as_user(OTHER, client_call, sock, "health") == {"ok": True}
        refused = as_user(OTHER, client_call, sock, "trace", "/etc/hostname")
        assert refused["code"] == "forbidden"
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            assert proc.wait(T) == 0
        finally:
            if proc.poll() is None:
                proc.kill()


def test_sigterm_writes_the_expert_usage_json(sock, model, tmp_path):
    out = tmp_path / "usage.json"
    proc = subprocess.Popen([sys.executable, "-m", "daemon.cli", "serve", "--socket", sock], stderr=subprocess.PIPE,
                            text=True, env={**env(sock), "MOE_EXPERT_TRACE_OUTPUT": str(out)}, cwd=ROOT)
    try:
        with wait_for_daemon(sock, proc) as c:
            c.load(model)
            assert sum(len(r.tokens) for r in c.generate([1, 2, 3], model=model, max_tokens=2)) == 2
            out.unlink(missing_ok=True)  # whatever was written so far: the shutdown must write it
            proc.send_signal(signal.SIGTERM)
        assert proc.wait(T) == 0, proc.stderr.read()
        d = json.loads(out.read_text())
        # 3 prompt tokens in one prefill pass, then 1 decode pass for the 2nd token (the last sampled token
        # is never fed): exactly 2 passes over 4 tokens; the load's warm-up pass must not be counted
        assert (d["forward_passes"], d["total_tokens"]) == (2, 4), d
        assert d["activations"] > 0
        assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]  # no temp file left
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_the_log_holds_moeds_records_not_one_per_token(sock, model, tmp_path):
    """A generation adds a bounded number of log lines, whatever its length (issue 26, item 5:
    numba-cuda's per-free INFO records once made 20,630 lines in one run)."""
    log = tmp_path / "moed.log"
    proc = subprocess.Popen([sys.executable, "-m", "daemon.cli", "serve", "--socket", sock, "--log", str(log)],
                            stderr=subprocess.PIPE, text=True, env=env(sock), cwd=ROOT)
    try:
        with wait_for_daemon(sock, proc) as c:
            c.load(model)
            list(c.generate("Hello", model=model, max_tokens=2, options={"temperature": 0}))
            before = log.read_text().splitlines()
            tokens = 0
            for _ in range(3):
                gen = c.generate("Once upon a time", model=model, max_tokens=40, options={"temperature": 0})
                list(gen)
                tokens += gen.done.eval_count
            added = log.read_text().splitlines()[len(before):]
            c.shutdown()
        assert tokens >= 30  # the fixture's greedy text runs on, so the bound below means something
        assert len(added) <= 3, added  # at most a line a request, none per token
    finally:
        proc.kill()
        proc.wait(timeout=T)
