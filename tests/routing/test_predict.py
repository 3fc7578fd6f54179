"""Expert prediction: RouterBank against a numpy router computed here from the file, Recall
arithmetic, and the Prefetcher's paths per routing mode (what it prefetches, when, and how its
recall is scored)."""

from __future__ import annotations

import time

import gguf
import numpy as np
import pytest

from daemon.model.transformer import Transformer
from daemon.routing.predict import MODES, Prefetcher, Recall, RouterBank
from daemon.storage.cache import ExpertCache
from daemon.storage.gguf import GGUFFile
from daemon.storage.store import ExpertStore, expert_layouts
from tests.fixtures.build import fixture_path

CASES = [("qwen3moe", "Q8_0"), ("gpt-oss", "MXFP4"), ("olmoe", "Q4_0")]
TOKENS = [5, 17, 17, 200, 3, 96, 411]


def _deq(g: GGUFFile, name: str) -> np.ndarray:
    ti = g.tensor_info(name)
    rows = int(np.prod(ti.ne[1:])) if len(ti.ne) > 1 else 1
    return dequantize_rows(np.array(g.tensor_data(name)).reshape(rows, -1), ti.ggml_type)


def dequantize_rows(raw: np.ndarray, ggml_type: int) -> np.ndarray:
    return gguf.quants.dequantize(raw, gguf.GGMLQuantizationType(ggml_type)).astype(np.float64)


class RefRouter:
    """The routers of a file in float64, straight from gguf-py: logits = W @ (rms(x) * g) + b."""

    def __init__(self, path):
        with GGUFFile(path) as g:
            arch = g.architecture
            self.eps = float(g.get(f"{arch}.attention.layer_norm_rms_epsilon"))
            self.n_used = int(g.get(f"{arch}.expert_used_count"))
            self.layers, self.w, self.g, self.b = [], {}, {}, {}
            il = 0
            while f"blk.{il}.attn_norm.weight" in g.tensors:
                p = f"blk.{il}."
                if p + "ffn_gate_inp.weight" in g.tensors:
                    self.layers.append(il)
                    self.w[il] = _deq(g, p + "ffn_gate_inp.weight")  # [E, D]
                    norm = p + "ffn_norm.weight" if p + "ffn_norm.weight" in g.tensors else p + "post_attention_norm.weight"
                    self.g[il] = _deq(g, norm).reshape(-1)
                    self.b[il] = (_deq(g, p + "ffn_gate_inp.bias").reshape(-1) if p + "ffn_gate_inp.bias" in g.tensors
                                  else np.zeros(self.w[il].shape[0]))
                il += 1
            ti = g.tensor_info("token_embd.weight")
            self.embd = dequantize_rows(np.array(g.tensor_data("token_embd.weight")).reshape(ti.ne[1], -1),
                                        ti.ggml_type)

    def logits(self, layer: int, x: np.ndarray) -> np.ndarray:
        x = np.asarray(x, np.float64)
        xn = x / np.sqrt((x * x).mean(axis=1, keepdims=True) + self.eps)
        return (xn * self.g[layer]) @ self.w[layer].T + self.b[layer]

    def top(self, layer: int, x: np.ndarray) -> list[set[int]]:
        lg = self.logits(layer, x)
        order = np.argsort(-lg, axis=1)
        # the fixtures' routers are random: no near-ties at the top-k boundary to blur the sets
        gap = np.take_along_axis(lg, order[:, self.n_used - 1:self.n_used + 1], axis=1)
        assert np.all(gap[:, 0] - gap[:, 1] > 1e-4)
        return [set(r.tolist()) for r in order[:, :self.n_used]]

    def union(self, layer: int, x: np.ndarray) -> list[int]:
        return sorted(set().union(*self.top(layer, x)))


@pytest.fixture(scope="module")
def fx(tmp_path_factory):
    d = tmp_path_factory.mktemp("predict-fx")
    out = {}
    for case in CASES:
        path = fixture_path(*case, d)
        out[case] = (path, Transformer(GGUFFile(path)), RefRouter(path))
    return out


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(c))
def test_router_bank_matches_numpy(fx, case):
    _, model, ref = fx[case]
    bank = RouterBank(model)
    assert bank.layers == ref.layers and bank.n_used == ref.n_used
    rng = np.random.default_rng(0)
    D = model.hp.n_embd
    xs = [rng.normal(size=(16, D)).astype(np.float32) * 3,
          ref.embd[TOKENS].astype(np.float32)]
    for x in xs:
        allk = bank.top_k_all(x)
        assert allk.shape == (len(x), len(ref.layers), ref.n_used)
        for i, il in enumerate(ref.layers):
            want = ref.top(il, x)
            got = bank.top_k(il, x)
            assert got.shape == (len(x), ref.n_used)
            assert [set(r.tolist()) for r in got] == want
            assert [set(r.tolist()) for r in allk[:, i]] == want


