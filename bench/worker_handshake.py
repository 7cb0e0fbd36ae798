"""What the worker handshake costs per connection (issue 24): a gateway opens one connection per request,
so the time from dialling to the first answer is paid once per sentence.

Starts `voxgate worker --backend synthetic` three ways (a Unix socket without a token: no handshake; a Unix
socket with a token: a one-way hello, no round trip; loopback TCP with a token: the mutual handshake, one
round trip) and times N connections each: dial, handshake where there
is a token, an `info` request and its answer, close, one after another.

    python bench/worker_handshake.py --connections 2000 [--json bench/results/worker_handshake_cpu.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tts_backend.remote import framing  # noqa: E402
from tts_backend.remote.connection import Dialer, WorkerAddress  # noqa: E402


def start_worker(listen: str, token_file: str | None) -> tuple[subprocess.Popen, str]:
    args = [sys.executable, "-m", "tts_backend.remote.worker", "--backend", "synthetic", "--listen", listen,
            "--log-level", "warning"]
    if token_file:
        args += ["--token-file", token_file]
    proc = subprocess.Popen(args, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    for line in proc.stdout:
        if line.startswith("voxgate worker ready:"):
            return proc, line.split("listen=", 1)[1].split()[0]
    raise RuntimeError("the worker did not start")


async def time_connections(dialer: Dialer, address: str, count: int) -> list[float]:
    target = WorkerAddress.parse(address)
    times = []
    for _ in range(count):
        started = time.perf_counter()
        reader, writer = await dialer.open(target)
        writer.write(framing.encode_json({"op": "info"}))
        frame = await framing.read_frame(reader, framing.MAX_ANSWER_FRAME)
        assert frame is not None and framing.decode_json(frame[1])["op"] == "info"
        writer.close()
        times.append(time.perf_counter() - started)
    return times


def summary(times: list[float]) -> dict:
    ordered = sorted(times)
    return {"p50_us": round(statistics.median(ordered) * 1e6, 1),
            "p95_us": round(ordered[int(len(ordered) * 0.95)] * 1e6, 1),
            "mean_us": round(statistics.fmean(ordered) * 1e6, 1)}


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--connections", type=int, default=2000)
    parser.add_argument("--json", help="write the results here too")
    args = parser.parse_args()
    folder = tempfile.mkdtemp(prefix="voxgate-bench-")
    token_file = os.path.join(folder, "worker.token")
    Path(token_file).write_text(os.urandom(16).hex() + "\n")
    token = Path(token_file).read_text().strip()
    cases = [("unix, no token (no handshake)", f"unix:{folder}/a.sock", None),
             ("unix, token (one-way hello: the kernel vouches for the peer)", f"unix:{folder}/b.sock", token_file),
             ("tcp loopback, token (handshake: one round trip)", "tcp://127.0.0.1:0", token_file)]
    results = {}
    load_before = os.getloadavg()[0]
    try:
        for name, listen, tokens in cases:
            proc, address = start_worker(listen, tokens)
            try:
                dialer = Dialer(token=token if tokens else None)
                await time_connections(dialer, address, 100)  # warm-up
                results[name] = summary(await time_connections(dialer, address, args.connections))
            finally:
                proc.terminate()
                proc.wait(30)
    finally:
        Path(token_file).unlink(missing_ok=True)
    report = {"connections": args.connections, "machine": f"{platform.machine()}, {os.cpu_count()} CPUs "
              f"({platform.processor() or 'unknown CPU'}), Python {platform.python_version()}",
              "load_average_1min": [round(load_before, 2), round(os.getloadavg()[0], 2)],
              "connect_handshake_info_close": results}
    print(json.dumps(report, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    asyncio.run(main())
