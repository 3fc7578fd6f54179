"""MOED_ALLOWED_UIDS (issue 25): the daemon's own user is always admitted, whatever the list names,
so `moed stop` keeps working; a bad list fails the start (tests/test_config.py has the parsing)."""

from __future__ import annotations

import os

import pytest

from daemon.errors import ConfigError
from tests.ipc.test_server import make_server


@pytest.mark.parametrize("spec", ["", "65534", f"{os.geteuid() + 4242}", f"0,{os.geteuid() + 1}"])
def test_own_user_is_always_admitted(tmp_path, spec):
    server = make_server(str(tmp_path / "s.sock"), allowed_uids=spec)
    assert os.geteuid() in server.allowed_uids
    named = {int(u) for u in spec.split(",") if u}
    assert server.allowed_uids == named | {os.geteuid()}


@pytest.mark.parametrize("spec", [",", "-1", "1_000", "\u0660"])
def test_a_bad_list_fails_the_start(tmp_path, spec):
    with pytest.raises(ConfigError, match="allowed_uids"):
        make_server(str(tmp_path / "s.sock"), allowed_uids=spec)
