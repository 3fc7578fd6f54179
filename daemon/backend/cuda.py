"""The CUDA backend: numba-CUDA kernels (daemon/kernels/cuda), device arrays, a device KV pool.

Every weight lives in VRAM, repacked at upload (cuda_weights.py); every expert too
(cuda_experts.DeviceExperts, built by the engine); each sequence owns a slot of the model's KV
pool (cuda_cache.py), which for a hybrid family (qwen3next, qwen35moe) holds KV for the
attention layers and the conv + delta-rule states of the Gated DeltaNet layers (their ops:
daemon/kernels/cuda/gdn.py, taking the step's slots and offsets as attention does). Arrays
passed between ops are device arrays; host numpy arrays are accepted too and copied to the device
(tests, tools), and host QWeights or expert stacks are uploaded on each call (correct, slow: the
engine uploads everything at load).

Kernel choice per matmul: the GEMV (mmvq, one pass over the weights for up to 16 rows) for up
to MAX_COLS rows of a sequence, the tiled matmul (mmq) for more rows of quantized weights whose
K is a multiple of 32. The choice depends only on each sequence's own row count, and every
kernel computes a row independently of the others, so a sequence's results are the same bits
whatever shares its step (batch invariance); a decode step is always the GEMV.

Host synchronisation per step: the step's token ids, positions and KV slots go to the device
once (memo); the router's expert ids stay on the device, unless the expert provider chooses what
to fetch by them (the VRAM expert cache) or a routing trace reads them (`routed_ids`: then once per
MoE layer); and the logits rows come back at the end, or, for the serving loop, only the token ids the step sampled
on the device (`sample`, daemon/kernels/cuda/sample.py; `readback`: pinned copies and an event).
Everything runs in order on one non-blocking stream. A decode step replayed as a CUDA graph
(run_step, cuda_graphs.py) syncs only for its output; its input tokens may be the step before's
sampled ids, gathered on the device (`_fed_tokens`), so the host need not have seen them.

A CUDA error (driver, launch, out of memory) surfaces as DeviceError (a ModelError): the request
fails, the engine goes on. An error that poisons the context (an illegal address) leaves every
later launch failing the same way; only a restart recovers from that.

Legend: T = rows, S = sequences, D = hidden size, K = input length, N = output length, H = query
heads, Hkv = key/value heads, Dh = key head size, Dv = value head size, E = experts, A = experts
per row, P = T*A pairs, V = vocabulary.
"""

from __future__ import annotations

import functools
import logging
import threading
import time

import numpy as np
from numba import cuda

from ..errors import DeviceError
from ..kernels.cuda import attention as attn
from ..kernels.cuda import embed as embed_k
from ..kernels.cuda import gdn
from ..kernels.cuda import glu as glu_k
from ..kernels.cuda import feed as feed_k
from ..kernels.cuda import flash
from ..kernels.cuda import mmq, mmvq, norm, rope as rope_k, router as router_k
from ..kernels.cuda import sample as sample_k
from ..kernels.cuda.device import SIM, upload
from ..kernels.cuda.mmvq import MAX_COLS, Q8
from ..kernels.cuda.quantize import QK8_1, quantize_q8_1
from ..kernels.cuda.vecdot import FLOAT_ACT
from ..model.weights import QWeight
from . import cuda_experts as cx
from .base import compose_delta_net, compose_expert_ffn, compose_expert_glu, compose_route
from .cuda_staged import StagedBatch
from .cuda_transfer import Event, Transfers, _check, _drv, pinned_empty
from .cuda_cache import DeviceKVCache, KVPool
from .cuda_errors import CUDA_ERRORS
from .cuda_graphs import GraphCache, nonblocking_stream
from .cuda_weights import DeviceWeight, WeightGroup, byte_map, embedding_rows, put_rows, take_rows, upload_matrix
from .step import Step

_F32 = np.float32
log = logging.getLogger("moed.device")

try:  # a decode step's grids are small by nature: numba would warn at every such launch
    from numba.cuda.core import config as _numba_cuda_config

    _numba_cuda_config.CUDA_LOW_OCCUPANCY_WARNINGS = 0
except ImportError:  # other numba-cuda versions
    pass


_OP_BUFFERS_KEPT = 256 << 20  # pooled op buffers kept past an eager step (bytes)
_bound = threading.local()  # the device this thread's numba context is on


def _fits(w: attn.AttentionWork | None, rows: int, n_head: int, chunks: int, dv: int) -> bool:
    """w holds calls of `rows` rows of n_head heads of size dv over `chunks` chunks."""
    return (w is not None and w.max_rows >= rows and w.max_chunks >= chunks and w.part_o.shape[1] == n_head
            and w.part_o.shape[3] == dv)


def _work_bytes(w: attn.AttentionWork | None) -> int:
    return 0 if w is None else int(w.part_m.nbytes + w.part_l.nbytes + w.part_o.nbytes + w.done.nbytes)


def _guarded(fn):
    """An op: on this backend's device in any calling thread; CUDA errors become DeviceError."""

    @functools.wraps(fn)
    def op(self, *args, **kw):
        if getattr(_bound, "index", None) != self.index:
            self.bind()
        try:
            return fn(self, *args, **kw)
        except CUDA_ERRORS as e:
            raise DeviceError(f"{self.name}: {fn.__name__} failed: {e} ({self.memory_note()})") from e

    return op


def _op_arrays():
    from .cuda_arrays import OpArrays  # numba's driver classes: absent under the simulator

    return OpArrays()


class Activations:
    """x [T, K] (device f32) with its q8_1 blocks made on first use, shared by every quantized
    weight that reads x (q, k and v; gate and up). A norm's output comes with its blocks (the
    norm kernels write them: `_with_q8_1`)."""

    __slots__ = ("x", "_q8", "_stream", "_empty")

    def __init__(self, x, stream=0, empty=None):
        self.x = x
        self._q8 = getattr(x, "q8_1", None)
        self._stream = stream
        self._empty = empty

    @property
    def rows(self) -> int:
        return self.x.shape[0]

    def get(self, ggml_type: int, r0: int = 0, r1: int | None = None):
        """What weights of ggml_type read: f32 rows (float weights) or Q8 (quantized), rows r0..r1-1."""
        whole = r0 == 0 and (r1 is None or r1 == self.rows)
        if ggml_type in FLOAT_ACT:
            return self.x if whole else self.x[r0:r1]
        if self._q8 is None:
            qs, ds = (None, None) if self._empty is None else _q8_room(self._empty, *self.x.shape)
            self._q8 = Q8(*quantize_q8_1(self.x, qs, ds, stream=self._stream))
        return self._q8 if whole else Q8(self._q8.qs[r0:r1], self._q8.ds[r0:r1])


