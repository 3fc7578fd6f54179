"""What ptxas gives the decode step's fused kernels, the GEMVs, the tiled matmuls and the router:
registers, local memory (stack frame), spills and shared memory per kernel, compiled for a GPU
target without a GPU.

    python benchmarks/kernel_resources.py [--cc 9.0] [--only attention,flash,rope,gdn,norm,mmvq,mmq,router]
                                          [--order NAME] [--launch-bounds THREADS,BLOCKS]

--order NAME also prints, for each kernel whose name contains NAME, the order ptxas issues its
global loads (L) and int8 dot products (d) in (cuobjdump -sass; the toolkit's, or the
nvidia-cuda-cuobjdump wheel's): "LLLLdddd" is loads in flight together, "LdLd" each waited for.
The SASS column counts the kernel's instructions: a decode step's small kernels run one pass of
straight-line code, so it is their issue time (their warps are too few to hide it).
--launch-bounds compiles with numba's launch_bounds (max threads, min blocks an SM): ptxas then
budgets registers for that occupancy, which decides whether it keeps loads hoisted.

It needs NVVM and ptxas (a CUDA toolkit: CUDA_HOME, or /usr/local/cuda) and NVRTC (numba-cuda
loads it; on a machine without one, `pip download nvidia-cuda-nvrtc` and put its lib/ folder on
LD_LIBRARY_PATH). Nothing runs on a device: numba types and compiles each kernel for --cc, as the
GPU would, so this also catches typing errors that the CUDA simulator (which runs kernels as
Python) cannot. A non-zero stack frame is an array numba put in local memory: an array indexed in
a loop the compiler did not unroll (the attention keys at head size 128 and 256 were, until the
key words went into groups of 32).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

os.environ["NUMBA_ENABLE_CUDASIM"] = "0"  # the real kernels (their inline PTX, not the simulator twins)

import numpy as np  # noqa: E402
from numba import cuda, types  # noqa: E402
from numba.np.numpy_support import from_dtype  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def arr(dtype, ndim: int):
    return types.Array(from_dtype(np.dtype(dtype)), ndim, "C")


F32, I32, I64, BOOL = types.float32, types.int32, types.int64, types.boolean
f32, i32, f16 = (lambda n: arr(np.float32, n)), (lambda n: arr(np.int32, n)), (lambda n: arr(np.float16, n))


def cases(only: set[str]):
    """(name, python function, argument types) of each kernel to report."""
    from daemon.kernels import quants as Q
    from daemon.kernels.cuda import attention as attn, norm, rope

    if not only or "attention" in only:
        part = (f32(3), f16(5), f16(5), i32(1), i32(1), F32, I32, f32(3), f32(3), f32(4), f32(1), BOOL, f32(3), i32(1))
        # (G, heads a block, rows a tile, head size, fused): decode grids take few heads a block
        for G, hb, rt, dh, fuse in [(8, 1, 1, 64, False), (8, 1, 1, 64, True), (8, 1, 1, 128, True), (8, 2, 1, 128, True),
                                    (8, 8, 1, 128, True), (8, 8, 4, 128, True), (8, 1, 1, 256, True),
                                    (8, 8, 2, 256, True)]:
            yield (f"attention chunk G{G} heads{hb} rows{rt} Dh{dh}{' +combine' if fuse else ''}",
                   attn._make_partial(G, hb, rt, dh, fuse, dh).py_func, part)
        yield ("attention combine", attn._attn_combine.py_func,
               (f32(3), f32(3), f32(4), i32(1), I32, f32(1), BOOL, f32(3)))
    if not only or "flash" in only:
        from daemon.kernels.cuda import flash

        sig = (f32(3), f16(5), f16(5), i32(1), i32(1), i32(2), F32, I32, f32(1), BOOL, f32(3))
        for G, dh in [(8, 64), (8, 128), (4, 128), (3, 64)]:
            yield (f"flash attention G{G} Dh{dh} {flash.WARPS} warps", flash._make(G, dh, dh, flash.WARPS).py_func, sig)
    if not only or "rope" in only:
        yield ("q/k norm + RoPE + KV append", rope._norm_rope_qk.py_func,
               (f32(3), f32(3), f32(1), f32(1), BOOL, F32, f32(3), BOOL, f32(3), i32(1), i32(1), f16(5), f16(5), BOOL))
    if not only or "gdn" in only:
        from daemon.kernels.cuda import gdn

        dn = (f32(2), f32(2), f32(4), f32(2), f32(2), f32(1), f32(1), f32(5), I32, i32(1), I32, BOOL, F32, F32, F32,
              f32(1), f32(2), F32, I32, f32(3), f32(2), i32(2))
        yield ("delta-net decode: conv + rule + gated norm (Dk 128)", gdn._decode_kernel(128, 4).py_func, dn)
        yield ("delta-net rule (Dk 128)", gdn._gdn_kernel(128).py_func,
               (f32(2), f32(2), f32(2), f32(1), f32(1), f32(5), I32, i32(1), i32(1), BOOL, I64, I32, BOOL, F32, F32,
                F32, f32(3)))
        yield ("delta-net conv (Kc 4)", gdn._conv_kernel(4).py_func,
               (f32(2), f32(2), f32(4), I32, i32(1), i32(1), BOOL, f32(2)))
        yield ("delta-net conv state (Kc 4)", gdn._conv_state_kernel(4).py_func,
               (f32(2), f32(4), I32, i32(1), i32(1), BOOL))
        from daemon.kernels.cuda import gdn_chunked as gc

        ch, rows, nt = gc.CHUNK, gc._ROWS, gc._CARRY_THREADS
        yield (f"chunked delta-net intra (Dk 128, {ch} rows)",
               gc._intra_kernel(128, 128, ch, gc._INTRA_THREADS).py_func,
               (f32(2), f32(2), f32(2), f32(1), f32(1), i32(1), BOOL, I64, I64, I64, BOOL, F32, F32, f32(4), f32(4),
                f32(4), f32(4), f32(4), f32(2)))
        yield (f"chunked delta-net carry (Dk 128, {ch} rows, {rows} value rows)",
               gc._carry_kernel(128, ch, rows, nt).py_func,
               (f32(4), f32(4), f32(4), f32(4), f32(4), f32(2), f32(5), I64, i32(1), i32(1), BOOL, I64, F32, f32(3)))
        yield ("gated RMSNorm", gdn._gated_rms_norm.py_func, (f32(3), f32(1), f32(2), F32, f32(2)))
    if not only or "mmvq" in only:  # the GEMVs: dense (1, 4, 16 columns) and a layer's experts with the GLU
        from daemon.kernels.cuda import mmvq
        from daemon.kernels.cuda.vecdot import FLOAT_ACT

        for qt in (Q.Q8_0, Q.MXFP4, Q.Q4_K, Q.F16):
            acts = (f32(2), f32(2)) if qt in FLOAT_ACT else (arr(np.int8, 2), f32(3))
            sig = (arr(np.uint8, 3),) * 4 + acts + (i32(2), i32(1), i32(1), i32(1), I64, I64, f32(2), f32(2), f32(3),
                                                    I64, I64, I64, I64, F32, F32)
            for cols, ids, glu, grouped in ((1, False, 0, False), (16, False, 0, False), (1, True, mmvq.GLU_SWIGLU, False),
                                            (2, True, mmvq.GLU_SWIGLU, True), (4, True, mmvq.GLU_SWIGLU, True),
                                            (4, True, 0, True)):
                kern = mmvq._build(qt, cols, 16, 4, ids, False, glu, 2, grouped=grouped)
                yield kern.__name__, kern.py_func, sig
    if not only or "mmq" in only:  # the prefill's tiled matmuls
        from daemon.kernels.cuda import mmq, mmq_mma

        sig = (arr(np.uint8, 3), arr(np.uint8, 3), arr(np.int8, 2), f32(3), i32(2), i32(1), i32(1), i32(1), I64, I64,
               f32(2), f32(3), I64, I64, I64, I64)
        for qt in (Q.Q8_0, Q.Q4_K, Q.Q6_K, Q.MXFP4):
            for ids in (False, True):
                yield (f"mmq dp4a {Q.type_name(qt)} {'experts' if ids else 'dense'} 64x64",
                       mmq._build(qt, 64, 64, ids, False)[0].py_func, sig)
                for shape in (mmq.MMA_WIDE, mmq.MMA_NARROW) if ids else (mmq.MMA_WIDE,):
                    yield (f"mmq mma {Q.type_name(qt)} {'experts' if ids else 'dense'} {shape.rows}x{shape.tokens}",
                           mmq_mma.build(qt, shape, ids, False)[0].py_func, sig)
    if not only or "router" in only:
        from daemon.kernels.cuda import router

        sig = (arr(np.uint8, 2), f32(2), I64, I64, f32(1), BOOL, BOOL, BOOL, F32, BOOL, f32(2), i32(2), f32(2), i32(1))
        for E in (32, 128, 512):
            for nc in (1, router.FUSED_ROWS):
                yield (f"fused router, F32, {E} experts, {nc} rows",
                       router._make_fused(Q.F32, router._per_lane(E), router._warps(E), 1, True, nc).py_func, sig)
        yield ("router product tiles (no routing), F32", router._make_fused(Q.F32, 16, router._warps(512),
                                                                              router._TILED_EXPERTS, False).py_func, sig)
    if not only or "norm" in only:
        sig = (f32(2), f32(2), f32(1), BOOL, f32(1), F32, f32(2), f32(2), arr(np.int8, 2), f32(3))
        for add, quant in ((False, False), (False, True), (True, False), (True, True)):
            for held in (2, 8):
                yield (f"RMSNorm{' + residual add' if add else ''}{' + q8_1' if quant else ''}, {held} values a thread",
                       norm._make(add, quant, held).py_func, sig)


def ptxas_report(ptx: str, arch: str, order: bool = False) -> dict:
    with tempfile.TemporaryDirectory() as d:
        src, cubin = Path(d, "k.ptx"), Path(d, "k.cubin")
        src.write_text(ptx)
        r = subprocess.run(["ptxas", f"-arch={arch}", "-v", str(src), "-o", str(cubin)], capture_output=True, text=True)
        if r.returncode:
            raise RuntimeError(r.stderr.strip())
        sass = subprocess.run(["cuobjdump", "-sass", str(cubin)], capture_output=True, text=True).stdout
    text = r.stderr

    def num(pattern):
        m = re.search(pattern, text)
        return int(m.group(1)) if m else 0

    # an instruction's line starts with its address, /*0a70*/ (its encoding follows on a line of its own)
    ops = [line.split()[1] for line in sass.splitlines() if re.match(r"\s*/\*[0-9a-f]{4,}\*/", line)]
    return {"order": "".join("L" if o.startswith("LDG") else "d" for o in ops if o.startswith(("LDG", "IDP")))
            if order else "", "instructions": len(ops),
            "registers": num(r"Used (\d+) registers"), "stack": num(r"(\d+) bytes stack frame"),
            "spill_st": num(r"(\d+) bytes spill stores"), "spill_ld": num(r"(\d+) bytes spill loads"),
            "smem": num(r"(\d+) bytes smem")}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cc", default="9.0", help="compute capability to compile for (9.0: H100, H200)")
    ap.add_argument("--only", default="", help="comma-separated groups: attention, flash, rope, gdn, norm, mmvq, mmq, router")
    ap.add_argument("--order", default="", help="print the load / dot issue order of kernels whose name has this")
    ap.add_argument("--launch-bounds", default="", help="THREADS,BLOCKS: compile with numba's launch_bounds")
    args = ap.parse_args()
    bounds = tuple(int(v) for v in args.launch_bounds.split(",")) if args.launch_bounds else None
    cc = tuple(int(p) for p in args.cc.split("."))
    # device functions compile for the current device's capability: with no GPU, name it
    import numba.cuda.dispatcher as dispatcher

    dispatcher.get_current_device = lambda: SimpleNamespace(compute_capability=cc)
    arch = f"sm_{cc[0]}{cc[1]}"
    print(f"{'kernel':<52} {'regs':>5} {'stack B':>8} {'spill B':>8} {'smem B':>7} {'SASS':>6}   ({arch}, ptxas -v; "
          "SASS: instructions in the kernel, 0 without cuobjdump)")
    failed = 0
    for name, fn, sig in cases({s for s in args.only.split(",") if s}):
        try:
            ptx, _ = cuda.compile_ptx(fn, sig, cc=cc, launch_bounds=bounds)
            r = ptxas_report(ptx, arch, bool(args.order) and args.order in name)
        except Exception as e:  # noqa: BLE001 - report every kernel, then fail
            print(f"{name:<52} FAILED: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
            failed += 1
            continue
        print(f"{name:<52} {r['registers']:>5} {r['stack']:>8} {r['spill_st'] + r['spill_ld']:>8} {r['smem']:>7} "
              f"{r['instructions']:>6}")
        if r["order"]:
            print(f"    issue order ({len(r['order'])}): {r['order'][:240]}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
