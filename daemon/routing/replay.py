"""Replay a routing trace through a per-layer expert cache and count hits.

A trace is, per MoE layer, the token-ordered sequence of the expert sets each token used. Each
layer has its own cache of `capacity` experts (as moed's per-layer LRU). A token's experts for a
layer are requested together: they are all needed at once, so during that step they are pinned and
cannot be evicted; the ones not resident (misses) are loaded then. A hit is a requested expert that
was already resident. When one token needs more experts than the capacity, they are all loaded for
the step anyway (counted as misses) and the cache is trimmed back to capacity afterwards, so a
budget below one step's need still completes.

The policies (`POLICIES`: lru, belady, lfu-decay, lru2, lfru; `ADMISSION_POLICIES`: lfru-admit,
opt-bypass) and the simulator (`simulate_layer`, `simulate`) live in experts/policies.py, which
documents them; they are re-exported here for the CLI and the benchmarks. This module reads
traces, scores history-only predictors and formats the tables.
"""

from __future__ import annotations

import io
import json
import os
from typing import Sequence

from ..errors import RequestError
from ..experts.policies import (ADMISSION_POLICIES, LFRU_FAST, LFRU_SLOW, LFRU_WEIGHT,  # noqa: F401
                                LFU_DECAY, POLICIES, SIMULATED, LayerResult, ReplayResult, Trace,
                                simulate, simulate_layer)


# -- loading -----------------------------------------------------------------------------------


MAX_TRACE_BYTES = 64 * 2**20  # on disk, and again decompressed: the biggest shipped trace is 0.3 MB
_CHUNK = 2**20


def _too_big(path: str, what: str) -> RequestError:
    return RequestError(f"{path}: trace {what} {MAX_TRACE_BYTES // 2**20} MiB (MAX_TRACE_BYTES); not reading it")


def _read_bounded(read, path: str, what: str) -> bytes:
    """read(n) until EOF, refusing more than MAX_TRACE_BYTES."""
    parts, n = [], 0
    while chunk := read(_CHUNK):
        n += len(chunk)
        if n > MAX_TRACE_BYTES:
            raise _too_big(path, what)
        parts.append(chunk)
    return b"".join(parts)


def _open_trace(path: str) -> int:
    """A blocking fd on the trace, opened as model files are (a FIFO or device is never read: one
    would block the load forever, /dev/zero would fill memory); RequestError if it is not a
    regular file or is larger than MAX_TRACE_BYTES."""
    from ..storage.identity import open_regular

    try:
        fd, st = open_regular(path)
    except OSError as e:
        raise RequestError(f"cannot read trace {path}: {e.strerror or e}") from None
    if st.st_size > MAX_TRACE_BYTES:
        os.close(fd)
        raise _too_big(path, "file is larger than")
    os.set_blocking(fd, True)
    return fd


def check_trace_path(path: str | os.PathLike) -> None:
    """What load_trace_ids refuses before reading (the registry asks before it unloads a model to
    make room): RequestError unless `path` is a regular file within MAX_TRACE_BYTES."""
    os.close(_open_trace(os.fspath(path)))


def _read_text(path: str) -> str:
    """The trace's text (_open_trace), its size bounded again as read and after zstd."""
    with open(_open_trace(path), "rb", closefd=True) as f:
        data = _read_bounded(f.read, path, "file is larger than")
    if path.endswith(".zst"):
        import zstandard

        try:
            data = _read_bounded(zstandard.ZstdDecompressor().stream_reader(io.BytesIO(data)).read, path,
                                 "decompresses to more than")
        except zstandard.ZstdError as e:
            raise RequestError(f"{path}: not a valid zstd file ({e})") from None
    return data.decode("utf-8", errors="strict")


def load_trace(path: str | os.PathLike) -> Trace:
    """Read a jsonl trace (`.jsonl` or `.jsonl.zst`): one `{"tok": n, "layers": [[ids], ...]}` per
    token. Returns per-layer token sequences of expert-id sets. Raises RequestError naming the line
    of a malformed record."""
    return [[frozenset(ids) for ids in seq] for seq in load_trace_ids(path)]


