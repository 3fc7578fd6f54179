"""The helpers that turn a missing test reference into a skip locally and a failure under CI."""

from __future__ import annotations

import inspect

import pytest

from tests.conftest import import_reference, missing_reference, needs_reference


@pytest.mark.parametrize("ci,outcome", [(None, pytest.skip.Exception), ("1", pytest.fail.Exception)])
def test_missing_reference_skips_locally_and_fails_under_ci(monkeypatch, ci, outcome):
    if ci is None:
        monkeypatch.delenv("CI", raising=False)
    else:
        monkeypatch.setenv("CI", ci)
    with pytest.raises(outcome, match="libfoo"):
        missing_reference("libfoo is missing")
    with pytest.raises(outcome, match="no_such_module_xyz"):
        import_reference("no_such_module_xyz")

    def test_body(fixture_dir, arch):
        raise AssertionError("must not run")

    wrapped = needs_reference(False, "libfoo is missing")(test_body)
    assert inspect.signature(wrapped) == inspect.signature(test_body)  # fixtures still resolve
    with pytest.raises(outcome, match="libfoo"):
        wrapped(None, "llama")


def test_available_reference_is_left_alone():
    def test_body():
        return 7

    assert needs_reference(True, "unused")(test_body) is test_body
    assert import_reference("json").dumps([]) == "[]"
