"""The daemon's memory over load/unload and Generate(keep_alive=0) cycles (issue 25, item 1).

    python benchmarks/leak.py [MODEL.gguf] [--cycles 200] [--generate 50] [--device cpu|cuda]
                              [--every 10] [--json PATH] [--set KEY=VALUE ...]

Starts the daemon (`moed serve` on a private socket, in a child process: this script's --serve
mode, which is the daemon's own serve plus a thread that answers probes on a pipe), then, on one
client connection (ipc.Client):
  load      --cycles times Load(MODEL, keep_alive=0) then Unload (not_found is fine: keep_alive=0
            may have unloaded it already), waiting until Ps lists nothing;
  generate  --generate times Generate(MODEL, 4 tokens, keep_alive=0), then the same wait.
After each cycle (once the daemon's compute threads have ended) it reads, in the daemon: RSS; the objects its collector tracks (frozen included,
after a collection of the young generations only: a full one would free what leaked); page-locked
host bytes alive (daemon.backend.cuda_transfer.pinned_bytes); threads; open descriptors; and, with
--device cuda, the device's free memory (cuMemGetInfo, numba's get_memory_info). Prints every
--every-th cycle and, per phase, each measure's least-squares slope over the last 100 cycles (all
of them when fewer). --device sets MOE_DEVICE for the daemon; --set KEY=VALUE adds Load settings
(e.g. --set gpu_cache_mb=64). Without MODEL, the qwen3moe Q8_0 test fixture is built in a
temporary folder. glibc's malloc keeps freed memory in each thread's arena, so single RSS
readings move by a few MB; the slope is the figure.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

MEASURES = ("rss_bytes", "gc_objects", "pinned_bytes", "threads", "fds", "vram_free_bytes")


# -- the daemon side -----------------------------------------------------------------------------

def probe(cuda: bool) -> dict:
    """The daemon process's measures, taken on the probe thread."""
    import gc

    deadline = time.monotonic() + 60  # Ps drops a model before its compute thread has closed it
    while any(t.name.startswith("moed-compute") for t in threading.enumerate()) and time.monotonic() < deadline:
        time.sleep(0.005)
    with open("/proc/self/statm") as f:
        rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    gc.collect(1)
    transfer = sys.modules.get("daemon.backend.cuda_transfer")
    out = {"rss_bytes": rss, "gc_objects": len(gc.get_objects()) + gc.get_freeze_count(),
           "pinned_bytes": transfer.pinned_bytes() if transfer is not None else 0,
           "threads": threading.active_count(), "fds": len(os.listdir("/proc/self/fd"))}
    if cuda and os.environ.get("NUMBA_ENABLE_CUDASIM") != "1":  # the simulator has no device memory
        from numba import cuda as nc

        out["vram_free_bytes"] = int(nc.current_context().get_memory_info()[0])
    return out


def serve(sock: str, cuda: bool) -> int:
    """`moed serve --socket sock`, answering a JSON line of probe() for every line on stdin."""
    from daemon.cli import main

    answers = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # whatever the daemon prints goes to its log, not into the answers

    def answer():
        for _line in sys.stdin:
            try:
                row = probe(cuda)
            except Exception as e:  # noqa: BLE001 - the client reports it, rather than wait forever
                row = {"error": f"{type(e).__name__}: {e}"}
            answers.write(json.dumps(row) + "\n")
        os.kill(os.getpid(), signal.SIGTERM)  # stdin closed: the benchmark is gone, stop the daemon
    threading.Thread(target=answer, name="leak-probe", daemon=True).start()
    return main(["serve", "--socket", sock])


# -- the client side -----------------------------------------------------------------------------

