"""Hybrid compute beside the host tier (issue 27, item 4): a CPU worker computes some of each MoE
layer's missed experts from its own copy in host RAM (the file's layout, which the CPU kernels
read), while the GPU reads the rest over PCIe, so DRAM bandwidth adds to PCIe bandwidth.

The step stays one CUDA graph with no host point: a layer's split is decided on the device and
the worker answers through mapped host memory (kernels/cuda/cpu_share.py):
1. `post` (after the router and its counts): the first n missed experts the CPU holds go to the
   CPU; the job (x, ids, which pairs) and its tag are written to mapped memory;
2. the GPU computes its share (the CPU's pairs skipped: the step's map says -1 for them);
3. the stream waits for the worker's answer (cuStreamWaitValue32 on `done`, captured with the
   step; the simulator, which has no driver, serves the job inline there), and `take` copies the
   CPU's outputs into the GPU's [P, D] before the mix.
The worker thread looks for jobs while a step is in flight (begin_step to end_step): spinning
with time.sleep(0), which lets the GIL go, for IDLE_S after its last job, then every millisecond
(a step may spend seconds compiling kernels before it posts); between steps it sleeps on an event. A job that fails still answers (its outputs zero) and the error
goes to the step's caller after the step, so the GPU never waits forever.

n is tuned on the measured step time (experts/offload.py SplitTuner): 0 turns hybrid off, and a
step without the share is another graph (`variant`), with no post, wait or take. Only steps of
at most `max_rows` rows split; the CPU's results are within tolerance of the GPU's, not
bit-identical (hybrid off keeps the host tier's bits).

Legend: E = experts of a layer, C = experts the CPU holds a layer, N = output rows, rb = raw row
bytes, T = rows, A = experts a row, P = T * A pairs, D = hidden size.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import replace

import numba
import numpy as np
from numba import cuda

from ..errors import DeviceError
from ..experts.offload import SplitTuner
from ..kernels.cuda import cpu_share as share_k
from ..kernels.cuda.device import upload
from ..kernels.cuda.launch import SIMULATOR
from ..model.weights import TensorSource
from ..storage.experts import ExpertBatch, expert_biases
from .base import pairs_on_cpu
from .cpu import CPUBackend

log = logging.getLogger("moed.device")
IDLE_S = 0.05  # the worker spins this long after its last job (or the step's start), then polls


def _mapped(shape, dtype):
    """Page-locked host memory mapped into the device -> (host view, device view)."""
    m = cuda.mapped_array(shape, dtype)
    host = np.asarray(m)
    host[...] = 0
    if SIMULATOR:
        return host, m
    from numba.cuda.cudadrv.devicearray import DeviceNDArray

    return host, DeviceNDArray(host.shape, host.strides, host.dtype, gpu_data=m.gpu_data)


class CPUShare:
    """The CPU's copy of C experts a layer and the worker that computes them (module doc)."""

    def __init__(self, gguf, layouts: dict, held: dict[int, list[int]], sources: dict, numerics: str, stream,
                 n_embd: int, n_used: int, max_rows: int = 16, fixed: int | None = None):
        self.cpu = CPUBackend(numerics)
        self.stream = stream
        self.max_rows = max_rows
        self.nbytes = 0
        src = TensorSource(gguf)
        self._batches: dict[int, ExpertBatch] = {}
        self._layouts = layouts
        self._cpu_of = {}  # il -> device int32 [E]: the expert's row in the CPU's copy, -1 none
        self._gpu_map = {}  # il -> device int32 [E]: the step's map for the GPU's share
        self._tags = {il: i + 1 for i, il in enumerate(held)}
        self._layer_of = {i + 1: il for i, il in enumerate(held)}
        self._glu: dict[int, tuple] = {}
        for il, experts in held.items():
            lay = layouts[il]
            stacks = []
            for place in sources[il]:  # gate, up, down: read straight into the stack [C, N, rb]
                stack = np.empty((len(experts), place.n, place.rb), np.uint8)
                for i, e in enumerate(experts):
                    gguf.read_into(place.offset + e * place.n * place.rb, stack[i], f"tensor {place.name!r}")
                stacks.append(stack)
                self.nbytes += stack.nbytes
            rows = {e: i for i, e in enumerate(experts)}
            self._batches[il] = ExpertBatch(*stacks, rows, *expert_biases(src, il, lay.n_embd, lay.n_ff, lay.n_expert))
            cpu_of = np.full(lay.n_expert, -1, np.int32)
            cpu_of[experts] = np.arange(len(experts), dtype=np.int32)
            self._cpu_of[il] = upload(cpu_of)
            self._gpu_map[il] = cuda.device_array(lay.n_expert, np.int32)
        P = max_rows * n_used
        self._job, self._job_d = _mapped(4, np.int32)  # tag, done, T, A
        self._ids, self._ids_d = _mapped(P, np.int32)
        self._mask, self._mask_d = _mapped(P, np.int32)
        self._x, self._x_d = _mapped((max_rows, n_embd), np.float32)
        self._y, self._y_d = _mapped((P, n_embd), np.float32)
        self._n_host = np.zeros(1, np.int32)
        self._n = upload(self._n_host)
        self.tuner = SplitTuner(n_used, fixed=fixed)
        self._set_n(self.tuner.n)
        self.error: BaseException | None = None
        self.jobs = self.pairs = 0
        self.cpu_s = 0.0
        self._closed = False
        self._active = threading.Event()
        self._last_job = time.monotonic()
        self._thread = None
        if not SIMULATOR:
            self._thread = threading.Thread(target=self._loop, name="moed-cpu-share", daemon=True)
            self._thread.start()

    @property
    def variant(self):
        """What a step's graph depends on: whether it splits."""
        return "cpu" if self.tuner.n > 0 else None

    def raise_failure(self) -> None:
        """After a step (synchronized): DeviceError if a job of it failed (its CPU pairs were zeros)."""
        if self.error is not None:
            err, self.error = self.error, None
            raise DeviceError(f"the CPU's share of the experts failed: {err}") from err

    def begin_step(self, rows: int, last_step_s: float | None) -> None:
        """Before a step: tune n on the last step's time (steps of one row), wake the worker."""
        self.error = None  # a failure after the last check belongs to a step already failed
        if last_step_s is not None and rows == 1:
            n = self.tuner.observe(last_step_s)
            if n != self._n_host[0]:
                self._set_n(n)
        if self._thread is not None and not self._thread.is_alive():
            raise DeviceError("the CPU worker of hybrid compute has stopped")
        self._last_job = time.monotonic()
        self._active.set()

    def _set_n(self, n: int) -> None:
        self._n_host[0] = n
        self._n.copy_to_device(self._n_host, stream=self.stream)

    def split(self, layer: int, x, plan, glu: tuple):
        """The GPU's plan (the CPU's pairs skipped) and finish(y): y [P, D] gets the CPU's pairs.
        None when this step does not split (hybrid off, too many rows, a layer the CPU has none of)."""
        if self.tuner.n <= 0 or plan.T > self.max_rows or layer not in self._tags:
            return None
        self._glu[layer] = glu
        gpu_map = self._gpu_map[layer]
        share_k.post(plan.ids, plan.slot_of, self._cpu_of[layer], self._n, x, gpu_map, self._ids_d, self._mask_d,
                     self._x_d, self._job_d, self._tags[layer], self.stream)
        def finish(y):
            self._wait()
            share_k.take(y, self._mask_d, self._y_d, self.stream)

        return replace(plan, slot_of=gpu_map), finish

    def _wait(self) -> None:
        """The stream waits for the worker's answer (the simulator: the job served here)."""
        if SIMULATOR:
            self._serve_posted()
            return
        from cuda.bindings import driver as drv

        h = self.stream.handle
        handle = h.value if hasattr(h, "value") else int(h)
        done = self._job_d.device_ctypes_pointer.value + 4
        err, = drv.cuStreamWaitValue32(handle, done, 1, drv.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_EQ.value)
        if err != drv.CUresult.CUDA_SUCCESS:
            raise DeviceError(f"cuStreamWaitValue32 failed: {err}")

    def end_step(self) -> None:
        """After a step (synchronized: every job of it answered): the worker may sleep."""
        self._active.clear()

    def _loop(self) -> None:
        # numba's thread count is per calling thread: leave two cores to the serving thread and
        # this one's polling, else the kernels' threads and they take turns on the cores
        numba.set_num_threads(max(1, numba.config.NUMBA_NUM_THREADS - 2))
        job = self._job
        while not self._closed:
            if not self._active.wait(0.5):  # no step in flight
                continue
            if job[0]:
                self._serve_posted()
            else:  # a step in flight: spin (letting the GIL go), then look every millisecond
                time.sleep(0 if time.monotonic() - self._last_job < IDLE_S else 0.001)

    def _serve_posted(self) -> None:
        job = self._job
        tag = int(job[0])
        if not tag:
            return
        job[0] = 0
        try:
            self._serve(self._layer_of[tag], int(job[2]), int(job[3]))
        except BaseException as e:  # answered anyway: the GPU must not wait forever
            self._y[...] = 0
            if self.error is None:
                self.error = e
        finally:
            self._last_job = time.monotonic()
            job[1] = 1

    def _serve(self, layer: int, T: int, A: int) -> None:
        """The CPU's pairs of a posted layer: y rows of the pairs its mask marks."""
        t0 = time.perf_counter()
        P = T * A
        pairs = np.flatnonzero(self._mask[:P])
        if pairs.size:
            self._y[pairs] = pairs_on_cpu(self.cpu, self._x[:T], self._ids[:P], pairs, A, self._batches[layer],
                                          self._layouts[layer], *self._glu[layer])
        self.jobs += 1
        self.pairs += int(pairs.size)
        self.cpu_s += time.perf_counter() - t0

    def stats(self) -> dict:
        return {"cpu_experts_bytes": self.nbytes, "cpu_n": int(self.tuner.n), "cpu_fixed": self.tuner.fixed,
                "cpu_jobs": self.jobs, "cpu_pairs": self.pairs, "cpu_ms": round(self.cpu_s * 1e3, 1),
                "cpu_step_ms": {int(n): round(t * 1e3, 3) for n, t in sorted(self.tuner.times.items())}}

    def reset_stats(self) -> None:
        self.jobs = self.pairs = 0
        self.cpu_s = 0.0

    def close(self) -> None:
        self._closed = True
        self._active.set()
        if self._thread is not None:
            self._thread.join(timeout=2.0)
