"""Time to first audio that each framework adapter adds over the raw WebSocket client (issue 8).

    python bench/adapter_ttfa.py [--backend synthetic|piper] [--runs 20]

Serves a gateway on loopback (the synthetic backend by default: deterministic tones, made instantly, so
the numbers are client overhead alone; `piper` for the real CPU voice), then in each framework's venv
(tests/adapter_env.py) runs bench/adapter_ttfa_worker.py, which times the same text through a plain
`websockets` connection, through voxgate_client, and through the adapter, interleaved, on warm
persistent connections. Writes medians and every sample to bench/results/adapter_ttfa_<backend>.json.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.adapter_env import FRAMEWORKS, adapter_python, prepare_all  # noqa: E402
from tests.gateway_server import running_gateway  # noqa: E402

TEXT = "Sure, I can help with that. Your order shipped this morning and should arrive on Thursday."
VOICES = {"synthetic": "tone-mid", "piper": None}


def run_worker(framework: str, url: str, runs: int, voice: str) -> dict[str, list[float]]:
    result = subprocess.run(
        [str(adapter_python(framework)), str(ROOT / "bench" / "adapter_ttfa_worker.py"), framework, url, str(runs),
         TEXT, voice],
        capture_output=True, text=True, timeout=600,
    )
    line = next((line for line in result.stdout.splitlines() if line.startswith("RESULTS ")), None)
    if result.returncode != 0 or line is None:
        raise RuntimeError(f"{framework} worker failed:\n{result.stdout[-2000:]}\n{result.stderr[-4000:]}")
    return json.loads(line[len("RESULTS "):])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", choices=sorted(VOICES), default="synthetic")
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    prepare_all()
    report: dict = {
        "command": "python bench/adapter_ttfa.py " + " ".join(sys.argv[1:]),
        "backend": args.backend,
        "runs": args.runs,
        "text": TEXT,
        "host": {"machine": platform.machine(), "python": platform.python_version(), "cpus": __import__("os").cpu_count()},
        "frameworks": {name: fw.requirements[0] for name, fw in FRAMEWORKS.items()},
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "results": {},
    }
    with running_gateway(args.backend) as server:
        voice = VOICES[args.backend] or server.gateway.backend.voices()[0].id
        report["voice"] = voice
        url = server.url.replace("http://", "ws://")
        for framework in FRAMEWORKS:
            samples = run_worker(framework, url, args.runs, voice)
            medians = {name: statistics.median(values) * 1000 for name, values in samples.items()}
            quartiles = {name: [round(q * 1000, 3) for q in statistics.quantiles(values, n=4)]
                         for name, values in samples.items()}
            report["results"][framework] = {
                "median_ms": medians,
                "quartiles_ms": quartiles,
                "adapter_overhead_ms": {
                    "over_raw_websocket": medians[framework] - medians["raw_websocket"],
                    "over_voxgate_client": medians[framework] - medians["voxgate_client"],
                },
                "samples_ms": {name: [round(v * 1000, 3) for v in values] for name, values in samples.items()},
            }
            print(f"{framework}: " + ", ".join(f"{k} {v:.2f} ms" for k, v in medians.items()))
    out = args.out or ROOT / "bench" / "results" / f"adapter_ttfa_{args.backend}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
