"""Take README's picture of the web demo, docs/web_demo.png, as a new user sees it:

    python docs/web_demo_screenshot.py            # writes docs/web_demo.png
    python docs/web_demo_screenshot.py --output /tmp/page.png

The default gateway (Piper on the CPU, as `voxgate serve` starts it) on a loopback port, the page in
headless Chromium (docs/web_demo_screenshot.mjs; `cd clients/js && npm ci` and /usr/bin/chromium, as the
browser tests need). A picture is only as true as the moment it was taken: on a busy machine a sentence's
audio comes late and the page shows the silence. So the picture is kept only if the listener heard none
(no underrun, no gap between sentences, the page's own counters); otherwise the script tries again, up to
--attempts times, and fails saying what it saw. Run it when the machine is idle.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.gateway_server import running_gateway  # noqa: E402

PICTURE = ROOT / "docs" / "web_demo.png"
BROWSER_SCRIPT = ROOT / "docs" / "web_demo_screenshot.mjs"


def take(url: str, png: Path) -> dict:
    completed = subprocess.run(["node", str(BROWSER_SCRIPT), url, str(png)], capture_output=True, text=True,
                               timeout=180, cwd=ROOT / "clients" / "js")
    if completed.returncode != 0:
        raise SystemExit(f"the browser script failed:\n{completed.stdout[-2000:]}\n{completed.stderr[-2000:]}")
    return json.loads(completed.stdout)


def silences(report: dict) -> list[str]:
    """What a listener heard as a break, by the page's counters: empty for a picture worth keeping."""
    player = report["player"]
    found = []
    if player["underruns"]:
        found.append(f"{player['underruns']} underruns inside sentences")
    if player["gaps"]:
        found.append(f"{player['gaps']} gaps between sentences, {player['gapFrames'] / player['contextRate']:.2f} s in all")
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", type=Path, default=PICTURE, help="where to write the PNG (default: %(default)s)")
    parser.add_argument("--attempts", type=int, default=3, help="tries before giving up on a busy machine")
    parser.add_argument("--accept-busy", action="store_true",
                        help="keep the picture whatever the listener heard (for testing this script)")
    args = parser.parse_args()
    # The browser closes while the page's later sentences still stream: asyncio warns once per frame sent to
    # the gone socket, which says nothing about the picture.
    logging.getLogger("asyncio").setLevel(logging.ERROR)
    load = os.getloadavg()[0]
    print(f"load average {load:.1f} on {os.cpu_count()} cores")
    with running_gateway("piper") as server, tempfile.TemporaryDirectory() as folder:
        for attempt in range(1, args.attempts + 1):
            png = Path(folder) / f"attempt-{attempt}.png"
            report = take(server.url, png)
            heard = silences(report)
            timing = ", ".join(f"S{s['number']} " + ("waits" if s["playAt"] is None else f"plays at {s['playAt']:.0f} ms")
                               for s in report["sentences"])
            print(f"attempt {attempt}: {timing}; " + ("; ".join(heard) or "no silence heard"))
            if report["pageErrors"]:
                raise SystemExit(f"the page failed: {report['pageErrors']}")
            if not heard or args.accept_busy:
                shutil.copyfile(png, args.output)
                print(f"wrote {args.output}")
                return 0
    print("every attempt had silences a listener would hear: the machine is busy; try again when it is idle",
          file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
