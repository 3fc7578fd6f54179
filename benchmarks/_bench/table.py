"""The one table benchmarks/run.py prints: moed rows, then llama.cpp rows, ratios in the moed rows.
COLUMNS on the CPU, GPU_COLUMNS with --device cuda (llama.cpp: llama-bench's mean and stddev)."""

from __future__ import annotations

COLUMNS = [  # (header, least width, row -> text); the first 5 are text
    ("engine", 9, lambda r: r["engine"]),
    ("thr", 3, lambda r: str(r["threads"])),
    ("cache MB", 8, lambda r: "-" if r["engine"] != "moed" else ("unlim" if not r["cache_mb"] else f"{r['cache_mb']:g}")),
    ("conc", 4, lambda r: str(r["concurrency"])),
    ("routing", 42, lambda r: r["routing_label"]),
    ("load s", 6, lambda r: _num(r.get("load_s"), ".2f")),
    ("prefill t/s", 11, lambda r: _num(r.get("prefill_tps"), ".1f")),
    ("decode t/s", 10, lambda r: _num(r.get("decode_tps"), ".1f")),
    ("TTFT s", 7, lambda r: _num(r.get("ttft_s"), ".3f")),
    ("hit", 5, lambda r: _num(r.get("hit_rate"), ".0%")),
    ("exp MB/tok", 10, lambda r: _per_tok(r, "expert_bytes")),
    ("disk MB/tok", 11, lambda r: _per_tok(r, "disk_bytes")),
    ("disk MB/s", 9, lambda r: _num(r.get("disk_mb_s"), ".1f")),
    ("of dd", 6, lambda r: _num(r.get("of_dd"), ".1%")),
    ("RSS MiB", 7, lambda r: _num(r.get("max_rss_mb"), ".0f")),
    ("x llama pre", 11, lambda r: _num(r.get("ratio_prefill"), ".2f")),
    ("x llama dec", 11, lambda r: _num(r.get("ratio_decode"), ".2f")),
]
TEXT_COLUMNS = 5

GPU_TEXT_COLUMNS = 6
GPU_COLUMNS = [
    ("engine", 9, lambda r: r["engine"]),
    ("thr", 3, lambda r: str(r["threads"])),
    ("VRAM MB", 7, lambda r: "-" if r.get("gpu_cache_mb") is None else f"{r['gpu_cache_mb']:g}"),
    ("ncmoe", 5, lambda r: str(r.get("n_cpu_moe", "-"))),
    ("routing", 30, lambda r: r["routing_label"]),
    ("min-batch", 9, lambda r: str(r.get("min_batch", "-"))),
] + [(header, max(len(header), 5), lambda r, key=key, fmt=fmt: _num(r.get(key), fmt)) for header, key, fmt in (
    ("decode t/s", "decode_tok_s", ".2f"), ("±", "decode_tok_s_stddev", ".2f"),
    ("x llama dec", "ratio_decode", ".2f"), ("prefill t/s", "prefill_tok_s", ".1f"),
    ("warm pre t/s", "prefill_warm_tok_s", ".1f"), ("x llama pre", "ratio_prefill", ".2f"),
    ("x llama warm pre", "ratio_prefill_warm", ".2f"), ("hit", "hit_rate", ".0%"), ("Belady", "belady_hit_rate", ".0%"),
    ("opt-bypass", "opt_bypass_hit_rate", ".0%"),
    ("MiB/tok", "bytes_per_token_mb", ".0f"), ("H2D GB/s", "h2d_gbps", ".1f"),
    ("copy bound t/s", "copy_bound_tok_s", ".1f"), ("overlap", "overlap_pct", ".1f"),
    ("fallback", "fallback_rate", ".1%"), ("CPU exp/tok", "cpu_experts_per_token", ".1f"),
    ("in-place MiB/tok", "read_in_place_mb_per_token", ".0f"), ("promo/step", "promotions_per_step", ".2f"),
    ("GPU ms/step", "gpu_ms_per_step", ".2f"), ("host ms/tok", "host_ms_per_token", ".2f"),
    ("graphs", "graph_replays", "d"))]  # figures: (header, key, format)


def _num(v, fmt: str) -> str:
    return "-" if v is None else format(v, fmt)


def _per_tok(r: dict, key: str) -> str:
    return "-" if r.get(key) is None or not r.get("tokens") else f"{r[key] / r['tokens'] / 1e6:.3f}"


def render(rows: list[dict], columns: list = COLUMNS, n_text: int = TEXT_COLUMNS) -> str:
    """Text columns (the first n_text) left-aligned, figures right-aligned, each as wide as its widest
    cell; a row with an error has its text columns, then the error."""
    cells = [[f(r) for _, _, f in (columns if "error" not in r else columns[:n_text])] for r in rows]
    widths = [max([w, len(h)] + [len(c[i]) for c in cells if i < len(c)]) for i, (h, w, _) in enumerate(columns)]

    def line(texts: list[str]) -> str:
        return "  ".join(t.ljust(w) if i < n_text else t.rjust(w) for i, (t, w) in enumerate(zip(texts, widths)))

    lines = [line([h for h, _, _ in columns])]
    for r, c in zip(rows, cells):
        lines.append(line(c) if "error" not in r else f"{line(c)}  {r['error']}")
    return "\n".join(lines)
