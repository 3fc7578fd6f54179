"""llama.cpp's `llama-batched-bench`, run and parsed, for benchmarks/serving.py (llama-bench itself:
gpu.llama_bench).

    batched_bench(binary, model, pp, tg, batches, threads) -> {"argv", "rows": {B: row}} or {"error": ...}
    parse_batched(text) -> {B: row}   its table; row: pp, tg, b, n_kv, t_pp_s, pp_tok_s, t_tg_s, tg_tok_s, t_s, tok_s

llama-batched-bench prints one markdown row per (PP, TG, B), `S_TG t/s` being B*TG / the decode time
(tools/batched-bench/batched-bench.cpp). It skips a B whose B*(PP+TG) exceeds its context silently,
so the context is sized to the largest B and a B missing from the table is an error.
"""

from __future__ import annotations

import subprocess

TIMEOUT_S = 3600
# header -> key; the table's order: PP TG B N_KV T_PP S_PP T_TG S_TG T S
COLUMNS = {"PP": "pp", "TG": "tg", "B": "b", "N_KV": "n_kv", "T_PP s": "t_pp_s", "S_PP t/s": "pp_tok_s",
           "T_TG s": "t_tg_s", "S_TG t/s": "tg_tok_s", "T s": "t_s", "S t/s": "tok_s"}


def parse_batched(text: str) -> dict[int, dict]:
    """The rows of llama-batched-bench's table in `text` (its stdout and stderr), by B."""
    header, rows = None, {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if header is None:
            if "S_TG t/s" in cells:
                header = cells
            continue
        if len(cells) != len(header) or not all(c.replace(".", "", 1).isdigit() for c in cells):
            continue  # the |---| rule, the log around the table
        row = {COLUMNS.get(h, h): float(c) for h, c in zip(header, cells)}
        for key in ("pp", "tg", "b", "n_kv"):
            row[key] = int(row[key])
        rows[row["b"]] = row
    return rows


def batched_bench(binary: str, model: str, pp: int, tg: int, batches: list[int], threads: int,
                  extra: list[str] = ()) -> dict:
    """{B: row} for each B of `batches` (prompt of pp tokens per sequence, not shared; tg generated
    each), all layers on the GPU where the build has one (-ngl 99); a failure is {"error": ...}."""
    ctx = max(batches) * (pp + tg) + 64
    argv = [binary, "-m", model, "-c", str(ctx), "-b", "2048", "-ub", "512", "-ngl", "99", "-t", str(threads),
            "-npp", str(pp), "-ntg", str(tg), "-npl", ",".join(map(str, batches)), *extra]
    try:
        p = subprocess.run(argv, capture_output=True, text=True, timeout=TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as e:
        return {"error": f"llama-batched-bench failed: {e}"}
    if p.returncode:
        lines = [ln for ln in p.stderr.strip().splitlines() if ln.strip()]
        why = f": {lines[-1]}" if lines else ""
        return {"error": f"llama-batched-bench failed (exit status {p.returncode}){why}"}
    rows = parse_batched(p.stdout + "\n" + p.stderr)
    missing = [b for b in batches if b not in rows]
    if missing:
        return {"error": f"llama-batched-bench printed no row for B={missing[0]} (context {ctx})"}
    return {"argv": argv[1:], "rows": {b: rows[b] for b in batches}}
