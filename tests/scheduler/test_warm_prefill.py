"""models.warm_prefill: the load's prefill warm-up on a GPU (long prompts, two sequences), none on the CPU."""

from types import SimpleNamespace

import pytest

from daemon.scheduler.models import load_engine, warm_prefill


class FakeModel:
    def __init__(self, backend: str, n_vocab: int):
        self.backend = SimpleNamespace(name=backend)
        self.hp = SimpleNamespace(n_vocab=n_vocab)
        self.calls = []

    def new_cache(self, n_ctx):
        return SimpleNamespace(n_ctx=n_ctx)

    def forward_many(self, prompts, caches):
        assert len(prompts) == len(caches) and all(c.n_ctx >= len(p) for p, c in zip(prompts, caches))
        self.calls.append([list(p) for p in prompts])


class FakeEngine:
    def __init__(self, backend="cuda:0", n_vocab=50, n_ctx=4096):
        self.model = FakeModel(backend, n_vocab)
        self.n_ctx = n_ctx
        self.forwards = []

    def tokenize(self, text, add_special):
        return [1]

    def forward(self, ids):
        self.forwards.append(ids)

    def reset_stats(self):
        pass


def test_on_a_gpu_a_long_prompt_alone_then_two():
    e = FakeEngine(n_vocab=50)
    warm_prefill(e)
    assert [[len(p) for p in call] for call in e.model.calls] == [[64], [64, 21]]
    assert all(0 <= t < 50 for call in e.model.calls for p in call for t in p)
    assert max(len(p) for call in e.model.calls for p in call) > 16  # past mmvq.MAX_COLS: the tiled path


@pytest.mark.parametrize("backend", ["cpu", ""])
def test_not_on_the_cpu(backend):
    e = FakeEngine(backend)
    warm_prefill(e)
    assert e.model.calls == []
    warm_prefill(SimpleNamespace())  # an engine without a model (a test's fake) is left alone


def test_capped_by_the_context_and_run_by_load_engine():
    e = FakeEngine(n_ctx=20)
    load_engine(lambda path, progress: e, "m.gguf", {}, lambda *r: None)
    assert e.forwards == [[1]] and [[len(p) for p in call] for call in e.model.calls] == [[20], [20, 6]]
    e = FakeEngine()
    load_engine(lambda path, progress: e, "m.gguf", {}, lambda *r: None, warm=False)
    assert e.model.calls == []
