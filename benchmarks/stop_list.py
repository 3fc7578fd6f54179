"""A hostile stop list beside another stream: that stream's latency (issue 25, item 2).

    python benchmarks/stop_list.py [--tokens 30] [--repeat 3] [--model M.gguf]

Starts a daemon (`moed serve` as a subprocess on a temporary socket) with a tiny fixture
(qwen3moe Q8_0 from tests/fixtures, built on first use) and measures a victim's greedy generation
of --tokens tokens, from sending its Generate to its Done, median of --repeat rounds (each round
runs every case, so that the cases share the machine's load alike):
  - alone;
  - while another greedy Generate decodes beside it on the same model, with each of these stop
    lists (none: the control; the victim then shares each decode step with one more sequence):
      none             []
      largest allowed  64 strings of 64 bytes (4 KiB, the protocol's bounds), multi-byte included
      the probe's      ['☃%07d' % k for k in range(10**6)], an 11 MB frame
The other request goes out as a raw frame (a client library would refuse the list itself). When
the daemon refuses it, the reply's code and how long it took are printed; one it serves runs
until the victim is done, then is cancelled. Also the matcher alone, for the largest allowed list:
µs to build it (once per request) and per StopMatcher.feed of a token's text. Prints measurements
only; for the figures before the bounds, run the same script in a checkout of that commit.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from _bench.daemon import start_daemon  # noqa: E402  (benchmarks/ is sys.path[0] for a script)

PROMPT = [1, 17, 42, 99, 7, 3, 250, 12]  # token ids (the fixture has no chat template to apply)


def largest_allowed() -> list[str]:
    stop = [("☃%02d" % k).ljust(62, "x") for k in range(64)]  # ☃ is 3 bytes: 64 bytes each
    assert len(stop) == 64 and sum(len(s.encode()) for s in stop) == 4096
    return stop


def probes() -> list[str]:
    return ["☃%07d" % k for k in range(10**6)]


async def victim(sock: str, model: str, tokens: int) -> float:
    """Seconds from sending a greedy Generate of `tokens` tokens to its Done."""
    from ipc import AsyncClient

    async with AsyncClient(sock, timeout=600) as c:
        t0 = time.perf_counter()
        gen = c.generate(PROMPT, model=model, max_tokens=tokens, options={"temperature": 0})
        async for _ in gen:
            pass
        assert gen.done.eval_count == tokens, gen.done
        return time.perf_counter() - t0


async def beside(sock: str, model: str, stop: list[str], tokens: int) -> float | tuple[str, float]:
    """Send a Generate with `stop` as a raw frame; while it decodes, the victim's seconds. If the
    daemon refuses it: (the reply's code and message, ms it took)."""
    import msgspec

    from ipc.framing import pack_frame, read_frame
    from ipc.protocol import PROTOCOL_VERSION, Cancel, Chunk, Done, Error, Hello, Progress, decode_reply, encode

    reader, writer = await asyncio.open_unix_connection(sock, limit=2**20)
    writer.write(pack_frame(encode(Hello(1, PROTOCOL_VERSION))))
    await read_frame(reader)
    # id, model, prompt, tokens, max_tokens, options, stop (greedy: the fixture then emits no EOS)
    body = msgspec.msgpack.encode(["G", 2, model, None, PROMPT, 3000, {"temperature": 0.0}, stop])
    t0 = time.perf_counter()
    writer.write(pack_frame(body))
    await writer.drain()
    try:
        while isinstance(reply := decode_reply(await read_frame(reader)), Progress):
            pass
        if isinstance(reply, Error):
            return f"{reply.code} ({reply.message[:60]})", (time.perf_counter() - t0) * 1e3
        assert isinstance(reply, Chunk), reply
        lat = await victim(sock, model, tokens)
        writer.write(pack_frame(encode(Cancel(2))))
        await writer.drain()
        while not isinstance(reply, (Done, Error)):
            reply = decode_reply(await read_frame(reader))
        assert isinstance(reply, Error) and reply.code == "cancelled", f"it ended before the victim: {reply}"
        return lat
    finally:
        writer.close()


def matcher_us(stop: list[str], n: int = 2000) -> tuple[float, float]:
    """µs to build a StopMatcher (once per request), and per feed of a short token text that
    never completes a stop."""
    from daemon.sampling import StopMatcher

    t0 = time.perf_counter()
    for _ in range(20):
        m = StopMatcher(stop)
    build = (time.perf_counter() - t0) / 20 * 1e6
    pieces = [" the", " ☃0", "1x", " house", "☃", "9"]
    t0 = time.perf_counter()
    for i in range(n):
        m.feed(pieces[i % len(pieces)])
    assert not m.stopped
    return build, (time.perf_counter() - t0) / n * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="GGUF file (default: the qwen3moe Q8_0 fixture)")
    ap.add_argument("--tokens", type=int, default=30, help="the victim's tokens")
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    from tests.fixtures.build import fixture_path

    tmp = tempfile.mkdtemp(prefix="moed-stop-")
    model = args.model or str(fixture_path("qwen3moe", "Q8_0", os.path.join(tmp, "fixtures")))
    sock = os.path.join(tmp, "moed.sock")
    print(f"load average {' '.join(f'{x:.1f}' for x in os.getloadavg())} on {os.cpu_count()} cores (others' work slows every figure)")
    build, feed = matcher_us(largest_allowed())
    print(f"matcher alone, largest allowed list: built in {build:.0f} µs, {feed:.1f} µs per feed")
    proc = start_daemon(sock)
    try:
        async def run() -> None:
            from ipc import AsyncClient

            async with AsyncClient(sock, timeout=600) as c:
                await c.load(model, keep_alive=-1)
            await victim(sock, model, 4)  # kernels and first steps outside the timing
            cases = {"victim alone": None, "beside a stream with no stop list": [],
                     "beside a stream with the largest allowed list (64 x 64 B)": largest_allowed(),
                     "beside a stream with the probe's 10**6 list": probes()}
            got: dict[str, list] = {name: [] for name in cases}
            for _ in range(args.repeat):  # rounds, so that each case sees the machine's load alike
                for name, stop in cases.items():
                    got[name].append(await (victim(sock, model, args.tokens) if stop is None
                                            else beside(sock, model, stop, args.tokens)))
            print(f"load average {' '.join(f'{x:.1f}' for x in os.getloadavg())}; "
                  f"the victim's {args.tokens} tokens, send to Done, median [each round]:")
            for name, runs in got.items():
                if all(isinstance(x, float) for x in runs):
                    print(f"  {name:58s} {statistics.median(runs):7.3f} s  [{', '.join(f'{x:.3f}' for x in runs)}]")
                else:
                    why = "; ".join(sorted({r[0] for r in runs if isinstance(r, tuple)}))
                    print(f"  {name:58s} refused: {why}, in {', '.join(f'{r[1]:.0f}' for r in runs)} ms")

        asyncio.run(run())
    finally:
        proc.terminate()
        proc.wait(30)
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
