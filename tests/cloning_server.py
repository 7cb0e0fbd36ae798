"""A cloning gateway in a process of its own, for the tests whose attack could take the process down
(a decoder crash) or whose measure is the process's own (RSS, event-loop stalls).

    python -m tests.cloning_server '{"api_keys": ["k"], "sessions_per_minute": 5}'

serves the gateway with `GatewaySettings(**settings)` and the test backend of tests/cloning_fixtures.py
(which really clones) on a free loopback port, named in its startup line, the way `voxgate serve` does
(gateway.cli.serve: its listening socket, its uvicorn options, its drain).
`cloning_gateway_process(**settings)` starts one and waits until it is ready.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from collections.abc import Iterator

from tests.resume_fixtures import GatewayProcess, start_process, wait_ready


@contextlib.contextmanager
def cloning_gateway_process(**settings) -> Iterator[GatewayProcess]:
    gateway = start_process([sys.executable, "-m", "tests.cloning_server", json.dumps(settings)])
    try:
        wait_ready(gateway)
        yield gateway
    finally:
        if gateway.process.poll() is None:
            gateway.kill()
        with contextlib.suppress(OSError):
            os.unlink(gateway.log_path)


def main() -> None:
    from gateway.cli import serve
    from gateway.settings import GatewaySettings
    from tests.cloning_fixtures import PitchCloneSynthesizer

    overrides = json.loads(sys.argv[1])
    # Port 0: the process binds a free port and names it in its startup line (an info line).
    settings = GatewaySettings(host="127.0.0.1", port=0, backend="pitch-clone-test", log_level="info", **overrides)
    serve(settings, PitchCloneSynthesizer())


if __name__ == "__main__":
    main()
