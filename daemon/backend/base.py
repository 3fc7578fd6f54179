"""The execution-backend seam: the operations model code runs, and nothing else.

Model code (daemon/model) says what to compute; a Backend says where and how: the CPU backend
(cpu.py) runs numba CPU kernels with llama.cpp's CPU numerics, a GPU backend would run device
kernels. As llama.cpp's graph code never names a device, model code never imports a kernel.

Arrays passed in and out are the backend's own (numpy arrays on the CPU, device arrays on a
GPU); `to_host` brings one back. Weights pass through `upload` once, at load. Every op that
depends on how rows group into sequences takes the step's `Step`, and computes each sequence's
rows as a step holding that sequence alone would (batch invariance).

Legend: T = rows of the step, S = sequences, D = hidden size, K = a linear's input length,
N = its output length, H = query heads, Hkv = key/value heads, Dh = key head size, Dv = value
head size, E = experts, A = experts used per row, P = T*A (row, expert) pairs, F = expert FFN size,
C = conv channels, Kc = conv kernel, Hk/Hv = delta-net key/value heads, Dk/Dv = their sizes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Protocol

import numpy as np

from .cache import SequenceCache
from .step import Step

if TYPE_CHECKING:  # the model package imports the backend
    from ..model.hparams import HParams, Rope
    from ..model.weights import QWeight

Array = Any  # a backend's array type (np.ndarray on the CPU)


class Backend(Protocol):
    name: str  # "cpu", "cuda:0", ...

    # -- weights and state ---------------------------------------------------------------------

    def upload(self, weight: QWeight | np.ndarray) -> Any:
        """A weight (quantized matrix or f32 vector) made resident where this backend computes."""
        ...

    def upload_group(self, weights: list[QWeight]) -> list[Any]:
        """Matrices that always read the same input (q, k and v), uploaded as `upload` would; a
        backend may store them as one matrix so that `linears` applies them in one launch."""
        ...

    def expert_provider(self, gguf, settings, say: Callable[[str], None], progress=None) -> tuple[Any, Any]:
        """The model's routed experts as this backend computes them -> (the expert provider the
        model is given, the object to close if loading fails after it: None or the provider).
        say(message): a load step; progress.part(fraction, note), where it has one, for bytes."""
        ...

    def new_cache(self, hp: HParams, n_ctx: int) -> SequenceCache:
        """An empty sequence: one layer cache per layer, for up to n_ctx positions."""
        ...

    def to_host(self, x: Array) -> np.ndarray:
        ...

    def run_step(self, step: Step, compute: Callable[[], Array], static: bool = False,
                 segmented: bool = False) -> Array:
        """compute() -> its output: the model's layers over `step`, run on this backend. static:
        compute needs nothing back on the host (no routing read, hooks or traces), so a backend
        may record the step once and replay it for steps of the same shape (the CUDA backend's
        graphs); the results are the same bits either way. segmented: compute needs the host
        only at its host points, reading only its routers' ids there: a backend may record it in
        segments with the host work between them."""
        ...

    def replay_routes(self, table: np.ndarray, step: Step) -> Array:
        """A routing replay's expert ids of every MoE layer at the step's rows: table[:, positions
        % N] ([L_moe, N, A] -> [L_moe, T, A]), computed from the step's positions where the step
        reads them (on a GPU: on the device, so a recorded step replays the trace too)."""
        return table[:, step.positions % table.shape[1]].astype(np.int64)

    def host_point(self, fn: Callable[[], None], sync: bool = True) -> None:
        """Host work at this point of the step: fn() now, or at this point of each replay of a
        recorded step (sync: once the work before it is done)."""
        fn()

    # -- dense ---------------------------------------------------------------------------------

    def embed(self, table: QWeight, tokens: np.ndarray, step: Step | None = None) -> Array:
        """Rows of the token embedding table: tokens [T] (the step's, when given) -> [T, D] f32."""
        ...

    def prepare(self, x: Array) -> Any:
        """Activations x [T, K] made ready for linear/expert_linear, converted once per weight
        encoding however many weights read them (q, k and v; gate and up)."""
        ...

    def linear(self, x: Any, w: QWeight, step: Step | None = None, bias: Array | None = None) -> Array:
        """x [T, K] (array or prepared) @ w.T (+ bias [N]) -> [T, N]. step: the rows' grouping
        (None: one sequence)."""
        ...

    def linears(self, x: Any, ws: list, step: Step | None = None, biases: list | None = None) -> list[Array]:
        """[linear(x, w, step, b) for each weight w and bias b] (weights of one upload_group), with
        the same bits as those calls; a backend may make them one launch."""
        ...

    # -- experts -------------------------------------------------------------------------------

    def expert_plan(self, ids: np.ndarray, slots: dict[int, int], layout: Any, step: Step | None,
                    only: np.ndarray | None = None) -> Any:
        """How the (row, expert) pairs of one MoE layer are computed: ids [T, A] expert ids in
        top-k order; slots[e]: expert e's index in the layer's weight stacks; layout: the
        experts' ExpertLayout. only: just the pairs of these experts (one wave of a
        layer whose experts do not fit the cache at once); `join_parts` puts the waves' outputs
        in the whole plan's order, for `moe_mix` with the whole plan."""
        ...

    def expert_linear(self, x: Any, stack: Array, ggml_type: int, k: int, plan: Any, bias: Array | None = None,
                      per_token: bool = True) -> Array:
        """Each pair's expert applied to its row: stack [slots, N, row bytes] of one projection;
        x: [T, K] (per_token, one row per token) or [P, K] (a previous expert_linear's rows).
        bias: [E, N] by expert id. -> [P, N] in the plan's pair order."""
        ...

    def expert_glu(self, x: Any, batch: Any, layout: Any, plan: Any, kind: str, alpha: float = 0.0,
                   limit: float = 0.0) -> Array:
        """glu(gate·x (+ bias), up·x (+ bias)) of each pair: x [T, K] prepared; batch: the
        layer's ExpertBatch (gate, up stacks and biases); layout: its ExpertLayout; kind, alpha,
        limit: as glu. -> [P, F]. The same as expert_linear twice and glu (compose_expert_glu);
        a backend may fuse them."""
        ...

    def expert_ffn(self, x: Any, batch: Any, layout: Any, plan: Any, kind: str, alpha: float = 0.0,
                   limit: float = 0.0) -> Array:
        """Each planned pair's expert: down(glu(gate·x, up·x)) -> [P, D]. The same as expert_glu and
        expert_linear of the down projection (compose_expert_ffn); a backend whose experts arrive
        while it computes (the CUDA backend's staged batches) orders the work by arrival."""
        ...

    def moe_mix(self, y: Array, plan: Any, weights: Array, shared: Array | None = None) -> Array:
        """The weighted sum of each row's expert outputs in top-k order: y [P, D], weights [T, A]
        -> [T, D], plus shared [T, D] (a shared expert's output) when given."""
        ...

    def router(self, logits: Array, n_used: int, gating: str, norm_topk: bool, scale: float,
               chosen: Array | None = None) -> tuple[Array, Array]:
        """Top-k routing of logits [T, E] -> (ids [T, A] largest first, weights [T, A] f32), both
        the backend's arrays: on a GPU the ids stay on the device (routed_ids brings them to the
        host for the providers that need them). gating "softmax": softmax over E, then top-k;
        "softmax_weight": top-k of the logits, then softmax over the k. norm_topk: weights divided
        by their sum; scale: multiplied by it (0 = not). chosen: ids [T, A] to weigh instead of
        the top-k (routing replay)."""
        ...

    def route(self, x: Array, weight: QWeight, bias: Array | None, n_used: int, gating: str, norm_topk: bool,
              scale: float, chosen: Array | None = None, step: Step | None = None) -> tuple[Array, Array, Array]:
        """The exact router of x [T, D]: logits = x . weight^T (+ bias) [T, E], then `router` ->
        (logits, ids, weights): `compose_route`, or one launch for all three."""
        ...

    def routed_ids(self, ids: Array) -> np.ndarray:
        """The router's ids [T, A] on the host (int64), for an expert provider that chooses what to
        fetch by them, or a trace: on a GPU the one host sync of a MoE layer (in a segmented
        capture, read at the step's next host point)."""
        ...

    # -- elementwise and attention -------------------------------------------------------------

    def rms_norm(self, x: Array, weight: Array, eps: float) -> Array:
        """x [T, N] normalized per row, times weight [N]."""
        ...

    def rms_norm_heads(self, x: Array, weight: Array, eps: float) -> Array:
        """x [T, H, Dh] normalized per head, times weight [Dh]."""
        ...

    def rope(self, x: Array, step: Step, rope: Rope) -> Array:
        """x [T, H, Dh] rotated by the positions of the step's rows (NORM or NEOX, YaRN)."""
        ...

    def rope_qk(self, q: Array, k: Array, step: Step, rope: Rope, q_norm: Array | None = None,
                k_norm: Array | None = None, eps: float = 0.0) -> tuple[Array, Array]:
        """q [T, H, Dh] and k [T, Hkv, Dh] each normed per head (rms_norm_heads, when q_norm and
        k_norm [Dh] are given), then rotated (rope). -> (q, k). The same as those ops one by one;
        a backend may do it in one launch."""
        ...

    def attention(self, layer: int, q: Array, k: Array, v: Array, step: Step, scale: float, window: int,
                  sinks: Array | None, rope: Rope | None = None, q_norm: Array | None = None,
                  k_norm: Array | None = None, eps: float = 0.0, into: QWeight | None = None) -> Array:
        """Store k [T, Hkv, Dh] and v [T, Hkv, Dv] in layer `layer` of each sequence's cache, then
        attend each query row q [T, H, Dh] causally to its own sequence's cells (GQA: head h reads
        KV head h // (H / Hkv)). window: sliding window (0 = full); sinks: [H] extra logit per
        head or None. rope: q and k are first normed and rotated as rope_qk does (a backend may
        fuse that with storing k). -> [T, H, Dv]; with `into` (the weight of the linear the output
        goes straight to): [T, H*Dv], which a backend may hand over with that linear's input made."""
        ...

    def glu(self, gate: Array, up: Array, kind: str, alpha: float = 0.0, limit: float = 0.0) -> Array:
        """kind "silu": silu(gate) * up; "oai": gpt-oss's clamped SwiGLU (alpha, limit). [T, F]."""
        ...

    def sigmoid_gate(self, y: Array, z: Array) -> Array:
        """y [T, N] * sigmoid(z [T, 1]) (a shared expert's gate)."""
        ...

    def sigmoid_mul(self, y: Array, z: Array) -> Array:
        """y [T, N] * sigmoid(z), z [T, N] or [T, 1] (ggml_sigmoid, then ggml_mul: the gated
        attention's output gate, qwen3next's shared-expert gate)."""
        ...

    def split_heads(self, x: Array, n_head: int, parts: int) -> list[Array]:
        """x [T, H*parts*d], each head holding `parts` pieces of d values one after another ->
        `parts` contiguous arrays [T, H, d], piece i of every head (qwen3next's query + gate
        projection: parts 2; its b + a projection per key head: parts 2, d = Hv/Hk)."""
        ...

    # -- Gated DeltaNet (hybrid families; docs/qwen3next.md) -------------------------------------

    def conv_silu(self, layer: int, x: Array, weight: Array, step: Step) -> Array:
        """silu of each sequence's causal depthwise convolution: x [T, C], weight [C, Kc] f32.
        Each sequence's conv state (layer `layer` of its cache: its previous Kc-1 inputs) comes
        first, and is replaced by the last Kc-1 inputs. out[t, c] = silu(sum_i in[t+i, c] *
        weight[c, i]) over the Kc inputs ending at row t. -> [T, C]"""
        ...

    def gated_delta_net(self, layer: int, qkv: Array, b: Array, a: Array, dt_bias: Array, ssm_a: Array,
                        step: Step, ssm: Any, eps: float) -> Array:
        """The gated delta rule over each sequence's rows, its state in layer `layer` of its cache.
        qkv [T, C]: the conv output, q [Hk*Dk] | k [Hk*Dk] | v [Hv*Dv], head-major; b, a [T, Hv];
        dt_bias, ssm_a [Hv]; ssm: the model's Ssm (dims, key-head pairing); eps: the RMS eps.
        q and k are l2-normed per head, beta = sigmoid(b), g = softplus(a + dt_bias) * ssm_a,
        then per row, for value head h with key head kh: M = M*exp(g); M += (beta*(v - M k)) k^T;
        o = (M q) / sqrt(Dv), with M [Dv, Dk] the state. -> o [T, Hv, Dv]"""
        ...

    def gated_rms_norm(self, x: Array, weight: Array, z: Array, eps: float) -> Array:
        """rms_norm of x [T, H, D] per head, times weight [D], times silu(z [T, H*D]) -> [T, H*D]."""
        ...

    def delta_net(self, layer: int, x: Array, conv_weight: Array, b: Array, a: Array, dt_bias: Array,
                  ssm_a: Array, norm: Array, z: Array, step: Step, ssm: Any, eps: float) -> Array:
        """conv_silu of x [T, C], gated_delta_net and gated_rms_norm (weight norm [Dv], gate z
        [T, Hv*Dv]) -> [T, Hv*Dv]: the same as those ops one after another (compose_delta_net);
        a backend may fuse them."""
        ...

    def add(self, a: Array, b: Array) -> Array:
        """a + b, same shapes (the residual stream)."""
        ...

    def add_rms_norm(self, x: Array, delta: Array, weight: Array, eps: float) -> tuple[Array, Array]:
        """The residual add and the next norm: -> (x + delta, rms_norm(x + delta) * weight), both
        [T, D]. x itself is left as it was. The same as add then rms_norm; a backend may fuse them."""
        ...

    def join_parts(self, parts: list[Array], plans: list[Any]) -> Array:
        """The outputs [P_i, N] of waves planned with `only` -> [P, N] in the whole plan's order
        (the waves cover every pair once)."""
        ...

    def take_rows(self, x: Array, rows: np.ndarray) -> Array:
        """x [T, N] -> x[rows] [R, N], contiguous."""
        ...


def compose_route(backend: Backend, x, weight, bias, n_used: int, gating: str, norm_topk: bool, scale: float,
                  chosen=None, step: Step | None = None):
    """Backend.route as linear, then router."""
    logits = backend.linear(x, weight, step, bias=bias)
    ids, weights = backend.router(logits, n_used, gating, norm_topk, scale, chosen)
    return logits, ids, weights


def compose_delta_net(backend: Backend, layer: int, x, conv_weight, b, a, dt_bias, ssm_a, norm, z, step: Step, ssm,
                      eps: float):
    """Backend.delta_net as conv_silu, gated_delta_net and gated_rms_norm."""
    conv = backend.conv_silu(layer, x, conv_weight, step)  # [T, C]
    o = backend.gated_delta_net(layer, conv, b, a, dt_bias, ssm_a, step, ssm, eps)  # [T, Hv, Dv]
    return backend.gated_rms_norm(o, norm, z, eps)  # [T, Hv*Dv]


def compose_expert_glu(backend: Backend, x, batch, layout, plan, kind: str, alpha: float = 0.0, limit: float = 0.0):
    """expert_glu as its parts: expert_linear for gate and for up, then glu. -> [P, F]"""
    g = backend.expert_linear(x, batch.gate, layout.gate_type, layout.n_embd, plan, batch.gate_bias)  # [P, F]
    u = backend.expert_linear(x, batch.up, layout.up_type, layout.n_embd, plan, batch.up_bias)
    return backend.glu(g, u, kind, alpha, limit)


def compose_expert_ffn(backend: Backend, x, batch, layout, plan, kind: str, alpha: float = 0.0, limit: float = 0.0):
    """expert_ffn as expert_glu and expert_linear: x [T, D] (prepared) -> [P, D]."""
    h = backend.expert_glu(x, batch, layout, plan, kind, alpha, limit)  # [P, F]
    return backend.expert_linear(h, batch.down, layout.down_type, layout.n_ff, plan, batch.down_bias, per_token=False)


def pairs_on_cpu(cpu: Backend, x: np.ndarray, flat_ids: np.ndarray, pairs: np.ndarray, A: int, batch, layout,
                 kind: str, alpha: float = 0.0, limit: float = 0.0) -> np.ndarray:
    """Some (row, expert) pairs of a step computed by a CPU backend from host memory (hybrid
    compute), each as a one-token row of its expert. x [T, D] the step's rows, flat_ids [P] each
    pair's expert, pairs [Pc] which pairs, A experts a row -> [Pc, D] in `pairs`' order."""
    xs = np.ascontiguousarray(x[pairs // A], dtype=np.float32)  # [Pc, D]
    sub = np.asarray(flat_ids)[pairs].astype(np.int64).reshape(-1, 1)
    plan = cpu.expert_plan(sub, batch.rows, layout, None)
    y = compose_expert_ffn(cpu, cpu.prepare(xs), batch, layout, plan, kind, alpha, limit)
    return np.ascontiguousarray(y[plan.slot_rows.reshape(-1)], dtype=np.float32)  # plan order -> pairs
