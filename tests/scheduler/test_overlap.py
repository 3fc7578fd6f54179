"""The overlapped serving loop (daemon/scheduler/batcher.py) on the CPU, with a decoder that keeps
the device decoder's contract: a launched step's tokens are known only when it is waited for, and
the next step is launched before that, reading them "on the device" (from the step in flight).
The loop must still give every request its solo tokens and stop it exactly: max_tokens, end of
generation and stop strings, with no extra token, and at most one wasted row per ended sequence."""

from __future__ import annotations

import asyncio

import pytest

from daemon.model import decoding
from daemon.scheduler import batcher as batcher_module
from ipc.protocol import Chunk, Done, Generate, SamplingOptions
from tests.scheduler.test_scheduler import GREEDY, model, prompts, run, sched  # noqa: F401  (fixtures)

pytestmark = pytest.mark.usefixtures("warm_kernels")

SEEDED = SamplingOptions(seed=11)  # the default options otherwise: top-k, top-p, min-p, penalty


class Lagging(decoding.HostDecoder):
    """Host sampling, but a step's tokens reach the loop only at wait(), and a fed row takes its
    input from the step before's tokens (the batcher has not accepted them yet)."""

    overlapping = True
    rows = 0  # rows launched
    fed = 0  # of which fed from the step in flight

    def overlaps(self, seqs) -> bool:
        return True

    def launch(self, seqs, src=None, prev=None):
        before = prev.wait()[0] if prev is not None else None
        tokens, histories = [], []
        for b, s in enumerate(seqs):
            fed = src is not None and src[b] >= 0
            t = int(before[src[b]]) if fed else s.token
            Lagging.fed += fed
            tokens.append(t)
            histories.append(s.history + [t] if fed else s.history)
        Lagging.rows += len(seqs)
        logits = self.model.forward_batch(tokens, [s.cache for s in seqs])
        out, errors = [], []
        for b, s in enumerate(seqs):
            try:
                out.append(s.sampler.sample(logits[b], histories[b]))
                errors.append(None)
            except Exception as e:  # noqa: BLE001
                out.append(0)
                errors.append(e)
        return decoding.Done(out, errors)


@pytest.fixture
def lagging(monkeypatch):
    Lagging.rows = Lagging.fed = 0
    monkeypatch.setattr(batcher_module, "decoder_for", Lagging)


def _tail_ok(replies) -> bool:
    """One terminal reply, last."""
    return isinstance(replies[-1], Done) and not any(isinstance(r, Done) for r in replies[:-1])


async def _solo(sched, reqs):
    return [await run(sched, r) for r in reqs]


@pytest.mark.parametrize("options", [GREEDY, SEEDED], ids=["greedy", "seeded"])
async def test_sixteen_concurrent_requests_get_their_solo_tokens(sched, model, lagging, options):  # noqa: F811
    ps = prompts(16)
    lengths = [4 + (i * 5) % 13 for i in range(16)]
    reqs = [Generate(i + 1, model, tokens=p, max_tokens=n, options=options) for i, (p, n) in enumerate(zip(ps, lengths))]
    solo = await _solo(sched, reqs)
    together = await asyncio.gather(*(run(sched, Generate(100 + r.id, model, tokens=r.tokens, max_tokens=r.max_tokens,
                                                          options=options)) for r in reqs))
    assert sched.registry.find(model).batcher.peak_batch > 1
    assert Lagging.fed > Lagging.rows // 2  # most rows read the step in flight's tokens
    for (r1, t1, x1), (r2, t2, x2), n in zip(solo, together, lengths):
        assert (t1, x1) == (t2, x2)
        assert _tail_ok(r2) and r2[-1].eval_count == len(t2) == n  # max_tokens exact


async def test_a_stop_string_ends_exactly_and_wastes_at_most_one_row(sched, model, lagging):  # noqa: F811
    ps = prompts(6)
    free = await _solo(sched, [Generate(i + 1, model, tokens=p, max_tokens=12, options=GREEDY) for i, p in enumerate(ps)])
    # a stop string made of each request's own 4th and 5th chunks: it stops there
    stops = []
    for replies, _, _ in free:
        texts = [r.text for r in replies if isinstance(r, Chunk)]
        stops.append((texts[3] + texts[4]).strip() or texts[4])
    reqs = [Generate(50 + i, model, tokens=p, max_tokens=12, options=GREEDY, stop=[stop])
            for i, (p, stop) in enumerate(zip(ps, stops))]
    solo = await _solo(sched, reqs)
    Lagging.rows = 0
    together = await asyncio.gather(*(run(sched, Generate(r.id + 100, model, tokens=r.tokens, max_tokens=12,
                                                          options=GREEDY, stop=r.stop)) for r in reqs))
    stopped = 0
    for (r1, t1, x1), (r2, t2, x2), stop in zip(solo, together, stops):
        assert (t1, x1) == (t2, x2) and _tail_ok(r2)
        assert r2[-1].done_reason == r1[-1].done_reason and r2[-1].eval_count == r1[-1].eval_count
        assert stop not in x2
        stopped += r2[-1].done_reason == "stop"
    assert stopped >= 3
    decoded = sum(r[-1].eval_count - 1 for r, _, _ in together)  # the first token comes from the prefill
    assert decoded <= Lagging.rows <= decoded + stopped


async def test_end_of_generation_ends_exactly(sched, model, lagging):  # noqa: F811
    ps = prompts(4)
    free = await _solo(sched, [Generate(i + 1, model, tokens=p, max_tokens=10, options=GREEDY) for i, p in enumerate(ps)])
    engine = sched.registry.find(model).engine
    ends = {t[5] for _, t, _ in free}  # each request's 6th token becomes an end of generation
    engine.tokenizer.eog_ids = frozenset(ends)
    Lagging.rows = 0
    together = await asyncio.gather(*(run(sched, Generate(20 + i, model, tokens=p, max_tokens=10, options=GREEDY))
                                      for i, p in enumerate(ps)))
    for (_, t1, _), (r2, t2, _) in zip(free, together):
        cut = next(i for i, t in enumerate(t1) if t in ends)
        assert t2 == t1[:cut] and _tail_ok(r2) and r2[-1].done_reason == "stop"
        assert r2[-1].eval_count == cut
    decoded = sum(len(t) for _, t, _ in together)  # the end token was sampled by a step too
    assert decoded <= Lagging.rows <= decoded + len(ps)


async def test_cancel_stops_within_one_step(sched, model, lagging):  # noqa: F811
    await run(sched, Generate(1, model, tokens=[1, 2], max_tokens=1))
    batcher = sched.registry.find(model).batcher
    chunks = []
    task = asyncio.create_task(sched.generate(Generate(2, model, tokens=[3, 4], max_tokens=3000),
                                              chunks.append, 0))
    other = asyncio.create_task(run(sched, Generate(3, model, tokens=[5, 6], max_tokens=40, options=GREEDY)))
    async with asyncio.timeout(30):
        while len(chunks) < 3:
            await asyncio.sleep(0.001)
    seq = next(s for s in batcher._active if s.id == 2)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    at_cancel = seq.produced
    async with asyncio.timeout(10):
        while seq.cache is not None or seq in batcher._active:
            await asyncio.sleep(0.001)
    assert seq.produced <= at_cancel + 2  # the step in flight, and one being launched as it came
    replies, toks, _ = await other
    solo = await run(sched, Generate(4, model, tokens=[5, 6], max_tokens=40, options=GREEDY))
    assert isinstance(replies[-1], Done) and toks == solo[1]
