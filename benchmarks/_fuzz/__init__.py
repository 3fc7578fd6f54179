"""Parts of benchmarks/fuzz_protocol.py.

    cases.py    the absurd values, make_case (case I of a seed), the scenes' messages
"""
