"""The client library is a thin client: it imports and talks to a daemon in a process where numpy
and numba cannot be imported (and without importing `daemon` at all)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

CHILD = textwrap.dedent("""
    import os, sys, tempfile
    for name in ("numpy", "numba"):
        sys.modules[name] = None  # `import numpy` raises ImportError from here on

    import ipc
    from ipc.client import Client
    from ipc.protocol import Chunk, Done, Generate, SamplingOptions
    from ipc.testing import MockServer

    def handler(req):
        if isinstance(req, Generate):
            return [Chunk(req.id, "hi", [1]), Done(req.id, eval_count=1)]
        return []

    path = os.path.join(tempfile.mkdtemp(prefix="moed-"), "moed.sock")
    with MockServer(handler, path).in_thread():
        with Client(path, timeout=30) as c:
            gen = c.generate("Hi", options={"temperature": 0.0, "seed": 1})
            text = "".join(chunk.text for chunk in gen)
    assert text == "hi" and gen.done.eval_count == 1
    try:
        SamplingOptions(top_p=2.0)
    except ValueError as e:
        assert "top_p" in str(e)
    else:
        raise AssertionError("top_p=2.0 accepted")
    loaded = sorted(m for m in sys.modules if m.split(".")[0] in ("daemon", "numpy", "numba")
                    and sys.modules[m] is not None)
    assert not loaded, loaded
    print("ok")
""")


def test_client_imports_and_talks_without_numpy_or_numba():
    env = {**os.environ, "PYTHONPATH": ROOT}
    out = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, cwd=ROOT,
                         env=env, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]
