"""The Gated DeltaNet block of qwen3next and qwen35moe (llama.cpp's build_layer_attn_linear;
docs/qwen3next.md): input projections, causal conv with a rolling state, the gated delta rule
with a per-sequence state, the gated RMSNorm and the output projection.

Legend: T = rows in the step, D = hidden size, C = conv channels (2*Hk*Dk + Hv*Dv), Kc = conv
kernel, Hk / Hv = key / value heads, Dk / Dv = their head sizes, r = Hv / Hk.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..backend import Step
from ..errors import UnsupportedError
from .weights import QWeight


@dataclass(frozen=True)
class GatedDeltaNet:
    qkv: QWeight  # [C, D]: q, k, v channels, head-major
    gate: QWeight  # [Hv*Dv, D]: z, the output gate
    ba: QWeight | None  # qwen3next [2*Hv, D]: per key head, r b rows then r a rows
    beta: QWeight | None  # qwen35moe [Hv, D]
    alpha: QWeight | None  # qwen35moe [Hv, D]
    conv: np.ndarray  # [C, Kc] f32
    dt_bias: np.ndarray  # [Hv]
    a: np.ndarray  # [Hv]: -exp(A_log)
    norm: np.ndarray  # [Dv]
    out: QWeight  # [D, Hv*Dv]

    @classmethod
    def load(cls, src, hp, il: int) -> GatedDeltaNet:
        p, ssm, D = f"blk.{il}.", hp.ssm, hp.n_embd
        C, Vd, Hv = ssm.conv_channels, ssm.v_dim, ssm.n_v_head
        if not src.has(p + "attn_qkv.weight") and src.has(p + "ssm_in.weight"):
            raise UnsupportedError(f"layer {il}: the legacy fused 'ssm_in' projection is not supported; "
                                   "convert the model again with a current llama.cpp (attn_qkv + attn_gate)")
        if src.has(p + "ssm_ba.weight"):  # qwen3next
            qkv, gate, ba = src.matrices((p + "attn_qkv.weight", D, C), (p + "attn_gate.weight", D, Vd),
                                         (p + "ssm_ba.weight", D, 2 * Hv))
            beta = alpha = None
        else:  # qwen35moe
            qkv, gate, beta, alpha = src.matrices(
                (p + "attn_qkv.weight", D, C), (p + "attn_gate.weight", D, Vd), (p + "ssm_beta.weight", D, Hv),
                (p + "ssm_alpha.weight", D, Hv))
            ba = None
        return cls(qkv=qkv, gate=gate, ba=ba, beta=beta, alpha=alpha,
                   conv=src.vector(p + "ssm_conv1d.weight", shape=(C, ssm.conv_kernel)),
                   dt_bias=src.vector(p + "ssm_dt.bias", Hv), a=src.vector(p + "ssm_a", Hv),
                   norm=src.vector(p + "ssm_norm.weight", ssm.head_v),
                   out=src.matrix(p + "ssm_out.weight", Vd, D))

    def forward(self, model, il: int, x, step: Step):
        """x: [T, D] (normed) -> the block's output [T, D]; layer il's conv and recurrent state of
        each sequence move on by its rows."""
        B, hp = model.backend, model.hp
        ssm, T = hp.ssm, x.shape[0]
        xa = B.prepare(x)
        if self.ba is not None:
            mixed, z, ba = B.linears(xa, [self.qkv, self.gate, self.ba], step)  # [T, C], [T, Hv*Dv], [T, 2*Hv]
            b, a = B.split_heads(ba, ssm.n_k_head, 2)  # [T, Hk, r] each: value heads g*r .. g*r+r-1
            b, a = b.reshape(T, ssm.n_v_head), a.reshape(T, ssm.n_v_head)
        else:
            mixed, z, b, a = B.linears(xa, [self.qkv, self.gate, self.beta, self.alpha], step)
        # the conv, the gated delta rule and the gated norm -> y [T, Hv*Dv]
        y = B.delta_net(il, mixed, self.conv, b, a, self.dt_bias, self.a, self.norm, z, step, ssm, hp.rms_eps)
        return B.linear(y, self.out, step)
