"""A client that goes away cancels its generation within a step or two, streamed or not: the HTTP
server and the scheduler in process, so the test can watch the sequence itself."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest

from daemon.catalog import Catalog
from daemon.config import Settings
from daemon.engine import Engine
from daemon.http.server import HttpServer
from daemon.scheduler import Scheduler

pytestmark = pytest.mark.usefixtures("warm_kernels")

# greedy from "The", the fixture runs 1687 tokens before its end-of-generation token
LONG = {"model": "tiny", "prompt": "The", "raw": True, "options": {"num_predict": 100000, "temperature": 0}}
NATURAL_END = 1687
# OpenAI's completions stop at 16 tokens unless told: the test must outlast its polling, so it asks for more
LONG_OPENAI = {"model": "tiny", "prompt": "The", "max_tokens": 100000, "temperature": 0}


@pytest.fixture
async def served(tmp_path, model_file):
    models = tmp_path / "models"
    models.mkdir()
    (models / "tiny.gguf").symlink_to(model_file)
    settings = Settings.load(env={}, http_host="127.0.0.1:0")
    sched = Scheduler(settings, factory=lambda path, **kw: Engine.load(path, **{"n_threads": 1, **kw}),
                      catalog=Catalog(models))
    http = HttpServer(settings, sched, str(tmp_path / "moed.sock"), frozenset(), "test")
    await http.start()
    yield sched, f"http://127.0.0.1:{http.port}"
    await http.close()
    await sched.close()


async def decoding(sched, tokens: int = 5):
    """The one sequence decoding, once it has made `tokens` tokens."""
    async with asyncio.timeout(60):
        while True:
            models = list(sched.registry.models.values())
            active = [s for m in models if m.loaded for s in m.batcher._active]
            if active and active[0].eval_count >= tokens:
                return models[0].batcher, active[0]
            await asyncio.sleep(0.002)


async def gone(batcher, seq) -> None:
    async with asyncio.timeout(10):
        while seq in batcher._active or seq.cache is not None:
            await asyncio.sleep(0.002)


async def test_a_client_gone_mid_stream_cancels_its_generation(served):
    sched, url = served
    async with aiohttp.ClientSession() as session:
        resp = await session.post(url + "/api/generate", json=LONG)
        for _ in range(3):
            assert json.loads(await resp.content.readline())["done"] is False
        batcher, seq = await decoding(sched)
        resp.close()  # the connection drops
        at_close = seq.eval_count
        await gone(batcher, seq)
    assert seq.cancelled
    assert seq.eval_count <= at_close + 3 < NATURAL_END


async def test_a_client_gone_before_a_whole_reply_cancels_it(served):
    sched, url = served
    body = json.dumps(LONG_OPENAI).encode()
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    batcher, seq = await decoding(sched)
    writer.close()
    at_close = seq.eval_count
    await gone(batcher, seq)
    assert seq.cancelled
    assert seq.eval_count <= at_close + 3 < NATURAL_END