def load_trace_ids(path: str | os.PathLike) -> list[list[list[int]]]:
    """load_trace, keeping each token's ids in file order (moed's own traces: top-k order):
    [moe layer][token] -> ids."""
    path = os.fspath(path)
    try:
        text = _read_text(path)
    except OSError as e:
        raise RequestError(f"cannot read trace {path}: {e.strerror or e}") from None
    except UnicodeDecodeError:
        raise RequestError(f"{path}: trace is not UTF-8 text") from None
    layers: list[list[list[int]]] | None = None
    for lineno, line in enumerate(io.StringIO(text), 1):
        if not line.strip():
            continue
        where = f"{path}:{lineno}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise RequestError(f"{where}: not valid JSON ({e.msg})") from None
        if not isinstance(obj, dict) or not isinstance(obj.get("layers"), list):
            raise RequestError(f"{where}: expected an object with a \"layers\" list")
        rec = obj["layers"]
        if layers is None:
            if not rec:
                raise RequestError(f"{where}: \"layers\" is empty")
            layers = [[] for _ in rec]
        if len(rec) != len(layers):
            raise RequestError(f"{where}: {len(rec)} layers, but earlier lines have {len(layers)}")
        for il, ids in enumerate(rec):
            if not isinstance(ids, list) or not all(type(v) is int and v >= 0 for v in ids):
                raise RequestError(f"{where}: layer {il} must be a list of non-negative integer expert ids")
            if len(set(ids)) != len(ids):
                raise RequestError(f"{where}: layer {il} repeats an expert id")
            layers[il].append(ids)
    if layers is None:
        raise RequestError(f"{path}: trace holds no tokens")
    return layers


# -- simulation --------------------------------------------------------------------------------


# The policies and the simulator live in experts/policies.py (imported above, re-exported).


# -- predictors that read only the routing history -------------------------------------------


HISTORY_PREDICTORS = ("previous_token", "next_layer", "frequent")


def predictor_recall(trace: Trace) -> dict[str, dict]:
    """Recall of three predictors that read nothing but the routing of the tokens (and layers)
    before, scored as the live predictors are (predict.Recall: |predicted & exact| / |exact|), so a
    trace without hidden states (a real model's, recorded elsewhere) can be set beside moed's
    Path A and speculative recall on a model. Each predicts as many experts as the step used:
    - previous_token: layer L's experts of the token before;
    - next_layer: layer L+1's experts from layer L's experts of the same token, ranked by how often
      each followed those in the tokens before (co-occurrence counts, learned online; ties: lower id);
    - frequent: layer L's most used experts over the tokens before (ties: lower id).
    Every predictor is scored from the second token on (the first has no history); next_layer
    predicts from the second MoE layer on, as speculative does.
    -> {name: Recall.as_dict()}: per_layer, overall, predicted and exact counts."""
    import numpy as np

    from .predict import Recall

    n_layer = len(trace)
    n_tok = min((len(seq) for seq in trace), default=0)
    n_exp = [max((max(s) for s in seq if s), default=-1) + 1 for seq in trace]
    recall = {p: Recall() for p in HISTORY_PREDICTORS}
    uses = [np.zeros(n, np.int64) for n in n_exp]
    follows = [np.zeros((n_exp[il], n_exp[il + 1]), np.int64) for il in range(n_layer - 1)]

    def top(score: np.ndarray, k: int) -> set[int]:
        return set(np.argsort(-score, kind="stable")[:k].tolist())

    for t in range(n_tok):
        for il in range(n_layer):
            need = set(trace[il][t])
            if t and need:
                recall["previous_token"].add(il, set(trace[il][t - 1]), need)
                recall["frequent"].add(il, top(uses[il], len(need)), need)
                if il:
                    prev = sorted(trace[il - 1][t])
                    recall["next_layer"].add(il, top(follows[il - 1][prev].sum(axis=0), len(need)), need)
        for il in range(n_layer):  # learn from this token only after predicting it
            ids = sorted(trace[il][t])
            uses[il][ids] += 1
            if il + 1 < n_layer and ids and trace[il + 1][t]:
                follows[il][np.ix_(ids, sorted(trace[il + 1][t]))] += 1
    return {p: r.as_dict() for p, r in recall.items()}


