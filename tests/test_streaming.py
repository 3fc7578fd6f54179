"""Expert streaming end to end: an Engine reading experts from disk through a bounded cache gives
the same logits and greedy tokens, bit for bit, as a Transformer over the whole file in memory, at
every cache size and in every routing mode; it reads exactly the experts it misses; it fails the
request, not the process, when the model file is truncated; it uses a valid expert pack and ignores a stale one; its tracer and
verbose routing log report the routing that really happened."""

from __future__ import annotations

import json
import logging
import re
import shutil
import time

import numpy as np
import pytest

from daemon import Engine
from daemon.config import Settings
from daemon.errors import ModelFileChanged
from daemon.model.transformer import Transformer
from daemon.storage.gguf import GGUFFile
from daemon.storage.pack import write_pack
from tests.fixtures.build import fixture_path

CASES = [("qwen3moe", "Q8_0"), ("gpt-oss", "MXFP4"), ("qwen3next", "Q8_0")]
MODES = ["exact", "approx", "speculative", "all"]
PROMPT = [5, 17, 200, 3, 96, 411]
N_GEN = 5


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    """Settings come from each test's arguments, never from the environment running the suite."""
    for _, env, _, _ in Settings.describe():
        monkeypatch.delenv(env, raising=False)


class Ref:
    """The reference: a Transformer over the whole file (ResidentExperts), greedy by argmax."""

    def __init__(self, path):
        self.path = path
        self.gguf = GGUFFile(path)
        self.model = Transformer(self.gguf)
        g = self.gguf
        arch = g.architecture
        self.n_used = int(g.get(f"{arch}.expert_used_count"))
        self.eos = int(g.get("tokenizer.ggml.eos_token_id"))
        self.moe_layers, self.expert_bytes = [], {}
        il = 0
        while f"blk.{il}.attn_norm.weight" in g.tensors:
            names = [f"blk.{il}.ffn_{p}_exps.weight" for p in ("gate", "up", "down")]
            if names[0] in g.tensors:
                self.moe_layers.append(il)
                self.expert_bytes[il] = sum(g.tensor_info(n).nbytes // g.tensor_info(n).ne[2] for n in names)
            il += 1
        self.n_layer = il
        m = self.model
        self.all_logits = m.forward(PROMPT, m.new_cache(len(PROMPT)), all_logits=True)
        self.steps = self.greedy(PROMPT, N_GEN)  # [(tokens fed, logits [1, V])]
        self.tokens = [t[0] for t, _ in self.steps[1:]]

    def greedy(self, prompt, n):
        m = self.model
        cache = m.new_cache(len(prompt) + n + 1)
        steps = [(list(prompt), m.forward(prompt, cache))]
        for _ in range(n - 1):  # the n-th token ends the generation: it is never fed
            tok = int(np.argmax(steps[-1][1][-1]))
            if tok == self.eos:
                break
            steps.append(([tok], m.forward([tok], cache)))
        return steps

    def routing(self, calls):
        """Replays forward calls [(tokens, all_logits)] -> [(layer, ids [rows, A])] in call order."""
        out = []
        m = self.model
        m.trace = lambda layer, ids: out.append((layer, np.array(ids)))
        try:
            cache = m.new_cache(sum(len(t) for t, _ in calls) + 1)
            for tokens, all_logits in calls:
                m.forward(tokens, cache, all_logits=all_logits)
        finally:
            m.trace = None
        return out


@pytest.fixture(scope="module")
def refs(tmp_path_factory):
    d = tmp_path_factory.mktemp("stream-fx")
    out = {case: Ref(fixture_path(*case, d)) for case in CASES}
    yield out
    for r in out.values():
        r.gguf.close()


def limits(ref: Ref) -> dict[str, float]:
    total = sum(ref.expert_bytes[il] * 8 for il in ref.moe_layers)  # the fixtures have 8 experts
    two_slots = 2.5 * max(ref.expert_bytes.values()) * len(ref.moe_layers)
    return {"none": 0.0, "generous": 2 * total / 2**20, "two-slots": two_slots / 2**20, "tiny": 0.001}


def load(path, **kw) -> Engine:
    kw = {"numerics": "ggml", "routing": "exact", "expert_pack": False, **kw}
    return Engine.load(path, **kw)


def record_forward(engine):
    """Wraps engine.model.forward: -> list of (tokens, all_logits, logits copy) per call."""
    calls = []
    inner = engine.model.forward

    def forward(tokens, cache, all_logits=False):
        out = inner(tokens, cache, all_logits=all_logits)
        calls.append(([int(t) for t in tokens], all_logits, np.array(out)))
        return out
    engine.model.forward = forward
    return calls


def generate(engine, prompt=PROMPT, n=N_GEN):
    """Greedy generation; -> (text, [(tokens, all_logits, logits)] of every forward call)."""
    calls = record_forward(engine)
    try:
        text = "".join(engine.generate(list(prompt), max_tokens=n, temperature=0, repeat_penalty=1.0))
    finally:
        del engine.model.forward
    return text, calls


def assert_matches_ref(ref: Ref, calls):
    assert [t for t, _, _ in calls] == [t for t, _ in ref.steps]
    for (_, _, got), (_, want) in zip(calls, ref.steps):
        assert got.dtype == want.dtype and np.array_equal(got, want)


def settled_stats(engine, timeout=10.0) -> dict:
    """Engine stats once every issued read has landed (predictions may still be loading)."""
    end = time.monotonic() + timeout
    while True:
        st = engine.stats()
        t = st["cache"]["total"]
        if t["loads"] >= t["misses"] + t["prefetch_issued"] or time.monotonic() > end:
            return st
        time.sleep(0.002)


def check_reads(ref: Ref, st: dict, mode: str):
    cache = st["cache"]
    for il in ref.moe_layers:
        s = cache["layers"][il]
        nb = ref.expert_bytes[il]
        assert s["duplicate_reads"] == 0
        assert s["loads"] == s["misses"] + s["prefetch_issued"]
        assert s["bytes_read"] == s["loads"] * nb
        assert s["hits"] + s["misses"] == s["requests"]
        if mode == "exact":
            assert s["prefetch_issued"] == 0
            assert s["loads"] == s["misses"] and s["bytes_read"] == s["misses"] * nb
    tot = cache["total"]
    for k in ("requests", "hits", "misses", "loads", "bytes_read", "evictions", "prefetch_issued"):
        assert tot[k] == sum(cache["layers"][il][k] for il in ref.moe_layers)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("limit", ["none", "generous", "two-slots", "tiny"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(c))
def test_identical_to_mapped_reference(refs, case, limit, mode):
    ref = refs[case]
    with load(ref.path, expert_cache_limit_mb=limits(ref)[limit], routing=mode) as engine:
        st = engine.stats()
        caps = {il: st["cache"]["layers"][il]["capacity"] for il in ref.moe_layers}
        want_cap = {"none": 8, "generous": 8, "two-slots": 2, "tiny": 0}[limit]
        assert set(caps.values()) == {want_cap}
        logits = engine.forward(PROMPT)
        assert logits.dtype == ref.all_logits.dtype and np.array_equal(logits, ref.all_logits)
        for _ in range(2):  # a second request runs on a warm (or churned) cache
            _, calls = generate(engine)
            assert_matches_ref(ref, calls)
        st = settled_stats(engine)
        check_reads(ref, st, mode)
        json.loads(json.dumps(st))
        assert st["routing"]["mode"] == mode
        assert set(st["cache"]["layers"]) == set(ref.moe_layers) and "total" in st["cache"]
        t = st["cache"]["total"]
        if limit in ("none", "generous"):  # everything fits: each expert is read once, ever
            assert t["misses"] + t["prefetch_issued"] == t["loads"]
            assert t["loads"] == sum(s["cached"] for s in st["cache"]["layers"].values())
            assert t["evictions"] == 0
        else:
            assert all(s["cached"] <= want_cap for s in st["cache"]["layers"].values())
            assert t["evictions"] > 0
        rec = st["routing"]["recall"]
        for r in rec.values():
            assert all(0.0 <= v <= 1.0 for v in r["per_layer"].values())
        engine.reset_stats()
        assert engine.stats()["cache"]["total"]["requests"] == 0


def test_stats_of_a_fresh_engine_serialise(refs):
    ref = refs[("qwen3moe", "Q8_0")]
    with load(ref.path, expert_cache_limit_mb=1.0) as engine:
        st = engine.stats()
        back = json.loads(json.dumps(st))
        assert back["cache"]["total"]["requests"] == 0 and back["cache"]["source"] == "gguf"
        assert back["cache"]["limit_mb"] == pytest.approx(1.0)
        assert set(back["cache"]["layers"]) == {str(il) for il in ref.moe_layers}


@pytest.mark.parametrize("policy", ["lfu-decay", "lfru"])
def test_the_eviction_policy_changes_no_token(refs, policy):
    """EXPERT_CACHE_POLICY reaches the host cache and, like the limit, only moves which experts are
    read: the tokens and logits stay the mapped reference's."""
    ref = refs[("qwen3moe", "Q8_0")]
    with load(ref.path, expert_cache_limit_mb=limits(ref)["two-slots"], routing="speculative",
              expert_cache_policy=policy) as engine:
        assert np.array_equal(engine.forward(PROMPT), ref.all_logits)
        _, calls = generate(engine)
        assert_matches_ref(ref, calls)
        st = settled_stats(engine)
        assert st["cache"]["policy"] == policy and st["cache"]["total"]["evictions"] > 0
        check_reads(ref, st, "speculative")


@pytest.mark.parametrize("limit,mode", [("tiny", "exact"), ("none", "all"), ("two-slots", "speculative")])
def test_truncated_model_fails_the_request_then_recovers(refs, tmp_path, limit, mode):
    ref = refs[("qwen3moe", "Q8_0")]
    path = tmp_path / "m.gguf"
    shutil.copyfile(ref.path, path)
    original = path.read_bytes()
    last = ref.moe_layers[-1]
    # the last layer's experts are the end of this file: nothing the model maps lies past the cut
    cut = ref.gguf.tensor_info(f"blk.{last}.ffn_gate_exps.weight").offset
    assert all(ti.offset < cut for ti in ref.gguf.tensors.values() if "_exps." not in ti.name)
    with load(path, expert_cache_limit_mb=limits(ref)[limit], routing=mode) as engine:
        with open(path, "r+b") as f:
            f.truncate(cut)
        with pytest.raises(ModelFileChanged) as ei:
            generate(engine)
        msg = str(ei.value)
        assert str(path) in msg and "truncated" in msg
        with open(path, "r+b") as f:  # the same file (inode) again, as it was: a new load serves it
            f.write(original)
    with load(path, expert_cache_limit_mb=limits(ref)[limit], routing=mode) as engine:
        _, calls = generate(engine)
        assert_matches_ref(ref, calls)
        assert np.array_equal(engine.forward(PROMPT), ref.all_logits)
        assert engine.stats()["cache"]["total"]["duplicate_reads"] == 0


@pytest.mark.parametrize("case,min_saving", [(("qwen3moe", "Q8_0"), 0.10), (("gpt-oss", "MXFP4"), 0.0)],
                         ids=["qwen3moe-default", "gpt-oss-zstd"])
def test_pack_is_used_and_a_stale_one_ignored(refs, tmp_path, caplog, case, min_saving):
    ref = refs[case]
    path = tmp_path / "m.gguf"
    shutil.copyfile(ref.path, path)
    write_pack(path, min_saving=min_saving)
    assert (tmp_path / "m.gguf.moepack").exists()
    for limit in ("two-slots", "none"):
        with load(path, expert_cache_limit_mb=limits(ref)[limit], routing="all", expert_pack=True) as engine:
            st = engine.stats()
            assert st["cache"]["source"] == "pack" and st["cache"]["path"].endswith(".moepack")
            assert np.array_equal(engine.forward(PROMPT), ref.all_logits)
            _, calls = generate(engine)
            assert_matches_ref(ref, calls)
            st = settled_stats(engine)
            assert st["cache"]["total"]["duplicate_reads"] == 0 and st["cache"]["total"]["loads"] > 0
    with load(path, expert_pack=False) as engine:  # the setting turns it off
        assert engine.stats()["cache"]["source"] == "gguf"
    # a change to the model's header (its name) makes the pack stale
    data = bytearray(path.read_bytes())
    i = data.index(b"moed-fixture-")
    assert i < ref.gguf.data_offset
    data[i] = ord("M")
    path.write_bytes(bytes(data))
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="moed.pack"), \
            load(path, expert_cache_limit_mb=limits(ref)["two-slots"], routing="all", expert_pack=True) as engine:
        assert engine.stats()["cache"]["source"] == "gguf"
        _, calls = generate(engine)
        assert_matches_ref(ref, calls)
    warnings = [r for r in caplog.records if r.name == "moed.pack" and r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "stale" in warnings[0].getMessage()


@pytest.mark.parametrize("via", ["setting", "env"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(c))
def test_trace_output_counts_the_routing(refs, tmp_path, monkeypatch, case, via):
    ref = refs[case]
    out = tmp_path / "usage.json"
    kw = {"expert_trace_output": str(out)} if via == "setting" else {}
    if via == "env":
        monkeypatch.setenv("MOE_EXPERT_TRACE_OUTPUT", str(out))
    with load(ref.path, expert_cache_limit_mb=limits(ref)["two-slots"], routing="all", **kw) as engine:
        _, calls = generate(engine)
        _, calls2 = generate(engine, prompt=[7, 8, 9], n=3)
        data = json.loads(out.read_text())  # written after each generation
    routed = ref.routing([(t, a) for t, a, _ in calls]) + ref.routing([(t, a) for t, a, _ in calls2])
    decisions = sum(ids.size for _, ids in routed)
    assert data["activations"] == decisions
    assert sum(sum(v) for v in data["per_expert"].values()) == decisions
    for il in ref.moe_layers:
        ids = [ids for layer, ids in routed if layer == il]
        want = np.bincount(np.concatenate([i.ravel() for i in ids]), minlength=8)
        assert data["per_expert"][str(il)] == want.tolist()
        assert data["per_layer"][str(il)] == int(want.sum())
        assert data["per_layer_tokens"][str(il)] == sum(i.shape[0] for i in ids)
    assert data["total_tokens"] == sum(len(t) for t, _, _ in calls + calls2)
    assert data["forward_passes"] == len(calls) + len(calls2)


def test_routing_verbose_logs_every_token(refs, caplog):
    ref = refs[("gpt-oss", "MXFP4")]
    with caplog.at_level(logging.INFO, logger="moed.routing"), \
            load(ref.path, expert_cache_limit_mb=limits(ref)["two-slots"], routing="all",
                 routing_verbose=True) as engine:
        _, calls = generate(engine)
    routed = ref.routing([(t, a) for t, a, _ in calls])
    want = []
    k = 0
    for tokens, _, _ in calls:
        for _ in ref.moe_layers:
            layer, ids = routed[k]
            k += 1
            rows = ids.shape[0]  # the last layer runs on the output row only
            for r in range(rows):
                tok = tokens[len(tokens) - rows + r]
                want.append(f"layer {layer} token {tok}: experts {' '.join(map(str, ids[r].tolist()))}")
    msgs = [r.getMessage() for r in caplog.records if r.name == "moed.routing"]
    token_lines = [m for m in msgs if re.match(r"layer \d+ token ", m)]
    assert token_lines == want
    stat_lines = [m for m in msgs if re.match(r"layer \d+: hits ", m)]
    assert [int(m.split()[1].rstrip(":")) for m in stat_lines] == ref.moe_layers
    assert all("recall_path_a=" in m and "recall_speculative=" in m for m in stat_lines)


def test_routing_quiet_by_default(refs, caplog):
    ref = refs[("gpt-oss", "MXFP4")]
    with caplog.at_level(logging.INFO, logger="moed.routing"), load(ref.path, routing="all") as engine:
        generate(engine, n=2)
    assert not [r for r in caplog.records if r.name == "moed.routing"]


@pytest.mark.parametrize("wtype", ["Q4_K", "Q8_0"])  # K-quants group pairs per (expert, sequence)
def test_waves_when_a_step_needs_more_experts_than_slots(tmp_path, wtype):
    """A prompt whose rows route to more experts than a layer has slots runs them in waves of
    at most that many (no overflow buffers), with the logits of the whole file in memory, bit for
    bit, for one prompt and for two prompts prefilled together."""
    path = fixture_path("qwen3moe", wtype, tmp_path)
    with GGUFFile(path) as g:
        ref = Transformer(g)
        prompts = [[5, 17, 200, 3, 96, 411, 7, 60], [9, 300, 41, 2, 77]]
        want_one = ref.forward(prompts[0], ref.new_cache(16), all_logits=True)
        want_many = ref.forward_many(prompts, [ref.new_cache(16) for _ in prompts])
        n_layers = sum(1 for n in g.tensors if n.endswith("ffn_gate_exps.weight"))
        bytes_per_expert = max(sum(g.tensor_info(f"blk.{il}.ffn_{p}_exps.weight").nbytes // 8
                                   for p in ("gate", "up", "down"))
                               for il in range(n_layers))
    limit = 2.5 * bytes_per_expert * n_layers / 2**20  # two slots per layer
    with load(path, expert_cache_limit_mb=limit) as engine:
        cache = engine.model.experts
        fetched = []
        inner = cache.fetch
        cache.fetch = lambda layer, ids, **kw: (fetched.append(len(ids)), inner(layer, ids, **kw))[1]
        got_one = engine.model.forward(prompts[0], engine.model.new_cache(16), all_logits=True)
        got_many = engine.model.forward_many(prompts, [engine.model.new_cache(16) for _ in prompts])
        st = engine.stats()["cache"]
    assert {s["capacity"] for s in st["layers"].values()} == {2}
    assert max(fetched) <= 2 and len(fetched) > 2 * n_layers  # waves of at most two experts ran
    assert np.array_equal(got_one, want_one) and np.array_equal(got_many, want_many)
