"""The device's side of hybrid compute beside the host tier (backend/cuda_cpu_share.py): a layer's
missed experts split between the GPU and a CPU worker, and the worker's outputs taken back, with
no host sync in the step.

`post` (one block) decides which pairs the CPU computes: walking the step's pairs in order, an
expert the map serves from a host row (slot_of <= -2) that the CPU also holds (cpu_of >= 0) goes
to the CPU while fewer than n_cpu[0] have; the GPU's map for the step (gpu_map) says -1 for them,
so the expert kernels skip their pairs. The job (x, ids, which pairs) is written to mapped host
memory, then, after a system-wide fence, its tag: the worker's signal. `take` copies the worker's
outputs of the CPU's pairs into the GPU's [P, D], once the stream has waited for the worker's
answer (cuStreamWaitValue32 on mapped memory, capturable in a graph).

Legend: T = rows, A = experts a row, P = T * A pairs, E = experts of a layer, D = hidden size.
"""

from __future__ import annotations

from numba import cuda

from .launch import launch

_THREADS = 256


@cuda.jit
def _post_kernel(ids, slot_of, cpu_of, n_cpu, x, gpu_map, job_ids, job_mask, job_x, job, tag):
    # ids int32 [T, A], slot_of / cpu_of / gpu_map int32 [E], n_cpu int32 [1], x f32 [T, D];
    # job_* mapped host memory: ids [P], mask [P], x [T, D]; job int32 [4]: tag, done, T, A
    t = cuda.threadIdx.x
    E = slot_of.shape[0]
    T, D = x.shape
    for e in range(t, E, cuda.blockDim.x):
        gpu_map[e] = slot_of[e]
    for i in range(t, T * D, cuda.blockDim.x):
        job_x[i // D, i % D] = x[i // D, i % D]
    cuda.threadfence_system()
    cuda.syncthreads()
    if t == 0:
        A = ids.shape[1]
        taken = 0
        for p in range(T * A):
            e = ids[p // A, p % A]
            job_ids[p] = e
            mine = 0
            if 0 <= e < E and slot_of[e] <= -2:
                if gpu_map[e] == -1:  # given to the CPU at an earlier pair
                    mine = 1
                elif cpu_of[e] >= 0 and taken < n_cpu[0]:
                    gpu_map[e] = -1
                    taken += 1
                    mine = 1
            job_mask[p] = mine
        job[1] = 0  # an answer left by a step that failed before its wait is not this job's
        job[2] = T
        job[3] = A
        cuda.threadfence_system()
        job[0] = tag


def post(ids, slot_of, cpu_of, n_cpu, x, gpu_map, job_ids, job_mask, job_x, job, tag: int, stream=0) -> None:
    """The CPU's pairs chosen and the job written for the worker (module doc)."""
    launch(_post_kernel, 1, _THREADS, stream, ids, slot_of, cpu_of, n_cpu, x, gpu_map, job_ids, job_mask, job_x,
           job, tag)


@cuda.jit
def _take_kernel(y, job_mask, job_y):
    # y f32 [P, D]; job_mask int32 [P], job_y f32 [P, D] in mapped host memory: one block a pair
    p = cuda.blockIdx.x
    if job_mask[p]:
        for d in range(cuda.threadIdx.x, y.shape[1], cuda.blockDim.x):
            y[p, d] = job_y[p, d]


def take(y, job_mask, job_y, stream=0) -> None:
    """The CPU's pairs' outputs into y [P, D] (the rest untouched)."""
    if y.shape[0]:
        launch(_take_kernel, y.shape[0], _THREADS, stream, y, job_mask, job_y)
