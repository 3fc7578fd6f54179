"""The CPU backend's compiled step (kernels/decode_step.py): a model packed once into the arrays
that step reads, then each step run as one call: a decode batch, a prompt, or prompts together.

`StepProgram.build(model)` says why a model has none (a reason string) or returns one: the
compiled step runs the model's layer plan (model/plan.py, the stages the per-op path walks) where
its stages are the shared decoder's (attention, then routed experts or a dense FFN), with "ggml"
numerics and weights of any type the CPU computes. The rest keeps the per-op path: the
hybrids with Gated DeltaNet layers, shared experts. That path also stays the readable reference.

Experts are read where they lie (ExpertCache.in_place): each MoE layer's arenas and a slot map
(`slot_of`), refreshed before a step for each layer whose experts moved since. A chosen expert not
in the map ends the compiled call at its layer; the host fetches that layer's choice (read into
slots, pinned until the step ends) and the step resumes there. A bounded cache moves experts only
through fetches and prefetches; while the step runs, only its own fetches do (a prefetcher is a step
hook, and a step with hooks takes the per-op path), and an eviction it did not make voids the step.
A step that may choose more experts in a layer than its slots (rows x experts used) takes the
per-op path, whose waves serve it.

The step's first compile takes about 55 s of one core (then numba's disk cache loads it in about
1 s). A program can wait for it, or have it compiled on a thread of its own while the per-op path
serves (`run(wait=False)`): the logits are the same bits either way. That compile starts at the
second decode step, once the prompt and the first decode step have compiled the per-op kernels:
numba compiles one function at a time, and a kernel the per-op path needs would wait behind the
step.

Legend: T = rows of the step, S = its sequences, L = layers, Lm = MoE layers, E = experts,
V = vocabulary.
"""

from __future__ import annotations

import logging
import time
from contextlib import ExitStack
from concurrent.futures import Future, ThreadPoolExecutor

import numba
import numpy as np
from numba import types
from numba.typed import List

from ..kernels import decode_step as K
from ..kernels import quants as Q
from ..kernels.quants import dequantize
from ..kernels.row_dot import DECODE_STEP_TYPES
from ..kernels.sync import one_thread_per_iteration
from ..model.plan import COL_LAYER

log = logging.getLogger(__name__)

_U8_3D = types.Array(types.uint8, 3, "C", readonly=True)
_F32_1D = types.Array(types.float32, 1, "C")
_F32_2D = types.Array(types.float32, 2, "C")
_NONE_1D = np.zeros(1, np.float32)  # an absent vector (never read: its flag is off)
_NONE_2D = np.zeros((1, 1), np.float32)


def _stack(raw: np.ndarray) -> np.ndarray:
    """A weight's rows as the step's [E, N, row bytes] read-only stack (E = 1 for a matrix)."""
    a = np.ascontiguousarray(raw)
    a = a.reshape((1, *a.shape)) if a.ndim == 2 else a
    return Q._readonly(a)


_compiler: ThreadPoolExecutor | None = None
_compiles: dict[tuple, Future] = {}  # the step's argument types -> its compile (one per process)


def _compile(signature: tuple) -> Future:
    """The step compiled for these argument types (or loaded from numba's disk cache), on the
    compiler's thread. Not a daemon thread: a compile cut off at exit is lost, a finished one is
    cached for every later process."""
    global _compiler
    if signature not in _compiles:
        if _compiler is None:
            _compiler = ThreadPoolExecutor(1, thread_name_prefix="moed-step-compile")

        def compile_step():
            t0 = time.perf_counter()
            K.decode_step.compile(signature)
            log.info("the compiled decode step is ready (%.1f s)", time.perf_counter() - t0)

        _compiles[signature] = _compiler.submit(compile_step)
    return _compiles[signature]


def compiling() -> bool:
    """Whether a compile of the step is under way (its thread keeps a core busy)."""
    return any(not f.done() for f in _compiles.values())


