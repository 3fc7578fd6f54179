"""The daemon's start-up (daemon/service.py): the server's config from Settings, the scheduler
given the engine loader and the demo, and no numba imported on the way (issue 26, item 7)."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

from daemon import service
from daemon.config import Settings
from ipc.handler import ServerConfig
from ipc.server import Server

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_server_config_carries_the_settings():
    s = Settings.load(env={"MOED_SOCKET": "/run/x/moed.sock", "MOED_ALLOWED_UIDS": "4242, 4243",
                           "MOED_MAX_FRAME": "2097152", "MOED_MAX_CONNECTIONS": "3",
                           "MOED_MAX_REQUESTS_PER_CONNECTION": "2", "MOED_FRAME_TIMEOUT": "0"})
    assert service.server_config(s) == ServerConfig("/run/x/moed.sock", frozenset({4242, 4243}), 2 * 2**20, 3, 2, 0.0)
    assert service.server_config(s, "/elsewhere.sock").socket_path == "/elsewhere.sock"  # --socket wins


def test_server_config_defaults_are_the_daemons():
    ours = dataclasses.asdict(service.server_config(Settings.load(env={})))
    assert {**dataclasses.asdict(ServerConfig()), "socket_path": None} == {**ours, "socket_path": None}
    assert ours["allowed_uids"] == frozenset() and ours["max_frame"] == 16 * 2**20


def test_the_server_maps_errors_as_the_daemon_does(tmp_path):
    from daemon.errors import RequestError, SchedulerError

    server = service.make_server(Settings.load(env={}), str(tmp_path / "s.sock"),
                                 scheduler=service.make_scheduler(Settings.load(env={})))
    try:
        assert isinstance(server, Server)
        assert server.error_of(SchedulerError("busy", "full")) == ("busy", "full")
        assert server.error_of(RequestError("bad")) == ("bad_request", "bad")
        assert server.error_of(KeyError("x")) == ("internal", "KeyError: 'x'")
    finally:
        server.handler.text.close()


def test_start_up_imports_no_engine():
    """Building the scheduler and the server (what `moed serve` does before the event loop starts)
    imports neither numba nor the engine: they come with the first model."""
    code = ("import sys; from daemon import service; from daemon.config import Settings; "
            "s = Settings.load(env={}); service.make_server(s, '/nonexistent/s.sock'); "
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'numba' "
            "or m in ('daemon.engine', 'daemon.demo')))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
