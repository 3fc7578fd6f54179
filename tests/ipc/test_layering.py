"""ipc/ is the wire alone (issue 26, item 7): no module of it imports daemon/, at any depth. The
daemon hands the server what it needs (ipc/handler.py); the dependency runs daemon → ipc only."""

from __future__ import annotations

import os

import pytest

import ipc
from tests.imports import imported, offending, package_imports

IPC_DIR = os.path.dirname(ipc.__file__)


def test_no_module_of_ipc_imports_daemon():
    found = package_imports(IPC_DIR, "ipc")
    assert {"server.py", "handler.py", "client.py", "protocol.py"} <= {os.path.basename(p) for p in found}
    bad = {os.path.relpath(p, IPC_DIR): offending(names, "daemon") for p, names in found.items()}
    assert {p: n for p, n in bad.items() if n} == {}


@pytest.mark.parametrize("source", [
    "import daemon",
    "import daemon.config as c",
    "from daemon.errors import wire_error",
    "from daemon import config",
    "def f():\n    from daemon.scheduler import Scheduler\n",
    "if TYPE_CHECKING:\n    from daemon.scheduler import Scheduler\n",
    "class A:\n    def m(self):\n        import daemon.engine\n",
    "import importlib\nimportlib.import_module('daemon.scheduler')",
    "from importlib import import_module\nimport_module('daemon')",
    "__import__('daemon.config')",
])
def test_the_checker_flags_an_import_of_daemon(source):
    assert offending(imported(source, "ipc"), "daemon") != []


@pytest.mark.parametrize("source", [
    "import daemonize",  # a name that only begins with "daemon"
    "from .protocol import Error",
    "from . import framing",
    "x = 'daemon.config'",  # a string that is not imported
    "from ipc.daemonish import x",
])
def test_the_checker_passes_what_is_not_daemon(source):
    assert offending(imported(source, "ipc"), "daemon") == []


def test_relative_imports_resolve_against_the_package():
    assert imported("from ..engine import Engine", "daemon.scheduler") == {"daemon.engine", "daemon.engine.Engine"}
    assert imported("from .. import demo", "daemon.scheduler") == {"daemon", "daemon.demo"}
    assert imported("from .access import Peer", "daemon.scheduler") == {"daemon.scheduler.access",
                                                                      "daemon.scheduler.access.Peer"}
