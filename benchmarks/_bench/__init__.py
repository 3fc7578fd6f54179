"""Helpers of benchmarks/run.py (one benchmark command, issue 11 item 3) and of other benchmarks.

    disk.py      the file's O_DIRECT sequential read rate (`dd`-style), dropping its cached pages
    children.py  one configuration in a child process: moed or llama.cpp, prefill and decode timed
    gpu.py       --device cuda: moed's VRAM expert cache, llama-bench at the same VRAM for experts
    table.py     the printed tables and the moed/llama.cpp ratios
    daemon.py    `moed serve` in a subprocess (stop_list.py, daemon_overhead.py)
"""