def test_recall_arithmetic():
    r = Recall()
    assert r.as_dict() == {"per_layer": {}, "overall": 0.0, "predicted": 0, "exact": 0}
    r.add(0, {1, 2, 3}, {2, 3, 4, 5})
    r.add(0, {1}, {1})
    r.add(2, set(), {7})
    r.add(3, {4, 5}, set())
    d = r.as_dict()
    assert d["per_layer"] == {0: 0.6, 2: 0.0, 3: 0.0}
    assert d["overall"] == 0.5
    assert d["predicted"] == 3 + 1 + 0 + 2 and d["exact"] == 6
    r2 = Recall()
    r2.add(1, {0, 1, 2}, {0, 1, 2})
    assert r2.as_dict()["per_layer"] == {1: 1.0} and r2.as_dict()["overall"] == 1.0


class FakeCache:
    """Records prefetch calls, tagged with the hook that was running."""

    def __init__(self):
        self.events: list = []
        self.phase = None

    def prefetch(self, layer, ids):
        self.events.append(("prefetch", self.phase, layer, list(ids)))

    def prefetches(self):
        return [e[1:] for e in self.events if e[0] == "prefetch"]

    def holds_all(self, layer):  # never full: every prediction is made
        return False


class Tagger:
    """Stands between the model and the Prefetcher's step hooks to tag calls and keep the inputs."""

    def __init__(self, pf, cache):
        self.pf, self.cache, self.x = pf, cache, {}

    def begin(self, tokens):
        self.cache.phase = "begin"
        self.pf.begin(tokens)

    def layer_input(self, il, x):
        self.cache.phase = il
        self.x[il] = np.array(x)
        self.pf.layer_input(il, x)


def _run(model, mode, tokens):
    """One forward pass with a Prefetcher of `mode` over a FakeCache; -> (prefetcher, fake cache,
    tagger, exact routing {layer: ids})."""
    cache = FakeCache()
    routes = {}
    model.trace = lambda layer, ids: routes.__setitem__(layer, np.array(ids))
    pf = Prefetcher(model, cache, mode).attach(model)
    tag = Tagger(pf, cache)
    model.step_hooks = tag
    try:
        model.forward(tokens, model.new_cache(len(tokens)), all_logits=True)
    finally:
        pf.detach()
        model.trace = model.step_hooks = None  # the tagger too (mode "exact" hooks nothing to detach)
    return pf, cache, tag, routes


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("case", CASES[:2], ids=lambda c: "-".join(c))
def test_prefetcher_paths_per_mode(fx, case, mode):
    _, model, ref = fx[case]
    pf, cache, tag, routes = _run(model, mode, TOKENS)
    assert model.step_hooks is None and model.trace is None  # detached
    got = cache.prefetches()
    want = []
    if mode in ("approx", "all"):  # Path A: every MoE layer, before the pass, from the embeddings
        emb = ref.embd[TOKENS]
        want += [("begin", il, ref.union(il, emb)) for il in ref.layers]
    if mode in ("speculative", "all"):  # the next MoE layer's router on the current layer's input
        moe = ref.layers
        for il in range(model.hp.n_layer):
            later = [m for m in moe if m > il]
            if later:
                want.append((il, later[0], ref.union(later[0], tag.x[il])))
    assert sorted(got, key=repr) == sorted(want, key=repr)
    st = pf.stats()
    assert st["mode"] == mode
    paths = {"exact": set(), "approx": {"path_a"}, "speculative": {"speculative"},
             "all": {"path_a", "speculative"}}[mode]
    assert set(st["recall"]) == paths
    for path, rec in st["recall"].items():
        per = rec["per_layer"]
        assert per and all(0.0 <= v <= 1.0 for v in per.values())
        assert 0.0 <= rec["overall"] <= 1.0
        # recall = |predicted ∩ exact| / |exact|, with the predictions this path prefetched
        for il, v in per.items():
            exact = set(np.unique(routes[il]).tolist())
            pred = {"path_a": [ids for ph, layer, ids in got if ph == "begin" and layer == il],
                    "speculative": [ids for ph, layer, ids in got if ph != "begin" and layer == il]}[path]
            assert len(pred) == 1
            assert v == pytest.approx(len(set(pred[0]) & exact) / len(exact), abs=1e-6)


