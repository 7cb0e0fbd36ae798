"""A cloning gateway in a process of its own, for the tests whose attack could take the process down
(a decoder crash) or whose measure is the process's own (RSS, event-loop stalls).

    python -m tests.cloning_server PORT '{"api_keys": ["k"], "sessions_per_minute": 5}'

serves the gateway with `GatewaySettings(**settings)` and the test backend of tests/cloning_fixtures.py
(which really clones) on 127.0.0.1:PORT the way `voxgate serve` does (gateway.cli.serve: its listening
socket, its uvicorn options, its drain).
`cloning_gateway_process(**settings)` starts one and waits until it is ready.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator

from tests.gateway_server import free_port
from tests.resume_fixtures import GatewayProcess, wait_ready


@contextlib.contextmanager
def cloning_gateway_process(**settings) -> Iterator[GatewayProcess]:
    port = free_port()
    log = tempfile.NamedTemporaryFile(prefix=f"voxgate-clone-{port}-", suffix=".log", delete=False)
    command = [sys.executable, "-m", "tests.cloning_server", str(port), json.dumps(settings)]
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                               env={**os.environ, "PYTHONUNBUFFERED": "1"})
    gateway = GatewayProcess(port, process, log.name)
    try:
        wait_ready(gateway)
        yield gateway
    finally:
        if process.poll() is None:
            gateway.kill()
        with contextlib.suppress(OSError):
            os.unlink(gateway.log_path)


def main() -> None:
    from gateway.cli import serve
    from gateway.settings import GatewaySettings
    from tests.cloning_fixtures import PitchCloneSynthesizer

    port, overrides = int(sys.argv[1]), json.loads(sys.argv[2])
    settings = GatewaySettings(host="127.0.0.1", port=port, backend="pitch-clone-test", log_level="warning",
                               **overrides)
    serve(settings, PitchCloneSynthesizer())


if __name__ == "__main__":
    main()
