"""daemon/experts/ sits low in the house (issue 27, item 6): no module of it imports daemon.routing,
daemon.model or daemon.backend, at any depth; those import it."""

from __future__ import annotations

import os

import daemon.experts
from tests.imports import offending, package_imports

EXPERTS_DIR = os.path.dirname(daemon.experts.__file__)


def test_no_module_of_experts_imports_routing_model_or_backend():
    found = package_imports(EXPERTS_DIR, "daemon.experts")
    assert {"policies.py", "slots.py", "promotion.py", "offload.py", "stats.py"} <= {os.path.basename(p) for p in found}
    bad = {os.path.relpath(p, EXPERTS_DIR): sum((offending(names, b) for b in
                                                ("daemon.routing", "daemon.model", "daemon.backend")), [])
           for p, names in found.items()}
    assert {p: n for p, n in bad.items() if n} == {}
