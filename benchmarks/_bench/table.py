"""The one table benchmarks/run.py prints: moed rows, then llama.cpp rows, ratios in the moed rows."""

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


def _num(v, fmt: str) -> str:
    return "-" if v is None else format(v, fmt)


def _per_tok(r: dict, key: str) -> str:
    return "-" if r.get(key) is None or not r.get("tokens") else f"{r[key] / r['tokens'] / 1e6:.3f}"


def render(rows: list[dict]) -> str:
    """Text columns left-aligned, figures right-aligned, each as wide as its widest cell."""
    cells = [[f(r) for _, _, f in (COLUMNS if "error" not in r else COLUMNS[:5])] for r in rows]
    widths = [max([w, len(h)] + [len(c[i]) for c in cells if i < len(c)]) for i, (h, w, _) in enumerate(COLUMNS)]

    def line(texts: list[str]) -> str:
        return "  ".join(t.ljust(w) if i < 5 else t.rjust(w) for i, (t, w) in enumerate(zip(texts, widths)))

    lines = [line([h for h, _, _ in COLUMNS])]
    for r, c in zip(rows, cells):
        lines.append(line(c) if "error" not in r else f"{line(c)}  {r['error']}")
    return "\n".join(lines)