def test_recall_of_a_perfect_and_a_useless_predictor(fx):
    _, model, ref = fx[("qwen3moe", "Q8_0")]
    cache = FakeCache()
    pf = Prefetcher(model, cache, "approx").attach(model)
    try:
        tokens = np.array([17, 96])
        pf.begin(tokens)
        pred = {layer: ids for _, layer, ids in cache.prefetches()}
        assert set(pred) == set(ref.layers)
        for il in ref.layers:  # the router "chose" exactly what was predicted
            pf.on_route(il, np.array(pred[il]).reshape(1, -1))
        rec = pf.stats()["recall"]["path_a"]
        assert rec["per_layer"] == {il: 1.0 for il in ref.layers} and rec["overall"] == 1.0
        pf.reset_stats()
        cache.events.clear()
        pf.begin(tokens)
        pred = {layer: ids for _, layer, ids in cache.prefetches()}
        for il in ref.layers:  # ... and now nothing that was predicted
            other = [e for e in range(model.hp.n_expert) if e not in pred[il]][:2]
            pf.on_route(il, np.array([other]))
        rec = pf.stats()["recall"]["path_a"]
        assert rec["per_layer"] == {il: 0.0 for il in ref.layers} and rec["overall"] == 0.0
        # a layer routed without a pending prediction is not scored
        pf.on_route(ref.layers[0], np.array([[0, 1]]))
        assert pf.stats()["recall"]["path_a"]["exact"] == 2 * len(ref.layers)
    finally:
        pf.detach()


def test_chains_the_existing_trace_hook(fx):
    _, model, _ = fx[("qwen3moe", "Q8_0")]
    seen = []
    model.trace = lambda layer, ids: seen.append(layer)
    pf = Prefetcher(model, FakeCache(), "all").attach(model)
    try:
        model.forward([1, 2], model.new_cache(2))
    finally:
        pf.detach()
    assert callable(model.trace) and model.trace is not pf.on_route
    model.trace = None
    assert seen == [0, 1]


def test_unknown_mode(fx):
    _, model, _ = fx[("qwen3moe", "Q8_0")]
    with pytest.raises(ValueError, match="bogus"):
        Prefetcher(model, FakeCache(), "bogus")


@pytest.mark.parametrize("mode", list(MODES))
def test_real_cache_prefetch_counts(fx, mode):
    path, _, _ = fx[("qwen3moe", "Q8_0")]
    g = GGUFFile(path)
    store = ExpertStore.from_gguf(g, expert_layouts(g))
    with ExpertCache(store, 0.0) as cache:
        model = Transformer(g, experts=cache)
        pf = Prefetcher(model, cache, mode).attach(model)
        model.forward(TOKENS, model.new_cache(len(TOKENS)), all_logits=True)
        pf.detach()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:  # predictions never asked for may still be loading
            t = cache.stats()["total"]
            if t["loads"] >= t["misses"] + t["prefetch_issued"]:
                break
            time.sleep(0.002)
        if mode == "exact":
            assert t["prefetch_issued"] == 0 and t["prefetch_used"] == 0
        else:
            assert t["prefetch_issued"] > 0 and t["prefetch_used"] > 0
        assert t["duplicate_reads"] == 0
        assert t["loads"] == t["misses"] + t["prefetch_issued"] == t["unique_requested"] + \
            t["prefetch_issued"] - t["prefetch_used"]
    g.close()


def test_no_prediction_for_a_layer_that_holds_every_expert(fx):
    """With every expert of a layer cached there is nothing to load: the predictors skip it."""
    _, model, _ = fx[("qwen3moe", "Q8_0")]

    class FullCache(FakeCache):
        def holds_all(self, layer):
            return True

    cache = FullCache()
    pf = Prefetcher(model, cache, "all").attach(model)
    try:
        model.forward(np.array([3, 4]), model.new_cache(4))
    finally:
        pf.detach()
    assert cache.prefetches() == []
    assert all(r["exact"] == 0 for r in pf.stats()["recall"].values())


