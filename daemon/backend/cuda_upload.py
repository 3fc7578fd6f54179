"""Loading a GGUF file's matrices into VRAM fast: large reads into page-locked buffers, one
async copy each, the repack on the GPU, all three overlapped.

The old path read each tensor into fresh host memory, repacked it there with numpy and copied it
from pageable memory (8 GB/s against 54 GB/s pinned, DESIGN.md): 46-60 s for a 32 GB file in the
page cache. Here the matrices to load (`Target`s, in file order) are cut into `Piece`s: one file
range of up to `chunk` bytes each, a run of whole rows of one large tensor or several small
tensors read together. Reader threads read pieces ahead into a ring of page-locked buffers
(os.preadv releases the GIL, so they read in parallel); the loading thread copies each buffer
with one cuMemcpyHtoDAsync into one of two device staging buffers on a copy stream, and the
repack stream repacks its rows out of staging into their final place (layout.repack_device: the
same bytes the host `repack` makes). Events order the reuse of each buffer: a host buffer is refilled once its
copy has run, a staging buffer overwritten once its repack has run; nothing waits per tensor.

Under numba's simulator copies are synchronous and events are done at once, and the repack runs
on the host (`REPACK_ON_DEVICE` off): the simulator runs each device thread in Python, a model's
weights would take minutes. The tests turn it on to check the device path there, byte for byte.

Legend: C = chunk bytes, R = rows of a target, RB = raw row bytes, stride = repacked row bytes.
"""

from __future__ import annotations

import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
from numba import cuda

from ..kernels.cuda.device import SIM, zero_fill
from ..kernels.cuda.layout import repack, repack_device, repacked_stride
from ..kernels.quants import block_size
from .cuda_transfer import Event, Transfers, pinned_empty

CHUNK = 64 << 20  # bytes a piece reads at most (unless one row is longer)
BUFFERS = 6  # page-locked host buffers in the ring (reads in flight, and the copy)
STAGING = 2  # device staging buffers: a copy lands in one while the other is repacked (VRAM the load adds)
READERS = 4  # threads reading the file
GAP = 1 << 20  # small tensors this close in the file share a read (alignment padding, vectors between)
REPACK_ON_DEVICE = not SIM  # else layout.repack on the host (the same bytes), then a copy


@dataclass(eq=False)
class Target:
    """One matrix to place: R raw rows at file `offset` -> dst (device uint8 [R, stride]) repacked."""
    name: str
    offset: int  # absolute file offset of row 0
    rows: int  # R
    rb: int  # RB
    ggml_type: int
    dst: object  # device uint8 [R, stride]

    @property
    def nbytes(self) -> int:
        return self.rows * self.rb


@dataclass(eq=False)
class Piece:
    """One read of file bytes [offset, offset + nbytes); parts: (target, row0, rows, at), rows
    row0..row0+rows-1 of target lying at byte `at` of the piece."""
    offset: int
    nbytes: int
    parts: list = field(default_factory=list)


