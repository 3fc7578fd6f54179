"""The whole model on the CUDA backend against the CPU backend, on tiny fixture models: logits
within tolerance, greedy tokens equal (except at near-ties), a sequence's results the same bits
whatever shares its step, and a CUDA error failing one request only.

Tolerances (relative L2 error of a logits row against the CPU's default "ggml" numerics): the
issue's 1e-2 for float weights and 5e-2 for quantized ones. The two backends round differently:
the GPU quantizes activations to q8_1 blocks (llama.cpp's CUDA backend) where the CPU uses q8_0
or q8_K, sums in another order, keeps q in float32 where the CPU rounds it to f16; float weights
keep float32 activations on the GPU and f16/bf16-rounded ones on the CPU. Measured here: ~7e-3
for Q8_0, ~1e-3 for F16.

Under numba's simulator (CI) every device thread runs in Python, about a millisecond each, so
only one small case runs there (about a minute); the GPU machine runs every case.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import numpy as np
import pytest

from daemon.backend import CPUBackend
from daemon.errors import DeviceError
from daemon.model.transformer import Transformer
from daemon.storage.gguf import GGUFFile
from tests.fixtures.build import fixture_path

from .conftest import CUDA_SKIP_REASON

pytestmark = pytest.mark.skipif(CUDA_SKIP_REASON is not None, reason=str(CUDA_SKIP_REASON))

SMALL = dict(n_embd=64, n_head=4, n_head_kv=2, head_dim=16, n_ff=64, n_ff_exp=64, n_ff_shexp=64, n_expert=4,
             n_expert_used=2)
KQUANT = dict(SMALL, n_embd=256, head_dim=64, n_ff=256, n_ff_exp=256, n_ff_shexp=256)  # K-quants: rows of 256
FLOAT_TOL, QUANT_TOL = 1e-2, 5e-2

GPU_CASES = [  # (fixture arch, weight type, overrides): every family, every weight type once at least
    ("qwen3moe", "F16", SMALL), ("qwen3moe", "Q8_0", SMALL), ("qwen3moe", "Q5_K", KQUANT),
    ("llama", "Q4_K", dict(KQUANT, n_expert=0, n_expert_used=0, n_head_kv=4)), ("llama", "F32", dict(SMALL, n_expert=0, n_expert_used=0, n_head_kv=4)),
    ("llama-moe", "Q6_K", KQUANT), ("llama-moe", "Q4_1", dict(SMALL, tie_embeddings=True)),
    ("qwen2moe", "Q8_0", SMALL), ("olmoe", "Q4_0", dict(SMALL, n_head_kv=4)),
    ("gpt-oss", "MXFP4", dict(SMALL, head_dim=8, n_head=8)), ("gpt-oss", "Q8_0", dict(SMALL, head_dim=8, n_head=8)),
]
SIM_CASES = [("qwen3moe", "Q8_0", dict(SMALL, n_layer=1))]


def _simulated() -> bool:
    if CUDA_SKIP_REASON is not None:
        return False
    from daemon.kernels.cuda.device import SIM

    return SIM


CASES = SIM_CASES if _simulated() else GPU_CASES
IDS = [f"{a}-{w}" for a, w, _ in CASES]


@pytest.fixture(scope="module", params=CASES, ids=IDS)
def models(request, fixture_dir):
    """(cpu model, cuda model, tolerance) of one fixture."""
    from daemon.backend.cuda import CUDABackend

    arch, wtype, overrides = request.param
    gguf = GGUFFile(fixture_path(arch, wtype, fixture_dir, **overrides))
    cuda_backend = CUDABackend(0)
    gpu = Transformer(gguf, experts=cuda_backend.resident_experts(gguf), backend=cuda_backend)
    cpu = Transformer(gguf, backend=CPUBackend("ggml"))
    yield cpu, gpu, FLOAT_TOL if wtype in ("F32", "F16", "BF16") else QUANT_TOL
    gguf.close()


def _rel(got, want) -> np.ndarray:
    return np.linalg.norm(got - want, axis=-1) / np.linalg.norm(want, axis=-1)


def _same_pick(gpu_row, cpu_row, tol) -> bool:
    """The GPU's greedy token is the CPU's, or the CPU ranks them within the tolerance (a near-tie)."""
    a, b = int(np.argmax(cpu_row)), int(np.argmax(gpu_row))
    return a == b or cpu_row[a] - cpu_row[b] <= tol * np.abs(cpu_row).max()


@dataclass
class Run:
    """One scenario per fixture, shared by the tests below (each pass costs seconds under the
    simulator): a batched prefill of the prompts and decode steps teacher-forced with the CPU's
    greedy tokens, on both backends; a request that hits a CUDA error; then the sequences in
    `alone` run again by themselves on the GPU."""
    tol: float
    cpu_steps: list = field(default_factory=list)  # logits [S, V] per step
    gpu_steps: list = field(default_factory=list)
    error: tuple | None = None  # (type, message) of the failed request's exception
    slot_freed: bool = False
    alone: dict = field(default_factory=dict)  # sequence -> its logits per step, run alone
    flipped: dict = field(default_factory=dict)  # step -> sequences routed differently by then


def _record_routes(backend, calls: list) -> None:
    """Each router call of `backend` appends (logits [R, E], ids [R, A]) on the host to calls."""
    route = backend.route

    def recording(*a, **k):
        logits, ids, weights = route(*a, **k)
        calls.append((np.array(backend.to_host(logits)), np.array(backend.to_host(ids))))
        return logits, ids, weights

    backend.route = recording
    if isinstance(backend, CPUBackend):  # its compiled decode step routes inside one call: the per-op path
        backend.compiled_step = "off"  # (bit-identical, tests/backend/test_cpu_step.py) exposes each router call


def _flips(cpu_calls, gpu_calls, offsets, tol) -> set[int]:
    """Sequences some of whose rows the two backends sent to different experts in these router
    calls; each such difference must be a near-tie: the CPU's margin between its last pick and the
    GPU's other pick no larger than the two backends' logits differ on that row (twice the largest
    difference: the two experts' logits may move apart), else the GPU's routing is wrong. tol: the
    same margin relative to the row's largest logit also counts as a tie."""
    out = set()
    S = len(offsets) - 1
    for (logits, ci), (other, gi) in zip(cpu_calls, gpu_calls, strict=True):
        rows = ci.shape[0]
        for r in range(rows):
            a, b = set(ci[r].tolist()), set(gi[r].tolist())
            if a == b:
                continue
            margin = min(logits[r, e] for e in a) - max(logits[r, e] for e in b - a)
            moved = 2 * np.abs(logits[r] - other[r]).max()
            assert margin <= max(moved, tol * np.abs(logits[r]).max()), (r, sorted(a), sorted(b), margin, moved)
            # rows of the step, or one row per sequence (the last layer's FFN of a prefill)
            out.add(int(np.searchsorted(offsets, r, side="right")) - 1 if rows != S else r)
    return out


@pytest.fixture(scope="module")
def run(models) -> Run:
    from numba.cuda.cudadrv.driver import CudaAPIError

    from daemon.backend import cuda as cuda_backend

    cpu, gpu, tol = models
    # a 17-row prompt takes the tiled matmul, the others the GEMV, in the same steps
    prompts, steps, alone = [np.arange(3, 20), np.array([7]), np.array([9, 1, 4])], 3, (0, 1, 2)
    if _simulated():  # two short prompts, one decode step, the second sequence alone
        prompts, steps, alone = [np.array([1, 5, 9]), np.array([4, 2])], 2, (1,)
    out = Run(tol)
    graphs, gpu.backend.use_graphs = gpu.backend.use_graphs, False  # the routes are read back each step
    cpu_calls, gpu_calls = [], []
    _record_routes(cpu.backend, cpu_calls)
    _record_routes(gpu.backend, gpu_calls)
    flipped: set[int] = set()

    def step(run_cpu, run_gpu, offsets):
        cpu_calls.clear()
        gpu_calls.clear()
        out.cpu_steps.append(run_cpu())
        out.gpu_steps.append(run_gpu())
        flipped.update(_flips(cpu_calls, gpu_calls, offsets, tol))
        out.flipped[len(out.cpu_steps) - 1] = set(flipped)

    cc, gc = [cpu.new_cache(32) for _ in prompts], [gpu.new_cache(32) for _ in prompts]
    step(lambda: cpu.forward_many(prompts, cc), lambda: gpu.forward_many(prompts, gc),
         np.cumsum([0] + [len(p) for p in prompts]))
    tokens = []
    for _ in range(steps - 1):
        tokens.append(out.cpu_steps[-1].argmax(axis=1))
        step(lambda: cpu.forward_batch(tokens[-1], cc), lambda: gpu.forward_batch(tokens[-1], gc),
             np.arange(len(prompts) + 1))
    del cpu.backend.route, gpu.backend.route  # the backends' own methods again
    gpu.backend.use_graphs = graphs  # (graphs: test_cuda_graphs)

    def boom(*args, **kw):
        raise CudaAPIError(700, "an illegal memory access was encountered")

    with pytest.MonkeyPatch.context() as m:  # a request that fails on the device
        m.setattr(cuda_backend.embed_k, "embed", boom)
        cache = gpu.new_cache(8)
        pool, free = cache.pool, len(cache.pool._free)
        try:
            gpu.forward([3], cache)
        except BaseException as e:  # noqa: BLE001  (the test checks what it is)
            out.error = (type(e), str(e))  # not e: its frames would keep the sequence alive
        del cache
        out.slot_freed = len(pool._free) == free + 1

    for s in alone:  # the model goes on: the same sequences, each by itself
        c = gpu.new_cache(32)
        out.alone[s] = [gpu.forward(prompts[s], c)[-1]]
        for t in tokens:
            out.alone[s].append(gpu.forward([int(t[s])], c)[-1])
    return out


def test_logits_and_greedy_tokens_match_the_cpu(run):
    """A batched prefill and decode steps: every row within tolerance of the CPU's, the same
    greedy token (or a near-tie). A sequence that a router sent to other experts on the GPU (at a
    near-tie of the CPU's router logits, checked in `run`) computes other experts from there on:
    its rows are exempt; these tiny random routers choose among 4 experts, so ties happen."""
    for step, (got, want) in enumerate(zip(run.gpu_steps, run.cpu_steps)):
        assert got.shape == want.shape and got.dtype == np.float32
        kept = [s for s in range(got.shape[0]) if s not in run.flipped[step]]
        assert kept, "every sequence was routed differently"
        assert np.all(_rel(got[kept], want[kept]) < run.tol), (step, kept, _rel(got, want))
        assert all(_same_pick(got[s], want[s], run.tol) for s in kept), step


def test_a_sequence_gets_the_same_bits_whatever_shares_its_step(run):
    """Each sequence run alone gives, bit for bit, its rows of the batched prefill (prompts of
    different lengths: different kernels in one step) and of the decode steps."""
    assert run.alone
    for s, rows in run.alone.items():
        for step, row in enumerate(rows):
            assert np.array_equal(row, run.gpu_steps[step][s]), (s, step)


def test_a_cuda_error_fails_the_request_and_the_model_goes_on(run):
    """A CUDA error in a launch is a DeviceError (a ModelError: the daemon fails that request,
    saying what the device holds); its sequence's KV slot is freed; the next requests run (the
    sequences run alone after it)."""
    kind, message = run.error
    assert issubclass(kind, DeviceError), run.error
    assert re.search(r"cuda:0: embed failed: .*illegal memory access.*VRAM held: weights", message)
    assert run.slot_freed
    assert run.alone and all(np.all(np.isfinite(r)) for rows in run.alone.values() for r in rows)


SMOLLM2_PROMPTS = ["The capital of France is", "def fibonacci(n):\n    ",
                   "Once upon a time, in a small village by the sea,"]


# A real model's logits on the two backends: SmolLM2 Q4_1 measured 4.2% apart after the prompt
# and 5.5% at the next token on the H100, where the CPU itself is 3.3% from float32 numerics; the
# issue's criterion for real models is the greedy text. The bound catches a broken kernel (28%
# before q8_1's s was fixed).
REAL_MODEL_TOL = 0.15


def _gpu_model(gguf):
    from daemon.backend.cuda import CUDABackend

    backend = CUDABackend(0)
    return Transformer(gguf, experts=backend.resident_experts(gguf), backend=backend)


def greedy_text_matches(path, other=_gpu_model) -> int:
    """32 greedy tokens per prompt from other(gguf) and from the CPU backend: equal, or the first
    difference is a near-tie, of the CPU's logits or of a router's (a sequence the two send to
    different experts, checked by _flips, computes other experts from there on: the comparison
    ends there). -> how many prompts ended at a routing near-tie."""
    from daemon.text.tokenizer import Tokenizer

    ended_at_routing = 0
    with GGUFFile(path) as gguf:
        tok = Tokenizer.from_metadata(gguf.metadata)
        model = other(gguf)
        cpu = Transformer(gguf, backend=CPUBackend("ggml"))
        routed = bool(cpu.moe_layers)
        if routed:  # routes are read back each step: no graphs
            cpu_calls, gpu_calls = [], []
            _record_routes(cpu.backend, cpu_calls)
            _record_routes(model.backend, gpu_calls)
            model.backend.use_graphs = False
        for prompt in SMOLLM2_PROMPTS:
            ids = tok.encode(prompt, add_special=True, parse_special=True)
            gc, cc = model.new_cache(len(ids) + 33), cpu.new_cache(len(ids) + 33)
            step_rows, offsets = ids, np.array([0, len(ids)])
            for i in range(33):
                if routed:
                    cpu_calls.clear()
                    gpu_calls.clear()
                g, c = model.forward(step_rows, gc)[-1], cpu.forward(step_rows, cc)[-1]
                if routed and _flips(cpu_calls, gpu_calls, offsets, QUANT_TOL):
                    ended_at_routing += 1
                    break  # a routing near-tie: the continuations may part from here
                assert _rel(g, c) < REAL_MODEL_TOL, (prompt, i, _rel(g, c))
                if int(g.argmax()) != int(c.argmax()):
                    assert _same_pick(g, c, QUANT_TOL), (prompt, i)
                    break  # a near-tie: the continuations may part from here
                step_rows, offsets = [int(c.argmax())], np.array([0, 1])
        if routed:
            del cpu.backend.route, model.backend.route
        else:
            graphs = getattr(model.backend, "graphs", None)
            assert graphs is None or graphs.replays > 0 or not model.backend.use_graphs  # decode ran as graphs
    return ended_at_routing


@pytest.mark.skipif(_simulated(), reason="a 135M model: GPU only (the simulator would take hours)")
def test_smollm2_greedy_text_matches_the_cpu(smollm2):
    """The real SmolLM2-135M-Instruct (Q4_1, dense llama)."""
    greedy_text_matches(smollm2)


@pytest.mark.skipif(_simulated(), reason="a 135M model: GPU only (the simulator would take hours)")
def test_demo_moe_greedy_text_matches_the_cpu():
    """The demo MoE (SmolLM2 made into 16 experts, 12 used), when it has been built
    (`moed demo-model`; tests never build it: it takes minutes). Its routers are scaled so that
    the 12 chosen experts weigh about 1/12 each: the 12th and 13th are near-ties at most tokens, and
    the CPU's own float32 numerics already part from its ggml ones there (17.6% apart after the
    first prompt); on the H100 the GPU's routes first differ at layer 1 of the first prompt, at such
    a tie."""
    from daemon.demo import cache_dir

    path = cache_dir() / "smollm2-135m-moe-e16k12.gguf"
    if not path.exists():
        pytest.skip(f"no demo model at {path} (build it with `moed demo-model`)")
    greedy_text_matches(path)
