"""Building blocks for SIMD kernels written as LLVM vector IR inside numba intrinsics.

numba leaves LLVM's SLP vectorizer off (numba#8705), and its loop vectorizer can do little with
16- and 32-value blocks, so the matmul row kernels (matmul_quant.py, matmul_float.py) emit their
loops directly as LLVM IR: portable vector IR plus, where the CPU has them, the AVX2 and
AVX512-VNNI integer intrinsics. This module holds the pieces they share: vector types and
constants, loads at byte offsets, fused multiply-add, ggml's horizontal sums, exact int8 dot
lanes, the CPU feature checks, and the cache stamp of the kernels' source files.

Legend: `builder` is an llvmlite IRBuilder, `context` numba's target context; "i8*" pointers are
byte addresses, offsets are in bytes unless a name says elements.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from llvmlite import ir
from numba import types
from numba.core import cgutils

I8, I16, I32, I64 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.IntType(64)
F32 = ir.FloatType()


def source_stamp(*files: str) -> str:
    """A digest of these source files. numba's cache checks only the file of the function it
    caches, so a kernel that inlines IR built in other files keeps this in its closure (which
    numba hashes into the cache key): an edit to any of them compiles it again instead of
    loading the old code."""
    h = hashlib.sha256()
    for f in files:
        h.update(Path(f).read_bytes())
    return h.hexdigest()[:16]


# ---- CPU features (codegen looks these up through this module, so tests can switch them off)


def has_avx2(context) -> bool:
    return "+avx2" in getattr(context.codegen(), "_tm_features", "")


def has_avx512_vnni(context) -> bool:
    """512-bit integer dot products (vpdpbusd on zmm): two tokens' blocks per instruction."""
    f = getattr(context.codegen(), "_tm_features", "")
    return all(x in f for x in ("+avx512f", "+avx512bw", "+avx512vnni"))


# ---- types, constants, shuffles


def vec(t, n):
    return ir.VectorType(t, n)


def const_vec(t, vals):
    return ir.Constant(vec(t, len(vals)), list(vals))


def splat_const(t, n, v):
    return const_vec(t, [v] * n)


def c64(v):
    return ir.Constant(I64, v)


def splat(builder, v, n):
    """Scalar value v in all n lanes."""
    one = builder.insert_element(ir.Constant(vec(v.type, n), ir.Undefined), v, ir.Constant(I32, 0))
    return builder.shuffle_vector(one, ir.Constant(vec(v.type, n), ir.Undefined), splat_const(I32, n, 0))


def shuffle(builder, a, b, idx):
    return builder.shuffle_vector(a, b, const_vec(I32, idx))


def concat(builder, a, b):
    return shuffle(builder, a, b, range(2 * a.type.count))


def lane(builder, v, i):
    return builder.extract_element(v, ir.Constant(I32, i))


# ---- memory


def array_of(context, builder, aryty, val):
    return context.make_array(aryty)(context, builder, val)


def byte_ptr(builder, p, off=None):
    """p as i8*, advanced by off bytes (int or i64 value)."""
    q = builder.bitcast(p, I8.as_pointer())
    if off is None or (isinstance(off, int) and off == 0):
        return q
    return builder.gep(q, [c64(off) if isinstance(off, int) else off])


def load(builder, p, off, ty, align=1):
    """Load a value of type ty at byte offset off of pointer p."""
    return builder.load(builder.bitcast(byte_ptr(builder, p, off), ty.as_pointer()), align=align)


def load_f16(builder, p, off):
    """fp16 at byte offset off -> float32 (fpext: exact)."""
    return builder.fpext(builder.bitcast(load(builder, p, off, I16), ir.HalfType()), F32)


def load_f32(builder, p, idx):
    """float32 element idx (i64) of the float array at i8* p."""
    return load(builder, p, builder.mul(idx, c64(4)), F32, 4)


def row_address(context, builder, aryty, ary, idx):
    """Address (i8*) of ary[idx] for leading indices idx (i64 values) of a C-contiguous array: a
    weight row without the array view (and its reference counting) that indexing would make."""
    a = array_of(context, builder, aryty, ary)
    strides = cgutils.unpack_tuple(builder, a.strides, aryty.ndim)
    off = c64(0)
    for i, s in zip(idx, strides):
        off = builder.add(off, builder.mul(i, s))
    return byte_ptr(builder, a.data, off)


