"""The one table benchmarks/run.py prints: moed rows, then llama.cpp rows, ratios in the moed rows."""

from __future__ import annotations

COLUMNS = [  # (header, width, row -> text)
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
    lines = ["  ".join(h.rjust(w) if i > 4 else h.ljust(w) for i, (h, w, _) in enumerate(COLUMNS))]
    for r in rows:
        if "error" in r:
            head = "  ".join(f(r).ljust(w) for h, w, f in COLUMNS[:5])
            lines.append(f"{head}  {r['error']}")
            continue
        lines.append("  ".join(f(r).rjust(w) if i > 4 else f(r).ljust(w)
                               for i, (h, w, f) in enumerate(COLUMNS)))
    return "\n".join(lines)
