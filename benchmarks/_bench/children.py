"""One benchmark configuration, run in a child process of its own (threads are fixed at start).

    moed(spec) / llama(spec) -> a row: load_s, prefill_tps, decode_tps, ttft_s, hit_rate,
                                expert_bytes, disk_bytes, timed_s, tokens, max_rss_mb, ...

spec: {"engine", "model", "ids", "threads", "concurrency", "decode", "cold", and for moed
"cache_mb", "routing", "replay"}. Sequence s of a batch gets the prompt with its body rotated
by s tokens, so concurrent sequences differ. Warm: load, one untimed pass of the same prompts,
then the timed pass. Cold: load, an untimed pass (kernels compile), close, the model's pages
dropped (disk.drop_file_pages), load again (timed as load_s), the timed pass: nothing of the
model is in the page cache or the expert cache when it starts.
"""

from __future__ import annotations

import resource
import time

import numpy as np

from .disk import drop_file_pages, io_read_bytes


def prompts(ids: list[int], n: int) -> list[list[int]]:
    body = ids[1:]
    return [ids[:1] + body[s % len(body):] + body[:s % len(body)] for s in range(n)] if body else [ids] * n


def moed(spec: dict) -> dict:
    from daemon import Engine

    settings = {"n_threads": spec["threads"], "expert_cache_limit_mb": spec["cache_mb"],
                "routing": spec["routing"], "routing_replay": spec["replay"] or ""}
    seqs = prompts(spec["ids"], spec["concurrency"])
    row: dict = {}
    if spec["cold"]:
        with Engine.load(spec["model"], **settings) as engine:
            _moed_pass(engine.model, seqs, 2)
        row["dropped"] = drop_file_pages(spec["model"])
    t0 = time.perf_counter()
    with Engine.load(spec["model"], **settings) as engine:
        row["load_s"] = time.perf_counter() - t0
        if not spec["cold"]:
            _moed_pass(engine.model, seqs, spec["decode"])
        engine.reset_stats()
        io0 = io_read_bytes()
        row |= _moed_pass(engine.model, seqs, spec["decode"])
        row["disk_bytes"] = io_read_bytes() - io0
        cache = engine.stats()["cache"]
        row["routing_used"] = engine.routing
        row["replay_note"] = engine.routing_replay.describe() if engine.routing_replay else ""
    if cache is not None:
        total = cache["total"]
        row["hit_rate"], row["expert_bytes"] = total["hit_rate"], total["bytes_read"]
    import numba

    row["numba_threads"] = numba.get_num_threads()
    return _finish(row)


def _moed_pass(model, seqs: list[list[int]], n_decode: int) -> dict:
    """Prefill every sequence (one forward_many for a batch), then n_decode greedy steps."""
    caches = [model.new_cache(len(s) + n_decode + 1) for s in seqs]
    t0 = time.perf_counter()
    if len(seqs) == 1:
        logits = model.forward(seqs[0], caches[0])[-1:]
    else:
        logits = model.forward_many(seqs, caches)
    toks = logits.argmax(-1)
    t1 = time.perf_counter()
    for _ in range(n_decode):
        logits = model.forward(toks[:1], caches[0]) if len(seqs) == 1 else model.forward_batch(toks, caches)
        toks = logits[-len(seqs):].argmax(-1)
    t2 = time.perf_counter()
    return _timings(sum(map(len, seqs)), len(seqs) * n_decode, t0, t1, t2)


def llama(spec: dict) -> dict:
    from llama_cpp import Llama

    if spec["concurrency"] != 1:
        raise SystemExit("llama-cpp-python's Llama runs one sequence at a time")
    ids, n = spec["ids"], spec["decode"]

    def load():
        return Llama(model_path=spec["model"], n_ctx=max(256, len(ids) + n + 8), n_threads=spec["threads"],
                     n_threads_batch=spec["threads"], n_batch=max(512, len(ids)), flash_attn=False,
                     verbose=False, seed=0)

    row: dict = {}
    if spec["cold"]:
        warm = load()
        _llama_pass(warm, ids, 2)
        warm.close()
        del warm
        row["dropped"] = drop_file_pages(spec["model"])
    t0 = time.perf_counter()
    llm = load()  # maps the file and reads it all (MAP_POPULATE): a cold start's reads land here
    row["load_s"] = time.perf_counter() - t0
    if not spec["cold"]:
        _llama_pass(llm, ids, n)
    io0 = io_read_bytes()
    row |= _llama_pass(llm, ids, n)
    row["disk_bytes"] = io_read_bytes() - io0
    llm.close()
    return _finish(row)


def _llama_pass(llm, ids: list[int], n_decode: int) -> dict:
    llm.reset()
    t0 = time.perf_counter()
    llm.eval(ids)
    tok = int(llm.scores[llm.n_tokens - 1].argmax())
    t1 = time.perf_counter()
    for _ in range(n_decode):
        llm.eval([tok])
        tok = int(llm.scores[llm.n_tokens - 1].argmax())
    t2 = time.perf_counter()
    return _timings(len(ids), n_decode, t0, t1, t2)


def _timings(n_prompt: int, n_decode: int, t0: float, t1: float, t2: float) -> dict:
    return {"prefill_tps": n_prompt / (t1 - t0), "decode_tps": n_decode / (t2 - t1) if n_decode else None,
            "ttft_s": t1 - t0, "timed_s": t2 - t0, "tokens": n_prompt + n_decode}


def _finish(row: dict) -> dict:
    row["max_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return row


def run(spec: dict) -> dict:
    np.seterr(all="ignore")
    return (moed if spec["engine"] == "moed" else llama)(spec)