def row_pointers(context, builder, aryty, ary, t0, m):
    """Data pointers (i8*) of rows t0 .. t0+m-1 of a C-contiguous 2-D array, and the array."""
    a = array_of(context, builder, aryty, ary)
    s0 = cgutils.unpack_tuple(builder, a.strides, 2)[0]
    return [byte_ptr(builder, a.data, builder.mul(builder.add(t0, c64(i)), s0)) for i in range(m)], a


# ---- arithmetic


def fma(builder, a, b, c):
    """llvm.fma (one rounding, as x86 vfmadd) on float32 scalars or vectors."""
    t = a.type
    name = f"llvm.fma.v{t.count}f32" if isinstance(t, ir.VectorType) else "llvm.fma.f32"
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(t, [t, t, t]), name)
    return builder.call(fn, [a, b, c])


def hsum8f(builder, v):
    """<8 x float> -> float as hsum_float_8 / tinyBLAS hsum: high half + low half, movehl,
    movehdup: ((l0+l4)+(l2+l6)) + ((l1+l5)+(l3+l7))."""
    h = builder.fadd(shuffle(builder, v, v, [4, 5, 6, 7]), shuffle(builder, v, v, [0, 1, 2, 3]))
    return builder.fadd(builder.fadd(lane(builder, h, 0), lane(builder, h, 2)),
                        builder.fadd(lane(builder, h, 1), lane(builder, h, 3)))


def hadd8f(builder, v):
    """<8 x float> -> float as the end of GGML_F32x8_REDUCE (low + high half, two hadd_ps):
    ((l0+l4)+(l1+l5)) + ((l2+l6)+(l3+l7))."""
    h = builder.fadd(shuffle(builder, v, v, [0, 1, 2, 3]), shuffle(builder, v, v, [4, 5, 6, 7]))
    return builder.fadd(builder.fadd(lane(builder, h, 0), lane(builder, h, 1)),
                        builder.fadd(lane(builder, h, 2), lane(builder, h, 3)))


def pairadd(builder, v):
    """<2n x iN> -> <n x iN>: lane j = v[2j] + v[2j+1]."""
    n = v.type.count
    return builder.add(shuffle(builder, v, v, range(0, n, 2)), shuffle(builder, v, v, range(1, n, 2)))


def hsum(builder, v):
    """Integer vector -> the sum of its lanes."""
    fnty = ir.FunctionType(v.type.element, [v.type])
    name = f"llvm.vector.reduce.add.v{v.type.count}i{v.type.element.width}"
    return builder.call(cgutils.get_or_insert_function(builder.module, fnty, name), [v])


def call_llvm(builder, name, ret, *args):
    """Call the LLVM intrinsic `name` (e.g. llvm.x86.avx2.pmadd.wd) returning type ret."""
    fnty = ir.FunctionType(ret, [a.type for a in args])
    return builder.call(cgutils.get_or_insert_function(builder.module, fnty, name), list(args))


def quads(context, builder, w, x, unsigned):
    """<32 x i8> w (unsigned: 0..127 codes, else signed) . <32 x i8> x -> <8 x i32>, lane r =
    sum_{e=4r..4r+3} w_e x_e, exact (as ggml's maddubs + madd). With AVX2 vpmaddubsw (after
    the vpsignb trick for signed w: no pair exceeds 2*128*127, no saturation) + vpmaddwd with
    ones; else portable multiplies and pairwise adds."""
    if has_avx2(context):
        v16 = vec(I16, 16)
        if not unsigned:
            x = call_llvm(builder, "llvm.x86.avx2.psign.b", w.type, x, w)
            w = call_llvm(builder, "llvm.x86.avx2.psign.b", w.type, w, w)
        p16 = call_llvm(builder, "llvm.x86.avx2.pmadd.ub.sw", v16, w, x)
        return call_llvm(builder, "llvm.x86.avx2.pmadd.wd", vec(I32, 8), p16, splat_const(I16, 16, 1))
    ext = builder.zext if unsigned else builder.sext
    p = builder.mul(ext(w, vec(I32, 32)), builder.sext(x, vec(I32, 32)))
    return pairadd(builder, pairadd(builder, p))


# ---- intrinsic typing


def literal_int(arg, allowed):
    """The value of an integer-literal argument type if it is one of `allowed`, else None."""
    if not isinstance(arg, types.IntegerLiteral) or arg.literal_value not in allowed:
        return None
    return arg.literal_value


def c_arrays(*arrs) -> bool:
    return all(isinstance(a, types.Array) and a.layout == "C" for a in arrs)