# -- capacity from sizes -----------------------------------------------------------------------


def expert_bytes_per_layer(model_path: str | os.PathLike) -> list[int]:
    """Bytes of one expert (gate+up+down slices) for each MoE layer of a GGUF file, in layer order."""
    from ..storage.gguf import GGUFFile

    out = []
    with GGUFFile(model_path) as g:
        il = 0
        n_layer = max((int(n.split(".")[1]) for n in g.tensors if n.startswith("blk.")), default=-1) + 1
        for il in range(n_layer):
            names = [f"blk.{il}.ffn_{p}_exps.weight" for p in ("gate", "up", "down")]
            if not all(n in g.tensors for n in names):
                continue
            total = 0
            for n in names:
                ti = g.tensor_info(n)
                total += ti.nbytes // ti.ne[-1]
            out.append(total)
    if not out:
        raise RequestError(f"{os.fspath(model_path)}: no stacked expert tensors (not an MoE model)")
    return out


def capacity_from_mb(cache_mb: float, expert_bytes: Sequence[int], n_layers: int) -> list[int]:
    """Experts per layer for a total budget of `cache_mb` MiB split evenly over `n_layers` MoE
    layers (as EXPERT_CACHE_LIMIT_MB). `expert_bytes`: one value, or one per layer."""
    eb = list(expert_bytes)
    if len(eb) == 1:
        eb = eb * n_layers
    if len(eb) != n_layers:
        raise RequestError(f"the model has {len(eb)} MoE layers but the trace has {n_layers}")
    per_layer = cache_mb * 2**20 / n_layers
    return [int(per_layer // b) for b in eb]


def format_table(results: dict[str, ReplayResult], capacity) -> str:
    """Per-layer hit rates per policy, the overall line, the Belady gap (demand policies) and the
    bypass gap (admission policies, against opt-bypass)."""
    pols = list(results)
    caps = [capacity] * len(next(iter(results.values())).layers) if isinstance(capacity, int) else list(capacity)
    w = max(9, *(len(p) + 2 for p in pols))
    lines = ["layer  cap " + "".join(f"{p:>{w}}" for p in pols)]
    n_layers = len(results[pols[0]].layers)
    for il in range(n_layers):
        lines.append(f"{il:>5} {caps[il]:>4} " + "".join(f"{results[p].layers[il].hit_rate:>{w}.1%}" for p in pols))
    lines.append("  all      " + "".join(f"{results[p].hit_rate:>{w}.1%}" for p in pols))
    lines.append("  hits     " + "".join(f"{results[p].hits:>{w}}" for p in pols))
    lines.append("  misses   " + "".join(f"{results[p].misses:>{w}}" for p in pols))
    if "belady" in results and "lru" in results:
        b, l = results["belady"].hit_rate, results["lru"].hit_rate
        gap = b - l
        lines.append(f"Belady gap (belady - lru): {gap:+.1%} points")
        for p in pols:
            if p not in ("lru", "belady", *ADMISSION_POLICIES) and gap > 0:
                closed = (results[p].hit_rate - l) / gap
                lines.append(f"  {p} closes {closed:.0%} of the gap")
    if "opt-bypass" in results and "lru" in results:  # admission policies against their own optimum
        l = results["lru"].hit_rate
        gap = results["opt-bypass"].hit_rate - l
        lines.append(f"Bypass gap (opt-bypass - lru): {gap:+.1%} points")
        for p in pols:
            if p in ADMISSION_POLICIES and p != "opt-bypass" and gap > 0:
                lines.append(f"  {p} closes {(results[p].hit_rate - l) / gap:.0%} of it")
    return "\n".join(lines)