def plan(targets: list[Target], chunk: int = CHUNK, gap: int = GAP) -> list[Piece]:
    """The targets' rows as pieces in file order: a target of more than `chunk` bytes as runs of
    whole rows of up to `chunk` bytes (one row at least), smaller ones gathered while the piece
    stays within `chunk` bytes and the next starts at most `gap` bytes past the last."""
    pieces: list[Piece] = []
    cur: Piece | None = None
    for t in sorted(targets, key=lambda t: t.offset):
        if t.nbytes == 0:
            continue
        if t.nbytes > chunk:
            cur = None
            per = max(1, chunk // t.rb)
            for r0 in range(0, t.rows, per):
                n = min(per, t.rows - r0)
                pieces.append(Piece(t.offset + r0 * t.rb, n * t.rb, [(t, r0, n, 0)]))
            continue
        end = None if cur is None else cur.offset + cur.nbytes
        if cur is None or t.offset < end or t.offset - end > gap or t.offset + t.nbytes - cur.offset > chunk:
            cur = Piece(t.offset, 0)
            pieces.append(cur)
        cur.parts.append((t, 0, t.rows, t.offset - cur.offset))
        cur.nbytes = t.offset + t.nbytes - cur.offset
    return pieces


def _stride(rb: int, ggml_type: int) -> int:
    """The repacked row bytes of a raw row of rb bytes."""
    qk, bb = block_size(ggml_type)
    return repacked_stride(ggml_type, rb // bb * qk)


def device_matrix(rows: int, rb: int, ggml_type: int, stream=0):
    """An empty device uint8 [rows, stride] for `rows` raw rows of rb bytes, its row padding
    (stride > rb) zeroed as the host repack leaves it."""
    stride = _stride(rb, ggml_type)
    out = cuda.device_array((rows, stride), np.uint8)
    if stride > rb and rows:
        zero_fill(out, stream or None)
    return out


def mapped_matrix(rows: int, rb: int, ggml_type: int, stream=0):
    """device_matrix's twin in page-locked host memory mapped into the device (the expert kernels'
    host tier: they read it in place over PCIe). Its row padding is zeroed on the host."""
    stride = _stride(rb, ggml_type)
    host = cuda.mapped_array((rows, stride), np.uint8)
    if stride > rb and rows:
        np.asarray(host)[:] = 0
    if SIM:
        return host
    from numba.cuda.cudadrv.devicearray import DeviceNDArray

    # a device array over the mapping (numba's mapped array slices as a numpy array, which a
    # kernel would copy): it holds the allocation, and slices and reshapes stay device views
    return DeviceNDArray((rows, stride), (stride, 1), np.uint8, gpu_data=host.gpu_data)


last_timing = None  # the last run's Timing (benchmarks/gpu_load.py)


@dataclass
class Timing:
    """Where a load's time went (seconds of the loading thread; bytes read)."""
    bytes: int = 0
    pieces: int = 0
    wait_read: float = 0.0  # waiting for the readers
    wait_copy: float = 0.0  # waiting for a host buffer's copy to run
    total: float = 0.0


class Uploader:
    """Loads targets of one GGUF file onto the device, repacking on `stream` (the backend's)."""

    def __init__(self, gguf, stream, chunk: int | None = None, buffers: int | None = None,
                 readers: int | None = None):
        self.gguf = gguf  # what it reads: read_into(offset, out, what) (GGUFFile)
        self.stream = stream
        self.chunk = chunk or CHUNK  # module defaults read now: tests and benchmarks may set them
        self.buffers = max(2, buffers or BUFFERS)
        self.readers = max(1, readers or READERS)
        self.timing = Timing()

    def run(self, targets: list[Target], on_bytes=None) -> Timing:
        """Place every target's rows, repacked, in its dst; on_bytes(done, total) after each piece.
        Returns when everything is on the device (the stream synchronized)."""
        pieces = plan(targets, self.chunk)
        total = sum(p.nbytes for p in pieces)
        t = self.timing = Timing(pieces=len(pieces))
        if not pieces:
            return t
        t0 = time.perf_counter()
        size = max(p.nbytes for p in pieces)
        n = min(self.buffers, len(pieces))
        host = [pinned_empty(size, np.uint8) for _ in range(n)]
        m = min(STAGING, n)
        staging = [cuda.device_array(size, np.uint8) for _ in range(m)]
        xfer = Transfers(self.stream)  # its fetch stream copies, self.stream repacks
        copied = [Event() for _ in range(n)]
        repacked = [Event() for _ in range(m)]
        used = [False] * n  # whether host buffer s has been copied from (copied[s] recorded)
        staged = [False] * m  # whether staging buffer d has been repacked from (repacked[d] recorded)
        pool = ThreadPoolExecutor(self.readers, thread_name_prefix="moed-load")
        reads: deque = deque()
        try:
            def start(k: int) -> None:
                s = k % n
                if used[s]:  # the buffer's last copy must have read it
                    w = time.perf_counter()
                    xfer.synchronize(copied[s])
                    t.wait_copy += time.perf_counter() - w
                p = pieces[k]
                reads.append(pool.submit(self.gguf.read_into, p.offset, host[s][:p.nbytes],
                                         f"tensor {p.parts[0][0].name!r}"))

            for k in range(n):
                start(k)
            done = 0
            for k, p in enumerate(pieces):
                s = k % n
                w = time.perf_counter()
                reads.popleft().result()
                t.wait_read += time.perf_counter() - w
                if REPACK_ON_DEVICE:
                    d = k % m
                    if staged[d]:  # staging d is free once its last repack ran
                        xfer.wait(xfer.fetch, repacked[d])
                    xfer.h2d(staging[d], host[s][:p.nbytes])
                    xfer.record(copied[s], xfer.fetch)
                    xfer.wait(self.stream, copied[s])
                    for tgt, r0, rows, at in p.parts:
                        raw = staging[d][at:at + rows * tgt.rb].reshape(rows, tgt.rb)  # [rows, RB]
                        repack_device(raw, tgt.dst[r0:r0 + rows], tgt.ggml_type, self.stream)
                    xfer.record(repacked[d], self.stream)
                    used[s] = staged[d] = True
                else:  # the simulator: repack on the host, copy each part
                    for tgt, r0, rows, at in p.parts:
                        raw = host[s][at:at + rows * tgt.rb].reshape(rows, tgt.rb)  # [rows, RB]
                        tgt.dst[r0:r0 + rows].copy_to_device(repack(raw, tgt.ggml_type), stream=self.stream)
                    self.stream.synchronize()  # before its buffer is read again
                done += p.nbytes
                if on_bytes is not None:
                    on_bytes(done, total)
                if k + n < len(pieces):
                    start(k + n)
            self.stream.synchronize()
        finally:
            for f in reads:  # a failure: no reader may still write a buffer about to be freed
                f.cancel()
            pool.shutdown(wait=True)
            if not SIM:
                self.stream.synchronize()  # nor a copy still read one
                xfer.fetch.synchronize()
        t.bytes = total
        t.total = time.perf_counter() - t0
        global last_timing
        last_timing = t
        return t