class StepProgram:
    """One model's step as one compiled call; `run` serves any step of it (decode or prompts)."""

    def __init__(self, model, batches: dict, moves: np.ndarray | None = None):
        hp, fam = model.hp, model.family
        L = hp.n_layer
        self.tok_embd = model.tok_embd
        self.stages = model.plan.stages  # the layer plan the per-op path walks (model/plan.py)
        moe_index = {il: i for i, il in enumerate(model.moe_layers)}
        self.kinds = np.zeros((L, 8), np.int64)
        self.layer = np.zeros((L, 8), np.int64)
        lists = {name: List.empty_list(_U8_3D) for name in ("wq", "wk", "wv", "wo", "router", "gate", "up", "down")}
        vecs = {name: List.empty_list(_F32_1D) for name in ("bq", "bk", "bv", "bo", "q_norm", "k_norm", "sinks",
                                                               "router_bias")}
        ebias = {name: List.empty_list(_F32_2D) for name in ("gate_bias", "up_bias", "down_bias")}
        E = max(hp.n_expert, 1)
        # -1: not in memory; the last row (zeros) serves dense FFNs
        self.slot_of = np.full((len(model.moe_layers) + 1, E), -1, np.int64)
        self.slot_of[-1] = 0
        self.moe_index = moe_index
        n_kv = 0
        for il, layer in enumerate(model.layers):
            at, ffn = layer.mixer, layer.ffn
            kd, ly = self.kinds[il], self.layer[il]
            for name, w, col in (("wq", at.wq, K.K_Q), ("wk", at.wk, K.K_K), ("wv", at.wv, K.K_V), ("wo", at.wo, K.K_O)):
                lists[name].append(_stack(w.raw))
                kd[col] = w.ggml_type
            for name, b in (("bq", at.bq), ("bk", at.bk), ("bv", at.bv), ("bo", at.bo), ("q_norm", at.q_norm),
                            ("k_norm", at.k_norm), ("sinks", at.sinks)):
                vecs[name].append(np.ascontiguousarray(b, np.float32) if b is not None else
                                  (np.empty(0, np.float32) if name == "sinks" else _NONE_1D))
            ly[K.L_BIAS_QKV] = at.bq is not None
            ly[K.L_BIAS_O] = at.bo is not None
            ly[K.L_KV_SLOT] = n_kv
            n_kv += 1
            ly[K.L_WINDOW] = at.window
            if il in moe_index:
                batch = batches[il]
                lay = model.experts.layout(il)
                lists["router"].append(_stack(ffn.router.raw))
                kd[K.K_ROUTER] = ffn.router.ggml_type
                vecs["router_bias"].append(_vec(ffn.router_bias))
                ly[K.L_ROUTER_BIAS] = ffn.router_bias is not None
                for name, stack in (("gate", batch.gate), ("up", batch.up), ("down", batch.down)):
                    lists[name].append(_stack(stack))
                kd[K.K_GATE], kd[K.K_UP], kd[K.K_DOWN] = lay.gate_type, lay.up_type, lay.down_type
                for name, b in (("gate_bias", batch.gate_bias), ("up_bias", batch.up_bias),
                                ("down_bias", batch.down_bias)):
                    ebias[name].append(_NONE_2D if b is None else np.ascontiguousarray(b, np.float32))
                ly[K.L_EXPERT_BIAS] = batch.gate_bias is not None
                ly[K.L_MOE], ly[K.L_MOE_INDEX] = 1, moe_index[il]
            else:
                lists["router"].append(_stack(np.zeros((1, 1), np.uint8)))
                kd[K.K_ROUTER] = Q.F32
                vecs["router_bias"].append(_NONE_1D)
                for name, w, col in (("gate", ffn.gate, K.K_GATE), ("up", ffn.up, K.K_UP), ("down", ffn.down, K.K_DOWN)):
                    lists[name].append(_stack(w.raw))
                    kd[col] = w.ggml_type
                for name in ebias:
                    ebias[name].append(_NONE_2D)
        self.lists, self.vecs, self.ebias = lists, vecs, ebias
        self.experts = model.experts
        self.moe_layers = list(model.moe_layers)
        self._arenas: dict[int, np.ndarray] = {}  # MoE layer -> the gate arena its stacks view
        for il, batch in batches.items():
            self._place(il, batch)
        self._moves = moves  # [Lm, 2] the experts' moves the maps reflect (None: they never move)
        slots = getattr(self.experts, "slots", None)  # None: every expert always in place
        # the fewest slots of a layer; a step choosing at most that many pairs fits (E: any step)
        self.room = min((slots(il) for il in self.moe_layers), default=E) if slots is not None else E
        self.attn_norm = np.stack([np.asarray(l.attn_norm, np.float32) for l in model.layers])  # [L, D]
        self.ffn_norm = np.stack([np.asarray(l.ffn_norm, np.float32) for l in model.layers])
        self.out_norm = np.ascontiguousarray(model.output_norm, np.float32)
        self.out_w = _stack(model.output.raw)
        rope = hp.rope
        self.rope = rope
        dims = np.zeros(K.N_DIMS, np.int64)
        dims[K.D_HEADS], dims[K.D_KV_HEADS], dims[K.D_HEAD], dims[K.D_HEAD_V] = (hp.n_head, hp.n_head_kv, hp.head_dim,
                                                                                hp.head_dim_v)
        dims[K.D_ROPE_DIMS], dims[K.D_NEOX] = rope.n_dims, rope.neox
        dims[K.D_QK_NORM] = {None: K.QK_NONE, "head": K.QK_HEAD, "full": K.QK_FULL}[fam.qk_norm]
        dims[K.D_USED] = hp.n_expert_used
        dims[K.D_WEIGHT_SOFTMAX] = fam.gating == "softmax_weight"
        dims[K.D_NORM_TOPK] = fam.norm_topk
        dims[K.D_GLU_OAI] = fam.glu == "oai"
        dims[K.D_GGML] = 1
        dims[K.D_OUT_KIND] = model.output.ggml_type
        for col, name in ((K.D_NQ, "wq"), (K.D_NK, "wk"), (K.D_NV, "wv"), (K.D_FF, "gate"), (K.D_EXPERTS, "router")):
            dims[col] = lists[name][0].shape[1]  # every layer's (unsupported)
        self.dims = dims
        self.scalars = np.array([hp.rms_eps, 1.0 / np.sqrt(hp.head_dim), hp.expert_weights_scale, fam.glu_alpha,
                                 fam.glu_limit], np.float32)
        self.n_vocab = hp.n_vocab
        self.clock = np.zeros(K.CLOCK_SIZE, np.int64)  # cycles per phase, summed over steps (benchmarks)
        self.lost = ""  # why the step cannot serve this model after all (the per-op path then does)
        self._compiled: Future | None = None
        self._decode_steps = 0

    @classmethod
    def build(cls, model) -> StepProgram | str:
        """The model's program, or why it has none (the per-op path then serves it)."""
        why = unsupported(model)
        if why:
            return why
        in_place = getattr(model.experts, "in_place", None)
        if model.moe_layers and in_place is None:
            return f"an expert provider without in-place reads ({type(model.experts).__name__})"
        moves = getattr(model.experts, "moves", None)
        # the counts before the maps: a move in between is seen by the next step's refresh
        before = moves(model.moe_layers) if moves is not None and model.moe_layers else None
        return cls(model, {il: in_place(il) for il in model.moe_layers}, before)

    def _place(self, il: int, batch) -> None:
        """Layer il's experts where they lie now: their stacks and each one's slot (-1: absent)."""
        i = self.moe_index[il]
        if self._arenas.get(il) is not batch.gate:  # an arena made since (np.empty: pages come as filled)
            for name, stack in (("gate", batch.gate), ("up", batch.up), ("down", batch.down)):
                self.lists[name][il] = _stack(stack)
            self._arenas[il] = batch.gate
        self.slot_of[i] = -1
        for e, slot in batch.rows.items():
            self.slot_of[i, e] = slot

    def run(self, step, rope_table: np.ndarray, stores, threads: int = 0, wait: bool = True) -> np.ndarray | None:
        """The step's rows (a decode batch, or prompts; their KV cells reserved) -> logits [T, V],
        or [S, V] of each sequence's last row unless step.all_logits. None: the step did not run to
        its end, and changed nothing the per-op path does not write again: not compiled yet (wait
        False), more experts than a layer's slots may be chosen, a fetched expert outside the
        arena, an eviction it did not make; or `lost` says why it never will (its threads could not
        meet, sync.py; its compile failed). threads: the step's threads (default numba's count;
        more than numba runs at once never meet). rope_table: the step's [T, n_rot/2, 2]; stores:
        each sequence's KV arrays (numba Lists)."""
        if self.room < self.dims[K.D_EXPERTS] and step.T * self.dims[K.D_USED] > self.room:
            return None  # it may choose more experts in a layer than its slots: the per-op path's waves
        x = dequantize(self.tok_embd.raw[step.tokens], self.tok_embd.ggml_type, self.tok_embd.n_in)  # [T, D]
        trim = not step.all_logits
        logits = np.empty((step.S if trim else step.T, self.n_vocab), np.float32)
        self.routes = np.empty((self.slot_of.shape[0] - 1, step.T, max(1, self.dims[K.D_USED])), np.int64)
        seq_of = np.repeat(np.arange(step.S, dtype=np.int64), np.diff(step.offsets))  # [T]
        L, V, E = self.lists, self.vecs, self.ebias
        args = [self.stages, x, rope_table, step.positions, seq_of, step.offsets, int(trim), stores[0], stores[1],
                self.dims, self.scalars, self.kinds, self.layer, self.attn_norm, self.ffn_norm, self.out_norm, L["wq"], L["wk"],
                L["wv"], L["wo"], V["bq"], V["bk"], V["bv"], V["bo"], V["q_norm"], V["k_norm"], V["sinks"],
                L["router"], V["router_bias"], L["gate"], L["up"], L["down"], E["gate_bias"], E["up_bias"],
                E["down_bias"], self.slot_of, self.out_w, logits, self.routes, -1,
                threads or numba.get_num_threads(), self.clock]
        if not self._ready(args, wait, step.one_row_each):
            return None
        self._refresh()
        read = np.zeros(len(self.moe_layers), bool)  # the layers the step fetched for (they counted)
        with ExitStack() as held:
            while True:
                start = args[-3] = K.decode_step(*args)
                if start == K.VOID:
                    self.lost = "its threads did not all run at once"
                    return None
                if start < 0:
                    break
                il = int(self.stages[start, COL_LAYER])
                if not self._fetch(il, held):
                    return None
                read[self.moe_index[il]] = True
            if self._moves is not None and self._moved_by_others():
                return None
            if self.moe_layers and not read.all() and hasattr(self.experts, "count_in_place"):
                self.experts.count_in_place([il for il, r in zip(self.moe_layers, read) if not r],
                                            self.routes[~read].reshape(int((~read).sum()), -1))
        return logits

    def _refresh(self) -> None:
        """Each MoE layer's map re-read where its experts moved since the last (counts before maps:
        a move in between shows at the next refresh)."""
        if self._moves is None:
            return
        now = self.experts.moves(self.moe_layers)
        for i in np.flatnonzero((now != self._moves).any(axis=1)).tolist():
            il = self.moe_layers[i]
            self._place(il, self.experts.in_place(il))
        self._moves = now

    def _fetch(self, il: int, held: ExitStack) -> bool:
        """The experts layer il chose, read into its slots and pinned until the step ends, and its
        map re-read. False: one lies outside the arena (every slot pinned or filling), so the step
        cannot read it there."""
        ids = np.unique(self.routes[self.moe_index[il]]).tolist()
        held.enter_context(self.experts.fetch(il, ids))
        moved = self.experts.moves([il])[0] if self._moves is not None else None  # counts, then the map
        batch = self.experts.in_place(il)
        if any(e not in batch.rows for e in ids):
            return False
        self._place(il, batch)
        if moved is not None:  # this fetch's evictions are the step's own (_moved_by_others)
            self._moves[self.moe_index[il]] = moved
        return True

    def _moved_by_others(self) -> bool:
        """Whether an expert the step may have read was evicted by a fetch it did not make (what it
        computed is void: the per-op path runs the step)."""
        now = self.experts.moves(self.moe_layers)
        if (now[:, 1] == self._moves[:, 1]).all():
            return False
        log.warning("experts were evicted while the compiled step read them: the step runs op by op")
        return True  # the next refresh re-reads the layers they left

    def _ready(self, args: list, wait: bool, decode: bool) -> bool:
        """Whether the step's machine code for these arguments is ready (see the module's doc: in
        the background, the compile starts at the second decode step)."""
        self._decode_steps += decode
        if self._compiled is None and (wait or self._decode_steps > 1):
            self._compiled = _compile(tuple(numba.typeof(a) for a in args))
        if self._compiled is None or not (wait or self._compiled.done()):
            return False
        try:
            self._compiled.result()
        except Exception as e:  # noqa: BLE001 - a compiler's error of any kind: the per-op path serves
            self.lost = f"it did not compile ({type(e).__name__}: {e})"
            return False
        return True


