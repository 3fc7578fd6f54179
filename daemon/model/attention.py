"""The self-attention block: q/k/v projections (biases, q/k norms), RoPE, causal attention over
the sequence's KV cache (GQA, sliding window, sinks), output projection; optionally gated as
qwen3next's full-attention layers (the q projection carries a per-head output gate).

Legend: T = rows (tokens) in the step, D = hidden size, H = query heads, Hkv = key/value heads,
Dh = head size, Dv = value head size.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..backend import Step
from .weights import QWeight


@dataclass(frozen=True)
class Attention:
    wq: QWeight  # [H*Dh, D]; gated: [H*2*Dh, D], each head's Dh query rows then Dh gate rows
    wk: QWeight  # [Hkv*Dh, D]
    wv: QWeight  # [Hkv*Dv, D]
    wo: QWeight  # [D, H*Dv]
    bq: np.ndarray | None
    bk: np.ndarray | None
    bv: np.ndarray | None
    bo: np.ndarray | None
    q_norm: np.ndarray | None  # [Dh] per head, or [H*Dh] whole projection
    k_norm: np.ndarray | None
    sinks: np.ndarray | None  # [H]
    window: int  # 0 = full attention
    gated: bool = False  # out = attention * sigmoid(gate) before wo (qwen3next)

    @classmethod
    def load(cls, src, hp, family, il: int, gated: bool = False) -> Attention:
        """Layer il's attention tensors (src: the model's uploading TensorSource)."""
        p = f"blk.{il}."
        D, H, Hkv, Dh, Dv = hp.n_embd, hp.n_head, hp.n_head_kv, hp.head_dim, hp.head_dim_v
        qk_len = {"head": Dh, "full": None}.get(family.qk_norm)
        q_rows = H * Dh * (2 if gated else 1)
        wq, wk, wv = src.matrices((p + "attn_q.weight", D, q_rows), (p + "attn_k.weight", D, Hkv * Dh),
                                  (p + "attn_v.weight", D, Hkv * Dv))
        return cls(
            wq=wq, wk=wk, wv=wv,  # one upload group: `linears` may apply them in one launch
            wo=src.matrix(p + "attn_output.weight", H * Dv, D),
            bq=src.optional_vector(p + "attn_q.bias", q_rows),
            bk=src.optional_vector(p + "attn_k.bias", Hkv * Dh),
            bv=src.optional_vector(p + "attn_v.bias", Hkv * Dv),
            bo=src.optional_vector(p + "attn_output.bias", D),
            q_norm=src.vector(p + "attn_q_norm.weight", qk_len or H * Dh) if family.qk_norm else None,
            k_norm=src.vector(p + "attn_k_norm.weight", qk_len or Hkv * Dh) if family.qk_norm else None,
            sinks=src.optional_vector(p + "attn_sinks.weight", H),
            window=hp.sliding_window if hp.swa_layers and hp.swa_layers[il] else 0,
            gated=gated,
        )

    def forward(self, model, il: int, x, step: Step):
        """x: [T, D] (normed) -> the block's output [T, D]."""
        B, hp, fam = model.backend, model.hp, model.family
        T = x.shape[0]
        H, Hkv, Dh, Dv = hp.n_head, hp.n_head_kv, hp.head_dim, hp.head_dim_v
        xa = B.prepare(x)  # converted once per weight type, shared by q, k and v
        # q [T, H*Dh] (gated: [T, H*2*Dh]), k [T, Hkv*Dh], v [T, Hkv*Dv]
        q, k, v = B.linears(xa, [self.wq, self.wk, self.wv], step, [self.bq, self.bk, self.bv])
        gate = None
        if self.gated:
            q, gate = B.split_heads(q, H, 2)  # [T, H, Dh] each
        eps = hp.rms_eps
        if fam.qk_norm == "full":
            q = B.rms_norm(q, self.q_norm, eps)
            k = B.rms_norm(k, self.k_norm, eps)
        q = q.reshape(T, H, Dh)
        k = k.reshape(T, Hkv, Dh)
        v = v.reshape(T, Hkv, Dv)
        head_norms = fam.qk_norm == "head"  # per-head norms, then RoPE, inside the attention op
        out = B.attention(il, q, k, v, step, 1.0 / np.sqrt(Dh), self.window, self.sinks, hp.rope,
                          self.q_norm if head_norms else None, self.k_norm if head_norms else None, eps,
                          into=self.wo if gate is None else None)  # [T, H*Dv] (gated: [T, H, Dv])
        if gate is not None:
            out = out.reshape(T, H * Dv)
            out = B.sigmoid_mul(out, gate.reshape(T, H * Dh))
        return B.linear(out, self.wo, step, self.bo)
