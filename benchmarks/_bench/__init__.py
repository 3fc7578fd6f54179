"""Helpers of benchmarks/run.py (one benchmark command, issue 11 item 3).

    disk.py      the file's O_DIRECT sequential read rate (`dd`-style), dropping its cached pages
    children.py  one configuration in a child process: moed or llama.cpp, prefill and decode timed
    table.py     the printed table and the moed/llama.cpp ratios
"""