class Daemon:
    def __init__(self, sock: str, device: str):
        env = {**os.environ, "MOE_DEVICE": device,
               "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
        self.proc = subprocess.Popen([sys.executable, __file__, "--serve", sock, "--device", device],
                                     env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                     stderr=subprocess.DEVNULL)

    def probe(self) -> dict:
        self.proc.stdin.write("probe\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise SystemExit("the daemon exited")
        row = json.loads(line)
        if "error" in row:
            raise SystemExit(f"the daemon's probe failed: {row['error']}")
        return row

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def connect(sock: str, proc: subprocess.Popen):
    from ipc import Client, NotRunning

    deadline = time.monotonic() + 120
    while True:
        try:
            c = Client(sock, timeout=600)
            c.connect()
            return c
        except NotRunning:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit("the daemon did not start") from None
            time.sleep(0.05)


def wait_unloaded(client) -> None:
    deadline = time.monotonic() + 120
    while client.ps():
        if time.monotonic() > deadline:
            raise SystemExit("the model is still listed 120 s after its unload")
        time.sleep(0.005)


def slope(ys: list[float]) -> float:
    ys = ys[-100:]
    return float(np.polyfit(np.arange(len(ys)), np.asarray(ys, np.float64), 1)[0]) if len(ys) > 1 else 0.0


def run_phase(name: str, n: int, cycle, daemon: Daemon, every: int) -> dict:
    rows = []
    t0 = time.perf_counter()
    for i in range(n):
        t = time.perf_counter()
        cycle()
        row = daemon.probe() | {"cycle_s": time.perf_counter() - t}
        rows.append(row)
        if i % every == 0 or i == n - 1:
            vram = f"  vram free {row['vram_free_bytes'] / 2**20:9.1f} MiB" if "vram_free_bytes" in row else ""
            print(f"{name} {i + 1:4d}: rss {row['rss_bytes'] / 2**20:8.1f} MiB  gc objects {row['gc_objects']:8d}"
                  f"  pinned {row['pinned_bytes'] / 2**20:7.1f} MiB  threads {row['threads']:3d}  fds {row['fds']:4d}"
                  f"{vram}  ({row['cycle_s']:.2f} s)", flush=True)
    seconds = time.perf_counter() - t0
    slopes = {k: slope([r[k] for r in rows]) for k in MEASURES if rows and k in rows[0]}
    tail = min(n, 100)
    if rows:
        print(f"{name}: {n} cycles in {seconds:.1f} s; slope over the last {tail}: "
              f"rss {slopes['rss_bytes'] / 1e3:+.1f} KB/cycle, gc objects {slopes['gc_objects']:+.2f}/cycle, "
              f"pinned {slopes['pinned_bytes'] / 1e3:+.1f} KB/cycle, threads {slopes['threads']:+.3f}/cycle, "
              f"fds {slopes['fds']:+.3f}/cycle"
              + (f", vram free {slopes['vram_free_bytes'] / 1e3:+.1f} KB/cycle" if "vram_free_bytes" in slopes else ""),
              flush=True)
    return {"cycles": n, "seconds": seconds, "rows": rows, "slopes_last_100": slopes}


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", nargs="?", help="a GGUF model (default: the qwen3moe Q8_0 test fixture)")
    ap.add_argument("--cycles", type=int, default=200, help="Load(keep_alive=0) + Unload cycles")
    ap.add_argument("--generate", type=int, default=50, help="Generate(keep_alive=0) cycles after them")
    ap.add_argument("--device", default="cpu", help="MOE_DEVICE for the daemon: cpu, cuda, cuda:N")
    ap.add_argument("--every", type=int, default=10, help="print every k-th cycle")
    ap.add_argument("--json", metavar="PATH", help="write every reading and the slopes here")
    ap.add_argument("--set", action="append", default=[], type=lambda kv: tuple(kv.split("=", 1)),
                    help="a Load setting, e.g. --set gpu_cache_mb=64")
    ap.add_argument("--serve", metavar="SOCKET", help=argparse.SUPPRESS)  # the daemon child
    args = ap.parse_args(argv)
    cuda = args.device.startswith("cuda")
    if args.serve:
        return serve(args.serve, cuda)
    from ipc import ModelError

    with tempfile.TemporaryDirectory(prefix="moed-leak-") as tmp:
        model = args.model
        if model is None:
            from tests.fixtures.build import fixture_path

            model = str(fixture_path("qwen3moe", "Q8_0", tmp))
        model = os.path.realpath(model)
        sock = os.path.join(tmp, "d.sock")
        daemon = Daemon(sock, args.device)
        try:
            client = connect(sock, daemon.proc)
            settings = dict(args.set)
            start = daemon.probe()
            print(f"daemon pid {daemon.proc.pid}, model {model}, device {args.device}; at start: "
                  f"rss {start['rss_bytes'] / 2**20:.1f} MiB, gc objects {start['gc_objects']}", flush=True)

            def load_cycle():
                client.load(model, keep_alive=0, **settings)
                try:
                    client.unload(model)
                except ModelError:  # keep_alive=0: unloaded already
                    pass
                wait_unloaded(client)

            def generate_cycle():
                for _ in client.generate([1, 2, 3], model=model, max_tokens=4, keep_alive=0,
                                         options={"temperature": 0}):
                    pass
                wait_unloaded(client)

            out = {"model": model, "device": args.device, "settings": settings, "start": start,
                   "load": run_phase("load", args.cycles, load_cycle, daemon, args.every),
                   "generate": run_phase("generate", args.generate, generate_cycle, daemon, args.every)}
            client.close()
        finally:
            daemon.stop()
    if args.json:
        Path(args.json).write_text(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
