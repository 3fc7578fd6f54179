"""A spin barrier for numba code that runs one parallel region for a whole step (decode_step.py).

A parallel region costs about 10 us to start at 16 threads (2.6 us at 2; measured on the GPU
machine, docs/benchmarks.md), and a layer needs a dozen synchronization points: as regions they
cost more than a small layer's compute. So the step starts one region of exactly one iteration per
thread (numba's OpenMP layer runs `prange(get_num_threads())` that way: `omp parallel for`, static
schedule) and its threads meet at this barrier between phases, as llama.cpp's threadpool does.

A thread that has waited SPINS_BEFORE_YIELD pauses yields its core at each further turn: on a
machine with fewer free cores than threads (another process, or a second model's step at the same
time) the peer it waits for then gets to run. The barrier gives up instead of hanging: a thread that waits past WAIT_LIMIT cycles of the time
stamp counter (seconds: a thread that never started, or a machine so loaded that its peers are
not scheduled) marks the state failed, and every thread then leaves at its next barrier; the host
runs the step again by the per-op path. `state` is an int64 array of STATE_SIZE zeros: the arrival count, the generation
and the failed flag, each on its own cache line.
"""

from __future__ import annotations

import numba
from llvmlite import binding, ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

binding.initialize_native_asmparser()  # inline assembly (sched_yield) in the object code numba emits

ARRIVED, GENERATION, FAILED = 0, 8, 16  # int64 slots 64 bytes apart
STATE_SIZE = 24
SPINS_BEFORE_YIELD = 1 << 12  # pauses (tens of microseconds): then each wait yields the core
WAIT_LIMIT = 1 << 33  # time stamp counter cycles (about 3 s at 3 GHz): not a stall of a busy machine


def _int64_slot(arr, idx) -> bool:
    """Whether (arr, idx) type an element of an int64 array, the atomics' operand."""
    return isinstance(arr, types.Array) and arr.dtype == types.int64 and isinstance(idx, types.Integer)


def _slot(context, builder, sig, args):
    """A pointer to arr[idx], from an intrinsic's (arr, idx, ...) arguments."""
    ary = context.make_array(sig.args[0])(context, builder, args[0])
    idx = context.cast(builder, args[1], sig.args[1], types.intp)
    return cgutils.get_item_pointer(context, builder, sig.args[0], ary, [idx])


@intrinsic
def atomic_add(typingctx, arr, idx, val):
    """arr[idx] += val atomically (sequentially consistent) -> the value before (int64 arrays)."""
    if not _int64_slot(arr, idx):
        return None

    def codegen(context, builder, sig, args):
        v = context.cast(builder, args[2], sig.args[2], types.int64)
        return builder.atomic_rmw("add", _slot(context, builder, sig, args), v, "seq_cst")

    return types.int64(arr, idx, val), codegen


@intrinsic
def atomic_load(typingctx, arr, idx):
    """arr[idx], read atomically (acquire) from an int64 array."""
    if not _int64_slot(arr, idx):
        return None

    def codegen(context, builder, sig, args):
        return builder.load_atomic(_slot(context, builder, sig, args), "acquire", 8)

    return types.int64(arr, idx), codegen


@intrinsic
def atomic_store(typingctx, arr, idx, val):
    """arr[idx] = val atomically (release) in an int64 array."""
    if not _int64_slot(arr, idx):
        return None

    def codegen(context, builder, sig, args):
        v = context.cast(builder, args[2], sig.args[2], types.int64)
        builder.store_atomic(v, _slot(context, builder, sig, args), "release", 8)
        return context.get_dummy_value()

    return types.none(arr, idx, val), codegen


@intrinsic
def cpu_pause(typingctx):
    """x86 PAUSE: a spinning thread yields the core's pipeline to its sibling and saves power."""
    def codegen(context, builder, sig, args):
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), []), "llvm.x86.sse2.pause")
        builder.call(fn, [])
        return context.get_dummy_value()

    return types.none(), codegen


@intrinsic
def sched_yield(typingctx):
    """sched_yield(2), as an x86-64 Linux system call (24) in inline assembly: a waiting thread
    gives its core away (a function pointer from ctypes would keep numba from caching the step)."""
    def codegen(context, builder, sig, args):
        i64 = ir.IntType(64)
        asm = ir.InlineAsm(ir.FunctionType(i64, [i64]), "syscall", "={rax},{rax},~{rcx},~{r11},~{memory}",
                           side_effect=True)
        builder.call(asm, [ir.Constant(i64, 24)])
        return context.get_dummy_value()

    return types.none(), codegen


@intrinsic
def cycles(typingctx):
    """The time stamp counter (llvm.readcyclecounter: RDTSC)."""
    def codegen(context, builder, sig, args):
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.IntType(64), []),
                                            "llvm.readcyclecounter")
        return builder.call(fn, [])

    return types.int64(), codegen


@numba.njit(cache=True)
def barrier(state, nth):
    """Wait until all nth threads arrive -> True; False if the state failed (every thread must
    then leave its work)."""
    if atomic_load(state, FAILED):
        return False
    gen = atomic_load(state, GENERATION)
    if atomic_add(state, ARRIVED, 1) == nth - 1:  # the last to arrive releases the others
        atomic_store(state, ARRIVED, 0)
        atomic_add(state, GENERATION, 1)
        return True
    spins = 0
    t0 = cycles()
    while atomic_load(state, GENERATION) == gen:
        cpu_pause()
        spins += 1
        if spins > SPINS_BEFORE_YIELD:  # a peer is not running (more threads than free cores): let it
            sched_yield()
        if spins & 1023 == 0:
            if atomic_load(state, FAILED):
                return False
            if cycles() - t0 > WAIT_LIMIT:
                atomic_store(state, FAILED, 1)
                return False
    return True


@numba.njit(cache=True, parallel=True)
def _touch(a):
    for i in numba.prange(a.shape[0]):
        a[i] = i


def one_thread_per_iteration() -> bool:
    """Whether numba's threading layer runs `prange(get_num_threads())` one iteration per thread,
    all at once: OpenMP's static schedule does; the workqueue and TBB layers may run two iterations
    on one thread in turn, which would meet at a barrier never."""
    try:
        layer = numba.threading_layer()
    except ValueError:  # no parallel region has run yet: the layer is chosen at the first
        import numpy as np

        _touch(np.zeros(2, np.int64))
        layer = numba.threading_layer()
    return layer == "omp"