def _q8_room(empty, rows: int, k: int) -> Q8:
    """Uninitialised q8_1 blocks for rows of k values (k a multiple of 32), from `empty`."""
    return Q8(empty((rows, k), np.int8), empty((rows, k // QK8_1, 2), _F32))


def _with_q8_1(out, q8):
    """out, carrying its q8_1 blocks q8 (None: none) for the Activations made from it. They hang
    on the array object, not its memory: a view or another array over the same buffer has none,
    and nothing writes a norm's output in place."""
    if q8 is not None:
        out.q8_1 = q8
    return out


class CUDABackend:
    """Ops on GPU `device_index` (numba's numbering). max_slots: sequences the KV pool starts with."""

    def __init__(self, device_index: int = 0, max_slots: int = 4, graphs: bool = True):
        self.index = device_index
        self.name = f"cuda:{device_index}"
        self.max_slots = max_slots
        self.simulator = SIM
        self.bind()
        # every op runs in order on one non-blocking stream (captured as graphs: cuda_graphs.py)
        self.stream = cuda.stream() if SIM else nonblocking_stream()
        # op outputs from buffers reused in stream order (cuda_arrays.py); the simulator has no driver
        self.arrays = None if SIM else _op_arrays()
        self.graphs = GraphCache()
        self.use_graphs = graphs and not SIM  # the simulator has no graphs
        self._capturing = False
        self._pools: dict[tuple, KVPool] = {}
        self._work: attn.AttentionWork | None = None  # calls of more rows than the pool's slots (prefills)
        self._work_captured = False  # a captured graph holds self._work
        self._step_work: attn.AttentionWork | None = None  # calls of up to the pool's slots rows
        self._byte_maps: dict[int, object] = {}
        self._group_biases: dict[tuple, object] = {}  # upload groups' biases, concatenated
        self._iota = upload(np.arange(1, dtype=np.int32), self.stream)
        self._old_iotas: list = []  # outgrown, kept: captured graphs may still read them
        self._routed = None  # (host ids, device ids) of the last router call
        self._replay_tables: dict[int, tuple] = {}  # id(table) -> (table, its device copy)
        self._pinned_ids: dict[tuple, np.ndarray] = {}  # routing read back by segmented graphs, by shape
        self._route_done = upload(np.zeros(1, np.int32), self.stream)  # the fused router's ticket counter (0 between launches)
        self._inputs: dict[int, dict] = {}  # decode-step input buffers by sequence count (graphs)
        self.bytes = {"weights": 0, "experts": 0, "kv": 0, "scratch": 0}  # VRAM held, by use
        self.estimate = None  # select.VRAMEstimate of the model, when select_backend made this
        self.expert_budget = None  # VRAM for the expert cache (select_backend); None = every expert resident
        self._samplers = None  # device sampler slots (sampler_slots())
        self._sample_outputs: dict[int, tuple] = {}  # S -> (tokens, flags): sample(reuse=True)
        self._sampler_generation = 0
        self._readback = [None] * 3  # pinned buffers and events reused in turn (Readback)
        self._readback_turn = 0

    def __repr__(self) -> str:
        return f"CUDABackend({self.index})"

    def bind(self) -> None:
        """Make this thread's numba context the one of this backend's device."""
        cuda.select_device(self.index)
        _bound.index = self.index

    def vram_bytes(self) -> int:
        """VRAM this backend holds (weights, experts, KV pools, scratch, op buffers, graphs), by its
        own count."""
        return sum(self._held().values())

    def _held(self) -> dict[str, int]:
        return {**self.bytes, "op buffers": 0 if self.arrays is None else self.arrays.held,
                "graphs": self.graphs.nbytes}

    def memory_note(self) -> str:
        """What this backend holds in VRAM, and what the load estimated (for error messages)."""
        held = ", ".join(f"{k} {v / 2**20:,.0f} MiB" for k, v in self._held().items())
        est = f"; estimated at load: {self.estimate.describe()}" if self.estimate is not None else ""
        return f"VRAM held: {held}{est}"

    # -- weights and state ---------------------------------------------------------------------

    @_guarded
    def upload(self, weight):
        if isinstance(weight, QWeight):
            w = DeviceWeight(upload_matrix(weight.raw, weight.ggml_type), weight.ggml_type, weight.n_in, weight.n_out)
            self.bytes["weights"] += w.nbytes
            return w
        a = upload(np.ascontiguousarray(weight, dtype=_F32), self.stream)
        self.bytes["weights"] += int(a.nbytes)
        return a

    @_guarded
    def upload_group(self, weights):
        """One matrix of the weights' rows when they share a type and input length (each weight a
        view of its rows); else each uploaded alone."""
        if len({(w.ggml_type, w.n_in) for w in weights}) != 1:
            return [self.upload(w) for w in weights]
        qt, k = weights[0].ggml_type, weights[0].n_in
        raw = np.concatenate([np.ascontiguousarray(w.raw).reshape(w.n_out, -1) for w in weights])  # [N, RB]
        group = WeightGroup(DeviceWeight(upload_matrix(raw, qt), qt, k, raw.shape[0]))
        self.bytes["weights"] += group.whole.nbytes
        r0 = 0
        for w in weights:
            group.members.append(DeviceWeight(group.whole.packed[r0:r0 + w.n_out], qt, k, w.n_out, group, r0))
            r0 += w.n_out
        return list(group.members)

    @_guarded
    def resident_experts(self, gguf, on_bytes=None) -> cx.DeviceExperts:
        """Every expert of the model in VRAM (the expert provider the engine hands the model),
        loaded through cuda_upload.Uploader; on_bytes(done, total): file bytes loaded so far."""

        def note(_name, nbytes):
            self.bytes["experts"] += int(nbytes)

        return cx.DeviceExperts.from_gguf(gguf, note, self.stream, on_bytes)

    def expert_provider(self, gguf, settings, say, progress=None):
        """Every expert in VRAM when they fit (expert_budget None, select_backend's finding), else a
        VRAM expert cache over the streaming host cache, whose slots are pinned for the copies."""
        from .host_experts import bytes_note, host_expert_cache

        if self.expert_budget is None:
            say(f"uploading experts to {self.name}")
            return self.resident_experts(gguf, bytes_note(progress, "uploading experts")), None
        if settings.gpu_host_tier:
            from .cuda_host_tier import HostTierExperts

            say(f"loading experts into the host tier of {self.name}")
            tier = HostTierExperts.from_gguf(gguf, self, self.expert_budget, say,
                                             bytes_note(progress, "loading experts"), settings.gpu_host_tier_moves,
                                             host_budget_bytes=int(settings.expert_cache_limit_mb * 2**20),
                                             cpu_budget_bytes=int(settings.gpu_host_tier_cpu_mb * 2**20),
                                             cpu_count=settings.gpu_host_tier_cpu, numerics=settings.numerics)
            self.bytes["experts"] += tier.nbytes
            return tier, None
        from .cuda_expert_cache import VRAMExpertCache

        host = host_expert_cache(gguf, settings, say, allocate=pinned_empty)
        try:
            cache = VRAMExpertCache.from_settings(host, self, settings, say)
        except BaseException:
            if host is not None:
                host.close()
            raise
        return cache, cache

    @_guarded
    def new_cache(self, hp, n_ctx: int) -> DeviceKVCache:
        """A slot of the model's pool: KV for every layer, or for a hybrid family KV for its
        attention layers and conv + delta-rule states (zeroed for the new sequence, in stream
        order) for its recurrent ones."""
        key = (hp.n_layer, hp.n_head_kv, hp.head_dim, hp.head_dim_v)
        hybrid = any(hp.recurrent)
        if hybrid:
            key += (hp.ssm, tuple(hp.recurrent))
        pool = self._pools.get(key)
        if pool is None:
            pool = self._pools[key] = KVPool(*key[:4], slots=self.max_slots, on_grow=self._kv_grew,
                                             ssm=hp.ssm if hybrid else None, recurrent=hp.recurrent if hybrid else ())
        return DeviceKVCache(pool, n_ctx, self.stream)

    def _kv_grew(self, delta: int, moved: bool) -> None:
        self.bytes["kv"] += delta  # KV and, for a hybrid family, the recurrent states
        if moved:  # more slots, or longer than reserved: new arrays
            log.debug("%s: the KV pool was made again (%+d bytes); %d graphs dropped", self.name, delta,
                      len(self.graphs))
            self.graphs.clear("the KV pool was made again")  # they hold the old pool's addresses
        else:
            log.debug("%s: the KV pool mapped %d bytes more", self.name, delta)

    @_guarded
    def to_host(self, x) -> np.ndarray:
        if isinstance(x, np.ndarray):
            return x
        out = x.copy_to_host(stream=self.stream)
        self.stream.synchronize()
        return out

    # -- steps ---------------------------------------------------------------------------------

    @property
    def capturing(self) -> bool:
        """A step is being captured: nothing runs, launches are recorded."""
        return self._capturing

    def host_point(self, fn, sync: bool = True) -> None:
        """fn() now; in a segmented capture, at this point of every launch of the step's graph
        (after the stream is idle, if sync: fn reads what the step wrote so far)."""
        cut = self.graphs.cutting
        if cut is None:
            fn()
        else:
            cut(fn, sync)

    def replay_routes(self, table: np.ndarray, step: Step):
        """table int32 [L_moe, N, A] (uploaded once) gathered at the step's positions on the device:
        a captured step reads its graph's position buffer, so each launch replays its own rows."""
        dev = self._replay_tables.get(id(table))
        if dev is None or dev[0] is not table:
            dev = self._replay_tables[id(table)] = (table, upload(np.ascontiguousarray(table, np.int32), self.stream))
        L, _, A = table.shape
        out = self._empty((L, step.T, A), np.int32)
        router_k.replay_routes(dev[1], self._memo_ints(step, "positions", step.positions), out, self.stream)
        return out

    @_guarded
    def run_step(self, step: Step, compute, static: bool = False, segmented: bool = False):
        """compute() (the model's layers over `step`, launching on this backend) -> its output.
        static: compute reads nothing back to the host and every expert is resident, so a decode
        step may be captured once and replayed as a CUDA graph (bit-identical: the same kernels
        on the same inputs). segmented: compute reads the host only at its host points (and its
        routers' ids there), so a decode step may be captured as graph segments between them."""
        if self.samplers is not None and self.samplers.generation != self._sampler_generation:
            self._sampler_generation = self.samplers.generation
            log.debug("%s: sampler pools remade; %d graphs dropped", self.name, len(self.graphs))
            self.graphs.clear("the sampler pools were made again")  # they hold the old pools' addresses
        key = self._graph_key(step) if (static or segmented) and self.use_graphs else None
        if key is None or key in self.graphs.failed:
            if step.feed is not None:  # the input tokens, from the step before's sampled ids
                step.memo["tokens"] = self._fed_tokens(step, cuda.device_array(step.S, np.int32))
            out = compute()
            if self.arrays is not None and self.arrays.held > _OP_BUFFERS_KEPT:
                self.arrays.trim()  # a long prefill's activations: not held for the model's life
            return out
        key = (*key, segmented)
        self._graph_inputs(step, key)
        g = self.graphs.get(key)
        if g is None:
            if self.graphs.first_sighting(key):  # eager once: kernels compile, buffers are made
                log.debug("%s: decode step %s seen first: eager", self.name, key)
                return compute()
            self._capturing = True
            if self.arrays is not None:  # the graph keeps what it uses: plain allocations, recorded
                self.arrays.plain = True
            t0 = time.perf_counter()
            try:
                g = self.graphs.capture(key, self.stream, compute, segmented)
                log.debug("%s: decode step %s captured in %.3f s", self.name, key, time.perf_counter() - t0)
            except (DeviceError, *CUDA_ERRORS) as e:  # graphs are an optimisation: this shape stays eager
                self.graphs.failed.add(key)
                log.warning("%s: capturing a decode step of %d sequences failed (%s); it runs eagerly",
                            self.name, step.S, e)
                self.stream.synchronize()
                return compute()
            finally:
                self._capturing = False
                if self.arrays is not None:
                    self.arrays.plain = False
        g.launch(self.stream, self.graphs.clock)
        self.graphs.replays += 1
        return g.out

    def _graph_key(self, step: Step):
        """The shape a decode step's graph is made for, or None (not a decode step)."""
        if not step.one_row_each or not step.caches:
            return None
        pool = getattr(step.caches[0], "pool", None)
        if pool is None:
            return None
        # attention's grid covers a power of two of cells (blocks past a row's cells exit at
        # once), so one graph serves many steps of a growing context
        cells = 1 << int(step.positions.max()).bit_length()
        return (step.S, step.all_logits, min(max(cells, attn.CHUNK), pool.cells), id(pool),
                step.samplers is not None, step.variant)

    def _graph_inputs(self, step: Step, key) -> None:
        """The step's token ids, positions, KV slots and sampler slots copied into the buffers of
        its graph's shape, which the step's ops read (step.memo); fed tokens gathered there."""
        bufs = self._inputs.get(key[0])
        if bufs is None:
            bufs = self._inputs[key[0]] = {k: cuda.device_array(key[0], np.int32)
                                           for k in ("tokens", "positions", "slots", "samplers")}
        inputs = [("positions", step.positions), ("slots", self._row_slots(step))]
        if step.feed is None:
            inputs.append(("tokens", step.tokens))
        else:
            step.memo["tokens"] = self._fed_tokens(step, bufs["tokens"])
        if step.samplers is not None:
            inputs.append(("samplers", step.samplers))
        for name, values in inputs:
            bufs[name].copy_to_device(np.ascontiguousarray(values, dtype=np.int32), stream=self.stream)
            step.memo[name] = bufs[name]
        step.memo["max_cells"] = key[2]

    def _fed_tokens(self, step: Step, out):
        """out [S] int32 <- each sequence's input token: prev[src[s]] where src[s] >= 0 (sampled by
        the step before, never seen by the host), else step.tokens[s]."""
        src, prev = step.feed
        both = np.stack([np.asarray(src, np.int32), np.asarray(step.tokens, np.int32)])  # [2, S]
        feed_k.fed_tokens(out, cuda.to_device(both.reshape(-1), stream=self.stream), prev, stream=self.stream)
        return out

    # -- sampling ------------------------------------------------------------------------------

    @property
    def samplers(self):
        """The device sampler slots of this backend's sequences (made on first use)."""
        return self._samplers

    def sampler_slots(self):
        if self._samplers is None:
            self._samplers = sample_k.SamplerSlots(stream=self.stream)
        return self._samplers

    @_guarded
    def sample(self, logits, step: Step, reuse: bool = False):
        """Row s of logits [S, V] drawn by sequence s's sampler slot (step.samplers), on the
        device: -> (tokens [S] int32, flags [S] int32; 1 = its logits were not finite). The
        logits are overwritten (the repeat penalty is applied in place). reuse: the outputs are
        buffers kept per S (an eager launch outside a graph: no allocation, which may wait for
        the device; the next step's sampling is queued after this one's readers)."""
        slots = self._memo_ints(step, "samplers", step.samplers)
        S = logits.shape[0]
        if reuse:
            out = self._sample_outputs.get(S)
            if out is None:
                out = self._sample_outputs[S] = (cuda.device_array(S, np.int32), cuda.device_array(S, np.int32))
            tokens, flags = out
        else:
            tokens, flags = cuda.device_array(S, np.int32), cuda.device_array(S, np.int32)
        sample_k.sample_rows(logits, slots, self.sampler_slots(), tokens, flags, stream=self.stream,
                             **({"threads": 32} if SIM else {}))  # the simulator: a Python thread each
        return tokens, flags

    @_guarded
    def readback(self, arrays) -> Readback:
        """Small device arrays copied to the host in stream order, without waiting: the copies
        are read with .wait() (the stream goes on meanwhile)."""
        return Readback(self, arrays)

    @_guarded
    def synchronize_event(self, event: Event) -> None:
        if event.handle is not None:
            _check(_drv().cuEventSynchronize(event.handle))

    # -- dense ---------------------------------------------------------------------------------

    @_guarded
    def embed(self, table, tokens: np.ndarray, step: Step | None = None):
        table = self._weight(table)
        qt = table.ggml_type
        bmap = self._byte_maps.get(qt)
        if bmap is None:
            bmap = self._byte_maps[qt] = upload(byte_map(qt), self.stream)
        toks = self._memo_ints(step, "tokens", tokens)
        T = toks.shape[0]
        raw = embedding_rows(table, toks, bmap, self.stream)  # [T, RB]
        out = self._empty((T, table.n_in), _F32)  # [T, D]
        embed_k.embed(raw, qt, self._arange(T), out, stream=self.stream)
        return out

    @_guarded
    def prepare(self, x) -> Activations:
        return Activations(self._dev(x), self.stream, self._empty)

    @_guarded
    def linear(self, x, w, step: Step | None = None, bias=None):
        acts = x if isinstance(x, Activations) else Activations(self._dev(x), self.stream, self._empty)
        w = self._weight(w)
        bias = None if bias is None else self._dev(bias)
        qt, K = w.ggml_type, w.n_in
        T = acts.rows
        out = self._empty((T, w.n_out), _F32)  # [T, N]
        for seg in cx.segments(step, T, lambda n: self._tiled(qt, K, n)):
            a = acts.get(qt, seg.r0, seg.r1)
            o = out if (seg.r0, seg.r1) == (0, T) else out[seg.r0:seg.r1]
            if seg.tiled:
                mmq.mul_mat_q(w.packed, qt, K, a, out=o, bias=bias, stream=self.stream)
            else:
                mmvq.mul_mat_vec(w.packed, qt, K, a, out=o, bias=bias, stream=self.stream)
        return out

    @_guarded
    def linears(self, x, ws, step: Step | None = None, biases=None):
        """One launch over the group's whole matrix for a one-row step (a decode step of one
        sequence), the outputs then column views of one [1, N] array (contiguous: one row);
        otherwise one linear per weight. Every output row is computed by the same kernel either
        way (the launch shape depends on K alone), so the bits are the same."""
        biases = list(biases) if biases is not None else [None] * len(ws)
        acts = x if isinstance(x, Activations) else Activations(self._dev(x), self.stream, self._empty)
        ws = [self._weight(w) for w in ws]
        group = ws[0].group
        if acts.rows != 1 or group is None or group.members != ws:  # not one whole group, in order
            return [self.linear(acts, w, step, b) for w, b in zip(ws, biases)]
        out = self.linear(acts, group.whole, step, self._group_bias(group.whole, ws, biases))  # [1, N]
        return [out[:, w.row0:w.row0 + w.n_out] for w in ws]

    def _group_bias(self, whole: DeviceWeight, ws, biases):
        """The group's biases as one device vector [N] (made once per group), or None."""
        if all(b is None for b in biases):
            return None
        key = (id(whole), tuple(id(b) for b in biases))
        cat = self._group_biases.get(key)
        if cat is None:
            host = np.concatenate([np.zeros(w.n_out, _F32) if b is None else np.asarray(self.to_host(b), _F32)
                                   for w, b in zip(ws, biases)])
            cat = self._group_biases[key] = upload(host, self.stream)
            self.bytes["weights"] += int(cat.nbytes)
        return cat

    @staticmethod
    def _tiled(qt: int, k: int, rows: int) -> bool:
        """A sequence of `rows` rows takes the tiled matmul (else the GEMV)."""
        return rows > MAX_COLS and qt in mmq.MMQ_TYPES and k % mmq.K_MULTIPLE == 0

    # -- experts -------------------------------------------------------------------------------

    @_guarded
    def expert_plan(self, ids, slots, layout, step, only=None) -> cx.DevicePlan:
        routed = self._routed
        if not isinstance(ids, np.ndarray):
            ids_dev = ids  # the router's, on the device
        elif routed is not None and ids is routed[0]:
            ids_dev = routed[1]  # the router's own device copy: nothing to upload
        else:
            ids_dev = cuda.to_device(np.ascontiguousarray(ids, dtype=np.int32), stream=self.stream)
        slot_of = getattr(slots, "device", None)
        if slot_of is None:
            slot_of = cx.SlotMap(slots, layout.n_expert, self.stream).device
        usage = getattr(slots, "usage", None)  # a provider that follows use (cuda_host_tier.py)
        if usage is not None:  # and a flag for experts in no tier (a host tier smaller than the model)
            router_k.count_experts(ids_dev, usage, self.stream, slot_of, getattr(slots, "cold", None))
        T = ids_dev.shape[0]
        qts = (layout.gate_type, layout.up_type, layout.down_type)
        ks = (layout.n_embd, layout.n_embd, layout.n_ff)

        def tiled(n):  # one kernel for a sequence's three projections
            return all(self._tiled(qt, k, n) for qt, k in zip(qts, ks))

        pairs = None
        if only is not None:  # a wave: its pairs, for join_parts
            pairs = cuda.to_device(np.flatnonzero(np.isin(np.asarray(ids).reshape(-1), only)).astype(np.int32),
                                   stream=self.stream)
        return cx.DevicePlan(ids_dev, slot_of, layout.n_expert, cx.segments(step, T, tiled), pairs)

    @_guarded
    def join_parts(self, parts, plans):
        out = self._empty(parts[0].shape, _F32)  # [P, N]
        for part, plan in zip(parts, plans):
            put_rows(part, plan.pairs, out, self.stream)
        return out

    @_guarded
    def expert_linear(self, x, stack, ggml_type, k, plan: cx.DevicePlan, bias=None, per_token=True):
        acts = x if isinstance(x, Activations) else Activations(self._dev(x), self.stream, self._empty)
        if isinstance(stack, np.ndarray):  # a host provider's stack: uploaded for this call
            stack = upload_matrix(stack, ggml_type)
        stack, host = cx.tiers(stack)
        bias = None if bias is None else self._dev(bias)
        T, A = plan.T, plan.A
        n = stack.shape[1]
        out = self._empty((T, A, n), _F32)  # [T, A, N]
        for seg in plan.segments:
            whole = (seg.r0, seg.r1) == (0, T)
            r0, r1 = (seg.r0, seg.r1) if per_token else (seg.r0 * A, seg.r1 * A)
            a = acts.get(ggml_type, r0, r1)
            ids = plan.ids if whole else plan.ids[seg.r0:seg.r1]
            o = out if whole else out[seg.r0:seg.r1]
            if seg.tiled:
                mmq.mul_mat_q_ids(stack, ggml_type, k, a, ids, plan.slot_of,
                                  cx.groups_of(plan, seg, self.stream, self._empty), out=o, bias=bias,
                                  act_per_pair=not per_token, w_host=host, stream=self.stream)
            else:
                mmvq.mul_mat_vec_ids(stack, ggml_type, k, a, ids, plan.slot_of, out=o, bias=bias,
                                     act_per_pair=not per_token, w_host=host, stream=self.stream,
                                     **cx.gemv_launch(plan, seg, ggml_type, False, self.stream, self._empty))
        return out.reshape(T * A, n)  # [P, N]

    @_guarded
    def expert_ffn(self, x, batch, layout, plan: cx.DevicePlan, kind, alpha=0.0, limit=0.0):
        """A staged batch (experts still arriving, some on the CPU: cuda_staged.py) orders its
        own work; else expert_glu and expert_linear."""
        if isinstance(batch, StagedBatch):
            return batch.compute(self, x, layout, plan, kind, alpha, limit)
        return compose_expert_ffn(self, x, batch, layout, plan, kind, alpha, limit)

    @_guarded
    def expert_glu(self, x, batch, layout, plan: cx.DevicePlan, kind, alpha=0.0, limit=0.0, out=None):
        """The GEMV segments fused (gate, up and glu in one launch, x read once); tiled segments
        as expert_linear twice and glu. Which applies depends only on a sequence's own rows.
        out: [P, F] to write (pairs of experts outside plan.slot_of keep what they hold)."""
        qt = layout.gate_type
        if layout.up_type != qt or isinstance(batch.gate, np.ndarray) or all(seg.tiled for seg in plan.segments):
            if out is not None:
                raise ValueError("expert_glu writes into `out` only when fused (gate and up of one type, a GEMV)")
            return compose_expert_glu(self, x, batch, layout, plan, kind, alpha, limit)
        acts = x if isinstance(x, Activations) else Activations(self._dev(x), self.stream, self._empty)
        T, A, K = plan.T, plan.A, layout.n_embd
        F = batch.gate.shape[1]
        out = self._empty((T, A, F), _F32) if out is None else out.reshape(T, A, F)  # [T, A, F]
        for seg in plan.segments:
            r0, r1 = seg.r0, seg.r1
            whole = (r0, r1) == (0, T)
            ids = plan.ids if whole else plan.ids[r0:r1]
            o = out if whole else out[r0:r1]
            if seg.tiled:  # as expert_linear twice and glu, on these rows
                n = (r1 - r0) * A
                a = acts.get(qt, r0, r1)
                groups = cx.groups_of(plan, seg, self.stream, self._empty)
                g = self._empty((r1 - r0, A, F), _F32)
                u = self._empty((r1 - r0, A, F), _F32)
                for stack, bias, dst in ((batch.gate, batch.gate_bias, g), (batch.up, batch.up_bias, u)):
                    w, host = cx.tiers(stack)
                    mmq.mul_mat_q_ids(w, qt, K, a, ids, plan.slot_of, groups, out=dst, bias=bias, w_host=host,
                                      stream=self.stream)
                glu_k.glu(g.reshape(n, F), u.reshape(n, F), o.reshape(n, F), kind, alpha, limit, stream=self.stream)
            else:
                (gate, host_gate), (up, host_up) = cx.tiers(batch.gate), cx.tiers(batch.up)
                mmvq.mul_mat_vec_glu_ids(gate, up, qt, K, acts.get(qt, r0, r1), ids, plan.slot_of,
                                         glu="swiglu_oai" if kind == "oai" else "swiglu", bias_gate=batch.gate_bias,
                                         bias_up=batch.up_bias, alpha=alpha, limit=limit, out=o, host_gate=host_gate,
                                         host_up=host_up, stream=self.stream,
                                         **cx.gemv_launch(plan, seg, qt, True, self.stream, self._empty))
        return out.reshape(T * A, F)  # [P, F]

    @_guarded
    def moe_mix(self, y, plan: cx.DevicePlan, weights, shared=None):
        """The mix in one launch (the residual add and the next norm are the model's next op: one
        kernel for the three took 9-14 us a decode layer in the graph, against 6.9 us for the two,
        H200, 2026-12-01, its block of a row reading the A expert rows serially)."""
        y, weights = self._dev(y), self._dev(weights)
        out = self._empty((plan.T, y.shape[1]), _F32)  # [T, D]
        glu_k.moe_mix(y, weights, out, stream=self.stream)
        return out if shared is None else self.add(out, shared)

    @_guarded
    def router(self, logits, n_used, gating, norm_topk, scale, chosen=None):
        logits = self._dev(logits)
        T = logits.shape[0]
        ids = self._routing_ids(T, n_used, chosen)
        weights = self._empty((T, n_used), _F32)
        router_k.route(logits, gating, norm_topk, scale, ids, weights, given=chosen is not None, stream=self.stream)
        return ids, weights

    @_guarded
    def route(self, x, weight, bias, n_used, gating, norm_topk, scale, chosen=None, step=None):
        """A float router in one launch (router_k.route_fused); other types as linear + router."""
        w = self._weight(weight)
        if w.ggml_type not in FLOAT_ACT:
            return compose_route(self, x, weight, bias, n_used, gating, norm_topk, scale, chosen, step)
        x = self._dev(x.x if isinstance(x, Activations) else x)
        T, E = x.shape[0], w.n_out
        logits = self._empty((T, E), _F32)
        ids = self._routing_ids(T, n_used, chosen)
        weights = self._empty((T, n_used), _F32)
        router_k.route_fused(w.packed, w.ggml_type, x, None if bias is None else self._dev(bias), gating, norm_topk,
                             scale, logits, ids, weights, self._route_done, given=chosen is not None,
                             stream=self.stream)
        return logits, ids, weights

    def _routing_ids(self, T: int, n_used: int, chosen):
        if chosen is None:
            return self._empty((T, n_used), np.int32)
        if isinstance(chosen, np.ndarray):
            return cuda.to_device(np.ascontiguousarray(chosen, dtype=np.int32), stream=self.stream)
        return chosen  # already on the device (replay_routes)

    @_guarded
    def routed_ids(self, ids):
        T, A = ids.shape
        if self._capturing:
            if self.graphs.cutting is not None:  # a segmented step: the ids are on the host at its next host point
                host = self._pinned_ids.get((T, A))
                if host is None:
                    host = self._pinned_ids[(T, A)] = pinned_empty((T, A), np.int32)
                Transfers.d2h(host, ids, self.stream)
            else:  # nothing has run: no ids to read (the model asked for a graph: it needs none)
                host = np.zeros((T, A), np.int64)
        else:
            host = self.to_host(ids).astype(np.int64)  # the one host sync of a MoE layer
        self._routed = (host, ids)
        return host

    # -- elementwise and attention -------------------------------------------------------------

    def _norm_q8_1(self, x):
        """Room for a row norm's q8_1 blocks (x [T, D] with D a multiple of 32), else None."""
        if x.ndim != 2 or x.shape[1] % QK8_1:
            return None
        return _q8_room(self._empty, *x.shape)

    @_guarded
    def rms_norm(self, x, weight, eps):
        x = self._dev(x)
        out = self._empty(x.shape, _F32)
        q8 = self._norm_q8_1(x)
        norm.rms_norm(x, self._dev(weight), eps, out, q8=q8, stream=self.stream)
        return _with_q8_1(out, q8)

    @_guarded
    def rms_norm_heads(self, x, weight, eps):
        return self.rms_norm(x, weight, eps)  # rms_norm takes [T, H, Dh] with a [Dh] weight

    @_guarded
    def rope(self, x, step: Step, rope):
        """Rotates a device x in place (the model hands over q and k it made) and returns it."""
        x = self._dev(x)
        T, _, Dh = x.shape
        # apply_rope_qk rotates q and k in one launch; a one-head scratch stands in for k
        spare_key = ("rope_spare", Dh)
        spare = step.memo.get(spare_key)
        if spare is None:
            spare = step.memo[spare_key] = self._empty((T, 1, Dh), _F32)
        rope_k.apply_rope_qk(x, spare, self._rope_table(step, rope), rope.neox, stream=self.stream)
        return x

    @_guarded
    def rope_qk(self, q, k, step: Step, rope, q_norm=None, k_norm=None, eps=0.0):
        """Norms (when given) and rotates q and k in place, in one launch."""
        q, k = self._dev(q), self._dev(k)
        rope_k.norm_rope_qk(q, k, self._rope_table(step, rope), rope.neox,
                            None if q_norm is None else self._dev(q_norm), None if k_norm is None else self._dev(k_norm),
                            eps, stream=self.stream)
        return q, k

    def _rope_table(self, step: Step, rope):
        """The step's cos/sin table [T, n_dims/2, 2], made once per step."""
        key = ("rope", rope)
        table = step.memo.get(key)
        if table is None:
            table = step.memo[key] = self._empty((step.T, rope.n_dims // 2, 2), _F32)
            rope_k.rope_cache(self._memo_ints(step, "positions", step.positions), rope.n_dims, rope.freq_base,
                              rope.freq_scale, rope.ext_factor, rope.attn_factor, rope.corr_dims, table,
                              stream=self.stream)
        return table

    @_guarded
    def attention(self, layer, q, k, v, step: Step, scale, window, sinks, rope=None, q_norm=None, k_norm=None,
                  eps=0.0, into=None):
        """With rope, one launch norms and rotates q and k and stores k and v (norm_rope_qk's append).
        into (the linear's weight the output goes to, returned [T, H*Dv]): for one row (a decode
        step of one sequence) whose linear reads q8_1, the combine writes those blocks too (no
        quantize launch)."""
        q, k, v = self._dev(q), self._dev(k), self._dev(v)
        cache = step.caches[0]
        pool: KVPool = cache.pool
        slots = self._step_slots(step)
        positions = self._memo_ints(step, "positions", step.positions)
        max_cells = step.memo.get("max_cells")
        if max_cells is None:
            max_cells = step.memo["max_cells"] = int(step.positions.max()) + 1
        ia = cache.layers[layer].layer  # the pool's index of this attention layer (il in a non-hybrid model)
        kc, vc = pool.k[ia], pool.v[ia]
        if rope is None:
            attn.kv_append(k, v, slots, positions, kc, vc, stream=self.stream)
        else:
            rope_k.norm_rope_qk(q, k, self._rope_table(step, rope), rope.neox,
                                None if q_norm is None else self._dev(q_norm),
                                None if k_norm is None else self._dev(k_norm), eps,
                                append=(v, slots, positions, kc, vc), stream=self.stream)
        T, H, Dh = q.shape
        Dv = vc.shape[4]
        out = self._empty((T, H, Dv), _F32)
        sinks = None if sinks is None else self._dev(sinks)
        tiles, runs = self._attention_parts(step, H, kc.shape[2], Dh, Dv)
        # the combine's q8_1 pay at one row (H200, qwen3: attention 11.43 us against 10.97, the
        # quantize launch 1.67); at 16 a block combines 8 heads, and they cost more (42.1 against
        # 38.1, the launch 2.2)
        quantized = into is not None and self._weight(into).ggml_type not in FLOAT_ACT
        q8 = _q8_room(self._empty, T, H * Dv) if quantized and tiles is None and T == 1 and Dv % QK8_1 == 0 else None
        if tiles is not None:
            flash.attention_flash(q, kc, vc, slots, positions, tiles, scale, window, sinks, out, stream=self.stream)
        for r0, r1, one_slot in runs:
            def rows(a, whole=(r0, r1) == (0, T)):  # a decode step's (and its graph's) arrays as they are
                return a if whole else a[r0:r1]

            attn.attention(rows(q), kc, vc, rows(slots), rows(positions), scale, window, sinks, rows(out),
                           self._work_for(r1 - r0, H, pool, Dv), max_cells, one_slot=one_slot, q8=q8,
                           stream=self.stream)
        return out if into is None else _with_q8_1(out.reshape(T, H * Dv), q8)

    def _attention_parts(self, step: Step, n_head: int, n_head_kv: int, dh: int, dv: int):
        """Which rows take the flash kernel (its tiles on the device, or None) and which runs of
        whole sequences (r0, r1, one sequence) attention.py's kernel; each sequence by its own
        rows and cells (flash.suits), so its result does not depend on the rest of the step."""
        if step.one_row_each or not flash.supports(n_head, n_head_kv, dh, dv):
            return None, [(0, step.T, step.S == 1)]
        key = ("attention parts", n_head, n_head_kv)
        parts = step.memo.get(key)
        if parts is None:
            offsets = step.offsets
            rows = np.diff(offsets)
            take = [flash.suits(int(n), int(p) + 1) for n, p in zip(rows, step.positions[offsets[1:] - 1])]
            tiles = flash.tiles_of(offsets, flash.rows_per_tile(n_head, n_head_kv), take)
            runs = []  # maximal runs of sequences that do not take it
            for s, yes in enumerate(take):
                if yes:
                    continue
                if runs and runs[-1][1] == offsets[s]:
                    runs[-1] = (runs[-1][0], int(offsets[s + 1]), False)
                else:
                    runs.append((int(offsets[s]), int(offsets[s + 1]), True))
            parts = step.memo[key] = (self.put(tiles) if len(tiles) else None, runs)
        return parts

    def _work_for(self, rows: int, n_head: int, pool: KVPool, dv: int) -> attn.AttentionWork:
        """The attention scratch for `rows` rows over the pool's cells. Calls of up to the pool's
        slots rows (decode steps, the captured ones) share one sized for every cell the pool
        reserves, made once per pool shape, so the graphs holding it stay valid as the pool maps
        more cells; longer calls (prefills) share one grown as needed."""
        small = max(pool.slots, self.max_slots)
        if rows <= small:
            chunks = -(-pool.reserved_cells // attn.CHUNK)
            w = self._step_work
            if not _fits(w, small, n_head, chunks, dv):
                if w is not None:
                    log.debug("%s: decode attention scratch made again; %d graphs dropped", self.name, len(self.graphs))
                    self.graphs.clear("the decode attention scratch was made again")  # they hold its addresses
                self._step_work, old, w = None, _work_bytes(w), None  # freed before the new one is made
                self._step_work = self._new_work(old, small, n_head, chunks, dv)
            return self._step_work
        w = self._work
        chunks = -(-pool.cells // attn.CHUNK)
        if not _fits(w, rows, n_head, chunks, dv):
            keep = _fits(w, 0, n_head, 0, dv)  # the same heads: grown to hold both
            rows = max(rows, w.max_rows) if keep else rows
            chunks = max(chunks, w.max_chunks) if keep else chunks
            self._work, old, w = None, _work_bytes(w), None  # freed before the new one is made
            if self._work_captured:
                log.debug("%s: attention scratch grows; %d graphs dropped", self.name, len(self.graphs))
                self.graphs.clear("the attention scratch grew")  # they hold its addresses
                self._work_captured = False
            self._work = self._new_work(old, rows, n_head, chunks, dv)
        self._work_captured |= self._capturing
        return self._work

    def _new_work(self, old_bytes: int, rows: int, n_head: int, chunks: int, dv: int) -> attn.AttentionWork:
        """A scratch replacing one of old_bytes in the VRAM tally."""
        w = attn.AttentionWork(rows, n_head, chunks * attn.CHUNK, dv, self.stream)
        self.bytes["scratch"] += _work_bytes(w) - old_bytes
        return w

    @_guarded
    def glu(self, gate, up, kind, alpha=0.0, limit=0.0):
        gate, up = self._dev(gate), self._dev(up)
        out = self._empty(gate.shape, _F32)
        glu_k.glu(gate, up, out, kind, alpha, limit, stream=self.stream)
        return out

    @_guarded
    def sigmoid_gate(self, y, z):
        y = self._dev(y)
        out = self._empty(y.shape, _F32)
        glu_k.sigmoid_gate(y, self._dev(z), out, stream=self.stream)
        return out

    @_guarded
    def sigmoid_mul(self, y, z):
        y, z = self._dev(y), self._dev(z)
        out = self._empty(y.shape, _F32)  # [T, N]
        gdn.sigmoid_mul(y, z, out, stream=self.stream)
        return out

    @_guarded
    def split_heads(self, x, n_head, parts):
        """One copy launch into one buffer [parts, T, H, d]; the parts are its (contiguous) slices."""
        x = self._dev(x)
        T, N = x.shape
        d = N // (n_head * parts)
        if d * n_head * parts != N:
            raise ValueError(f"split_heads: {N} values are not {n_head} heads of {parts} equal parts")
        out = self._empty((parts, T, n_head, d), _F32)
        gdn.split_heads(x, out, stream=self.stream)
        return [out[p:p + 1].reshape(T, n_head, d) for p in range(parts)]

    # -- Gated DeltaNet ----------------------------------------------------------------------------

    @_guarded
    def conv_silu(self, layer, x, weight, step: Step):
        x = self._dev(x)
        cache = step.caches[0]
        out = self._empty(x.shape, _F32)  # [T, C]
        gdn.conv_silu(x, self._dev(weight), cache.pool.conv, cache.layers[layer].index, self._step_slots(step),
                      self._step_offsets(step), step.S, out, stream=self.stream)
        return out

    @_guarded
    def gated_delta_net(self, layer, qkv, b, a, dt_bias, ssm_a, step: Step, ssm, eps):
        qkv, b, a = self._dev(qkv), self._dev(b), self._dev(a)
        cache = step.caches[0]
        T, Hv = qkv.shape[0], ssm.n_v_head
        out = self._empty((T, Hv, ssm.head_v), _F32)  # [T, Hv, Dv]
        rows = None
        if not step.one_row_each:  # a sequence of many rows takes the chunked form (gdn_chunked.py)
            rows = step.memo.get("sequence rows")
            if rows is None:
                rows = step.memo["sequence rows"] = np.diff(step.offsets)
        gdn.gated_delta_net(qkv, b, a, self._dev(dt_bias), self._dev(ssm_a), cache.pool.state,
                            cache.layers[layer].index, self._step_slots(step), self._step_offsets(step), step.S,
                            ssm.n_k_head, ssm.head_k, ssm.tiled, eps, out, stream=self.stream, rows=rows,
                            empty=self._empty)
        return out

    @_guarded
    def gated_rms_norm(self, x, weight, z, eps):
        x, z = self._dev(x), self._dev(z)
        T, N = z.shape  # x [T, H, D]
        out = self._empty((T, N), _F32)  # [T, H*D]
        gdn.gated_rms_norm(x, self._dev(weight), z, eps, out, stream=self.stream)
        return out

    @_guarded
    def delta_net(self, layer, x, conv_weight, b, a, dt_bias, ssm_a, norm, z, step: Step, ssm, eps):
        """A decode step (one row a sequence) in one launch (gdn.decode_step); else the three ops."""
        if not step.one_row_each or not gdn.fused_decode_fits(ssm.head_k, ssm.head_v):
            return compose_delta_net(self, layer, x, conv_weight, b, a, dt_bias, ssm_a, norm, z, step, ssm, eps)
        x, b, a, z = self._dev(x), self._dev(b), self._dev(a), self._dev(z)
        cache = step.caches[0]
        pool = cache.pool
        S, Hv, Dv = x.shape[0], ssm.n_v_head, ssm.head_v
        o = self._empty((S, Hv, Dv), _F32)
        out = self._empty((S, Hv * Dv), _F32)
        gdn.decode_step(x, self._dev(conv_weight), pool.conv, b, a, self._dev(dt_bias), self._dev(ssm_a), pool.state,
                        cache.layers[layer].index, self._step_slots(step), ssm.n_k_head, ssm.head_k, ssm.tiled, eps,
                        self._dev(norm), z, o, out, pool.tickets, stream=self.stream)
        return out

    @_guarded
    def add(self, a, b):
        a = self._dev(a)
        out = self._empty(a.shape, _F32)
        glu_k.add(a, self._dev(b), out, stream=self.stream)
        return out

    @_guarded
    def add_rms_norm(self, x, delta, weight, eps):
        x = self._dev(x)
        x_out = self._empty(x.shape, _F32)  # [T, D]
        out = self._empty(x.shape, _F32)
        q8 = self._norm_q8_1(x)
        norm.add_rms_norm(x, self._dev(delta), self._dev(weight), eps, out, x_out=x_out, q8=q8, stream=self.stream)
        return x_out, _with_q8_1(out, q8)

    @_guarded
    def take_rows(self, x, rows):
        x = self._dev(x)
        rows = np.asarray(rows)
        if rows.shape[0] == x.shape[0] and np.array_equal(rows, np.arange(rows.shape[0])):
            return x  # every row, in order (a decode step's last rows): nothing to gather
        return take_rows(x, cuda.to_device(np.ascontiguousarray(rows, dtype=np.int32), stream=self.stream), self.stream)

    # -- helpers -------------------------------------------------------------------------------

    def empty(self, shape, dtype=_F32):
        """An uninitialised device array (an op's output)."""
        return self._empty(shape, dtype)

    def zeros(self, shape, dtype=_F32):
        """A device array of zeros (set in stream order)."""
        out = self._empty(shape, dtype)
        if SIM:
            out.copy_to_device(np.zeros(shape, dtype), stream=self.stream)
        else:
            _check(_drv().cuMemsetD8Async(int(out.gpu_data.device_pointer), 0, int(out.nbytes), int(self.stream.handle)))
        return out

    def put(self, host: np.ndarray):
        """A small host array on the device, copied in stream order (host may change at once)."""
        host = np.ascontiguousarray(host)
        out = self._empty(host.shape, host.dtype)
        Transfers.upload_into(out, host, self.stream)
        return out

    def _empty(self, shape, dtype=_F32):
        """An op's output array (uninitialised, C-contiguous)."""
        if self.arrays is None:
            return cuda.device_array(shape, dtype)
        return self.arrays.empty(shape, dtype)

    def _dev(self, x):
        """x as a device f32 array (a host array is copied over)."""
        if isinstance(x, np.ndarray):
            return cuda.to_device(np.ascontiguousarray(x, dtype=_F32), stream=self.stream)
        return x

    def _weight(self, w) -> DeviceWeight:
        if isinstance(w, QWeight):  # not uploaded (tests, tools): uploaded for this call
            return DeviceWeight(upload_matrix(w.raw, w.ggml_type), w.ggml_type, w.n_in, w.n_out)
        return w

    def _memo_ints(self, step: Step | None, key: str, values: np.ndarray):
        """values [T] as device int32, once per step (step None: every call). A step run as a
        graph has them in the graph's input buffers already (run_step)."""
        if step is not None:
            dev = step.memo.get(key)
            if dev is not None:
                return dev
        dev = cuda.to_device(np.ascontiguousarray(values, dtype=np.int32), stream=self.stream)
        if step is not None:
            step.memo[key] = dev
        return dev

    def _step_slots(self, step: Step):
        """The step's row slots on the device (int32 [T]), made once per step (a graph's input
        buffer when the step runs as one)."""
        slots = step.memo.get("slots")
        if slots is None:
            slots = self._memo_ints(step, "slots", self._row_slots(step))
        return slots

    def _step_offsets(self, step: Step):
        """The step's sequence offsets on the device (int32 [S+1]), once per step; None for a
        step of one row per sequence (a decode step: the kernels need none, so a graph of it has
        no offsets to feed)."""
        return None if step.one_row_each else self._memo_ints(step, "offsets", step.offsets)

    @staticmethod
    def _row_slots(step: Step) -> np.ndarray:
        """The KV slot of each row of the step [T]."""
        return np.repeat(np.array([c.slot for c in step.caches], np.int32), np.diff(step.offsets))

    def _arange(self, n: int):
        """Device int32 [0, 1, .., n-1] (a slice of one kept array)."""
        if self._iota.shape[0] < n:
            self._old_iotas.append(self._iota)  # a graph's kernels hold its address (freed: garbage rows)
            self._iota = upload(np.arange(max(n, 2 * self._iota.shape[0]), dtype=np.int32), self.stream)
        return self._iota if self._iota.shape[0] == n else self._iota[:n]


class Readback:
    """Device arrays copied into page-locked host buffers after the work enqueued so far; wait()
    -> host copies. Three sets of buffers and events are used in turn: the serving loop has at
    most two steps in flight."""

    def __init__(self, backend: CUDABackend, arrays):
        self._backend = backend
        i = backend._readback_turn = (backend._readback_turn + 1) % len(backend._readback)
        size = sum(int(a.size) for a in arrays)
        held = backend._readback[i]
        if held is None or held[0].size < size:
            held = backend._readback[i] = (pinned_empty(max(size, 64), np.int32), Event())
        host, self._event = held
        self._parts = []
        at = 0
        for a in arrays:
            part = host[at:at + int(a.size)]
            Transfers.d2h(part, a, backend.stream)
            self._parts.append(part)
            at += int(a.size)
        if self._event.handle is not None:
            _check(_drv().cuEventRecord(self._event.handle, int(backend.stream.handle)))

    def wait(self) -> list[np.ndarray]:
        self._backend.synchronize_event(self._event)
        return [p.copy() for p in self._parts]
