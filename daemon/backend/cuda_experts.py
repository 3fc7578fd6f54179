"""The CUDA backend's experts: the expert provider on the device, and the plan of a layer's pairs.

`DeviceExperts` holds every expert of every MoE layer in VRAM, loaded at load by
cuda_upload.Uploader: large reads into page-locked buffers, repacked on the device (the host holds
a few chunks at a time). Its fetch maps
expert ids to slots, and its batches carry that map as a device array too (`SlotMap.device`), so
the expert kernels read slots on the device. Streaming experts that do not fit is part 2.

A plan lists each sequence run's kernel: the GEMV over (token, expert) pairs (mmvq) for up to
MAX_COLS rows of one sequence, the tiled prefill matmul (mmq) for more. Every pair's result
depends only on its own row and its kernel, and the kernel only on its sequence's row count, so
a sequence's rows come out as in a step of that sequence alone (batch invariance).

Legend: T = rows, A = experts used per row, P = T*A pairs (token-major: pair t*A + a is row t's
a-th expert in top-k order), E = experts, S = slots, N = output rows, K = input length,
D = hidden size, F = expert FFN size, RB = raw row bytes, stride = repacked row bytes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
from numba import cuda

from ..kernels.cuda import grouping, mmvq
from ..kernels.cuda.device import upload
from ..kernels.quants import row_bytes
from ..storage.experts import PROJECTIONS, ExpertBatch, ExpertLayout, ResidentExperts, expert_biases


class SlotMap(dict):
    """expert id -> slot (a batch's `rows`), with the same map on the device: int32 [E], -1 for
    an expert not held (host_tier: -2 - e, the expert's row of the host tier)."""

    def __init__(self, rows: dict[int, int], n_expert: int, stream=None, host_tier: bool = False):
        super().__init__(rows)
        host = -2 - np.arange(n_expert, dtype=np.int32) if host_tier else np.full(n_expert, -1, np.int32)
        for e, s in rows.items():
            host[e] = s
        self.device = upload(host, stream)


class TieredStack(NamedTuple):
    """An expert stack in two tiers (cuda_host_tier.py): VRAM slots and every expert in mapped
    host memory; a plan's slot_of says which tier serves each expert (mmvq.py's module doc)."""
    vram: object  # device uint8 [S, N, stride]
    host: object  # mapped uint8 [E, N, stride]

    @property
    def shape(self) -> tuple:
        return tuple(self.vram.shape)


def tiers(stack) -> tuple:
    """(VRAM stack, host tier or None) of a batch's stack."""
    return (stack.vram, stack.host) if isinstance(stack, TieredStack) else (stack, None)


@dataclass(eq=False)
class Segment:
    """Rows r0..r1-1 of a step (whole sequences), computed by one kernel: tiled (mmq) or not."""
    r0: int
    r1: int
    tiled: bool
    groups: object = None  # grouping.Groups of the segment's pairs, made on first use


@dataclass(eq=False)
class DevicePlan:
    """Every pair of the step, in token-major order. A wave's plan (expert_plan(only=)) computes
    every pair too, those of experts outside the wave not written (slot -1); `pairs` lists its own,
    which join_parts takes from its output."""
    ids: object  # device int32 [T, A]
    slot_of: object  # device int32 [E]
    n_expert: int
    segments: list[Segment]
    pairs: object = None  # a wave's plan: device int32 [P_w], its pairs
    T: int = field(init=False)
    A: int = field(init=False)

    def __post_init__(self):
        self.T, self.A = self.ids.shape


@dataclass(frozen=True)
class Source:
    """Where one projection's stacked experts lie in the file: expert e's N raw rows of RB bytes
    start at offset + e * N * RB."""
    name: str
    offset: int
    n: int  # N
    rb: int  # RB
    ggml_type: int


def expert_sources(gguf) -> dict[int, list[Source]]:
    """Each MoE layer's gate, up and down stacks in the file."""
    from ..model.weights import TensorSource
    from ..storage.store import expert_layouts

    src = TensorSource(gguf)
    sources: dict[int, list[Source]] = {}
    for il, lay in expert_layouts(gguf).items():
        sources[il] = []
        for p in PROJECTIONS:
            k, n = (lay.n_ff, lay.n_embd) if p == "down" else (lay.n_embd, lay.n_ff)
            name = f"blk.{il}.ffn_{p}_exps.weight"
            info = src.stacked_info(name, k, n, lay.n_expert)
            sources[il].append(Source(name, info.offset, n, row_bytes(info.ggml_type, k), info.ggml_type))
    return sources


class DeviceExperts:
    """Every expert of the given layers in VRAM (an ExpertProvider). batches[il]: gate, up:
    device uint8 [E, F, stride]; down: [E, D, stride]; biases device f32 [E, F|D] or None."""

    # a layer's batch does not depend on which experts a step routes to (the kernels read the
    # routing on the device), so a step needs no routing on the host (CUDA graphs)
    routing_free = True

    def __init__(self, layouts: dict[int, ExpertLayout], batches: dict[int, ExpertBatch]):
        self._layouts = layouts
        self._batches = batches

    @classmethod
    def from_gguf(cls, gguf, on_upload=None, stream=None, on_bytes=None, mapped: bool = False,
                  rows: int | None = None) -> DeviceExperts:
        """Every layer's stacked expert tensors, read in large chunks, copied and repacked on the
        device (cuda_upload.Uploader; repacks on `stream`, default a stream of its own).
        on_upload(name, nbytes) is told of each tensor placed (the backend's VRAM tally);
        on_bytes(done, total) of the file bytes loaded so far. mapped: the stacks in page-locked
        host memory mapped into the device instead of VRAM (the host tier, cuda_host_tier.py).
        rows: only each layer's first `rows` experts (a host tier smaller than the model)."""
        from ..model.weights import TensorSource
        from ..storage.store import expert_layouts
        from .cuda_upload import Target, Uploader, device_matrix, mapped_matrix

        note = on_upload or (lambda _name, _nbytes: None)
        stream = cuda.stream() if stream is None else stream
        src = TensorSource(gguf)
        layouts = expert_layouts(gguf)
        stacks: dict[int, list] = {}
        targets = []
        for il, projections in expert_sources(gguf).items():
            stacks[il] = []
            held = layouts[il].n_expert if rows is None else min(rows, layouts[il].n_expert)
            for p in projections:
                flat = (mapped_matrix if mapped else device_matrix)(held * p.n, p.rb, p.ggml_type, stream)  # [E*N, stride]
                targets.append(Target(p.name, p.offset, held * p.n, p.rb, p.ggml_type, flat))
                stacks[il].append(flat.reshape(held, p.n, flat.shape[1]))  # [E, N, stride]
        Uploader(gguf, stream).run(targets, on_bytes)
        batches = {}
        for il, lay in layouts.items():
            for p, a in zip(PROJECTIONS, stacks[il]):
                note(f"blk.{il}.ffn_{p}_exps.weight", a.nbytes)
            biases = []
            for b in expert_biases(src, il, lay.n_embd, lay.n_ff, lay.n_expert):
                biases.append(None if b is None else upload(b))
                if b is not None:
                    note(f"blk.{il} expert bias", b.nbytes)
            held = stacks[il][0].shape[0]
            batches[il] = ExpertBatch(*stacks[il], SlotMap({e: e for e in range(held)}, lay.n_expert), *biases)
        return cls(layouts, batches)

    @property
    def nbytes(self) -> int:
        total = 0
        for b in self._batches.values():
            for a in (b.gate, b.up, b.down, b.gate_bias, b.up_bias, b.down_bias):
                total += 0 if a is None else int(a.nbytes)
        return total

    # every expert is held: serving them is ResidentExperts', over device batches
    layout = ResidentExperts.layout
    fetch = ResidentExperts.fetch
    waves = ResidentExperts.waves


def segments(step, T: int, tiled_rows) -> list[Segment]:
    """The step's rows as runs of whole sequences sharing a kernel. tiled_rows(n): whether a
    sequence of n rows takes the tiled kernel."""
    if step is None or step.S == 1:
        return [Segment(0, T, tiled_rows(T))]
    if step.one_row_each:
        return [Segment(0, T, tiled_rows(1))]
    out: list[Segment] = []
    offs = step.offsets
    for s in range(step.S):
        r0, r1 = int(offs[s]), int(offs[s + 1])
        tiled = tiled_rows(r1 - r0)
        if out and out[-1].tiled == tiled:
            out[-1].r1 = r1
        else:
            out.append(Segment(r0, r1, tiled))
    return out


# GEMV segments of at least this many rows read each expert once for runs of its pairs, for the
# types and projections where that measured faster (mmvq.expert_tuning); else one block a pair
GROUPED_GEMV_ROWS = 8


def groups_of(plan: DevicePlan, seg: Segment, stream, empty):
    """The pairs of a segment grouped by expert (once per plan: gate, up and down share it).
    empty(shape, dtype): the buffers' allocator (the backend's, which a graph capture keeps)."""
    if seg.groups is None:
        buffers = grouping.Groups(empty((max(1, (seg.r1 - seg.r0) * plan.A),), np.int32),
                                  empty((plan.n_expert + 1,), np.int32), plan.n_expert)
        seg.groups = grouping.group_by_expert(plan.ids[seg.r0:seg.r1], plan.n_expert, buffers, stream)
    return seg.groups


def gemv_launch(plan: DevicePlan, seg: Segment, qtype: int, glu: bool, stream, empty) -> dict:
    """The expert GEMV's shape for a segment: groups and the grouped tuning where it reads
    each expert once for runs of its pairs (GROUPED_GEMV_ROWS, mmvq.expert_tuning), else a
    block a pair."""
    grouped = mmvq.expert_tuning(qtype, glu, True) if seg.r1 - seg.r0 >= GROUPED_GEMV_ROWS else None
    if grouped is None:
        return {"tuning": mmvq.expert_tuning(qtype, glu, False)}
    return {"groups": groups_of(plan, seg, stream, empty), "tuning": grouped}
