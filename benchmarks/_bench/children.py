"""One benchmark configuration, run in a child process of its own (threads are fixed at start).

    moed(spec) / llama(spec) -> a row: load_s, load_disk_bytes, prefill_tps, decode_tps, ttft_s,
                                hit_rate, expert_bytes, disk_bytes (of the timed passes), timed_s,
                                tokens, generated (sequence 0's greedy tokens), max_rss_mb, ...

spec: {"engine", "model", "ids", "threads", "concurrency", "decode", "cold", and for moed
"cache_mb", "routing", "replay"}. Sequence s of a batch gets the prompt with its body rotated
by s tokens, so concurrent sequences differ. Warm: load, one untimed pass of the same prompts,
then the timed pass. Cold: load, an untimed pass (kernels compile), close, the model's pages
dropped (disk.drop_file_pages), load again (timed as load_s), the timed pass: nothing of the
model is in the page cache or the expert cache when it starts. A spec with "device": "cuda" is a
moed run on the GPU (gpu.moed).
"""

from __future__ import annotations

import os
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
    if "MOE_CPU_STEP" not in os.environ:  # time the compiled step, not the per-op path beside its compile
        settings["cpu_step"] = "wait"
    seqs = prompts(spec["ids"], spec["concurrency"])
    row: dict = {}
    if spec["cold"]:
        with Engine.load(spec["model"], **settings) as engine:
            _moed_pass(engine.model, seqs, 2)
        del engine  # its weights must not stay alive while the timed engine loads
        row["dropped"] = drop_file_pages(spec["model"])
    io0, t0 = io_read_bytes(), time.perf_counter()
    with Engine.load(spec["model"], **settings) as engine:
        row["load_s"], row["load_disk_bytes"] = time.perf_counter() - t0, io_read_bytes() - io0
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
    out = [int(toks[0])]
    t1 = time.perf_counter()
    for _ in range(n_decode):
        logits = model.forward(toks[:1], caches[0]) if len(seqs) == 1 else model.forward_batch(toks, caches)
        toks = logits[-len(seqs):].argmax(-1)
        out.append(int(toks[0]))
    t2 = time.perf_counter()
    return _timings(sum(map(len, seqs)), len(seqs) * n_decode, t0, t1, t2) | {"generated": out[:-1]}


def llama(spec: dict) -> dict:
    """One sequence through Llama.eval; a batch of N through llama_decode with N sequence ids."""
    from llama_cpp import Llama

    seqs, n, conc = prompts(spec["ids"], spec["concurrency"]), spec["decode"], spec["concurrency"]
    if conc > 1:
        _context_sequences(conc)
    run = _llama_pass if conc == 1 else _llama_batch_pass

    # llama.cpp's repacked CPU buffers copy the weights into RAM: a file larger than half the free
    # memory would not load (an 80B Q4_K_M needs 35 GB of them), so it runs from its mapping
    repack = os.path.getsize(spec["model"]) < _mem_available() // 2
    if not repack:
        _llama_defaults("model", use_extra_bufts=False)  # plain CPU buffers

    def load():
        return Llama(model_path=spec["model"], n_ctx=conc * max(256, len(seqs[0]) + n + 8),
                     n_threads=spec["threads"], n_threads_batch=spec["threads"],
                     n_batch=max(512, sum(map(len, seqs))), flash_attn=False, verbose=False, seed=0)

    row: dict = {"llama_repack": repack}
    if spec["cold"]:
        warm = load()
        run(warm, seqs, 2)
        warm.close()
        del warm
        row["dropped"] = drop_file_pages(spec["model"])
    io0, t0 = io_read_bytes(), time.perf_counter()
    llm = load()  # maps the file and reads it all (MAP_POPULATE): a cold start's reads land here
    row["load_s"], row["load_disk_bytes"] = time.perf_counter() - t0, io_read_bytes() - io0
    if not spec["cold"]:
        run(llm, seqs, n)
    io0 = io_read_bytes()
    row |= run(llm, seqs, n)
    row["disk_bytes"] = io_read_bytes() - io0
    llm.close()
    return _finish(row)


def _context_sequences(n: int) -> None:
    """Llama takes no n_seq_max: give its contexts room for n sequences (each n_ctx / n long)."""
    _llama_defaults("context", n_seq_max=n)


def _llama_defaults(kind: str, **fields) -> None:
    """Set fields of llama.cpp's default `kind` ("model" or "context") params for the Llama
    objects this process makes (Llama takes no argument for them)."""
    import llama_cpp.llama as mod

    name = f"llama_{kind}_default_params"
    default = getattr(mod.llama_cpp, name)

    def params():
        p = default()
        for key, value in fields.items():
            setattr(p, key, value)
        return p

    setattr(mod.llama_cpp, name, params)


def _llama_pass(llm, seqs: list[list[int]], n_decode: int) -> dict:
    (ids,) = seqs
    llm.reset()
    t0 = time.perf_counter()
    llm.eval(ids)
    out = [_argmax(llm, -1)]  # Llama.scores stays empty without logits_all: read the context's logits
    t1 = time.perf_counter()
    for _ in range(n_decode):
        llm.eval(out[-1:])
        out.append(_argmax(llm, -1))
    t2 = time.perf_counter()
    return _timings(len(ids), n_decode, t0, t1, t2) | {"generated": out[:-1]}


def _llama_batch_pass(llm, seqs: list[list[int]], n_decode: int) -> dict:
    """Every prompt in one llama_decode (sequence ids 0..N-1), then N tokens per decode step."""
    from llama_cpp import _internals

    llm._ctx.kv_cache_clear()
    batch = _internals.LlamaBatch(n_tokens=sum(map(len, seqs)), embd=0, n_seq_max=1, verbose=False)
    for s, ids in enumerate(seqs):
        batch.add_sequence(ids, s, False)
    last = np.cumsum([len(ids) for ids in seqs]) - 1
    t0 = time.perf_counter()
    llm._ctx.decode(batch)
    toks = [_argmax(llm, int(i)) for i in last]
    out = [toks[0]]
    t1 = time.perf_counter()
    b = batch.batch
    for step in range(n_decode):
        b.n_tokens = len(seqs)
        for s, tok in enumerate(toks):
            b.token[s], b.pos[s], b.seq_id[s][0], b.n_seq_id[s], b.logits[s] = tok, len(seqs[s]) + step, s, 1, True
        llm._ctx.decode(batch)
        toks = [_argmax(llm, s) for s in range(len(seqs))]
        out.append(toks[0])
    t2 = time.perf_counter()
    return _timings(sum(map(len, seqs)), len(seqs) * n_decode, t0, t1, t2) | {"generated": out[:-1]}


def _argmax(llm, row: int) -> int:
    return int(np.ctypeslib.as_array(llm._ctx.get_logits_ith(row), shape=(llm.n_vocab(),)).argmax())


def _timings(n_prompt: int, n_decode: int, t0: float, t1: float, t2: float) -> dict:
    return {"prefill_tps": n_prompt / (t1 - t0), "decode_tps": n_decode / (t2 - t1) if n_decode else None,
            "ttft_s": t1 - t0, "timed_s": t2 - t0, "tokens": n_prompt + n_decode}


def _finish(row: dict) -> dict:
    row["max_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return row


def run(spec: dict) -> dict:
    np.seterr(all="ignore")
    if spec.get("device") == "cuda":
        from . import gpu

        return gpu.moed(spec)
    return (moed if spec["engine"] == "moed" else llama)(spec)


def _mem_available() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0
