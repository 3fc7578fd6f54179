"""The weight types the CPU matmuls support, in one table.

Each type belongs to a kernel family: "float" (plain F32/F16/BF16 rows: matmul_float.py),
"block32" (32-value blocks: matmul_quant.py) or "kquant" (256-value super-blocks:
matmul_quant.py). Its vec_dot_type is what llama.cpp converts the activations to before the
dot products (ggml-cpu.c type_traits_cpu; matmul_activations.py). Kernels are compiled per
type, with the type id as a compile-time constant (`kind` in the row intrinsics).
"""

from __future__ import annotations

from dataclasses import dataclass

from daemon.kernels import quants as Q

FLOAT, BLOCK32, KQUANT = "float", "block32", "kquant"


@dataclass(frozen=True)
class WeightType:
    ggml_type: int
    family: str  # FLOAT, BLOCK32 or KQUANT
    vec_dot_type: int  # the activations' type for this weight type's dot products
    block_bytes: int  # bytes of one block (of one value for the float types)


def _entry(ggml_type: int, family: str, vec_dot_type: int) -> WeightType:
    return WeightType(ggml_type, family, vec_dot_type, Q.block_size(ggml_type)[1])


TYPES: dict[int, WeightType] = {w.ggml_type: w for w in (
    _entry(Q.F32, FLOAT, Q.F32),
    _entry(Q.F16, FLOAT, Q.F16),
    _entry(Q.BF16, FLOAT, Q.BF16),
    _entry(Q.Q4_0, BLOCK32, Q.Q8_0),
    _entry(Q.Q5_0, BLOCK32, Q.Q8_0),
    _entry(Q.Q8_0, BLOCK32, Q.Q8_0),
    _entry(Q.MXFP4, BLOCK32, Q.Q8_0),
    _entry(Q.Q4_1, BLOCK32, Q.Q8_1),
    _entry(Q.Q5_1, BLOCK32, Q.Q8_1),
    _entry(Q.Q4_K, KQUANT, Q.Q8_K),
    _entry(Q.Q5_K, KQUANT, Q.Q8_K),
    _entry(Q.Q6_K, KQUANT, Q.Q8_K),
)}
assert set(TYPES) == Q.SUPPORTED_TYPES

VEC_DOT_TYPE: dict[int, int] = {t: w.vec_dot_type for t, w in TYPES.items()}


def of_family(family: str) -> tuple[int, ...]:
    """The type ids of one family (the literal `kind` values its row intrinsics accept)."""
    return tuple(t for t, w in TYPES.items() if w.family == family)
