"""The CPU thread governor (daemon/backend/cpu_threads.py): every core while the rest of the machine
is idle, the cores others leave idle while they are busy; and the step's thread count changes no bit
of the logits, so the governor may change it between steps."""

import os

import numba
import numpy as np
import pytest

from daemon.backend import CPUBackend
from daemon.backend.cpu_threads import ThreadGovernor, machine_busy_s
from daemon.model.transformer import Transformer
from daemon.storage.gguf import GGUFFile
from tests.fixtures.build import fixture_path

from .test_cuda_model import KQUANT


class Machine:
    """Fake clocks: the machine's busy CPU seconds and this process's, advanced by hand."""

    def __init__(self):
        self.wall = self.busy = self.own = 0.0

    def run(self, seconds: float, others: float, ours: float):
        self.wall += seconds
        self.busy += seconds * (others + ours)
        self.own += seconds * ours


def governor(m: Machine, most=8, cores=8):
    return ThreadGovernor(most, cores=cores, interval_s=0.25, busy=lambda: m.busy, own=lambda: m.own,
                          clock=lambda: m.wall)


def test_an_idle_machine_gets_every_thread_and_a_busy_one_the_idle_cores():
    m = Machine()
    g = governor(m)
    assert g.threads() == 8  # the first look has nothing to compare with
    m.run(1.0, others=0.1, ours=8)  # our own 8 busy threads are not a competitor
    assert g.threads() == 8
    m.run(1.0, others=3.0, ours=5)
    assert g.threads() == 5
    m.run(0.1, others=8.0, ours=0)  # within the interval: not looked at again
    assert g.threads() == 5
    m.run(1.0, others=7.8, ours=0.2)
    assert g.threads() == 1  # at least one
    m.run(1.0, others=0.0, ours=1)
    assert g.threads() == 8  # back to all once the others stop


def test_an_explicit_ceiling_and_no_proc_stat():
    m = Machine()
    g = governor(m, most=4, cores=16)
    g.threads()
    m.run(1.0, others=2.0, ours=4)
    assert g.threads() == 4  # 14 cores idle, but 4 asked for
    blind = ThreadGovernor(6, cores=8, busy=lambda: None)
    assert blind.threads() == 6 and blind.threads() == 6


def test_the_machine_counter_counts_only_the_cpus_asked_for():
    busy = machine_busy_s()
    if busy is None:
        pytest.skip("no /proc/stat here")
    mine = sorted(os.sched_getaffinity(0))
    assert busy > 0 and machine_busy_s(set()) == 0
    assert 0 <= machine_busy_s({mine[0]}) <= machine_busy_s()


@pytest.mark.parametrize("arch,wtype,over", [("qwen3moe", "Q8_0", {}), ("llama-moe", "Q4_K", KQUANT)])
def test_logits_do_not_depend_on_the_thread_count(arch, wtype, over, fixture_dir):
    if numba.config.NUMBA_NUM_THREADS < 2:
        pytest.skip("one numba thread: nothing to compare")
    path = fixture_path(arch, wtype, fixture_dir, **over)
    runs = []
    before = numba.get_num_threads()
    try:
        for n in (1, 2):
            numba.set_num_threads(n)
            with GGUFFile(path) as g:
                model = Transformer(g, backend=CPUBackend())
                cache = model.new_cache(64)
                out = [model.forward(np.arange(1, 25) % model.hp.n_vocab, cache)]
                for t in range(3):
                    out.append(model.forward([int(np.argmax(out[-1][-1]))], cache))
                runs.append(out)
    finally:
        numba.set_num_threads(before)
    for a, b in zip(*runs):
        np.testing.assert_array_equal(a, b)


def test_a_compile_of_the_decode_step_takes_a_core_from_the_governed_count(monkeypatch):
    """The step's compile runs on a thread of this process, which the governor counts as ours: the
    backend leaves it a core, or the per-op path's spinning threads would stall beside it."""
    from daemon.backend import cpu_step

    if numba.config.NUMBA_NUM_THREADS < 2:
        pytest.skip("one numba thread: nothing to take")
    m = Machine()
    backend = CPUBackend()
    backend.governor = governor(m, most=numba.config.NUMBA_NUM_THREADS, cores=numba.config.NUMBA_NUM_THREADS)
    before = numba.get_num_threads()
    try:
        backend._set_threads()
        assert numba.get_num_threads() == numba.config.NUMBA_NUM_THREADS
        monkeypatch.setattr(cpu_step, "compiling", lambda: True)
        backend._set_threads()
        assert numba.get_num_threads() == numba.config.NUMBA_NUM_THREADS - 1
        monkeypatch.setattr(cpu_step, "compiling", lambda: False)
        backend._set_threads()
        assert numba.get_num_threads() == numba.config.NUMBA_NUM_THREADS
    finally:
        numba.set_num_threads(before)


def test_a_compile_of_the_decode_step_lowers_a_count_set_by_hand_and_gives_it_back(monkeypatch):
    from daemon.backend import cpu_step

    cores = len(os.sched_getaffinity(0))
    if min(cores, numba.config.NUMBA_NUM_THREADS) < 2:
        pytest.skip("one core or one numba thread: nothing to take")
    backend = CPUBackend()
    backend.threads = min(cores, numba.config.NUMBA_NUM_THREADS)
    before = numba.get_num_threads()
    try:
        monkeypatch.setattr(cpu_step, "compiling", lambda: True)
        backend._set_threads()
        assert numba.get_num_threads() == min(backend.threads, cores - 1)
        monkeypatch.setattr(cpu_step, "compiling", lambda: False)
        backend._set_threads()
        assert numba.get_num_threads() == backend.threads
    finally:
        numba.set_num_threads(before)


def test_a_count_set_at_load_holds_on_the_thread_that_runs_the_steps(fixture_dir):
    """numba's count is per thread, and the daemon loads on one thread and computes on another:
    MOE_N_THREADS must reach the compute thread."""
    import threading

    from daemon import Engine

    if numba.config.NUMBA_NUM_THREADS < 2:
        pytest.skip("one numba thread: nothing to compare")
    seen = []
    with Engine.load(fixture_path("qwen3moe", "Q8_0", fixture_dir), n_threads=1, device="cpu") as engine:
        def compute():
            engine.model.forward([1, 2], engine.model.new_cache(8))
            seen.append(numba.get_num_threads())

        t = threading.Thread(target=compute)
        t.start()
        t.join()
    assert seen == [1]
