"""The host tier (issue 27): every expert in page-locked host memory mapped into the GPU, a share
of each MoE layer's experts also in VRAM slots. A layer's slot map on the device (cuda_experts.
SlotMap, int32 [E]) says where the expert kernels read each routed expert: its VRAM slot (>= 0),
or its row of the host tier (-2 - e), in place over PCIe (zero-copy, mmvq.py's module doc). The
routing never leaves the device, so a decode step is one CUDA graph whatever the experts chosen,
and the tokens are those of every expert in VRAM (the kernels compute the same bits from either
tier).

For now the slots hold each layer's first S experts, chosen at load; promoting the experts a
workload uses (between steps, off the critical path) is the next step of issue 27. Hybrid compute
and SSD streaming are the VRAM expert cache's (cuda_expert_cache.py): this tier needs host memory
for every expert (MOE_GPU_HOST_TIER).

Legend: E = experts of a layer, S = VRAM slots of a layer, N = output rows, stride = repacked
row bytes.
"""

from __future__ import annotations

import numpy as np
from numba import cuda

from ..storage.experts import ExpertBatch, ResidentExperts
from .cuda_experts import DeviceExperts, SlotMap, TieredStack


class HostTierExperts:
    """An expert provider over the host tier and S VRAM slots a layer. Its batches hold
    TieredStacks: gate, up [S | E, F, stride], down [S | E, D, stride] (VRAM | host)."""

    routing_free = True  # the slot maps are read on the device: no routing on the host

    def __init__(self, host: DeviceExperts, slots: int, stream=0):
        self._layouts = host._layouts  # noqa: SLF001  (the same package's loader)
        self._batches: dict[int, ExpertBatch] = {}
        self.slots = max(0, int(slots))
        self.vram_bytes = self.host_bytes = 0
        for il, b in host._batches.items():  # noqa: SLF001
            n_expert = self._layouts[il].n_expert
            s = min(self.slots, n_expert)
            stacks = []
            for h in (b.gate, b.up, b.down):  # [E, N, stride] in mapped host memory
                v = cuda.device_array((s, *h.shape[1:]), np.uint8)  # [S, N, stride]
                if s:
                    v.copy_to_device(h[:s], stream=stream)  # the first S experts, device to device
                stacks.append(TieredStack(v, h))
                self.vram_bytes += int(v.nbytes)
                self.host_bytes += int(h.nbytes)
            rows = SlotMap({e: e for e in range(s)}, n_expert, stream, host_tier=True)
            self._batches[il] = ExpertBatch(*stacks, rows, b.gate_bias, b.up_bias, b.down_bias)
        if not isinstance(stream, int):
            stream.synchronize()

    @classmethod
    def from_gguf(cls, gguf, backend, budget_bytes: int, say=lambda _msg: None, on_bytes=None) -> HostTierExperts:
        """Every expert of the file loaded into the host tier (repacked on the GPU, written over
        PCIe), then as many VRAM slots a layer as budget_bytes holds over all MoE layers."""
        host = DeviceExperts.from_gguf(gguf, None, backend.stream, on_bytes, mapped=True)
        per_expert = sum(int(s[0].nbytes) for b in host._batches.values()  # noqa: SLF001
                         for s in (b.gate, b.up, b.down)) // max(1, len(host._batches))  # noqa: SLF001
        slots = int(budget_bytes) // max(1, per_expert * len(host._batches))  # noqa: SLF001
        tier = cls(host, slots, backend.stream)
        say(f"host tier: {tier.host_bytes / 2**30:.1f} GiB of experts in pinned host memory, "
            f"{tier.slots} of each layer's experts also in VRAM ({tier.vram_bytes / 2**30:.1f} GiB)")
        return tier

    @property
    def nbytes(self) -> int:
        """VRAM held (the slots; the biases are the host loader's, in VRAM too)."""
        return self.vram_bytes

    # every expert is served: the kernels pick the tier
    layout = ResidentExperts.layout
    fetch = ResidentExperts.fetch
    waves = ResidentExperts.waves