def _vec(v) -> np.ndarray:
    return _NONE_1D if v is None else np.ascontiguousarray(v, np.float32)


def unsupported(model) -> str:
    """Why the compiled step cannot run this model ('' when it can)."""
    from ..model.attention import Attention
    from ..model.moe import MoE

    if getattr(model.backend, "numerics", None) != "ggml":
        return "float32 numerics"
    if not one_thread_per_iteration():
        return f"numba's {numba.threading_layer()} threading layer (the step needs OpenMP's)"
    if model.family.build_layer is not None or any(model.hp.recurrent):
        return f"{model.family.arch}'s layers have their own builder"
    if model.family.last_layer_all_rows:
        return "a last layer that keeps every row"
    types_used = {model.output.ggml_type}
    for layer in model.layers:
        at, ffn = layer.mixer, layer.ffn
        if type(at) is not Attention or at.gated:
            return "a mixer other than plain attention"
        types_used |= {at.wq.ggml_type, at.wk.ggml_type, at.wv.ggml_type, at.wo.ggml_type}
        if len({at.bq is None, at.bk is None, at.bv is None}) > 1:
            return "biases on some of q, k and v only"
        if isinstance(ffn, MoE):
            if ffn.shared is not None:
                return "shared experts"
            lay = model.experts.layout(ffn.layer)
            types_used |= {ffn.router.ggml_type, lay.gate_type, lay.up_type, lay.down_type}
        else:
            types_used |= {ffn.gate.ggml_type, ffn.up.ggml_type, ffn.down.ggml_type}
    sizes = {(l.mixer.wq.n_out, l.mixer.wk.n_out, l.mixer.wv.n_out, isinstance(l.ffn, MoE)) for l in model.layers}
    if len(sizes) > 1:
        return "layers of different sizes or kinds"
    odd = types_used - DECODE_STEP_TYPES
    if odd:
        return "weights of type " + ", ".join(sorted(Q.type_name(t) for t in odd))
    return ""