def test_exact_mode_hooks_nothing_and_each_pass_begins_once(fx, monkeypatch):
    """Mode "exact" predicts nothing: no step hook or trace is set (a GPU step may then run as graph
    segments); verbose logging still hooks. The model, not the prefetcher, starts each pass of its
    expert provider (the host cache's duplicate-read check)."""
    _, model, _ = fx[CASES[0]]
    pf = Prefetcher(model, FakeCache(), "exact").attach(model)
    assert model.step_hooks is None and model.trace is None
    pf.detach()
    pf = Prefetcher(model, FakeCache(), "exact", verbose=True).attach(model)
    assert model.step_hooks is pf and model.trace == pf.on_route
    pf.detach()
    assert model.step_hooks is None and model.trace is None
    passes = []
    monkeypatch.setattr(model.experts, "begin_pass", lambda rows=0: passes.append(1), raising=False)
    cache = model.new_cache(len(TOKENS) + 1)
    model.forward(TOKENS, cache)
    model.forward(TOKENS[:1], cache)
    assert len(passes) == 2


def test_auto_stops_predicting_once_the_cache_reads_nothing_new(fx):
    """until_quiet (MOE_ROUTING=auto without a limit): passes that start reads keep the prediction;
    QUIET_PASSES passes in a row starting at most one read each detach the hooks for good."""
    from daemon.routing.predict import QUIET_PASSES

    _, model, _ = fx[("qwen3moe", "Q8_0")]
    cache = FakeCache()
    cache.reads_started = 0
    pf = Prefetcher(model, cache, "speculative", until_quiet=True).attach(model)
    try:
        for _ in range(3 * QUIET_PASSES):  # a cold start: each pass reads experts
            cache.reads_started += 5
            model.forward([1, 2], model.new_cache(2))
        assert model.step_hooks is pf and pf.mode == "speculative"
        before = len(cache.prefetches())
        for i in range(QUIET_PASSES - 1):  # quiet, but one pass short (one read a pass is quiet)
            cache.reads_started += i % 2
            model.forward([1, 2], model.new_cache(2))
        assert model.step_hooks is pf and len(cache.prefetches()) > before
        cache.reads_started += 2  # a pass that read: the count starts again
        model.forward([1, 2], model.new_cache(2))
        for _ in range(QUIET_PASSES - 1):
            model.forward([1, 2], model.new_cache(2))
        assert model.step_hooks is pf
        model.forward([1, 2], model.new_cache(2))  # the QUIET_PASSES-th quiet pass: no prediction, detached
        after = len(cache.prefetches())
        assert model.step_hooks is None and model.trace is None and pf.mode == "exact"
        model.forward([1, 2], model.new_cache(2))
        assert len(cache.prefetches()) == after
    finally:
        pf.detach()


def test_auto_stops_predicting_as_soon_as_every_expert_is_cached(fx):
    """until_quiet: a pass that starts with every expert of every MoE layer in the cache makes no
    prediction and detaches the hooks, however many reads the passes before started."""
    _, model, _ = fx[("qwen3moe", "Q8_0")]
    cache = FakeCache()
    cache.reads_started = 0
    full = set()
    cache.holds_all = lambda layer: layer in full
    pf = Prefetcher(model, cache, "speculative", until_quiet=True).attach(model)
    try:
        cache.reads_started += 5
        model.forward([1, 2], model.new_cache(2))
        full.update(model.moe_layers[:-1])  # all but one layer full: still predicting
        cache.reads_started += 5
        model.forward([1, 2], model.new_cache(2))
        assert model.step_hooks is pf and pf.mode == "speculative"
        before = len(cache.prefetches())
        full.update(model.moe_layers)
        cache.reads_started += 5  # the pass before still read: not quiet, but nothing is left to load
        model.forward([1, 2], model.new_cache(2))
        assert model.step_hooks is None and model.trace is None and pf.mode == "exact"
        assert len(cache.prefetches()) == before
    finally:
        pf.detach()


def test_an_explicit_mode_predicts_however_quiet(fx):
    _, model, _ = fx[("qwen3moe", "Q8_0")]
    cache = FakeCache()
    cache.reads_started = 0
    pf = Prefetcher(model, cache, "speculative").attach(model)
    try:
        for _ in range(20):
            model.forward([1, 2], model.new_cache(2))
        assert model.step_hooks is pf and pf.mode == "speculative"
    finally:
        pf.detach()
