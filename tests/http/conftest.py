"""A real `moed serve` with HTTP on, for the tests of daemon/http.

    daemon             one per module: tiny (the qwen3moe Q8_0 fixture, linked into a models
                       directory as `tiny`), TCP at 127.0.0.1:<a free port>, HTTP on its unix socket
    start_daemon(**env) -> Daemon   another one with its own environment (queue size, API key, ...)

Daemon: .url (TCP), .http_socket, .socket (moed's own), .models (the directory), .model (the file),
.log (its stderr so far), .proc.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from ipc.client import Client
from ipc.errors import NotRunning
from tests.fixtures.build import fixture_path

T = 120  # seconds before a test fails rather than hangs (start-up imports numba)
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Daemon:
    proc: subprocess.Popen
    url: str
    socket: str
    http_socket: str
    models: Path
    model: str
    log_path: Path

    @property
    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def client(self) -> Client:
        return Client(self.socket, timeout=T)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def spawn(directory: Path, model: str, env: dict[str, str | None] | None = None, port: int | None = None,
          wait: bool = True) -> Daemon:
    """`moed serve` in `directory` (its sockets, its models directory holding `tiny`)."""
    directory.mkdir(parents=True, exist_ok=True)
    models = directory / "models"
    models.mkdir(exist_ok=True)
    if not (models / "tiny.gguf").exists():
        (models / "tiny.gguf").symlink_to(model)
    port = free_port() if port is None else port
    sock = str(directory / "moed.sock")
    full = {**os.environ, "MOED_SOCKET": sock, "MOED_MODELS": str(models), "MOE_N_THREADS": "1",
            "MOED_HTTP_HOST": f"127.0.0.1:{port}",
            "PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])), **(env or {})}
    full = {k: v for k, v in full.items() if v is not None}  # env={"X": None} unsets X
    log_path = directory / "serve.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "daemon.cli", "serve"], env=full, cwd=ROOT,
                                stdout=log, stderr=subprocess.STDOUT)
    d = Daemon(proc, f"http://127.0.0.1:{port}", sock, str(directory / "moed-http.sock"), models, model, log_path)
    if wait:
        _wait(d)
    return d


def _wait(d: Daemon) -> None:
    deadline = time.monotonic() + T
    while True:
        if d.proc.poll() is not None:
            raise AssertionError(f"the daemon exited ({d.proc.returncode}): {d.log}")
        try:
            with Client(d.socket, timeout=T) as c:
                c.health()
            if os.path.exists(d.http_socket):
                return
        except NotRunning:
            pass
        assert time.monotonic() < deadline, f"the daemon did not start: {d.log}"
        time.sleep(0.05)


def _short_dir(tmp: Path) -> Path:
    """A directory whose socket paths fit AF_UNIX's 108 bytes."""
    return tmp if len(str(tmp)) < 80 else Path(tempfile.mkdtemp(prefix="moed-"))


@pytest.fixture(scope="module")
def model_file(fixture_dir) -> str:
    return str(fixture_path("qwen3moe", "Q8_0", fixture_dir))


@pytest.fixture(scope="module")
def daemon(tmp_path_factory, model_file, warm_kernels):
    d = spawn(_short_dir(tmp_path_factory.mktemp("http")), model_file)
    yield d
    d.stop()


@pytest.fixture
def start_daemon(tmp_path, model_file, warm_kernels):
    started = []

    def start(env: dict[str, str] | None = None, **kw) -> Daemon:
        d = spawn(_short_dir(tmp_path) / f"d{len(started)}", model_file, env, **kw)
        started.append(d)
        return d

    yield start
    for d in started:
        d.stop()


@pytest.fixture(scope="module")
def reference_embeddings(model_file):
    """Engine.embed in this process (checked against llama.cpp in tests/test_engine_embed.py):
    texts -> [N, D]."""
    from daemon.engine import Engine

    engine = Engine.load(model_file, n_threads=1)
    yield lambda texts: engine.embed(texts)[0]
    engine.close()


EMBED_TEXTS = ["Hello world", "The quick brown fox jumps over the lazy dog."]


def via_socket(daemon: Daemon, call) -> tuple[str, object]:
    """The reference for HTTP's text: call(client) -> a Generation over moed's own socket; its
    text and its Done."""
    with daemon.client() as c:
        gen = call(c)
        return "".join(ch.text for ch in gen), gen.done
