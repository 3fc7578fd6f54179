"""An independent float64 numpy forward pass, used where llama.cpp cannot serve as the reference
(all-F32 MoE fixtures crash llama-cpp-python 0.3.36). It shares no code with moed: weights come
from gguf-py's reader and dequantizer, the math is written out plainly.

Legend: T = tokens, D = hidden, H/Hkv = heads, Dh = head size, E = experts, A = used experts.
"""

from __future__ import annotations

import math

import gguf
import numpy as np


class Reference:
    def __init__(self, path):
        r = gguf.GGUFReader(str(path))
        self.meta = {}
        for name, f in r.fields.items():
            if f.types and f.types[0] == gguf.GGUFValueType.ARRAY:
                continue
            self.meta[name] = f.contents()
        self.w = {}
        for t in r.tensors:
            a = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float64)
            self.w[t.name] = a.reshape([int(n) for n in reversed(t.shape.tolist())])
        self.arch = self.meta["general.architecture"]

    def m(self, key, default=None):
        return self.meta.get(f"{self.arch}.{key}", default)

    def logits(self, tokens):
        a, w = self.arch, self.w
        D = self.m("embedding_length")
        H = self.m("attention.head_count")
        Hkv = self.m("attention.head_count_kv")
        L = self.m("block_count")
        Dh = self.m("attention.key_length", D // H)
        eps = self.m("attention.layer_norm_rms_epsilon")
        n_rot = self.m("rope.dimension_count", Dh)
        base = self.m("rope.freq_base", 10000.0)
        neox = a != "llama"
        T = len(tokens)
        pos = np.arange(T)
        x = w["token_embd.weight"][tokens]
        for il in range(L):
            p = f"blk.{il}."
            h = rms(x, eps) * w[p + "attn_norm.weight"]
            q = h @ w[p + "attn_q.weight"].T + w.get(p + "attn_q.bias", 0)
            k = h @ w[p + "attn_k.weight"].T + w.get(p + "attn_k.bias", 0)
            v = h @ w[p + "attn_v.weight"].T + w.get(p + "attn_v.bias", 0)
            if a == "olmoe":
                q = rms(q, eps) * w[p + "attn_q_norm.weight"]
                k = rms(k, eps) * w[p + "attn_k_norm.weight"]
            q = q.reshape(T, H, Dh)
            k = k.reshape(T, Hkv, Dh)
            v = v.reshape(T, Hkv, -1)
            if a == "qwen3moe":
                q = rms(q, eps) * w[p + "attn_q_norm.weight"]
                k = rms(k, eps) * w[p + "attn_k_norm.weight"]
            q = self.rope(q, pos, n_rot, base, neox)
            k = self.rope(k, pos, n_rot, base, neox)
            window = self.m("attention.sliding_window", 0) if (a == "gpt-oss" and il % 2 == 0) else 0
            att = attention(q, k, v, window, w.get(p + "attn_sinks.weight"))
            x = x + att.reshape(T, -1) @ w[p + "attn_output.weight"].T + w.get(p + "attn_output.bias", 0)
            norm = "post_attention_norm" if a == "gpt-oss" else "ffn_norm"
            h = rms(x, eps) * w[p + norm + ".weight"]
            x = x + (self.moe(p, h) if p + "ffn_gate_inp.weight" in w else
                     ffn(h, w[p + "ffn_gate.weight"], w[p + "ffn_up.weight"], w[p + "ffn_down.weight"]))
        x = rms(x, eps) * w["output_norm.weight"]
        out = w.get("output.weight", w["token_embd.weight"])
        return x @ out.T

    def moe(self, p, h):
        w, a = self.w, self.arch
        A = self.m("expert_used_count")
        logits = h @ w[p + "ffn_gate_inp.weight"].T + w.get(p + "ffn_gate_inp.bias", 0)
        out = np.zeros_like(h)
        for t in range(h.shape[0]):
            if a == "gpt-oss":
                sel = np.argsort(-logits[t], kind="stable")[:A]
                wt = softmax(logits[t, sel])
            else:
                probs = softmax(logits[t])
                sel = np.argsort(-probs, kind="stable")[:A]
                wt = probs[sel]
                if a in ("llama", "qwen3moe"):
                    wt = wt / wt.sum()
            for e, we in zip(sel, wt):
                g = w[p + "ffn_gate_exps.weight"][e] @ h[t] + _row(w, p + "ffn_gate_exps.bias", e)
                u = w[p + "ffn_up_exps.weight"][e] @ h[t] + _row(w, p + "ffn_up_exps.bias", e)
                if a == "gpt-oss":
                    gx = np.minimum(g, 7.0)
                    act = gx / (1 + np.exp(-1.702 * gx)) * (np.clip(u, -7.0, 7.0) + 1)
                else:
                    act = g / (1 + np.exp(-g)) * u
                y = w[p + "ffn_down_exps.weight"][e] @ act + _row(w, p + "ffn_down_exps.bias", e)
                out[t] += we * y
        if p + "ffn_gate_shexp.weight" in w:
            sh = ffn(h, w[p + "ffn_gate_shexp.weight"], w[p + "ffn_up_shexp.weight"], w[p + "ffn_down_shexp.weight"])
            gate = h @ w[p + "ffn_gate_inp_shexp.weight"].reshape(1, -1).T
            out += sh / (1 + np.exp(-gate))
        return out

    def rope(self, x, pos, n_rot, base, neox):
        factor = self.m("rope.scaling.factor", 0.0) or 1.0
        kind = self.m("rope.scaling.type", "none")
        freq_scale = 1.0 / factor
        inv = base ** (-np.arange(0, n_rot, 2) / n_rot)  # [n_rot/2]
        theta_ex = pos[:, None] * inv[None, :]
        mscale = 1.0
        if kind == "yarn":
            n_orig = self.m("rope.scaling.original_context_length")
            beta_fast = self.m("rope.scaling.yarn_beta_fast", 32.0)
            beta_slow = self.m("rope.scaling.yarn_beta_slow", 1.0)

            def corr(n):
                return n_rot * math.log(n_orig / (n * 2 * math.pi)) / (2 * math.log(base))
            lo = max(0.0, math.floor(corr(beta_fast)))
            hi = min(n_rot - 1.0, math.ceil(corr(beta_slow)))
            i = np.arange(n_rot // 2)
            ramp = 1 - np.clip((i - lo) / max(0.001, hi - lo), 0, 1)
            theta = theta_ex * freq_scale * (1 - ramp) + theta_ex * ramp
            mscale = 1.0 + 0.1 * math.log(1.0 / freq_scale)
        else:
            theta = theta_ex * (freq_scale if kind == "linear" else 1.0)
        cos, sin = np.cos(theta) * mscale, np.sin(theta) * mscale  # [T, n_rot/2]
        out = x.copy()
        half = n_rot // 2
        if neox:
            a, b = x[..., :half], x[..., half:n_rot]
        else:
            a, b = x[..., 0:n_rot:2], x[..., 1:n_rot:2]
        c, s = cos[:, None, :], sin[:, None, :]
        ra, rb = a * c - b * s, a * s + b * c
        if neox:
            out[..., :half], out[..., half:n_rot] = ra, rb
        else:
            out[..., 0:n_rot:2], out[..., 1:n_rot:2] = ra, rb
        return out


def _row(w, name, e):
    return w[name][e] if name in w else 0


def rms(x, eps):
    return x / np.sqrt((x * x).mean(axis=-1, keepdims=True) + eps)


def softmax(z):
    z = np.exp(z - z.max())
    return z / z.sum()


def ffn(h, gate, up, down):
    g = h @ gate.T
    return (g / (1 + np.exp(-g)) * (h @ up.T)) @ down.T


def attention(q, k, v, window, sinks):
    T, H, Dh = q.shape
    group = H // k.shape[1]
    out = np.zeros((T, H, v.shape[2]))
    for t in range(T):
        lo = max(0, t - window + 1) if window else 0
        for h in range(H):
            kh = h // group
            s = k[lo:t + 1, kh] @ q[t, h] / math.sqrt(Dh)
            if sinks is not None:
                z = np.exp(np.append(s, sinks[h]) - max(s.max(), sinks[h]))
                p = z[:-1] / z.sum()
            else:
                p = softmax(s)
            out[t, h] = p @ v[lo:t + 1, kh]
    return out
